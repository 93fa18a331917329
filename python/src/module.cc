// modelcache._core: the extension module behind the modelcache package. The
// pure-Python package (python/modelcache/) re-exports it with docstrings,
// type stubs and the helpers that need no C++.
#include "common.h"

PYBIND11_MODULE(_core, m) {
  namespace mp = modelcache::python;
  m.doc() = "modelcache's C++ core; import modelcache instead.";
  m.attr("__version__") = MODELCACHE_VERSION;
  mp::RememberMainThread();
  mp::RegisterExceptionTranslators();
  mp::BindCache(m);
  mp::BindWeights(m);
  mp::BindRuntime(m);
  mp::BindServe(m);
}
