// The text helpers of every layer's messages.
#include "modelcache/base/text.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>

namespace modelcache::base {
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

std::string ErrnoText(int error_number) {
  char buf[256];
  // GNU strerror_r returns the message, which may or may not be in `buf`.
  const char* text = ::strerror_r(error_number, buf, sizeof(buf));
  return text;
}

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
    const size_t len = Utf8SequenceLength(text, i, &cp);
    const bool control = cp < 0x20 || cp == 0x7F ||
                         (cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 ||
                         cp == 0x2029;
    if (len == 0) {
      AppendEscaped(&out, static_cast<unsigned char>(text[i]));
      ++i;
    } else if (control) {
      for (size_t k = 0; k < len; ++k) {
        AppendEscaped(&out, static_cast<unsigned char>(text[i + k]));
      }
      i += len;
    } else {
      out.append(text.substr(i, len));
      i += len;
    }
  }
  return out;
}

std::string Quoted(std::string_view text, size_t max_bytes) {
  return "'" + Printable(text, max_bytes) + "'";
}

}  // namespace modelcache::base
