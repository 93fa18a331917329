// The safetensors format: parsing and validating a file's header.
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of
// UTF-8 JSON (possibly padded with trailing spaces), then the data buffer:
//
//   {"__metadata__": {"format": "pt"},
//    "weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
//
// Offsets are relative to the start of the data buffer (byte 8 + N of the
// file). Nothing in a file is trusted until all of it has been checked: every
// function here either returns a header whose every claim holds for the file
// it came from, or throws FormatError. The checks:
//   - the file holds the 8-byte length; N <= kMaxHeaderBytes and 8 + N does
//     not run past the end of the file;
//   - the header is well-formed JSON starting with '{', a single object;
//   - every entry other than "__metadata__" is a tensor: an object with
//     exactly the fields dtype (a known dtype name), shape (an array of
//     non-negative integers) and data_offsets (an array [begin, end] of two
//     non-negative integers);
//   - "__metadata__", when present, is an object of string values;
//   - no name appears twice (JSON parsers usually keep the last duplicate;
//     this one rejects the file), nor does a field within an entry;
//   - the product of the nonzero dimensions, and that times the dtype size,
//     fit in 64 bits, and dtype size x product(shape) == end - begin;
//   - begin <= end <= data buffer size, and the tensors' ranges, sorted by
//     begin, tile [0, data buffer size) exactly: no overlap, no gap, no
//     trailing unclaimed bytes.
// Shape [] (a scalar: one element) and zero-size tensors (a zero dimension,
// begin == end) are valid.
//
// Errors are one line: "<file>: <problem>", with control characters in names
// escaped, so a CLI can print them as they are.
#ifndef MODELCACHE_WEIGHTS_SAFETENSORS_H_
#define MODELCACHE_WEIGHTS_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"

namespace modelcache::weights {

// The largest header accepted (the reference implementation's bound).
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// The size of the little-endian header length that starts every file.
inline constexpr uint64_t kLengthPrefixBytes = 8;

// ---- errors ----

// An error about a weights file (or an in-memory image of one): what() is
// one line, "<path>: <problem>". Invalid arguments to the weights layer's
// calls (writer input, load options) are plain modelcache::Errors with
// kInvalidArgument.
class WeightsError : public Error {
 public:
  WeightsError(ErrorCode code, const std::string& path,
               const std::string& problem);
  // The file (or, for in-memory images, the source name) the error is about.
  const std::string& path() const { return path_; }
  // The problem alone, without the path.
  const std::string& problem() const { return problem_; }

 private:
  std::string path_;
  std::string problem_;
};

// The bytes are not a valid safetensors file (code kInvalidData).
class FormatError : public WeightsError {
 public:
  FormatError(const std::string& path, const std::string& problem)
      : WeightsError(ErrorCode::kInvalidData, path, problem) {}
};

// The operating system refused: open, stat, read, write or mmap failed, or the
// file is not a regular file, or it shrank while being read (code kIo).
class IoError : public WeightsError {
 public:
  IoError(const std::string& path, const std::string& problem,
          int error_number);
  // The errno value, or 0 when the failure has none (a file that ended early).
  int error_number() const { return error_number_; }

 private:
  int error_number_;
};

// ---- dtypes ----

enum class Dtype {
  kBool,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kF64,
  kI64,
  kU64,
};

// The name used in headers: "BOOL", "U8", "F8_E5M2", "BF16", ...
const char* DtypeName(Dtype dtype);
// Bytes per element: 1, 2, 4 or 8.
uint64_t DtypeSize(Dtype dtype);
// The dtype with this header name (case-sensitive), if any.
std::optional<Dtype> ParseDtype(std::string_view name);

// ---- the header ----

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kU8;
  // Empty for a scalar.
  std::vector<uint64_t> shape;
  // Byte range [begin, end) within the data buffer.
  uint64_t begin = 0;
  uint64_t end = 0;

  uint64_t bytes() const { return end - begin; }
  // product(shape): 1 for a scalar, 0 when a dimension is 0.
  uint64_t elements() const;
};

// A validated header. Immutable; built only by the parsing functions below.
class SafetensorsHeader {
 public:
  SafetensorsHeader() = default;

  // N, the JSON header length from the file's first 8 bytes (padding
  // included, the 8 bytes themselves not).
  uint64_t header_bytes() const { return header_bytes_; }
  // Where the data buffer starts in the file: 8 + N.
  uint64_t data_offset() const { return kLengthPrefixBytes + header_bytes_; }
  // The data buffer's size: the file size minus 8 + N. Every byte of it
  // belongs to exactly one tensor.
  uint64_t data_bytes() const { return data_bytes_; }
  // The whole file: 8 + N + data_bytes.
  uint64_t file_bytes() const { return data_offset() + data_bytes_; }

  // In data order: sorted by (begin, end), zero-size tensors at the same
  // offset by name.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  // The "__metadata__" strings; empty when the header has none.
  const std::map<std::string, std::string>& metadata() const {
    return metadata_;
  }
  // True when the header has a "__metadata__" entry (possibly empty).
  bool has_metadata() const { return has_metadata_; }

  // The tensor with this name, or nullptr.
  const TensorInfo* Find(std::string_view name) const;

 private:
  friend class HeaderBuilder;

  uint64_t header_bytes_ = 0;
  uint64_t data_bytes_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  bool has_metadata_ = false;
  std::unordered_map<std::string, size_t> index_;
};

// Parses a whole file image held in memory: the 8-byte length, the header and
// the data buffer (`image.size()` is the file size). `source` names the image
// in error messages. Throws FormatError. Reads nothing outside `image`.
SafetensorsHeader ParseSafetensors(std::span<const std::byte> image,
                                   std::string_view source);

// Validates the JSON header text of a file whose size is `file_bytes` (the
// header text is `header_json.size()` bytes, so the data buffer has
// file_bytes - 8 - header_json.size() bytes). Throws FormatError.
SafetensorsHeader ParseSafetensorsHeader(std::string_view header_json,
                                         uint64_t file_bytes,
                                         std::string_view source);

// The header as JSON text that ParseSafetensorsHeader accepts for a file of
// 8 + text size + header.data_bytes() bytes, parsing to the same tensors and
// metadata: "__metadata__" first (when the header has it), then the tensors
// in data order, with no padding. A validated header needs no second reading
// of the file it came from: the serve daemon hands this text to its workers.
std::string SafetensorsHeaderJson(const SafetensorsHeader& header);

// Reads and validates the header of the file at `path` without reading its
// data buffer. Throws IoError (cannot open, not a regular file, read failed)
// or FormatError.
SafetensorsHeader ReadSafetensorsHeader(const std::string& path);

// Printable(text, max_bytes = 120): `text` (a tensor name, a path) made fit
// for one line of a message or a listing (see modelcache/base/text.h). Every
// layer quotes untrusted text, so the function is base's; it keeps its name
// here for the code that calls it as weights::Printable.
using base::Printable;

}  // namespace modelcache::weights

#endif  // MODELCACHE_WEIGHTS_SAFETENSORS_H_
