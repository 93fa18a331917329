#!/usr/bin/env bash
# Installs every Debian package the build, tests and benchmarks need.
# Idempotent: packages already present are skipped, and apt-get runs only
# when something is missing.
set -euo pipefail

packages=(
  cmake ninja-build make g++ clang libclang-rt-14-dev pkgconf
  libgtest-dev libgmock-dev libbenchmark-dev librapidcheck-dev
  nlohmann-json3-dev libcli11-dev
  libabsl-dev
  # Compressed traces: gzip (zlib) and zstd.
  zlib1g-dev libzstd-dev
  librocksdb-dev libleveldb-dev
  python3-dev pybind11-dev python3-pytest python3-numpy python3-torch
  # `pip install .` of the Python package (pyproject.toml, setup.py) and its
  # test: setuptools and wheel build it, venv (with ensurepip's pip) installs
  # it, offline (--no-build-isolation --no-index).
  python3-setuptools python3-wheel python3-venv python3-pip
  # HAProxy 2.6, whose hash ring tests/replay/haproxy_ring_test.cc runs
  # (Debian's own configuration defines no frontend, so its service listens
  # on nothing).
  haproxy
  # cpp-httplib serves `modelcache serve`'s HTTP API; promtool (from
  # prometheus) checks its metrics in a test.
  libcpp-httplib-dev prometheus
  # The multi-worker example server (examples/python/node_server/) and its
  # tests: FastAPI on uvicorn, run with --workers N under gunicorn, whose
  # arbiter restarts a worker that dies.
  python3-fastapi python3-uvicorn gunicorn
  # Headless Chromium, to look at replay's HTML report as docs/replay.md
  # describes it (chromium --headless --no-sandbox --screenshot=FILE.png
  # file://REPORT.html).
  chromium
  # bench/stream_billion.sh: the zstd command and GNU time (peak RSS).
  zstd time
  # Profiling and benchmark tooling docs/benchmarks.md uses: perf (perf
  # record) and valgrind (callgrind's instruction counts, which a noisy
  # machine does not change); ccache, which setup.py's CMake build of the
  # Python extension uses when it is installed.
  linux-perf valgrind ccache
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
