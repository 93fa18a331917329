// Writing safetensors files by streaming.
//
// The header text lists "__metadata__" first, then the tensors in data order,
// and is padded with spaces to a multiple of 8 bytes as the reference
// implementation does. Emit() produces the file as a
// sequence of byte ranges: the 8-byte length and header, then each tensor's
// bytes a buffer at a time from its FillFn. Write() sends them to a file
// descriptor, WriteToMemory() to a vector; both share Emit, so they produce
// the same bytes.
//
// FillPattern is splitmix64 of (seed, word index): every 8-byte word of the
// stream depends on its position, so a reader that misplaces, repeats or
// swaps a chunk shows it.
#include "modelcache/weights/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "modelcache/base/text.h"
#include "util.h"

namespace modelcache::weights {

namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t PatternWord(uint64_t seed, uint64_t word) {
  return SplitMix64(SplitMix64(seed) ^ word);
}

// dtype size x product(shape), or throws Error kInvalidArgument. Applies the
// reader's rule: the product of the nonzero dimensions times the dtype size
// must fit in 64 bits even when a zero dimension makes the tensor empty.
uint64_t ByteSize(const std::string& name, Dtype dtype,
                  const std::vector<uint64_t>& shape) {
  uint64_t n = DtypeSize(dtype);
  bool has_zero = false;
  for (uint64_t d : shape) {
    if (d == 0) {
      has_zero = true;
    } else if (__builtin_mul_overflow(n, d, &n)) {
      throw Error(
          ErrorCode::kInvalidArgument,
          "SafetensorsWriter: tensor '" + name + "' is more than 2^64 bytes");
    }
  }
  return has_zero ? 0 : n;
}

}  // namespace

void FillPattern(uint64_t seed, uint64_t offset, std::span<std::byte> out) {
  size_t i = 0;
  while (i < out.size()) {
    const uint64_t pos = offset + i;
    const uint64_t word = PatternWord(seed, pos / 8);
    const size_t in_word = static_cast<size_t>(pos % 8);
    if (in_word == 0 && out.size() - i >= 8) {
      // Whole words, little-endian.
      for (int b = 0; b < 8; ++b) {
        out[i + b] = static_cast<std::byte>(word >> (8 * b));
      }
      i += 8;
    } else {
      out[i] = static_cast<std::byte>(word >> (8 * in_word));
      ++i;
    }
  }
}

FillFn PatternFill(uint64_t seed) {
  return [seed](uint64_t offset, std::span<std::byte> out) {
    FillPattern(seed, offset, out);
  };
}

SafetensorsWriter& SafetensorsWriter::SetMetadata(const std::string& key,
                                                  const std::string& value) {
  metadata_[key] = value;
  return *this;
}

SafetensorsWriter& SafetensorsWriter::AddTensor(const std::string& name,
                                                Dtype dtype,
                                                std::vector<uint64_t> shape,
                                                FillFn fill) {
  if (name == "__metadata__") {
    throw Error(ErrorCode::kInvalidArgument,
                "SafetensorsWriter: invalid tensor name '" + name + "'");
  }
  if (!fill) {
    throw Error(
        ErrorCode::kInvalidArgument,
        "SafetensorsWriter: tensor '" + name + "' has no fill function");
  }
  const uint64_t bytes = ByteSize(name, dtype, shape);
  if (!names_.insert(name).second) {
    throw Error(ErrorCode::kInvalidArgument,
                "SafetensorsWriter: duplicate tensor '" + name + "'");
  }
  entries_.push_back(
      Entry{name, dtype, std::move(shape), bytes, std::move(fill)});
  return *this;
}

SafetensorsWriter& SafetensorsWriter::AddTensor(
    const std::string& name, Dtype dtype, std::vector<uint64_t> shape,
    std::span<const std::byte> bytes) {
  const uint64_t expected = ByteSize(name, dtype, shape);
  if (bytes.size() != expected) {
    throw Error(ErrorCode::kInvalidArgument,
                "SafetensorsWriter: tensor '" + name + "' needs " +
                    std::to_string(expected) + " bytes, got " +
                    std::to_string(bytes.size()));
  }
  return AddTensor(name, dtype, std::move(shape),
                   [bytes](uint64_t offset, std::span<std::byte> out) {
                     std::memcpy(out.data(), bytes.data() + offset, out.size());
                   });
}

std::vector<const SafetensorsWriter::Entry*> SafetensorsWriter::Layout() const {
  std::vector<const Entry*> order;
  order.reserve(entries_.size());
  for (const Entry& e : entries_) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(),
                   [](const Entry* a, const Entry* b) {
                     return DtypeSize(a->dtype) > DtypeSize(b->dtype);
                   });
  return order;
}

std::string SafetensorsWriter::HeaderJson() const {
  // Built as text, entry by entry (ordered_json's object lookup is linear,
  // which would make headers of many tensors quadratic); nlohmann escapes
  // the strings.
  const auto quote = [](const std::string& s) {
    return nlohmann::json(s).dump();
  };
  std::string text = "{";
  if (!metadata_.empty()) {
    text += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata_) {
      if (!first) text += ',';
      first = false;
      text += quote(key) + ':' + quote(value);
    }
    text += '}';
  }
  uint64_t offset = 0;
  for (const Entry* e : Layout()) {
    if (text.size() > 1) text += ',';
    text += quote(e->name);
    text += ":{\"dtype\":\"";
    text += DtypeName(e->dtype);
    text += "\",\"shape\":[";
    for (size_t i = 0; i < e->shape.size(); ++i) {
      if (i > 0) text += ',';
      text += std::to_string(e->shape[i]);
    }
    text += "],\"data_offsets\":[" + std::to_string(offset) + ',' +
            std::to_string(offset + e->bytes) + "]}";
    offset += e->bytes;
  }
  text += '}';
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t total = 0;
  for (const Entry& e : entries_) total += e.bytes;
  return total;
}

uint64_t SafetensorsWriter::file_bytes() const {
  return kLengthPrefixBytes + HeaderJson().size() + data_bytes();
}

void SafetensorsWriter::Emit(
    size_t buffer_bytes,
    const std::function<void(std::span<const std::byte>)>& sink) const {
  const std::string header = HeaderJson();
  std::byte prefix[kLengthPrefixBytes];
  for (size_t i = 0; i < kLengthPrefixBytes; ++i) {
    prefix[i] = static_cast<std::byte>(uint64_t{header.size()} >> (8 * i));
  }
  sink(prefix);
  sink(std::as_bytes(std::span<const char>(header)));

  std::vector<std::byte> buffer(std::max<size_t>(buffer_bytes, 1));
  for (const Entry* e : Layout()) {
    for (uint64_t done = 0; done < e->bytes;) {
      const size_t n = static_cast<size_t>(
          std::min<uint64_t>(buffer.size(), e->bytes - done));
      const std::span<std::byte> chunk(buffer.data(), n);
      e->fill(done, chunk);
      sink(chunk);
      done += n;
    }
  }
}

uint64_t SafetensorsWriter::Write(const std::string& path,
                                  size_t buffer_bytes) const {
  int raw;
  do {
    raw = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  } while (raw < 0 && errno == EINTR);
  if (raw < 0) {
    const int e = errno;
    throw IoError(path, "cannot create: " + base::ErrnoText(e), e);
  }
  detail::Fd fd(raw);
  uint64_t written = 0;
  try {
    Emit(buffer_bytes, [&](std::span<const std::byte> bytes) {
      detail::WriteFull(fd.get(), bytes.data(), bytes.size(), path);
      written += bytes.size();
    });
    if (::close(fd.Release()) != 0) {
      const int e = errno;
      throw IoError(path, "close failed: " + base::ErrnoText(e), e);
    }
  } catch (...) {
    fd = detail::Fd();
    ::unlink(path.c_str());
    throw;
  }
  return written;
}

std::vector<std::byte> SafetensorsWriter::WriteToMemory() const {
  std::vector<std::byte> image;
  image.reserve(static_cast<size_t>(file_bytes()));
  Emit(size_t{1} << 20, [&](std::span<const std::byte> bytes) {
    image.insert(image.end(), bytes.begin(), bytes.end());
  });
  return image;
}

}  // namespace modelcache::weights
