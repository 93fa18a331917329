#include "common.h"

#include <pybind11/chrono.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <thread>

#include "modelcache/base/bytes.h"

namespace modelcache::python {

namespace {
std::atomic<unsigned long> main_thread_ident{0};
}  // namespace

void RememberMainThread() {
  main_thread_ident = py::module_::import("threading")
                          .attr("main_thread")()
                          .attr("ident")
                          .cast<unsigned long>();
}

bool MustNotTakeGil() {
  if (!Py_IsInitialized()) return true;
  return _Py_IsFinalizing() &&
         PyThread_get_thread_ident() != main_thread_ident.load();
}

void ParkForever() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(24));
}

namespace {

// Drops a reference on any thread. Leaked once the interpreter is going
// away: it frees everything itself, and taking the GIL then could hang or
// end this thread.
void DropReference(PyObject* object) {
  if (object == nullptr || MustNotTakeGil()) return;
  try {
    // Py_DECREF may run __del__, Python code that may give the GIL up and
    // take it back: see CallPython.
    PyGILState_STATE state = PyGILState_Ensure();
    Py_DECREF(object);
    PyGILState_Release(state);
  } catch (abi::__forced_unwind&) {
    ParkForever();
  }
}

}  // namespace

GilHold::GilHold() {
  try {
    state_ = PyGILState_Ensure();
  } catch (abi::__forced_unwind&) {
    ParkForever();
  }
}

py::object CallPython(py::handle fn, py::handle args, py::handle kwargs) {
  PyObject* no_args = args ? nullptr : PyTuple_New(0);
  PyObject* result = nullptr;
  try {
    result = PyObject_Call(fn.ptr(), args ? args.ptr() : no_args,
                           kwargs ? kwargs.ptr() : nullptr);
  } catch (abi::__forced_unwind&) {
    ParkForever();
  }
  Py_XDECREF(no_args);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

PyRef::PyRef(py::handle object)
    : holder_(object.inc_ref().ptr(), &DropReference) {}

py::handle PyRef::get() const { return holder_.get(); }

std::shared_ptr<void> SharePyObject(py::handle object) {
  return std::shared_ptr<void>(object.inc_ref().ptr(), [](void* p) {
    DropReference(static_cast<PyObject*>(p));
  });
}

namespace {

// "ValueError: disk on fire": the exception as the last line of a Python
// traceback shows it, without pybind11's "At:" dump of the frames (the
// frames stay in the exception's traceback, where Python shows them).
std::string DescribeException(py::handle value) {
  std::string text = Py_TYPE(value.ptr())->tp_name;
  if (const char* dot = std::strrchr(text.c_str(), '.')) text = dot + 1;
  PyObject* str = PyObject_Str(value.ptr());
  if (str == nullptr) {
    PyErr_Clear();
    return text;
  }
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(str, &size);
  if (utf8 == nullptr) {
    PyErr_Clear();
  } else if (size > 0) {
    text += ": " + std::string(utf8, static_cast<size_t>(size));
  }
  Py_DECREF(str);
  return text;
}

}  // namespace

PythonError::PythonError(py::error_already_set& error) {
  // The traceback of an exception that left Python code for C (here, the
  // PyObject_Call of a loader) lives in the error indicator only: the
  // exception's __traceback__ is set when Python code catches it, which
  // has not happened yet. Storing it in the exception keeps the frames from
  // the loader down to the raise with the object, for the thread that ran
  // the loader and for every waiter's LoadError.__cause__.
  py::handle value = error.value();
  if (error.trace()) PyException_SetTraceback(value.ptr(), error.trace().ptr());
  value_ = PyRef(value);
  message_ = DescribeException(value);
}

void RestorePythonException(py::handle value) {
  // PyErr_Restore with the exception's own traceback: Python then adds the
  // frames it unwinds through in front of the loader's.
  PyObject* traceback = PyException_GetTraceback(value.ptr());  // new ref
  PyErr_Restore(Py_NewRef(reinterpret_cast<PyObject*>(Py_TYPE(value.ptr()))),
                Py_NewRef(value.ptr()), traceback);
}

void PythonError::Reraise() const {
  RestorePythonException(value_.get());
  throw py::error_already_set();
}

namespace {

const char* ErrorClassName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kTooLarge:
      return "TooLargeError";
    case ErrorCode::kCapacity:
      return "CapacityError";
    case ErrorCode::kTimeout:
      return "TimeoutError";
    case ErrorCode::kNotFound:
      return "NotFoundError";
    case ErrorCode::kInvalidArgument:
      return "InvalidArgumentError";
    case ErrorCode::kFailedPrecondition:
      return "FailedPreconditionError";
    case ErrorCode::kInvalidData:
      return "InvalidDataError";
    case ErrorCode::kIo:
      return "IoError";
    case ErrorCode::kUnavailable:
      return "UnavailableError";
  }
  return "Error";
}

}  // namespace

// Looked up on each use: the lookup is cheap next to raising, and a cached
// object would outlive the interpreter at exit.
py::object ErrorClass(ErrorCode code) {
  return py::module_::import("modelcache.errors").attr(ErrorClassName(code));
}

py::object LoadErrorClass() {
  return py::module_::import("modelcache.errors").attr("LoadError");
}

void RaiseError(ErrorCode code, const std::string& message) {
  PyErr_SetString(ErrorClass(code).ptr(), message.c_str());
  throw py::error_already_set();
}

std::optional<double> SecondsFrom(const py::object& value, const char* what) {
  if (value.is_none()) return std::nullopt;
  double seconds = 0;
  py::module_ datetime = py::module_::import("datetime");
  if (py::isinstance(value, datetime.attr("timedelta"))) {
    seconds = value.attr("total_seconds")().cast<double>();
  } else if (PyFloat_Check(value.ptr()) || PyLong_Check(value.ptr())) {
    seconds = value.cast<double>();
  } else {
    RaiseError(ErrorCode::kInvalidArgument,
               std::string(what) +
                   " must be None, a number of seconds or a timedelta, not " +
                   std::string(py::str(value.get_type().attr("__name__"))));
  }
  if (std::isnan(seconds) || seconds < 0) {
    RaiseError(ErrorCode::kInvalidArgument, std::string(what) +
                                                " must be >= 0 seconds, got " +
                                                std::to_string(seconds));
  }
  return seconds;
}

Clock::time_point DeadlineFrom(const py::object& timeout) {
  std::optional<double> seconds = SecondsFrom(timeout, "timeout");
  if (!seconds || std::isinf(*seconds)) return Clock::time_point::max();
  const auto now = Clock::now();
  const double room =
      std::chrono::duration<double>(Clock::time_point::max() - now).count();
  if (*seconds >= room) return Clock::time_point::max();
  return now + std::chrono::duration_cast<Clock::duration>(
                   std::chrono::duration<double>(*seconds));
}

AcquireOptions MakeAcquireOptions(const py::object& timeout,
                                  const std::string& when_full,
                                  bool* interrupted) {
  AcquireOptions options;
  options.deadline = DeadlineFrom(timeout);
  if (when_full == "fail") {
    options.when_full = WhenFull::kFail;
  } else if (when_full == "wait") {
    options.when_full = WhenFull::kWait;
  } else {
    RaiseError(
        ErrorCode::kInvalidArgument,
        "when_full must be \"fail\" or \"wait\", not \"" + when_full + "\"");
  }
  // Python runs signal handlers only on the main thread; elsewhere the check
  // costs a GIL round trip and finds nothing, so only the main thread polls.
  if (_PyOS_IsMainThread()) {
    options.interrupt.check = [interrupted] {
      WithGil([interrupted] {
        if (PyErr_CheckSignals() != 0) {
          if (interrupted != nullptr) *interrupted = true;
          throw py::error_already_set();
        }
      });
    };
  }
  return options;
}

namespace {

std::string TypeName(py::handle value) {
  std::string name = Py_TYPE(value.ptr())->tp_name;
  if (const char* dot = std::strrchr(name.c_str(), '.')) name = dot + 1;
  return name;
}

}  // namespace

void RaiseArgumentType(const char* name, const char* expected, py::handle got) {
  PyErr_SetString(PyExc_TypeError, (std::string(name) + " must be " + expected +
                                    ", not " + TypeName(got))
                                       .c_str());
  throw py::error_already_set();
}

std::string StrArg(py::handle value, const char* name) {
  if (!PyUnicode_Check(value.ptr())) RaiseArgumentType(name, "a str", value);
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (utf8 == nullptr) throw py::error_already_set();
  return std::string(utf8, static_cast<size_t>(size));
}

bool BoolArg(py::handle value, const char* name) {
  if (!PyBool_Check(value.ptr())) RaiseArgumentType(name, "a bool", value);
  return value.ptr() == Py_True;
}

namespace {

// The int of an __index__ object (not a bool), as a Python int.
py::object IndexOf(py::handle value, const char* name, const char* expected) {
  if (PyBool_Check(value.ptr()) || !PyIndex_Check(value.ptr())) {
    RaiseArgumentType(name, expected, value);
  }
  PyObject* index = PyNumber_Index(value.ptr());
  if (index == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(index);
}

}  // namespace

long long IntArg(py::handle value, const char* name, long long min,
                 long long max) {
  py::object index = IndexOf(value, name, "an int");
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
  if (overflow == 0 && v == -1 && PyErr_Occurred()) {
    throw py::error_already_set();
  }
  if (overflow != 0 || v < min || v > max) {
    RaiseError(ErrorCode::kInvalidArgument,
               std::string(name) + " must be within " + std::to_string(min) +
                   ".." + std::to_string(max) + ", got " +
                   std::string(py::str(index)));
  }
  return v;
}

uint64_t BytesArg(py::handle value, const char* name, bool allow_zero) {
  const char* expected =
      "an int or a byte size string such as '16GiB' or '500MB'";
  uint64_t bytes = 0;
  if (PyUnicode_Check(value.ptr())) {
    const std::string text = StrArg(value, name);
    try {
      bytes = ParseBytes(text);
    } catch (const Error& e) {
      RaiseError(ErrorCode::kInvalidArgument,
                 std::string(name) + ": " + e.what());
    }
  } else {
    py::object index = IndexOf(value, name, expected);
    if (PyObject_RichCompareBool(index.ptr(), py::int_(0).ptr(), Py_LT) == 1) {
      RaiseError(ErrorCode::kInvalidArgument,
                 std::string(name) + " must not be negative, got " +
                     std::string(py::str(index)));
    }
    bytes = PyLong_AsUnsignedLongLong(index.ptr());
    if (bytes == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
      PyErr_Clear();
      RaiseError(ErrorCode::kInvalidArgument,
                 std::string(name) +
                     " is 2^64 bytes or more: " + std::string(py::str(index)));
    }
  }
  if (bytes == 0 && !allow_zero) {
    RaiseError(ErrorCode::kInvalidArgument,
               std::string(name) + " must be more than 0 bytes");
  }
  return bytes;
}

py::object CallableArg(py::handle value, const char* name, bool allow_none) {
  if (allow_none && value.is_none()) return py::none();
  if (!PyCallable_Check(value.ptr())) {
    RaiseArgumentType(name, allow_none ? "callable or None" : "callable",
                      value);
  }
  return py::reinterpret_borrow<py::object>(value);
}

py::object TimeoutArg(py::handle value, const char* name) {
  py::object timeout = py::reinterpret_borrow<py::object>(value);
  (void)SecondsFrom(timeout, name);
  return timeout;
}

void RegisterExceptionTranslators() {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PythonError& e) {
      // User code's exception reaching the thread that ran it: unchanged,
      // traceback included.
      RestorePythonException(e.value());
    } catch (const Error& e) {
      PyErr_SetString(ErrorClass(e.code()).ptr(), e.what());
    }
  });
}

namespace {

py::object ToPython(const std::string& v) { return py::str(v); }
py::object ToPython(EntryState v) { return py::str(EntryStateName(v)); }
py::object ToPython(Clock::time_point v) {
  return py::float_(
      std::chrono::duration<double>(v.time_since_epoch()).count());
}
py::object ToPython(bool v) { return py::bool_(v); }
py::object ToPython(double v) { return py::float_(v); }
template <typename T>
py::object ToPython(T v) {
  return py::int_(v);
}

const char* PythonType(const std::string&) { return "str"; }
const char* PythonType(EntryState) { return "str"; }
const char* PythonType(Clock::time_point) { return "float"; }
const char* PythonType(bool) { return "bool"; }
const char* PythonType(double) { return "float"; }
template <typename T>
const char* PythonType(T) {
  return "int";
}

template <typename Record>
py::dict FieldsDict(const Record& r) {
  py::dict d;
  ForEachField(r, [&](const char* name, const auto& value, const char*) {
    d[name] = ToPython(value);
  });
  return d;
}

template <typename Record>
py::list FieldList() {
  py::list out;
  ForEachField(Record{},
               [&](const char* name, const auto& value, const char* doc) {
                 out.append(py::make_tuple(name, PythonType(value), doc));
               });
  return out;
}

}  // namespace

py::dict CacheStatsDict(const CacheStats& s) { return FieldsDict(s); }
py::dict EntryDict(const EntryInfo& e) { return FieldsDict(e); }
py::list CacheStatsFields() { return FieldList<CacheStats>(); }
py::list EntryFields() { return FieldList<EntryInfo>(); }

}  // namespace modelcache::python
