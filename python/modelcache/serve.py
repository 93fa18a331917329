"""Workers of ``modelcache serve``: leases of a node daemon's shared copies.

The daemon (``modelcache serve``, see docs/serve.md) holds one read-only copy of
each model for every process on the node. A worker connects to its socket and
acquires leases; a lease maps the daemon's copy read-only, so N workers read
one copy::

    import modelcache.serve

    client = modelcache.serve.connect("/run/modelcache/serve.sock")
    with client.acquire("sdxl-base", timeout=60) as lease:
        arrays = lease.numpy()              # name -> read-only ndarray
        tensors = lease.torch()             # name -> tensor, zero-copy
        writable = lease.torch(copy=True)   # name -> tensor the caller owns

This is the C++ client (``modelcache::serve::Client``) through pybind11: the
same protocol, reconnection and fork handling.

Lifetime. A view (array or tensor) keeps the mapping alive: the copy is in
use until the lease is released *and* the last view over it is gone; only
then may it be kept idle or unmapped and released (see Delegation below).
So a copy is never unmapped while numpy still reads it, and a view stays
valid after its lease is released.

Read-only. The copy is a sealed memfd mapped read-only: numpy arrays are
marked read-only; torch has no read-only tensors, and writing to a tensor
from :meth:`RemoteLease.torch` kills the process with SIGSEGV (no other
process is affected: nothing can change the daemon's bytes). Use
``torch(copy=True)`` where the model must own writable parameters.

Errors. The classes of :mod:`modelcache.errors`, with ``serve_code`` set to
the daemon's code: NotFoundError (NOT_FOUND), TooLargeError (TOO_LARGE),
CapacityError (CAPACITY; the message names what holds the memory),
TimeoutError (TIMEOUT), LoadError (LOAD_FAILED; ``cause`` is "io" or
"invalid_data"), UnavailableError (BUSY: a limit of the daemon; or
UNAVAILABLE: the model's files cannot be opened or are not valid, the message
names the file, and ``cause`` is "io" or "invalid_data"),
InvalidArgumentError (INVALID), and DaemonUnavailableError when the daemon
cannot be reached or is shutting down.

Threads and signals. A :class:`Client` may be used from any number of
threads; every call that waits for the daemon releases the GIL. On the main
thread, Ctrl-C ends an acquire's wait with KeyboardInterrupt (a lease granted
after that is released).

Daemon restarts. Leases held stay mapped and valid when the daemon dies. The
next call connects again, retrying with backoff within its own timeout, and
raises DaemonUnavailableError when the daemon is not back by then.

Reclaim. With a daemon that offers it (its hello's limits list "reclaim"),
the leases held when the connection is lost (a crash, a takeover) are kept:
a thread of the client reconnects at once and, before any other request,
re-asserts each one to the successor with the copy's memfds (which the
client keeps open for this: ``reclaim=True`` in :func:`connect`). An adopted
lease goes on as before (same ``lease_id``, same mapping; an idle one stays
idle); a refused one keeps its mapping while its lease objects and views
live, is never released, and the next acquire of its model asks the daemon.
:meth:`Client.reclaims` counts what happened.

Delegation: warm acquires without a round trip, an honest budget. A process
maps a copy once. An acquire of a model this process already holds (a lease
or a view of it is alive, on any thread) is local: no message to the
daemon, the same mapping, the same ``lease_id``, and ``load`` is "local".
When the last lease object and view of a copy end, the client keeps the
lease, mapped, for ``keep_idle`` seconds (:func:`connect`) and tells the
daemon it is idle: the daemon then counts the copy as evictable, so the
node's budget is not held by a model nobody uses. The next acquire of it
revives it locally. When the daemon needs the room, it recalls the idle
lease: a thread of the client unmaps it and answers "release" (or "busy"
when an acquire took it back meanwhile), and the next acquire is a round
trip again. So a server acquires and releases per request, and pays a round
trip only when the model was evicted. :meth:`Client.idle_leases` counts
the leases kept idle; ``keep_idle=0`` releases a lease when its last lease
object or view ends. A lost connection (a daemon restart) drops every idle
lease, unless it waits to be reclaimed (above); leases in use keep their
mapping. A lease waiting to be reclaimed stays mapped whatever
``keep_idle`` says, and one whose last lease object ends meanwhile is kept
idle (``keep_idle=0`` too), so :meth:`Client.acquire_local` serves it while
the daemon is away; ``keep_idle`` applies again once it is reclaimed.

fork(). A child starts with no connection and no lease: every lease object
it inherits reads as released (taking a view raises), and its first call on
a client connects afresh. The parent's copies are not mapped in the child
(they are mapped with MADV_DONTFORK): an array or tensor the child inherits
over one must not be read there.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union, overload

from . import _args, _core
from ._lease import _Releasable
from .errors import DaemonUnavailableError, FailedPreconditionError

if TYPE_CHECKING:  # pragma: no cover
    import datetime

    import numpy as _np
    import torch as _torch

__all__ = [
    "Client",
    "DaemonUnavailableError",
    "RemoteLease",
    "connect",
]

#: A timeout: None (the protocol's longest, a day), seconds, or a timedelta.
Timeout = Union[None, float, int, "datetime.timedelta"]
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

# Every live lease object, so that a forked child can hollow them out.
_live_leases: "weakref.WeakSet[RemoteLease]" = weakref.WeakSet()
_live_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child, and it holds the GIL: no
    # lease call is in progress here. Dropping the extension's shares does
    # nothing in a child (the C++ client leaves the parent's leases alone).
    global _live_lock
    _live_lock = threading.Lock()
    for lease in list(_live_leases):
        lease._forked = True
        lease._lease.release()
    _live_leases.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class RemoteLease(_Releasable):
    """A lease on a model's copy held by the daemon, mapped read-only.

    A context manager: ``with client.acquire(model) as lease:`` releases it
    at the end of the block. Views (:meth:`numpy`, :meth:`torch`,
    :meth:`raw`) keep the mapping, and so the lease, alive on their own and
    stay valid after :meth:`release`. After :meth:`release`, taking a new
    view raises :class:`~modelcache.errors.FailedPreconditionError`.
    """

    __slots__ = ("_forked", "_cuda", "__weakref__")

    def __init__(self, lease: Any) -> None:
        """Internal: leases come from :meth:`Client.acquire`."""
        super().__init__(lease)
        self._forked = False
        self._cuda: Optional[List[Tuple[int, int]]] = None
        with _live_lock:
            _live_leases.add(self)

    @property
    def model(self) -> str:
        """The model's id (an alias given to acquire resolves to it)."""
        return self._lease.model

    @property
    def lease_id(self) -> int:
        """The daemon's lease id (never reused, even by a restarted daemon).
        Local acquires of a copy this process holds share it."""
        return self._lease.lease

    @property
    def load(self) -> str:
        """How the copy was found: "local" (this process held it, in use or
        idle: no round trip), or as the daemon says: "hit" (resident),
        "miss" (this acquire started its load) or "joined" (it waited for a
        load already under way)."""
        return self._lease.load

    @property
    def bytes(self) -> int:
        """The data bytes of every file of the model together."""
        return self._lease.bytes

    @property
    def wait_seconds(self) -> float:
        """How long the acquire took, connecting and waiting included."""
        return self._lease.wait_seconds

    def files(self) -> List[Tuple[str, int]]:
        """(``"<model>/<file>"``, data bytes) of each file, in the
        catalog's order."""
        return self._checked().files()

    def names(self) -> List[str]:
        """Every tensor name, in file order then data order."""
        return self._checked().names()

    def tensors(self) -> Dict[str, Dict[str, Any]]:
        """name -> {"dtype", "shape", "file"} (when two files hold one
        name, the first file's)."""
        return self._checked().tensors()

    @overload
    def numpy(self) -> Dict[str, "_np.ndarray"]: ...
    @overload
    def numpy(self, name: str) -> "_np.ndarray": ...

    def numpy(self, name: Optional[str] = None) -> Any:
        """Read-only, zero-copy numpy views: a dict name -> array of every
        tensor, or the one array ``name``.

        Each array's ``base`` holds the mapping. numpy has no bfloat16 or
        float8: those raise InvalidArgumentError (use :meth:`torch`, or
        :meth:`raw`).

        Raises:
            modelcache.errors.NotFoundError: no tensor ``name``.
        """
        lease = self._checked()
        if name is not None:
            return lease.numpy(_args.string(name, "name"))
        return {n: lease.numpy(n) for n in lease.names()}

    def raw(self, name: str) -> "_np.ndarray":
        """The bytes of tensor ``name`` as a read-only 1-D uint8 array."""
        return self._checked().raw(_args.string(name, "name"))

    @overload
    def torch(self, *, copy: bool = False) -> Dict[str, "_torch.Tensor"]: ...
    @overload
    def torch(self, name: str, *, copy: bool = False) -> "_torch.Tensor": ...

    def torch(self, name: Optional[str] = None, *, copy: bool = False) -> Any:
        """CPU torch tensors: a dict name -> tensor of every tensor, or the
        one tensor ``name``.

        ``copy=False``: zero-copy views through DLPack, each holding the
        mapping until torch frees it. They must not be written to: the
        mapping is read-only and a write kills the process with SIGSEGV.
        ``copy=True``: tensors the caller owns (writable, nothing shared).
        Supported dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL.
        """
        if name is not None:
            _args.string(name, "name")
        _args.boolean(copy, "copy")
        lease = self._checked()
        names = [name] if name is not None else lease.names()
        out = {n: self._one_tensor(lease, n, copy) for n in names}
        return out[name] if name is not None else out

    @staticmethod
    def _one_tensor(lease: Any, name: str, copy: bool) -> "_torch.Tensor":
        import torch
        from torch.utils import dlpack

        capsule, dtype = lease.dlpack(name)
        tensor = dlpack.from_dlpack(capsule)
        if dtype == "BOOL":  # exported as U8: torch 1.13's DLPack lacks bool
            tensor = tensor.view(torch.bool)
        return tensor.clone() if copy else tensor

    def register_cuda(self) -> Optional[str]:
        """Page-locks the mapping (``cudaHostRegister``, read-only flag) so
        that host-to-device copies from it run at full speed.

        Returns None once registered (also when it already was), or the
        reason it was skipped: no usable GPU, or a device that cannot
        register read-only memory. The pages are unregistered just before
        the copy is unmapped (after :meth:`release` and the last view).
        """
        lease = self._checked()
        if self._cuda is not None:
            return None
        try:
            import torch
        except ImportError:
            return "torch is not installed"
        if not torch.cuda.is_available():
            return "no usable CUDA device (torch.cuda.is_available() is False)"
        cudart = torch.cuda.cudart()
        # cudaHostRegisterReadOnly: the mapping is PROT_READ.
        read_only = 0x08
        registered: List[Tuple[int, int]] = []
        for address, size in lease.regions():
            if size == 0:
                continue
            status = cudart.cudaHostRegister(address, size, read_only)
            if int(status) != 0:
                for a, _ in registered:
                    cudart.cudaHostUnregister(a)
                return (f"cudaHostRegister of {size} read-only bytes failed "
                        f"(cudaError {int(status)}); the device may not "
                        "support registering read-only memory")
            registered.append((address, size))

        def unregister(regions: List[Tuple[int, int]] = registered) -> None:
            for a, _ in regions:
                cudart.cudaHostUnregister(a)

        lease.set_before_unmap(unregister)
        self._cuda = registered
        return None

    @property
    def cuda_registered(self) -> bool:
        """Whether :meth:`register_cuda` page-locked the mapping."""
        return self._cuda is not None

    def _checked(self) -> Any:
        if self._forked:
            raise FailedPreconditionError(
                "this lease belongs to the parent process (fork): acquire "
                "again in the child")
        return self._lease

    def __repr__(self) -> str:
        state = " released" if self.released else ""
        return (f"<modelcache.serve.RemoteLease {self.model!r} "
                f"lease={self.lease_id} bytes={self.bytes}{state}>")


class Client:
    """A connection to ``modelcache serve``; see :func:`connect`.

    Usable from any number of threads at once. The connection stays open
    while leases of this client exist; :meth:`close` closes it at once.
    """

    __slots__ = ("_client", "__weakref__")

    def __init__(self, client: Any) -> None:
        """Internal: clients come from :func:`connect`."""
        self._client = client

    @property
    def socket_path(self) -> str:
        """The daemon's socket."""
        return self._client.socket_path

    def acquire(self, model: str, *, timeout: Timeout = 60.0,
                when_full: str = "wait") -> RemoteLease:
        """A lease on ``model`` (an id or alias of the daemon's catalog),
        loading it if no copy is resident. The GIL is released while it
        waits; Ctrl-C (on the main thread) ends the wait.

        When this process already holds the model (in use, or kept idle
        after its last use), the acquire is local: no round trip, the same
        mapping and lease id, ``load`` "local" (see the module docstring).

        Args:
            model: the catalog's id or alias.
            timeout: bounds the whole call: reconnecting, waiting for the
                load, for room. None: a day, the protocol's longest.
            when_full: what a load this acquire starts does when nothing can
                be evicted: "wait" for room until ``timeout``, or "fail" at
                once with CapacityError.

        Raises:
            modelcache.errors.NotFoundError, TooLargeError, CapacityError,
            TimeoutError, LoadError, UnavailableError (BUSY, or the
            model's files unavailable), InvalidArgumentError,
            DaemonUnavailableError; see the module docstring.
        """
        return RemoteLease(self._client.acquire(
            _args.string(model, "model"), _args.timeout(timeout),
            _args.choice(when_full, "when_full", ("fail", "wait"))))

    def acquire_local(self, model: str) -> Optional[RemoteLease]:
        """The :meth:`acquire` of ``model`` only where it is local: this
        process holds the model under that name (in use, kept idle, or
        waiting to be reclaimed after the daemon went away), so it takes
        another reference with no message (``load`` "local"). Otherwise
        None, having sent nothing.

        It never waits for the daemon or for I/O, so it answers at once
        while the daemon is down: a server can serve the models its
        process maps through an outage, and answer the others as it
        chooses (see examples/python/node_server).
        """
        lease = self._client.acquire_local(_args.string(model, "model"))
        return None if lease is None else RemoteLease(lease)

    def ping(self, timeout: Timeout = 5.0) -> None:
        """A round trip to the daemon (connecting if needed). Raises
        DaemonUnavailableError when it cannot be reached in time."""
        self._client.ping(_args.timeout(timeout))

    def info(self) -> Dict[str, Any]:
        """What the daemon said when the connection was made:
        {"server", "version", "limits"}."""
        return self._client.info()

    def idle_leases(self) -> int:
        """How many leases this client keeps idle now: mapped, used by no
        lease object or view, revived by the next acquire of their model,
        and released when the daemon recalls them or ``keep_idle`` passes."""
        return self._client.idle_leases()

    def reclaims(self) -> Dict[str, int]:
        """What became of the leases of lost connections, since the client
        was made: ``reclaimed`` (adopted by a successor daemon),
        ``reclaim_refused`` (the successor refused them: they were gone),
        ``reclaim_unsupported`` (the successor does not reclaim), and
        ``pending`` (waiting now for a connection to be reclaimed on)."""
        return self._client.reclaims()

    def close(self) -> None:
        """Closes the connection now. Leases whose copies this process still
        maps (through views) stay orphaned in the daemon until they are
        unmapped or the process exits; the others end. The next call
        connects again."""
        self._client.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<modelcache.serve.Client {self.socket_path!r}>"


#: How long an idle lease is kept: seconds (>= 0) or a timedelta.
KeepIdle = Union[float, int, "datetime.timedelta"]


def connect(socket_path: PathLike, *, connect_timeout: Timeout = 0,
            keep_idle: KeepIdle = 60.0, idle_notice_delay: KeepIdle = 0.001,
            reclaim: bool = True) -> Client:
    """Connects to the daemon listening at ``socket_path``.

    Args:
        socket_path: the daemon's socket (``--socket``).
        connect_timeout: how long to keep trying (with backoff) while the
            daemon is not there yet; 0 tries once.
        keep_idle: how long (seconds, or a timedelta) a lease that no lease
            object or view uses any more is kept, mapped, so that the next
            acquire of its model is local; the daemon may recall it sooner
            when it needs the room. 0 releases a lease when its last lease
            object or view ends (every acquire is then a round trip, unless
            another one of the same model is alive). With a daemon that
            cannot recall leases, leases are never kept idle. A lease
            waiting to be reclaimed is kept whatever this says.
        idle_notice_delay: how soon (seconds, or a timedelta) after a
            lease goes idle the daemon is told (one message, no reply
            awaited), so that it counts the copy as evictable; until then
            it counts it as in use, and an acquire within the delay revives
            the lease with no message at all. Likewise a lease told idle
            and revived is told "use" once it has been used this long
            (looked at every 100 ms at least). Longer: fewer messages for
            models in steady use, and the budget learns of idle leases
            later. 0: the release itself sends the notice, and wakes the
            client's thread only when it is not due to look within 100 ms.
        reclaim: keep each copy's memfds open (two per file) so that the
            leases held survive a daemon's crash or takeover (see the module
            docstring); False closes them once mapped, and leases held
            when the connection is lost are never reclaimed.

    Raises:
        modelcache.errors.DaemonUnavailableError: nobody answers there.
        modelcache.errors.UnavailableError: the daemon's client limit
            (BUSY).
        modelcache.errors.InvalidArgumentError: this peer is not allowed,
            or the daemon speaks another version.
    """
    return Client(_core._ServeClient.connect(
        _args.path(socket_path, "socket_path"),
        _args.timeout(connect_timeout, "connect_timeout"),
        _args.seconds(keep_idle, "keep_idle"),
        _args.seconds(idle_notice_delay, "idle_notice_delay"),
        _args.boolean(reclaim, "reclaim")))
