// Writes safetensors files, for tests, tools and benchmarks.
//
// Tensor bytes are streamed: each tensor's bytes come from a fill callback a
// buffer at a time, so a writer can produce a file of many GiB while holding
// only one buffer. The output is what the reference implementation writes:
// the JSON header ("__metadata__" first when there is metadata, then the
// tensors in data order) padded with spaces to a multiple of 8 bytes, so the
// data buffer starts 8-aligned; tensors laid out by decreasing dtype size (in
// the order added among equal sizes), so each tensor is aligned to its element
// size within the data buffer. Every file written is accepted by the reader.
//
// Not thread-safe; a writer is a builder used by one thread.
#ifndef MODELCACHE_WEIGHTS_SAFETENSORS_WRITER_H_
#define MODELCACHE_WEIGHTS_SAFETENSORS_WRITER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "modelcache/weights/safetensors.h"

namespace modelcache::weights {

// Produces a tensor's bytes: fills `out` with bytes [offset, offset +
// out.size()) of the tensor. Called with increasing, contiguous offsets.
using FillFn = std::function<void(uint64_t offset, std::span<std::byte> out)>;

// A deterministic pseudo-random pattern: fills `out` with bytes [offset,
// offset + out.size()) of the endless byte stream for `seed`. Any two
// distinct 8-byte-aligned words of one stream differ with high probability,
// so misplaced or swapped chunks show.
void FillPattern(uint64_t seed, uint64_t offset, std::span<std::byte> out);
// A FillFn for FillPattern(seed, ...).
FillFn PatternFill(uint64_t seed);

class SafetensorsWriter {
 public:
  // Adds a "__metadata__" entry (replacing an earlier value for `key`).
  SafetensorsWriter& SetMetadata(const std::string& key,
                                 const std::string& value);

  // Adds a tensor whose bytes come from `fill`. Throws Error kInvalidArgument
  // for a duplicate name, the name "__metadata__", a null `fill`, or
  // a byte size that does not fit in 64 bits (counting the nonzero dimensions
  // only, as the reader does). Names and metadata must be valid UTF-8.
  SafetensorsWriter& AddTensor(const std::string& name, Dtype dtype,
                               std::vector<uint64_t> shape, FillFn fill);
  // Adds a tensor whose bytes are `bytes` (not copied: they must outlive the
  // writes). Throws Error kInvalidArgument as above, and when bytes.size() is
  // not dtype size x product(shape).
  SafetensorsWriter& AddTensor(const std::string& name, Dtype dtype,
                               std::vector<uint64_t> shape,
                               std::span<const std::byte> bytes);

  // The header text as written, padding included.
  std::string HeaderJson() const;
  // The data buffer's size.
  uint64_t data_bytes() const;
  // The size of the file Write produces.
  uint64_t file_bytes() const;

  // Writes the file at `path` (created or truncated), passing tensor bytes
  // through one buffer of `buffer_bytes`. Returns the file size. Throws
  // IoError; a partly written file is removed.
  uint64_t Write(const std::string& path,
                 size_t buffer_bytes = size_t{4} << 20) const;
  // The whole file image in memory, for small files.
  std::vector<std::byte> WriteToMemory() const;

 private:
  struct Entry {
    std::string name;
    Dtype dtype;
    std::vector<uint64_t> shape;
    uint64_t bytes;
    FillFn fill;
  };

  // Entries in data order.
  std::vector<const Entry*> Layout() const;
  // Streams the header and every tensor's bytes to `sink`.
  void Emit(size_t buffer_bytes,
            const std::function<void(std::span<const std::byte>)>& sink) const;

  std::map<std::string, std::string> metadata_;
  std::vector<Entry> entries_;
  std::unordered_set<std::string> names_;
};

}  // namespace modelcache::weights

#endif  // MODELCACHE_WEIGHTS_SAFETENSORS_WRITER_H_
