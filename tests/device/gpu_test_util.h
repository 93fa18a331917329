// What every GPU test shares: the rule that a GPU test skips, saying why,
// where CUDA is unavailable, unless MODELCACHE_REQUIRE_GPU=1 says a GPU must
// be there, and then fails instead (scripts/gpu-check.sh sets it, so a GPU
// run can never pass by testing nothing).
#ifndef MODELCACHE_TESTS_DEVICE_GPU_TEST_UTIL_H_
#define MODELCACHE_TESTS_DEVICE_GPU_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "modelcache/device/cuda_device.h"

namespace modelcache::device::testing {

// True when MODELCACHE_REQUIRE_GPU is set to anything but "" or "0".
inline bool GpuRequired() {
  const char* value = std::getenv("MODELCACHE_REQUIRE_GPU");
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

// Why a GPU test cannot run here; empty when CUDA is available.
inline std::string GpuUnavailableReason() {
  if (CudaAvailable()) return "";
  return "CUDA unavailable: " + CudaUnavailableReason();
}

}  // namespace modelcache::device::testing

// In a test body or SetUp(): skips the test when CUDA is unavailable, saying
// why, or fails it when MODELCACHE_REQUIRE_GPU=1.
#define MC_SKIP_OR_FAIL_WITHOUT_GPU()                                  \
  do {                                                                 \
    const std::string mc_gpu_why =                                     \
        ::modelcache::device::testing::GpuUnavailableReason();         \
    if (!mc_gpu_why.empty()) {                                         \
      if (::modelcache::device::testing::GpuRequired()) {              \
        GTEST_FAIL() << "MODELCACHE_REQUIRE_GPU=1 but " << mc_gpu_why; \
      }                                                                \
      GTEST_SKIP() << mc_gpu_why;                                      \
    }                                                                  \
  } while (false)

#endif  // MODELCACHE_TESTS_DEVICE_GPU_TEST_UTIL_H_
