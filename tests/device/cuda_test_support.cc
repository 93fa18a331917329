// Linked into every test binary that may initialise CUDA (device_test, where
// this build has the CUDA backend, and the GPU suites and their child
// programs).
//
// ASan reserves the low address range CUDA maps device memory into; without
// this the CUDA runtime fails to initialise under the asan preset (the CUDA
// tests then skip, or fail under MODELCACHE_REQUIRE_GPU=1). The CUDA
// driver's own allocations at exit are not ours to report.
extern "C" const char* __asan_default_options() {
  return "protect_shadow_gap=0";
}
extern "C" const char* __lsan_default_suppressions() {
  return "leak:libcuda.so\nleak:libcudart.so\nleak:libnvidia-\n";
}
