#!/usr/bin/python3
"""One request's weights path in the example server (examples/python/node_server),
timed in a loop in one Python process: the lease's acquire, its tensors and
the module bound to them (models.bound, as the server does), then the
release, through `modelcache serve` (a warm acquire: local, the lease kept
idle between iterations) beside a per-process HostWeightStore (kPread); the
same with a module built per request (models.bind, as the server did
before); and the acquire alone and the tensors alone for each. The paths
are interleaved; p50 in µs.

With --with-run, each path runs the model too, as a request does, over
every model of the node in turn: the kept lease's request (a module bound
once to tensors kept for the whole run: the example before delegation)
beside the delegated and the in-process ones, and two steps between them
on the kept lease (its kept tensors swapped in by models.bound; new views
from lease.torch(), then bound), which split the delegated request's extra
cost into binding, making views, and the rest (acquire, release and the
notices that follow). Between two acquires the
caches hold the model's run, not the weights path, which is where the
server pays for it; the ratios are what a CPU-bound server's throughput
can be at best against the kept lease.

    PYTHONPATH=build/python MODELCACHE_BUILD_DIR=build /usr/bin/python3 \\
        bench/python/request_path.py [--model m3] [--iterations 2000]
    PYTHONPATH=build/python MODELCACHE_BUILD_DIR=build /usr/bin/python3 \\
        bench/python/request_path.py --with-run [--iterations 300]

Not a test: it asserts no time. The daemon it starts is stopped by pid.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python/tests"))
sys.path.insert(0, str(ROOT / "examples/python/node_server"))

import models  # noqa: E402
import modelcache.serve  # noqa: E402
import modelcache.weights  # noqa: E402
from serve_util import Daemon  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="m3", choices=sorted(models.SHAPES))
    parser.add_argument("--iterations", type=int, default=None,
                        help="default 2000; with --with-run 300 rounds")
    parser.add_argument("--with-run", action="store_true",
                        help="run the model in each path, every model in turn")
    args = parser.parse_args()
    if args.iterations is None:
        args.iterations = 300 if args.with_run else 2000
    tmp = Path(tempfile.mkdtemp(prefix="mcreqpath_"))
    models.write_node(tmp)
    daemon = Daemon(tmp, tmp / "catalog.json", tmp / "models",
                    capacity="512MiB").start()
    try:
        client = modelcache.serve.connect(daemon.socket)
        store = modelcache.weights.HostWeightStore(16 << 30, mode="pread")
        if args.with_run:
            with_run(client, store, tmp, args.iterations)
            return
        m = args.model
        path = str(tmp / "models" / (m + ".safetensors"))

        def daemon_request() -> None:
            lease = client.acquire(m, timeout=30, when_full="fail")
            with models.bound(m, lease.torch()):
                pass
            lease.release()

        def in_process_request() -> None:
            lease = store.acquire(path)
            with models.bound(m, {n: lease.torch(n) for n in lease.names()}):
                pass
            lease.release()

        def daemon_request_bind() -> None:
            lease = client.acquire(m, timeout=30, when_full="fail")
            net = models.bind(m, lease.torch())
            del net
            lease.release()

        def daemon_acquire() -> None:
            client.acquire(m, timeout=30, when_full="fail").release()

        def in_process_acquire() -> None:
            store.acquire(path).release()

        def daemon_tensors() -> None:
            lease = client.acquire(m, timeout=30, when_full="fail")
            tensors = lease.torch()
            del tensors
            lease.release()

        def in_process_tensors() -> None:
            lease = store.acquire(path)
            tensors = {n: lease.torch(n) for n in lease.names()}
            del tensors
            lease.release()

        paths = [daemon_request, in_process_request, daemon_request_bind,
                 daemon_acquire,
                 in_process_acquire, daemon_tensors, in_process_tensors]
        for run in paths:
            run()  # warm: loaded, read, mapped
        us = {run.__name__: [] for run in paths}
        for _ in range(args.iterations):
            for run in paths:
                start = time.perf_counter()
                run()
                us[run.__name__].append((time.perf_counter() - start) * 1e6)
        print(f"model {m}, {args.iterations} iterations, p50:")
        for name, values in us.items():
            print(f"  {name:20s} {statistics.median(values):8.1f} us")
    finally:
        daemon.stop()


def with_run(client: "modelcache.serve.Client",
             store: "modelcache.weights.HostWeightStore", tmp: Path,
             iterations: int) -> None:
    names = sorted(models.SHAPES)
    inputs = {m: [[0.0] * models.SHAPES[m][0]] for m in names}
    paths = {m: str(tmp / "models" / (m + ".safetensors")) for m in names}
    kept = {}  # model -> (lease, its tensors, a module bound once to them)
    for m in names:
        lease = client.acquire(m, timeout=30, when_full="fail")
        tensors = lease.torch()
        kept[m] = (lease, tensors, models.bind(m, tensors))
    # A second client for the delegated path: the kept leases are in use
    # for the whole run, so the first client's acquires would be local
    # references to them, never revivals of an idle delegation.
    delegated = modelcache.serve.connect(client.socket_path)

    def kept_request(m: str) -> None:
        models.run(kept[m][2], inputs[m])

    def kept_tensors_bound(m: str) -> None:
        with models.bound(m, kept[m][1]) as net:
            models.run(net, inputs[m])

    def kept_lease_new_views(m: str) -> None:
        with models.bound(m, kept[m][0].torch()) as net:
            models.run(net, inputs[m])

    def daemon_request(m: str) -> None:
        lease = delegated.acquire(m, timeout=30, when_full="fail")
        with models.bound(m, lease.torch()) as net:
            models.run(net, inputs[m])
        lease.release()

    def in_process_request(m: str) -> None:
        lease = store.acquire(paths[m])
        with models.bound(m, {n: lease.torch(n) for n in lease.names()}) as net:
            models.run(net, inputs[m])
        lease.release()

    runs = [kept_request, kept_tensors_bound, kept_lease_new_views,
            daemon_request, in_process_request]
    for m in names:
        for run in runs:
            run(m)  # warm
    # One sample: every path once on every model, paths interleaved.
    us = {run.__name__: [] for run in runs}
    for _ in range(iterations):
        total = {run.__name__: 0.0 for run in runs}
        for m in names:
            for run in runs:
                start = time.perf_counter()
                run(m)
                total[run.__name__] += (time.perf_counter() - start) * 1e6
        for name, value in total.items():
            us[name].append(value)
    base = statistics.median(us["kept_request"])
    print(f"models {', '.join(names)} in turn, {iterations} rounds, "
          "p50 of a round (each model once):")
    for name, values in us.items():
        p50 = statistics.median(values)
        print(f"  {name:20s} {p50:9.1f} us  {p50 - base:+7.1f} us  "
              f"kept/this {base / p50:.3f}")
    delegated.close()
    for lease, _, _ in kept.values():
        lease.release()


if __name__ == "__main__":
    main()
