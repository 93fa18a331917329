#include "input.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>

#include "modelcache/base/text.h"
#include "modelcache/replay/replay.h"

namespace modelcache::replay {
namespace {

// Buffers: as large as the file, from 4 KiB to 1 MiB (a small file is
// opened often, by the fuzzer and the tests, and should open cheaply).
constexpr size_t kMinBuffer = size_t{4} << 10, kMaxBuffer = size_t{1} << 20;

size_t BufferFor(uint64_t file_bytes) {
  if (file_bytes == 0) return kMaxBuffer;  // not a regular file
  return static_cast<size_t>(
      std::clamp<uint64_t>(file_bytes, kMinBuffer, kMaxBuffer));
}
constexpr unsigned char kGzipMagic[] = {0x1f, 0x8b};
constexpr unsigned char kZstdMagic[] = {0x28, 0xb5, 0x2f, 0xfd};

bool StartsWith(const char* data, size_t size, const unsigned char* magic,
                size_t magic_size) {
  return size >= magic_size && std::memcmp(data, magic, magic_size) == 0;
}

}  // namespace

// Turns the file's raw bytes (InputFile::in_) into data.
class InputFile::Decoder {
 public:
  explicit Decoder(InputFile* file) : file_(file) {}
  virtual ~Decoder() = default;
  virtual size_t Read(char* out, size_t max) = 0;

 protected:
  // The raw bytes not yet decoded; Fill() reads more (false at the end).
  const char* in() const { return file_->in_.get() + file_->in_begin_; }
  size_t in_size() const { return file_->in_end_ - file_->in_begin_; }
  void Consume(size_t n) { file_->in_begin_ += n; }
  bool Fill() { return file_->Fill(); }
  bool ended() const { return file_->file_ended_ && in_size() == 0; }

 private:
  InputFile* const file_;
};

class InputFile::GzipDecoder : public InputFile::Decoder {
 public:
  explicit GzipDecoder(InputFile* file) : Decoder(file) {
    std::memset(&stream_, 0, sizeof stream_);
    // 16 + 15: gzip framing only, with the largest window.
    if (inflateInit2(&stream_, 16 + 15) != Z_OK) throw std::bad_alloc();
  }
  ~GzipDecoder() override { inflateEnd(&stream_); }

  size_t Read(char* out, size_t max) override {
    for (;;) {
      if (!in_member_) {
        // Between members: the end, or another member.
        while (in_size() < 2 && Fill()) {
        }
        if (in_size() == 0) return 0;
        if (!StartsWith(in(), in_size(), kGzipMagic, sizeof kGzipMagic)) {
          throw InputError(
              "corrupt gzip data (bytes after the last member that do not "
              "start another)");
        }
        inflateReset(&stream_);
        in_member_ = true;
      }
      if (in_size() == 0 && !Fill()) {
        throw InputError(
            "truncated gzip data (the file ends inside a gzip member)");
      }
      stream_.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in()));
      stream_.avail_in =
          static_cast<uInt>(std::min<size_t>(in_size(), 1u << 30));
      stream_.next_out = reinterpret_cast<Bytef*>(out);
      stream_.avail_out = static_cast<uInt>(std::min<size_t>(max, 1u << 30));
      const uInt offered_in = stream_.avail_in, offered_out = stream_.avail_out;
      const int status = inflate(&stream_, Z_NO_FLUSH);
      Consume(offered_in - stream_.avail_in);
      const size_t produced = offered_out - stream_.avail_out;
      switch (status) {
        case Z_STREAM_END:
          in_member_ = false;
          break;
        case Z_OK:
        case Z_BUF_ERROR:  // no progress: more input is needed
          break;
        case Z_MEM_ERROR:
          throw std::bad_alloc();
        default:  // Z_DATA_ERROR, Z_NEED_DICT, Z_STREAM_ERROR
          throw InputError(std::string("corrupt gzip data (") +
                           (stream_.msg ? stream_.msg : "inflate failed") +
                           ")");
      }
      if (produced > 0) return produced;
    }
  }

 private:
  z_stream stream_;
  bool in_member_ = false;
};

class InputFile::ZstdDecoder : public InputFile::Decoder {
 public:
  explicit ZstdDecoder(InputFile* file)
      : Decoder(file), stream_(ZSTD_createDStream()) {
    if (!stream_) throw std::bad_alloc();
  }
  ~ZstdDecoder() override { ZSTD_freeDStream(stream_); }

  size_t Read(char* out, size_t max) override {
    for (;;) {
      // At the end of the file between frames: the end of the data. (Asked
      // for more there, zstd would want the next frame's header.)
      if (in_size() == 0 && !Fill() && !frame_open_) return 0;
      ZSTD_inBuffer input{in(), in_size(), 0};
      ZSTD_outBuffer output{out, max, 0};
      const size_t status = ZSTD_decompressStream(stream_, &output, &input);
      Consume(input.pos);
      if (ZSTD_isError(status)) {
        throw InputError(std::string("corrupt zstd data (") +
                         ZSTD_getErrorName(status) + ")");
      }
      // 0: a frame ended and everything it held is out.
      frame_open_ = status != 0;
      if (output.pos > 0) return output.pos;
      if (ended()) {
        if (!frame_open_) return 0;
        throw InputError(
            "truncated zstd data (the file ends inside a zstd frame)");
      }
    }
  }

 private:
  ZSTD_DStream* const stream_;
  bool frame_open_ = false;
};

InputFile::InputFile(std::string path) : path_(std::move(path)) {
  struct stat st;
  if (::stat(path_.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    throw TraceError(path_ + ":1: is a directory, not a file");
  }
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    const int error = errno;
    throw TraceError(path_ + ":1: cannot open file: " + base::ErrnoText(error));
  }
  if (::fstat(fd_, &st) == 0 && S_ISREG(st.st_mode)) {
    file_bytes_ = static_cast<uint64_t>(st.st_size);
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  }
  in_size_ = BufferFor(file_bytes_);
  in_.reset(new char[in_size_]);
  // Enough of the file to see its magic bytes.
  try {
    while (in_end_ < sizeof kZstdMagic && Fill()) {
    }
  } catch (const InputError& e) {
    ::close(fd_);
    throw TraceError(path_ + ":1: " + e.what());
  }
  if (StartsWith(in_.get(), in_end_, kGzipMagic, sizeof kGzipMagic)) {
    compression_ = Compression::kGzip;
    decoder_ = std::make_unique<GzipDecoder>(this);
  } else if (StartsWith(in_.get(), in_end_, kZstdMagic, sizeof kZstdMagic)) {
    compression_ = Compression::kZstd;
    decoder_ = std::make_unique<ZstdDecoder>(this);
  }
}

InputFile::~InputFile() {
  decoder_.reset();
  if (fd_ >= 0) ::close(fd_);
}

bool InputFile::Fill() {
  if (file_ended_) return false;
  if (in_begin_ > 0) {
    std::memmove(in_.get(), in_.get() + in_begin_, in_end_ - in_begin_);
    in_end_ -= in_begin_;
    in_begin_ = 0;
  }
  if (in_end_ == in_size_) return true;  // full: decode some first
  for (;;) {
    const ssize_t n = ::read(fd_, in_.get() + in_end_, in_size_ - in_end_);
    if (n > 0) {
      in_end_ += static_cast<size_t>(n);
      bytes_read_ += static_cast<uint64_t>(n);
      return true;
    }
    if (n == 0) {
      file_ended_ = true;
      return false;
    }
    const int error = errno;
    if (error != EINTR) {
      throw InputError("cannot read the file (" + base::ErrnoText(error) + ")");
    }
  }
}

size_t InputFile::ReadRaw(char* out, size_t max) {
  if (in_begin_ == in_end_ && !Fill()) return 0;
  const size_t n = std::min(max, in_end_ - in_begin_);
  std::memcpy(out, in_.get() + in_begin_, n);
  in_begin_ += n;
  return n;
}

size_t InputFile::Read(char* out, size_t max) {
  return decoder_ ? decoder_->Read(out, max) : ReadRaw(out, max);
}

LineReader::LineReader(const std::string& path)
    : input_(path), size_(BufferFor(input_.file_bytes())) {
  buffer_.reset(new char[size_]);
}

bool LineReader::Refill() {
  if (ended_) return false;
  if (begin_ > 0) {
    std::memmove(buffer_.get(), buffer_.get() + begin_, end_ - begin_);
    end_ -= begin_;
    scanned_ -= begin_;
    begin_ = 0;
  }
  if (end_ == size_) {
    // A line longer than the buffer: a larger one.
    std::unique_ptr<char[]> larger(new char[size_ * 2]);
    std::memcpy(larger.get(), buffer_.get(), end_);
    buffer_ = std::move(larger);
    size_ *= 2;
  }
  size_t n;
  try {
    n = input_.Read(buffer_.get() + end_, size_ - end_);
  } catch (const InputError& e) {
    throw TraceError(input_.path() + ":" + std::to_string(line_number_ + 1) +
                     ": " + e.what());
  }
  if (n == 0) {
    ended_ = true;
    return false;
  }
  end_ += n;
  return true;
}

bool LineReader::Next(std::string_view* line) {
  if (!NextLine(line)) return false;
  // A UTF-8 byte order mark (what some editors and spreadsheets write
  // first) is not part of the header's first column name.
  constexpr std::string_view kBom = "\xEF\xBB\xBF";
  if (line_number_ == 1 && line->substr(0, kBom.size()) == kBom) {
    line->remove_prefix(kBom.size());
  }
  return true;
}

bool LineReader::NextLine(std::string_view* line) {
  for (;;) {
    const char* data = buffer_.get();
    if (const void* newline =
            std::memchr(data + scanned_, '\n', end_ - scanned_)) {
      const size_t at =
          static_cast<size_t>(static_cast<const char*>(newline) - data);
      *line = std::string_view(data + begin_, at - begin_);
      begin_ = scanned_ = at + 1;
      ++line_number_;
      return true;
    }
    scanned_ = end_;
    if (!Refill()) {
      if (begin_ == end_) return false;
      *line = std::string_view(buffer_.get() + begin_, end_ - begin_);
      begin_ = scanned_ = end_;
      ++line_number_;
      return true;
    }
  }
}

}  // namespace modelcache::replay
