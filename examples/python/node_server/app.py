"""A multi-worker inference server whose workers share one copy of each model.

FastAPI on uvicorn (or gunicorn with uvicorn workers), any number of worker
processes, all leasing their weights from the node's `modelcache serve`
daemon: four workers hold one copy of a model, not four, and the daemon keeps
the node within its memory budget.

    export MODELCACHE_SOCKET=/tmp/mc-node/run/serve.sock NODE_NAME=node-1
    PYTHONPATH=build/python:examples/python/node_server \\
        /usr/bin/python3 -m uvicorn app:app --workers 4 --uds /tmp/mc-node/http.sock

Endpoints:

  POST /v1/models/{id}/infer   {"inputs": [[...], ...]} -> {"outputs": ...}
      Headers for a router: X-Node (this node); X-Load: local (this worker
      held the model, in use or idle: no round trip to the daemon), hit (the
      daemon had it resident), miss (this request's acquire loaded it) or
      joined (it waited for a load already in flight); X-Wait-Ms (how long
      getting the weights took). X-Worker-Pid says which worker answered.
      503 at once, with Retry-After, when the daemon cannot take the model
      now (CAPACITY, TOO_LARGE, BUSY), or cannot be reached and this worker
      does not map the model: a router sends the request to another node
      instead of queueing it for minutes.
      404 for a model the catalog does not have.
  GET /readyz                  the daemon's readiness, passed through
                               (DAEMON_HTTP: its /readyz; else a ping).
  GET /healthz                 200 while this worker answers.

How a worker runs a model on the shared tensors: `lease.torch()` gives
zero-copy tensors over the daemon's read-only mapping, and `models.bound`
makes them, for one request, the parameters of a module built on the meta
device (so the module has no memory of its own; each thread builds one per
shape, once, and a request only swaps its tensors in and out); `models.run`
runs it in inference mode, which never writes a parameter. torch cannot mark a tensor read-only: a write
to one (an optimizer step, load_state_dict, an in-place op) would kill the
worker with SIGSEGV (the daemon's copy is sealed, so no other process could
be affected). A model that must own writable parameters takes
`lease.torch(copy=True)` instead, at the cost of its own copy.

Each request acquires its model's lease and releases it when it has
answered. The client's delegation makes that cheap and keeps the node's
budget honest: an acquire of a model this worker holds (another request
uses it, or it was used within MODELCACHE_KEEP_IDLE seconds) is local, with
no round trip; a lease no request uses is idle, which the daemon counts as
evictable and recalls from the worker when it needs the room. A request in
flight keeps its model mapped while the daemon restarts, and the idle
leases stay mapped too (for MODELCACHE_KEEP_IDLE at most): the client
reclaims them from the restarted daemon, which adopts the copies and loads
nothing. While the daemon is down, a request for a model this worker maps
(in use by another request, kept idle, or waiting to be reclaimed: the
client keeps those mapped for the successor, whatever keep_idle says) is
served from that mapping (X-Load: local); only a request for a model it
does not map answers 503 at once.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
from typing import Any, Dict, List

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

import modelcache.serve
from modelcache import errors

import models

SOCKET = os.environ.get("MODELCACHE_SOCKET", "/run/modelcache/serve.sock")
NODE = os.environ.get("NODE_NAME", socket.gethostname())
# How long a request may wait for its model's load (its own, or one already
# running). Not for room: a full node answers 503 at once.
ACQUIRE_TIMEOUT = float(os.environ.get("ACQUIRE_TIMEOUT", "30"))
# How long the client keeps a lease that no request uses any more, idle
# (modelcache.serve.connect's keep_idle): the next request of the model
# within it acquires locally, without a round trip, and the daemon may
# recall it sooner when it needs the room. 0: every request whose model no
# other request of this worker uses is a round trip (the benchmark's
# baseline).
KEEP_IDLE = float(os.environ.get("MODELCACHE_KEEP_IDLE", "60"))
# How long a miss waits for an unreachable daemon before answering 503:
# every 503 comes within it, whether or not this worker ever reached the
# daemon. After a failed connect the worker waits (from 50 ms, doubling up
# to CONNECT_BACKOFF_MAX seconds) before it tries again, answering 503 at
# once meanwhile, so that a node whose daemon is down is not asked to
# connect on every request.
CONNECT_TIMEOUT = float(os.environ.get("CONNECT_TIMEOUT", "0.5"))
CONNECT_BACKOFF_MAX = float(os.environ.get("CONNECT_BACKOFF_MAX", "2"))
RETRY_AFTER = os.environ.get("RETRY_AFTER", "1")
# The daemon's HTTP address (its --http), for /readyz; unset: a ping.
DAEMON_HTTP = os.environ.get("DAEMON_HTTP", "")
# The baseline the benchmark compares with: WEIGHTS=inprocess gives each
# worker its own cache (modelcache.weights.HostWeightStore, pread: private
# memory) of the files under MODEL_ROOT, as servers do without the daemon.
WEIGHTS = os.environ.get("WEIGHTS", "daemon")
MODEL_ROOT = os.environ.get("MODEL_ROOT", "")
# For measurements (the loopback cluster, examples/cluster): every request is
# served in no less than this many milliseconds, the model's run included, so
# that how long a request holds its node does not depend on the machine's
# load. 0: as fast as the model runs.
SERVICE_MS = float(os.environ.get("SERVICE_MS", "0"))

app = FastAPI(title="modelcache node server")


_lock = threading.Lock()
_connected = threading.Condition(_lock)  # a connect attempt ended
_client: "modelcache.serve.Client | None" = None
_connecting = False  # one attempt at a time
_backoff = 0.0  # seconds; 0 until a connect fails
_next_connect = 0.0  # time.monotonic() before which none is tried
_connect_error = ""  # why the last attempt failed
_store: Any = None  # WEIGHTS=inprocess
_stored: set = set()  # models the in-process store has read


def _unreachable(message: str) -> errors.DaemonUnavailableError:
    e = errors.DaemonUnavailableError(message)
    e.serve_code = "UNAVAILABLE"
    return e


def client(deadline: "float | None" = None) -> modelcache.serve.Client:
    """One connection per worker process, made on first use: in the worker,
    after the server forked it. Raises DaemonUnavailableError by `deadline`
    (time.monotonic(); default CONNECT_TIMEOUT from now) when the daemon
    cannot be reached, and at once while backing off after a failed
    attempt."""
    global _client, _connecting, _backoff, _next_connect
    global _connect_error
    if deadline is None:
        deadline = time.monotonic() + CONNECT_TIMEOUT
    with _lock:
        while True:
            if _client is not None or WEIGHTS == "inprocess":
                return _client
            now = time.monotonic()
            if now < _next_connect:
                raise _unreachable(
                    f"{_connect_error} (next try in "
                    f"{(_next_connect - now) * 1000:.0f} ms)")
            if not _connecting:
                _connecting = True
                break
            # Another request of this worker is connecting: its outcome is
            # ours, if it comes in time.
            if now >= deadline or not _connected.wait(deadline - now):
                raise _unreachable(
                    f"no connection to the daemon at {SOCKET} within "
                    f"{CONNECT_TIMEOUT * 1000:.0f} ms")
    made = None
    try:
        made = modelcache.serve.connect(
            SOCKET, connect_timeout=max(0.0, deadline - time.monotonic()),
            keep_idle=KEEP_IDLE)
    except errors.Error as e:
        with _lock:
            _connecting = False
            _backoff = min(max(_backoff * 2, 0.05), CONNECT_BACKOFF_MAX)
            _next_connect = time.monotonic() + _backoff
            _connect_error = str(e)
            _connected.notify_all()
        raise
    except BaseException:
        with _lock:
            _connecting = False
            _connected.notify_all()
        raise
    with _lock:
        _client = made
        _connecting = False
        _backoff = 0.0
        _connected.notify_all()
        return _client


def _acquire(model_id: str) -> "tuple[Any, float, str]":
    """A lease on the model, how long getting it took in milliseconds, and
    how the copy was found (the X-Load header)."""
    start = time.perf_counter()
    deadline = time.monotonic() + CONNECT_TIMEOUT
    c = client(deadline)
    if WEIGHTS == "inprocess":
        lease = _store_lease(model_id)
        with _lock:
            load = "hit" if model_id in _stored else "miss"
            _stored.add(model_id)
        return lease, (time.perf_counter() - start) * 1000, load
    # A model this worker maps (another request uses it, the client keeps
    # it idle, or it waits to be reclaimed while the daemon is away) is
    # served from that mapping: no round trip, and no daemon needed. The
    # daemon's copy is sealed, and while the daemon is down nothing can
    # free it; its successor books the mapping and the client reclaims it.
    lease = c.acquire_local(model_id)
    if lease is not None:
        return lease, (time.perf_counter() - start) * 1000, lease.load
    # An acquire that is a round trip retries an unreachable daemon until
    # ACQUIRE_TIMEOUT; a ping first answers 503 within CONNECT_TIMEOUT. It
    # is skipped where the connection is known alive (the client keeps idle
    # leases, and a thread of its own watches the socket: when the daemon
    # goes, the leases wait to be reclaimed from its successor, counted as
    # pending, and the ping is made again; it reconnects, and so reclaims,
    # once the daemon is back).
    if c.idle_leases() == 0 or c.reclaims()["pending"] > 0:
        c.ping(timeout=max(0.0, deadline - time.monotonic()))
    lease = c.acquire(model_id, timeout=ACQUIRE_TIMEOUT, when_full="fail")
    return lease, (time.perf_counter() - start) * 1000, lease.load


def _store_lease(model_id: str) -> Any:
    global _store
    import modelcache.weights

    with _lock:
        if _store is None:
            _store = modelcache.weights.HostWeightStore(16 << 30, mode="pread")
    return _store.acquire(os.path.join(MODEL_ROOT, model_id + ".safetensors"))


def _tensors(lease: Any) -> Dict[str, Any]:
    """The lease's tensors, zero-copy views over its mapping (which they
    hold until they are dropped)."""
    if isinstance(lease, modelcache.serve.RemoteLease):
        return lease.torch()
    return {n: lease.torch(n) for n in lease.names()}  # the baseline's


class InferRequest(BaseModel):
    inputs: List[List[float]]


def _unavailable(e: errors.Error, wait_ms: float) -> JSONResponse:
    return JSONResponse(
        status_code=503,
        content={"error": e.serve_code or type(e).__name__, "message": str(e)},
        headers={"Retry-After": RETRY_AFTER, "X-Node": NODE,
                 "X-Wait-Ms": f"{wait_ms:.3f}",
                 "X-Worker-Pid": str(os.getpid())})


@app.post("/v1/models/{model_id}/infer")
def infer(model_id: str, request: InferRequest) -> Any:
    # A plain def: FastAPI runs it on its thread pool, and every wait for
    # the daemon releases the GIL, so one worker serves many at once.
    start = time.perf_counter()
    try:
        lease, wait_ms, load = _acquire(model_id)
    except (errors.NotFoundError, FileNotFoundError) as e:
        # The daemon's catalog (or, in-process, MODEL_ROOT) has no such model.
        raise HTTPException(status_code=404, detail=str(e))
    except (errors.CapacityError, errors.TooLargeError,
            errors.UnavailableError, errors.TimeoutError) as e:
        # CAPACITY, TOO_LARGE, BUSY, and an unreachable daemon
        # (DaemonUnavailableError is an UnavailableError).
        return _unavailable(e, (time.perf_counter() - start) * 1000)
    try:
        # This thread's module for the model's shape, built once, runs on
        # the lease's tensors for the block only: nothing is built per
        # request, and after the block nothing of the module views the
        # mapping.
        tensors = _tensors(lease)
        with models.bound(model_id, tensors) as net:
            outputs = models.run(net, request.inputs)
        if SERVICE_MS > 0:  # held until then, lease and all
            rest = SERVICE_MS / 1000 - (time.perf_counter() - start - wait_ms / 1000)
            if rest > 0:
                time.sleep(rest)
    finally:
        # The tensors are views of the mapping: the lease is in use until
        # they are gone too, then idle in the client.
        tensors = None
        lease.release()
    return JSONResponse(
        content={"model": model_id, "outputs": outputs},
        headers={"X-Node": NODE, "X-Load": load,
                 "X-Wait-Ms": f"{wait_ms:.3f}",
                 "X-Worker-Pid": str(os.getpid())})


@app.get("/readyz")
def readyz() -> Any:
    """The daemon's readiness passed through: with DAEMON_HTTP set (its
    --http address, e.g. 127.0.0.1:9464), its own /readyz status and body
    (503 during its grace period or while a pinned model is not resident);
    without, whether it answers on its socket. 503 carries Retry-After."""
    if WEIGHTS == "inprocess":
        return {"ready": True, "node": NODE}
    if DAEMON_HTTP:
        host, _, port = DAEMON_HTTP.rpartition(":")
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=2)
            conn.request("GET", "/readyz")
            r = conn.getresponse()
            body = json.loads(r.read() or b"{}")
            conn.close()
        except (OSError, ValueError) as e:
            body, status = {"ready": False, "reasons": [f"daemon: {e}"]}, 503
        else:
            status = r.status
        body["node"] = NODE
        headers = {"Retry-After": RETRY_AFTER} if status != 200 else {}
        return JSONResponse(status_code=status, content=body, headers=headers)
    try:
        client().ping(timeout=2)
    except errors.Error as e:
        return _unavailable(e, 0.0)
    return {"ready": True, "node": NODE}


@app.get("/healthz")
def healthz() -> Any:
    return {"ok": True, "pid": os.getpid()}
