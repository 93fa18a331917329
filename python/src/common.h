// What every binding file of modelcache._core shares: the rules for the GIL,
// for Python references held by C++ objects, and for exceptions crossing
// between Python and the core.
//
// The GIL rules (the package's threading contract, docs/python.md):
//
//  * Every call into the core that can block (waiting for another thread's
//    load, for capacity, for an unload) runs under WithoutGil, so no thread
//    holds the GIL while it waits for another thread.
//  * Python user code (loaders, unloaders, event callbacks, value release)
//    runs under WithGil on whatever thread the core calls it from; the core
//    calls it with none of its locks held (its invariant I7 covers the last
//    reference too). So a thread holding a cache lock never waits for the
//    GIL, and a thread holding the GIL may take a cache lock briefly: the
//    hit path (ModelCache::TryAcquire) and lease release do, since neither
//    waits for another thread (cache_bindings.cc).
//  * Python ends a daemon thread that takes the GIL back after finalization
//    began by unwinding its stack (pthread_exit); unwinding through frames
//    that own Python references would drop them without the GIL. So
//    WithoutGil, GilHold and CallPython catch that unwind in their own frame
//    and park the thread (ParkForever) until the process exits.
//  * A Python reference owned by C++ (PyRef) may be dropped on any thread. It
//    takes the GIL to drop it, and leaks it instead once the interpreter is
//    finalizing, when taking the GIL could end the thread.
#ifndef MODELCACHE_PYTHON_SRC_COMMON_H_
#define MODELCACHE_PYTHON_SRC_COMMON_H_

#include <cxxabi.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "modelcache/core/cache.h"

namespace modelcache::python {

namespace py = pybind11;

// A strong reference to a Python object that C++ code may copy and drop on
// any thread, with or without the GIL.
class PyRef {
 public:
  PyRef() = default;
  // REQUIRES: the GIL is held.
  explicit PyRef(py::handle object);
  py::handle get() const;  // borrowed; use with the GIL held
  explicit operator bool() const { return static_cast<bool>(holder_); }

 private:
  std::shared_ptr<PyObject> holder_;
};

// A shared_ptr<void> owning a reference to `object`, dropped as PyRef's is;
// the void* is the PyObject*. REQUIRES: the GIL is held.
std::shared_ptr<void> SharePyObject(py::handle object);

// Ends the life of a thread the interpreter is done with: a daemon thread
// that would need the GIL after finalization began. It sleeps until the
// process exits, as Python itself parks such threads, instead of unwinding
// its stack through frames that own Python references.
[[noreturn]] void ParkForever();

// True when this thread must not take the GIL again: the interpreter is
// finalizing and this is not the thread finalizing it (the main thread).
// Safe without the GIL.
bool MustNotTakeGil();

// Records the main thread's identity. Called once from the module's init.
void RememberMainThread();

// Runs `fn` with the GIL released and returns its result; see the rules
// above. REQUIRES: the GIL is held.
template <typename Fn>
auto WithoutGil(Fn&& fn) -> decltype(fn()) {
  PyThreadState* state = PyEval_SaveThread();
  auto restore = [state] {
    if (MustNotTakeGil()) ParkForever();
    PyEval_RestoreThread(state);
  };
  try {
    if constexpr (std::is_void_v<decltype(fn())>) {
      fn();
      restore();
    } else {
      auto result = fn();
      restore();
      return result;
    }
  } catch (abi::__forced_unwind&) {
    // Python ended this thread (pthread_exit) as it took the GIL back after
    // finalization began. Unwinding further would drop Python references
    // without the GIL; a forced unwind may not be swallowed, so the thread
    // sleeps here until the process exits.
    ParkForever();
  } catch (...) {
    restore();
    throw;
  }
}

// A Python exception raised by user code (a loader, an unloader), carried
// through the core as a C++ exception. The core hands the same object to
// every waiter of a failed load.
class PythonError : public std::exception {
 public:
  // Takes the Python error indicator (or the exception held by `error`).
  // REQUIRES: the GIL is held.
  explicit PythonError(py::error_already_set& error);
  // "Type: message", as the last line of a Python traceback reads.
  const char* what() const noexcept override { return message_.c_str(); }
  // The exception object; use with the GIL held.
  py::handle value() const { return value_.get(); }
  // Raises the exception as it was (type, value, traceback) in the calling
  // thread and throws py::error_already_set. REQUIRES: the GIL is held.
  [[noreturn]] void Reraise() const;

 private:
  PyRef value_;
  std::string message_;
};

// Sets the Python error indicator to `value` (an exception object) with
// its own __traceback__. REQUIRES: the GIL is held.
void RestorePythonException(py::handle value);

// Holds the GIL for its scope, from any thread, re-entrantly. If Python
// ends this thread while it waits for the GIL (a daemon thread after
// finalization began), the thread parks instead of unwinding.
class GilHold {
 public:
  GilHold();
  ~GilHold() { PyGILState_Release(state_); }
  GilHold(const GilHold&) = delete;
  GilHold& operator=(const GilHold&) = delete;

 private:
  PyGILState_STATE state_;
};

// Calls fn(*args, **kwargs) (args: a tuple or null for none; kwargs: a dict
// or null). Any call that runs Python code on a thread Python may end goes
// through here: Python ends a daemon thread by unwinding its stack from
// wherever it takes the GIL back, and this catches that unwind in the frame
// of the call itself, before any caller's Python references would be
// dropped without the GIL, and parks the thread. Throws
// py::error_already_set when the call raised. REQUIRES: the GIL is held.
py::object CallPython(py::handle fn, py::handle args = {},
                      py::handle kwargs = {});

// Runs Python user code with the GIL taken; a Python exception leaves as
// PythonError, so that it can cross threads inside the core. Python code in
// `fn` runs through CallPython.
template <typename Fn>
auto WithGil(Fn&& fn) -> decltype(fn()) {
  if (MustNotTakeGil()) ParkForever();
  GilHold gil;
  try {
    return fn();
  } catch (py::error_already_set& e) {
    throw PythonError(e);
  }
}

// Raises the modelcache.errors class for `code` with `message`.
// REQUIRES: the GIL is held.
[[noreturn]] void RaiseError(ErrorCode code, const std::string& message);

// The modelcache.errors class for `code`. REQUIRES: the GIL is held.
py::object ErrorClass(ErrorCode code);
// modelcache.errors.LoadError. REQUIRES: the GIL is held.
py::object LoadErrorClass();

// AcquireOptions from a Python timeout (None, seconds, or timedelta) and
// when_full ("fail" or "wait"), with an interrupt check that takes the GIL
// and runs Python's signal handlers, so that Ctrl-C ends a blocked wait with
// KeyboardInterrupt (checked on the main thread only, the one Python runs
// signal handlers on). REQUIRES: the GIL is held.
// `*interrupted` (when given) is set when the check raised.
AcquireOptions MakeAcquireOptions(const py::object& timeout,
                                  const std::string& when_full,
                                  bool* interrupted = nullptr);

// A deadline from None, seconds (int or float) or datetime.timedelta.
Clock::time_point DeadlineFrom(const py::object& timeout);
// Seconds from a float, an int or a datetime.timedelta; nullopt for None.
std::optional<double> SecondsFrom(const py::object& value, const char* what);

// ---- Arguments of the public functions ----
//
// Each public function takes its arguments as py::object and converts them
// here, so that a wrong argument reads as Python's own errors do, naming the
// parameter ("capacity_bytes must be an int or a byte size string such as
// '16GiB', not list"), instead of pybind11's list of overloads. TypeError
// for a wrong type, InvalidArgumentError for a wrong value. REQUIRES: the
// GIL is held, for all of them.

// Raises TypeError "<name> must be <expected>, not <type of got>".
[[noreturn]] void RaiseArgumentType(const char* name, const char* expected,
                                    py::handle got);
// A str.
std::string StrArg(py::handle value, const char* name);
// A bool (True or False only: 1 or "yes" are refused).
bool BoolArg(py::handle value, const char* name);
// An int (anything with __index__ but a bool) within [min, max].
long long IntArg(py::handle value, const char* name, long long min,
                 long long max);
// A byte size: an int (anything with __index__ but a bool) or a string in
// the CLI's grammar (ParseBytes: "16GiB", "500MB", "1.5GiB", "4096").
// Negative, malformed, 2^64 or more, and zero unless `allow_zero`:
// InvalidArgumentError naming `name`.
uint64_t BytesArg(py::handle value, const char* name, bool allow_zero);
// A callable (or None when `allow_none`); returned as given.
py::object CallableArg(py::handle value, const char* name, bool allow_none);
// A timeout (None, seconds or a timedelta), checked as DeadlineFrom does;
// returned as given.
py::object TimeoutArg(py::handle value, const char* name);

// CacheStats as a dict keyed by its field names (modelcache.CacheStats's
// fields). REQUIRES: the GIL is held.
// CacheStats and EntryInfo as dicts, and their fields as (name, Python type,
// doc) tuples, all from the one field list in cache.h.
py::dict CacheStatsDict(const CacheStats& stats);
py::dict EntryDict(const EntryInfo& entry);
py::list CacheStatsFields();
py::list EntryFields();

// Registers the translation of modelcache::Error and PythonError into Python
// exceptions. Called once from the module's init.
void RegisterExceptionTranslators();

// Each binding file adds its part of the module.
void BindCache(py::module_& m);
void BindWeights(py::module_& m);
void BindRuntime(py::module_& m);
void BindServe(py::module_& m);

}  // namespace modelcache::python

#endif  // MODELCACHE_PYTHON_SRC_COMMON_H_
