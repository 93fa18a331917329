// A worker of `modelcache serve`: leases a model from the node's daemon,
// prints its tensors and a checksum of its bytes, holds the lease until
// Enter is pressed (or stdin closes), then releases it.
//
//   build/bin/modelcache_serve_worker /run/modelcache/serve.sock MODEL
//
// Run two at once and they map one copy: `curl 127.0.0.1:9464/v1/models/MODEL`
// lists both leases with their pids, and both processes' /proc/PID/maps show
// the same memfd inode.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

#include "modelcache/serve/client.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " SOCKET MODEL\n";
    return 2;
  }
  try {
    auto client = modelcache::serve::Client::Connect(argv[1]);
    modelcache::serve::RemoteWeights model =
        client.Acquire(argv[2], std::chrono::seconds(60));
    uint64_t sum = 1469598103934665603ull;  // FNV-1a over every byte
    for (const auto& t : model.tensors()) {
      std::cout << "  " << t.name() << "  "
                << modelcache::weights::DtypeName(t.dtype()) << "  [";
      for (size_t i = 0; i < t.shape().size(); ++i) {
        std::cout << (i ? ", " : "") << t.shape()[i];
      }
      std::cout << "]  " << t.data.size() << " bytes\n";
      for (const std::byte b : t.data) {
        sum = (sum ^ static_cast<unsigned char>(b)) * 1099511628211ull;
      }
    }
    std::printf(
        "pid %d holds lease %llu on '%s': %llu bytes, checksum %016llx\n",
        static_cast<int>(::getpid()),
        static_cast<unsigned long long>(model.lease()), model.model().c_str(),
        static_cast<unsigned long long>(model.data_bytes()),
        static_cast<unsigned long long>(sum));
    std::cout << "press Enter to release" << std::endl;
    std::string line;
    std::getline(std::cin, line);
  } catch (const modelcache::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
