// `modelcache inspect FILE [--json]` (RunInspect): the text listing, the JSON
// object and its keys, and the failure contract: exit status 1, nothing on
// stdout, exactly one line on stderr starting with "error:" naming the file.

#include "inspect_command.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "modelcache/weights/safetensors_writer.h"

namespace modelcache::tools {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

const std::filesystem::path kWeightsDir =
    std::filesystem::path(MODELCACHE_SHARED_DATA) / "weights";

struct Result {
  int status;
  std::string out;
  std::string err;
};

Result Inspect(const std::string& file, bool json) {
  std::ostringstream out, err;
  const int status = RunInspect(file, json, out, err);
  return {status, out.str(), err.str()};
}

int CountLines(const std::string& text) {
  return static_cast<int>(std::count(text.begin(), text.end(), '\n'));
}

// Checks the failure contract and returns the error line.
std::string ExpectFailure(const std::string& file, bool json) {
  const Result r = Inspect(file, json);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, StartsWith("error: " + file + ": "));
  EXPECT_EQ(CountLines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.back(), '\n');
  return r.err;
}

TEST(InspectTest, TextListsTensorsMetadataAndTotals) {
  const std::string file =
      (kWeightsDir / "hf_safetensors_samples/overall.safetensors").string();
  const Result r = Inspect(file, false);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, StartsWith("file: " + file + "\n"));
  EXPECT_THAT(r.out, HasSubstr("header: 526 bytes\n"));
  EXPECT_THAT(r.out, HasSubstr("data: 168 bytes (168 B)\n"));
  EXPECT_THAT(r.out, HasSubstr("metadata: 1 entry\n  test: a\n"));
  EXPECT_THAT(r.out, HasSubstr("tensors: 9\n"));
  EXPECT_THAT(r.out, HasSubstr("NAME  DTYPE  SHAPE  DATA_OFFSETS  BYTES"));
  EXPECT_THAT(r.out, HasSubstr("  d     F64    [6]    [48, 96]      48\n"));
  EXPECT_THAT(r.out,
              HasSubstr("total: 9 tensors, 168 bytes (168 B); file 702 bytes"));
  // Header lines, one line per tensor, the total.
  EXPECT_EQ(CountLines(r.out), 6 + 1 + 9 + 1);
}

TEST(InspectTest, TextShowsScalarShapes) {
  const Result r =
      Inspect((kWeightsDir / "burn/mnist.safetensors").string(), false);
  EXPECT_EQ(r.status, 0);
  EXPECT_THAT(r.out, HasSubstr("norm1.num_batches_tracked  I64    []"));
  EXPECT_THAT(r.out, HasSubstr("metadata: 0 entries\n"));
  EXPECT_THAT(r.out, HasSubstr("tensors: 20\n"));
}

TEST(InspectTest, JsonHasTheDocumentedKeys) {
  const std::string file =
      (kWeightsDir / "hf_safetensors_samples/overall.safetensors").string();
  const Result r = Inspect(file, true);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.err, "");
  EXPECT_EQ(CountLines(r.out), 1);
  const nlohmann::json doc = nlohmann::json::parse(r.out);
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc.size(), 5u);
  EXPECT_EQ(doc.at("file"), file);
  EXPECT_EQ(doc.at("header_bytes"), 526);
  EXPECT_EQ(doc.at("data_bytes"), 168);
  EXPECT_EQ(doc.at("metadata"), nlohmann::json({{"test", "a"}}));
  const nlohmann::json& tensors = doc.at("tensors");
  ASSERT_TRUE(tensors.is_array());
  ASSERT_EQ(tensors.size(), 9u);
  uint64_t total = 0;
  for (const nlohmann::json& t : tensors) {
    EXPECT_EQ(t.size(), 5u);
    EXPECT_TRUE(t.at("name").is_string());
    EXPECT_TRUE(t.at("dtype").is_string());
    EXPECT_EQ(t.at("shape"), nlohmann::json::array({6}));
    ASSERT_EQ(t.at("data_offsets").size(), 2u);
    EXPECT_EQ(t.at("bytes").get<uint64_t>(),
              t.at("data_offsets")[1].get<uint64_t>() -
                  t.at("data_offsets")[0].get<uint64_t>());
    total += t.at("bytes").get<uint64_t>();
  }
  EXPECT_EQ(total, 168u);
  EXPECT_EQ(tensors[0].at("name"), "B");
  EXPECT_EQ(tensors[0].at("dtype"), "U8");
  EXPECT_EQ(tensors[0].at("data_offsets"), nlohmann::json::array({0, 6}));
}

TEST(InspectTest, JsonForAFileWithoutMetadataAndWithScalars) {
  const Result r =
      Inspect((kWeightsDir / "burn/mnist.safetensors").string(), true);
  ASSERT_EQ(r.status, 0);
  const nlohmann::json doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc.at("metadata"), nlohmann::json::object());
  EXPECT_EQ(doc.at("tensors").size(), 20u);
  EXPECT_EQ(doc.at("tensors")[0].at("shape"), nlohmann::json::array());
  EXPECT_EQ(doc.at("tensors")[0].at("dtype"), "I64");
}

TEST(InspectTest, EveryRealFileInspects) {
  for (const auto& entry :
       std::filesystem::recursive_directory_iterator(kWeightsDir)) {
    if (entry.path().extension() != ".safetensors") continue;
    if (entry.path().filename() == "safetensors_abuse_attempt_1.safetensors") {
      continue;
    }
    SCOPED_TRACE(entry.path().string());
    EXPECT_EQ(Inspect(entry.path().string(), false).status, 0);
    EXPECT_EQ(Inspect(entry.path().string(), true).status, 0);
  }
}

TEST(InspectTest, MalformedFileFailsWithOneLine) {
  const std::string file =
      (kWeightsDir / "syoyo/safetensors_abuse_attempt_1.safetensors").string();
  for (bool json : {false, true}) {
    const std::string err = ExpectFailure(file, json);
    EXPECT_EQ(err, "error: " + file +
                       ": header length 1000 exceeds file size 88 (8 + 1000 "
                       "bytes needed)\n");
  }
}

class InspectFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string templ = ::testing::TempDir() + "inspect_test.XXXXXX";
    ASSERT_NE(::mkdtemp(templ.data()), nullptr);
    dir_ = templ;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string Write(const std::string& name, const std::string& bytes) {
    const std::string path = (dir_ / name).string();
    FILE* f = std::fopen(path.c_str(), "wb");
    std::fwrite(bytes.data(), 1, bytes.size(), f);
    std::fclose(f);
    return path;
  }
  static std::string Image(const std::string& json, size_t data_bytes) {
    std::string image;
    for (int i = 0; i < 8; ++i) {
      image.push_back(static_cast<char>(uint64_t{json.size()} >> (8 * i)));
    }
    return image + json + std::string(data_bytes, '\0');
  }
  std::filesystem::path dir_;
};

TEST_F(InspectFileTest, MissingFileAndDirectory) {
  EXPECT_THAT(ExpectFailure((dir_ / "missing.safetensors").string(), false),
              HasSubstr("cannot open: No such file or directory"));
  EXPECT_THAT(ExpectFailure(dir_.string(), true), HasSubstr("is a directory"));
}

TEST_F(InspectFileTest, InvalidHeadersFailWithOneLine) {
  const std::string overlap =
      Write("overlap.safetensors",
            Image(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                  R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                  6));
  EXPECT_THAT(ExpectFailure(overlap, false), HasSubstr("overlap"));
  const std::string dup =
      Write("dup.safetensors",
            Image(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                  R"("a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                  1));
  EXPECT_THAT(ExpectFailure(dup, true), HasSubstr("duplicate entry 'a'"));
  // A name with a newline and a terminal escape stays on one line.
  const std::string evil = Write(
      "evil.safetensors",
      Image(
          R"({"x\n\u001b[2J":{"dtype":"F99","shape":[],"data_offsets":[0,0]}})",
          0));
  EXPECT_THAT(ExpectFailure(evil, false),
              HasSubstr("tensor 'x\\n\\x1B[2J': unknown dtype 'F99'"));
  const std::string tiny = Write("tiny.safetensors", "abc");
  EXPECT_THAT(ExpectFailure(tiny, false), HasSubstr("too small"));
  const std::string text = Write("text.safetensors", Image("not json", 0));
  EXPECT_THAT(ExpectFailure(text, true), HasSubstr("does not start with"));
}

// A file that is not safetensors at all (a CSV given by mistake) is said
// to be so, before the detail its first bytes give.
TEST_F(InspectFileTest, AFileThatIsNotSafetensorsIsSaidToBeSo) {
  const std::string csv =
      Write("trace.csv", "t_ms,model,size_bytes\n0,a,1000\n");
  for (bool json : {false, true}) {
    const std::string err = ExpectFailure(csv, json);
    EXPECT_THAT(err, StartsWith("error: " + csv +
                                ": does not look like a safetensors file (no "
                                "JSON header after the 8-byte header length): "
                                "header length "));
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  }
}

TEST_F(InspectFileTest, NamesAreEscapedInTextAndExactInJson) {
  modelcache::weights::SafetensorsWriter w;
  w.SetMetadata("note", "two\nlines");
  w.AddTensor("odd\nname", modelcache::weights::Dtype::kU8, {2},
              modelcache::weights::PatternFill(1));
  const std::string path = (dir_ / "odd.safetensors").string();
  w.Write(path);

  const Result text = Inspect(path, false);
  EXPECT_EQ(text.status, 0);
  EXPECT_THAT(text.out, HasSubstr("  note: two\\nlines\n"));
  EXPECT_THAT(text.out, HasSubstr("  odd\\nname  U8"));
  EXPECT_EQ(CountLines(text.out), 6 + 1 + 1 + 1);

  const Result json = Inspect(path, true);
  EXPECT_EQ(json.status, 0);
  EXPECT_EQ(CountLines(json.out), 1);
  const nlohmann::json doc = nlohmann::json::parse(json.out);
  EXPECT_EQ(doc.at("tensors")[0].at("name"), "odd\nname");
  EXPECT_EQ(doc.at("metadata").at("note"), "two\nlines");
}

TEST_F(InspectFileTest, EmptyFileListsNoTensors) {
  modelcache::weights::SafetensorsWriter w;
  const std::string path = (dir_ / "empty.safetensors").string();
  w.Write(path);
  const Result text = Inspect(path, false);
  EXPECT_EQ(text.status, 0);
  EXPECT_THAT(text.out, HasSubstr("tensors: 0\ntotal: 0 tensors, 0 bytes"));
  const nlohmann::json doc = nlohmann::json::parse(Inspect(path, true).out);
  EXPECT_EQ(doc.at("tensors"), nlohmann::json::array());
}

}  // namespace
}  // namespace modelcache::tools
