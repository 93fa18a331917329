// The runtime on the daemon's copies: ModelRuntime and its device caches,
// unchanged, place models whose host copies are a `modelcache serve`
// daemon's (serve::RemoteHostWeights) instead of a store of their own.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "modelcache/device/simulated_device.h"
#include "modelcache/runtime/runtime.h"
#include "modelcache/serve/client.h"
#include "serve_test_util.h"

namespace modelcache::serve::testing {
namespace {

TEST(ServeRuntime, DeviceCachesPlaceTheDaemonsCopies) {
  TempDir dir;
  const std::string root = dir / "models";
  WriteModel(root + "/unet/a.safetensors", 512 * 1024, 1);
  WriteModel(root + "/unet/b.safetensors", 256 * 1024, 2);
  WriteCatalog(dir / "catalog.json",
               {{"unet", {"unet/a.safetensors", "unet/b.safetensors"}}});
  DaemonOptions options;
  options.catalog = dir / "catalog.json";
  options.root = root;
  options.socket = dir / "run/serve.sock";
  Daemon daemon(options);

  device::SimulatedDevice gpu0({.name = "sim0", .capacity_bytes = 64 << 20});
  device::SimulatedDevice gpu1({.name = "sim1", .capacity_bytes = 64 << 20});
  runtime::ModelRegistry registry;
  // The runtime's registry names the model; the daemon's catalog its files.
  registry.Add({"unet", {"ignored.safetensors"}, {}, false, 0});
  runtime::RuntimeOptions runtime_options;
  runtime_options.host_source =
      std::make_shared<RemoteHostWeights>(Client::Connect(daemon.socket()));
  runtime_options.devices = {{&gpu0, {}}, {&gpu1, {}}};
  {
    runtime::ModelRuntime runtime(std::move(registry), runtime_options);
    runtime::ModelLease on0 = runtime.Acquire("unet", 0);
    runtime::ModelLease on1 = runtime.Acquire("unet", 1);
    const uint64_t total =
        weights::WeightSet::Open(root + "/unet/a.safetensors").data_bytes() +
        weights::WeightSet::Open(root + "/unet/b.safetensors").data_bytes();
    EXPECT_EQ(on0->total_bytes(), total);
    EXPECT_TRUE(on0->full());
    EXPECT_TRUE(on1->full());
    // The bytes on the device are the file's.
    for (const runtime::PlacedTensor& t : on1->tensors()) {
      std::vector<std::byte> back(t.host.size());
      gpu1.CopyToHost(back, on1->buffer(), t.device_offset);
      EXPECT_EQ(std::memcmp(back.data(), t.host.data(), back.size()), 0)
          << t.info->name;
    }
    // One copy on the host for both devices: one load, and one lease in
    // the process, which both placements reference.
    EXPECT_EQ(daemon.Metric("modelcache_loads_total"), 1);
    EXPECT_EQ(daemon.Model("unet")["leases"].size(), 1u);
    on0.Release();
    on1.Release();
    // The device caches keep the placements (and so the host leases) until
    // the runtime goes.
  }
  // Destroying the runtime ends its references: the client keeps the lease
  // idle, and the daemon is told so.
  Eventually(
      [&] {
        const json leases = daemon.Model("unet")["leases"];
        return leases.size() == 1 && leases[0]["use"] == "idle";
      },
      "destroying the runtime leaves the lease idle");
  // And the client's end ends it.
  runtime_options.host_source.reset();
  Eventually([&] { return daemon.Model("unet")["leases"].empty(); },
             "the client's end ends its lease");
  ExpectBooksCoverMaps(daemon);
}

TEST(ServeRuntime, AnUnknownModelIsTheDaemonsNotFound) {
  TempDir dir;
  WriteModel(dir / "models/m.safetensors", 4096, 3);
  WriteCatalog(dir / "catalog.json", {{"m", {"m.safetensors"}}});
  DaemonOptions options;
  options.catalog = dir / "catalog.json";
  options.root = dir / "models";
  options.socket = dir / "run/serve.sock";
  Daemon daemon(options);
  device::SimulatedDevice gpu({.name = "sim", .capacity_bytes = 1 << 20});
  runtime::ModelRegistry registry;
  registry.Add({"elsewhere", {"x.safetensors"}, {}, false, 0});
  runtime::RuntimeOptions runtime_options;
  runtime_options.host_source =
      std::make_shared<RemoteHostWeights>(Client::Connect(daemon.socket()));
  runtime_options.devices = {{&gpu, {}}};
  runtime::ModelRuntime runtime(std::move(registry), runtime_options);
  try {
    runtime.Acquire("elsewhere", 0);
    FAIL() << "no error";
  } catch (const ServeError& e) {
    EXPECT_EQ(e.serve_code(), ServeCode::kNotFound);
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  }
}

}  // namespace
}  // namespace modelcache::serve::testing
