// How close can an online policy come to Belady's bytes, and how tight a
// reference are Belady's bytes?
//
// The default trace draws every request independently from a popularity
// that drifts from a morning ranking to an afternoon one
// (DefaultTracePopularityOf). Under such a trace the best an online policy
// can know is each model's request rate at the moment it must choose. The
// "rate oracle" below keeps the models with the highest true rates, which
// no real policy knows: a resident model saves its size at every request,
// so the bytes saved per byte held are its rate. The "sized oracle" ranks
// by rate * size^0.25 instead (kNextUseSizeExponent), the same discount of
// small models that next-use applies, which loads fewer bytes in most rows.
// Belady's knows the actual future draws, so the gap between the oracles
// and it is what randomness alone costs a policy that ranks this way;
// next-use and GDSF are shown beside them.
//
// Belady's rule (evict the model asked for furthest in the future) is
// optimal for misses with equal sizes, not for bytes with unequal ones, so
// two size-aware offline rules are shown as ratios to it too. If either
// loaded clearly fewer bytes, Belady's would be a loose reference and the
// gap of an online policy to it an understatement:
// - "belady-size": the furthest distance times the size (libCacheSim's
//   BeladySize, made for miss ratios: it frees the most byte-time per
//   eviction);
// - "sized-belady": the furthest distance over size^0.25, Belady's rule
//   with next-use's discount of small models.
//
// Two online ideas are measured beside next-use too:
// - "one-offs-cooled": next-use without its admission rule for models asked
//   for once so far (they go first; here they are ranked like cooled ones);
// - "experts+gdsf", "experts+lru": next-use and a second expert weighted
//   online by regret, in the manner of LeCaR (ExpertsChooser below).
// A third table asks whether the bar "within 1.15x of Belady's bytes" can
// be met on the default trace at all. It gives every model the same size
// and replays two versions of the trace: the default one (drifting
// popularity) and a stationary one, every request an independent draw from
// the morning's popularity. With equal sizes bytes are misses times the
// size, and for independent draws from a fixed popularity the rule "evict
// the resident model least likely to be asked for" (A0) has the fewest
// expected misses of any policy that does not know the future (Aho, Denning
// and Ullman, "Principles of Optimal Page Replacement", JACM 18(1), 1971),
// while Belady's rule has the fewest misses of all. The rate oracle is A0,
// so on the stationary trace its ratio to Belady's is what randomness alone
// costs any online policy; on the drifting one it is A0 applied to the
// popularity of the moment.
//
// The equal-sizes table also shows "lfu-all-time": the model asked for
// least often since the trace began goes first, counts kept across
// evictions. For independent draws from a popularity that is a random
// permutation of known weights (how the default trace draws its ranking),
// the posterior mean of a model's rate grows with its count, so this is the
// rule "evict the model least likely to be asked for, given what has been
// seen": A0 for a policy that must learn the popularity.
//
// With --azure, every rule but the oracles also runs on that trace
// (serving-mix sizes, and with --memory, memory-file sizes times 32); it has
// no true rates, so no oracle there.
//
// Two more modes, each printing only its own table:
//
// --bar WORKLOAD ...: the policy bar. For each workload and capacity, the
// bytes next-use loads in the library's untimed replay against the fewest
// of every other online policy replay accepts (ttl-<N>m as ttl-10m), and
// Belady's; on the stationary equal-size workloads also against A0. A
// workload is one of
//   default:S        the embedded default of seed S (16, 32, 48, 64 GiB)
//   fixed:S          the equal-sizes trace of seed S, stationary (room for
//   drifting:S       10, 20, 30, 40 and 50 models), or drifting
//   azure[:models=N][:seed=S][:poisson][:memory-scale=X]
//                    the --azure trace, as `modelcache replay` reads it with
//                    those flags (memory-scale needs --memory; 8, 16, 32,
//                    64 GiB)
// and may end in @CAP,CAP,... to choose its capacities.
//
// --learning-bound N: how close any online policy can come to A0 on the
// stationary equal-sizes traces of seeds 5000 to 5000+N-1, whose popularity
// is a uniformly random permutation of the default's Zipf weights (the
// generator's own prior). At request i a policy's cache holds the model
// asked for at i-1 and at most k-1 other models already seen, all chosen
// from the requests so far (H_i), so P(miss at i | H_i) >= 1 - q(last) -
// (the k-1 largest q of the others seen), with q = E[popularity | H_i].
// Summed over i, that is a lower bound on the expected misses of every
// online policy, A0 included if q is the true popularity ("relaxed A0"
// below). q comes from a Metropolis chain over permutations, the bound is
// summed over every 50th request (times 50), and the expectation is over
// the N seeds. Beside it: A0's and lfu-all-time's actual misses.
//
// The rules run in a small replay of their own, which runs the core's
// policy objects where a rule is one. For Belady's, next-use, GDSF and LRU
// it must give the library's replay bytes exactly (the program exits 1
// otherwise; a ctest runs it), which checks that the two replays agree.
//
//   ./build/bin/modelcache_policy_bound [seed ...] [--azure TRACE.csv
//       [--memory MEMORY.csv]] [--bar WORKLOAD ... | --learning-bound N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "modelcache/core/policy.h"
#include "modelcache/replay/replay.h"

namespace {

modelcache::replay::ReplayOptions Untimed() {
  modelcache::replay::ReplayOptions options;
  options.timed = false;
  return options;
}

using modelcache::replay::DefaultTracePopularity;
using modelcache::replay::Trace;

constexpr double kNever = std::numeric_limits<double>::infinity();

// What a rule may look at for a resident model when request `now` (an
// index into the trace) misses.
struct Candidate {
  uint32_t model;
  size_t now;
  double next_request;  // index of its next request; kNever if none
  uint64_t bytes;
};
// Lower is evicted first.
using Rule = std::function<double(const Candidate&)>;

double Gib(uint64_t bytes) { return static_cast<double>(bytes) / 0x1p30; }

Rule Belady() {
  return [](const Candidate& c) { return -c.next_request; };
}
Rule BeladySize() {
  return [](const Candidate& c) {
    return -(c.next_request - static_cast<double>(c.now)) * Gib(c.bytes);
  };
}
Rule SizedBelady() {
  return [](const Candidate& c) {
    return -(c.next_request - static_cast<double>(c.now)) /
           std::pow(Gib(c.bytes), modelcache::kNextUseSizeExponent);
  };
}
Rule RateOracle(const Trace& trace, const DefaultTracePopularity& pop,
                double size_exponent) {
  return [&trace, &pop, size_exponent](const Candidate& c) {
    const double share = static_cast<double>(trace.requests[c.now].t_ms) /
                         static_cast<double>(pop.span_ms);
    return ((1 - share) * pop.morning[c.model] +
            share * pop.afternoon[c.model]) *
           std::pow(Gib(c.bytes), size_exponent);
  };
}

// Picks victims for the replay loop below.
class Chooser {
 public:
  virtual ~Chooser() = default;
  // The resident model to evict when request `i` misses; `residents` never
  // holds the model requested.
  virtual uint32_t Victim(size_t i, const std::vector<uint32_t>& residents) = 0;
  virtual void Evicted(uint32_t /*model*/) {}
  // Request `i` was served, after a load if `loaded`.
  virtual void Served(size_t i, bool loaded) = 0;
};

// The resident with the lowest rank, ties to the least recently used (the
// smallest `last_use`), as the cache ranks its victims.
template <typename Rank, typename LastUse>
uint32_t LowestRanked(const std::vector<uint32_t>& residents, Rank rank,
                      LastUse last_use) {
  uint32_t victim = residents.front();
  double lowest = rank(victim);
  for (size_t k = 1; k < residents.size(); ++k) {
    const uint32_t j = residents[k];
    const double r = rank(j);
    if (r < lowest || (r == lowest && last_use(j) < last_use(victim))) {
      victim = j;
      lowest = r;
    }
  }
  return victim;
}

// Bytes loaded by an untimed replay that, on a miss, evicts the model the
// chooser picks until the new one fits. Models larger than the capacity are
// refused, as in Replay.
uint64_t BytesLoaded(const Trace& trace, uint64_t capacity, Chooser& chooser) {
  std::vector<bool> resident(trace.models.size(), false);
  std::vector<uint32_t> residents;
  uint64_t used = 0, loaded = 0;
  for (size_t i = 0; i < trace.requests.size(); ++i) {
    const uint32_t m = trace.requests[i].model;
    const uint64_t size = trace.sizes[m];
    if (size > capacity) continue;
    const bool miss = !resident[m];
    if (miss) {
      while (used + size > capacity) {
        residents.clear();
        for (uint32_t j = 0; j < resident.size(); ++j) {
          if (resident[j]) residents.push_back(j);
        }
        const uint32_t victim = chooser.Victim(i, residents);
        resident[victim] = false;
        used -= trace.sizes[victim];
        chooser.Evicted(victim);
      }
      resident[m] = true;
      used += size;
      loaded += size;
    }
    chooser.Served(i, miss);
  }
  return loaded;
}

// Evicts the model ranked lowest by a Rule, ties to the least recently used.
class RankedChooser final : public Chooser {
 public:
  RankedChooser(const Trace& trace, Rule rule)
      : trace_(trace),
        rule_(std::move(rule)),
        next_use_(trace.requests.size(), kNever),
        next_request_(trace.models.size(), kNever),
        last_use_(trace.models.size(), 0) {
    std::vector<double> seen(trace.models.size(), kNever);
    for (size_t i = trace.requests.size(); i-- > 0;) {
      next_use_[i] = seen[trace.requests[i].model];
      seen[trace.requests[i].model] = static_cast<double>(i);
    }
  }
  uint32_t Victim(size_t i, const std::vector<uint32_t>& residents) override {
    return LowestRanked(
        residents,
        [&](uint32_t j) {
          return rule_({j, i, next_request_[j], trace_.sizes[j]});
        },
        [&](uint32_t j) { return last_use_[j]; });
  }
  void Served(size_t i, bool) override {
    const uint32_t m = trace_.requests[i].model;
    last_use_[m] = i + 1;
    next_request_[m] = next_use_[i];
  }

 private:
  const Trace& trace_;
  const Rule rule_;
  std::vector<double> next_use_, next_request_;
  std::vector<uint64_t> last_use_;
};

uint64_t BytesLoaded(const Trace& trace, uint64_t capacity, Rule rule) {
  RankedChooser chooser(trace, std::move(rule));
  return BytesLoaded(trace, capacity, chooser);
}

// lfu-all-time: the fewest requests since the trace began goes first (counts
// kept across evictions), ties to the least recently used.
class AllTimeCountChooser final : public Chooser {
 public:
  explicit AllTimeCountChooser(const Trace& trace)
      : trace_(trace),
        count_(trace.models.size(), 0),
        last_use_(trace.models.size(), 0) {}
  uint32_t Victim(size_t, const std::vector<uint32_t>& residents) override {
    return LowestRanked(
        residents, [&](uint32_t j) { return static_cast<double>(count_[j]); },
        [&](uint32_t j) { return last_use_[j]; });
  }
  void Served(size_t i, bool) override {
    const uint32_t m = trace_.requests[i].model;
    ++count_[m];
    last_use_[m] = i + 1;
  }

 private:
  const Trace& trace_;
  std::vector<uint64_t> count_, last_use_;
};

// One of the core's policies, fed what the cache would feed it: the request
// history it asks for, the access count since the load, the shared clock.
// Ranks like the cache: lowest priority first, ties to the least recently
// used (a time-dependent policy ranked at the moment of the miss).
class PolicyChooser final : public Chooser {
 public:
  PolicyChooser(const Trace& trace,
                std::shared_ptr<const modelcache::EvictionPolicy> policy)
      : trace_(trace),
        policy_(std::move(policy)),
        models_(trace.models.size()) {
    if (policy_->history_length() > 0) {
      for (Model& model : models_) {
        model.history.emplace(policy_->history_length());
      }
    }
  }
  uint32_t Victim(size_t i, const std::vector<uint32_t>& residents) override {
    now_seconds_ = Seconds(i);
    return LowestRanked(
        residents, [&](uint32_t j) { return PriorityNow(j); },
        [&](uint32_t j) { return models_[j].seq; });
  }
  void Evicted(uint32_t model) override {
    policy_->OnEvict(PriorityNow(model), clock_);
    clock_.epoch.fetch_add(1, std::memory_order_relaxed);
  }
  void Served(size_t i, bool loaded) override {
    Model& model = models_[trace_.requests[i].model];
    if (model.history) model.history->Record(Seconds(i));
    model.accesses = loaded ? 1 : model.accesses + 1;
    model.seq = ++seq_;
    if (!policy_->time_dependent()) {
      model.priority =
          policy_->Priority(Info(trace_.requests[i].model, 0), clock_);
    }
  }

 private:
  struct Model {
    std::optional<modelcache::RequestHistory> history;
    uint64_t accesses = 0;
    uint64_t seq = 0;
    double priority = 0;
  };
  // The cache's clock in the replay: trace time through nanoseconds.
  double Seconds(size_t i) const {
    return std::chrono::duration<double>(
               std::chrono::nanoseconds(static_cast<int64_t>(
                   static_cast<double>(trace_.requests[i].t_ms) * 1e6)))
        .count();
  }
  modelcache::AccessInfo Info(uint32_t m, double now_seconds) const {
    modelcache::AccessInfo info;
    info.bytes = trace_.sizes[m];
    info.accesses = models_[m].accesses;
    if (models_[m].history) info.history = &*models_[m].history;
    info.now_seconds = now_seconds;
    return info;
  }
  double PriorityNow(uint32_t m) const {
    return policy_->time_dependent()
               ? policy_->Priority(Info(m, now_seconds_), clock_)
               : models_[m].priority;
  }

  const Trace& trace_;
  const std::shared_ptr<const modelcache::EvictionPolicy> policy_;
  std::vector<Model> models_;
  modelcache::PolicyClock clock_;
  uint64_t seq_ = 0;
  double now_seconds_ = 0;
};

// next-use without its admission rule for one-off models: a model asked for
// once so far (no gap, no forecast) is ranked like a cooled one, by its
// idle time, instead of going first. What the rule is worth.
class OneOffsAsCooled final : public modelcache::EvictionPolicy {
 public:
  std::string name() const override { return "next-use, one-offs as cooled"; }
  double Priority(const modelcache::AccessInfo& entry,
                  const modelcache::PolicyClock& clock) const override {
    const modelcache::RequestHistory* history = entry.history;
    if (history == nullptr || history->has_gaps()) {
      return next_use_->Priority(entry, clock);
    }
    const double idle =
        std::max(0.0, entry.now_seconds - history->last_request_seconds());
    return -idle / std::pow(std::max(Gib(entry.bytes), 1.0 / 0x1p30),
                            modelcache::kNextUseSizeExponent);
  }
  void OnEvict(double, modelcache::PolicyClock&) const override {}
  size_t history_length() const override { return next_use_->history_length(); }
  bool time_dependent() const override { return true; }

 private:
  const std::shared_ptr<const modelcache::EvictionPolicy> next_use_ =
      modelcache::NewNextUsePolicy();
};

// Two experts weighted online by regret (LeCaR: Vietri et al., HotStorage
// 2018). Both see every request; when they disagree, the victim is one
// expert's, drawn with probability its weight, and is remembered as that
// expert's mistake-in-waiting. A miss on it later, t requests on, means the
// expert was wrong: the other one's weight grows by exp(rate * d^t), with d
// = 0.005^(1/n) for n resident models, so a regret fades over about n
// requests. Weights stay within [0.01, 0.99] so that neither expert is
// silenced for good. Unlike LeCaR, a victim both experts chose is no one's
// mistake: it says nothing about which to trust.
class ExpertsChooser final : public Chooser {
 public:
  ExpertsChooser(const Trace& trace,
                 std::shared_ptr<const modelcache::EvictionPolicy> a,
                 std::shared_ptr<const modelcache::EvictionPolicy> b)
      : trace_(trace),
        a_(trace, std::move(a)),
        b_(trace, std::move(b)),
        evicted_by_a_(trace.models.size(), -1),
        evicted_by_b_(trace.models.size(), -1) {}
  uint32_t Victim(size_t i, const std::vector<uint32_t>& residents) override {
    residents_ = residents.size();
    const uint32_t va = a_.Victim(i, residents);
    const uint32_t vb = b_.Victim(i, residents);
    if (va == vb) return va;
    const bool take_a =
        std::uniform_real_distribution<double>(0, 1)(rng_) < weight_a_;
    (take_a ? evicted_by_a_ : evicted_by_b_)[take_a ? va : vb] =
        static_cast<int64_t>(i);
    return take_a ? va : vb;
  }
  void Evicted(uint32_t model) override {
    a_.Evicted(model);
    b_.Evicted(model);
  }
  void Served(size_t i, bool loaded) override {
    const uint32_t m = trace_.requests[i].model;
    if (loaded) {
      const double fade = std::pow(
          0.005, 1.0 / static_cast<double>(std::max<size_t>(1, residents_)));
      auto regret = [&](int64_t at) {
        return std::exp(
            kLearningRate *
            std::pow(fade, static_cast<double>(i) - static_cast<double>(at)));
      };
      double weight_b = 1 - weight_a_;
      if (evicted_by_a_[m] >= 0) weight_b *= regret(evicted_by_a_[m]);
      if (evicted_by_b_[m] >= 0) weight_a_ *= regret(evicted_by_b_[m]);
      weight_a_ = std::clamp(weight_a_ / (weight_a_ + weight_b), 0.01, 0.99);
      evicted_by_a_[m] = evicted_by_b_[m] = -1;
    }
    a_.Served(i, loaded);
    b_.Served(i, loaded);
  }

 private:
  static constexpr double kLearningRate = 0.45;  // LeCaR's
  const Trace& trace_;
  PolicyChooser a_, b_;
  std::vector<int64_t> evicted_by_a_, evicted_by_b_;
  double weight_a_ = 0.5;
  size_t residents_ = 1;
  std::mt19937_64 rng_{1};
};

double Tib(uint64_t bytes) { return static_cast<double>(bytes) / 0x1p40; }

double Ratio(uint64_t bytes, uint64_t belady) {
  return static_cast<double>(bytes) / static_cast<double>(belady);
}

// One capacity's row: Belady's bytes, and every other rule's as a ratio to
// them.
struct Row {
  uint64_t belady = 0;
  double belady_size = 0, sized_belady = 0, next_use = 0, one_offs_cooled = 0,
         experts_gdsf = 0, experts_lru = 0, gdsf = 0;
};
// The columns every table shares, after its own, and their header.
void PrintShared(const Row& row) {
  std::printf("%12.3f %13.3f %9.3f %16.3f %13.3f %12.3f %9.3f\n",
              row.belady_size, row.sized_belady, row.next_use,
              row.one_offs_cooled, row.experts_gdsf, row.experts_lru, row.gdsf);
}
void PrintSharedHeader() {
  std::printf("%12s %13s %9s %16s %13s %12s %9s\n", "belady-size",
              "sized-belady", "next-use", "one-offs-cooled", "experts+gdsf",
              "experts+lru", "gdsf");
}

// Replays `trace` with next-use, GDSF, LRU and Belady's in the library and
// checks the loops above against the library's bytes for each (false if
// any differs), then runs the rest in those loops.
bool Measure(const Trace& trace, const std::vector<uint64_t>& capacities,
             std::vector<Row>& rows) {
  namespace replay = modelcache::replay;
  const std::vector<std::string> names = {"gdsf", "next-use", "lru", "belady"};
  const auto results =
      replay::ReplayAll(trace, names, capacities, Untimed(), 2);
  const size_t k = capacities.size();
  for (size_t c = 0; c < k; ++c) {
    const uint64_t cap = capacities[c];
    for (size_t p = 0; p < names.size(); ++p) {
      uint64_t ours;
      if (names[p] == "belady") {
        ours = BytesLoaded(trace, cap, Belady());
      } else {
        PolicyChooser chooser(trace,
                              modelcache::PolicyByName(names[p]).eviction);
        ours = BytesLoaded(trace, cap, chooser);
      }
      if (ours != results[p * k + c].bytes_loaded) {
        std::fprintf(stderr,
                     "error: the bound's replay disagrees with the library's "
                     "%s replay at %s\n",
                     names[p].c_str(), replay::FormatBytes(cap).c_str());
        return false;
      }
    }
    Row row;
    row.belady = results[3 * k + c].bytes_loaded;
    auto ratio = [&row](uint64_t bytes) { return Ratio(bytes, row.belady); };
    row.gdsf = ratio(results[c].bytes_loaded);
    row.next_use = ratio(results[k + c].bytes_loaded);
    row.belady_size = ratio(BytesLoaded(trace, cap, BeladySize()));
    row.sized_belady = ratio(BytesLoaded(trace, cap, SizedBelady()));
    PolicyChooser cooled(trace, std::make_shared<OneOffsAsCooled>());
    row.one_offs_cooled = ratio(BytesLoaded(trace, cap, cooled));
    ExpertsChooser with_gdsf(trace,
                             modelcache::PolicyByName("next-use").eviction,
                             modelcache::PolicyByName("gdsf").eviction);
    row.experts_gdsf = ratio(BytesLoaded(trace, cap, with_gdsf));
    ExpertsChooser with_lru(trace,
                            modelcache::PolicyByName("next-use").eviction,
                            modelcache::PolicyByName("lru").eviction);
    row.experts_lru = ratio(BytesLoaded(trace, cap, with_lru));
    rows.push_back(row);
  }
  return true;
}

// The default trace of `seed` with every model kEqualModelBytes large; if
// `stationary`, every model drawn again from the morning's popularity at
// the same times, and `pop` made to say so.
constexpr uint64_t kEqualModelBytes = uint64_t{4} << 30;
Trace EqualSizes(uint64_t seed, bool stationary, DefaultTracePopularity& pop) {
  Trace trace = modelcache::replay::GenerateDefaultTrace(seed);
  std::fill(trace.sizes.begin(), trace.sizes.end(), kEqualModelBytes);
  pop = modelcache::replay::DefaultTracePopularityOf(seed);
  if (stationary) {
    pop.afternoon = pop.morning;
    std::discrete_distribution<uint32_t> draw(pop.morning.begin(),
                                              pop.morning.end());
    std::mt19937_64 rng(seed);
    for (auto& request : trace.requests) request.model = draw(rng);
  }
  return trace;
}

// The equal-sizes table: for each version of each seed's trace and each
// capacity in models, Belady's bytes and the others' as ratios to them.
constexpr uint64_t kEqualSizesModels[] = {10, 20, 30, 40, 50};
void PrintEqualSizes(const std::vector<uint64_t>& seeds) {
  namespace replay = modelcache::replay;
  std::printf(
      "\nThe same popularity with every model %s: the rate oracle is the\n"
      "optimal online policy (A0) for the stationary version\n\n",
      replay::FormatBytes(kEqualModelBytes).c_str());
  std::printf("%-10s %6s %8s %12s %12s %13s %9s %9s %9s %14s\n", "popularity",
              "seed", "models", "belady", "rate-oracle", "lfu-all-time",
              "next-use", "gdsf", "lru", "nu/oracle");
  std::vector<uint64_t> capacities;
  for (uint64_t k : kEqualSizesModels) {
    capacities.push_back(k * kEqualModelBytes);
  }
  const std::vector<std::string> names = {"belady", "next-use", "gdsf", "lru"};
  for (bool stationary : {true, false}) {
    for (uint64_t seed : seeds) {
      DefaultTracePopularity pop;
      const Trace trace = EqualSizes(seed, stationary, pop);
      const auto results =
          replay::ReplayAll(trace, names, capacities, Untimed(), 2);
      const size_t k = capacities.size();
      for (size_t c = 0; c < k; ++c) {
        const uint64_t belady = results[c].bytes_loaded;
        const uint64_t oracle =
            BytesLoaded(trace, capacities[c], RateOracle(trace, pop, 0));
        AllTimeCountChooser lfu(trace);
        std::printf(
            "%-10s %6llu %8llu %9.2f TiB %12.3f %13.3f %9.3f %9.3f %9.3f "
            "%14.3f\n",
            stationary ? "fixed" : "drifting",
            static_cast<unsigned long long>(seed),
            static_cast<unsigned long long>(kEqualSizesModels[c]), Tib(belady),
            Ratio(oracle, belady),
            Ratio(BytesLoaded(trace, capacities[c], lfu), belady),
            Ratio(results[k + c].bytes_loaded, belady),
            Ratio(results[2 * k + c].bytes_loaded, belady),
            Ratio(results[3 * k + c].bytes_loaded, belady),
            Ratio(results[k + c].bytes_loaded, oracle));
      }
    }
  }
}

// ---- --bar ----

// Every online policy in the registry but next-use (PolicyNames), the ttl
// family as ttl-10m.
std::vector<std::string> OtherOnlinePolicies() {
  std::vector<std::string> names;
  for (std::string name : modelcache::PolicyNames()) {
    if (name.rfind("ttl-", 0) == 0) name = "ttl-10m";
    if (name != "next-use") names.push_back(name);
  }
  return names;
}

struct BarWorkload {
  std::string name;
  Trace trace;
  std::vector<uint64_t> capacities;
  std::optional<DefaultTracePopularity> stationary;  // A0 applies
};

std::vector<uint64_t> GibCapacities(std::initializer_list<double> gib) {
  std::vector<uint64_t> capacities;
  for (double g : gib) capacities.push_back(static_cast<uint64_t>(g * 0x1p30));
  return capacities;
}

// Throws std::invalid_argument on a malformed spec.
BarWorkload ParseBarWorkload(const std::string& spec,
                             const std::string& azure_path,
                             const std::string& memory_path) {
  namespace replay = modelcache::replay;
  BarWorkload w;
  w.name = spec;
  std::string body = spec;
  std::vector<uint64_t> capacities;
  if (const size_t at = spec.find('@'); at != std::string::npos) {
    body = spec.substr(0, at);
    std::string list = spec.substr(at + 1);
    size_t start = 0;
    while (start < list.size()) {
      size_t end = list.find(',', start);
      if (end == std::string::npos) end = list.size();
      capacities.push_back(replay::ParseBytes(list.substr(start, end - start)));
      start = end + 1;
    }
  }
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t end = body.find(':', start);
    parts.push_back(body.substr(start, end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  auto seed_of = [&](const std::string& text) {
    char* end = nullptr;
    const uint64_t seed = std::strtoull(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0') {
      throw std::invalid_argument("bad seed in workload '" + spec + "'");
    }
    return seed;
  };
  const std::string& kind = parts[0];
  if (kind == "default" && parts.size() == 2) {
    w.trace = replay::GenerateDefaultTrace(seed_of(parts[1]));
    w.capacities = GibCapacities({16, 32, 48, 64});
  } else if ((kind == "fixed" || kind == "drifting") && parts.size() == 2) {
    DefaultTracePopularity pop;
    w.trace = EqualSizes(seed_of(parts[1]), kind == "fixed", pop);
    if (kind == "fixed") w.stationary = pop;
    for (uint64_t k : kEqualSizesModels) {
      w.capacities.push_back(k * kEqualModelBytes);
    }
  } else if (kind == "azure") {
    if (azure_path.empty()) {
      throw std::invalid_argument("workload '" + spec + "' needs --azure");
    }
    replay::AzureOptions options;
    for (size_t i = 1; i < parts.size(); ++i) {
      const size_t eq = parts[i].find('=');
      const std::string key = parts[i].substr(0, eq);
      const std::string value =
          eq == std::string::npos ? "" : parts[i].substr(eq + 1);
      if (key == "models" && !value.empty()) {
        options.num_models = static_cast<uint32_t>(seed_of(value));
      } else if (key == "seed" && !value.empty()) {
        options.seed = seed_of(value);
      } else if (key == "poisson" && eq == std::string::npos) {
        options.poisson = true;
      } else if (key == "memory-scale" && !value.empty() &&
                 !memory_path.empty()) {
        options.memory_path = memory_path;
        options.memory_scale = std::stod(value);
      } else {
        throw std::invalid_argument("bad part '" + parts[i] +
                                    "' in workload '" + spec + "'");
      }
    }
    w.trace = replay::ReadAzureFunctionsTrace(azure_path, options);
    w.capacities = GibCapacities({8, 16, 32, 64});
  } else {
    throw std::invalid_argument("unknown workload '" + spec + "'");
  }
  if (!capacities.empty()) w.capacities = capacities;
  return w;
}

int PrintBar(const std::vector<std::string>& specs,
             const std::string& azure_path, const std::string& memory_path) {
  namespace replay = modelcache::replay;
  const std::vector<std::string> others = OtherOnlinePolicies();
  std::vector<std::string> names = others;
  names.push_back("next-use");
  names.push_back("belady");
  std::printf(
      "next-use against every other online policy (untimed replay): bytes as\n"
      "a ratio to Belady's, and next-use's to the fewest of the others;\n"
      "on stationary equal sizes also to A0 (the rate oracle)\n"
      "others: ");
  for (size_t p = 0; p < others.size(); ++p) {
    std::printf("%s%s", p ? ", " : "", others[p].c_str());
  }
  std::printf("\n\n%-40s %10s %11s %9s %-17s %7s %9s %8s\n", "workload",
              "capacity", "belady", "next-use", "fewest other", "", "nu/other",
              "nu/A0");
  replay::ReplayOptions untimed;
  untimed.timed = false;
  size_t rows = 0, over = 0, a0_rows = 0, a0_over = 0;
  double worst = 0, worst_a0 = 0, log_sum = 0;
  for (const std::string& spec : specs) {
    const BarWorkload w = ParseBarWorkload(spec, azure_path, memory_path);
    const auto results =
        replay::ReplayAll(w.trace, names, w.capacities, untimed, 2);
    const size_t k = w.capacities.size();
    for (size_t c = 0; c < k; ++c) {
      size_t best = 0;
      for (size_t p = 1; p < others.size(); ++p) {
        if (results[p * k + c].bytes_loaded <
            results[best * k + c].bytes_loaded) {
          best = p;
        }
      }
      const uint64_t other = results[best * k + c].bytes_loaded;
      const uint64_t next_use = results[others.size() * k + c].bytes_loaded;
      const uint64_t belady = results[(others.size() + 1) * k + c].bytes_loaded;
      const double vs_other = Ratio(next_use, other);
      ++rows;
      over += vs_other > 1.01;
      worst = std::max(worst, vs_other);
      log_sum += std::log(Ratio(next_use, belady));
      std::printf("%-40s %10s %7.2f TiB %9.3f %-17s %7.3f %9.4f",
                  w.name.c_str(), replay::FormatBytes(w.capacities[c]).c_str(),
                  Tib(belady), Ratio(next_use, belady), others[best].c_str(),
                  Ratio(other, belady), vs_other);
      if (w.stationary) {
        const double vs_a0 =
            Ratio(next_use, BytesLoaded(w.trace, w.capacities[c],
                                        RateOracle(w.trace, *w.stationary, 0)));
        ++a0_rows;
        a0_over += vs_a0 > 1.05;
        worst_a0 = std::max(worst_a0, vs_a0);
        std::printf(" %8.3f", vs_a0);
      }
      std::printf("%s\n", vs_other > 1.01 ? "  over 1%" : "");
    }
    std::fflush(stdout);
  }
  std::printf(
      "\n%zu rows: next-use %.4f x Belady's (geometric mean); over 1.01 x the "
      "fewest other in %zu (worst %.4f)\n",
      rows, std::exp(log_sum / static_cast<double>(rows)), over, worst);
  if (a0_rows > 0) {
    std::printf("%zu stationary rows: over 1.05 x A0 in %zu (worst %.3f)\n",
                a0_rows, a0_over, worst_a0);
  }
  return 0;
}

// ---- --learning-bound ----

int PrintLearningBound(int seeds) {
  namespace replay = modelcache::replay;
  constexpr size_t kStride = 50;  // the bound is summed every kStride requests
  constexpr int kSweeps = 20000;  // chain steps per evaluation (plus a quarter)
  const std::vector<int> ks = {10, 20, 30, 40, 45, 50, 55};
  struct Sums {
    double a0 = 0, bound = 0, relaxed_a0 = 0, lfu = 0, lfu_max = 0;
    int lfu_over = 0;
    // Rows within 1% of the fewest bytes of the shipped online policies
    // (next-use's: of the others).
    int lfu_within = 0, next_use_within = 0;
    double next_use = 0;
  };
  std::vector<Sums> sums(ks.size());
  const std::vector<std::string> others = OtherOnlinePolicies();
  std::vector<std::string> names = others;
  names.push_back("next-use");
  std::vector<uint64_t> capacities;
  for (int k : ks) capacities.push_back(k * kEqualModelBytes);
  replay::ReplayOptions untimed;
  untimed.timed = false;
  for (int s = 0; s < seeds; ++s) {
    const uint64_t seed = 5000 + static_cast<uint64_t>(s);
    DefaultTracePopularity pop;
    const Trace trace = EqualSizes(seed, true, pop);
    const std::vector<double>& p = pop.morning;
    const size_t n_models = p.size();
    // The weights the ranks take, most popular first.
    std::vector<double> weight = p;
    std::sort(weight.rbegin(), weight.rend());
    std::vector<double> log_weight(n_models);
    for (size_t r = 0; r < n_models; ++r) log_weight[r] = std::log(weight[r]);
    std::vector<double> bound(ks.size(), 0), relaxed(ks.size(), 0);
    const auto shipped =
        replay::ReplayAll(trace, names, capacities, untimed, 2);
    for (size_t j = 0; j < ks.size(); ++j) {
      const uint64_t capacity = ks[j] * kEqualModelBytes;
      const double a0 = static_cast<double>(BytesLoaded(
                            trace, capacity, RateOracle(trace, pop, 0))) /
                        static_cast<double>(kEqualModelBytes);
      AllTimeCountChooser lfu(trace);
      const double lfu_misses =
          static_cast<double>(BytesLoaded(trace, capacity, lfu)) /
          static_cast<double>(kEqualModelBytes);
      sums[j].a0 += a0;
      sums[j].lfu += lfu_misses;
      sums[j].lfu_max = std::max(sums[j].lfu_max, lfu_misses / a0);
      sums[j].lfu_over += lfu_misses / a0 > 1.05;
      double fewest_other = std::numeric_limits<double>::infinity();
      for (size_t o = 0; o < others.size(); ++o) {
        fewest_other = std::min(
            fewest_other,
            static_cast<double>(shipped[o * ks.size() + j].bytes_loaded));
      }
      const double next_use = static_cast<double>(
          shipped[others.size() * ks.size() + j].bytes_loaded);
      const double lfu_bytes =
          lfu_misses * static_cast<double>(kEqualModelBytes);
      sums[j].next_use += next_use / static_cast<double>(kEqualModelBytes);
      sums[j].lfu_within +=
          lfu_bytes <= 1.01 * std::min(fewest_other, next_use);
      sums[j].next_use_within += next_use <= 1.01 * fewest_other;
    }
    // Metropolis over assignments of ranks to models; the likelihood of the
    // counts n is prod_m weight[rank[m]]^n[m].
    std::mt19937_64 rng(seed * 7 + 1);
    std::vector<size_t> rank_of(n_models), model_at(n_models);
    for (size_t m = 0; m < n_models; ++m) rank_of[m] = model_at[m] = m;
    std::vector<double> count(n_models, 0), q(n_models);
    std::vector<bool> seen(n_models, false);
    std::uniform_int_distribution<size_t> any(0, n_models - 1),
        adjacent(0, n_models - 2);
    std::uniform_real_distribution<double> unit(0, 1);
    auto step = [&] {
      size_t a, b;
      if (unit(rng) < 0.5) {  // neighbours in rank, or any two models
        const size_t r = adjacent(rng);
        a = model_at[r];
        b = model_at[r + 1];
      } else {
        a = any(rng);
        b = any(rng);
        if (a == b) return;
      }
      const double d = (count[a] - count[b]) *
                       (log_weight[rank_of[b]] - log_weight[rank_of[a]]);
      if (d >= 0 || unit(rng) < std::exp(d)) {
        std::swap(rank_of[a], rank_of[b]);
        model_at[rank_of[a]] = a;
        model_at[rank_of[b]] = b;
      }
    };
    size_t last = n_models;
    std::vector<double> others;
    for (size_t i = 0; i < trace.requests.size(); ++i) {
      if (i % kStride == 0 && last < n_models) {
        for (int t = 0; t < kSweeps / 4; ++t) step();
        std::fill(q.begin(), q.end(), 0.0);
        int samples = 0;
        for (int t = 0; t < kSweeps; ++t) {
          step();
          if (t % 20 == 0) {
            for (size_t m = 0; m < n_models; ++m) q[m] += weight[rank_of[m]];
            ++samples;
          }
        }
        for (double& x : q) x /= samples;
        for (const bool known : {false, true}) {
          const std::vector<double>& v = known ? p : q;
          others.clear();
          for (size_t m = 0; m < n_models; ++m) {
            if (seen[m] && m != last) others.push_back(v[m]);
          }
          std::sort(others.rbegin(), others.rend());
          for (size_t j = 0; j < ks.size(); ++j) {
            double held = v[last];
            for (size_t o = 0;
                 o + 1 < static_cast<size_t>(ks[j]) && o < others.size(); ++o) {
              held += others[o];
            }
            (known ? relaxed : bound)[j] += kStride * (1 - held);
          }
        }
      }
      const uint32_t m = trace.requests[i].model;
      count[m] += 1;
      seen[m] = true;
      last = m;
    }
    for (size_t j = 0; j < ks.size(); ++j) {
      sums[j].bound += bound[j];
      sums[j].relaxed_a0 += relaxed[j];
    }
    std::fprintf(stderr, "seed %llu done\n",
                 static_cast<unsigned long long>(seed));
  }
  std::printf(
      "Stationary equal sizes, seeds 5000-%d: misses per trace (means), the\n"
      "lower bound for any online policy, lfu-all-time against A0, and in\n"
      "how many seeds lfu-all-time and next-use load within 1%% of the\n"
      "fewest bytes of the other online policies we ship\n\n",
      5000 + seeds - 1);
  std::printf("%6s %8s %8s %9s %10s %13s %13s %7s %19s %9s %14s %14s\n",
              "models", "A0", "bound", "bound/A0", "relaxed-A0",
              "bound/relaxed", "lfu-all-time", "lfu/A0", "lfu over 1.05 x A0",
              "next-use", "lfu within 1%", "nu within 1%");
  for (size_t j = 0; j < ks.size(); ++j) {
    const Sums& x = sums[j];
    std::printf(
        "%6d %8.1f %8.1f %9.3f %10.1f %13.3f %13.1f %7.3f %5d (worst %.3f) "
        "%9.1f %11d/%d %11d/%d\n",
        ks[j], x.a0 / seeds, x.bound / seeds, x.bound / x.a0,
        x.relaxed_a0 / seeds, x.bound / x.relaxed_a0, x.lfu / seeds,
        x.lfu / x.a0, x.lfu_over, x.lfu_max, x.next_use / seeds, x.lfu_within,
        seeds, x.next_use_within, seeds);
  }
  return 0;
}

std::vector<uint64_t> Capacities(std::initializer_list<const char*> names) {
  std::vector<uint64_t> capacities;
  for (const char* c : names) {
    capacities.push_back(modelcache::replay::ParseBytes(c));
  }
  return capacities;
}

int Run(int argc, char** argv) {
  namespace replay = modelcache::replay;
  std::vector<uint64_t> seeds;
  std::string azure_path, memory_path;
  std::vector<std::string> bar;
  bool bar_mode = false;
  int learning_bound = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--azure") == 0 && i + 1 < argc) {
      azure_path = argv[++i];
    } else if (std::strcmp(argv[i], "--memory") == 0 && i + 1 < argc) {
      memory_path = argv[++i];
    } else if (std::strcmp(argv[i], "--bar") == 0) {
      bar_mode = true;
    } else if (std::strcmp(argv[i], "--learning-bound") == 0 && i + 1 < argc &&
               std::atoi(argv[i + 1]) > 0) {
      learning_bound = std::atoi(argv[++i]);
    } else if (bar_mode && argv[i][0] != '-') {
      bar.push_back(argv[i]);
    } else {
      char* end = nullptr;
      seeds.push_back(std::strtoull(argv[i], &end, 10));
      if (end == argv[i] || *end != '\0') {
        std::fprintf(stderr,
                     "usage: %s [seed ...] [--azure TRACE.csv [--memory "
                     "MEMORY.csv]] [--bar WORKLOAD ... | --learning-bound "
                     "N]\n",
                     argv[0]);
        return 2;
      }
    }
  }
  if (learning_bound > 0) return PrintLearningBound(learning_bound);
  if (bar_mode) {
    if (bar.empty()) {
      std::fprintf(stderr, "error: --bar needs at least one workload\n");
      return 2;
    }
    return PrintBar(bar, azure_path, memory_path);
  }
  if (seeds.empty()) seeds = {42, 1, 2};
  std::printf(
      "Bytes loaded again on the embedded default, as a ratio to Belady's\n"
      "(untimed replay; the oracles know each model's true request "
      "rate)\n\n");
  std::printf("%6s %9s %12s %12s %13s ", "seed", "capacity", "belady",
              "rate-oracle", "sized-oracle");
  PrintSharedHeader();
  const std::vector<uint64_t> capacities =
      Capacities({"32GiB", "48GiB", "64GiB"});
  for (uint64_t seed : seeds) {
    const Trace trace = replay::GenerateDefaultTrace(seed);
    const DefaultTracePopularity pop = replay::DefaultTracePopularityOf(seed);
    std::vector<Row> rows;
    if (!Measure(trace, capacities, rows)) return 1;
    for (size_t c = 0; c < capacities.size(); ++c) {
      const uint64_t cap = capacities[c], belady = rows[c].belady;
      std::printf(
          "%6llu %9s %9.2f TiB %12.3f %13.3f ",
          static_cast<unsigned long long>(seed),
          replay::FormatBytes(cap).c_str(), Tib(belady),
          Ratio(BytesLoaded(trace, cap, RateOracle(trace, pop, 0)), belady),
          Ratio(BytesLoaded(
                    trace, cap,
                    RateOracle(trace, pop, modelcache::kNextUseSizeExponent)),
                belady));
      PrintShared(rows[c]);
    }
  }
  PrintEqualSizes(seeds);
  if (azure_path.empty()) return 0;
  std::printf("\nThe same on the Azure Functions trace (%s)\n\n",
              azure_path.c_str());
  std::printf("%-16s %9s %12s ", "sizes", "capacity", "belady");
  PrintSharedHeader();
  struct Workload {
    const char* name;
    replay::AzureOptions options;
  };
  std::vector<Workload> workloads = {{"serving mix", {}}};
  if (!memory_path.empty()) {
    replay::AzureOptions options;
    options.memory_path = memory_path;
    options.memory_scale = 32;
    workloads.push_back({"memory file x32", options});
  }
  const std::vector<uint64_t> azure_capacities =
      Capacities({"16GiB", "32GiB", "64GiB"});
  for (const Workload& w : workloads) {
    const Trace trace = replay::ReadAzureFunctionsTrace(azure_path, w.options);
    std::vector<Row> rows;
    if (!Measure(trace, azure_capacities, rows)) return 1;
    for (size_t c = 0; c < azure_capacities.size(); ++c) {
      std::printf("%-16s %9s %9.2f TiB ", w.name,
                  replay::FormatBytes(azure_capacities[c]).c_str(),
                  Tib(rows[c].belady));
      PrintShared(rows[c]);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {  // a missing or malformed trace
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
