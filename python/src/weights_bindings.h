// What weights_bindings.cc shares with runtime_bindings.cc: converting paths,
// load modes, dtypes and stats between Python and the weights layer.
#ifndef MODELCACHE_PYTHON_SRC_WEIGHTS_BINDINGS_H_
#define MODELCACHE_PYTHON_SRC_WEIGHTS_BINDINGS_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "common.h"
#include "modelcache/core/cache.h"
#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::python {

// The path as the operating system takes it: str, bytes or os.PathLike,
// through os.fsencode (so undecodable file names round-trip).
// REQUIRES: the GIL is held.
std::string PathFrom(const py::handle& path);

// LoadOptions for mode "mmap" or "pread"; InvalidArgumentError otherwise.
// REQUIRES: the GIL is held.
weights::LoadOptions LoadOptionsFrom(const std::string& mode,
                                     int pread_threads);

// The numpy dtype (little-endian, as safetensors stores it) of `dtype`.
// Raises InvalidArgumentError for dtypes numpy has no type for (BF16, the
// F8 kinds), naming `tensor`. REQUIRES: the GIL is held.
py::dtype NumpyDtype(weights::Dtype dtype, const std::string& tensor);

// The address a view of `bytes` points at: a static non-null one for an
// empty tensor (a null address would make numpy allocate instead of view).
const void* ViewAddress(std::span<const std::byte> bytes);

// A read-only, zero-copy numpy array of tensor `info` at `address`, whose
// base object (modelcache._core._HostCopyRef, named after `owner`) holds
// `keep`, so the bytes outlive the array. `flat_bytes`: a 1-D uint8 array
// of its bytes instead of its shape and `dtype`. REQUIRES: the GIL is held.
py::array NumpyView(std::shared_ptr<const void> keep, const std::string& owner,
                    const weights::TensorInfo& info, const void* address,
                    const py::dtype& dtype, bool flat_bytes);

// A DLPack capsule ("dltensor") of tensor `info` at `address` on the CPU,
// whose deleter drops `keep` (on any thread, without the GIL). Raises
// InvalidArgumentError for dtypes torch 1.13 has no type for; BOOL travels
// as U8. REQUIRES: the GIL is held.
py::capsule DlpackCapsule(std::shared_ptr<const void> keep,
                          const weights::TensorInfo& info, const void* address);

}  // namespace modelcache::python

#endif  // MODELCACHE_PYTHON_SRC_WEIGHTS_BINDINGS_H_
