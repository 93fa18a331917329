// The runtime part of modelcache._core: a ModelRuntime over simulated, host
// or CUDA devices, and leases on placed models. The public API (docstrings,
// types, device specs) is python/modelcache/runtime.py; the classes here are
// its private building blocks.
//
// Ownership. A RuntimeState owns the devices and the ModelRuntime that points
// at them (the runtime goes first). The Python runtime object and every
// lease share it, so the runtime outlives its leases (~ModelRuntime requires
// it) however the Python objects are collected.
//
// The GIL. Acquire may block (for a load on another thread, for capacity)
// and reads files and copies to devices, so it runs under WithoutGil, as do
// the reads of the registry and of device memory. Releasing a lease runs
// with the GIL held, as in the cache bindings: it never waits for another
// thread and runs no Python code (the runtime has no Python callbacks).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "modelcache/device/cuda_device.h"
#include "modelcache/device/device.h"
#include "modelcache/device/host_device.h"
#include "modelcache/device/simulated_device.h"
#include "modelcache/runtime/registry.h"
#include "modelcache/runtime/runtime.h"
#include "weights_bindings.h"

namespace modelcache::python {
namespace {

using runtime::ModelLease;
using runtime::ModelRuntime;
using runtime::PlacedTensor;

class RuntimeState {
 public:
  RuntimeState() = default;
  // The runtime's device caches free device memory; the devices must still
  // be there.
  ~RuntimeState() { runtime.reset(); }
  RuntimeState(const RuntimeState&) = delete;
  RuntimeState& operator=(const RuntimeState&) = delete;

  std::vector<std::unique_ptr<device::Device>> devices;
  std::unique_ptr<ModelRuntime> runtime;
};

using StatePtr = std::shared_ptr<RuntimeState>;

// One device of the runtime, as runtime.py hands it over (every key set).
std::unique_ptr<device::Device> MakeDevice(const py::dict& spec,
                                           runtime::DeviceCacheOptions& cache) {
  const auto kind = spec["kind"].cast<std::string>();
  const auto capacity = spec["capacity_bytes"].cast<uint64_t>();
  cache.working_reserve_bytes = spec["working_reserve_bytes"].cast<uint64_t>();
  if (kind == "simulated") {
    device::SimulatedDeviceOptions options;
    options.name = spec["name"].cast<std::string>();
    options.capacity_bytes = capacity;
    options.bandwidth_bytes_per_second =
        spec["bandwidth_bytes_per_second"].cast<double>();
    return std::make_unique<device::SimulatedDevice>(std::move(options));
  }
  if (kind == "host") {
    device::HostDeviceOptions options;
    options.name = spec["name"].cast<std::string>();
    options.capacity_bytes = capacity;
    return std::make_unique<device::HostDevice>(std::move(options));
  }
  if (kind == "cuda") {
    device::CudaDeviceOptions options;
    options.capacity_bytes = capacity;
    const int ordinal = spec["ordinal"].cast<int>();
    // Throws DeviceError kUnavailable without CUDA: UnavailableError.
    return WithoutGil([&] { return device::MakeCudaDevice(ordinal, options); });
  }
  RaiseError(ErrorCode::kInvalidArgument,
             "device kind must be \"simulated\", \"host\" or \"cuda\", not \"" +
                 kind + "\"");
}

py::dict DeviceStatsDict(const device::DeviceStats& s) {
  py::dict d;
  d["capacity_bytes"] = s.capacity_bytes;
  d["allocation_granularity"] = s.allocation_granularity;
  d["bytes_allocated"] = s.bytes_allocated;
  d["high_water_bytes"] = s.high_water_bytes;
  d["allocations"] = s.allocations;
  d["frees"] = s.frees;
  d["failed_allocations"] = s.failed_allocations;
  d["copies_to_device"] = s.copies_to_device;
  d["copies_to_host"] = s.copies_to_host;
  d["bytes_copied_to_device"] = s.bytes_copied_to_device;
  d["bytes_copied_to_host"] = s.bytes_copied_to_host;
  d["failed_copies"] = s.failed_copies;
  d["synchronizations"] = s.synchronizations;
  d["simulated_transfer_seconds"] = s.simulated_transfer_seconds;
  d["unusable"] = s.unusable;
  d["unusable_reason"] = s.unusable_reason;
  return d;
}

runtime::Placement PlacementFrom(const std::string& placement) {
  if (placement == "full") return runtime::Placement::kFull;
  if (placement == "partial") return runtime::Placement::kPartial;
  RaiseError(
      ErrorCode::kInvalidArgument,
      "placement must be \"full\" or \"partial\", not \"" + placement + "\"");
}

// One lease on a placed model and the runtime it came from.
struct LeaseHold {
  LeaseHold(StatePtr state, ModelLease lease)
      : state(std::move(state)), lease(std::move(lease)) {}
  // Declared before `lease`, so destroyed after it: the lease goes back to a
  // runtime that is still there.
  StatePtr state;
  ModelLease lease;
};

class PyModelLease {
 public:
  PyModelLease(StatePtr state, ModelLease lease)
      : model_(lease->id()),
        device_(lease->device().name()),
        bytes_on_device_(lease->bytes_on_device()),
        total_bytes_(lease->total_bytes()),
        hold_(std::make_shared<LeaseHold>(std::move(state), std::move(lease))) {
  }

  const std::string& model() const { return model_; }
  const std::string& device() const { return device_; }
  uint64_t bytes_on_device() const { return bytes_on_device_; }
  uint64_t total_bytes() const { return total_bytes_; }
  bool full() const { return bytes_on_device_ == total_bytes_; }
  bool released() const { return !hold_; }
  // A read in progress on another thread keeps its own share of the lease,
  // so the lease ends when that read is done.
  void Release() { hold_.reset(); }

  py::list Tensors() const {
    const std::shared_ptr<const LeaseHold> hold = Held();
    py::list out;
    for (const PlacedTensor& t : hold->lease.model().tensors()) {
      py::dict d;
      d["name"] = py::str(t.info->name);
      d["dtype"] = weights::DtypeName(t.info->dtype);
      d["shape"] = py::cast(t.info->shape);
      d["bytes"] = t.info->bytes();
      d["on_device"] = t.on_device;
      d["device_offset"] = t.on_device ? py::cast(t.device_offset) : py::none();
      out.append(std::move(d));
    }
    return out;
  }

  // A fresh, writable copy of the tensor read back from where it is placed:
  // device memory (through the device's own copy) or the host copy.
  py::array Read(const std::string& name, bool raw) const {
    // Our own share: release() on another thread while the copy runs
    // without the GIL must not free the device memory under it.
    const std::shared_ptr<const LeaseHold> hold = Held();
    const runtime::DeviceModel& model = hold->lease.model();
    const PlacedTensor* found = nullptr;
    for (const PlacedTensor& t : model.tensors()) {
      if (t.info->name == name) {
        found = &t;
        break;
      }
    }
    if (found == nullptr) {
      RaiseError(ErrorCode::kNotFound, "model '" + model_ +
                                           "' has no tensor named '" +
                                           weights::Printable(name) + "'");
    }
    const weights::TensorInfo& info = *found->info;
    std::vector<py::ssize_t> shape;
    py::dtype dtype("u1");
    if (raw) {
      shape.push_back(static_cast<py::ssize_t>(info.bytes()));
    } else {
      dtype = NumpyDtype(info.dtype, name);
      for (uint64_t d : info.shape) {
        shape.push_back(static_cast<py::ssize_t>(d));
      }
    }
    py::array out(dtype, shape);
    if (info.bytes() == 0) return out;
    std::span<std::byte> dst(static_cast<std::byte*>(out.mutable_data()),
                             info.bytes());
    // Nothing else can see `out` yet, so writing it without the GIL is safe.
    WithoutGil([&] {
      if (found->on_device) {
        model.device().CopyToHost(dst, model.buffer(), found->device_offset);
      } else {
        std::memcpy(dst.data(), found->host.data(), dst.size());
      }
    });
    return out;
  }

 private:
  std::shared_ptr<const LeaseHold> Held() const {
    if (!hold_) {
      RaiseError(ErrorCode::kFailedPrecondition,
                 "the lease on model '" + model_ + "' was released");
    }
    return hold_;
  }

  std::string model_;
  std::string device_;
  uint64_t bytes_on_device_;
  uint64_t total_bytes_;
  std::shared_ptr<const LeaseHold> hold_;
};

class PyRuntime {
 public:
  PyRuntime(const py::handle& registry_path, uint64_t host_capacity_bytes,
            const py::list& devices, const std::string& mode,
            int pread_threads) {
    if (host_capacity_bytes == 0) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "host_capacity_bytes must be > 0");
    }
    const std::string path = PathFrom(registry_path);
    runtime::RuntimeOptions options;
    options.host_capacity_bytes = host_capacity_bytes;
    options.load = LoadOptionsFrom(mode, pread_threads);
    state_ = std::make_shared<RuntimeState>();
    for (const py::handle& spec : devices) {
      runtime::DeviceCacheOptions cache;
      state_->devices.push_back(MakeDevice(spec.cast<py::dict>(), cache));
      device::Device* added = state_->devices.back().get();
      for (size_t i = 0; i + 1 < state_->devices.size(); ++i) {
        if (state_->devices[i]->name() == added->name()) {
          RaiseError(ErrorCode::kInvalidArgument,
                     "two devices are named '" + added->name() + "'");
        }
      }
      options.devices.push_back({added, cache});
    }
    runtime::ModelRegistry registry =
        WithoutGil([&] { return runtime::ModelRegistry::FromJsonFile(path); });
    state_->runtime =
        std::make_unique<ModelRuntime>(std::move(registry), std::move(options));
  }

  PyModelLease Acquire(const std::string& model, const py::handle& device,
                       const std::string& placement, const py::object& timeout,
                       const std::string& when_full) {
    const size_t index = DeviceIndex(device);
    const runtime::Placement where = PlacementFrom(placement);
    const AcquireOptions options = MakeAcquireOptions(timeout, when_full);
    ModelRuntime& runtime = *state_->runtime;
    ModelLease lease = WithoutGil(
        [&] { return runtime.Acquire(model, index, where, options); });
    return PyModelLease(state_, std::move(lease));
  }

  py::dict Stats() const {
    ModelRuntime& runtime = *state_->runtime;
    struct Snapshot {
      CacheStats host;
      std::vector<CacheStats> caches;
      std::vector<device::DeviceStats> devices;
    };
    const Snapshot snapshot = WithoutGil([&] {
      Snapshot s;
      s.host = runtime.host().Stats();
      for (size_t i = 0; i < runtime.device_count(); ++i) {
        s.caches.push_back(runtime.device_cache(i).cache().Stats());
        s.devices.push_back(runtime.device_cache(i).device().Stats());
      }
      return s;
    });
    py::dict per_device;
    for (size_t i = 0; i < snapshot.caches.size(); ++i) {
      py::dict d;
      d["cache"] = CacheStatsDict(snapshot.caches[i]);
      d["device"] = DeviceStatsDict(snapshot.devices[i]);
      per_device[py::str(state_->devices[i]->name())] = std::move(d);
    }
    py::dict out;
    out["host"] = CacheStatsDict(snapshot.host);
    out["devices"] = std::move(per_device);
    return out;
  }

  py::list DeviceNames() const {
    py::list names;
    for (const auto& d : state_->devices) names.append(d->name());
    return names;
  }

  py::list Models() const {
    py::list ids;
    for (const auto& spec : state_->runtime->registry().models()) {
      ids.append(spec.id);
    }
    return ids;
  }

  size_t Prune() {
    ModelRuntime& runtime = *state_->runtime;
    return WithoutGil([&] {
      size_t pruned = 0;
      // Device copies first: they hold the host references.
      for (size_t i = 0; i < runtime.device_count(); ++i) {
        pruned += runtime.device_cache(i).cache().Prune();
      }
      return pruned + runtime.host().Prune();
    });
  }

 private:
  size_t DeviceIndex(const py::handle& device) const {
    if (py::isinstance<py::str>(device)) {
      const auto name = device.cast<std::string>();
      for (size_t i = 0; i < state_->devices.size(); ++i) {
        if (state_->devices[i]->name() == name) return i;
      }
      RaiseError(ErrorCode::kNotFound,
                 "the runtime has no device named '" + name + "'");
    }
    if (!PyLong_Check(device.ptr()) || PyBool_Check(device.ptr())) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "device must be an index or a device name, not " +
                     std::string(py::str(device.get_type().attr("__name__"))));
    }
    const auto index = device.cast<long long>();
    const size_t count = state_->devices.size();
    if (index < 0 || static_cast<size_t>(index) >= count) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "device index " + std::to_string(index) +
                     " out of range: the runtime has " + std::to_string(count) +
                     " devices");
    }
    // An index is a position in the runtime's device list, not a CUDA
    // ordinal. Where the two could be confused, refuse: the position holds
    // a GPU other than cuda:<index>, or cuda:<index> sits at another
    // position.
    const std::string at = state_->devices[index]->name();
    const std::string same_ordinal = "cuda:" + std::to_string(index);
    const bool cuda_elsewhere = [&] {
      for (size_t i = 0; i < count; ++i) {
        if (i != static_cast<size_t>(index) &&
            state_->devices[i]->kind() == device::DeviceKind::kCuda &&
            state_->devices[i]->name() == same_ordinal) {
          return true;
        }
      }
      return false;
    }();
    const bool cuda_here =
        state_->devices[index]->kind() == device::DeviceKind::kCuda;
    if ((cuda_here && at != same_ordinal) || cuda_elsewhere) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "device index " + std::to_string(index) +
                     " is ambiguous: it is the runtime's device " +
                     std::to_string(index) + " ('" + at +
                     "'), not necessarily CUDA GPU " + std::to_string(index) +
                     "; pass the device's name ('" + at + "' or '" +
                     same_ordinal + "')");
    }
    return static_cast<size_t>(index);
  }

  StatePtr state_;
};

}  // namespace

void BindRuntime(py::module_& m) {
  m.def("_cuda_available", &device::CudaAvailable,
        "True when this build has CUDA and a GPU can be used.");
  m.def("_cuda_unavailable_reason", &device::CudaUnavailableReason,
        "Why CUDA cannot be used; empty when it can.");

  py::class_<PyModelLease>(m, "_ModelLease",
                           "A lease on a placed model; see "
                           "modelcache.runtime.ModelLease.")
      .def_property_readonly("model", &PyModelLease::model)
      .def_property_readonly("device", &PyModelLease::device)
      .def_property_readonly("bytes_on_device", &PyModelLease::bytes_on_device)
      .def_property_readonly("total_bytes", &PyModelLease::total_bytes)
      .def_property_readonly("full", &PyModelLease::full)
      .def_property_readonly("released", &PyModelLease::released)
      .def("release", &PyModelLease::Release)
      .def("tensors", &PyModelLease::Tensors)
      .def("read", &PyModelLease::Read, py::arg("name"), py::arg("raw"));

  py::class_<PyRuntime>(m, "_Runtime",
                        "The model runtime; see modelcache.runtime.Runtime.")
      .def(py::init<const py::handle&, uint64_t, const py::list&,
                    const std::string&, int>(),
           py::arg("registry_path"), py::arg("host_capacity_bytes"),
           py::arg("devices"), py::arg("mode"), py::arg("pread_threads"))
      .def("acquire", &PyRuntime::Acquire, py::arg("model"), py::arg("device"),
           py::arg("placement"), py::arg("timeout"), py::arg("when_full"))
      .def("stats", &PyRuntime::Stats)
      .def("prune", &PyRuntime::Prune)
      .def_property_readonly("device_names", &PyRuntime::DeviceNames)
      .def_property_readonly("models", &PyRuntime::Models);
}

}  // namespace modelcache::python
