// The capacity an SLO needs: a search over capacity by replaying.
//
// Design note.
//
// The search keeps, per policy, every probe it has (the runs it was given
// and those it made), sorted by capacity. For one SLO, the probes determine
// its bracket: the answer C is the smallest probed capacity that met the SLO
// with every probe above it meeting it too, and the failing end is the probe
// just below C (or one byte less than the largest requested model, below
// which some request is too large: a known failure that needs no replay).
// Nothing else is state: each round recomputes every bracket from the probes,
// so the search cannot be misled by an order of discovery, and a probe that
// fails above an earlier answer moves the answer up.
//
// Rounds: the first is the coarse sweep (the sum of all models, and
// capacities filling every gap of more than kSloSweepRatio between the
// largest model and the top). Each later round bisects every bracket wider
// than the resolution of some SLO that has it, for every policy and every
// SLO at once; SLOs with the same bracket share its probe. A round's probes
// run together on up to the threads asked for (RunParallel). Bisection, one
// probe per bracket, rather than a wider split when threads are idle: the
// answers then depend on the trace, the options and the SLOs only, never on
// the number of threads.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "modelcache/base/errors.h"
#include "modelcache/replay/replay.h"
#include "parallel.h"

namespace modelcache::replay {
namespace {

bool Meets(const SloProbe& probe, double slo_ms) {
  return probe.served_all && probe.wait_ms <= slo_ms;
}

SloProbe ProbeOf(const RunResult& r, double percentile) {
  return SloProbe{r.capacity_bytes, WaitAtPercentile(r, percentile),
                  r.too_large == 0 && r.rejected == 0 && r.blocked == 0};
}

struct Bracket {
  std::optional<uint64_t> answer;
  uint64_t failing = 0;
  bool monotone = true;
};

// `probes` by capacity; `floor` the largest requested model.
Bracket BracketOf(const std::map<uint64_t, SloProbe>& probes, uint64_t floor,
                  double slo_ms) {
  Bracket b;
  b.failing = floor > 0 ? floor - 1 : 0;
  auto it = probes.end();
  while (it != probes.begin() && Meets(std::prev(it)->second, slo_ms)) --it;
  if (it == probes.end()) {  // the top failed, or nothing probed yet
    if (!probes.empty()) b.failing = probes.rbegin()->first;
  } else {
    b.answer = it->first;
    if (it != probes.begin()) b.failing = std::prev(it)->first;
  }
  // Below the failing end: did any probe meet it anyway?
  for (const auto& [capacity, probe] : probes) {
    if (capacity >= b.failing) break;
    if (Meets(probe, slo_ms)) b.monotone = false;
  }
  return b;
}

struct Target {
  double slo_ms;
  double fraction;
  uint64_t bytes;
};

// True when the bracket still needs a probe for `target`.
bool Open(const Bracket& b, uint64_t floor, const Target& target) {
  if (!b.answer || *b.answer <= floor) return false;
  const double relative =
      std::ceil(target.fraction * static_cast<double>(*b.answer));
  const uint64_t resolution =
      std::max({static_cast<uint64_t>(relative), target.bytes, uint64_t{1}});
  return *b.answer - b.failing > resolution;
}

// Capacities that fill every gap wider than kSloSweepRatio in `have` (which
// holds the top), starting from `floor`.
std::vector<uint64_t> SweepPoints(const std::set<uint64_t>& have,
                                  uint64_t floor) {
  std::vector<uint64_t> points;
  double lower = static_cast<double>(std::max<uint64_t>(floor, 1));
  for (uint64_t next : have) {
    const double upper = static_cast<double>(next);
    if (upper > lower * kSloSweepRatio) {
      const int gaps = static_cast<int>(
          std::ceil(std::log(upper / lower) / std::log(kSloSweepRatio)));
      for (int j = 1; j < gaps; ++j) {
        points.push_back(static_cast<uint64_t>(
            std::llround(lower * std::pow(upper / lower, double(j) / gaps))));
      }
    }
    lower = std::max(lower, upper);
  }
  return points;
}

// The bisection rounds a bracket `width` wide whose failing end is `lower`
// can still take for `target`, at most: each round halves it (rounding up)
// and it closes once no wider than its resolution, which is at least that
// of an answer just above `lower`.
size_t RoundsBound(uint64_t width, uint64_t lower, const Target& target) {
  const double resolution =
      std::max({std::ceil(target.fraction * static_cast<double>(lower)),
                static_cast<double>(target.bytes), 1.0});
  size_t rounds = 0;
  for (double w = static_cast<double>(width); w > resolution;
       w = std::ceil(w / 2)) {
    ++rounds;
  }
  return rounds;
}

}  // namespace

SloAnswer SloAnswerFromProbes(std::vector<SloProbe> probes,
                              uint64_t largest_model, double slo_ms) {
  std::map<uint64_t, SloProbe> by_capacity;
  for (const SloProbe& p : probes) by_capacity.emplace(p.capacity_bytes, p);
  const Bracket b = BracketOf(by_capacity, largest_model, slo_ms);
  SloAnswer a;
  a.capacity_bytes = b.answer;
  a.failing_bytes = b.failing;
  a.monotone = b.monotone;
  for (const auto& [capacity, probe] : by_capacity) a.probes.push_back(probe);
  return a;
}

double WaitAtPercentile(const RunResult& r, double percentile) {
  if (percentile >= 100) return r.wait_ms.max;
  // wait_quantiles[k] is the nearest-rank percentile (k + 1) / 1000, as the
  // summary's fields are; use those where they exist, bit for bit.
  if (percentile == 50) return r.wait_ms.p50;
  if (percentile == 95) return r.wait_ms.p95;
  if (percentile == 99) return r.wait_ms.p99;
  if (percentile == 99.9) return r.wait_ms.p999;
  if (r.wait_quantiles.empty()) return 0;
  const auto k = static_cast<size_t>(std::llround(percentile * 10)) - 1;
  return r.wait_quantiles[std::min(k, r.wait_quantiles.size() - 1)];
}

std::string PercentileName(double percentile) {
  if (percentile >= 100) return "max";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "p%g", percentile);
  return buf;
}

namespace {

std::string G(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

void ValidateSloOptions(const SloSearchOptions& o) {
  auto bad = [](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, what);
  };
  auto check_ms = [&](double ms, const char* name) {
    if (!(ms > 0) || !std::isfinite(ms)) {
      bad(std::string(name) + " must be a positive, finite number of ms, not " +
          G(ms));
    }
  };
  check_ms(o.slo_ms, "the SLO");
  for (double ms : o.curve_slo_ms) check_ms(ms, "a curve SLO");
  const double tenths = o.percentile * 10;
  if (!(o.percentile > 0 && o.percentile <= 100) ||
      std::abs(tenths - std::round(tenths)) > 1e-9) {
    bad("the SLO's percentile must be in (0, 100] in steps of 0.1, not " +
        G(o.percentile));
  }
  auto check_resolution = [&](double fraction, uint64_t bytes,
                              const char* name) {
    if (!(fraction >= 0) || !std::isfinite(fraction) ||
        (fraction == 0 && bytes == 0)) {
      bad(std::string(name) +
          " must be positive and finite (a fraction of the answer, bytes, or "
          "both)");
    }
  };
  check_resolution(o.resolution_fraction, o.resolution_bytes,
                   "the SLO's resolution");
  check_resolution(o.curve_resolution_fraction, o.curve_resolution_bytes,
                   "the curve's resolution");
}

std::vector<SloAnswer> FindSloCapacities(
    const TraceSource& source, const std::vector<std::string>& policies,
    const SimulateOptions& options, const SloSearchOptions& slo,
    unsigned threads, const std::vector<RunResult>& known,
    const std::function<void(const SloProgress&)>& progress) {
  ValidateSloOptions(slo);
  for (const std::string& p : policies) {
    Simulate(Trace{}, p, 0, options);  // throws the clear error
  }

  // The domain: from the largest requested model to the sum of all models.
  // One pass over the requests finds the models requested.
  const TraceHeader& trace = source.header();
  uint64_t floor = 0;
  {
    std::vector<bool> requested(trace.models.size());
    std::unique_ptr<RequestReader> reader = source.Read();
    constexpr size_t kChunk = 4096;
    std::vector<Request> chunk(kChunk);
    std::vector<float> hold(trace.service_times ? kChunk : 0);
    for (size_t n; (n = reader->Read(chunk.data(), hold.data(), kChunk)) > 0;) {
      for (size_t i = 0; i < n; ++i) requested[chunk[i].model] = true;
    }
    for (size_t m = 0; m < trace.sizes.size(); ++m) {
      if (requested[m]) floor = std::max(floor, trace.sizes[m]);
    }
  }
  const uint64_t top =
      std::accumulate(trace.sizes.begin(), trace.sizes.end(), uint64_t{0});

  std::vector<Target> targets{
      {slo.slo_ms, slo.resolution_fraction, slo.resolution_bytes}};
  for (double ms : slo.curve_slo_ms) {
    targets.push_back(
        {ms, slo.curve_resolution_fraction, slo.curve_resolution_bytes});
  }

  std::vector<std::map<uint64_t, SloProbe>> probes(policies.size());
  for (const RunResult& r : known) {
    for (size_t p = 0; p < policies.size(); ++p) {
      if (r.policy == policies[p] && r.timed && r.capacity_bytes >= floor &&
          r.capacity_bytes <= top) {
        probes[p].emplace(r.capacity_bytes, ProbeOf(r, slo.percentile));
      }
    }
  }

  // The sweep's capacities not yet probed (round 0).
  auto sweep = [&] {
    std::vector<std::pair<size_t, uint64_t>> plan;
    for (size_t p = 0; p < policies.size(); ++p) {
      std::set<uint64_t> have{top};
      for (const auto& [capacity, probe] : probes[p]) have.insert(capacity);
      if (!probes[p].count(top)) plan.emplace_back(p, top);
      for (uint64_t c : SweepPoints(have, floor)) plan.emplace_back(p, c);
    }
    return plan;
  };
  // The midpoint of every bracket some SLO still needs narrower (later
  // rounds); empty when the search is done.
  auto bisection = [&] {
    std::vector<std::pair<size_t, uint64_t>> plan;
    for (size_t p = 0; p < policies.size(); ++p) {
      std::set<uint64_t> mids;
      for (const Target& t : targets) {
        const Bracket b = BracketOf(probes[p], floor, t.slo_ms);
        if (Open(b, floor, t)) {
          mids.insert(b.failing + (*b.answer - b.failing) / 2);
        }
      }
      for (uint64_t c : mids) {
        if (!probes[p].count(c)) plan.emplace_back(p, c);
      }
    }
    return plan;
  };
  // The bisection rounds that can follow the sweep, at most: after it, a
  // bracket lies between two consecutive capacities of the probes and the
  // sweep's plan (or below the first, from one byte under the floor).
  auto rounds_after_sweep =
      [&](const std::vector<std::pair<size_t, uint64_t>>& plan) {
        size_t most = 0;
        for (size_t p = 0; p < policies.size(); ++p) {
          std::set<uint64_t> points{top};
          for (const auto& [capacity, probe] : probes[p])
            points.insert(capacity);
          for (const auto& [q, c] : plan) {
            if (q == p) points.insert(c);
          }
          uint64_t lower = floor > 0 ? floor - 1 : 0;
          for (uint64_t c : points) {
            if (c <= lower) continue;
            for (const Target& t : targets)
              most = std::max(most, RoundsBound(c - lower, lower, t));
            lower = c;
          }
        }
        return most;
      };
  // The bisection rounds after the one that probes now, at most.
  auto rounds_after_bisection = [&] {
    size_t most = 0;
    for (size_t p = 0; p < policies.size(); ++p) {
      for (const Target& t : targets) {
        const Bracket b = BracketOf(probes[p], floor, t.slo_ms);
        if (Open(b, floor, t)) {
          most = std::max(most,
                          RoundsBound(*b.answer - b.failing, b.failing, t) - 1);
        }
      }
    }
    return most;
  };
  // Runs a round's probes (RunParallel).
  SloProgress state;
  auto run = [&](const std::vector<std::pair<size_t, uint64_t>>& plan,
                 size_t rounds_left) {
    state.round_probes = plan.size();
    state.round_done = 0;
    state.rounds_left = rounds_left;
    if (progress) progress(state);
    std::vector<SloProbe> found(plan.size());
    RunParallel(
        plan.size(), threads,
        [&](size_t i) {
          const RunResult r = Simulate(source, policies[plan[i].first],
                                       plan[i].second, options);
          found[i] = ProbeOf(r, slo.percentile);
        },
        // One call per probe ended, as RunParallel reports them.
        progress ? [&](size_t done) {
          while (state.round_done < done) {
            ++state.probes_done;
            ++state.round_done;
            progress(state);
          }
        } : std::function<void(size_t)>());
    for (size_t i = 0; i < plan.size(); ++i) {
      probes[plan[i].first].emplace(plan[i].second, found[i]);
    }
    ++state.round;
  };
  {
    // May be empty: the runs given can cover the sweep.
    const auto plan = sweep();
    run(plan, rounds_after_sweep(plan));
  }
  for (auto plan = bisection(); !plan.empty(); plan = bisection())
    run(plan, rounds_after_bisection());

  std::vector<SloAnswer> answers;
  for (size_t p = 0; p < policies.size(); ++p) {
    SloAnswer a;
    a.policy = policies[p];
    const Bracket b = BracketOf(probes[p], floor, slo.slo_ms);
    a.capacity_bytes = b.answer;
    a.failing_bytes = b.failing;
    a.monotone = b.monotone;
    for (const auto& [capacity, probe] : probes[p]) a.probes.push_back(probe);
    for (double ms : slo.curve_slo_ms) {
      a.curve.push_back(BracketOf(probes[p], floor, ms).answer);
    }
    answers.push_back(std::move(a));
  }
  return answers;
}

std::vector<SloAnswer> FindSloCapacities(
    const Trace& trace, const std::vector<std::string>& policies,
    const SimulateOptions& options, const SloSearchOptions& slo,
    unsigned threads, const std::vector<RunResult>& known,
    const std::function<void(const SloProgress&)>& progress) {
  return FindSloCapacities(*SourceOf(trace), policies, options, slo, threads,
                           known, progress);
}

}  // namespace modelcache::replay
