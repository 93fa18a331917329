// Fork safety: the generation a forked child bumps, and the table of
// sockets its atfork handler closes (design note: client_internal.h).
#include "client_internal.h"

namespace modelcache::serve::detail {

// The sockets of every live connection, for the atfork child handler: a
// slot holds fd + 1, 0 when free (static storage starts zeroed).
namespace {

constexpr size_t kSocketSlots = 256;
std::atomic<int> g_sockets[kSocketSlots];
// The memfds copies keep (for a reclaim), likewise; g_memfd_hint is where
// the next search for a free slot starts, so that filing many is not
// quadratic.
std::atomic<int> g_memfds[kMemfdSlots];
std::atomic<size_t> g_memfd_hint{0};

void CloseSocketsInChild() {
  for (auto& slot : g_sockets) {
    const int held = slot.exchange(0);
    if (held > 0) ::close(held - 1);
  }
  for (auto& slot : g_memfds) {
    const int held = slot.exchange(0);
    if (held > 0) ::close(held - 1);
  }
  g_fork_generation.fetch_add(1);
}

}  // namespace

std::atomic<uint64_t> g_fork_generation{0};

void InstallForkHandler() {
  static std::once_flag once;
  std::call_once(
      once, [] { ::pthread_atfork(nullptr, nullptr, &CloseSocketsInChild); });
}

int RegisterSocket(int fd) {
  for (size_t i = 0; i < kSocketSlots; ++i) {
    int expected = 0;
    if (g_sockets[i].compare_exchange_strong(expected, fd + 1)) {
      return static_cast<int>(i);
    }
  }
  return -1;  // table full: this socket stays open in children
}

int RegisterMemfd(int fd) {
  const size_t start = g_memfd_hint.load(std::memory_order_relaxed);
  for (size_t n = 0; n < kMemfdSlots; ++n) {
    const size_t i = (start + n) % kMemfdSlots;
    int expected = 0;
    if (g_memfds[i].compare_exchange_strong(expected, fd + 1)) {
      g_memfd_hint.store((i + 1) % kMemfdSlots, std::memory_order_relaxed);
      return static_cast<int>(i);
    }
  }
  return -1;  // table full: this memfd stays open in children
}

void UnregisterMemfd(int slot, int fd) {
  if (slot < 0) return;
  int expected = fd + 1;
  g_memfds[static_cast<size_t>(slot)].compare_exchange_strong(expected, 0);
}

Connection::~Connection() {
  if (generation != g_fork_generation.load()) {
    fd.release();  // closed at fork; the number may be another's now
    return;
  }
  if (slot >= 0) {
    int expected = fd.get() + 1;
    g_sockets[static_cast<size_t>(slot)].compare_exchange_strong(expected, 0);
  }
}

}  // namespace modelcache::serve::detail
