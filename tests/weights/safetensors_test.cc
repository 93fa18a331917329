// The safetensors header parser: real files and hand-made invalid ones.
//
// Real files (../shared/data/weights): every one parses, from disk and from
// memory alike, except the deliberately malformed one, which fails with one
// clear line; known contents (dtypes, metadata, scalar I64 values) are checked
// byte for byte. Invalid headers: one case per validation rule, each asserting
// that the message names the source and the problem and is a single line.
// Valid corner cases: scalars, zero-size tensors, empty headers, padding,
// UTF-8 names.

#include "modelcache/weights/safetensors.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "../test_util.h"

namespace modelcache::weights {
namespace {

using ::modelcache::testing::ReadFile;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const std::filesystem::path kWeightsDir =
    std::filesystem::path(MODELCACHE_SHARED_DATA) / "weights";
const char kAbuseFile[] = "syoyo/safetensors_abuse_attempt_1.safetensors";

// A file image: the 8-byte little-endian length of `json` (or `length` when
// given), `json`, then `data_bytes` bytes of data.
std::vector<std::byte> Image(const std::string& json, uint64_t data_bytes,
                             std::optional<uint64_t> length = std::nullopt) {
  const uint64_t n = length.value_or(json.size());
  std::vector<std::byte> image;
  for (int i = 0; i < 8; ++i) image.push_back(std::byte(n >> (8 * i)));
  for (char c : json) image.push_back(static_cast<std::byte>(c));
  image.resize(image.size() + data_bytes, std::byte{0x5A});
  return image;
}

SafetensorsHeader Parse(const std::vector<std::byte>& image) {
  return ParseSafetensors(image, "mem.safetensors");
}

// The message of the FormatError that parsing `image` throws, or a failure.
std::string ParseError(const std::vector<std::byte>& image) {
  try {
    Parse(image);
  } catch (const FormatError& e) {
    return e.what();
  }
  ADD_FAILURE() << "parsed without error";
  return "";
}

std::vector<std::filesystem::path> RealFiles() {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::recursive_directory_iterator(kWeightsDir, ec)) {
    if (entry.path().extension() == ".safetensors") {
      files.push_back(entry.path());
    }
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string Relative(const std::filesystem::path& p) {
  return std::filesystem::relative(p, kWeightsDir).string();
}

// ---- real files ----

TEST(SafetensorsRealFilesTest, TheSharedFolderHoldsTheExpectedFiles) {
  const auto files = RealFiles();
  ASSERT_GE(files.size(), 25u) << "missing " << kWeightsDir;
  std::set<std::string> names;
  for (const auto& f : files) names.insert(Relative(f));
  EXPECT_TRUE(names.count(kAbuseFile));
  EXPECT_TRUE(names.count("burn/mnist.safetensors"));
  EXPECT_TRUE(names.count("hf_safetensors_samples/overall.safetensors"));
}

TEST(SafetensorsRealFilesTest, EveryValidFileParsesFromDiskAndMemory) {
  int parsed = 0;
  for (const auto& path : RealFiles()) {
    if (Relative(path) == kAbuseFile) continue;
    SCOPED_TRACE(Relative(path));
    SafetensorsHeader from_disk;
    ASSERT_NO_THROW(from_disk = ReadSafetensorsHeader(path.string()));
    const std::vector<std::byte> image = ReadFile(path);
    SafetensorsHeader from_memory;
    ASSERT_NO_THROW(from_memory = ParseSafetensors(image, path.string()));

    EXPECT_EQ(from_disk.file_bytes(), image.size());
    EXPECT_EQ(from_memory.header_bytes(), from_disk.header_bytes());
    EXPECT_EQ(from_memory.data_bytes(), from_disk.data_bytes());
    EXPECT_EQ(from_memory.metadata(), from_disk.metadata());
    ASSERT_EQ(from_memory.tensors().size(), from_disk.tensors().size());
    EXPECT_FALSE(from_disk.tensors().empty());
    // The tensors tile the data buffer, in order, and are found by name.
    uint64_t cursor = 0;
    for (size_t i = 0; i < from_disk.tensors().size(); ++i) {
      const TensorInfo& t = from_disk.tensors()[i];
      EXPECT_EQ(t.name, from_memory.tensors()[i].name);
      EXPECT_EQ(t.begin, cursor);
      EXPECT_EQ(t.bytes(), t.elements() * DtypeSize(t.dtype));
      EXPECT_EQ(from_disk.Find(t.name), &t);
      cursor = t.end;
    }
    EXPECT_EQ(cursor, from_disk.data_bytes());
    ++parsed;
  }
  EXPECT_GE(parsed, 24);
}

TEST(SafetensorsRealFilesTest, TheAbuseAttemptFailsWithOneClearLine) {
  const std::string path = (kWeightsDir / kAbuseFile).string();
  for (int from_memory = 0; from_memory < 2; ++from_memory) {
    SCOPED_TRACE(from_memory ? "memory" : "disk");
    try {
      if (from_memory) {
        ParseSafetensors(ReadFile(path), path);
      } else {
        ReadSafetensorsHeader(path);
      }
      FAIL() << "accepted a malformed file";
    } catch (const FormatError& e) {
      const std::string what = e.what();
      EXPECT_EQ(what, path +
                          ": header length 1000 exceeds file size 88 (8 + "
                          "1000 bytes needed)");
      EXPECT_EQ(e.path(), path);
      EXPECT_THAT(e.problem(), HasSubstr("header length 1000"));
    }
  }
}

TEST(SafetensorsRealFilesTest, OverallHasNineDtypesAndMetadata) {
  const std::string path =
      (kWeightsDir / "hf_safetensors_samples/overall.safetensors").string();
  const SafetensorsHeader h = ReadSafetensorsHeader(path);
  EXPECT_TRUE(h.has_metadata());
  EXPECT_EQ(h.metadata(), (std::map<std::string, std::string>{{"test", "a"}}));
  ASSERT_EQ(h.tensors().size(), 9u);
  std::set<Dtype> dtypes;
  for (const TensorInfo& t : h.tensors()) {
    dtypes.insert(t.dtype);
    EXPECT_THAT(t.shape, ElementsAre(6));
  }
  EXPECT_EQ(dtypes, (std::set<Dtype>{Dtype::kU8, Dtype::kI8, Dtype::kU16,
                                     Dtype::kI16, Dtype::kU32, Dtype::kI32,
                                     Dtype::kF16, Dtype::kF32, Dtype::kF64}));
  // Every tensor holds -3..2 in its dtype.
  const std::vector<std::byte> image = ReadFile(path);
  const std::byte* data = image.data() + h.data_offset();
  const TensorInfo* i32 = h.Find("i");
  ASSERT_NE(i32, nullptr);
  EXPECT_EQ(i32->dtype, Dtype::kI32);
  int32_t ints[6];
  std::memcpy(ints, data + i32->begin, sizeof(ints));
  EXPECT_THAT(ints, ElementsAre(-3, -2, -1, 0, 1, 2));
  const TensorInfo* f64 = h.Find("d");
  ASSERT_NE(f64, nullptr);
  double doubles[6];
  std::memcpy(doubles, data + f64->begin, sizeof(doubles));
  EXPECT_THAT(doubles, ElementsAre(-3.0, -2.0, -1.0, 0.0, 1.0, 2.0));
}

TEST(SafetensorsRealFilesTest, MnistHasTwentyTensorsWithI64Scalars) {
  const std::string path = (kWeightsDir / "burn/mnist.safetensors").string();
  const SafetensorsHeader h = ReadSafetensorsHeader(path);
  EXPECT_FALSE(h.has_metadata());
  EXPECT_EQ(h.tensors().size(), 20u);
  const std::vector<std::byte> image = ReadFile(path);
  int scalars = 0;
  for (const TensorInfo& t : h.tensors()) {
    if (!t.shape.empty()) continue;
    ++scalars;
    EXPECT_EQ(t.dtype, Dtype::kI64) << t.name;
    EXPECT_EQ(t.elements(), 1u);
    EXPECT_EQ(t.bytes(), 8u);
    int64_t value;
    std::memcpy(&value, image.data() + h.data_offset() + t.begin, 8);
    EXPECT_EQ(value, 7504) << t.name;
  }
  EXPECT_EQ(scalars, 2);
  const TensorInfo* fc1 = h.Find("fc1.weight");
  ASSERT_NE(fc1, nullptr);
  EXPECT_EQ(fc1->dtype, Dtype::kF32);
  EXPECT_THAT(fc1->shape, ElementsAre(32, 11616));
  EXPECT_EQ(fc1->bytes(), 32u * 11616 * 4);
}

TEST(SafetensorsRealFilesTest, BooleanFileHoldsBoolTensor) {
  const SafetensorsHeader h = ReadSafetensorsHeader(
      (kWeightsDir / "burn/boolean.safetensors").string());
  ASSERT_EQ(h.tensors().size(), 1u);
  EXPECT_EQ(h.tensors()[0].dtype, Dtype::kBool);
  EXPECT_THAT(h.tensors()[0].shape, ElementsAre(3));
}

// ---- dtypes ----

TEST(DtypeTest, NamesAndSizesRoundTrip) {
  const std::vector<std::pair<std::string, uint64_t>> expected = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"F64", 8}, {"I64", 8},     {"U64", 8}};
  for (const auto& [name, size] : expected) {
    const std::optional<Dtype> dtype = ParseDtype(name);
    ASSERT_TRUE(dtype.has_value()) << name;
    EXPECT_EQ(DtypeName(*dtype), name);
    EXPECT_EQ(DtypeSize(*dtype), size) << name;
  }
  EXPECT_FALSE(ParseDtype("f32"));
  EXPECT_FALSE(ParseDtype("F128"));
  EXPECT_FALSE(ParseDtype(""));
}

// ---- invalid headers: one case per rule ----

struct InvalidCase {
  const char* rule;
  std::vector<std::byte> image;
  const char* message;  // a substring the error must contain
};

const std::string kOk =
    R"("ok":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})";

std::vector<InvalidCase> InvalidCases() {
  return {
      {"file shorter than the length",
       {std::byte{1}, std::byte{0}},
       "file is 2 bytes, too small for the 8-byte header length"},
      {"empty file", {}, "file is 0 bytes"},
      {"header length over the limit", Image("{}", 0, uint64_t{101} << 20),
       "header length 105906176 exceeds the limit of 104857600 bytes"},
      {"header length over the file", Image("{}", 0, 3),
       "header length 3 exceeds file size 10"},
      {"header length 2^64 - 1", Image("{}", 0, ~uint64_t{0}),
       "header length 18446744073709551615 exceeds the limit"},
      {"empty header", Image("", 0), "header is empty"},
      {"leading whitespace", Image(" {}", 0), "does not start with '{'"},
      {"top-level array", Image("[]", 0), "does not start with '{'"},
      {"truncated JSON", Image(R"({"a":{"dtype")", 0),
       "header is not valid JSON"},
      {"trailing garbage", Image("{} x", 0), "header is not valid JSON"},
      {"two objects", Image("{}{}", 0), "header is not valid JSON"},
      {"NUL padding", Image(std::string("{}\0\0", 4), 0),
       "header is not valid JSON"},
      {"garbage after a NUL", Image(std::string("{}\0{\"a\":1}", 11), 0),
       "header is not valid JSON (at byte 2): NUL byte"},
      {"invalid UTF-8", Image("{\"\xff\":1}", 0), "header is not valid JSON"},
      {"comment", Image("{/* c */}", 0), "header is not valid JSON"},
      {"tensor not an object", Image(R"({"a":1})", 0),
       "tensor 'a' must be an object, found a number"},
      {"tensor is an array", Image(R"({"a":[]})", 0),
       "tensor 'a' must be an object, found an array"},
      {"unknown dtype",
       Image(R"({"a":{"dtype":"F128","shape":[1],"data_offsets":[0,1]}})", 1),
       "tensor 'a': unknown dtype 'F128'"},
      {"lower-case dtype",
       Image(R"({"a":{"dtype":"f32","shape":[1],"data_offsets":[0,4]}})", 4),
       "tensor 'a': unknown dtype 'f32'"},
      {"dtype not a string",
       Image(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4),
       "tensor 'a': dtype must be a string, found a number"},
      {"dtype nested",
       Image(R"({"a":{"dtype":[["F32"]],"shape":[1],"data_offsets":[0,4]}})",
             4),
       "tensor 'a': dtype must be a string, found an array"},
      {"missing dtype", Image(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4),
       "tensor 'a': missing dtype"},
      {"missing shape",
       Image(R"({"a":{"dtype":"F32","data_offsets":[0,4]}})", 4),
       "tensor 'a': missing shape"},
      {"missing data_offsets", Image(R"({"a":{"dtype":"F32","shape":[1]}})", 4),
       "tensor 'a': missing data_offsets"},
      {"extra field",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})",
             4),
       "tensor 'a': unexpected field 'x'"},
      {"duplicate field",
       Image(
           R"({"a":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
           4),
       "tensor 'a': duplicate field 'dtype'"},
      {"shape not an array",
       Image(R"({"a":{"dtype":"F32","shape":1,"data_offsets":[0,4]}})", 4),
       "tensor 'a': shape must be an array of non-negative integers, found a "
       "number"},
      {"negative dimension",
       Image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
       "tensor 'a': shape must hold non-negative integers, found a negative "
       "number"},
      {"fractional dimension",
       Image(R"({"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}})", 4),
       "shape must hold non-negative integers, found a number that is not an "
       "integer"},
      {"dimension above 2^64 - 1",
       Image(
           R"({"a":{"dtype":"F32","shape":[18446744073709551616],"data_offsets":[0,4]}})",
           4),
       "shape must hold non-negative integers"},
      {"string dimension",
       Image(R"({"a":{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}})", 4),
       "shape must hold non-negative integers, found a string"},
      {"nested shape",
       Image(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", 4),
       "shape must hold non-negative integers, found an array"},
      {"data_offsets not an array",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":"0,4"}})", 4),
       "tensor 'a': data_offsets must be [begin, end] of non-negative "
       "integers, found a string"},
      {"one offset",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4]}})", 4),
       "tensor 'a': data_offsets must be [begin, end], found 1 number"},
      {"three offsets",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}})", 8),
       "tensor 'a': data_offsets must be [begin, end], found more than 2"},
      {"negative offset",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 4),
       "data_offsets must hold non-negative integers, found a negative "
       "number"},
      {"null offset",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[null,4]}})", 4),
       "data_offsets must hold non-negative integers, found null"},
      {"begin after end",
       Image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", 4),
       "tensor 'a': data_offsets [4, 0] have begin > end"},
      {"end past the data",
       Image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
       "tensor 'a': data_offsets [0, 8] run past the data buffer of 4 bytes"},
      {"end near 2^64",
       Image(
           R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}})",
           1),
       "run past the data buffer of 1 bytes"},
      {"size mismatch",
       Image(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})",
             20),
       "tensor 'a': F32 x shape [2, 3] is 24 bytes but data_offsets [0, 20] "
       "span 20"},
      {"scalar with no bytes",
       Image(R"({"a":{"dtype":"I64","shape":[],"data_offsets":[0,0]}})", 0),
       "tensor 'a': I64 x shape [] is 8 bytes"},
      {"element count overflow",
       Image(
           R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,0]}})",
           0),
       "tensor 'a': shape [4294967296, 4294967296] has more than 2^64 "
       "elements"},
      {"overflow hidden behind a zero",
       Image(
           R"({"a":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})",
           0),
       "has more than 2^64 elements"},
      {"byte count overflow",
       Image(
           R"({"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}})",
           0),
       "tensor 'a': F64 x shape [4611686018427387904] is more than 2^64 bytes"},
      {"overlap",
       Image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
             6),
       "tensor 'b' data_offsets [2, 6] overlap tensor 'a' [0, 4]"},
      {"same range twice",
       Image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
             4),
       "tensor 'b' data_offsets [0, 4] overlap tensor 'a' [0, 4]"},
      {"zero-size tensor inside another",
       Image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
             R"("z":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
             4),
       "tensor 'z' data_offsets [2, 2] overlap tensor 'a' [0, 4]"},
      {"gap",
       Image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
             R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
             10),
       "data bytes [4, 6) belong to no tensor (gap before tensor 'b')"},
      {"gap at the start",
       Image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6),
       "data bytes [0, 2) belong to no tensor (gap before tensor 'a')"},
      {"trailing unclaimed bytes", Image("{" + kOk + "}", 5),
       "data bytes [4, 5) belong to no tensor (after the last tensor)"},
      {"data but no tensors", Image("{}", 3),
       "data bytes [0, 3) belong to no tensor"},
      {"duplicate tensor name", Image("{" + kOk + "," + kOk + "}", 4),
       "duplicate entry 'ok'"},
      {"duplicate tensor name, second one different",
       Image("{" + kOk +
                 R"(,"ok":{"dtype":"U8","shape":[0],"data_offsets":[4,4]}})",
             4),
       "duplicate entry 'ok'"},
      {"duplicate __metadata__",
       Image(R"({"__metadata__":{},"__metadata__":{}})", 0),
       "duplicate entry '__metadata__'"},
      {"__metadata__ not an object", Image(R"({"__metadata__":"x"})", 0),
       "__metadata__ must be an object of strings, found a string"},
      {"__metadata__ null", Image(R"({"__metadata__":null})", 0),
       "__metadata__ must be an object of strings, found null"},
      {"__metadata__ number value", Image(R"({"__metadata__":{"k":1}})", 0),
       "__metadata__: value of 'k' must be a string, found a number"},
      {"__metadata__ nested value",
       Image(R"({"__metadata__":{"k":{"x":"y"}}})", 0),
       "__metadata__: value of 'k' must be a string, found an object"},
      {"__metadata__ boolean value", Image(R"({"__metadata__":{"k":true}})", 0),
       "__metadata__: value of 'k' must be a string, found a boolean"},
      {"__metadata__ duplicate key",
       Image(R"({"__metadata__":{"k":"a","k":"b"}})", 0),
       "__metadata__: duplicate key 'k'"},
      {"newline in a name is escaped",
       Image(R"({"a\nb":{"dtype":"X","shape":[],"data_offsets":[0,0]}})", 0),
       "tensor 'a\\nb': unknown dtype 'X'"},
      {"escape sequence in a name is escaped", Image(R"({"\u001b[31m":1})", 0),
       "tensor '\\x1B[31m' must be"},
  };
}

TEST(SafetensorsInvalidTest, EachRuleHasItsOwnClearOneLineError) {
  for (const InvalidCase& c : InvalidCases()) {
    SCOPED_TRACE(c.rule);
    const std::string message = ParseError(c.image);
    EXPECT_THAT(message, HasSubstr(c.message));
    EXPECT_EQ(message.rfind("mem.safetensors: ", 0), 0u) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_LT(message.size(), 600u) << message;
  }
}

TEST(SafetensorsInvalidTest, LongGarbageKeepsTheMessageShort) {
  // A syntax error deep in a long string token: the message stays bounded.
  const std::string json = "{\"" + std::string(100000, 'x') + "\n";
  const std::string message = ParseError(Image(json, 0));
  EXPECT_THAT(message, HasSubstr("header is not valid JSON"));
  EXPECT_EQ(message.find('\n'), std::string::npos);
  EXPECT_LT(message.size(), 600u);
}

TEST(SafetensorsInvalidTest, DeepNestingIsRejectedWithoutRecursion) {
  const std::string json = "{\"a\":{\"dtype\":" + std::string(1000000, '[');
  EXPECT_THAT(ParseError(Image(json, 0)),
              HasSubstr("dtype must be a string, found an array"));
}

TEST(SafetensorsInvalidTest, ParseHeaderRejectsAHeaderLongerThanTheFile) {
  EXPECT_THROW(ParseSafetensorsHeader("{}", 9, "x"), FormatError);
  EXPECT_THROW(ParseSafetensorsHeader("{}", 4, "x"), FormatError);
  EXPECT_NO_THROW(ParseSafetensorsHeader("{}", 10, "x"));
}

// ---- valid corner cases ----

TEST(SafetensorsValidTest, EmptyHeaderWithoutData) {
  const SafetensorsHeader h = Parse(Image("{}", 0));
  EXPECT_TRUE(h.tensors().empty());
  EXPECT_FALSE(h.has_metadata());
  EXPECT_EQ(h.header_bytes(), 2u);
  EXPECT_EQ(h.data_offset(), 10u);
  EXPECT_EQ(h.data_bytes(), 0u);
}

TEST(SafetensorsValidTest, TrailingWhitespacePaddingIsAccepted) {
  const SafetensorsHeader h = Parse(Image("{" + kOk + "}     \n\t ", 4));
  ASSERT_EQ(h.tensors().size(), 1u);
  EXPECT_EQ(h.header_bytes(), kOk.size() + 2 + 8);
}

TEST(SafetensorsValidTest, ScalarsAndZeroSizeTensors) {
  const SafetensorsHeader h = Parse(
      Image(R"({"z_end":{"dtype":"F32","shape":[3,0],"data_offsets":[10,10]},)"
            R"("scalar":{"dtype":"I64","shape":[],"data_offsets":[0,8]},)"
            R"("z_mid_b":{"dtype":"U8","shape":[0],"data_offsets":[8,8]},)"
            R"("z_mid_a":{"dtype":"BF16","shape":[0,7],"data_offsets":[8,8]},)"
            R"("h":{"dtype":"F16","shape":[1],"data_offsets":[8,10]},)"
            R"("z_start":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})",
            10));
  std::vector<std::string> names;
  for (const TensorInfo& t : h.tensors()) names.push_back(t.name);
  EXPECT_THAT(names, ElementsAre("z_start", "scalar", "z_mid_a", "z_mid_b", "h",
                                 "z_end"));
  const TensorInfo* scalar = h.Find("scalar");
  ASSERT_NE(scalar, nullptr);
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->elements(), 1u);
  EXPECT_EQ(scalar->bytes(), 8u);
  const TensorInfo* z = h.Find("z_end");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->elements(), 0u);
  EXPECT_EQ(z->bytes(), 0u);
  EXPECT_EQ(h.Find("missing"), nullptr);
}

TEST(SafetensorsValidTest, OnlyZeroSizeTensorsAndNoData) {
  const SafetensorsHeader h = Parse(
      Image(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}})", 0));
  ASSERT_EQ(h.tensors().size(), 1u);
}

TEST(SafetensorsValidTest, MetadataAndUtf8Names) {
  const SafetensorsHeader h = Parse(
      Image(R"({"__metadata__":{"format":"pt","note":"\u00e9t\u00e9"},)"
            R"("caf\u00e9":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]},)"
            R"("f8":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[2,3]}})",
            3));
  EXPECT_TRUE(h.has_metadata());
  EXPECT_EQ(h.metadata().at("format"), "pt");
  EXPECT_EQ(h.metadata().at("note"), "\xC3\xA9t\xC3\xA9");
  EXPECT_NE(h.Find("caf\xC3\xA9"), nullptr);
  EXPECT_EQ(h.Find("f8")->dtype, Dtype::kF8E4M3);
}

TEST(SafetensorsValidTest, EmptyMetadataObject) {
  const SafetensorsHeader h = Parse(Image(R"({"__metadata__":{}})", 0));
  EXPECT_TRUE(h.has_metadata());
  EXPECT_TRUE(h.metadata().empty());
}

TEST(SafetensorsValidTest, NegativeZeroIsZero) {
  const SafetensorsHeader h = Parse(
      Image(R"({"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,-0]}})", 0));
  EXPECT_THAT(h.tensors()[0].shape, ElementsAre(0));
}

// ---- I/O errors of ReadSafetensorsHeader ----

TEST(SafetensorsIoTest, MissingFileAndDirectory) {
  try {
    ReadSafetensorsHeader("/nonexistent/x.safetensors");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), ENOENT);
    EXPECT_STREQ(e.what(),
                 "/nonexistent/x.safetensors: cannot open: No such file or "
                 "directory");
  }
  try {
    ReadSafetensorsHeader(kWeightsDir.string());
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EISDIR);
    EXPECT_THAT(e.what(), HasSubstr("is a directory"));
  }
}

// ---- Printable ----

TEST(PrintableTest, EscapesControlsAndInvalidUtf8KeepsValidUtf8) {
  EXPECT_EQ(Printable("plain.name"), "plain.name");
  EXPECT_EQ(Printable("a\nb\tc\rd"), "a\\nb\\tc\\rd");
  EXPECT_EQ(Printable("\x1b[0m"), "\\x1B[0m");
  EXPECT_EQ(Printable("\x7f"), "\\x7F");
  EXPECT_EQ(Printable("caf\xC3\xA9"), "caf\xC3\xA9");
  EXPECT_EQ(Printable("\xC2\x85"), "\\xC2\\x85");           // NEL
  EXPECT_EQ(Printable("\xE2\x80\xA8"), "\\xE2\\x80\\xA8");  // U+2028
  EXPECT_EQ(Printable("\xff\xfe"), "\\xFF\\xFE");
  EXPECT_EQ(Printable("\xC3"), "\\xC3");           // truncated sequence
  EXPECT_EQ(Printable("\xC0\xAF"), "\\xC0\\xAF");  // overlong
  EXPECT_EQ(Printable("\xED\xA0\x80"), "\\xED\\xA0\\x80");  // surrogate
  EXPECT_EQ(Printable(std::string(1, '\0')), "\\x00");
  EXPECT_EQ(Printable(std::string(10, 'x'), 4), "xxxx...");
  // Never cuts a character in half.
  EXPECT_EQ(Printable("\xC3\xA9\xC3\xA9\xC3\xA9", 3), "\xC3\xA9\xC3\xA9...");
}

}  // namespace
}  // namespace modelcache::weights
