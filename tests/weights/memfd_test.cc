// Sealed memfds (weights/memfd.h): what a process holding a sealed copy's
// descriptor can and cannot do with it, and a kPread load into one.
//
// The seals live on the memfd's inode, so a descriptor held here behaves as
// one received from another process; tests/serve checks the same paths on a
// descriptor that did cross a socket.
#include "modelcache/weights/memfd.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/base/text.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::weights {
namespace {

namespace fs = std::filesystem;

std::vector<std::byte> Pattern(size_t n, uint64_t seed) {
  std::vector<std::byte> bytes(n);
  FillPattern(seed, 0, bytes);
  return bytes;
}

int OpenFds() {
  int n = 0;
  for (const auto& entry : fs::directory_iterator("/proc/self/fd")) {
    (void)entry;
    ++n;
  }
  return n;
}

// Every way of changing a sealed memfd's bytes or size through `fd` fails.
void ExpectNoWritePathWorks(int fd, uint64_t bytes) {
  SCOPED_TRACE("memfd of " + std::to_string(bytes) + " bytes");
  // 1. A shared writable mapping.
  errno = 0;
  void* writable =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  EXPECT_EQ(writable, MAP_FAILED) << "mmap(PROT_WRITE, MAP_SHARED) succeeded";
  EXPECT_EQ(errno, EPERM);
  if (writable != MAP_FAILED) ::munmap(writable, bytes);

  // 2. A read-only shared mapping made writable.
  void* readable = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(readable, MAP_FAILED) << base::ErrnoText(errno);
  errno = 0;
  EXPECT_NE(::mprotect(readable, bytes, PROT_READ | PROT_WRITE), 0)
      << "mprotect(PROT_WRITE) of a read-only mapping succeeded";
  EXPECT_EQ(errno, EACCES);
  ::munmap(readable, bytes);

  // 3. write(2), at the start and past the end.
  const char byte = 'x';
  errno = 0;
  EXPECT_EQ(::pwrite(fd, &byte, 1, 0), -1) << "pwrite succeeded";
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(bytes)), -1);
  EXPECT_EQ(errno, EPERM);

  // 4. ftruncate(2), shrinking and growing.
  errno = 0;
  EXPECT_NE(::ftruncate(fd, 0), 0) << "ftruncate to 0 succeeded";
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_NE(::ftruncate(fd, static_cast<off_t>(bytes) * 2), 0);
  EXPECT_EQ(errno, EPERM);

  // And around them: punching a hole (zeroes pages in every mapping),
  // growing by fallocate, a writable descriptor opened afresh through /proc,
  // and removing or adding seals.
  errno = 0;
  EXPECT_NE(::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0,
                        static_cast<off_t>(bytes)),
            0)
      << "punching a hole succeeded";
  EXPECT_NE(::fallocate(fd, 0, 0, static_cast<off_t>(bytes) * 2), 0);
  const std::string proc = "/proc/self/fd/" + std::to_string(fd);
  const int rw = ::open(proc.c_str(), O_RDWR | O_CLOEXEC);
  if (rw >= 0) {
    errno = 0;
    EXPECT_EQ(::pwrite(rw, &byte, 1, 0), -1) << "write through /proc succeeded";
    EXPECT_EQ(errno, EPERM);
    ::close(rw);
  }
  errno = 0;
  EXPECT_NE(::fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
  EXPECT_EQ(errno, EPERM) << "more seals could be added";
  EXPECT_EQ(::fcntl(fd, F_GET_SEALS), MemfdSeals());

  struct stat st;
  ASSERT_EQ(::fstat(fd, &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), bytes) << "the size changed";
}

TEST(SealedMemfd, CreatedCopyHoldsTheBytesAndRefusesEveryWritePath) {
  const std::vector<std::byte> bytes = Pattern(10000, 7);
  base::UniqueFd fd = CreateSealedMemfd("modelcache:test:header", bytes);
  ASSERT_TRUE(fd);
  ExpectNoWritePathWorks(fd.get(), bytes.size());

  std::vector<std::byte> back(bytes.size());
  ASSERT_EQ(::pread(fd.get(), back.data(), back.size(), 0),
            static_cast<ssize_t>(back.size()));
  EXPECT_EQ(back, bytes);
  EXPECT_EQ(::fcntl(fd.get(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST(SealedMemfd, ItsNameShowsInTheMaps) {
  const std::vector<std::byte> bytes = Pattern(4096, 1);
  base::UniqueFd fd = CreateSealedMemfd("modelcache:test:named", bytes);
  void* map = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd.get(), 0);
  ASSERT_NE(map, MAP_FAILED);
  std::ifstream maps("/proc/self/maps");
  std::string line;
  bool found = false;
  while (std::getline(maps, line)) {
    if (line.find("/memfd:modelcache:test:named") != std::string::npos) {
      found = true;
    }
  }
  ::munmap(map, 4096);
  EXPECT_TRUE(found);
}

TEST(SealedMemfd, PageRoundedBytesRoundsUpAndSaturates) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  EXPECT_EQ(PageRoundedBytes(0), 0u);
  EXPECT_EQ(PageRoundedBytes(1), page);
  EXPECT_EQ(PageRoundedBytes(page), page);
  EXPECT_EQ(PageRoundedBytes(page + 1), 2 * page);
  EXPECT_EQ(PageRoundedBytes(UINT64_MAX), UINT64_MAX / page * page);
}

TEST(SealedMemfd, HugePageModeIsOneOfTheKernelsWords) {
  const std::string mode = ShmemHugePageMode();
  EXPECT_TRUE(mode == "always" || mode == "within_size" || mode == "advise" ||
              mode == "never" || mode == "deny" || mode == "force" ||
              mode == "unavailable")
      << mode;
  EXPECT_NE(DescribeShmemHugePages(mode).find(mode), std::string::npos);
}

TEST(MemfdAllocator, SealedBufferKeepsItsBytesAndAddressAndIsReadOnly) {
  auto allocator = std::make_shared<MemfdHostBufferAllocator>("modelcache:t");
  constexpr uint64_t kBytes = (uint64_t{3} << 20) + 5;
  auto* buffer =
      static_cast<std::byte*>(allocator->Allocate(kBytes, kHugePageBytes));
  ASSERT_NE(buffer, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer) % kHugePageBytes, 0u);
  EXPECT_EQ(allocator->memfd_bytes(buffer), PageRoundedBytes(kBytes));
  const std::vector<std::byte> bytes = Pattern(kBytes, 3);
  std::memcpy(buffer, bytes.data(), kBytes);

  const int fd = allocator->fd(buffer);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(allocator->fd(bytes.data()), -1);
  allocator->Seal(buffer);
  allocator->Seal(buffer);  // a second seal does nothing
  EXPECT_EQ(std::memcmp(buffer, bytes.data(), kBytes), 0);
  EXPECT_NE(
      ::mprotect(buffer, PageRoundedBytes(kBytes), PROT_READ | PROT_WRITE), 0)
      << "the allocator's own mapping could be made writable again";
  ExpectNoWritePathWorks(fd, PageRoundedBytes(kBytes));
  allocator->Deallocate(buffer, kBytes, kHugePageBytes);
  EXPECT_EQ(allocator->fd(buffer), -1);
}

TEST(MemfdAllocator, DeallocateClosesTheMemfd) {
  auto allocator = std::make_shared<MemfdHostBufferAllocator>("modelcache:t");
  const int before = OpenFds();
  void* a = allocator->Allocate(4096, 4096);
  void* b = allocator->Allocate(100, 64);
  EXPECT_EQ(OpenFds(), before + 2);
  allocator->Deallocate(a, 4096, 4096);
  allocator->Deallocate(b, 100, 64);
  EXPECT_EQ(OpenFds(), before);
}

TEST(MemfdAllocator, SealOfAForeignBufferIsAnError) {
  MemfdHostBufferAllocator allocator("modelcache:t");
  int local = 0;
  try {
    allocator.Seal(&local);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }
}

TEST(MemfdAllocator, PreadLoadFillsASealableCopyOfTheFile) {
  const fs::path dir =
      fs::temp_directory_path() / ("memfd_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string path = (dir / "model.safetensors").string();
  SafetensorsWriter writer;
  writer.AddTensor("a", Dtype::kF32, {1000, 300}, PatternFill(11));
  writer.AddTensor("b", Dtype::kU8, {17}, PatternFill(12));
  writer.Write(path);

  auto allocator = std::make_shared<MemfdHostBufferAllocator>("modelcache:m");
  LoadOptions options;
  options.mode = LoadMode::kPread;
  options.allocator = allocator;
  options.chunk_bytes = 64 << 10;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  {
    WeightSet set = WeightSet::OpenFd(fd, "model.safetensors", options);
    EXPECT_EQ(set.path(), "model.safetensors");
    allocator->Seal(set.data().data());
    const WeightSet reference = WeightSet::Open(path);
    ASSERT_EQ(set.data_bytes(), reference.data_bytes());
    EXPECT_EQ(std::memcmp(set.data().data(), reference.data().data(),
                          set.data_bytes()),
              0);
    EXPECT_GE(allocator->fd(set.data().data()), 0);

    // The header travels as text that parses to the same header.
    const std::string json = SafetensorsHeaderJson(set.header());
    const SafetensorsHeader again = ParseSafetensorsHeader(
        json, kLengthPrefixBytes + json.size() + set.data_bytes(), "again");
    ASSERT_EQ(again.tensors().size(), set.tensors().size());
    for (size_t i = 0; i < again.tensors().size(); ++i) {
      EXPECT_EQ(again.tensors()[i].name, set.tensors()[i].name);
      EXPECT_EQ(again.tensors()[i].shape, set.tensors()[i].shape);
      EXPECT_EQ(again.tensors()[i].begin, set.tensors()[i].begin);
      EXPECT_EQ(again.tensors()[i].dtype, set.tensors()[i].dtype);
    }
  }
  ::close(fd);
  fs::remove_all(dir);
}

TEST(WeightSetFromMemory, ViewsTheGivenBytesAndKeepsTheirOwner) {
  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  writer.AddTensor("x", Dtype::kI64, {4}, PatternFill(5));
  const std::vector<std::byte> image = writer.WriteToMemory();
  const SafetensorsHeader header = ParseSafetensors(image, "image");
  auto owner = std::make_shared<std::vector<std::byte>>(
      image.begin() + static_cast<long>(header.data_offset()), image.end());
  std::weak_ptr<std::vector<std::byte>> watch = owner;
  {
    WeightSet set =
        WeightSet::FromMemory("remote:x", FileIdentity{1, 2, image.size(), 3},
                              std::make_shared<const SafetensorsHeader>(header),
                              std::span<const std::byte>(*owner), owner);
    owner.reset();
    EXPECT_FALSE(watch.expired());
    EXPECT_EQ(set.mode(), LoadMode::kPread);
    EXPECT_EQ(set.identity().inode, 2u);
    EXPECT_EQ(set.data("x").size(), 32u);
    EXPECT_EQ(set.metadata().at("format"), "pt");
    const std::string json = SafetensorsHeaderJson(set.header());
    EXPECT_EQ(json.rfind("{\"__metadata__\":{\"format\":\"pt\"}", 0), 0u)
        << json;
  }
  EXPECT_TRUE(watch.expired());

  std::vector<std::byte> short_data(3);
  EXPECT_THROW(
      WeightSet::FromMemory("remote:x", {},
                            std::make_shared<const SafetensorsHeader>(header),
                            short_data, nullptr),
      Error);
  EXPECT_THROW(WeightSet::FromMemory("remote:x", {}, nullptr, {}, nullptr),
               Error);
}

}  // namespace
}  // namespace modelcache::weights
