// `modelcache inspect`: prints a safetensors file's validated header.
//
// Only the header is read (ReadSafetensorsHeader), so inspecting a file of
// many GiB costs one open, one fstat and two small reads. The whole output is
// built in memory and written only on success, which is how a failure leaves
// stdout empty; every error becomes the single line "error: <what()>", whose
// text the weights layer already keeps to one line (names and paths are
// escaped). The text listing escapes tensor names and metadata the same way;
// the JSON output carries them exactly, JSON-escaped.
#include "inspect_command.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "modelcache/base/bytes.h"
#include "modelcache/base/text.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::tools {

namespace {

using base::Printable;
using weights::SafetensorsHeader;
using weights::TensorInfo;

constexpr size_t kNoLimit = std::numeric_limits<size_t>::max();

std::string ShapeText(const std::vector<uint64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string TextListing(const std::string& file, const SafetensorsHeader& h) {
  std::ostringstream out;
  out << "file: " << Printable(file, kNoLimit) << "\n";
  out << "header: " << h.header_bytes() << " bytes\n";
  out << "data: " << h.data_bytes() << " bytes (" << FormatBytes(h.data_bytes())
      << ")\n";
  out << "metadata: " << h.metadata().size()
      << (h.metadata().size() == 1 ? " entry" : " entries") << "\n";
  for (const auto& [key, value] : h.metadata()) {
    out << "  " << Printable(key, kNoLimit) << ": "
        << Printable(value, kNoLimit) << "\n";
  }

  struct Row {
    std::string name, dtype, shape, offsets, bytes;
  };
  std::vector<Row> rows;
  rows.push_back({"NAME", "DTYPE", "SHAPE", "DATA_OFFSETS", "BYTES"});
  for (const TensorInfo& t : h.tensors()) {
    rows.push_back(
        {Printable(t.name, kNoLimit), weights::DtypeName(t.dtype),
         ShapeText(t.shape),
         "[" + std::to_string(t.begin) + ", " + std::to_string(t.end) + "]",
         std::to_string(t.bytes())});
  }
  size_t widths[4] = {0, 0, 0, 0};
  for (const Row& r : rows) {
    widths[0] = std::max(widths[0], r.name.size());
    widths[1] = std::max(widths[1], r.dtype.size());
    widths[2] = std::max(widths[2], r.shape.size());
    widths[3] = std::max(widths[3], r.offsets.size());
  }
  out << "tensors: " << h.tensors().size() << "\n";
  if (!h.tensors().empty()) {
    for (const Row& r : rows) {
      const auto pad = [](const std::string& s, size_t width) {
        return s + std::string(width - s.size() + 2, ' ');
      };
      out << "  " << pad(r.name, widths[0]) << pad(r.dtype, widths[1])
          << pad(r.shape, widths[2]) << pad(r.offsets, widths[3]) << r.bytes
          << "\n";
    }
  }
  out << "total: " << h.tensors().size()
      << (h.tensors().size() == 1 ? " tensor, " : " tensors, ")
      << h.data_bytes() << " bytes (" << FormatBytes(h.data_bytes())
      << "); file " << h.file_bytes() << " bytes\n";
  return out.str();
}

std::string JsonListing(const std::string& file, const SafetensorsHeader& h) {
  nlohmann::ordered_json doc = nlohmann::ordered_json::object();
  doc["file"] = file;
  doc["header_bytes"] = h.header_bytes();
  doc["data_bytes"] = h.data_bytes();
  nlohmann::ordered_json metadata = nlohmann::ordered_json::object();
  for (const auto& [key, value] : h.metadata()) metadata[key] = value;
  doc["metadata"] = std::move(metadata);
  nlohmann::ordered_json tensors = nlohmann::ordered_json::array();
  for (const TensorInfo& t : h.tensors()) {
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["name"] = t.name;
    entry["dtype"] = weights::DtypeName(t.dtype);
    entry["shape"] = t.shape;
    entry["data_offsets"] = {t.begin, t.end};
    entry["bytes"] = t.bytes();
    tensors.push_back(std::move(entry));
  }
  doc["tensors"] = std::move(tensors);
  // Names and metadata are valid UTF-8 (the reader checked); the path need
  // not be, so invalid bytes become U+FFFD rather than an exception.
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
         "\n";
}

// Whether the file starts as a safetensors file does: after the 8-byte
// header length, its JSON header opens with '{'. A file that is too short
// or cannot be read is left to the reader's own error.
bool LooksUnlikeSafetensors(const std::string& file) {
  std::FILE* in = std::fopen(file.c_str(), "rb");
  if (in == nullptr) return false;
  unsigned char start[9];
  const size_t got = std::fread(start, 1, sizeof start, in);
  std::fclose(in);
  return got == sizeof start && start[8] != '{';
}

}  // namespace

int RunInspect(const std::string& file, bool json, std::ostream& out,
               std::ostream& err) {
  std::string listing;
  try {
    const SafetensorsHeader header = weights::ReadSafetensorsHeader(file);
    listing = json ? JsonListing(file, header) : TextListing(file, header);
  } catch (const weights::WeightsError& e) {
    std::string message = e.what();
    if (LooksUnlikeSafetensors(file)) {
      // Say so before the detail, which reads as a damaged file otherwise.
      const std::string prefix = Printable(file, kNoLimit) + ": ";
      const std::string note =
          "does not look like a safetensors file (no JSON header after the "
          "8-byte header length): ";
      if (message.rfind(prefix, 0) == 0) {
        message.insert(prefix.size(), note);
      } else {
        message = prefix + note + message;
      }
    }
    err << "error: " << message << "\n";
    return 1;
  } catch (const std::exception& e) {
    err << "error: " << Printable(file, kNoLimit) << ": "
        << Printable(e.what(), 1024) << "\n";
    return 1;
  }
  out << listing;
  out.flush();
  return 0;
}

}  // namespace modelcache::tools
