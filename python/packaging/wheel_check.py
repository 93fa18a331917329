"""The package as a Python user installs it: `pip wheel` from the repository
root into a temporary folder, `pip install` of that wheel into a fresh venv
(--system-site-packages, for Debian's numpy and torch), a smoke test run by
the venv's interpreter from outside the source tree (a cache, a weights
view, modelcache.serve against a daemon), then `pip uninstall` and a check
that nothing of the package is left in the venv.

    wheel_check.py <repository root> <CMake build folder> [--fresh]

The wheel is built in the given CMake tree (MODELCACHE_CMAKE_BUILD_DIR; the
release build, where the extension is built already), so the check costs
seconds, not a build. With --fresh, setup.py configures and builds a tree of
its own, as a plain `pip install .` does (minutes). No network: --no-build-isolation, --no-index. The
daemon (`modelcache serve`, <build>/bin/modelcache) is stopped by pid, as
every test here stops what it started. Exit status 0 when every step holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SMOKE = r'''
import json, os, sys, sysconfig
from pathlib import Path

import numpy as np

import modelcache
import modelcache.serve
import modelcache.weights

site = Path(sysconfig.get_paths()["purelib"]).resolve()
package = Path(modelcache.__file__).resolve().parent
assert package.parent == site, (package, site)
assert Path.cwd().resolve() != Path(os.environ["REPO_ROOT"]).resolve()
assert (package / "_core.pyi").is_file() and (package / "py.typed").is_file()
print("modelcache", modelcache.__version__, "from", package)

# A cache, its budget given as the CLI writes sizes.
cache = modelcache.Cache(capacity_bytes="1MiB")
assert cache.budget.capacity == 1 << 20
with cache.acquire("m", lambda: modelcache.Loaded("model", 1000), "4KiB") as m:
    assert m == "model"
assert cache.stats().loads == 1

# A zero-copy weights view of a file written here.
sys.path.append(os.environ["TESTS_DIR"])  # serve_util: after the package
from serve_util import Daemon, random_model, write_catalog, write_safetensors

tmp = Path.cwd()
root = tmp / "models"
root.mkdir()
tensors = random_model(3)
write_safetensors(root / "a.safetensors", tensors)
store = modelcache.weights.HostWeightStore(capacity_bytes="4MiB")
with store.acquire(root / "a.safetensors") as lease:
    view = lease.numpy("weight")
    assert not view.flags.writeable
    np.testing.assert_array_equal(view, tensors["weight"])

# modelcache.serve against `modelcache serve`.
write_catalog(tmp / "catalog.json", [{"id": "a", "files": ["a.safetensors"]}])
daemon = Daemon(tmp, tmp / "catalog.json", root).start()
try:
    with modelcache.serve.connect(daemon.socket) as client:
        with client.acquire("a", timeout=30) as remote:
            np.testing.assert_array_equal(remote.numpy("bias"), tensors["bias"])
finally:
    daemon.stop()
print("smoke test passed")
'''


def run(args, **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(str(a) for a in args), flush=True)
    return subprocess.run([str(a) for a in args], check=True, **kwargs)


def main() -> int:
    repo, build = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    with tempfile.TemporaryDirectory(prefix="modelcache-wheel-") as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ)
        if "--fresh" not in sys.argv[3:]:
            env["MODELCACHE_CMAKE_BUILD_DIR"] = str(build)
        env.pop("PYTHONPATH", None)  # the package comes from the venv only
        run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation",
             "--no-deps", "--no-index", "--wheel-dir", tmp / "dist", repo],
            env=env, cwd=tmp)
        wheels = list((tmp / "dist").glob("modelcache-*.whl"))
        assert len(wheels) == 1, wheels

        venv = tmp / "venv"
        run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", venv],
            env=env, cwd=tmp)
        python = venv / "bin" / "python"
        # Without --no-deps: numpy has to be found (in the system's site).
        run([python, "-m", "pip", "install", "--no-index",
             "--disable-pip-version-check", wheels[0]], env=env, cwd=tmp)
        requires = subprocess.run(
            [python, "-c", "import importlib.metadata as m; "
             "print('\\n'.join(m.requires('modelcache')))"],
            check=True, capture_output=True, text=True, env=env, cwd=tmp).stdout
        assert "numpy" in requires.splitlines(), requires
        assert any(r.replace(" ", "").replace('"', "'") == "torch;extra=='torch'"
                   for r in requires.splitlines()), requires

        work = tmp / "smoke"
        work.mkdir()
        smoke_env = dict(env, REPO_ROOT=str(repo),
                         TESTS_DIR=str(repo / "python" / "tests"),
                         MODELCACHE_BUILD_DIR=str(build))
        (work / "smoke.py").write_text(SMOKE)
        run([python, "-X", "dev", "smoke.py"], env=smoke_env, cwd=work)

        site = Path(subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, cwd=tmp).stdout.strip())
        installed = sorted(p.name for p in site.glob("modelcache*"))
        assert installed, f"nothing of modelcache in {site}"
        run([python, "-m", "pip", "uninstall", "--yes", "modelcache"],
            env=env, cwd=tmp)
        left = sorted(str(p) for p in site.glob("modelcache*"))
        assert not left, f"pip uninstall left {left}"
        gone = subprocess.run([python, "-c", "import modelcache"], env=env,
                              cwd=work, capture_output=True, text=True)
        assert gone.returncode != 0 and "ModuleNotFoundError" in gone.stderr, (
            gone.returncode, gone.stderr)
        print("wheel check passed: built, installed", installed,
              "smoke-tested, uninstalled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
