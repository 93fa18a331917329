"""setuptools' side of `pip install .` (pyproject.toml holds the metadata).

The extension modelcache._core is built by the project's CMake build, not by
setuptools' compiler: build_ext configures a CMake tree of its own for the
running interpreter (Python_EXECUTABLE = sys.executable) and builds the one
target modelcache_python, with the layer libraries it links, then copies the
module where setuptools packs it. The wheel holds the package's .py files,
the module, the .pyi stubs and py.typed.

Environment:
  MODELCACHE_CMAKE_BUILD_DIR  a CMake tree to build the target in instead of
      one under setuptools' build folder: an existing one (the release
      build, `build/`) builds nothing it has built already. It must have
      been configured for an interpreter of this one's ABI (checked).
  CMAKE_CXX_COMPILER_LAUNCHER  passed on when configuring (ccache);
      ccache is used by default when it is installed.
  CMAKE_BUILD_PARALLEL_LEVEL  compile jobs (default: the CPU count).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# setuptools' own build folder: inside the repository's ignored build/,
# apart from the CMake release tree that build/ is.
BUILD_BASE = Path("build") / "python-setuptools"


def _project_version() -> str:
    """The version in CMakeLists.txt's project(): the only place it is set."""
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"^project\(modelcache VERSION ([0-9.]+)\b", text, re.M)
    if not m:
        sys.exit("setup.py: CMakeLists.txt has no project(modelcache VERSION ...)")
    return m.group(1)


class CMakeExtension(Extension):
    """An extension CMake builds: no sources for setuptools to compile."""

    def __init__(self, name: str, target: str) -> None:
        super().__init__(name, sources=[])
        self.target = target


def _cache_value(build_dir: Path, name: str) -> str:
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return ""
    for line in cache.read_text(errors="replace").splitlines():
        m = re.match(rf"{re.escape(name)}(?::[A-Z]+)?=(.*)$", line)
        if m:
            return m.group(1)
    return ""


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        given = os.environ.get("MODELCACHE_CMAKE_BUILD_DIR")
        build_dir = Path(given).resolve() if given else (
            Path(self.build_temp).resolve() / "cmake")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if given:
            self._check_tree(build_dir, suffix)
        else:
            self._configure(build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(build_dir), "--target",
                        ext.target, "-j", jobs], check=True)
        built = build_dir / "python" / "modelcache" / ("_core" + suffix)
        if not built.is_file():
            sys.exit(f"setup.py: the CMake build made no {built}: was the "
                     f"tree configured for {sys.executable}?")
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, out)

    @staticmethod
    def _configure(build_dir: Path) -> None:
        args = ["cmake", "-S", str(ROOT), "-B", str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DPython_EXECUTABLE={sys.executable}",
                "-DMODELCACHE_BUILD_PYTHON=ON",
                "-DMODELCACHE_BUILD_TESTS=OFF",
                "-DMODELCACHE_BUILD_BENCH=OFF",
                "-DMODELCACHE_BUILD_CUDA_BENCH=OFF"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        launcher = os.environ.get("CMAKE_CXX_COMPILER_LAUNCHER") or (
            "ccache" if shutil.which("ccache") else "")
        if launcher:
            args += [f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}",
                     f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}"]
        subprocess.run(args, check=True)

    @staticmethod
    def _check_tree(build_dir: Path, suffix: str) -> None:
        if not (build_dir / "CMakeCache.txt").is_file():
            sys.exit(f"setup.py: MODELCACHE_CMAKE_BUILD_DIR={build_dir} is not "
                     "a configured CMake tree")
        # FindPython's cache entry; Python_EXECUTABLE itself is cached only
        # when given on the command line.
        configured = (_cache_value(build_dir, "Python_EXECUTABLE") or
                      _cache_value(build_dir, "_Python_EXECUTABLE"))
        probe = subprocess.run(
            [configured, "-c",
             "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
            capture_output=True, text=True) if configured else None
        if probe is None or probe.returncode != 0 or probe.stdout.strip() != suffix:
            sys.exit(f"setup.py: {build_dir} builds for {configured or 'no Python'}, "
                     f"whose extension modules do not load in {sys.executable} "
                     f"(needs {suffix})")


BUILD_BASE.mkdir(parents=True, exist_ok=True)
setup(
    version=_project_version(),
    ext_modules=[CMakeExtension("modelcache._core", target="modelcache_python")],
    cmdclass={"build_ext": CMakeBuild},
    options={
        "build": {"build_base": str(BUILD_BASE)},
        "egg_info": {"egg_base": str(BUILD_BASE)},
    },
)
