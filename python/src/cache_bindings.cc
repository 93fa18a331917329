// Budget, Cache, Lease, Loaded and the stats types of modelcache._core.
//
// Ownership. A Python Cache owns its ModelCache. Every Python Lease holds a
// reference to the Python Cache it came from, and every call holds `self`,
// so a ModelCache is destroyed only when no lease and no call on it is left,
// which is what ~ModelCache requires. A cache still alive when the
// interpreter finalizes is left alone (see ~CacheHandle).
//
// Values. A loader's value is kept by the core as a shared_ptr<void> owning
// one Python reference (SharePyObject), dropped with the GIL on whichever
// thread frees the record.
//
// The GIL. Calls that may block or evict run under WithoutGil (common.h).
// Lease release runs with the GIL held: releasing never waits for another
// thread (no thread waits for the GIL while it holds a cache lock, because
// user code runs outside the cache's locks), and the unloaders it may
// trigger take the GIL re-entrantly. Keeping the GIL there spares the hit
// path a round trip and keeps destructors free of GIL hand-offs, which a
// daemon thread must not do while the interpreter exits.
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "modelcache/base/bytes.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"
#include "modelcache/core/policy.h"

namespace modelcache::python {
namespace {

// What a loader may return instead of the bare value.
struct PyLoaded {
  py::object value;
  uint64_t bytes = 0;
  py::object unload;  // None or a callable
};

Loaded ToLoaded(const py::object& result, uint64_t expected_bytes);

// The loader and expected size of each key's last load through acquire or
// prefetch, kept for a cache whose policy prewarms (CacheOptions::
// keep_alive): a prewarm loads a model the way the application last did.
class PrewarmLoaders {
 public:
  // REQUIRES: the GIL is held (a replaced loader is dropped here).
  void Remember(const std::string& key, uint64_t expected_bytes,
                const py::object& loader) {
    PyRef old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& slot = by_key_[key];
      old = std::move(slot.second);
      slot = {expected_bytes, PyRef(loader)};
    }
  }
  // Called by the cache's keep-alive thread, without the GIL.
  std::optional<PrewarmSource> SourceFor(std::string_view key) {
    std::pair<uint64_t, PyRef> entry;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = by_key_.find(std::string(key));
      if (it == by_key_.end()) return std::nullopt;
      entry = it->second;
    }
    const uint64_t bytes = entry.first;
    return PrewarmSource{
        bytes, [fn = std::move(entry.second), bytes] {
          return WithGil([&] { return ToLoaded(CallPython(fn.get()), bytes); });
        }};
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::string, std::pair<uint64_t, PyRef>> by_key_;
};

class CacheHandle {
 public:
  CacheHandle(CacheOptions options, std::shared_ptr<Budget> budget,
              py::object on_event,
              std::shared_ptr<PrewarmLoaders> prewarm_loaders)
      : budget_(std::move(budget)),
        on_event_(std::move(on_event)),
        prewarm_loaders_(std::move(prewarm_loaders)) {
    options.budget = budget_;
    cache_ = std::make_unique<ModelCache>(std::move(options));
  }

  ~CacheHandle() {
    // At interpreter exit the cache is left to the process's end: its
    // unloaders and value deleters would run Python code while the
    // interpreter is being torn down.
    if (_Py_IsFinalizing()) {
      (void)cache_.release();
      return;
    }
    // ~ModelCache may wait for a peer cache's eviction running a Python
    // unloader on another thread, which needs the GIL.
    ModelCache* cache = cache_.release();
    PyThreadState* state = PyEval_SaveThread();
    delete cache;
    PyEval_RestoreThread(state);
  }

  ModelCache& cache() { return *cache_; }
  const std::shared_ptr<Budget>& budget() const { return budget_; }
  const py::object& on_event() const { return on_event_; }
  // For a policy that prewarms: remembers how `key` was loaded.
  // REQUIRES: the GIL is held.
  void RememberLoader(const std::string& key, uint64_t expected_bytes,
                      const py::object& loader) {
    if (prewarm_loaders_) {
      prewarm_loaders_->Remember(cache_->Resolve(key), expected_bytes, loader);
    }
  }

 private:
  std::shared_ptr<Budget> budget_;
  py::object on_event_;
  // Null unless the policy prewarms.
  std::shared_ptr<PrewarmLoaders> prewarm_loaders_;
  std::unique_ptr<ModelCache> cache_;
};

// ---- Lease: a plain CPython type ----
//
// Written against the C API rather than pybind11 because `with
// cache.acquire(...)` on a resident model is the hot path of every request:
// the object is allocated, entered, exited and freed per request, and
// pybind11's dispatch costs more than the cache's own work there.

struct LeaseObject {
  PyObject_HEAD PyObject*
      cache;    // strong: keeps the ModelCache alive while leased
  Lease lease;  // empty once released
  uint64_t bytes;
  std::string key;  // the canonical key, saved when the lease is released
};

PyTypeObject LeaseType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// Sets the Python error for a released lease; returns nullptr.
PyObject* ReleasedError(LeaseObject* o) {
  try {
    PyErr_SetString(ErrorClass(ErrorCode::kFailedPrecondition).ptr(),
                    ("the lease on '" + o->key + "' was released").c_str());
  } catch (py::error_already_set& e) {
    e.restore();
  }
  return nullptr;
}

PyObject* NewLeaseObject(PyObject* cache, Lease lease) {
  LeaseObject* o = PyObject_New(LeaseObject, &LeaseType);
  if (o == nullptr) return nullptr;  // `lease` releases itself
  o->cache = Py_NewRef(cache);
  o->bytes = lease.bytes();
  new (&o->lease) Lease(std::move(lease));
  new (&o->key) std::string();
  return reinterpret_cast<PyObject*>(o);
}

void ReleaseLease(LeaseObject* o) {
  // With the GIL: see the file comment.
  if (!o->lease) return;
  o->key = o->lease.key();
  o->lease.Release();
}

void LeaseDealloc(PyObject* self) {
  auto* o = reinterpret_cast<LeaseObject*>(self);
  o->lease.Release();
  o->lease.~Lease();
  o->key.~basic_string();
  Py_XDECREF(o->cache);
  PyObject_Free(self);
}

PyObject* LeaseValue(PyObject* self, void* = nullptr) {
  auto* o = reinterpret_cast<LeaseObject*>(self);
  if (!o->lease) return ReleasedError(o);
  return Py_NewRef(static_cast<PyObject*>(o->lease.value()));
}

PyObject* LeaseEnter(PyObject* self, PyObject*) { return LeaseValue(self); }

PyObject* LeaseExit(PyObject* self, PyObject* const*, Py_ssize_t) {
  ReleaseLease(reinterpret_cast<LeaseObject*>(self));
  Py_RETURN_FALSE;
}

PyObject* LeaseRelease(PyObject* self, PyObject*) {
  ReleaseLease(reinterpret_cast<LeaseObject*>(self));
  Py_RETURN_NONE;
}

const std::string& LeaseKey(LeaseObject* o) {
  return o->lease ? o->lease.key() : o->key;
}

PyObject* LeaseKeyGetter(PyObject* self, void*) {
  const std::string& key = LeaseKey(reinterpret_cast<LeaseObject*>(self));
  return PyUnicode_FromStringAndSize(key.data(),
                                     static_cast<Py_ssize_t>(key.size()));
}

PyObject* LeaseBytesGetter(PyObject* self, void*) {
  return PyLong_FromUnsignedLongLong(
      reinterpret_cast<LeaseObject*>(self)->bytes);
}

PyObject* LeaseReleasedGetter(PyObject* self, void*) {
  return PyBool_FromLong(!reinterpret_cast<LeaseObject*>(self)->lease);
}

PyObject* LeaseRepr(PyObject* self) {
  auto* o = reinterpret_cast<LeaseObject*>(self);
  const std::string text = "<modelcache.Lease key='" + LeaseKey(o) +
                           "' bytes=" + std::to_string(o->bytes) +
                           (o->lease ? ">" : " released>");
  return PyUnicode_FromStringAndSize(text.data(),
                                     static_cast<Py_ssize_t>(text.size()));
}

PyMethodDef lease_methods[] = {
    {"release", LeaseRelease, METH_NOARGS,
     "release($self, /)\n--\n\nGives the lease back; later calls do "
     "nothing."},
    {"__enter__", LeaseEnter, METH_NOARGS,
     "__enter__($self, /)\n--\n\nThe model."},
    {"__exit__",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(LeaseExit)),
     METH_FASTCALL, "__exit__($self, /, *args)\n--\n\nReleases the lease."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef lease_getset[] = {
    {"value", LeaseValue, nullptr,
     "The model; FailedPreconditionError once released.", nullptr},
    {"key", LeaseKeyGetter, nullptr, "The canonical key (aliases resolved).",
     nullptr},
    {"bytes", LeaseBytesGetter, nullptr, "The model's resident size in bytes.",
     nullptr},
    {"released", LeaseReleasedGetter, nullptr, "Whether release() ran.",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

constexpr const char* kLeaseDoc = R"doc(
A claim on a resident model: while it is held the model is not evicted or
unloaded. A context manager: ``with cache.acquire(...) as model:`` gives the
value and releases the lease at the end of the block. ``release()`` is
idempotent; after it, ``value`` raises FailedPreconditionError. A lease that
is garbage-collected is released.
)doc";

void ReadyLeaseType(py::module_& m) {
  LeaseType.tp_name = "modelcache.Lease";
  LeaseType.tp_basicsize = sizeof(LeaseObject);
  LeaseType.tp_flags = Py_TPFLAGS_DEFAULT;
  LeaseType.tp_doc = kLeaseDoc;
  LeaseType.tp_dealloc = LeaseDealloc;
  LeaseType.tp_repr = LeaseRepr;
  LeaseType.tp_methods = lease_methods;
  LeaseType.tp_getset = lease_getset;
  if (PyType_Ready(&LeaseType) < 0) throw py::error_already_set();
  m.add_object("Lease", py::reinterpret_borrow<py::object>(
                            reinterpret_cast<PyObject*>(&LeaseType)));
}

Loaded ToLoaded(const py::object& result, uint64_t expected_bytes) {
  Loaded loaded;
  py::object value = result;
  py::object unload = py::none();
  loaded.bytes = expected_bytes;
  if (py::isinstance<PyLoaded>(result)) {
    const PyLoaded& l = result.cast<const PyLoaded&>();
    value = l.value;
    unload = l.unload;
    loaded.bytes = l.bytes;
  }
  loaded.value = SharePyObject(value);
  if (!unload.is_none()) {
    loaded.unload = [fn = PyRef(unload)] {
      WithGil([&] { CallPython(fn.get()); });
    };
  }
  return loaded;
}

// Wraps a Python loader; `ran` records that this call's loader ran, which
// is how a failure is told apart: the loader's own thread gets the
// exception unchanged, waiters get LoadError.
Loader MakeLoader(const py::object& loader, uint64_t expected_bytes,
                  bool* ran) {
  return [fn = PyRef(loader), expected_bytes, ran] {
    *ran = true;
    return WithGil([&] {
      py::object result = CallPython(fn.get());
      return ToLoaded(result, expected_bytes);
    });
  };
}

// Runs a blocking core call that may run this call's loader and turns what
// it throws into the Python exception the package promises.
template <typename Fn>
auto RunLoading(CacheHandle& handle, const std::string& key,
                const py::object& loader, uint64_t expected_bytes,
                const py::object& timeout, const std::string& when_full,
                Fn&& call) {
  bool interrupted = false;
  AcquireOptions options = MakeAcquireOptions(timeout, when_full, &interrupted);
  bool ran = false;
  const Loader wrapped = MakeLoader(loader, expected_bytes, &ran);
  try {
    return WithoutGil([&] { return call(handle.cache(), options, wrapped); });
  } catch (const PythonError& e) {
    if (ran || interrupted) e.Reraise();
    // Another thread's loader failed: LoadError, caused by its exception.
    py::object error = LoadErrorClass()(
        "loading '" + key + "' in cache '" + handle.cache().name() +
        "' failed in another thread: " + std::string(e.what()));
    PyException_SetCause(error.ptr(), e.value().inc_ref().ptr());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())),
                    error.ptr());
    throw py::error_already_set();
  }
}

// The default of acquire's and prefetch's required parameters, so that
// leaving one out is told as Python tells it (pybind11 would list the
// overloads instead). A private object: None is a wrong value, not a
// missing one.
py::object Missing() {
  // Made once, with the GIL (at module init), and never dropped.
  static PyObject* missing =
      py::module_::import("builtins").attr("object")().release().ptr();
  return py::reinterpret_borrow<py::object>(missing);
}

// The arguments acquire and prefetch share, checked.
struct LoadArgs {
  LoadArgs(const char* function, const py::object& key_arg,
           const py::object& loader_arg, const py::object& expected_arg,
           const py::object& when_full_arg) {
    const py::object missing = Missing();
    const char* what[] = {"key", "loader", "expected_bytes"};
    const py::object* given[] = {&key_arg, &loader_arg, &expected_arg};
    for (int i = 0; i < 3; ++i) {
      if (given[i]->is(missing)) {
        std::string message = std::string("Cache.") + function +
                              "() missing required argument '" + what[i] + "'";
        if (i == 2) {
          message +=
              ": the bytes to reserve in the budget before the loader runs "
              "(an int or a size such as '7GiB'); a loader that returns "
              "modelcache.Loaded(value, bytes) corrects it to the real size";
        }
        PyErr_SetString(PyExc_TypeError, message.c_str());
        throw py::error_already_set();
      }
    }
    key = StrArg(key_arg, "key");
    loader = CallableArg(loader_arg, "loader", false);
    expected_bytes = BytesArg(expected_arg, "expected_bytes", true);
    when_full = StrArg(when_full_arg, "when_full");
  }
  std::string key;
  py::object loader;
  uint64_t expected_bytes = 0;
  std::string when_full;
};

NamedPolicy PolicyFrom(const std::string& name) {
  try {
    return PolicyByName(name);
  } catch (const Error& e) {
    RaiseError(e.code(), e.what());
  }
}

// drain_after from Python: None is the library's default, math.inf never
// drains, any other number of seconds (or a timedelta) is the setting.
std::chrono::nanoseconds DrainAfterFrom(const py::object& value) {
  const std::optional<double> seconds = SecondsFrom(value, "drain_after");
  if (!seconds) return kDefaultDrainAfter;
  if (std::isinf(*seconds) ||
      *seconds >= std::chrono::duration<double>(kDrainNever).count()) {
    return kDrainNever;
  }
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double>(*seconds));
}

py::object DrainAfterToPython(std::chrono::nanoseconds drain_after) {
  // The adaptive default has no one value: None, as it is given.
  if (drain_after == kDrainAfterAuto) return py::none();
  if (drain_after == kDrainNever) {
    return py::float_(std::numeric_limits<double>::infinity());
  }
  return py::float_(std::chrono::duration<double>(drain_after).count());
}

std::unique_ptr<CacheHandle> NewCache(
    const py::object& name_arg, const py::object& capacity_arg,
    const py::object& budget_arg, const py::object& policy_arg,
    const py::object& idle_ttl, const py::object& shard_bits_arg,
    py::object on_event, const py::object& drain_after_arg) {
  const std::string name = StrArg(name_arg, "name");
  std::optional<uint64_t> capacity_bytes;
  if (!capacity_arg.is_none()) {
    capacity_bytes = BytesArg(capacity_arg, "capacity_bytes", false);
  }
  std::shared_ptr<Budget> budget;
  if (!budget_arg.is_none()) {
    if (!py::isinstance<Budget>(budget_arg)) {
      RaiseArgumentType("budget", "a modelcache.Budget or None", budget_arg);
    }
    budget = budget_arg.cast<std::shared_ptr<Budget>>();
  }
  const std::string policy = StrArg(policy_arg, "policy");
  const long long shard_bits =
      IntArg(shard_bits_arg, "shard_bits", 0, kMaxShardBits);
  on_event = CallableArg(on_event, "on_event", true);
  (void)SecondsFrom(idle_ttl, "idle_ttl");
  const std::chrono::nanoseconds drain_after = DrainAfterFrom(drain_after_arg);
  if (budget && !drain_after_arg.is_none()) {
    RaiseError(ErrorCode::kInvalidArgument,
               "drain_after belongs to the shared budget: give it to "
               "modelcache.Budget, not to the cache");
  }
  if (budget && capacity_bytes) {
    RaiseError(ErrorCode::kInvalidArgument,
               "give capacity_bytes or budget, not both");
  }
  if (!budget && !capacity_bytes) {
    RaiseError(ErrorCode::kInvalidArgument,
               "give capacity_bytes (a new budget) or budget (a shared one)");
  }
  if (!budget) {
    budget = std::make_shared<Budget>(
        *capacity_bytes, name, BudgetOptions{.drain_after = drain_after});
  }
  CacheOptions options;
  options.name = name;
  options.WithPolicy(PolicyFrom(policy));
  std::shared_ptr<PrewarmLoaders> prewarm_loaders;
  if (options.keep_alive) {
    prewarm_loaders = std::make_shared<PrewarmLoaders>();
    options.prewarm_source = [prewarm_loaders](std::string_view key) {
      return prewarm_loaders->SourceFor(key);
    };
  }
  options.shard_bits = static_cast<int>(shard_bits);
  if (std::optional<double> ttl = SecondsFrom(idle_ttl, "idle_ttl")) {
    if (std::isinf(*ttl)) {
      RaiseError(ErrorCode::kInvalidArgument, "idle_ttl must be finite");
    }
    options.idle_ttl = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::duration<double>(*ttl));
  }
  if (!on_event.is_none()) {
    options.on_event = [fn = PyRef(on_event)](const CacheEvent& event) {
      if (MustNotTakeGil()) return;
      GilHold gil;
      try {
        py::dict fields;
        fields["type"] = EventTypeName(event.type);
        fields["key"] = event.key;
        fields["bytes"] = event.bytes;
        fields["seconds"] = event.seconds;
        fields["error"] = event.error;
        // A Python loader's or unloader's exception, traceback included.
        py::object exception = py::none();
        if (event.exception) {
          try {
            std::rethrow_exception(event.exception);
          } catch (const PythonError& e) {
            exception = py::reinterpret_borrow<py::object>(e.value());
          } catch (...) {
            // A C++ error of the core (a refused reservation): `error`
            // says it; there is no Python object to give.
          }
        }
        fields["exception"] = exception;
        py::object event_class =
            py::module_::import("modelcache._types").attr("Event");
        py::object ev = CallPython(event_class, {}, fields);
        CallPython(fn.get(), py::make_tuple(ev));
      } catch (py::error_already_set& e) {
        // Shown like an exception in __del__, then counted by the core.
        e.discard_as_unraisable(py::reinterpret_borrow<py::object>(fn.get()));
        throw std::runtime_error("the on_event callback raised");
      }
    };
  }
  return std::make_unique<CacheHandle>(std::move(options), std::move(budget),
                                       std::move(on_event),
                                       std::move(prewarm_loaders));
}

CacheHandle& Handle(const py::object& self) {
  return self.cast<CacheHandle&>();
}

// Cache.acquire: the hit path in the C API, holding the GIL (TryAcquire
// never waits and runs no user code); anything else goes to the pybind11
// method _acquire, which validates the arguments, releases the GIL and may
// load. Only the plain call form, acquire(key, loader, expected_bytes), takes
// the fast path, so keyword arguments are always validated.
// An int the slow path would take as expected_bytes without a word: a hit
// with a negative size (or a bool) is refused there like a miss.
bool IsSmallNonNegative(PyObject* value) {
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
  return overflow == 0 && v >= 0;
}

PyObject* CacheAcquire(PyObject* self, PyObject* const* args, Py_ssize_t nargs,
                       PyObject* kwnames) {
  if (nargs == 3 && kwnames == nullptr && PyUnicode_Check(args[0]) &&
      PyCallable_Check(args[1]) && PyLong_CheckExact(args[2]) &&
      IsSmallNonNegative(args[2])) {
    Py_ssize_t size = 0;
    const char* key = PyUnicode_AsUTF8AndSize(args[0], &size);
    if (key == nullptr) return nullptr;
    try {
      CacheHandle& h = py::handle(self).cast<CacheHandle&>();
      std::optional<Lease> lease =
          h.cache().TryAcquire(std::string_view(key, size));
      if (lease) return NewLeaseObject(self, std::move(*lease));
    } catch (py::error_already_set& e) {
      e.restore();
      return nullptr;
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  PyObject* slow = PyObject_GetAttrString(self, "_acquire");
  if (slow == nullptr) return nullptr;
  PyObject* result = PyObject_Vectorcall(slow, args, nargs, kwnames);
  Py_DECREF(slow);
  return result;
}

PyMethodDef acquire_def = {
    "acquire",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(CacheAcquire)),
    METH_FASTCALL | METH_KEYWORDS,
    R"doc(acquire($self, key, loader, expected_bytes, *, timeout=None, when_full='fail')
--

Returns a Lease on ``key`` (or the key it aliases), calling ``loader()`` to
load it if it is not resident; ``expected_bytes`` (an int or a size such as
"7GiB") is reserved before the loader runs, and is required: it is what
keeps loads in flight within the budget. The loader returns the model (sized ``expected_bytes``) or a
Loaded. Concurrent acquires of one key share one load.

``when_full``: "fail" raises CapacityError when nothing can be evicted;
"wait" waits for room, up to ``timeout`` (seconds or timedelta; None waits
forever), then raises TimeoutError. TooLargeError when the model exceeds the
whole budget. The loader's exception reaches this thread unchanged when its
loader ran here; threads that waited for that load get LoadError with the
loader's exception as ``__cause__``. A loader acquiring its own key gets
FailedPreconditionError. Blocking waits release the GIL and end with
KeyboardInterrupt on Ctrl-C (main thread).
)doc"};

}  // namespace

void BindCache(py::module_& m) {
  m.def(
      "policy_names",
      [](const py::object& offline_arg) {
        const bool offline = BoolArg(offline_arg, "offline");
        std::vector<std::string> names = PolicyNames();
        if (offline) {
          for (std::string& name : OfflinePolicyNames()) {
            names.push_back(std::move(name));
          }
        }
        return names;
      },
      py::arg("offline") = false,
      "The policy names Cache(policy=...) takes, as replay and the daemon "
      "take them; \"ttl-<N>m\" stands for ttl-10m, ttl-90s, ttl-1h. With "
      "offline=True, also those that need the future (\"belady\").");
  m.def(
      "_byte_size",
      [](const py::object& value, const py::object& name, bool allow_zero) {
        return BytesArg(value, StrArg(name, "name").c_str(), allow_zero);
      },
      py::arg("value"), py::arg("name"), py::arg("allow_zero"),
      "A byte size (an int, or a string in the CLI's grammar: \"16GiB\", "
      "\"500MB\") as an int; TypeError or InvalidArgumentError naming "
      "``name`` otherwise. For the Python modules' argument checks.");
  m.def(
      "_check_timeout",
      [](const py::object& value, const py::object& name) {
        (void)TimeoutArg(value, StrArg(name, "name").c_str());
      },
      py::arg("value"), py::arg("name"),
      "InvalidArgumentError naming ``name`` unless ``value`` is None, a "
      "number of seconds >= 0 or a timedelta.");
  m.def("_cache_stats_fields", &CacheStatsFields);
  m.def("_entry_fields", &EntryFields);
  py::class_<Budget, std::shared_ptr<Budget>>(m, "Budget", R"doc(
A byte budget that one or several caches draw from.

When a cache on the budget needs room, the budget evicts the lowest-priority
idle model among all its caches, whichever cache holds it.
)doc")
      .def(py::init([](const py::object& capacity_arg,
                       const py::object& name_arg,
                       const py::object& drain_after_arg) {
             const uint64_t capacity_bytes =
                 BytesArg(capacity_arg, "capacity_bytes", false);
             return std::make_shared<Budget>(
                 capacity_bytes, StrArg(name_arg, "name"),
                 BudgetOptions{.drain_after = DrainAfterFrom(drain_after_arg)});
           }),
           py::arg("capacity_bytes"), py::arg("name") = "budget",
           py::arg("drain_after") = py::none())
      .def_property_readonly(
          "drain_after",
          [](const Budget& b) { return DrainAfterToPython(b.drain_after()); },
          "Seconds an acquire waiting for room may be overtaken by requests "
          "for the models that hold it before they drain (math.inf: never; "
          "None: the library's default, four times the load time last "
          "measured for the waiter's model and at least 1 s).")
      .def(
          "set_drain_after",
          [](Budget& b, const py::object& drain_after_arg) {
            const std::chrono::nanoseconds drain_after =
                DrainAfterFrom(drain_after_arg);
            WithoutGil([&] { b.set_drain_after(drain_after); });
          },
          py::arg("drain_after"),
          "Sets drain_after (seconds, a timedelta or math.inf; None: the "
          "library's default); waiters already waiting judge their wait "
          "against the new value.")
      .def_property_readonly("drains", &Budget::drains,
                             "Drains started since the budget was made.")
      .def_property_readonly(
          "queued_behind_drain", &Budget::queued_behind_drain,
          "Acquires that queued behind a draining model since it was made.")
      .def_property_readonly("name", &Budget::name)
      .def_property_readonly("capacity", &Budget::capacity,
                             "Capacity in bytes.")
      .def_property_readonly(
          "used", &Budget::used,
          "Bytes held: resident and retired models plus loads in flight.")
      .def_property_readonly("high_water", &Budget::high_water,
                             "The largest `used` ever seen.")
      .def_property_readonly("waiters", &Budget::waiters,
                             "Acquires currently waiting for room.")
      .def(
          "set_capacity",
          [](Budget& b, const py::object& capacity_arg) {
            const uint64_t capacity_bytes =
                BytesArg(capacity_arg, "capacity_bytes", false);
            return WithoutGil([&] { return b.SetCapacity(capacity_bytes); });
          },
          py::arg("capacity_bytes"),
          "Changes the capacity, evicting idle models of every cache on the "
          "budget when it shrinks; returns the bytes still over capacity "
          "(held by leases or pins).")
      .def("__repr__", [](const Budget& b) {
        return "Budget(name='" + b.name() +
               "', capacity=" + std::to_string(b.capacity()) +
               ", used=" + std::to_string(b.used()) + ")";
      });

  py::class_<PyLoaded>(m, "Loaded", R"doc(
What a loader may return to give the model's real size and an unloader.

``Loaded(value, bytes, unload=None)``: ``bytes`` is the model's resident size
(the reservation made from ``expected_bytes`` is adjusted to it); ``unload``,
when given, is called before the value is dropped, on eviction or removal. If
it raises, the model stays resident and counted.
)doc")
      .def(py::init([](py::object value, const py::object& bytes_arg,
                       const py::object& unload_arg) {
             const uint64_t bytes = BytesArg(bytes_arg, "bytes", true);
             py::object unload = CallableArg(unload_arg, "unload", true);
             return PyLoaded{std::move(value), bytes, std::move(unload)};
           }),
           py::arg("value"), py::arg("bytes"), py::arg("unload") = py::none())
      .def_readonly("value", &PyLoaded::value)
      .def_readonly("bytes", &PyLoaded::bytes)
      .def_readonly("unload", &PyLoaded::unload);

  ReadyLeaseType(m);

  py::class_<CacheHandle>(m, "Cache", R"doc(
A cache of loaded models: each model is loaded at most once however many
threads race for it, kept resident within a byte budget, never evicted while
a lease on it is held, and never cached when its loader fails.

``Cache(name="models", capacity_bytes=None, budget=None, policy="lru",
idle_ttl=None, shard_bits=4, on_event=None, drain_after=None)``: give ``capacity_bytes`` (an
int or a size such as "16GiB") for a budget of its own or ``budget`` to share
one. ``policy`` is a name from
``modelcache.policy_names()`` ("lru", "gdsf", "next-use", "ttl-10m",
"next-use-prewarm", ...): the same policies replay runs. A keep-alive policy
("hybrid-histogram", "gdsf-prewarm", "next-use-prewarm") unloads idle models
and prewarms them ahead of their expected next request, on a thread of the
cache's, with the loader and size of each model's last acquire or prefetch.
``shard_bits`` is within 0..12.
``idle_ttl`` (seconds or a timedelta) unloads models idle that long.
``drain_after`` (seconds, a timedelta or ``math.inf``; for a budget of the
cache's own) bounds how long an acquire waiting for room may be overtaken by
requests for the models that hold it: after that they drain (new requests
for them queue, the leases out end, the waiter gets its room). 0 is strict
arrival order, ``math.inf`` never drains; None is the library's default:
four times what the cache last measured loading the waiting model, and at
least 1 s (also for a model never loaded).
``on_event`` is called with an Event for every load, failure, eviction and
removal, outside the cache's locks.
)doc")
      .def(py::init(&NewCache), py::arg("name") = "models",
           py::arg("capacity_bytes") = py::none(),
           py::arg("budget") = py::none(), py::arg("policy") = "lru",
           py::arg("idle_ttl") = py::none(), py::arg("shard_bits") = 4,
           py::arg("on_event") = py::none(),
           py::arg("drain_after") = py::none())
      .def_property_readonly("name",
                             [](CacheHandle& h) { return h.cache().name(); })
      .def_property_readonly(
          "budget", [](CacheHandle& h) { return h.budget(); },
          "The Budget this cache draws from.")
      .def(
          "_acquire",
          [](py::object self, const py::object& key_arg,
             const py::object& loader_arg, const py::object& expected_arg,
             const py::object& timeout, const py::object& when_full_arg) {
            CacheHandle& h = Handle(self);
            const LoadArgs args{"acquire", key_arg, loader_arg, expected_arg,
                                when_full_arg};
            const std::string& key = args.key;
            const py::object& loader = args.loader;
            const uint64_t expected_bytes = args.expected_bytes;
            const std::string& when_full = args.when_full;
            h.RememberLoader(key, expected_bytes, loader);
            Lease lease = RunLoading(
                h, key, loader, expected_bytes, timeout, when_full,
                [&](ModelCache& cache, const AcquireOptions& options,
                    const Loader& wrapped) {
                  return cache.Acquire(key, expected_bytes, wrapped, options);
                });
            PyObject* o = NewLeaseObject(self.ptr(), std::move(lease));
            if (o == nullptr) throw py::error_already_set();
            return py::reinterpret_steal<py::object>(o);
          },
          py::arg_v("key", Missing(), "<required>"),
          py::arg_v("loader", Missing(), "<required>"),
          py::arg_v("expected_bytes", Missing(), "<required>"), py::kw_only(),
          py::arg("timeout") = py::none(), py::arg("when_full") = "fail",
          "acquire()'s path for misses and keyword arguments.")
      .def(
          "prefetch",
          [](py::object self, const py::object& key_arg,
             const py::object& loader_arg, const py::object& expected_arg,
             const py::object& timeout, const py::object& when_full_arg,
             const py::object& lower_arg) {
            CacheHandle& h = Handle(self);
            const LoadArgs args{"prefetch", key_arg, loader_arg, expected_arg,
                                when_full_arg};
            const std::string& key = args.key;
            const py::object& loader = args.loader;
            const uint64_t expected_bytes = args.expected_bytes;
            const std::string& when_full = args.when_full;
            const bool evict_only_lower_ranked =
                BoolArg(lower_arg, "evict_only_lower_ranked");
            h.RememberLoader(key, expected_bytes, loader);
            RunLoading(h, key, loader, expected_bytes, timeout, when_full,
                       [&](ModelCache& cache, const AcquireOptions& options,
                           const Loader& wrapped) {
                         AcquireOptions prefetch = options;
                         prefetch.evict_only_lower_ranked =
                             evict_only_lower_ranked;
                         cache.Prefetch(key, expected_bytes, wrapped, prefetch);
                         return 0;
                       });
          },
          py::arg_v("key", Missing(), "<required>"),
          py::arg_v("loader", Missing(), "<required>"),
          py::arg_v("expected_bytes", Missing(), "<required>"), py::kw_only(),
          py::arg("timeout") = py::none(), py::arg("when_full") = "fail",
          py::arg("evict_only_lower_ranked") = false,
          "Loads ``key`` if absent and leaves it resident without a lease. "
          "It is not a request: a policy that learns when requests come "
          "(\"next-use\") does not count it. With "
          "``evict_only_lower_ranked``, makes room only from models the "
          "policy ranks below ``key`` now (a warm-up that never displaces a "
          "model expected sooner). Raises like acquire().")
      .def(
          "get",
          [](py::object self, const py::object& key_arg) -> py::object {
            CacheHandle& h = Handle(self);
            const std::string key = StrArg(key_arg, "key");
            std::optional<Lease> lease =
                WithoutGil([&] { return h.cache().Lookup(key); });
            if (!lease) return py::none();
            PyObject* o = NewLeaseObject(self.ptr(), std::move(*lease));
            if (o == nullptr) throw py::error_already_set();
            return py::reinterpret_steal<py::object>(o);
          },
          py::arg("key"),
          "A Lease if ``key`` is resident, else None; never loads.")
      .def(
          "remove",
          [](CacheHandle& h, const py::object& key_arg, py::object timeout) {
            const std::string key = StrArg(key_arg, "key");
            const Clock::time_point deadline = DeadlineFrom(timeout);
            const RemoveOutcome outcome =
                WithoutGil([&] { return h.cache().Remove(key, deadline); });
            return outcome == RemoveOutcome::kNotFound  ? "not_found"
                   : outcome == RemoveOutcome::kRemoved ? "removed"
                                                        : "retired";
          },
          py::arg("key"), py::kw_only(), py::arg("timeout") = py::none(),
          R"doc(
Removes the model ``key`` names, waiting for its load or unload in progress.
Returns "removed" (unloaded now), "retired" (leased: hidden now, unloaded when
its last lease ends) or "not_found". An unloader's exception propagates and
the model stays resident.
)doc")
      .def(
          "invalidate",
          [](CacheHandle& h, const py::object& key_arg, py::object timeout) {
            const std::string key = StrArg(key_arg, "key");
            const Clock::time_point deadline = DeadlineFrom(timeout);
            const RemoveOutcome outcome =
                WithoutGil([&] { return h.cache().Invalidate(key, deadline); });
            return outcome == RemoveOutcome::kNotFound  ? "not_found"
                   : outcome == RemoveOutcome::kRemoved ? "removed"
                                                        : "retired";
          },
          py::arg("key"), py::kw_only(), py::arg("timeout") = py::none(),
          "Like remove(), but a load in progress is not waited for: later "
          "acquires load afresh.")
      .def(
          "pin",
          [](CacheHandle& h, const py::object& key_arg) {
            const std::string key = StrArg(key_arg, "key");
            WithoutGil([&] { h.cache().Pin(key); });
          },
          py::arg("key"),
          "Keeps a resident model from eviction; NotFoundError if it is not "
          "resident. Pins do not nest.")
      .def(
          "unpin",
          [](CacheHandle& h, const py::object& key_arg) {
            const std::string key = StrArg(key_arg, "key");
            WithoutGil([&] { h.cache().Unpin(key); });
          },
          py::arg("key"))
      .def(
          "add_alias",
          [](CacheHandle& h, const py::object& alias_arg,
             const py::object& canonical_arg) {
            const std::string alias = StrArg(alias_arg, "alias");
            const std::string canonical = StrArg(canonical_arg, "canonical");
            WithoutGil([&] { h.cache().AddAlias(alias, canonical); });
          },
          py::arg("alias"), py::arg("canonical"),
          "Makes ``alias`` another name of ``canonical`` (one level deep).")
      .def(
          "remove_alias",
          [](CacheHandle& h, const py::object& alias_arg) {
            const std::string alias = StrArg(alias_arg, "alias");
            return WithoutGil([&] { return h.cache().RemoveAlias(alias); });
          },
          py::arg("alias"))
      .def(
          "resolve",
          [](CacheHandle& h, const py::object& key_arg) {
            const std::string key = StrArg(key_arg, "key");
            return WithoutGil([&] { return h.cache().Resolve(key); });
          },
          py::arg("key"), "The canonical key ``key`` names.")
      .def(
          "evict_expired",
          [](CacheHandle& h) {
            return WithoutGil([&] { return h.cache().EvictExpired(); });
          },
          "Unloads idle models past idle_ttl; returns how many.")
      .def(
          "prune",
          [](CacheHandle& h) {
            return WithoutGil([&] { return h.cache().Prune(); });
          },
          "Unloads every idle, unpinned model; returns how many.")
      .def(
          "set_capacity",
          [](CacheHandle& h, const py::object& capacity_arg) {
            const uint64_t capacity_bytes =
                BytesArg(capacity_arg, "capacity_bytes", false);
            return WithoutGil(
                [&] { return h.cache().SetCapacity(capacity_bytes); });
          },
          py::arg("capacity_bytes"),
          "Sets the capacity of this cache's budget; see Budget.set_capacity.")
      .def("_stats_dict",
           [](CacheHandle& h) {
             return CacheStatsDict(
                 WithoutGil([&] { return h.cache().Stats(); }));
           })
      .def("_entries",
           [](CacheHandle& h) {
             std::vector<EntryInfo> entries =
                 WithoutGil([&] { return h.cache().Entries(); });
             py::list out;
             for (const EntryInfo& e : entries) out.append(EntryDict(e));
             return out;
           })
      .def(
          "_entry",
          [](CacheHandle& h, const py::object& key_arg) -> py::object {
            const std::string key = StrArg(key_arg, "key");
            std::optional<EntryInfo> e =
                WithoutGil([&] { return h.cache().Entry(key); });
            if (!e) return py::none();
            return EntryDict(*e);
          },
          py::arg("key"))
      .def("check_invariants",
           [](CacheHandle& h) {
             return WithoutGil([&] { return h.cache().CheckInvariants(); });
           })
      .def("__repr__", [](CacheHandle& h) {
        return "<modelcache.Cache '" + h.cache().name() + "'>";
      });
  // Installed over the class as a plain method descriptor: see
  // CacheAcquire.
  py::object cache_class = m.attr("Cache");
  PyObject* acquire = PyDescr_NewMethod(
      reinterpret_cast<PyTypeObject*>(cache_class.ptr()), &acquire_def);
  if (acquire == nullptr) throw py::error_already_set();
  cache_class.attr("acquire") = py::reinterpret_steal<py::object>(acquire);
}

}  // namespace modelcache::python
