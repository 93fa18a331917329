// The child process of
// CudaDeviceTest.ACorruptedContextMakesTheDeviceUnavailable.
//
// Makes cuda:0 and places a buffer on it, then runs, on a stream of its own,
// a kernel that writes to address 0, as a faulty kernel of another library
// in the same process would. That corrupts the GPU's primary context for the
// rest of the process. Then checks, from the Device contract, that every
// call of the device fails with kUnavailable naming the corrupted context,
// that its stats say so, and that freeing still returns the books.
//
// The kernel is hand-written PTX, compiled by the driver at load time
// (cudaLibraryLoadData), so the suite needs no nvcc. Prints what it saw;
// exits 0 when every check held, 1 when one failed, 2 when CUDA is
// unavailable, 3 when the kernel could not be run.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "modelcache/device/cuda_device.h"
#include "modelcache/device/device.h"

namespace {

using modelcache::device::DeviceBuffer;
using modelcache::device::DeviceError;
using modelcache::device::DeviceErrorCode;

constexpr const char* kWriteToNull = R"(
.version 7.0
.target sm_75
.address_size 64

.visible .entry write_to_null()
{
  .reg .b32 %r<2>;
  .reg .b64 %rd<2>;
  mov.u64 %rd1, 0;
  mov.u32 %r1, 42;
  st.global.u32 [%rd1], %r1;
  ret;
}
)";

int failures = 0;

void Check(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
  if (!ok) ++failures;
}

// The call must throw DeviceError kUnavailable saying the context is
// corrupted.
void ExpectUnavailable(const char* what, const std::function<void()>& call) {
  try {
    call();
    Check(false, std::string(what) + " succeeded");
  } catch (const DeviceError& e) {
    std::printf("%s: %s\n", what, e.what());
    Check(e.device_code() == DeviceErrorCode::kUnavailable,
          std::string(what) + " is kUnavailable");
    Check(std::strstr(e.what(), "context corrupted") != nullptr,
          std::string(what) + " says the context is corrupted");
  }
}

}  // namespace

int main() {
  if (!modelcache::device::CudaAvailable()) {
    std::printf("CUDA unavailable: %s\n",
                modelcache::device::CudaUnavailableReason().c_str());
    return 2;
  }
  std::unique_ptr<modelcache::device::Device> gpu =
      modelcache::device::MakeCudaDevice(
          0, {.capacity_bytes = uint64_t{64} << 20});
  const std::vector<std::byte> data(1 << 20, std::byte{0x3C});
  DeviceBuffer buffer = gpu->Allocate(data.size());
  gpu->CopyToDevice(buffer, 0, data);
  gpu->Synchronize();
  Check(gpu->usable(), "the device works before the kernel runs");

  // Another library's kernel, in the same (primary) context.
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernel = nullptr;
  cudaStream_t stream = nullptr;
  cudaError_t error = cudaSetDevice(0);
  if (error == cudaSuccess) {
    error = cudaLibraryLoadData(&library, kWriteToNull, nullptr, nullptr, 0,
                                nullptr, nullptr, 0);
  }
  if (error == cudaSuccess) {
    error = cudaLibraryGetKernel(&kernel, library, "write_to_null");
  }
  if (error == cudaSuccess) {
    error = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }
  if (error == cudaSuccess) {
    error = cudaLaunchKernel(reinterpret_cast<const void*>(kernel), dim3(1),
                             dim3(1), nullptr, 0, stream);
  }
  if (error != cudaSuccess) {
    std::printf("could not run the kernel: %s (%s)\n",
                cudaGetErrorString(error), cudaGetErrorName(error));
    return 3;
  }
  error = cudaStreamSynchronize(stream);
  std::printf("the kernel that writes to address 0 ended with %s (%s)\n",
              cudaGetErrorName(error), cudaGetErrorString(error));
  Check(error != cudaSuccess, "the kernel faulted");

  ExpectUnavailable("CopyToDevice",
                    [&] { gpu->CopyToDevice(buffer, 0, data); });
  ExpectUnavailable("Allocate", [&] { gpu->Allocate(1); });
  std::vector<std::byte> back(data.size());
  ExpectUnavailable("CopyToHost", [&] { gpu->CopyToHost(back, buffer, 0); });
  ExpectUnavailable("Synchronize", [&] { gpu->Synchronize(); });
  const modelcache::device::DeviceStats stats = gpu->Stats();
  Check(stats.unusable, "the stats say the device is unusable");
  Check(stats.unusable_reason.find("context corrupted") != std::string::npos,
        "the stats say why: " + stats.unusable_reason);
  buffer.Reset();
  Check(gpu->bytes_allocated() == 0, "freeing still returns the books");
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
