#!/usr/bin/python3
"""The hit path from Python: acquiring a resident model, in ns per operation.

Three ways a Python server can hand out an already loaded model, each timed
at 1 and 4 threads in the same process:

  modelcache     ``with cache.acquire(key, loader, n) as model:`` (a lease)
  dict+lock      a plain dict behind one threading.Lock
  per-model-lock a global lock guarding a dict of per-model locks: take the
                 global lock, get or create the model's lock, release the
                 global lock, take the model's lock, check the dict (load if
                 missing), release

The two baselines only look the model up: they hold no lease, so nothing
stops an eviction while the model is in use. modelcache's figure includes
the lease (taken and released).

ns/op is the wall time of a run times the threads, over all operations: the
time one operation takes in one thread. With the GIL, threads do not run
Python in parallel, so at 4 threads it also measures contention and GIL
hand-offs. Each figure is the median of --reps runs.

    PYTHONPATH=build/python /usr/bin/python3 bench/python/hit_path.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import modelcache

KEY = "model-a"
NBYTES = 1 << 20


class Model:
    def __init__(self, name):
        self.name = name


def loader():
    return modelcache.Loaded(Model(KEY), NBYTES)


def make_modelcache():
    cache = modelcache.Cache(name="bench", capacity_bytes=1 << 30)
    with cache.acquire(KEY, loader, NBYTES):
        pass  # resident from now on

    def op():
        with cache.acquire(KEY, loader, NBYTES) as model:
            model.name  # noqa: B018 - use the value
    return op, cache


def make_dict_lock():
    lock = threading.Lock()
    models = {KEY: Model(KEY)}

    def op():
        with lock:
            model = models.get(KEY)
            if model is None:
                model = models[KEY] = Model(KEY)
        model.name  # noqa: B018
    return op, None


def make_per_model_lock():
    global_lock = threading.Lock()
    model_locks = {}
    models = {KEY: Model(KEY)}

    def op():
        with global_lock:
            model_lock = model_locks.get(KEY)
            if model_lock is None:
                model_lock = model_locks[KEY] = threading.Lock()
        with model_lock:
            model = models.get(KEY)
            if model is None:
                model = models[KEY] = Model(KEY)
        model.name  # noqa: B018
    return op, None


VARIANTS = {
    "modelcache": make_modelcache,
    "dict+lock": make_dict_lock,
    "per-model-lock": make_per_model_lock,
}


def run_once(op, threads, ops_per_thread):
    """Wall seconds for `threads` threads doing ops_per_thread ops each."""
    barrier = threading.Barrier(threads + 1)
    done = [0.0] * threads

    def worker(i):
        barrier.wait()
        for _ in range(ops_per_thread):
            op()
        done[i] = time.perf_counter()

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in ts:
        t.join()
    return max(done) - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=200_000,
                   help="operations per run, split across the threads (default %(default)s)")
    p.add_argument("--reps", type=int, default=5, help="runs per figure (default %(default)s)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", type=Path, default=Path("build/bench-results/python_hit_path.json"))
    args = p.parse_args(argv)

    ops_objects = {name: make() for name, make in VARIANTS.items()}
    results = {}
    for threads in args.threads:
        ops_per_thread = max(1, args.ops // threads)
        samples = {name: [] for name in VARIANTS}
        # Warm up each variant, then alternate them rep by rep so that a
        # noisy moment on the machine hits all of them alike.
        for name, (op, _) in ops_objects.items():
            run_once(op, threads, min(ops_per_thread, 10_000))
        for _ in range(args.reps):
            for name, (op, _) in ops_objects.items():
                wall = run_once(op, threads, ops_per_thread)
                # wall x threads / (ops_per_thread x threads)
                samples[name].append(wall / ops_per_thread * 1e9)
        results[str(threads)] = {
            name: {
                "ns_per_op_median": statistics.median(s),
                "ns_per_op_samples": s,
                "ops_per_second_median": 1e9 * threads / statistics.median(s),
            }
            for name, s in samples.items()
        }
        for name in VARIANTS:
            # > 1: modelcache's hit takes that many times as long as this one
            results[str(threads)][name]["modelcache_over_this"] = (
                results[str(threads)]["modelcache"]["ns_per_op_median"]
                / results[str(threads)][name]["ns_per_op_median"])
        results[str(threads)]["ops_per_thread"] = ops_per_thread

    cache = ops_objects["modelcache"][1]
    stats = cache.stats()
    loads = stats.loads
    assert loads == 1, f"the resident key was loaded {loads} times"

    print(f"hit path, median of {args.reps} runs (ns per op per thread; "
          f"ratio = modelcache / baseline)")
    print(f"{'threads':>7} {'variant':<16} {'ns/op':>10} {'Mops/s':>8} {'modelcache/this':>16}")
    for threads in args.threads:
        row = results[str(threads)]
        mc = row["modelcache"]["ns_per_op_median"]
        for name in VARIANTS:
            ns = row[name]["ns_per_op_median"]
            print(f"{threads:>7} {name:<16} {ns:>10.0f} "
                  f"{row[name]['ops_per_second_median'] / 1e6:>8.2f} {mc / ns:>16.2f}")

    out = {
        "benchmark": "python_hit_path",
        "unit": "ns per op per thread (wall time x threads / ops)",
        "reps": args.reps,
        "ops_per_run": args.ops,
        "results": results,
        "modelcache_stats": stats.as_dict(),
        "python": sys.version,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "switch_interval_s": sys.getswitchinterval(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
