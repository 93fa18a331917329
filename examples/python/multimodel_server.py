#!/usr/bin/python3
"""A small multi-model inference HTTP server on top of modelcache.

It serves several small torch models (MLPs of different widths and a small
convnet) whose weights live in safetensors files, and keeps them resident
under a byte budget smaller than all of them together. Requests for a model
that is not resident wait for room (``when_full="wait"``) instead of failing;
modelcache evicts idle models to make it, never one a request is using.

    python3 multimodel_server.py --port 0          # prints the bound address
    curl -s localhost:PORT/v1/models
    curl -s -X POST localhost:PORT/v1/models/mlp-m/infer \\
         -d '{"inputs": [[0.1, 0.2, ...32 floats...]]}'
    curl -s localhost:PORT/v1/stats

Endpoints:
  GET  /v1/models               the models, their input shape and cache state
  POST /v1/models/{name}/infer  {"inputs": [...]} -> {"model", "outputs"}
  GET  /v1/stats                the cache's stats, the loader calls the server
                                recorded, the budget and the unload checks

The models are generated on first run from fixed seeds and written to
--models-dir as safetensors files; later runs read them back. The server
also records every loader call and, through each model's unload callback,
checks that no model is unloaded while a request is using it.

Importable: ``make_server(models_dir, capacity_bytes)`` builds the server in
process; run ``server.serve_forever()`` in a thread and stop it with
``server.shutdown()`` and ``server.server_close()``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch
from torch import nn

import modelcache

# ---------------------------------------------------------------------------
# The models
# ---------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, widths, device=None):
        super().__init__()
        layers = []
        for i, (a, b) in enumerate(zip(widths, widths[1:])):
            layers.append(nn.Linear(a, b, device=device))
            if i + 2 < len(widths):
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    """[N, 1, 16, 16] -> [N, 10]."""

    def __init__(self, device=None):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, device=device),
            nn.BatchNorm2d(16, device=device),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, device=device),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 1024, device=device),
            nn.ReLU(),
            nn.Linear(1024, 10, device=device),
        )

    def forward(self, x):
        return self.head(self.features(x))


# name -> (architecture, constructor arguments, input shape of one sample, seed)
# Sizes: about 0.3, 2.2, 4.4, 6.5 and 2.2 MB; 15.7 MB together.
MODEL_SPECS = {
    "mlp-s": ("mlp", [32, 256, 256, 10], [32], 11),
    "mlp-m": ("mlp", [32, 512, 512, 512, 10], [32], 12),
    "mlp-l": ("mlp", [32, 1024, 1024, 10], [32], 13),
    "mlp-xl": ("mlp", [32, 1536, 1024, 10], [32], 14),
    "convnet": ("convnet", None, [1, 16, 16], 15),
}


def build_module(name, device=None):
    """A fresh module for model `name` (uninitialised weights on "meta")."""
    arch, args, _, _ = MODEL_SPECS[name]
    if arch == "mlp":
        return MLP(args, device=device)
    if arch == "convnet":
        return ConvNet(device=device)
    raise ValueError(f"unknown architecture {arch!r}")


def input_shape(name):
    return list(MODEL_SPECS[name][2])


# ---------------------------------------------------------------------------
# safetensors: written with modelcache.weights.save_file; read by hand here
# (8-byte little-endian header length, JSON header, raw little-endian data)
# ---------------------------------------------------------------------------

_DTYPES = {
    torch.float32: ("F32", np.dtype("<f4")),
    torch.float64: ("F64", np.dtype("<f8")),
    torch.float16: ("F16", np.dtype("<f2")),
    torch.int64: ("I64", np.dtype("<i8")),
    torch.int32: ("I32", np.dtype("<i4")),
    torch.uint8: ("U8", np.dtype("u1")),
}
_NP_BY_CODE = {code: np_dtype for code, np_dtype in _DTYPES.values()}


def write_safetensors(path, tensors, metadata=None):
    """Writes `tensors` (name -> tensor) to `path` atomically, with
    modelcache's writer."""
    arrays = {}
    for name, tensor in tensors.items():
        _, np_dtype = _DTYPES[tensor.dtype]
        arrays[name] = tensor.detach().contiguous().cpu().numpy().astype(np_dtype, copy=False)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    modelcache.weights.save_file(
        arrays, tmp, {str(k): str(v) for k, v in (metadata or {}).items()})
    os.replace(tmp, path)


def read_safetensors_header(path):
    """(header dict, offset of the data buffer) of the file at `path`."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return header, 8 + n


def safetensors_data_bytes(path):
    """The bytes of tensor data in the file: what its state dict occupies."""
    header, _ = read_safetensors_header(path)
    return sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    )


def read_safetensors(path):
    """name -> CPU tensor (owning its memory) for the file at `path`."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        arr = np.frombuffer(raw, dtype=_NP_BY_CODE[info["dtype"]],
                            count=(end - begin) // _NP_BY_CODE[info["dtype"]].itemsize,
                            offset=base + begin)
        out[name] = torch.from_numpy(arr.reshape(info["shape"]).copy())
    return out


def _modelcache_state_dict_reader():
    """modelcache.weights.load_state_dict bound to a store, or None when the
    package does not offer it (then the reader above is used)."""
    weights = getattr(modelcache, "weights", None)
    if weights is None:
        try:
            import modelcache.weights as weights  # noqa: F811
        except ImportError:
            return None
    load = getattr(weights, "load_state_dict", None)
    store_cls = getattr(weights, "HostWeightStore", None)
    if load is None or store_cls is None:
        return None
    try:
        store = store_cls(capacity_bytes=1 << 30)
    except Exception:  # noqa: BLE001 - an API we cannot use: fall back
        return None

    def reader(path):
        return load(store, str(path))

    return reader


# ---------------------------------------------------------------------------
# Generating the model files
# ---------------------------------------------------------------------------


def model_path(models_dir, name):
    return Path(models_dir) / f"{name}.safetensors"


def generate_model(name):
    """The module for `name` with its seeded weights (deterministic)."""
    seed = MODEL_SPECS[name][3]
    gen = torch.Generator().manual_seed(seed)
    module = build_module(name)
    with torch.no_grad():
        for pname, p in module.named_parameters():
            fan_in = p.shape[1:].numel() if p.dim() > 1 else p.shape[0]
            bound = 1.0 / math.sqrt(max(fan_in, 1))
            p.copy_((torch.rand(p.shape, generator=gen) * 2 - 1) * bound)
        for bname, b in module.named_buffers():
            if bname.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
            elif bname.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    return module.eval()


def ensure_models(models_dir):
    """Writes the model files that are missing; returns name -> path."""
    models_dir = Path(models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in MODEL_SPECS:
        path = model_path(models_dir, name)
        if not path.exists():
            module = generate_model(name)
            write_safetensors(path, module.state_dict(),
                              metadata={"model": name, "format": "pt"})
        paths[name] = path
    return paths


def load_module(path, name, read_state_dict=read_safetensors):
    """A ready-to-run module for `name` with the weights in `path`."""
    # Built on "meta" and materialised empty: no time spent on an init that
    # load_state_dict overwrites anyway.
    module = build_module(name, device="meta").to_empty(device="cpu")
    module.load_state_dict(read_state_dict(path), strict=True)
    return module.eval()


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class ModelServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer holding the cache and the server's own records.

    Handler threads are not daemons, so server_close() waits for the requests
    in progress to finish.
    """

    daemon_threads = False
    block_on_close = True

    def __init__(self, address, models_dir, capacity_bytes=None, *,
                 policy="lru", acquire_timeout=60.0, use_modelcache_reader=True,
                 verbose=False):
        self.verbose = verbose
        self.models_dir = Path(models_dir)
        self.paths = ensure_models(self.models_dir)
        self.expected_bytes = {n: safetensors_data_bytes(p) for n, p in self.paths.items()}
        self.total_model_bytes = sum(self.expected_bytes.values())
        if capacity_bytes is None:
            capacity_bytes = max(int(self.total_model_bytes * 0.6),
                                 max(self.expected_bytes.values()))
        self.capacity_bytes = int(capacity_bytes)
        self.acquire_timeout = acquire_timeout

        self.read_state_dict = read_safetensors
        self.reader_name = "builtin"
        if use_modelcache_reader:
            reader = _modelcache_state_dict_reader()
            if reader is not None:
                self.read_state_dict = reader
                self.reader_name = "modelcache.weights"

        # The server's own books, under one lock.
        self.lock = threading.Lock()
        self.loader_calls = collections.Counter()  # name -> loader calls
        self.unloads = collections.Counter()       # name -> unload calls
        self.in_use = collections.Counter()        # name -> requests using it
        self.violations = []  # models unloaded while a request used them
        self.events = collections.Counter()        # event type -> count
        self.requests = 0
        self.errors = collections.Counter()        # HTTP status -> count

        self.budget = modelcache.Budget(self.capacity_bytes)
        self.cache = modelcache.Cache(
            name="models", budget=self.budget, policy=policy,
            on_event=self._on_event)
        super().__init__(address, _Handler)

    # -- cache callbacks ----------------------------------------------------

    def _on_event(self, event):
        with self.lock:
            self.events[event.type] += 1
        if self.verbose:
            print(f"event {event.type} {event.key} {event.bytes}B "
                  f"{event.seconds:.3f}s {event.error or ''}", file=sys.stderr)

    def _loader(self, name):
        def load():
            with self.lock:
                self.loader_calls[name] += 1
            module = load_module(self.paths[name], name, self.read_state_dict)
            return modelcache.Loaded(module, modelcache.torch_bytes(module),
                                     unload=lambda: self._unload(name))
        return load

    def _unload(self, name):
        with self.lock:
            self.unloads[name] += 1
            if self.in_use[name] > 0:
                self.violations.append(
                    {"model": name, "in_use": self.in_use[name],
                     "time": time.time()})

    @contextlib.contextmanager
    def _using(self, name):
        with self.lock:
            self.in_use[name] += 1
        try:
            yield
        finally:
            with self.lock:
                self.in_use[name] -= 1

    # -- the operations behind the endpoints ---------------------------------

    def infer(self, name, inputs):
        if name not in MODEL_SPECS:
            raise modelcache.NotFoundError(f"no model named {name!r}")
        x = torch.tensor(inputs, dtype=torch.float32)
        want = input_shape(name)
        if x.dim() != len(want) + 1 or list(x.shape[1:]) != want:
            raise ValueError(f"inputs of {name} must have shape [N, "
                             f"{', '.join(map(str, want))}], not {list(x.shape)}")
        with self.lock:
            self.requests += 1
        with self.cache.acquire(name, self._loader(name), self.expected_bytes[name],
                                timeout=self.acquire_timeout,
                                when_full="wait") as model:
            with self._using(name), torch.no_grad():
                y = model(x)
        return y.tolist()

    def models(self):
        out = []
        for name in MODEL_SPECS:
            entry = self.cache.entry(name)
            out.append({
                "name": name,
                "input_shape": input_shape(name),
                "file_bytes": self.expected_bytes[name],
                "state": entry.state if entry is not None else "not loaded",
                "bytes": entry.bytes if entry is not None else 0,
                "leases": entry.leases if entry is not None else 0,
                "waiters": entry.waiters if entry is not None else 0,
                "accesses": entry.accesses if entry is not None else 0,
            })
        return out

    def stats(self):
        cache_stats = self.cache.stats().as_dict()
        with self.lock:
            return {
                "cache": cache_stats,
                "loader_calls": sum(self.loader_calls.values()),
                "loader_calls_by_model": dict(self.loader_calls),
                "unloads": sum(self.unloads.values()),
                "unloads_by_model": dict(self.unloads),
                "unload_violations": list(self.violations),
                "events": dict(self.events),
                "requests": self.requests,
                "errors": {str(k): v for k, v in self.errors.items()},
                "budget": {
                    "capacity": self.budget.capacity,
                    "used": self.budget.used,
                    "high_water": self.budget.high_water,
                },
                "total_model_bytes": self.total_model_bytes,
                "weights_reader": self.reader_name,
            }

    @property
    def url(self):
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


_INFER = re.compile(r"^/v1/models/([^/]+)/infer$")


class _Handler(BaseHTTPRequestHandler):
    server_version = "modelcache-example/0.1"

    def log_message(self, fmt, *args):  # quiet unless --verbose
        if self.server.verbose:
            super().log_message(fmt, *args)

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        if status >= 400:
            with self.server.lock:
                self.server.errors[status] += 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/v1/models":
            self._reply(200, {"models": self.server.models()})
        elif path == "/v1/stats":
            self._reply(200, self.server.stats())
        elif path in ("", "/healthz"):
            self._reply(200, {"ok": True})
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        m = _INFER.match(self.path.split("?", 1)[0])
        if not m:
            self._reply(404, {"error": f"no route {self.path}"})
            return
        name = m.group(1)
        try:
            length = int(self.headers.get("Content-Length", "0"))
            body = json.loads(self.rfile.read(length) or b"{}")
            inputs = body["inputs"]
        except (ValueError, KeyError, TypeError) as e:
            self._reply(400, {"error": f"bad request body: {e}"})
            return
        try:
            outputs = self.server.infer(name, inputs)
        except modelcache.NotFoundError as e:
            self._reply(404, {"error": str(e)})
        except (modelcache.TimeoutError, modelcache.CapacityError) as e:
            self._reply(503, {"error": f"{type(e).__name__}: {e}"})
        except modelcache.TooLargeError as e:
            self._reply(507, {"error": str(e)})
        except (ValueError, TypeError, RuntimeError) as e:
            if isinstance(e, modelcache.Error):
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            else:
                self._reply(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - a loader failure and the like
            self._reply(500, {"error": f"{type(e).__name__}: {e}"})
        else:
            self._reply(200, {"model": name, "outputs": outputs})


def make_server(models_dir, capacity_bytes=None, host="127.0.0.1", port=0, **kwargs):
    """Builds the server (generating the model files if needed), bound but
    not yet serving. Run server.serve_forever() (in a thread, say); stop with
    server.shutdown() then server.server_close()."""
    torch.set_num_threads(1)
    return ModelServer((host, port), models_dir, capacity_bytes, **kwargs)


def default_models_dir():
    return Path(tempfile.gettempdir()) / "modelcache-example-models"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--models-dir", type=Path, default=default_models_dir(),
                   help="where the safetensors files are (generated if missing; "
                        "default %(default)s)")
    p.add_argument("--capacity-bytes", type=int, default=None,
                   help="the cache's budget (default: 60%% of all the models)")
    p.add_argument("--policy", default="lru", help="lru or gdsf")
    p.add_argument("--acquire-timeout", type=float, default=60.0,
                   help="seconds a request waits for its model (default %(default)s)")
    p.add_argument("--builtin-reader", action="store_true",
                   help="read safetensors with this script's reader, not modelcache.weights")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)

    server = make_server(args.models_dir, args.capacity_bytes, args.host, args.port,
                         policy=args.policy, acquire_timeout=args.acquire_timeout,
                         use_modelcache_reader=not args.builtin_reader,
                         verbose=args.verbose)
    print(f"serving {len(MODEL_SPECS)} models ({server.total_model_bytes} bytes) "
          f"from {server.models_dir} with a {server.capacity_bytes}-byte budget "
          f"on {server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
