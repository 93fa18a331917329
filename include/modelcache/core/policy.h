// Eviction policies: which unleased, unpinned record goes first.
//
// A policy maps an entry's access history to a priority; the cache evicts the
// lowest priority first, ties broken by access order. The cache keeps its
// eviction order lazily (a touched entry is re-sorted only when it reaches the
// front), which is exact for a policy whose priorities never decrease (see
// EvictionPolicy::Priority). A policy whose priorities may decrease, such as
// Belady's, says so through monotone(), and the cache then re-sorts an entry
// on every access instead. A policy whose priorities change as time passes
// (next-use) says so through time_dependent(), and the cache ranks every
// candidate afresh when it looks for a victim.
#ifndef MODELCACHE_CORE_POLICY_H_
#define MODELCACHE_CORE_POLICY_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "modelcache/core/keep_alive.h"

namespace modelcache {

// A key's recent requests: when the last one came, and a histogram of the
// gaps between them in which older gaps weigh less. The cache keeps one per
// key for a policy that asks for it (EvictionPolicy::history_length() > 0),
// also while the key is not resident, so that a model evicted and loaded
// again keeps what was learnt about it. Times are the cache's clock
// (CacheOptions::now) in seconds. The cache keeps histories of at most 4,096
// keys per lock shard; past that it forgets the half least recently
// requested, and a forgotten key starts again with no history.
//
// Why a histogram and not the last few gaps: a model asked for in bursts
// (many requests a second, then nothing for ten minutes) fills any short
// list with its burst's gaps, and the pause, which is what says when the
// next burst comes, falls out. In the histogram a gap fades by a factor of
// (1 - 1 / memory) with each later request, so a pause is still there after
// dozens of short gaps. Bins are half an octave wide (a factor of sqrt(2)),
// from 1 ms up; each keeps the weighted mean of its gaps, so a regular gap is
// predicted exactly. At most 16 bins are kept (the lightest goes), which
// bounds a history at a few hundred bytes.
//
// Why the forecast is a mean of order 1/2 and not the plain mean: gaps are
// heavy-tailed. A model asked for every five minutes has pauses of hours (a
// night, a lull), and in the plain mean one such pause, even faded, stretches
// the forecast for every short gap. After a night of eight hours and then 30
// gaps of five minutes, the plain mean forecasts 849 s, later than a model
// asked for every ten minutes, which then stays while this one goes; the
// square of the weighted mean square root forecasts 410 s. (How the order
// was chosen, and what it is worth: docs/benchmarks.md, "next-use".)
//
// Why a second forecast for gaps that look exponential: requests that come
// independently of each other (a Poisson stream: many users, no schedule)
// have exponential gaps, and then the wait for the next request does not
// depend on how long the model has been idle. The forecast from the gaps
// longer than the idle time rests on the few gaps that long, which is noise
// that reorders models asked for at different rates; the mean gap over all of
// them (MemorylessWait) is the better estimate. A model asked for on a timer
// or in bursts is the opposite: there the idle time is what says when the
// next request comes. Which one a key's gaps are is decided by how well each
// forecast predicted them: before each new gap is added, it is scored by its
// likelihood under the histogram (smoothed over the neighbouring bins) and
// under the exponential of the mean gap, and the difference of the logarithms
// is summed, fading as the gaps do (LooksMemoryless). This is prequential
// model choice: each forecast is judged only on gaps it had not seen.
class RequestHistory {
 public:
  // A gap's weight is multiplied by (1 - 1 / memory) at each later request:
  // it halves about every 0.7 * memory requests. (memory >= 1; 1 keeps only
  // the latest gap.)
  explicit RequestHistory(size_t memory);

  // A request at `now_seconds`; times earlier than the last are taken as
  // the last (a clock read on another thread may lag a little).
  void Record(double now_seconds);

  // Whether any request was recorded.
  bool empty() const { return requests_ == 0; }
  uint64_t requests() const { return requests_; }
  double last_request_seconds() const { return last_; }
  // Whether at least one gap (two requests) was recorded.
  bool has_gaps() const { return requests_ >= 2; }

  // The typical gap longer than `seconds`: over the bins whose mean is
  // longer, the square of the weighted mean of the square roots of the bins'
  // means (a power mean of order 1/2; see above). 0 if there is none (no
  // gap, or every gap seen is shorter). TypicalGapLongerThan(-1) is over all
  // gaps. Gaps of one length give that length exactly.
  double TypicalGapLongerThan(double seconds) const;

  // Whether the exponential has predicted this key's gaps better than the
  // histogram: false until three requests (two gaps) are recorded; then
  // whether the faded sum, over every gap after the first, of
  // log(likelihood under the histogram) - log(likelihood under the
  // exponential whose mean is the mean gap), each gap scored before it was
  // added, is below 0. Both likelihoods are per unit of log(gap). The
  // histogram's is smoothed over neighbouring bins, with a small share spread
  // over every length so that no gap is impossible under it (the weights:
  // docs/benchmarks.md, "next-use").
  bool LooksMemoryless() const;

  // The expected wait for the next request if gaps are exponential, after
  // `idle_seconds` without one: (sum of weight * gap + idle) / (sum of the
  // weights), the newest gap weighing 1, which is the maximum-likelihood mean
  // of an exponential from the gaps and the idle time so far (a gap not yet
  // over). A negative idle time counts as 0. 0 if no gap was recorded.
  double MemorylessWait(double idle_seconds) const;

 private:
  struct Bin {
    int index;      // half-octaves above 1 ms
    double weight;  // sum of its gaps' weights, times scale_
    double sum;     // sum of weight * gap, times scale_
  };
  static constexpr size_t kMaxBins = 16;
  // Adds to score_ how much better the histogram than the exponential
  // predicted `gap` (in bin `index`), which is not added yet.
  void Score(double gap, int index);
  void Add(double gap, int index);

  double fade_;         // 1 - 1 / memory
  double scale_ = 1.0;  // grows by 1 / fade_ a gap, so old bins need no update
  uint64_t requests_ = 0;
  double last_ = 0;
  double score_ = 0;  // faded log-likelihood ratio, histogram : exponential
  std::vector<Bin> bins_;  // sorted by index
};

// Policy state shared by every cache on one Budget, so that priorities of
// entries in different caches (and shards) are comparable.
struct PolicyClock {
  // Advanced by the cache on every completed load and every eviction.
  std::atomic<uint64_t> epoch{0};
  // GreedyDual's inflation value L: the priority of the last victim.
  std::atomic<double> inflation{0.0};
};

// What a policy may look at when it ranks an entry.
struct AccessInfo {
  uint64_t bytes = 0;         // resident size
  uint64_t accesses = 0;      // acquires since this entry was loaded, >= 1
  double load_seconds = 0.0;  // how long its load took
  // AcquireOptions::policy_hint of the acquire being ranked (0 if unset).
  double hint = 0.0;
  // Only for a policy that asks for them: the entry's request history
  // (history_length() > 0; null otherwise) and, for a time-dependent
  // policy, the time of the ranking in the cache clock's seconds.
  const RequestHistory* history = nullptr;
  double now_seconds = 0.0;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;

  virtual std::string name() const = 0;

  // Priority of an entry that was just loaded or acquired; lower is evicted
  // first. (For a time_dependent() policy: of an entry at the time
  // AccessInfo::now_seconds, when the cache looks for a victim.)
  // REQUIRES: for one entry, successive calls never return a smaller value
  // (given that `accesses` grows and the clock only moves forward), unless
  // monotone() says otherwise or the policy is time_dependent().
  virtual double Priority(const AccessInfo& entry,
                          const PolicyClock& clock) const = 0;

  // Told the priority of every victim, after it is gone.
  virtual void OnEvict(double victim_priority, PolicyClock& clock) const = 0;

  // Whether Priority keeps the REQUIRES above. A policy that does not (such
  // as Belady's) makes the cache re-sort an entry on every access instead of
  // lazily, which costs a tree update per hit. Not consulted for a
  // time_dependent() policy, which is never kept sorted.
  virtual bool monotone() const { return true; }

  // The memory of the request history the cache keeps per key for this
  // policy (AccessInfo::history; RequestHistory's `memory`). 0, the
  // default, keeps none and costs nothing; a positive value costs a clock
  // read, a logarithm and a hash lookup per request.
  virtual size_t history_length() const { return 0; }

  // Whether an entry's priority changes as time passes, not only when the
  // entry is used. The cache then ranks every evictable entry afresh, with
  // AccessInfo::now_seconds set, each time it looks for a victim: a scan
  // linear in the entries resident in the cache, paid once per eviction,
  // which is small beside the load that causes it. Priority is not called
  // on access for such a policy.
  virtual bool time_dependent() const { return false; }
};

// Least recently used. With one shard the order is exact LRU; with several it
// is exact between shards up to the last load or eviction, like a sharded LRU.
std::shared_ptr<const EvictionPolicy> NewLruPolicy();

// What a reload costs, for the cost-aware policy. F = log2(1 + accesses).
enum class ReloadCost {
  // Bytes to load again. Priority = L + F: cost / size is 1, so what counts
  // is how often a model is asked for, whatever its size; this minimises the
  // bytes loaded again per byte of memory.
  kBytes,
  // Measured load time. Priority = L + F * load_seconds / GiB: keeps models
  // that are slow to load per byte they occupy.
  kLoadTime,
  // One unit per load. Priority = L + F / GiB: favours small models,
  // maximising the request hit ratio rather than the byte hit ratio.
  kUniform,
};

// GreedyDual-Size-Frequency (Cherkasova 1998): priority = L + F * cost /
// size, with L raised to each victim's priority so that entries not used
// for a long time age out. F is the logarithm of the access count rather
// than the count itself (as in Redis's LFU): with raw counts, a model that
// was popular early keeps its place for thousands of evictions after it
// cools, and on the Azure Functions trace that loads more bytes than LRU at
// some capacities; with the logarithm it loads fewer at every capacity we
// measured (docs/benchmarks.md, "Replay").
std::shared_ptr<const EvictionPolicy> NewGdsfPolicy(
    ReloadCost cost = ReloadCost::kBytes);

// Classic GDSF with raw access counts: priority = L + accesses (cost =
// bytes). Kept beside the logarithmic variant because neither wins on every
// workload (docs/benchmarks.md, "Replay").
std::shared_ptr<const EvictionPolicy> NewClassicGdsfPolicy();

// FaaSCache's Greedy-Dual keep-alive (Fuerst & Sharma, ASPLOS 2021):
// priority = L + accesses * cost / size with cost the modelled load time,
// latency + size / bandwidth. Not gdsf-time: that one takes the log of the
// count and the load time the loader measured, which in a replay (or behind
// a page cache) says nothing about what a reload from storage costs.
std::shared_ptr<const EvictionPolicy> NewFaasCachePolicy(
    double latency_seconds, double bytes_per_second);

// Predicted next request (ours): Belady's rule with a forecast in place of
// the future. The forecast comes from the key's RequestHistory (kept across
// evictions; `history_length` is its memory). For an entry idle for d
// seconds, the wait for its next request is:
// - with no gap yet (one request so far), never, so one-off models go first;
// - if its gaps look memoryless (RequestHistory::LooksMemoryless), the mean
//   gap counting d as part of the gap under way
//   (RequestHistory::MemorylessWait(d));
// - otherwise the typical gap longer than d
//   (RequestHistory::TypicalGapLongerThan), minus d; if no gap was that
//   long, d (the longer idle, the later).
//
// The entry evicted first is the one with the longest wait over size^e (size
// in GiB, e = `size_exponent`). What e means: keeping a model until its next
// request saves one reload, of cost c, at a memory cost of its size times
// the wait; evicting by the longest wait * size / c keeps the most saved
// per byte-second held.
// - Bytes loaded again (c = size) make that the wait alone, e = 0:
//   Belady's rule, blind to size. In replays, discounting small models a
//   little loads fewer bytes still: a victim larger than the room a load
//   needs frees bytes nothing uses yet, and models asked for equally often
//   are better kept whole than in rotation. The default is
//   kNextUseSizeExponent (how it was chosen, and what it loads against the
//   other policies: docs/benchmarks.md, "next-use").
// - Cold starts (c = 1 per reload, kNextUseUniformSizeExponent = -1) make
//   it the wait times the size: large models go first, as in GreedyDual-
//   Size with uniform cost. Fewer requests wait, at the price of more bytes
//   loaded, which is the better trade unless loads saturate the link
//   ("next-use-uniform"; the replay's next-use-prewarm evicts by it).
// Time-dependent (see time_dependent()).
inline constexpr size_t kNextUseHistoryLength = 32;
inline constexpr double kNextUseUniformSizeExponent = -1.0;
inline constexpr double kNextUseSizeExponent = 0.25;
std::shared_ptr<const EvictionPolicy> NewNextUsePolicy(
    size_t history_length = kNextUseHistoryLength,
    double size_exponent = kNextUseSizeExponent);

// Belady's offline policy: evicts the entry whose next request is furthest
// in the future. It needs the future, so it is a reference for replaying a
// known trace, not a policy for serving: every acquire must pass
// AcquireOptions::policy_hint = the position (any increasing measure, such
// as a request index or a time) of that key's next request, or infinity if
// there is none.
std::shared_ptr<const EvictionPolicy> NewBeladyPolicy();

// ---- The policy registry: every policy by the name an operator gives it. ----
//
// One list for the replay, the command line, the Python package and the
// daemon: each takes a name through PolicyByName and lists PolicyNames() when
// a name is unknown.

// What a load costs, for a policy that prices reloads by it (faascache) or
// starts prewarms that much ahead (gdsf-prewarm, next-use-prewarm): a load
// takes `latency_seconds` plus its bytes at `bytes_per_second`.
struct LoadCostModel {
  double latency_seconds = 0.1;
  double bytes_per_second = 2e9;
};

// A policy as an operator names it: an eviction order and, for some, an idle
// TTL or a keep-alive plan (CacheOptions::WithPolicy sets all three).
struct NamedPolicy {
  std::string name;
  std::shared_ptr<const EvictionPolicy> eviction;
  // 0: none. For "ttl-<N>": N.
  std::chrono::nanoseconds idle_ttl{0};
  // Null: none.
  std::shared_ptr<const KeepAlivePolicy> keep_alive;
  // It needs the future (AcquireOptions::policy_hint): only a replay of a
  // known trace can run it.
  bool offline = false;
};

// The online policies' names, in the order messages list them:
//   lru, gdsf (GDSF, log2 of the count, cost = bytes), gdsf-classic (raw
//   counts), gdsf-time (cost = measured load time), gdsf-uniform (one unit
//   per load), faascache (FaaSCache's Greedy-Dual keep-alive, priced by the
//   LoadCostModel), ttl-<N><unit> (LRU, and a model idle for N is unloaded:
//   ttl-10m, ttl-90s, ttl-1h, ttl-500ms), hybrid-histogram (LRU with Shahrad
//   et al.'s keep-alive and prewarm), gdsf-prewarm (the histogram with GDSF,
//   prewarms led by the load time), next-use, next-use-uniform,
//   next-use-prewarm (the histogram with next-use-uniform; its prewarms may
//   replace idle models ranked below them).
// "ttl-<N>m" stands for the ttl family.
std::vector<std::string> PolicyNames();
// The offline ones: "belady".
std::vector<std::string> OfflinePolicyNames();

// The policy named `name` (online or offline), priced by `cost`. Throws Error
// kInvalidArgument naming every valid name for an unknown one, and saying
// how to write a TTL for a malformed ttl-<N>.
NamedPolicy PolicyByName(std::string_view name, const LoadCostModel& cost = {});

}  // namespace modelcache

#endif  // MODELCACHE_CORE_POLICY_H_
