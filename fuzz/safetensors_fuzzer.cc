// libFuzzer target: arbitrary bytes as a safetensors file image.
//
// ParseSafetensors must either throw FormatError with a one-line message
// naming the source, or return a header whose every claim holds for the
// image: the tensors tile the data buffer in order, every range lies inside
// the image, byte counts equal dtype size x product(shape), and names find
// their tensors. Any violation traps, so logic errors count as crashes as
// well as memory errors (ASan) and undefined behaviour (UBSan, no recovery).
//
// An accepted image is also written again with SafetensorsWriter (names,
// metadata and tensor bytes taken from the image) and parsed back: the
// writer must produce a file the reader accepts, with the same tensors and
// bytes, whatever UTF-8 the names hold.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/safetensors_writer.h"

namespace {

using modelcache::weights::DtypeSize;
using modelcache::weights::FormatError;
using modelcache::weights::ParseSafetensors;
using modelcache::weights::SafetensorsHeader;
using modelcache::weights::SafetensorsWriter;
using modelcache::weights::TensorInfo;

void Check(bool condition) {
  if (!condition) __builtin_trap();
}

void CheckInvariants(const SafetensorsHeader& h,
                     std::span<const std::byte> image) {
  Check(h.file_bytes() == image.size());
  Check(h.data_offset() + h.data_bytes() == image.size());
  uint64_t cursor = 0;
  for (const TensorInfo& t : h.tensors()) {
    Check(t.begin == cursor);
    Check(t.begin <= t.end && t.end <= h.data_bytes());
    Check(t.bytes() == t.elements() * DtypeSize(t.dtype));
    Check(h.Find(t.name) == &t);
    cursor = t.end;
    if (t.bytes() > 0) {
      // Touch the first and last byte: ASan reports any range outside.
      const std::byte* p = image.data() + h.data_offset() + t.begin;
      volatile std::byte first = p[0];
      volatile std::byte last = p[t.bytes() - 1];
      (void)first;
      (void)last;
    }
  }
  Check(cursor == h.data_bytes());
}

void CheckRewrite(const SafetensorsHeader& h,
                  std::span<const std::byte> image) {
  const std::span<const std::byte> data =
      image.subspan(h.data_offset(), h.data_bytes());
  SafetensorsWriter writer;
  for (const auto& [key, value] : h.metadata()) writer.SetMetadata(key, value);
  for (const TensorInfo& t : h.tensors()) {
    writer.AddTensor(t.name, t.dtype, t.shape,
                     data.subspan(t.begin, t.bytes()));
  }
  const std::vector<std::byte> copy = writer.WriteToMemory();
  const SafetensorsHeader again = ParseSafetensors(copy, "rewrite");
  Check(again.tensors().size() == h.tensors().size());
  Check(again.metadata() == h.metadata());
  Check(again.header_bytes() % 8 == 0);
  for (const TensorInfo& t : h.tensors()) {
    const TensorInfo* u = again.Find(t.name);
    Check(u != nullptr);
    Check(u->dtype == t.dtype && u->shape == t.shape &&
          u->bytes() == t.bytes());
    Check(u->bytes() == 0 ||
          std::memcmp(copy.data() + again.data_offset() + u->begin,
                      data.data() + t.begin, t.bytes()) == 0);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* bytes, size_t size) {
  const std::span<const std::byte> image(
      reinterpret_cast<const std::byte*>(bytes), size);
  SafetensorsHeader header;
  try {
    header = ParseSafetensors(image, "fuzz");
  } catch (const FormatError& e) {
    const std::string what = e.what();
    Check(what.rfind("fuzz: ", 0) == 0);
    Check(what.find('\n') == std::string::npos);
    Check(what.size() < 2048);
    return 0;
  }
  CheckInvariants(header, image);
  CheckRewrite(header, image);
  return 0;
}
