// What the C++ blocks of README.md and docs/*.md may use without including
// or declaring it (tests/docs/snippets.py): every public header of the
// layers this build has, and the names a snippet leaves to its reader,
// declared here only (the snippets are compiled, never linked or run).
#ifndef MODELCACHE_TESTS_DOCS_SNIPPET_PRELUDE_H_
#define MODELCACHE_TESTS_DOCS_SNIPPET_PRELUDE_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "modelcache/base/bytes.h"
#include "modelcache/base/errors.h"
#include "modelcache/core/budget.h"
#include "modelcache/core/cache.h"
#include "modelcache/core/policy.h"
#include "modelcache/device/device.h"
#include "modelcache/device/simulated_device.h"
#include "modelcache/replay/replay.h"
#include "modelcache/runtime/registry.h"
#include "modelcache/runtime/runtime.h"
#include "modelcache/serve/client.h"
#include "modelcache/weights/host_buffer.h"
#include "modelcache/weights/host_store.h"
#include "modelcache/weights/safetensors.h"
#include "modelcache/weights/weight_set.h"

// The reader's model type and what it does with one.
struct Model {
  uint64_t bytes() const;
};
Model LoadFromDisk(const std::string& path);
void Run(const Model& model);

// The reader's devices, and what a generator does with a placed model and
// the patches (LoRAs) held beside it.
extern std::unique_ptr<modelcache::device::Device> gpu0;
extern std::unique_ptr<modelcache::device::Device> gpu1;
void Generate(const modelcache::runtime::DeviceModel& model,
              const std::vector<modelcache::runtime::ModelLease>& patches);

// What a worker does with a tensor of the daemon's copy.
void Use(const std::string& name, modelcache::weights::Dtype dtype,
         const std::vector<uint64_t>& shape, std::span<const std::byte> data);

#endif  // MODELCACHE_TESTS_DOCS_SNIPPET_PRELUDE_H_
