"""The example's models: small torch MLPs whose weights live in safetensors
files that `modelcache serve` hands out, and the catalog naming them.

    /usr/bin/python3 examples/python/node_server/models.py /tmp/mc-node
    # writes /tmp/mc-node/models/m0.safetensors ... and /tmp/mc-node/catalog.json
    /usr/bin/python3 examples/python/node_server/models.py /tmp/mc-node --count 32
    # a catalog of 32 small models c0 ... c31 instead (the cluster's, below)

The same module builds the network a worker runs on the daemon's tensors
(`bind`, `run`), so that the tests and the benchmark compare against exactly
what the server computes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Mapping

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
    it at once (unlike swapping parameters in per call, as
    torch.func.functional_call does, which races between threads)."""
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
    header, offset = {}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t).tobytes())
    return offset


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
