// File descriptor and text helpers of the weights layer.
//
// Every I/O helper retries EINTR and continues after short transfers, and
// turns any other failure into an IoError naming the file, the operation, the
// offset and strerror. Printable() is what keeps error messages to one line:
// names and paths come from untrusted files and users and may hold newlines,
// terminal escapes or invalid UTF-8.
#include "util.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "modelcache/weights/safetensors.h"

namespace modelcache::weights::detail {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.Release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

std::string ErrnoText(int error_number) {
  char buf[256];
  // GNU strerror_r returns the message, which may or may not be in `buf`.
  const char* text = strerror_r(error_number, buf, sizeof(buf));
  return text;
}

Fd OpenRegularFile(const std::string& path, struct stat* st) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int e = errno;
    throw IoError(path, "cannot open: " + ErrnoText(e), e);
  }
  Fd owned(fd);
  if (::fstat(fd, st) != 0) {
    const int e = errno;
    throw IoError(path, "cannot stat: " + ErrnoText(e), e);
  }
  if (S_ISDIR(st->st_mode)) {
    throw IoError(path, "is a directory", EISDIR);
  }
  if (!S_ISREG(st->st_mode)) {
    throw IoError(path, "not a regular file", EINVAL);
  }
  return owned;
}

void PreadFull(int fd, void* buffer, uint64_t length, uint64_t offset,
               const std::string& path) {
  auto* out = static_cast<char*>(buffer);
  uint64_t done = 0;
  while (done < length) {
    // Linux transfers at most ~2 GiB per call; asking for more is fine.
    const ssize_t n = ::pread(fd, out + done, length - done,
                              static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      throw IoError(path,
                    "read of " + std::to_string(length - done) +
                        " bytes at offset " + std::to_string(offset + done) +
                        " failed: " + ErrnoText(e),
                    e);
    }
    if (n == 0) {
      throw IoError(path,
                    "file ended at offset " + std::to_string(offset + done) +
                        " while " + std::to_string(offset + length) +
                        " bytes were expected (truncated while reading?)",
                    0);
    }
    done += static_cast<uint64_t>(n);
  }
}

void WriteFull(int fd, const void* buffer, uint64_t length,
               const std::string& path) {
  const auto* in = static_cast<const char*>(buffer);
  uint64_t done = 0;
  while (done < length) {
    const ssize_t n = ::write(fd, in + done, length - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int e = errno;
      throw IoError(path, "write failed: " + ErrnoText(e), e);
    }
    done += static_cast<uint64_t>(n);
  }
}

namespace {

// The length of the valid UTF-8 sequence starting at text[i], or 0.
size_t Utf8SequenceLength(std::string_view text, size_t i,
                          uint32_t* code_point) {
  const auto byte = [&](size_t k) {
    return static_cast<unsigned char>(text[k]);
  };
  const unsigned char lead = byte(i);
  size_t len;
  uint32_t cp;
  if (lead < 0x80) {
    *code_point = lead;
    return 1;
  } else if (lead >= 0xC2 && lead <= 0xDF) {
    len = 2;
    cp = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    len = 3;
    cp = lead & 0x0F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    len = 4;
    cp = lead & 0x07;
  } else {
    return 0;
  }
  if (text.size() - i < len) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  // Overlong forms, surrogates, beyond U+10FFFF.
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
      (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    return 0;
  }
  *code_point = cp;
  return len;
}

void AppendEscaped(std::string* out, unsigned char c) {
  switch (c) {
    case '\n':
      *out += "\\n";
      return;
    case '\r':
      *out += "\\r";
      return;
    case '\t':
      *out += "\\t";
      return;
    default:
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02X", c);
      *out += buf;
  }
}

}  // namespace

}  // namespace modelcache::weights::detail

namespace modelcache::weights {

std::string Printable(std::string_view text, size_t max_bytes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes) + 3);
  size_t i = 0;
  while (i < text.size()) {
    if (out.size() >= max_bytes) {
      out += "...";
      break;
    }
    uint32_t cp = 0;
    const size_t len = detail::Utf8SequenceLength(text, i, &cp);
    const bool control = cp < 0x20 || cp == 0x7F ||
                         (cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 ||
                         cp == 0x2029;
    if (len == 0) {
      detail::AppendEscaped(&out, static_cast<unsigned char>(text[i]));
      ++i;
    } else if (control) {
      for (size_t k = 0; k < len; ++k) {
        detail::AppendEscaped(&out, static_cast<unsigned char>(text[i + k]));
      }
      i += len;
    } else {
      out.append(text.substr(i, len));
      i += len;
    }
  }
  return out;
}

}  // namespace modelcache::weights

namespace modelcache::weights::detail {

std::string Quoted(std::string_view text) {
  return "'" + Printable(text) + "'";
}

}  // namespace modelcache::weights::detail
