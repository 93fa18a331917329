// Parsing and validating safetensors headers.
//
// Design: the header is untrusted input of up to 100 MiB, so it is never
// turned into a generic JSON tree. A SAX handler (nlohmann::json::sax_parse,
// whose parser keeps its own stack rather than recursing) walks the token
// stream with a small state machine that accepts only the shape of a
// safetensors header: one object of entries, each a tensor object with the
// three known fields or the "__metadata__" string map. The first token that
// does not fit stops the parse with a message naming the entry and the field,
// so nesting depth and memory stay bounded by the header's own size, and
// duplicate names, which DOM parsers silently collapse, are seen as they come.
// A raw NUL byte is rejected up front: the lexer would take it for the end of
// the input and ignore whatever follows.
//
// Once the structure is known, the numbers are checked in header order (dtype,
// overflow-free byte size, offsets within the data buffer), then the tensors
// are sorted by offset and must tile the data buffer exactly. Only then is a
// SafetensorsHeader handed out; no code path reads file bytes before the
// checks that bound them.
#include "modelcache/weights/safetensors.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_set>
#include <utility>

#include "modelcache/base/text.h"
#include "util.h"

namespace modelcache::weights {

using base::Quoted;

// ---- errors ----

WeightsError::WeightsError(ErrorCode code, const std::string& path,
                           const std::string& problem)
    : Error(code, Printable(path, 4096) + ": " + Printable(problem, 1024)),
      path_(path),
      problem_(problem) {}

IoError::IoError(const std::string& path, const std::string& problem,
                 int error_number)
    : WeightsError(ErrorCode::kIo, path, problem),
      error_number_(error_number) {}

// ---- dtypes ----

namespace {

struct DtypeEntry {
  Dtype dtype;
  const char* name;
  uint64_t size;
};

constexpr std::array<DtypeEntry, 15> kDtypes = {{
    {Dtype::kBool, "BOOL", 1},
    {Dtype::kU8, "U8", 1},
    {Dtype::kI8, "I8", 1},
    {Dtype::kF8E5M2, "F8_E5M2", 1},
    {Dtype::kF8E4M3, "F8_E4M3", 1},
    {Dtype::kI16, "I16", 2},
    {Dtype::kU16, "U16", 2},
    {Dtype::kF16, "F16", 2},
    {Dtype::kBF16, "BF16", 2},
    {Dtype::kI32, "I32", 4},
    {Dtype::kU32, "U32", 4},
    {Dtype::kF32, "F32", 4},
    {Dtype::kF64, "F64", 8},
    {Dtype::kI64, "I64", 8},
    {Dtype::kU64, "U64", 8},
}};

const DtypeEntry& EntryOf(Dtype dtype) {
  for (const DtypeEntry& e : kDtypes) {
    if (e.dtype == dtype) return e;
  }
  return kDtypes[0];  // unreachable for a valid enumerator
}

}  // namespace

const char* DtypeName(Dtype dtype) { return EntryOf(dtype).name; }

uint64_t DtypeSize(Dtype dtype) { return EntryOf(dtype).size; }

std::optional<Dtype> ParseDtype(std::string_view name) {
  for (const DtypeEntry& e : kDtypes) {
    if (name == e.name) return e.dtype;
  }
  return std::nullopt;
}

// ---- the header ----

uint64_t TensorInfo::elements() const {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;  // validated: cannot overflow
  return n;
}

const TensorInfo* SafetensorsHeader::Find(std::string_view name) const {
  const auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

// "[2, 3]", at most the first 8 dimensions.
std::string FormatShape(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    if (i == 8) {
      out += "... (" + std::to_string(shape.size()) + " dimensions)";
      break;
    }
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

// Offsets as the header writes them: "[begin, end]".
std::string FormatRange(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + "]";
}

// A byte range of the data buffer: "[begin, end)".
std::string FormatByteRange(uint64_t begin, uint64_t end) {
  return "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

// A tensor entry as parsed, before its numbers are checked.
struct RawTensor {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  uint64_t offsets[2] = {0, 0};
  int offset_count = 0;
};

// The SAX handler: accepts exactly the structure of a safetensors header.
class HeaderSax {
 public:
  using json = nlohmann::json;

  std::vector<RawTensor>& tensors() { return tensors_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }
  bool has_metadata() const { return has_metadata_; }
  const std::string& error() const { return error_; }

  bool null() { return Unexpected("null"); }
  bool boolean(bool) { return Unexpected("a boolean"); }
  bool number_integer(json::number_integer_t value) {
    // Only negative integers arrive here ("-0" aside).
    if (value == 0) return number_unsigned(0);
    return Unexpected("a negative number");
  }
  bool number_unsigned(json::number_unsigned_t value) {
    if (state_ == State::kShape) {
      current_.shape.push_back(value);
      return true;
    }
    if (state_ == State::kOffsets) {
      if (current_.offset_count == 2) {
        return Fail("tensor " + Quoted(current_.name) +
                    ": data_offsets must be [begin, end], found more than 2 "
                    "numbers");
      }
      current_.offsets[current_.offset_count++] = value;
      return true;
    }
    return Unexpected("a number");
  }
  bool number_float(json::number_float_t, const std::string&) {
    return Unexpected("a number that is not an integer or exceeds 2^64 - 1");
  }
  bool string(std::string& value) {
    if (state_ == State::kField && field_ == kDtypeField) {
      current_.dtype = std::move(value);
      state_ = State::kTensor;
      return true;
    }
    if (state_ == State::kMetadataValue) {
      metadata_.emplace(std::move(metadata_key_), std::move(value));
      state_ = State::kMetadata;
      return true;
    }
    return Unexpected("a string");
  }
  bool binary(json::binary_t&) { return Unexpected("binary data"); }

  bool start_object(std::size_t) {
    switch (state_) {
      case State::kStart:
        state_ = State::kEntries;
        return true;
      case State::kEntryValue:
        if (entry_is_metadata_) {
          has_metadata_ = true;
          state_ = State::kMetadata;
        } else {
          fields_seen_ = 0;
          state_ = State::kTensor;
        }
        return true;
      default:
        return Unexpected("an object");
    }
  }
  bool key(std::string& key) {
    switch (state_) {
      case State::kEntries:
        if (!names_.insert(key).second) {
          return Fail("duplicate entry " + Quoted(key));
        }
        entry_is_metadata_ = key == "__metadata__";
        if (!entry_is_metadata_) {
          current_ = RawTensor();
          current_.name = std::move(key);
        }
        state_ = State::kEntryValue;
        return true;
      case State::kTensor: {
        int field = -1;
        for (int i = 0; i < 3; ++i) {
          if (key == kFieldNames[i]) field = i;
        }
        if (field < 0) {
          return Fail("tensor " + Quoted(current_.name) +
                      ": unexpected field " + Quoted(key) +
                      " (want exactly dtype, shape, data_offsets)");
        }
        if (fields_seen_ & (1u << field)) {
          return Fail("tensor " + Quoted(current_.name) + ": duplicate field " +
                      Quoted(key));
        }
        fields_seen_ |= 1u << field;
        field_ = field;
        state_ = State::kField;
        return true;
      }
      case State::kMetadata:
        if (metadata_.count(key) != 0) {
          return Fail("__metadata__: duplicate key " + Quoted(key));
        }
        metadata_key_ = std::move(key);
        state_ = State::kMetadataValue;
        return true;
      default:
        return Fail("unexpected key " + Quoted(key));  // unreachable
    }
  }
  bool end_object() {
    switch (state_) {
      case State::kEntries:
        state_ = State::kDone;
        return true;
      case State::kMetadata:
        state_ = State::kEntries;
        return true;
      case State::kTensor:
        for (int i = 0; i < 3; ++i) {
          if (!(fields_seen_ & (1u << i))) {
            return Fail("tensor " + Quoted(current_.name) + ": missing " +
                        kFieldNames[i]);
          }
        }
        tensors_.push_back(std::move(current_));
        state_ = State::kEntries;
        return true;
      default:
        return Fail("unexpected end of object");  // unreachable
    }
  }
  bool start_array(std::size_t) {
    if (state_ == State::kField && field_ == kShapeField) {
      state_ = State::kShape;
      return true;
    }
    if (state_ == State::kField && field_ == kOffsetsField) {
      state_ = State::kOffsets;
      return true;
    }
    return Unexpected("an array");
  }
  bool end_array() {
    if (state_ == State::kShape) {
      state_ = State::kTensor;
      return true;
    }
    if (state_ == State::kOffsets) {
      if (current_.offset_count != 2) {
        return Fail("tensor " + Quoted(current_.name) +
                    ": data_offsets must be [begin, end], found " +
                    std::to_string(current_.offset_count) + " number" +
                    (current_.offset_count == 1 ? "" : "s"));
      }
      state_ = State::kTensor;
      return true;
    }
    return Fail("unexpected end of array");  // unreachable
  }

  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) {
    // ex.what() is "[json.exception.parse_error.101] parse error at line 1,
    // column 5: syntax error while parsing ...; last read: '...'".
    std::string what = ex.what();
    const size_t colon = what.find(": ");
    if (what.rfind("[json.exception.", 0) == 0 && colon != std::string::npos) {
      what = what.substr(colon + 2);
    }
    return Fail("header is not valid JSON (at byte " +
                std::to_string(position) + "): " + Printable(what, 200));
  }

 private:
  enum class State {
    kStart,          // before the top-level object
    kEntries,        // in the top-level object, before a key or its end
    kEntryValue,     // after a top-level key
    kTensor,         // in a tensor object, before a field or its end
    kField,          // after a tensor field's key
    kShape,          // in a shape array
    kOffsets,        // in a data_offsets array
    kMetadata,       // in __metadata__, before a key or its end
    kMetadataValue,  // after a __metadata__ key
    kDone,           // after the top-level object
  };
  static constexpr int kDtypeField = 0;
  static constexpr int kShapeField = 1;
  static constexpr int kOffsetsField = 2;
  static constexpr const char* kFieldNames[3] = {"dtype", "shape",
                                                 "data_offsets"};

  bool Fail(std::string message) {
    if (error_.empty()) error_ = std::move(message);
    return false;
  }

  // A JSON value of kind `found` where the state wants something else.
  bool Unexpected(const std::string& found) {
    const std::string tensor = "tensor " + Quoted(current_.name);
    switch (state_) {
      case State::kStart:
        return Fail("header must be a JSON object, found " + found);
      case State::kEntryValue:
        if (entry_is_metadata_) {
          return Fail("__metadata__ must be an object of strings, found " +
                      found);
        }
        return Fail(tensor + " must be an object, found " + found);
      case State::kField:
        switch (field_) {
          case kDtypeField:
            return Fail(tensor + ": dtype must be a string, found " + found);
          case kShapeField:
            return Fail(tensor +
                        ": shape must be an array of non-negative integers, "
                        "found " +
                        found);
          default:
            return Fail(tensor +
                        ": data_offsets must be [begin, end] of non-negative "
                        "integers, found " +
                        found);
        }
      case State::kShape:
        return Fail(tensor + ": shape must hold non-negative integers, found " +
                    found);
      case State::kOffsets:
        return Fail(tensor +
                    ": data_offsets must hold non-negative integers, found " +
                    found);
      case State::kMetadataValue:
        return Fail("__metadata__: value of " + Quoted(metadata_key_) +
                    " must be a string, found " + found);
      default:
        return Fail("unexpected " + found);  // unreachable: keys come first
    }
  }

  State state_ = State::kStart;
  int field_ = 0;
  unsigned fields_seen_ = 0;
  bool entry_is_metadata_ = false;
  bool has_metadata_ = false;
  RawTensor current_;
  std::string metadata_key_;
  std::unordered_set<std::string> names_;
  std::vector<RawTensor> tensors_;
  std::map<std::string, std::string> metadata_;
  std::string error_;
};

// `a` x `b`, or false when it does not fit in 64 bits.
bool MultiplyChecked(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

uint64_t ReadLittleEndian64(const std::byte* p) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) {
    value = (value << 8) | static_cast<uint64_t>(p[i]);
  }
  return value;
}

// Checks the header length from the first 8 bytes against the bound and the
// file size.
void CheckHeaderLength(uint64_t header_len, uint64_t file_bytes,
                       const std::string& source) {
  if (header_len > kMaxHeaderBytes) {
    throw FormatError(source, "header length " + std::to_string(header_len) +
                                  " exceeds the limit of " +
                                  std::to_string(kMaxHeaderBytes) + " bytes");
  }
  if (header_len > file_bytes - kLengthPrefixBytes) {
    throw FormatError(
        source, "header length " + std::to_string(header_len) +
                    " exceeds file size " + std::to_string(file_bytes) +
                    " (8 + " + std::to_string(header_len) + " bytes needed)");
  }
}

void CheckFileHoldsLength(uint64_t file_bytes, const std::string& source) {
  if (file_bytes < kLengthPrefixBytes) {
    throw FormatError(source, "file is " + std::to_string(file_bytes) +
                                  " bytes, too small for the 8-byte header "
                                  "length");
  }
}

}  // namespace

// Turns parsed entries into a validated SafetensorsHeader.
class HeaderBuilder {
 public:
  static SafetensorsHeader Build(std::vector<RawTensor> raw,
                                 std::map<std::string, std::string> metadata,
                                 bool has_metadata, uint64_t header_bytes,
                                 uint64_t data_bytes,
                                 const std::string& source) {
    SafetensorsHeader h;
    h.header_bytes_ = header_bytes;
    h.data_bytes_ = data_bytes;
    h.metadata_ = std::move(metadata);
    h.has_metadata_ = has_metadata;
    h.tensors_.reserve(raw.size());

    for (RawTensor& r : raw) {
      // Only for messages: built when there is one to throw.
      const auto tensor = [&r] { return "tensor " + Quoted(r.name); };
      const std::optional<Dtype> dtype = ParseDtype(r.dtype);
      if (!dtype) {
        throw FormatError(source,
                          tensor() + ": unknown dtype " + Quoted(r.dtype));
      }
      // The product of the nonzero dimensions must fit, so that strides
      // computed from the shape cannot overflow either.
      uint64_t nonzero_product = 1;
      bool has_zero = false;
      for (uint64_t d : r.shape) {
        if (d == 0) {
          has_zero = true;
        } else if (!MultiplyChecked(nonzero_product, d, &nonzero_product)) {
          throw FormatError(source, tensor() + ": shape " +
                                        FormatShape(r.shape) +
                                        " has more than 2^64 elements");
        }
      }
      uint64_t expected_bytes = 0;
      if (!MultiplyChecked(nonzero_product, DtypeSize(*dtype),
                           &expected_bytes)) {
        throw FormatError(source, tensor() + ": " + DtypeName(*dtype) +
                                      " x shape " + FormatShape(r.shape) +
                                      " is more than 2^64 bytes");
      }
      if (has_zero) expected_bytes = 0;
      const uint64_t begin = r.offsets[0];
      const uint64_t end = r.offsets[1];
      if (begin > end) {
        throw FormatError(source, tensor() + ": data_offsets " +
                                      FormatRange(begin, end) +
                                      " have begin > end");
      }
      if (end > data_bytes) {
        throw FormatError(source, tensor() + ": data_offsets " +
                                      FormatRange(begin, end) +
                                      " run past the data buffer of " +
                                      std::to_string(data_bytes) + " bytes");
      }
      if (end - begin != expected_bytes) {
        throw FormatError(source, tensor() + ": " + DtypeName(*dtype) +
                                      " x shape " + FormatShape(r.shape) +
                                      " is " + std::to_string(expected_bytes) +
                                      " bytes but data_offsets " +
                                      FormatRange(begin, end) + " span " +
                                      std::to_string(end - begin));
      }
      TensorInfo info;
      info.name = std::move(r.name);
      info.dtype = *dtype;
      info.shape = std::move(r.shape);
      info.begin = begin;
      info.end = end;
      h.tensors_.push_back(std::move(info));
    }

    std::sort(h.tensors_.begin(), h.tensors_.end(),
              [](const TensorInfo& a, const TensorInfo& b) {
                if (a.begin != b.begin) return a.begin < b.begin;
                if (a.end != b.end) return a.end < b.end;
                return a.name < b.name;
              });
    uint64_t cursor = 0;
    for (size_t i = 0; i < h.tensors_.size(); ++i) {
      const TensorInfo& t = h.tensors_[i];
      if (t.begin < cursor) {
        const TensorInfo& prev = h.tensors_[i - 1];
        throw FormatError(source, "tensor " + Quoted(t.name) +
                                      " data_offsets " +
                                      FormatRange(t.begin, t.end) +
                                      " overlap tensor " + Quoted(prev.name) +
                                      " " + FormatRange(prev.begin, prev.end));
      }
      if (t.begin > cursor) {
        throw FormatError(source, "data bytes " +
                                      FormatByteRange(cursor, t.begin) +
                                      " belong to no tensor (gap before "
                                      "tensor " +
                                      Quoted(t.name) + ")");
      }
      cursor = t.end;
    }
    if (cursor != data_bytes) {
      throw FormatError(source, "data bytes " +
                                    FormatByteRange(cursor, data_bytes) +
                                    " belong to no tensor (after the last "
                                    "tensor)");
    }

    h.index_.reserve(h.tensors_.size());
    for (size_t i = 0; i < h.tensors_.size(); ++i) {
      h.index_.emplace(h.tensors_[i].name, i);
    }
    return h;
  }
};

SafetensorsHeader ParseSafetensorsHeader(std::string_view header_json,
                                         uint64_t file_bytes,
                                         std::string_view source_view) {
  const std::string source(source_view);
  CheckFileHoldsLength(file_bytes, source);
  const uint64_t header_len = header_json.size();
  CheckHeaderLength(header_len, file_bytes, source);
  if (header_len == 0) {
    throw FormatError(source, "header is empty (length 0)");
  }
  if (header_json[0] != '{') {
    throw FormatError(source, "header does not start with '{'");
  }

  // nlohmann's lexer takes a NUL byte for the end of the input, which would
  // let anything after one through. Valid JSON never holds a raw NUL (inside
  // strings it must be escaped), so any NUL makes the header invalid.
  if (const void* nul =
          std::memchr(header_json.data(), 0, header_json.size())) {
    const size_t at =
        static_cast<size_t>(static_cast<const char*>(nul) - header_json.data());
    throw FormatError(source, "header is not valid JSON (at byte " +
                                  std::to_string(at) + "): NUL byte");
  }

  HeaderSax sax;
  const bool ok = nlohmann::json::sax_parse(
      header_json.data(), header_json.data() + header_json.size(), &sax,
      nlohmann::json::input_format_t::json, /*strict=*/true,
      /*ignore_comments=*/false);
  if (!ok) {
    throw FormatError(
        source, sax.error().empty() ? "header is not valid JSON" : sax.error());
  }
  const uint64_t data_bytes = file_bytes - kLengthPrefixBytes - header_len;
  return HeaderBuilder::Build(std::move(sax.tensors()),
                              std::move(sax.metadata()), sax.has_metadata(),
                              header_len, data_bytes, source);
}

SafetensorsHeader ParseSafetensors(std::span<const std::byte> image,
                                   std::string_view source_view) {
  const std::string source(source_view);
  CheckFileHoldsLength(image.size(), source);
  const uint64_t header_len = ReadLittleEndian64(image.data());
  CheckHeaderLength(header_len, image.size(), source);
  const std::string_view json(
      reinterpret_cast<const char*>(image.data()) + kLengthPrefixBytes,
      header_len);
  return ParseSafetensorsHeader(json, image.size(), source);
}

std::string SafetensorsHeaderJson(const SafetensorsHeader& header) {
  // Names and values were valid UTF-8 when parsed (the lexer checks), so
  // dump() cannot throw; `replace` keeps that true whatever happens.
  const auto quote = [](const std::string& text) {
    return nlohmann::json(text).dump(-1, ' ', false,
                                     nlohmann::json::error_handler_t::replace);
  };
  std::string out = "{";
  bool first = true;
  if (header.has_metadata()) {
    out += "\"__metadata__\":{";
    bool first_key = true;
    for (const auto& [key, value] : header.metadata()) {
      if (!first_key) out += ',';
      first_key = false;
      out += quote(key) + ":" + quote(value);
    }
    out += '}';
    first = false;
  }
  for (const TensorInfo& tensor : header.tensors()) {
    if (!first) out += ',';
    first = false;
    out += quote(tensor.name) + ":{\"dtype\":\"" + DtypeName(tensor.dtype) +
           "\",\"shape\":[";
    for (size_t i = 0; i < tensor.shape.size(); ++i) {
      if (i > 0) out += ',';
      out += std::to_string(tensor.shape[i]);
    }
    out += "],\"data_offsets\":[" + std::to_string(tensor.begin) + "," +
           std::to_string(tensor.end) + "]}";
  }
  out += '}';
  return out;
}

namespace detail {

SafetensorsHeader ReadHeaderFromFd(int fd, uint64_t file_bytes,
                                   const std::string& path) {
  CheckFileHoldsLength(file_bytes, path);
  std::byte prefix[kLengthPrefixBytes];
  PreadFull(fd, prefix, sizeof(prefix), 0, path);
  const uint64_t header_len = ReadLittleEndian64(prefix);
  CheckHeaderLength(header_len, file_bytes, path);
  std::string json(header_len, '\0');
  PreadFull(fd, json.data(), header_len, kLengthPrefixBytes, path);
  return ParseSafetensorsHeader(json, file_bytes, path);
}

}  // namespace detail

SafetensorsHeader ReadSafetensorsHeader(const std::string& path) {
  struct stat st;
  const detail::Fd fd = detail::OpenRegularFile(path, &st);
  return detail::ReadHeaderFromFd(fd.get(), static_cast<uint64_t>(st.st_size),
                                  path);
}

}  // namespace modelcache::weights
