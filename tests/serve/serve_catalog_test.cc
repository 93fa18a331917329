// The catalog (modelcache/serve/catalog.h): what it accepts and the reason
// for what it refuses.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "modelcache/serve/catalog.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(CatalogTest, ParsesModelsAliasesPinsAndPriorities) {
  const Catalog c = Catalog::Parse(
      R"({"models": [
        {"id": "sdxl", "files": ["sdxl/unet.safetensors", "sdxl/vae.safetensors"],
         "aliases": ["sd", "xl"], "pinned": true, "priority": -3},
        {"id": "tiny", "files": ["tiny.safetensors"]}]})",
      "c.json");
  ASSERT_EQ(c.models().size(), 2u);
  EXPECT_EQ(c.Find("sd"), &c.models()[0]);
  EXPECT_EQ(c.Find("sdxl")->files.size(), 2u);
  EXPECT_TRUE(c.Find("xl")->pinned);
  EXPECT_EQ(c.Find("sdxl")->priority, -3);
  EXPECT_FALSE(c.Find("tiny")->pinned);
  EXPECT_EQ(c.Find("nothing"), nullptr);
  EXPECT_EQ(c.Find("sdxl/unet.safetensors"), nullptr);
}

TEST(CatalogTest, RefusesWhatCouldLeaveTheRootOrIsAmbiguous) {
  const auto error = [](const std::string& models) {
    try {
      Catalog::Parse("{\"models\": [" + models + "]}", "c.json");
    } catch (const CatalogError& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidData);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_THAT(error(R"({"id": "a", "files": ["../x"]})"),
              HasSubstr("c.json: model 'a': file '../x' has a '..' component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x/../../y"]})"),
              HasSubstr("'..' component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["/etc/passwd"]})"),
              HasSubstr("is absolute"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x//y"]})"),
              HasSubstr("empty component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["./x"]})"),
              HasSubstr("'.' component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x/"]})"),
              HasSubstr("empty component"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x", "x"]})"),
              HasSubstr("listed twice"));
  EXPECT_THAT(error(R"({"id": "a", "files": []})"),
              HasSubstr("needs 1 to 100"));
  EXPECT_THAT(error(R"({"id": "a"})"), HasSubstr("has no \"files\""));
  EXPECT_THAT(error(R"({"id": "../a", "files": ["x"]})"),
              HasSubstr("not a valid id"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "aliases": ["b/c"]})"),
              HasSubstr("alias 'b/c' is not a valid id"));
  EXPECT_THAT(
      error(R"({"id": "a", "files": ["x"]}, {"id": "a", "files": ["y"]})"),
      HasSubstr("used twice"));
  EXPECT_THAT(
      error(
          R"({"id": "a", "files": ["x"]}, {"id": "b", "files": ["y"], "aliases": ["a"]})"),
      HasSubstr("alias 'a' is used twice"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "size": 1})"),
              HasSubstr("unknown key 'size'"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "priority": 1001})"),
              HasSubstr("from -1000 to 1000"));
  EXPECT_THAT(error(R"({"id": "a", "files": ["x"], "pinned": "yes"})"),
              HasSubstr("\"pinned\" is not true or false"));
  EXPECT_THAT(
      error(R"({"id": "a", "files": [")" + std::string(1100, 'x') + "\"]}"),
      HasSubstr("longer than 1024"));
  EXPECT_THROW(Catalog::Parse("{\"models\": []} x", "c"), CatalogError);
  EXPECT_THROW(Catalog::Parse("{\"other\": []}", "c"), CatalogError);
  EXPECT_THROW(Catalog::Parse(std::string(100, '['), "c"), CatalogError);
  EXPECT_THROW(Catalog::FromFile("/nonexistent/catalog.json"), CatalogError);
}

}  // namespace
}  // namespace modelcache::serve
