// What weights_bindings.cc shares with runtime_bindings.cc: converting paths,
// load modes, dtypes and stats between Python and the weights layer.
#ifndef MODELCACHE_PYTHON_SRC_WEIGHTS_BINDINGS_H_
#define MODELCACHE_PYTHON_SRC_WEIGHTS_BINDINGS_H_

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

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

}  // namespace modelcache::python

#endif  // MODELCACHE_PYTHON_SRC_WEIGHTS_BINDINGS_H_
