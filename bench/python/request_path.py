#!/usr/bin/python3
"""One request's weights path in the example server (examples/python/node_server),
timed in a loop in one Python process: the lease's acquire, its tensors and
the module bound to them (models.bound, as the server does), then the
release, through `modelcache serve` (a warm acquire: local, the lease kept
idle between iterations) beside a per-process HostWeightStore (kPread); the
same with a module built per request (models.bind, as the server did
before); and the acquire alone and the tensors alone for each. The paths
are interleaved; p50 in µs.

    PYTHONPATH=build/python MODELCACHE_BUILD_DIR=build /usr/bin/python3 \\
        bench/python/request_path.py [--model m3] [--iterations 2000]

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
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mcreqpath_"))
    models.write_node(tmp)
    daemon = Daemon(tmp, tmp / "catalog.json", tmp / "models",
                    capacity="512MiB").start()
    try:
        client = modelcache.serve.connect(daemon.socket)
        store = modelcache.weights.HostWeightStore(16 << 30, mode="pread")
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


if __name__ == "__main__":
    main()
