"""The example's models: small torch MLPs whose weights live in safetensors
files that `modelcache serve` hands out, and the catalog naming them.

    PYTHONPATH=build/python /usr/bin/python3 examples/python/node_server/models.py /tmp/mc-node
    # writes /tmp/mc-node/models/m0.safetensors ... and /tmp/mc-node/catalog.json
    PYTHONPATH=build/python /usr/bin/python3 examples/python/node_server/models.py \
        /tmp/mc-node --count 32
    # a catalog of 32 small models c0 ... c31 instead (the cluster's, below)

The same module builds the network a worker runs on the daemon's tensors
(`bound` per request, `bind` for a module of its own; `run`), so that the
tests and the benchmark compare against exactly what the server computes.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Tuple

import numpy as np
import torch

#: Model id -> (input width, hidden width, output width).
SHAPES: Dict[str, tuple] = {
    "m0": (512, 1024, 128),    #  2.6 MB
    "m1": (512, 2048, 128),    #  5.3 MB
    "m2": (1024, 2048, 256),   # 10.5 MB
    "m3": (1024, 4096, 256),   # 21.0 MB
    "m4": (2048, 4096, 512),   # 42.0 MB
}

#: The input width of every model of `family` (the loopback cluster's).
FAMILY_INPUT = 64


def family(count: int) -> Dict[str, tuple]:
    """A catalog of `count` small models, c0 ... c<count-1>, for the loopback
    cluster (examples/cluster): one input width (FAMILY_INPUT), so a client
    sends the same input to every model, and five sizes from 1.3 to 6.6 MB,
    so loads take different times."""
    return {f"c{i}": (FAMILY_INPUT, 4096 * (1 + (7 * i) % 5), 16)
            for i in range(count)}


def shape(tensors: Mapping[str, "torch.Tensor | np.ndarray"]) -> tuple:
    """(input width, hidden width, output width) of a model's tensors."""
    hidden, d_in = tensors["0.weight"].shape
    d_out = tensors["2.weight"].shape[0]
    return int(d_in), int(hidden), int(d_out)


def bind(model_id: str, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The model as a torch module whose parameters *are* `tensors` (name ->
    tensor, the state dict's names), not copies: the module is built on the
    meta device (no memory of its own) and each parameter wraps its tensor's
    storage. Given the daemon's zero-copy tensors, the module runs directly
    on the shared read-only mapping.

    torch cannot mark a tensor read-only: anything that writes a parameter
    (an optimizer step, ``load_state_dict``, an in-place op on a weight)
    would write to the mapping and kill the process with SIGSEGV (the
    daemon's memfd is sealed, so no other process could be affected).
    Inference never writes one. A module that must own writable parameters
    takes ``lease.torch(copy=True)`` instead.

    The module is never changed after this, so any number of threads may run
    it at once (unlike swapping parameters in per call on a shared module,
    as torch.func.functional_call does, which races between threads; `bound`
    swaps them on a module of the calling thread's own). It costs a module
    per call, and it holds the mapping for as long as it lives: a server
    that binds per request pays that on every request (`bound` does not)."""
    if "0.weight" not in tensors or "2.weight" not in tensors:
        raise ValueError(f"{model_id}: tensors {sorted(tensors)} are not "
                         "this example's two-layer network")
    d_in, hidden, d_out = shape(tensors)
    net = torch.nn.Sequential(
        torch.nn.Linear(d_in, hidden, device="meta"), torch.nn.ReLU(),
        torch.nn.Linear(hidden, d_out, device="meta"))
    expected = set(dict(net.named_parameters()))
    if set(tensors) != expected:
        raise ValueError(f"{model_id}: tensors {sorted(tensors)}, "
                         f"the module needs {sorted(expected)}")
    for name, tensor in tensors.items():
        owner, attr = name.rsplit(".", 1)
        setattr(net.get_submodule(owner), attr,
                torch.nn.Parameter(tensor, requires_grad=False))
    return net.eval()


# This thread's modules, by shape: built once on the meta device, given a
# request's tensors only inside `bound`.
_threads = threading.local()


class _Template:
    """A module with no memory of its own and where each parameter lives:
    (state dict name, the owning module's parameter dict, attribute, the
    meta tensor put back after each use)."""

    __slots__ = ("net", "slots", "names", "in_use")

    def __init__(self, d_in: int, hidden: int, d_out: int) -> None:
        self.net = torch.nn.Sequential(
            torch.nn.Linear(d_in, hidden, device="meta"), torch.nn.ReLU(),
            torch.nn.Linear(hidden, d_out, device="meta")).eval()
        self.slots: List[Tuple[str, dict, str, torch.Tensor]] = []
        for name, meta in self.net.named_parameters():
            owner, attr = name.rsplit(".", 1)
            meta.requires_grad_(False)
            self.slots.append(
                (name, self.net.get_submodule(owner)._parameters, attr, meta))
        self.names = frozenset(name for name, *_ in self.slots)
        self.in_use = False


@contextlib.contextmanager
def bound(model_id: str, tensors: Mapping[str, torch.Tensor]
          ) -> Iterator[torch.nn.Module]:
    """The model as a torch module running on `tensors` (name -> tensor,
    zero-copy) for the block: what `bind` gives, at a per-request cost of
    microseconds instead of building a module.

    Each thread builds one module per shape on the meta device, once; the
    block puts `tensors` in as its parameters and the meta tensors back at
    its end. So outside a block the module holds no view of a lease's
    mapping: a server that acquires and releases per request keeps its
    leases idle between requests (evictable, recallable), and builds
    nothing per request. Thread-safe because no two threads share a module;
    blocks of one shape do not nest on a thread (ValueError). The module
    must not be kept past the block."""
    if "0.weight" not in tensors or "2.weight" not in tensors:
        raise ValueError(f"{model_id}: tensors {sorted(tensors)} are not "
                         "this example's two-layer network")
    key = shape(tensors)
    templates = _threads.__dict__.setdefault("templates", {})
    template = templates.get(key)
    if template is None:
        template = templates[key] = _Template(*key)
    if set(tensors) != template.names:
        raise ValueError(f"{model_id}: tensors {sorted(tensors)}, "
                         f"the module needs {sorted(template.names)}")
    if template.in_use:
        raise ValueError(f"{model_id}: a module of shape {key} is already "
                         "bound on this thread")
    template.in_use = True
    try:
        for name, params, attr, _ in template.slots:
            params[attr] = tensors[name]
        yield template.net
    finally:
        for _, params, attr, meta in template.slots:
            params[attr] = meta
        template.in_use = False


def run(net: torch.nn.Module, inputs: List[List[float]]) -> List[List[float]]:
    """The module on a batch of inputs, in inference mode."""
    x = torch.tensor(inputs, dtype=torch.float32)
    with torch.inference_mode():
        return net(x).tolist()


def weights(model_id: str, shape_: "tuple | None" = None
            ) -> Dict[str, np.ndarray]:
    """The model's weights (of shape `shape_`, by default its entry in
    SHAPES), from a seed derived from its id."""
    d_in, hidden, d_out = shape_ or SHAPES[model_id]
    rng = np.random.default_rng(int(model_id[1:]) + 1000)
    scale_in, scale_hidden = 1 / np.sqrt(d_in), 1 / np.sqrt(hidden)
    return {
        "0.weight": (rng.standard_normal((hidden, d_in)) * scale_in).astype(np.float32),
        "0.bias": (rng.standard_normal(hidden) * 0.1).astype(np.float32),
        "2.weight": (rng.standard_normal((d_out, hidden)) * scale_hidden).astype(np.float32),
        "2.bias": (rng.standard_normal(d_out) * 0.1).astype(np.float32),
    }


def write_safetensors(path: Path, tensors: Mapping[str, np.ndarray]) -> int:
    """Writes `tensors` with modelcache's writer; returns the data bytes.
    (Imported here: the rest of the module, the networks, needs no
    modelcache.)"""
    from modelcache.weights import save_file

    save_file(tensors, path)
    return sum(t.nbytes for t in tensors.values())


def write_node(folder: Path, shapes: "Mapping[str, tuple] | None" = None
               ) -> int:
    """Writes every model of `shapes` (by default SHAPES) and the catalog
    under `folder`; returns the models' data bytes together."""
    shapes = SHAPES if shapes is None else shapes
    models = folder / "models"
    models.mkdir(parents=True, exist_ok=True)
    total = 0
    for model_id, shape_ in shapes.items():
        total += write_safetensors(models / f"{model_id}.safetensors",
                                   weights(model_id, shape_))
    catalog = {"models": [{"id": m, "files": [f"{m}.safetensors"]}
                          for m in shapes]}
    (folder / "catalog.json").write_text(json.dumps(catalog, indent=1))
    return total


if __name__ == "__main__":
    args = sys.argv[1:]
    count = None
    if len(args) == 3 and args[1] == "--count" and args[2].isdigit():
        count = int(args[2])
        args = args[:1]
    if len(args) != 1 or count == 0:
        sys.exit("usage: models.py FOLDER [--count N]")
    chosen = SHAPES if count is None else family(count)
    total = write_node(Path(args[0]), chosen)
    print(f"{len(chosen)} models, {total} bytes, catalog "
          f"{Path(args[0]) / 'catalog.json'}")
