// Reading /proc/PID/maps for a daemon's memfds (src/serve/proc_maps.h).
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "modelcache/weights/memfd.h"
#include "proc_maps.h"

namespace modelcache::serve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(ProcMaps, ReadsMemfdLinesOfOnePrefixOnly) {
  const auto m = detail::ParseMapsLine(
      "7f0c00000000-7f0c00200000 r--s 00001000 00:01 4242                      "
      " "
      "/memfd:modelcache:abc:sdxl#0 (deleted)",
      "modelcache:abc:", 17);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->pid, 17);
  EXPECT_EQ(m->start, 0x7f0c00000000u);
  EXPECT_EQ(m->end, 0x7f0c00200000u);
  EXPECT_EQ(m->offset, 0x1000u);
  EXPECT_EQ(m->dev_major, 0u);
  EXPECT_EQ(m->dev_minor, 1u);
  EXPECT_EQ(m->inode, 4242u);
  EXPECT_EQ(m->name, "modelcache:abc:sdxl#0");
  EXPECT_EQ(m->reach(), 0x201000u);
  for (const char* other :
       {"7f0c00000000-7f0c00200000 r--s 00000000 00:01 4242 "
        "/memfd:modelcache:xyz:sdxl#0 (deleted)",
        "7f0c00000000-7f0c00200000 r--p 00000000 08:01 99 /usr/lib/libc.so.6",
        "7f0c00000000-7f0c00200000 rw-p 00000000 00:00 0",
        "7f0c00000000-7f0c00200000 r--s 00000000 00:01 4242 "
        "/memfd:modelcache:ab",
        "garbage", "",
        "7f0c00200000-7f0c00000000 r--s 0 00:01 1 /memfd:modelcache:abc:x"}) {
    EXPECT_FALSE(detail::ParseMapsLine(other, "modelcache:abc:", 1)) << other;
  }
}

TEST(ProcMaps, FindsThisProcessesMappingOfAMemfd) {
  const std::vector<std::byte> bytes(8192, std::byte{1});
  base::UniqueFd fd =
      weights::CreateSealedMemfd("modelcache:unit:scan#0", bytes);
  void* map = ::mmap(nullptr, 8192, PROT_READ, MAP_SHARED, fd.get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  const auto found = detail::ScanMemfdMappings("modelcache:unit:", 0);
  ::munmap(map, 8192);
  bool mine = false;
  for (const auto& m : found) {
    if (m.pid == ::getpid() && m.name == "modelcache:unit:scan#0") {
      mine = true;
      EXPECT_EQ(m.reach(), 8192u);
    }
  }
  EXPECT_TRUE(mine);
  const auto excluded =
      detail::ScanMemfdMappings("modelcache:unit:", ::getpid());
  for (const auto& m : excluded) EXPECT_NE(m.pid, ::getpid());
}

}  // namespace
}  // namespace modelcache::serve
