"""The example server (examples/python/multimodel_server.py) under load.

Eight client threads send requests over more models than fit in the budget.
Every response must equal the model run directly (weights read back from the
same safetensors files into fresh modules, by a reader independent of the
server's); the budget's high-water mark must stay within capacity; no model
may be unloaded while a request uses it; and the cache's load count must
equal the loader calls the server recorded.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

import modelcache  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples/python/multimodel_server.py"

CLIENTS = 8
REQUESTS_PER_CLIENT = 24
BATCHES_PER_MODEL = 4


def _import_example():
    name = "modelcache_example_multimodel_server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _read_safetensors(path):
    """The test's own reader: name -> tensor."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8")}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dt = dtypes[info["dtype"]]
        arr = np.frombuffer(raw, dtype=dt, count=(end - begin) // dt.itemsize,
                            offset=8 + n + begin)
        out[name] = torch.from_numpy(arr.reshape(info["shape"]).copy())
    return out


def _data_bytes(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return sum(v["data_offsets"][1] - v["data_offsets"][0]
               for k, v in header.items() if k != "__metadata__")


def _get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode(errors="replace")


@pytest.fixture
def example():
    return _import_example()


@pytest.fixture
def running_server(example, tmp_path):
    models_dir = tmp_path / "models"
    paths = example.ensure_models(models_dir)
    sizes = {name: _data_bytes(p) for name, p in paths.items()}
    total = sum(sizes.values())
    # About half of all the models, and at least the largest one.
    capacity = max(total // 2, max(sizes.values()))
    assert capacity < total, "the budget must be smaller than all the models"

    server = example.make_server(models_dir, capacity, host="127.0.0.1", port=0,
                                 acquire_timeout=60.0)
    thread = threading.Thread(target=server.serve_forever,
                              kwargs={"poll_interval": 0.05},
                              name="example-server")
    thread.start()
    try:
        yield server, paths, capacity
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_server_under_concurrent_clients(example, running_server):
    server, paths, capacity = running_server
    assert isinstance(server.cache, modelcache.Cache)
    names = sorted(paths)
    assert len(names) >= 4

    # Inputs, and reference outputs from fresh modules built from the files.
    gen = torch.Generator().manual_seed(1234)
    inputs = {}
    expected = {}
    for name in names:
        module = example.build_module(name)
        module.load_state_dict(_read_safetensors(paths[name]), strict=True)
        module.eval()
        shape = example.input_shape(name)
        inputs[name] = []
        expected[name] = []
        for b in range(BATCHES_PER_MODEL):
            x = torch.randn([b + 1, *shape], generator=gen)
            with torch.no_grad():
                y = module(x)
            inputs[name].append(x.tolist())
            expected[name].append(y)

    base = server.url

    def client(c):
        results = []
        for j in range(REQUESTS_PER_CLIENT):
            name = names[(c + j) % len(names)]
            b = (c * 7 + j) % BATCHES_PER_MODEL
            status, body = _post(f"{base}/v1/models/{name}/infer",
                                 {"inputs": inputs[name][b]})
            results.append((name, b, status, body))
        return results

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
        all_results = [r for rs in pool.map(client, range(CLIENTS)) for r in rs]

    assert len(all_results) == CLIENTS * REQUESTS_PER_CLIENT
    failures = [(n, b, s, body) for n, b, s, body in all_results if s != 200]
    assert not failures, failures[:3]
    for name, b, _, body in all_results:
        assert body["model"] == name
        got = torch.tensor(body["outputs"], dtype=torch.float32)
        want = expected[name][b]
        assert got.shape == want.shape, (name, b)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (
            name, b, (got - want).abs().max().item())

    stats = _get(f"{base}/v1/stats")
    cache = stats["cache"]
    # The budget never went over capacity.
    assert stats["budget"]["capacity"] == capacity
    assert cache["capacity_bytes"] == capacity
    assert 0 < stats["budget"]["high_water"] <= capacity
    assert 0 < cache["high_water_bytes"] <= capacity
    assert cache["resident_bytes"] <= capacity
    # No model was unloaded while a request was using it.
    assert stats["unload_violations"] == []
    assert server.violations == []
    # The cache counted exactly the loads the server's loader made.
    assert cache["loads"] == stats["loader_calls"]
    assert cache["load_failures"] == 0
    assert cache["refused"] == 0
    # Every model was needed and they do not all fit: some were evicted, and
    # every eviction ran the model's unloader.
    assert stats["loader_calls"] >= len(names)
    assert set(stats["loader_calls_by_model"]) == set(names)
    assert cache["evictions"] >= 1
    assert stats["unloads"] == cache["evictions"]
    assert cache["hits"] + cache["misses"] >= CLIENTS * REQUESTS_PER_CLIENT
    assert stats["requests"] == CLIENTS * REQUESTS_PER_CLIENT

    # Nothing is leased once every request has been answered.
    listing = _get(f"{base}/v1/models")["models"]
    assert sorted(m["name"] for m in listing) == names
    resident = 0
    for m in listing:
        assert m["leases"] == 0, m
        assert m["state"] in ("resident", "not loaded"), m
        resident += m["bytes"]
    assert resident == cache["resident_bytes"]


def test_server_rejects_bad_requests(running_server):
    server, paths, _ = running_server
    base = server.url
    status, _ = _post(f"{base}/v1/models/no-such-model/infer", {"inputs": [[0.0]]})
    assert status == 404
    name = sorted(paths)[0]
    status, _ = _post(f"{base}/v1/models/{name}/infer", {"inputs": [[1.0, 2.0]]})
    assert status == 400
    status, _ = _post(f"{base}/v1/models/{name}/infer", {"nothing": 1})
    assert status == 400
    stats = _get(f"{base}/v1/stats")
    assert stats["cache"]["loads"] == stats["loader_calls"] == 0
