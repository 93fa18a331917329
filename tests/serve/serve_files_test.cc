// Opening files beneath the model root, with no symbolic link
// (src/serve/files.h).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "files.h"
#include "modelcache/weights/safetensors.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// ---- files beneath the root ----

class BeneathTest : public ::testing::TestWithParam<detail::Resolver> {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("beneath_" + std::to_string(::getpid()) + "_" +
            std::to_string(static_cast<int>(GetParam())));
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "root/sub");
    fs::create_directories(dir_ / "outside");
    std::ofstream(dir_ / "root/sub/in.bin") << "inside";
    std::ofstream(dir_ / "outside/secret.bin") << "secret";
    fs::create_symlink(dir_ / "outside/secret.bin", dir_ / "root/link.bin");
    fs::create_symlink("sub/in.bin", dir_ / "root/relative-link.bin");
    fs::create_directory_symlink(dir_ / "outside", dir_ / "root/dirlink");
    ::mkfifo((dir_ / "root/fifo").c_str(), 0600);
    root_ = detail::OpenRoot((dir_ / "root").string());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Error(const std::string& path) {
    try {
      detail::OpenBeneath(root_.get(), path, GetParam());
    } catch (const weights::IoError& e) {
      return e.what();
    }
    return "opened";
  }

  fs::path dir_;
  base::UniqueFd root_;
};

TEST_P(BeneathTest, OpensFilesInsideAndNothingElse) {
  base::UniqueFd fd =
      detail::OpenBeneath(root_.get(), "sub/in.bin", GetParam());
  char text[16] = {};
  EXPECT_EQ(::read(fd.get(), text, sizeof(text)), 6);
  EXPECT_STREQ(text, "inside");
  EXPECT_EQ(::fcntl(fd.get(), F_GETFL) & O_NONBLOCK, 0);
  EXPECT_THAT(Error("link.bin"), HasSubstr("symbolic link"));
  EXPECT_THAT(Error("relative-link.bin"), HasSubstr("symbolic link"));
  EXPECT_THAT(Error("dirlink/secret.bin"), HasSubstr("symbolic link"));
  EXPECT_THAT(Error("../outside/secret.bin"),
              HasSubstr("leaves the model root"));
  EXPECT_THAT(Error("sub/../../outside/secret.bin"),
              HasSubstr("leaves the model root"));
  EXPECT_THAT(Error("/etc/passwd"), HasSubstr("leaves the model root"));
  EXPECT_THAT(Error("sub"), HasSubstr("is a directory"));
  EXPECT_THAT(Error("fifo"), HasSubstr("not a regular file"));
  EXPECT_THAT(Error("missing.bin"), HasSubstr("No such file"));
  EXPECT_THAT(Error("sub/in.bin/x"), HasSubstr("not a directory"));
}

INSTANTIATE_TEST_SUITE_P(Resolvers, BeneathTest,
                         ::testing::Values(detail::Resolver::kOpenat2,
                                           detail::Resolver::kPerComponent));

}  // namespace
}  // namespace modelcache::serve
