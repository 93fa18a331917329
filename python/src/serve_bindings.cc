// The serve part of modelcache._core: the client of `modelcache serve`
// (serve::Client), its leases and zero-copy views of the daemon's copies.
// The public API (docstrings, types, torch, fork) is
// python/modelcache/serve.py; the classes here are its building blocks.
//
// Ownership. A lease's RemoteWeights (the mapping of the daemon's copy, and
// the lease itself) lives in one RemoteCopy, shared through a shared_ptr by
// the _RemoteLease object and every view taken from it (a numpy array's base
// object, a DLPack tensor's manager context). ~RemoteWeights ends this
// reference to the client's mapping (the client keeps the lease idle, or
// unmaps the copy and then tells the daemon the lease ended), so that
// happens only once the lease is released *and* the last view is gone:
// never unmapped while a view still reads it. A local acquire (a model this
// process holds) is another RemoteCopy over the same mapping.
//
// The GIL. Connecting, acquiring and pinging wait for the daemon, so they
// run under WithoutGil; an acquire on the main thread polls Python's signal
// handlers (MakeAcquireOptions), so Ctrl-C ends its wait. A local acquire
// (Client::AcquireLocal), idle_leases and reclaims keep the GIL: they take
// only the client's lock, and no thread holding that lock waits for the
// GIL or for the daemon (the order is always the GIL, then the lock). Dropping
// a share may run with or without the GIL (torch frees a tensor on any thread):
// it unmaps and sends one datagram without waiting for an answer, so it never
// waits for another thread. Only a hook set by register_cuda (Python code)
// takes the GIL, before the unmap.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "common.h"
#include "modelcache/serve/client.h"
#include "modelcache/serve/errors.h"
#include "modelcache/weights/safetensors.h"
#include "weights_bindings.h"

namespace modelcache::python {

namespace {

// The most an acquire may wait: the protocol's limit (a day).
constexpr std::chrono::milliseconds kMaxWait{86'400'000};

// The modelcache.errors class a ServeError becomes.
const char* ServeErrorClassName(serve::ServeCode code) {
  switch (code) {
    case serve::ServeCode::kNotFound:
      return "NotFoundError";
    case serve::ServeCode::kTooLarge:
      return "TooLargeError";
    case serve::ServeCode::kCapacity:
      return "CapacityError";
    case serve::ServeCode::kTimeout:
      return "TimeoutError";
    case serve::ServeCode::kLoadFailed:
      return "LoadError";
    case serve::ServeCode::kBusy:
      return "UnavailableError";
    case serve::ServeCode::kInvalid:
      return "InvalidArgumentError";
    case serve::ServeCode::kUnavailable:
      return "DaemonUnavailableError";
  }
  return "Error";
}

// Raises `error` as its modelcache.errors class, with `serve_code` (the
// protocol's name: "CAPACITY", "BUSY", ...) and, for LOAD_FAILED and a
// model's UNAVAILABLE, `cause` (the core's code name: "io", "invalid_data")
// set on the exception. UNAVAILABLE is DaemonUnavailableError only when it
// is the daemon that is (unreachable, shutting down); a model whose files
// fail the daemon's checks is an UnavailableError.
void SetServeError(const serve::ServeError& error) {
  const bool model_unavailable =
      error.serve_code() == serve::ServeCode::kUnavailable &&
      dynamic_cast<const serve::DaemonUnavailableError*>(&error) == nullptr;
  py::object cls =
      py::module_::import("modelcache.errors")
          .attr(model_unavailable ? "UnavailableError"
                                  : ServeErrorClassName(error.serve_code()));
  py::object value = cls(py::str(std::string(error.what())));
  value.attr("serve_code") = serve::ServeCodeName(error.serve_code());
  if (error.serve_code() == serve::ServeCode::kLoadFailed ||
      model_unavailable) {
    value.attr("cause") = ErrorCodeName(error.code());
  }
  PyErr_SetObject(cls.ptr(), value.ptr());
}

// One lease's mapping, shared by the lease object and its views.
class RemoteCopy {
 public:
  explicit RemoteCopy(serve::RemoteWeights weights)
      : weights_(std::move(weights)) {}
  // Runs the hook (if any) with the GIL, then unmaps and ends the lease
  // (member destruction: the hook's reference, then weights_).
  ~RemoteCopy() {
    if (!before_unmap_ || MustNotTakeGil()) return;
    GilHold gil;
    try {
      CallPython(before_unmap_.get());
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("modelcache.serve: before unmapping a lease");
    }
  }
  RemoteCopy(const RemoteCopy&) = delete;
  RemoteCopy& operator=(const RemoteCopy&) = delete;

  const serve::RemoteWeights& weights() const { return weights_; }
  // REQUIRES: the GIL is held (which orders every call).
  void SetBeforeUnmap(py::handle hook) { before_unmap_ = PyRef(hook); }
  bool has_hook() const { return static_cast<bool>(before_unmap_); }

 private:
  serve::RemoteWeights weights_;
  PyRef before_unmap_;
};

using RemoteCopyPtr = std::shared_ptr<RemoteCopy>;

class PyRemoteLease {
 public:
  explicit PyRemoteLease(RemoteCopyPtr copy, double wait_seconds)
      : copy_(std::move(copy)),
        model_(copy_->weights().model()),
        lease_(copy_->weights().lease()),
        load_(copy_->weights().load()),
        bytes_(copy_->weights().data_bytes()),
        wait_seconds_(wait_seconds) {}

  const std::string& model() const { return model_; }
  uint64_t lease() const { return lease_; }
  const std::string& load() const { return load_; }
  uint64_t bytes() const { return bytes_; }
  double wait_seconds() const { return wait_seconds_; }
  bool released() const { return !copy_; }
  // Drops this object's share only; views keep theirs.
  void Release() { copy_.reset(); }

  py::list Names() const {
    const RemoteCopyPtr copy = Held();
    py::list names;
    for (const serve::RemoteTensor& t : copy->weights().tensors()) {
      names.append(py::str(t.name()));
    }
    return names;
  }

  py::dict Tensors() const {
    const RemoteCopyPtr copy = Held();
    const auto& files = copy->weights().files();
    py::dict d;
    for (const serve::RemoteTensor& t : copy->weights().tensors()) {
      if (d.contains(py::str(t.name()))) continue;  // the first file's
      py::dict info;
      info["dtype"] = weights::DtypeName(t.dtype());
      info["shape"] = py::cast(t.shape());
      info["file"] = files[t.file].path();
      d[py::str(t.name())] = info;
    }
    return d;
  }

  // (path, data bytes) of each file, in the catalog's order.
  py::list Files() const {
    const RemoteCopyPtr copy = Held();
    py::list out;
    for (const weights::WeightSet& f : copy->weights().files()) {
      out.append(py::make_tuple(f.path(), f.data_bytes()));
    }
    return out;
  }

  // (address, bytes) of each file's mapped data, for cudaHostRegister.
  py::list Regions() const {
    const RemoteCopyPtr copy = Held();
    py::list out;
    for (const weights::WeightSet& f : copy->weights().files()) {
      out.append(py::make_tuple(reinterpret_cast<uintptr_t>(f.data().data()),
                                f.data().size()));
    }
    return out;
  }

  py::array Numpy(const std::string& name) const {
    const RemoteCopyPtr copy = Held();
    const serve::RemoteTensor& t = Find(*copy, name);
    return NumpyView(copy, model_, *t.info, ViewAddress(t.data),
                     NumpyDtype(t.dtype(), name), false);
  }
  py::array Raw(const std::string& name) const {
    const RemoteCopyPtr copy = Held();
    const serve::RemoteTensor& t = Find(*copy, name);
    return NumpyView(copy, model_, *t.info, ViewAddress(t.data),
                     py::dtype("u1"), true);
  }
  py::tuple Dlpack(const std::string& name) const {
    const RemoteCopyPtr copy = Held();
    const serve::RemoteTensor& t = Find(*copy, name);
    return py::make_tuple(DlpackCapsule(copy, *t.info, ViewAddress(t.data)),
                          weights::DtypeName(t.dtype()));
  }

  // `hook` runs once, with the GIL, after the lease is released and the last
  // view is gone, just before the copy is unmapped.
  void SetBeforeUnmap(py::handle hook) {
    const RemoteCopyPtr copy = Held();
    if (copy->has_hook()) {
      RaiseError(ErrorCode::kFailedPrecondition,
                 "lease " + std::to_string(lease_) + " of '" + model_ +
                     "' already has a hook before its unmap");
    }
    copy->SetBeforeUnmap(hook);
  }

 private:
  RemoteCopyPtr Held() const {
    if (!copy_) {
      RaiseError(ErrorCode::kFailedPrecondition,
                 "the lease on '" + model_ +
                     "' was released; views taken before the release stay "
                     "valid");
    }
    return copy_;
  }

  static const serve::RemoteTensor& Find(const RemoteCopy& copy,
                                         const std::string& name) {
    const serve::RemoteTensor* t = copy.weights().Find(name);
    if (t == nullptr) {
      RaiseError(ErrorCode::kNotFound, "'" + copy.weights().model() +
                                           "' has no tensor named '" +
                                           weights::Printable(name) + "'");
    }
    return *t;
  }

  RemoteCopyPtr copy_;
  const std::string model_;
  const uint64_t lease_;
  const std::string load_;
  const uint64_t bytes_;
  const double wait_seconds_;
};

std::chrono::milliseconds MillisFrom(const py::object& seconds,
                                     const char* what) {
  const std::optional<double> s = SecondsFrom(seconds, what);
  if (!s || std::isinf(*s) ||
      *s * 1000 >= static_cast<double>(kMaxWait.count())) {
    return kMaxWait;
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*s * 1000)));
}

class PyServeClient {
 public:
  explicit PyServeClient(serve::Client client)
      : client_(std::make_shared<serve::Client>(std::move(client))) {}

  static PyServeClient Connect(const py::handle& path,
                               const py::object& connect_timeout,
                               const py::object& keep_idle,
                               const py::object& idle_notice_delay,
                               bool reclaim) {
    const std::string socket = PathFrom(path);
    serve::ClientOptions options;
    options.connect_timeout = MillisFrom(connect_timeout, "connect_timeout");
    options.keep_idle = KeepIdleFrom(keep_idle);
    options.idle_notice_delay = NoticeDelayFrom(idle_notice_delay);
    options.reclaim = reclaim;
    serve::Client client =
        WithoutGil([&] { return serve::Client::Connect(socket, options); });
    return PyServeClient(std::move(client));
  }

  PyRemoteLease Acquire(const std::string& model, const py::object& timeout,
                        const std::string& when_full) {
    const AcquireOptions core = MakeAcquireOptions(timeout, when_full);
    serve::RemoteAcquireOptions options;
    options.timeout = MillisFrom(timeout, "timeout");
    options.when_full = core.when_full;
    options.interrupt = core.interrupt;
    std::shared_ptr<serve::Client> client = client_;
    const auto start = std::chrono::steady_clock::now();
    // A local acquire, with the GIL held: it only takes the client's lock,
    // which no holder keeps while it waits (for the GIL or the daemon), and
    // giving the GIL up and taking it back would cost more than it does
    // (a switch to another thread, which keeps the GIL for its interval).
    std::optional<serve::RemoteWeights> local = client->AcquireLocal(model);
    RemoteCopyPtr copy = local ? std::make_shared<RemoteCopy>(std::move(*local))
                               : WithoutGil([&] {
                                   return std::make_shared<RemoteCopy>(
                                       client->Acquire(model, options));
                                 });
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    return PyRemoteLease(std::move(copy), waited);
  }

  // Client::AcquireLocal, with the GIL held (as in Acquire): None when the
  // model is not held locally.
  std::optional<PyRemoteLease> AcquireLocal(const std::string& model) {
    std::optional<serve::RemoteWeights> local = client_->AcquireLocal(model);
    if (!local) return std::nullopt;
    return PyRemoteLease(std::make_shared<RemoteCopy>(std::move(*local)), 0.0);
  }

  void Ping(const py::object& timeout) {
    const std::chrono::milliseconds ms = MillisFrom(timeout, "timeout");
    std::shared_ptr<serve::Client> client = client_;
    WithoutGil([&] { client->Ping(ms); });
  }

  py::dict Info() {
    std::shared_ptr<serve::Client> client = client_;
    const serve::ServerInfo info = WithoutGil([&] { return client->Info(); });
    py::dict d;
    d["server"] = info.server;
    d["version"] = info.version;
    d["limits"] = py::cast(info.limits);
    return d;
  }

  void Close() {
    std::shared_ptr<serve::Client> client = client_;
    WithoutGil([&] { client->Close(); });
  }

  const std::string& socket_path() const { return client_->socket_path(); }

  // These two keep the GIL, as a local acquire does: they only read under
  // the client's lock.
  size_t IdleLeases() { return client_->IdleLeases(); }

  // serve::ReclaimStats as a dict of its fields.
  py::dict Reclaims() {
    const serve::ReclaimStats stats = client_->Reclaims();
    py::dict d;
    d["reclaimed"] = stats.reclaimed;
    d["reclaim_refused"] = stats.reclaim_refused;
    d["reclaim_unsupported"] = stats.reclaim_unsupported;
    d["pending"] = stats.pending;
    return d;
  }

 private:
  // keep_idle: seconds (a number or a timedelta, >= 0). None, which a
  // timeout reads as the protocol's longest wait, is refused here: no
  // default reading of it would be unsurprising.
  static std::chrono::milliseconds KeepIdleFrom(const py::object& seconds) {
    if (seconds.is_none()) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "keep_idle must be a number of seconds (>= 0) or a "
                 "timedelta, not None");
    }
    return MillisFrom(seconds, "keep_idle");
  }

  // idle_notice_delay: seconds (>= 0), to the microsecond; at most the
  // longest wait (a notice never sent would keep the lease in use in the
  // daemon's books: refused rather than read as "never").
  static std::chrono::microseconds NoticeDelayFrom(const py::object& seconds) {
    const std::optional<double> s =
        seconds.is_none() ? std::nullopt
                          : SecondsFrom(seconds, "idle_notice_delay");
    if (!s || std::isinf(*s) ||
        *s * 1000 > static_cast<double>(kMaxWait.count())) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "idle_notice_delay must be a number of seconds from 0 to " +
                     std::to_string(kMaxWait.count() / 1000) +
                     " or a timedelta");
    }
    return std::chrono::microseconds(static_cast<int64_t>(std::ceil(*s * 1e6)));
  }

  std::shared_ptr<serve::Client> client_;
};

}  // namespace

void BindServe(py::module_& m) {
  // Tried before the core's translator (pybind11 tries the newest first),
  // which would map a ServeError by its core code only.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const serve::ServeError& e) {
      SetServeError(e);
    }
  });

  py::class_<PyRemoteLease>(m, "_RemoteLease",
                            "A lease on a daemon's copy; see "
                            "modelcache.serve.RemoteLease.")
      .def_property_readonly("model", &PyRemoteLease::model)
      .def_property_readonly("lease", &PyRemoteLease::lease)
      .def_property_readonly("load", &PyRemoteLease::load)
      .def_property_readonly("bytes", &PyRemoteLease::bytes)
      .def_property_readonly("wait_seconds", &PyRemoteLease::wait_seconds)
      .def_property_readonly("released", &PyRemoteLease::released)
      .def("release", &PyRemoteLease::Release)
      .def("names", &PyRemoteLease::Names)
      .def("tensors", &PyRemoteLease::Tensors)
      .def("files", &PyRemoteLease::Files)
      .def("regions", &PyRemoteLease::Regions)
      .def("numpy", &PyRemoteLease::Numpy, py::arg("name"))
      .def("raw", &PyRemoteLease::Raw, py::arg("name"))
      .def("dlpack", &PyRemoteLease::Dlpack, py::arg("name"))
      .def("set_before_unmap", &PyRemoteLease::SetBeforeUnmap, py::arg("hook"));

  py::class_<PyServeClient>(m, "_ServeClient",
                            "A connection to modelcache serve; see "
                            "modelcache.serve.Client.")
      .def_static("connect", &PyServeClient::Connect, py::arg("socket_path"),
                  py::arg("connect_timeout"), py::arg("keep_idle"),
                  py::arg("idle_notice_delay"), py::arg("reclaim"))
      .def("acquire", &PyServeClient::Acquire, py::arg("model"),
           py::arg("timeout"), py::arg("when_full"))
      .def("acquire_local", &PyServeClient::AcquireLocal, py::arg("model"))
      .def("ping", &PyServeClient::Ping, py::arg("timeout"))
      .def("info", &PyServeClient::Info)
      .def("close", &PyServeClient::Close)
      .def("idle_leases", &PyServeClient::IdleLeases)
      .def("reclaims", &PyServeClient::Reclaims)
      .def_property_readonly("socket_path", &PyServeClient::socket_path);
}

}  // namespace modelcache::python
