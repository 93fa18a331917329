// The weights part of modelcache._core: safetensors headers, the host weight
// store, and zero-copy numpy/DLPack views of its host copies. The public API
// (docstrings, types, torch) is python/modelcache/weights.py; the classes
// here are its private building blocks.
//
// Ownership. One C++ reference to a host copy (a HostWeights lease) lives in
// a HostCopy, shared through a shared_ptr by everything that reads the copy:
// the _WeightsLease object, and every view taken from it (a numpy array's
// base object, a DLPack tensor's manager context). The copy is leased until
// the last of these goes, so no view can outlive its bytes and no eviction
// can pull them from under one. release() on a _WeightsLease drops only that
// object's share. Each HostCopy also shares the store, so a store stays alive
// (~HostWeightStore requires it) until its last reference is gone, however
// the Python objects are collected.
//
// The GIL. Acquire, Invalidate and Prune may block or unmap whole files, so
// they run under WithoutGil. Dropping a share runs with whatever the caller
// holds (the GIL, when a Python object is collected; nothing, when torch
// frees a tensor on one of its threads): releasing a host-store lease never
// waits for another thread and runs no Python code (the store has no
// callbacks and its own budget), so holding the GIL there cannot deadlock,
// and not needing it lets a DLPack deleter run anywhere.
#include "weights_bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "modelcache/weights/host_store.h"
#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/safetensors_writer.h"
#include "modelcache/weights/weight_set.h"

namespace modelcache::python {

using weights::Dtype;
using weights::TensorInfo;

std::string PathFrom(const py::handle& path) {
  py::object encoded = py::module_::import("os").attr("fsencode")(path);
  return encoded.cast<std::string>();
}

weights::LoadOptions LoadOptionsFrom(const std::string& mode,
                                     int pread_threads) {
  weights::LoadOptions options;
  if (mode == "mmap") {
    options.mode = weights::LoadMode::kMmap;
  } else if (mode == "pread") {
    options.mode = weights::LoadMode::kPread;
  } else {
    RaiseError(ErrorCode::kInvalidArgument,
               "mode must be \"mmap\" or \"pread\", not \"" + mode + "\"");
  }
  if (pread_threads < 1) {
    RaiseError(ErrorCode::kInvalidArgument, "pread_threads must be >= 1, got " +
                                                std::to_string(pread_threads));
  }
  options.threads = pread_threads;
  return options;
}

py::dtype NumpyDtype(Dtype dtype, const std::string& tensor) {
  // Explicitly little-endian: that is the file's byte order, whatever the
  // host's.
  const char* format = nullptr;
  switch (dtype) {
    case Dtype::kBool:
      format = "?";
      break;
    case Dtype::kU8:
      format = "u1";
      break;
    case Dtype::kI8:
      format = "i1";
      break;
    case Dtype::kI16:
      format = "<i2";
      break;
    case Dtype::kU16:
      format = "<u2";
      break;
    case Dtype::kF16:
      format = "<f2";
      break;
    case Dtype::kI32:
      format = "<i4";
      break;
    case Dtype::kU32:
      format = "<u4";
      break;
    case Dtype::kF32:
      format = "<f4";
      break;
    case Dtype::kF64:
      format = "<f8";
      break;
    case Dtype::kI64:
      format = "<i8";
      break;
    case Dtype::kU64:
      format = "<u8";
      break;
    case Dtype::kBF16:
    case Dtype::kF8E5M2:
    case Dtype::kF8E4M3:
      break;
  }
  if (format == nullptr) {
    RaiseError(ErrorCode::kInvalidArgument,
               "tensor '" + weights::Printable(tensor) + "' has dtype " +
                   weights::DtypeName(dtype) +
                   ", which numpy has no type for; use torch(name) (BF16), "
                   "or raw(name) for its bytes as uint8");
  }
  return py::dtype(format);
}

namespace {

// ---- DLPack ----
//
// The DLPack ABI (v0.6, what torch 1.13 consumes), declared here because no
// Debian package ships dlpack.h; these layouts are frozen by the standard.
struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr int32_t kDLCPU = 1;
constexpr uint8_t kDLInt = 0;
constexpr uint8_t kDLUInt = 1;
constexpr uint8_t kDLFloat = 2;
constexpr uint8_t kDLBfloat = 4;

// numpy's limit on dimensions (NPY_MAXDIMS in numpy 1.x).
constexpr size_t kMaxDims = 32;

// An empty tensor still needs a non-null address: a null one would make
// pybind11 allocate a fresh array instead of viewing.
alignas(16) const std::byte kEmptyTensor[16] = {};

// One reference to a host copy, shared by a lease object and its views.
class HostCopy {
 public:
  HostCopy(std::shared_ptr<weights::HostWeightStore> store,
           weights::HostWeights weights)
      : store_(std::move(store)), weights_(std::move(weights)) {}
  // Releases the reference before the store share goes (member order).
  ~HostCopy() = default;
  HostCopy(const HostCopy&) = delete;
  HostCopy& operator=(const HostCopy&) = delete;

  const weights::WeightSet& set() const { return weights_.weights(); }

 private:
  std::shared_ptr<weights::HostWeightStore> store_;
  weights::HostWeights weights_;
};

using HostCopyPtr = std::shared_ptr<const HostCopy>;

// The base object of every numpy view: its share keeps the copy leased
// (a host store's copy, or a daemon's mapped copy: `keep` owns either).
// Supports weak references (every pybind11 instance does), which is how
// tests watch a view's lifetime.
struct HostCopyRef {
  HostCopyRef(std::shared_ptr<const void> keep, std::string owner,
              std::string tensor)
      : keep(std::move(keep)),
        owner(std::move(owner)),
        tensor(std::move(tensor)) {}
  std::shared_ptr<const void> keep;
  std::string owner;  // the file or model, for repr
  std::string tensor;
};

const TensorInfo& FindTensor(const weights::WeightSet& set,
                             const std::string& name) {
  const TensorInfo* info = set.header().Find(name);
  if (info == nullptr) {
    RaiseError(ErrorCode::kNotFound, weights::Printable(set.path()) +
                                         ": no tensor named '" +
                                         weights::Printable(name) + "'");
  }
  return *info;
}

}  // namespace

const void* ViewAddress(std::span<const std::byte> bytes) {
  return bytes.empty() ? static_cast<const void*>(kEmptyTensor)
                       : static_cast<const void*>(bytes.data());
}

namespace {

const void* AddressOf(const weights::WeightSet& set, const TensorInfo& info) {
  return ViewAddress(set.data(info));
}

// The shape as signed sizes, row-major strides in elements, for numpy and
// DLPack alike. Non-empty tensors fit by construction (their bytes are in the
// file); an empty one may claim absurd dimensions next to its zero, which
// are refused rather than wrapped.
struct Layout {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

Layout LayoutOf(const TensorInfo& info) {
  if (info.shape.size() > kMaxDims) {
    RaiseError(ErrorCode::kInvalidArgument,
               "tensor '" + weights::Printable(info.name) + "' has " +
                   std::to_string(info.shape.size()) + " dimensions; at most " +
                   std::to_string(kMaxDims) + " can be viewed");
  }
  constexpr uint64_t kMax = std::numeric_limits<int64_t>::max();
  Layout layout;
  layout.shape.resize(info.shape.size());
  layout.strides.resize(info.shape.size());
  uint64_t stride = 1;
  bool overflow = false;
  for (size_t i = info.shape.size(); i-- > 0;) {
    const uint64_t dim = info.shape[i];
    if (dim > kMax) {
      RaiseError(ErrorCode::kInvalidArgument,
                 "tensor '" + weights::Printable(info.name) +
                     "' has dimension " + std::to_string(dim) +
                     ", too large to view");
    }
    layout.shape[i] = static_cast<int64_t>(dim);
    layout.strides[i] = overflow ? 1 : static_cast<int64_t>(stride);
    // Zero dimensions count as one, as numpy's own contiguous strides do.
    const uint64_t step = dim == 0 ? 1 : dim;
    if (!overflow && stride > kMax / step) {
      overflow = true;  // only an empty tensor gets here; any stride will do
    } else if (!overflow) {
      stride *= step;
    }
  }
  return layout;
}

}  // namespace

py::array NumpyView(std::shared_ptr<const void> keep, const std::string& owner,
                    const TensorInfo& info, const void* address,
                    const py::dtype& dtype, bool flat_bytes) {
  std::vector<py::ssize_t> shape, strides;
  if (flat_bytes) {
    shape = {static_cast<py::ssize_t>(info.bytes())};
    strides = {1};
  } else {
    const Layout layout = LayoutOf(info);
    const auto itemsize = static_cast<int64_t>(dtype.itemsize());
    for (size_t i = 0; i < layout.shape.size(); ++i) {
      shape.push_back(static_cast<py::ssize_t>(layout.shape[i]));
      strides.push_back(static_cast<py::ssize_t>(
          info.elements() == 0 ? itemsize : layout.strides[i] * itemsize));
    }
  }
  py::object base = py::cast(HostCopyRef(std::move(keep), owner, info.name));
  py::array array(dtype, std::move(shape), std::move(strides), address, base);
  // The bytes are shared by every user of the copy (and in mmap mode are a
  // read-only mapping, where a write would be SIGSEGV), so no view may write.
  array.attr("setflags")(py::arg("write") = false);
  return array;
}

// ---- DLPack export ----

namespace {

struct DlpackContext {
  DLManagedTensor managed{};
  std::shared_ptr<const void> keep;
  Layout layout;
};

// May run on any thread, with or without the GIL: it touches no Python
// object (see the file comment).
void DeleteDlpack(DLManagedTensor* managed) {
  delete static_cast<DlpackContext*>(managed->manager_ctx);
}

// A capsule no consumer took (its name is still "dltensor"; a consumer
// renames it "used_dltensor" and calls the deleter itself).
void DeleteUnusedCapsule(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, "dltensor")) return;
  auto* managed =
      static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (managed != nullptr && managed->deleter != nullptr) {
    managed->deleter(managed);
  }
}

// The DLPack type of `dtype` for torch. BOOL travels as U8 (torch 1.13
// predates DLPack's bool code) and is reinterpreted by the caller.
DLDataType DlpackType(Dtype dtype, const std::string& tensor) {
  switch (dtype) {
    case Dtype::kBool:
    case Dtype::kU8:
      return {kDLUInt, 8, 1};
    case Dtype::kI8:
      return {kDLInt, 8, 1};
    case Dtype::kI16:
      return {kDLInt, 16, 1};
    case Dtype::kI32:
      return {kDLInt, 32, 1};
    case Dtype::kI64:
      return {kDLInt, 64, 1};
    case Dtype::kF16:
      return {kDLFloat, 16, 1};
    case Dtype::kBF16:
      return {kDLBfloat, 16, 1};
    case Dtype::kF32:
      return {kDLFloat, 32, 1};
    case Dtype::kF64:
      return {kDLFloat, 64, 1};
    case Dtype::kU16:
    case Dtype::kU32:
    case Dtype::kU64:
    case Dtype::kF8E5M2:
    case Dtype::kF8E4M3:
      break;
  }
  RaiseError(ErrorCode::kInvalidArgument,
             "tensor '" + weights::Printable(tensor) + "' has dtype " +
                 weights::DtypeName(dtype) +
                 ", which torch has no type for; use numpy(name) or "
                 "raw(name)");
}

}  // namespace

py::capsule DlpackCapsule(std::shared_ptr<const void> keep,
                          const TensorInfo& info, const void* address) {
  const DLDataType type = DlpackType(info.dtype, info.name);
  auto context = std::make_unique<DlpackContext>();
  context->keep = std::move(keep);
  context->layout = LayoutOf(info);
  DLTensor& t = context->managed.dl_tensor;
  // DLPack has no read-only flag: the data pointer is const_cast, and the
  // Python side documents that the tensor must not be written.
  t.data = const_cast<void*>(address);
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(context->layout.shape.size());
  t.dtype = type;
  t.shape = context->layout.shape.data();
  t.strides = context->layout.strides.data();
  t.byte_offset = 0;
  context->managed.manager_ctx = context.get();
  context->managed.deleter = &DeleteDlpack;
  PyObject* capsule =
      PyCapsule_New(&context->managed, "dltensor", &DeleteUnusedCapsule);
  if (capsule == nullptr) throw py::error_already_set();
  (void)context.release();  // the capsule (then its consumer) owns it now
  return py::reinterpret_steal<py::capsule>(capsule);
}

namespace {

// ---- headers ----

py::dict TensorDict(const TensorInfo& t) {
  py::dict d;
  d["dtype"] = weights::DtypeName(t.dtype);
  d["shape"] = py::cast(t.shape);
  d["data_offsets"] = std::vector<uint64_t>{t.begin, t.end};
  return d;
}

py::dict TensorsDict(const std::vector<TensorInfo>& tensors) {
  py::dict d;
  for (const TensorInfo& t : tensors) d[py::str(t.name)] = TensorDict(t);
  return d;
}

py::dict MetadataDict(const std::map<std::string, std::string>& metadata) {
  py::dict d;
  for (const auto& [key, value] : metadata) d[py::str(key)] = py::str(value);
  return d;
}

py::dict HeaderDict(const weights::SafetensorsHeader& h) {
  py::dict d;
  d["tensors"] = TensorsDict(h.tensors());
  d["metadata"] = MetadataDict(h.metadata());
  d["header_bytes"] = h.header_bytes();
  d["data_offset"] = h.data_offset();
  d["data_bytes"] = h.data_bytes();
  d["file_bytes"] = h.file_bytes();
  return d;
}

// ---- the store and its leases ----

class PyWeightsLease {
 public:
  explicit PyWeightsLease(HostCopyPtr copy)
      : copy_(std::move(copy)),
        bytes_(copy_->set().data_bytes()),
        mode_(weights::LoadModeName(copy_->set().mode())) {}

  uint64_t bytes() const { return bytes_; }
  const char* mode() const { return mode_; }
  bool released() const { return !copy_; }
  // Drops this object's share only; views keep theirs.
  void Release() { copy_.reset(); }

  // Each call works on its own share (Held()), so a release() from another
  // thread, which can run whenever Python code does (a finalizer while an
  // object is allocated), cannot free the copy under it.
  py::list Names() const {
    const HostCopyPtr copy = Held();
    py::list names;
    for (const TensorInfo& t : copy->set().tensors()) {
      names.append(py::str(t.name));
    }
    return names;
  }
  py::dict Tensors() const { return TensorsDict(Held()->set().tensors()); }
  py::dict Metadata() const { return MetadataDict(Held()->set().metadata()); }

  py::array Numpy(const std::string& name) const {
    const HostCopyPtr copy = Held();
    const TensorInfo& info = FindTensor(copy->set(), name);
    return NumpyView(copy, copy->set().path(), info,
                     AddressOf(copy->set(), info), NumpyDtype(info.dtype, name),
                     false);
  }
  py::array Raw(const std::string& name) const {
    const HostCopyPtr copy = Held();
    const TensorInfo& info = FindTensor(copy->set(), name);
    return NumpyView(copy, copy->set().path(), info,
                     AddressOf(copy->set(), info), py::dtype("u1"), true);
  }
  // The capsule and the safetensors dtype name, which tells the caller to
  // reinterpret BOOL (exported as U8).
  py::tuple Dlpack(const std::string& name) const {
    const HostCopyPtr copy = Held();
    const TensorInfo& info = FindTensor(copy->set(), name);
    return py::make_tuple(
        DlpackCapsule(copy, info, AddressOf(copy->set(), info)),
        weights::DtypeName(info.dtype));
  }

 private:
  HostCopyPtr Held() const {
    if (!copy_) {
      RaiseError(ErrorCode::kFailedPrecondition,
                 "the weights lease was released; views taken before the "
                 "release stay valid");
    }
    return copy_;
  }

  HostCopyPtr copy_;
  const uint64_t bytes_;
  const char* const mode_;
};

class PyHostWeightStore {
 public:
  PyHostWeightStore(uint64_t capacity_bytes, const std::string& mode,
                    const std::string& name, int pread_threads)
      : mode_(mode) {
    if (capacity_bytes == 0) {
      RaiseError(ErrorCode::kInvalidArgument, "capacity_bytes must be > 0");
    }
    weights::HostStoreOptions options;
    options.name = name;
    options.capacity_bytes = capacity_bytes;
    options.load = LoadOptionsFrom(mode, pread_threads);
    store_ = std::make_shared<weights::HostWeightStore>(std::move(options));
  }

  PyWeightsLease Acquire(const py::handle& path, const py::object& timeout,
                         const std::string& when_full) {
    const std::string file = PathFrom(path);
    const AcquireOptions options = MakeAcquireOptions(timeout, when_full);
    std::shared_ptr<weights::HostWeightStore> store = store_;
    HostCopyPtr copy = WithoutGil([&] {
      weights::HostWeights weights = store->Acquire(file, options);
      return std::make_shared<const HostCopy>(store, std::move(weights));
    });
    return PyWeightsLease(std::move(copy));
  }

  std::string Invalidate(const py::handle& path) {
    const std::string file = PathFrom(path);
    const RemoveOutcome outcome =
        WithoutGil([&] { return store_->Invalidate(file); });
    switch (outcome) {
      case RemoveOutcome::kNotFound:
        return "not_found";
      case RemoveOutcome::kRemoved:
        return "removed";
      case RemoveOutcome::kRetired:
        return "retired";
    }
    return "not_found";
  }

  size_t Prune() {
    return WithoutGil([&] { return store_->Prune(); });
  }
  py::dict Stats() const {
    return CacheStatsDict(WithoutGil([&] { return store_->Stats(); }));
  }
  uint64_t capacity_bytes() const { return store_->budget().capacity(); }
  uint64_t budget_used_bytes() const { return store_->budget().used(); }
  int waiters() const { return store_->budget().waiters(); }
  const std::string& name() const { return store_->cache().name(); }
  const std::string& mode() const { return mode_; }

 private:
  std::shared_ptr<weights::HostWeightStore> store_;
  const std::string mode_;
};

}  // namespace

void BindWeights(py::module_& m) {
  m.def(
      "_write_safetensors",
      [](const py::handle& path, const py::list& tensors,
         const std::map<std::string, std::string>& metadata) {
        const std::string file = PathFrom(path);
        weights::SafetensorsWriter writer;
        for (const auto& [key, value] : metadata)
          writer.SetMetadata(key, value);
        // Each entry is (name, dtype name, shape, buffer). The buffers stay
        // referenced by `tensors` (the caller's list) for the whole write,
        // which reads them without the GIL: the caller passes contiguous
        // copies nobody else holds.
        std::vector<py::buffer_info> infos;
        infos.reserve(tensors.size());
        for (const py::handle& item : tensors) {
          const auto entry = item.cast<py::tuple>();
          if (entry.size() != 4) {
            RaiseError(ErrorCode::kInvalidArgument,
                       "a tensor entry is (name, dtype, shape, buffer)");
          }
          const auto name = entry[0].cast<std::string>();
          const auto dtype_name = entry[1].cast<std::string>();
          const std::optional<Dtype> dtype = weights::ParseDtype(dtype_name);
          if (!dtype) {
            RaiseError(ErrorCode::kInvalidArgument,
                       "tensor '" + weights::Printable(name) +
                           "': unknown safetensors dtype '" +
                           weights::Printable(dtype_name) + "'");
          }
          infos.push_back(entry[3].cast<py::buffer>().request());
          const py::buffer_info& info = infos.back();
          if (info.itemsize != 1 || info.ndim != 1 ||
              (info.size > 1 && info.strides[0] != 1)) {
            RaiseError(ErrorCode::kInvalidArgument,
                       "tensor '" + weights::Printable(name) +
                           "': its data must be contiguous bytes");
          }
          const auto size = static_cast<size_t>(info.size * info.itemsize);
          writer.AddTensor(name, *dtype, entry[2].cast<std::vector<uint64_t>>(),
                           std::span<const std::byte>(
                               static_cast<const std::byte*>(info.ptr), size));
        }
        return WithoutGil([&] { return writer.Write(file); });
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata"),
      "Writes a safetensors file; see modelcache.weights.save_file.");

  m.def(
      "_inspect_safetensors",
      [](const py::handle& path) {
        const std::string file = PathFrom(path);
        const weights::SafetensorsHeader header =
            WithoutGil([&] { return weights::ReadSafetensorsHeader(file); });
        return HeaderDict(header);
      },
      py::arg("path"),
      "The validated header of a safetensors file as a dict; see "
      "modelcache.weights.inspect.");

  py::class_<HostCopyRef>(m, "_HostCopyRef",
                          "Owner of a numpy view's bytes: one reference to "
                          "a host copy, held while the view lives.")
      .def_readonly("tensor", &HostCopyRef::tensor)
      .def("__repr__", [](const HostCopyRef& r) {
        return "<modelcache._core._HostCopyRef '" +
               weights::Printable(r.owner) + "' tensor='" +
               weights::Printable(r.tensor) + "'>";
      });

  py::class_<PyWeightsLease>(m, "_WeightsLease",
                             "One reference to a host copy; see "
                             "modelcache.weights.WeightsLease.")
      .def_property_readonly("bytes", &PyWeightsLease::bytes)
      .def_property_readonly("mode", &PyWeightsLease::mode)
      .def_property_readonly("released", &PyWeightsLease::released)
      .def("release", &PyWeightsLease::Release)
      .def("names", &PyWeightsLease::Names)
      .def("tensors", &PyWeightsLease::Tensors)
      .def("metadata", &PyWeightsLease::Metadata)
      .def("numpy", &PyWeightsLease::Numpy, py::arg("name"))
      .def("raw", &PyWeightsLease::Raw, py::arg("name"))
      .def("dlpack", &PyWeightsLease::Dlpack, py::arg("name"));

  py::class_<PyHostWeightStore>(m, "_HostWeightStore",
                                "The host weight store; see "
                                "modelcache.weights.HostWeightStore.")
      .def(py::init<uint64_t, const std::string&, const std::string&, int>(),
           py::arg("capacity_bytes"), py::arg("mode"), py::arg("name"),
           py::arg("pread_threads"))
      .def("acquire", &PyHostWeightStore::Acquire, py::arg("path"),
           py::arg("timeout"), py::arg("when_full"))
      .def("invalidate", &PyHostWeightStore::Invalidate, py::arg("path"))
      .def("prune", &PyHostWeightStore::Prune)
      .def("stats", &PyHostWeightStore::Stats)
      .def_property_readonly("capacity_bytes",
                             &PyHostWeightStore::capacity_bytes)
      .def_property_readonly("budget_used_bytes",
                             &PyHostWeightStore::budget_used_bytes)
      .def_property_readonly("waiters", &PyHostWeightStore::waiters)
      .def_property_readonly("name", &PyHostWeightStore::name)
      .def_property_readonly("mode", &PyHostWeightStore::mode);
}

}  // namespace modelcache::python
