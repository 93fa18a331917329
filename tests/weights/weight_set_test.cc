// Loading safetensors files (mmap and parallel pread) and writing them.
//
// Round trips: files from SafetensorsWriter load byte-identical through mmap
// and through pread with 1..4 threads and chunk sizes from 1 byte up, so the
// chunking is exercised with many more chunks than threads, chunks that split
// tensors and tensors that split chunks. The real files load identically by
// both paths. Errors: missing files, directories, truncated files, bad
// options, unknown tensor names.

#include "modelcache/weights/weight_set.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "modelcache/base/errors.h"
#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/safetensors_writer.h"

namespace modelcache::weights {
namespace {

using ::modelcache::testing::ReadFile;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kMiB = uint64_t{1} << 20;

const std::filesystem::path kWeightsDir =
    std::filesystem::path(MODELCACHE_SHARED_DATA) / "weights";

std::vector<std::byte> Pattern(uint64_t seed, uint64_t bytes) {
  std::vector<std::byte> out(bytes);
  FillPattern(seed, 0, out);
  return out;
}

bool SameBytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

class WeightSetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "weight_set_test.XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string PathFor(const std::string& name) const {
    return (dir_ / name).string();
  }

  // Tensors of every dtype size, a scalar, zero-size tensors, an odd-sized
  // one; each tensor's bytes are FillPattern(seed = its index).
  SafetensorsWriter MixedWriter() const {
    SafetensorsWriter w;
    w.SetMetadata("format", "pt").SetMetadata("source", "weight_set_test");
    w.AddTensor("embed", Dtype::kF32, {97, 33}, PatternFill(0));
    w.AddTensor("bias", Dtype::kBF16, {33}, PatternFill(1));
    w.AddTensor("step", Dtype::kI64, {}, PatternFill(2));
    w.AddTensor("mask", Dtype::kBool, {1001}, PatternFill(3));
    w.AddTensor("empty", Dtype::kF64, {0, 12}, PatternFill(4));
    w.AddTensor("quant", Dtype::kF8E5M2, {7, 3, 5}, PatternFill(5));
    w.AddTensor("ids", Dtype::kU64, {250}, PatternFill(6));
    w.AddTensor("none", Dtype::kU8, {0}, PatternFill(7));
    return w;
  }
  static uint64_t SeedOf(const std::string& name) {
    const char* names[] = {"embed", "bias",  "step", "mask",
                           "empty", "quant", "ids",  "none"};
    for (uint64_t i = 0; i < 8; ++i) {
      if (name == names[i]) return i;
    }
    ADD_FAILURE() << "unknown tensor " << name;
    return 0;
  }

  void ExpectMixedContents(const WeightSet& set) {
    EXPECT_EQ(set.tensors().size(), 8u);
    EXPECT_EQ(set.metadata().at("format"), "pt");
    for (const TensorInfo& t : set.tensors()) {
      SCOPED_TRACE(t.name);
      const std::span<const std::byte> bytes = set.data(t.name);
      EXPECT_EQ(bytes.size(), t.bytes());
      EXPECT_TRUE(SameBytes(bytes, Pattern(SeedOf(t.name), t.bytes())));
    }
  }

  std::filesystem::path dir_;
};

// ---- writer ----

TEST_F(WeightSetTest, WriterPadsTheHeaderAndAlignsTensors) {
  const SafetensorsWriter w = MixedWriter();
  const std::string header = w.HeaderJson();
  EXPECT_EQ(header.size() % 8, 0u);
  EXPECT_EQ(header.rfind("{\"__metadata__\":{", 0), 0u) << header;
  const std::string path = PathFor("mixed.safetensors");
  EXPECT_EQ(w.Write(path), w.file_bytes());
  EXPECT_EQ(std::filesystem::file_size(path), w.file_bytes());

  const SafetensorsHeader h = ReadSafetensorsHeader(path);
  EXPECT_EQ(h.header_bytes(), header.size());
  EXPECT_EQ(h.data_offset() % 8, 0u);
  EXPECT_EQ(h.data_bytes(), w.data_bytes());
  for (const TensorInfo& t : h.tensors()) {
    EXPECT_EQ(t.begin % DtypeSize(t.dtype), 0u) << t.name;
  }
  EXPECT_THAT(h.Find("step")->shape, ElementsAre());
  EXPECT_THAT(h.Find("quant")->shape, ElementsAre(7, 3, 5));
  EXPECT_EQ(h.metadata().size(), 2u);

  // The in-memory image is the file, byte for byte.
  const std::vector<std::byte> image = w.WriteToMemory();
  EXPECT_TRUE(SameBytes(image, ReadFile(path)));
  EXPECT_EQ(ParseSafetensors(image, "mem").tensors().size(), 8u);
}

TEST_F(WeightSetTest, WriterWithoutMetadataOrTensors) {
  SafetensorsWriter w;
  const std::string path = PathFor("empty.safetensors");
  EXPECT_EQ(w.Write(path), 16u);  // 8 + "{}" padded to 8
  const SafetensorsHeader h = ReadSafetensorsHeader(path);
  EXPECT_FALSE(h.has_metadata());
  EXPECT_TRUE(h.tensors().empty());
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kPread}) {
    LoadOptions options;
    options.mode = mode;
    const WeightSet set = WeightSet::Open(path, options);
    EXPECT_TRUE(set.data().empty());
    EXPECT_EQ(set.data_bytes(), 0u);
  }
}

TEST_F(WeightSetTest, WriterCopiesSpansAndRejectsBadTensors) {
  const std::vector<std::byte> bytes = Pattern(9, 24);
  SafetensorsWriter w;
  w.AddTensor("t", Dtype::kF32, {2, 3}, std::span<const std::byte>(bytes));
  EXPECT_THROW(w.AddTensor("t", Dtype::kU8, {1}, PatternFill(0)), Error);
  EXPECT_THROW(w.AddTensor("__metadata__", Dtype::kU8, {1}, PatternFill(0)),
               Error);
  EXPECT_THROW(w.AddTensor("n", Dtype::kU8, {1}, FillFn()), Error);
  EXPECT_THROW(
      w.AddTensor("s", Dtype::kF32, {2, 2}, std::span<const std::byte>(bytes)),
      Error);
  EXPECT_THROW(
      w.AddTensor("big", Dtype::kF64, {uint64_t{1} << 62}, PatternFill(0)),
      Error);
  EXPECT_THROW(
      w.AddTensor("big0", Dtype::kU8, {0, uint64_t{1} << 32, uint64_t{1} << 32},
                  PatternFill(0)),
      Error);

  const std::string path = PathFor("span.safetensors");
  w.Write(path, /*buffer_bytes=*/5);
  const WeightSet set = WeightSet::Open(path);
  EXPECT_TRUE(SameBytes(set.data("t"), bytes));
}

TEST_F(WeightSetTest, WriteToAnUnwritablePlaceThrowsIoError) {
  SafetensorsWriter w;
  try {
    w.Write(PathFor("no/such/dir/x.safetensors"));
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_THAT(e.what(), HasSubstr("cannot create"));
  }
}

TEST(FillPatternTest, AnyOffsetAndLengthGivesTheSameStream) {
  const std::vector<std::byte> whole = Pattern(42, 1000);
  for (uint64_t offset : {0, 1, 7, 8, 9, 500, 993}) {
    for (uint64_t len : {0, 1, 3, 8, 16, 7}) {
      if (offset + len > whole.size()) continue;
      std::vector<std::byte> part(len);
      FillPattern(42, offset, part);
      EXPECT_TRUE(SameBytes(
          part, std::span<const std::byte>(whole).subspan(offset, len)))
          << offset << "+" << len;
    }
  }
  EXPECT_FALSE(SameBytes(Pattern(1, 64), Pattern(2, 64)));
  // Words differ along the stream (no short period).
  std::vector<std::byte> a(8), b(8);
  FillPattern(3, 0, a);
  FillPattern(3, 4096, b);
  EXPECT_FALSE(SameBytes(a, b));
}

// ---- round trips ----

TEST_F(WeightSetTest, MmapRoundTripIsZeroCopyAndByteIdentical) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  for (bool populate : {false, true}) {
    LoadOptions options;
    options.mode = LoadMode::kMmap;
    options.mmap_populate = populate;
    const WeightSet set = WeightSet::Open(path, options);
    EXPECT_EQ(set.mode(), LoadMode::kMmap);
    EXPECT_EQ(set.path(), path);
    ExpectMixedContents(set);
    // The data buffer is the file's tail.
    const std::vector<std::byte> file = ReadFile(path);
    EXPECT_TRUE(SameBytes(set.data(), std::span<const std::byte>(file).subspan(
                                          set.header().data_offset())));
  }
}

TEST_F(WeightSetTest, PreadRoundTripAtEveryThreadCountAndChunkSize) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  const std::vector<std::byte> file = ReadFile(path);
  for (int threads = 1; threads <= 4; ++threads) {
    for (uint64_t chunk : {uint64_t{1}, uint64_t{7}, uint64_t{64},
                           uint64_t{1000}, uint64_t{4096}, 8 * kMiB}) {
      SCOPED_TRACE(::testing::Message()
                   << threads << " threads, chunk " << chunk);
      LoadOptions options;
      options.mode = LoadMode::kPread;
      options.threads = threads;
      options.chunk_bytes = chunk;
      const WeightSet set = WeightSet::Open(path, options);
      EXPECT_EQ(set.mode(), LoadMode::kPread);
      ExpectMixedContents(set);
      EXPECT_TRUE(
          SameBytes(set.data(), std::span<const std::byte>(file).subspan(
                                    set.header().data_offset())));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(set.data().data()) % 4096, 0u);
    }
  }
}

TEST_F(WeightSetTest, LargerFileLoadsIdenticallyByBothPaths) {
  // 24 MiB + change: the pread buffer gets 2 MiB alignment; many chunks.
  const uint64_t rows = 3 * 1024 + 1;
  SafetensorsWriter w;
  w.AddTensor("a", Dtype::kF32, {rows, 2048}, PatternFill(100));
  w.AddTensor("b", Dtype::kF16, {rows}, PatternFill(101));
  w.AddTensor("c", Dtype::kU8, {12345}, PatternFill(102));
  const std::string path = PathFor("large.safetensors");
  w.Write(path, /*buffer_bytes=*/3 * kMiB + 17);

  LoadOptions mmap_options;
  const WeightSet mapped = WeightSet::Open(path, mmap_options);
  LoadOptions pread_options;
  pread_options.mode = LoadMode::kPread;
  pread_options.threads = 4;
  pread_options.chunk_bytes = kMiB + 3;
  const WeightSet read = WeightSet::Open(path, pread_options);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(read.data().data()) % (2 * kMiB), 0u);
  EXPECT_TRUE(SameBytes(mapped.data(), read.data()));
  EXPECT_TRUE(SameBytes(read.data("a"), Pattern(100, rows * 2048 * 4)));
  EXPECT_TRUE(SameBytes(read.data("b"), Pattern(101, rows * 2)));
  EXPECT_TRUE(SameBytes(read.data("c"), Pattern(102, 12345)));
}

TEST_F(WeightSetTest, ExplicitBufferAlignment) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  for (size_t alignment : {size_t{8}, size_t{64}, size_t{65536}}) {
    LoadOptions options;
    options.mode = LoadMode::kPread;
    options.buffer_alignment = alignment;
    const WeightSet set = WeightSet::Open(path, options);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(set.data().data()) % alignment, 0u);
    ExpectMixedContents(set);
  }
}

TEST_F(WeightSetTest, RealFilesLoadIdenticallyByBothPaths) {
  int loaded = 0;
  for (const auto& entry :
       std::filesystem::recursive_directory_iterator(kWeightsDir)) {
    if (entry.path().extension() != ".safetensors") continue;
    if (entry.path().filename() == "safetensors_abuse_attempt_1.safetensors") {
      EXPECT_THROW(WeightSet::Open(entry.path().string()), FormatError);
      continue;
    }
    SCOPED_TRACE(entry.path().string());
    const std::vector<std::byte> file = ReadFile(entry.path());
    const WeightSet mapped = WeightSet::Open(entry.path().string());
    LoadOptions options;
    options.mode = LoadMode::kPread;
    options.threads = 3;
    options.chunk_bytes = 4096;
    const WeightSet read = WeightSet::Open(entry.path().string(), options);
    const auto tail =
        std::span<const std::byte>(file).subspan(mapped.header().data_offset());
    EXPECT_TRUE(SameBytes(mapped.data(), tail));
    EXPECT_TRUE(SameBytes(read.data(), tail));
    for (const TensorInfo& t : read.tensors()) {
      EXPECT_TRUE(SameBytes(read.data(t.name), mapped.data(t.name)));
    }
    ++loaded;
  }
  EXPECT_GE(loaded, 24);
}

TEST_F(WeightSetTest, MnistScalarsReadThroughBothPaths) {
  const std::string path = (kWeightsDir / "burn/mnist.safetensors").string();
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kPread}) {
    LoadOptions options;
    options.mode = mode;
    const WeightSet set = WeightSet::Open(path, options);
    EXPECT_EQ(set.tensors().size(), 20u);
    int64_t value = 0;
    const auto bytes = set.data("norm1.num_batches_tracked");
    ASSERT_EQ(bytes.size(), 8u);
    std::memcpy(&value, bytes.data(), 8);
    EXPECT_EQ(value, 7504) << LoadModeName(mode);
  }
}

// ---- lifetime, identity, concurrency ----

TEST_F(WeightSetTest, SpansSurviveAMove) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kPread}) {
    LoadOptions options;
    options.mode = mode;
    WeightSet first = WeightSet::Open(path, options);
    const std::span<const std::byte> embed = first.data("embed");
    WeightSet second = std::move(first);
    EXPECT_EQ(second.data("embed").data(), embed.data());
    WeightSet third = WeightSet::Open(path);
    third = std::move(second);
    EXPECT_TRUE(SameBytes(embed, Pattern(0, embed.size())));
    ExpectMixedContents(third);
  }
}

TEST_F(WeightSetTest, IdentityNamesTheFile) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  const WeightSet a = WeightSet::Open(path);
  LoadOptions options;
  options.mode = LoadMode::kPread;
  const WeightSet b = WeightSet::Open(path, options);
  EXPECT_EQ(a.identity(), b.identity());
  EXPECT_EQ(a.identity().size, std::filesystem::file_size(path));
  MixedWriter().Write(PathFor("other.safetensors"));
  EXPECT_NE(WeightSet::Open(PathFor("other.safetensors")).identity().inode,
            a.identity().inode);
}

TEST_F(WeightSetTest, ManyThreadsReadOneSet) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  const WeightSet set = WeightSet::Open(path);
  std::vector<std::thread> readers;
  std::atomic<int> mismatches{0};
  for (int i = 0; i < 4; ++i) {
    readers.emplace_back([&] {
      for (int round = 0; round < 20; ++round) {
        if (!SameBytes(set.data("embed"), Pattern(0, 97 * 33 * 4))) {
          ++mismatches;
        }
      }
    });
  }
  for (auto& t : readers) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ---- errors ----

TEST_F(WeightSetTest, MissingFileDirectoryAndSpecialFile) {
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kPread}) {
    LoadOptions options;
    options.mode = mode;
    try {
      WeightSet::Open(PathFor("missing.safetensors"), options);
      FAIL();
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), ENOENT);
      EXPECT_EQ(std::string(e.what()),
                PathFor("missing.safetensors") +
                    ": cannot open: No such file or directory");
    }
    try {
      WeightSet::Open(dir_.string(), options);
      FAIL();
    } catch (const IoError& e) {
      EXPECT_EQ(e.error_number(), EISDIR);
      EXPECT_EQ(std::string(e.what()), dir_.string() + ": is a directory");
    }
    EXPECT_THROW(WeightSet::Open("/dev/null", options), IoError);
  }
}

TEST_F(WeightSetTest, TruncatedFileIsAFormatError) {
  const std::string path = PathFor("mixed.safetensors");
  const uint64_t size = MixedWriter().Write(path);
  std::filesystem::resize_file(path, size - 3);
  for (LoadMode mode : {LoadMode::kMmap, LoadMode::kPread}) {
    LoadOptions options;
    options.mode = mode;
    try {
      WeightSet::Open(path, options);
      FAIL();
    } catch (const FormatError& e) {
      EXPECT_THAT(e.what(), HasSubstr("run past the data buffer"));
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  std::filesystem::resize_file(path, 5);
  EXPECT_THROW(WeightSet::Open(path), FormatError);
  std::filesystem::resize_file(path, 0);
  EXPECT_THROW(WeightSet::Open(path), FormatError);
}

TEST_F(WeightSetTest, FileWithExtraBytesIsAFormatError) {
  const std::string path = PathFor("mixed.safetensors");
  const uint64_t size = MixedWriter().Write(path);
  std::filesystem::resize_file(path, size + 1);
  EXPECT_THROW(WeightSet::Open(path), FormatError);
}

TEST_F(WeightSetTest, BadOptionsAreRejected) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  LoadOptions options;
  options.mode = LoadMode::kPread;
  options.threads = 0;
  EXPECT_THROW(WeightSet::Open(path, options), Error);
  options.threads = 1;
  options.chunk_bytes = 0;
  EXPECT_THROW(WeightSet::Open(path, options), Error);
  options.chunk_bytes = 1;
  options.buffer_alignment = 3;
  EXPECT_THROW(WeightSet::Open(path, options), Error);
  options.buffer_alignment = 4;
  EXPECT_THROW(WeightSet::Open(path, options), Error);
}

TEST_F(WeightSetTest, UnknownTensorNameIsNotFound) {
  const std::string path = PathFor("mixed.safetensors");
  MixedWriter().Write(path);
  const WeightSet set = WeightSet::Open(path);
  try {
    set.data("nope\n");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_EQ(std::string(e.what()), path + ": no tensor named 'nope\\n'");
  }
}

TEST(LoadModeTest, Names) {
  EXPECT_STREQ(LoadModeName(LoadMode::kMmap), "mmap");
  EXPECT_STREQ(LoadModeName(LoadMode::kPread), "pread");
}

}  // namespace
}  // namespace modelcache::weights
