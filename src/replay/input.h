// The files replay reads (traces, sizes, memory and durations files), plain
// or compressed, a line at a time.
//
// A file is decompressed when its first bytes say so: 1f 8b is gzip (one or
// more members, as `gzip` and `cat a.gz b.gz` write them), 28 b5 2f fd is
// zstd (one or more frames; skippable frames are skipped). Anything else is
// read as it is. Data that ends inside a gzip member or a zstd frame, fails
// its checksum, or is not valid compressed data is an error naming the file
// and the line being read when it was found; so is anything after the last
// gzip member that is not another member.
#ifndef MODELCACHE_SRC_REPLAY_INPUT_H_
#define MODELCACHE_SRC_REPLAY_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace modelcache::replay {

enum class Compression : uint8_t { kNone, kGzip, kZstd };

// The decompressed bytes of one file.
class InputFile {
 public:
  // Throws TraceError "PATH:1: cannot open file: REASON" or "PATH:1: is a
  // directory, not a file".
  explicit InputFile(std::string path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  // Up to `max` (> 0) bytes of the decompressed data into `out`; 0 only at
  // its end. Throws InputError on data that is truncated or corrupt, and on
  // a read error.
  size_t Read(char* out, size_t max);

  const std::string& path() const { return path_; }
  Compression compression() const { return compression_; }
  // The file's size on disk and how much of it has been read: progress.
  uint64_t file_bytes() const { return file_bytes_; }
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  class Decoder;
  class GzipDecoder;
  class ZstdDecoder;

  // Reads more of the file into in_; false at its end.
  bool Fill();
  size_t ReadRaw(char* out, size_t max);

  const std::string path_;
  int fd_ = -1;
  Compression compression_ = Compression::kNone;
  uint64_t file_bytes_ = 0, bytes_read_ = 0;
  // Raw bytes read and not yet decoded: in_[in_begin_, in_end_). Not
  // zeroed (nor, for a small file, all touched): opening is cheap.
  std::unique_ptr<char[]> in_;
  size_t in_size_ = 0;
  size_t in_begin_ = 0, in_end_ = 0;
  bool file_ended_ = false;
  std::unique_ptr<Decoder> decoder_;

  friend class Decoder;
};

// What is wrong with a file's compressed data, without the file's name and
// line: LineReader adds them (as a TraceError).
class InputError : public std::exception {
 public:
  explicit InputError(std::string message) : message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  std::string message_;
};

// The lines of a file, as std::getline splits them: at each '\n', which is
// not part of the line; a last line without one is a line; a file that ends
// with '\n' has no empty line after it.
class LineReader {
 public:
  // Throws TraceError as InputFile does.
  explicit LineReader(const std::string& path);

  // The next line, valid until the next call; false at the end of the file.
  // Throws TraceError "PATH:LINE: ..." (LINE: the line being read) when the
  // data is truncated or corrupt. A UTF-8 byte order mark before the first
  // line is dropped.
  bool Next(std::string_view* line);

  // The number of the line Next gave last (1 for the first).
  size_t line_number() const { return line_number_; }
  const std::string& path() const { return input_.path(); }
  const InputFile& input() const { return input_; }

 private:
  // Next, as the file has it.
  bool NextLine(std::string_view* line);
  // Reads more into buffer_, keeping [begin_, end_); false at the end.
  bool Refill();

  InputFile input_;
  std::unique_ptr<char[]> buffer_;
  size_t size_ = 0;
  size_t begin_ = 0, end_ = 0;
  size_t scanned_ = 0;  // [begin_, scanned_) holds no '\n'
  bool ended_ = false;
  size_t line_number_ = 0;
};

}  // namespace modelcache::replay

#endif  // MODELCACHE_SRC_REPLAY_INPUT_H_
