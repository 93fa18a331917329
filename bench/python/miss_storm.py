#!/usr/bin/python3
"""A miss storm from Python: 32 threads acquire one cold key at once.

The key's loader sleeps 50 ms. Per run the benchmark checks that the loader
ran exactly once, and measures the hand-off: the time from the loader's end
(the instant before it returns) until the last thread holds the value, and
until the median thread does. The baseline is the least a Python program can
do: a bare concurrent.futures.Future, whose result one thread sets after
sleeping 50 ms while 32 threads wait in future.result().

Every run uses a fresh key (modelcache) or a fresh Future (baseline); the
two alternate run by run. Figures are medians over --reps runs.

    PYTHONPATH=build/python /usr/bin/python3 bench/python/miss_storm.py
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import modelcache


def run_modelcache(cache, key, threads, load_s):
    """(loader calls, loader end, [time each thread got the value])."""
    calls = []
    ends = []

    def loader():
        calls.append(1)
        time.sleep(load_s)
        ends.append(time.perf_counter())
        return modelcache.Loaded(object(), 1 << 20)

    barrier = threading.Barrier(threads)
    got = [0.0] * threads
    values = [None] * threads

    def worker(i):
        barrier.wait()
        with cache.acquire(key, loader, 1 << 20) as value:
            got[i] = time.perf_counter()
            values[i] = value

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(v is values[0] for v in values), "threads got different values"
    return len(calls), ends[0], got


def run_future(threads, load_s):
    """(setter calls, result set, [time each thread got the value])."""
    future = concurrent.futures.Future()
    ends = []
    barrier = threading.Barrier(threads + 1)
    got = [0.0] * threads

    def setter():
        barrier.wait()
        time.sleep(load_s)
        ends.append(time.perf_counter())
        future.set_result(object())

    def worker(i):
        barrier.wait()
        future.result()
        got[i] = time.perf_counter()

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    ts.append(threading.Thread(target=setter))
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return len(ends), ends[0], got


def summarise(samples):
    """samples: [(loads, end, got)] -> dict of medians (microseconds)."""
    last = [(max(got) - end) * 1e6 for _, end, got in samples]
    median = [(statistics.median(got) - end) * 1e6 for _, end, got in samples]
    first = [(min(got) - end) * 1e6 for _, end, got in samples]
    return {
        "loads": [n for n, _, _ in samples],
        "handoff_last_us_median": statistics.median(last),
        "handoff_median_thread_us_median": statistics.median(median),
        "handoff_first_us_median": statistics.median(first),
        "handoff_last_us_samples": last,
        "handoff_median_thread_us_samples": median,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--load-ms", type=float, default=50.0)
    p.add_argument("--reps", type=int, default=9, help="runs per figure (default %(default)s)")
    p.add_argument("--out", type=Path, default=Path("build/bench-results/python_miss_storm.json"))
    args = p.parse_args(argv)
    load_s = args.load_ms / 1000

    cache = modelcache.Cache(name="storm", capacity_bytes=1 << 40)
    mc_samples, fut_samples = [], []
    # One warm-up run each, not counted.
    run_modelcache(cache, "warm-up", args.threads, load_s)
    run_future(args.threads, load_s)
    before = cache.stats()
    for rep in range(args.reps):
        mc_samples.append(run_modelcache(cache, f"model-{rep}", args.threads, load_s))
        fut_samples.append(run_future(args.threads, load_s))
    after = cache.stats()

    loads = [n for n, _, _ in mc_samples]
    assert all(n == 1 for n in loads), f"loader calls per run: {loads}"
    cache_loads = after.loads - before.loads
    assert cache_loads == args.reps, f"cache counted {cache_loads} loads in {args.reps} runs"

    mc = summarise(mc_samples)
    fut = summarise(fut_samples)
    ratio_last = mc["handoff_last_us_median"] / fut["handoff_last_us_median"]
    ratio_median = mc["handoff_median_thread_us_median"] / fut["handoff_median_thread_us_median"]

    print(f"miss storm: {args.threads} threads, one cold key, {args.load_ms:g} ms loader; "
          f"median of {args.reps} runs")
    print(f"{'variant':<12} {'loads/run':>9} {'last thread':>12} {'median thread':>14} "
          f"{'first thread':>13}   (microseconds after the load's end)")
    for name, s in (("modelcache", mc), ("Future", fut)):
        print(f"{name:<12} {max(s['loads']):>9} {s['handoff_last_us_median']:>12.0f} "
              f"{s['handoff_median_thread_us_median']:>14.0f} "
              f"{s['handoff_first_us_median']:>13.0f}")
    print(f"modelcache / Future: last thread {ratio_last:.2f}x, median thread {ratio_median:.2f}x")
    print(f"cache: {after.misses - before.misses} misses, {after.hits - before.hits} hits "
          f"in the counted runs")

    out = {
        "benchmark": "python_miss_storm",
        "threads": args.threads,
        "load_ms": args.load_ms,
        "reps": args.reps,
        "modelcache": mc,
        "future_baseline": fut,
        "ratio_last_modelcache_over_future": ratio_last,
        "ratio_median_thread_modelcache_over_future": ratio_median,
        "cache_loads": cache_loads,
        "cache_misses": after.misses - before.misses,
        "cache_hits": after.hits - before.hits,
        "python": sys.version,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
