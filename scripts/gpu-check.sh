#!/usr/bin/env bash
# The one prepared check for a machine with an NVIDIA GPU and the CUDA
# toolkit: builds the release tree there (a binary built elsewhere may need a
# newer driver), runs the GPU suites with MODELCACHE_REQUIRE_GPU=1 (a GPU test
# that would skip fails instead), then the Python CUDA tests, then the
# transfer benchmark (a 4 GiB model placed through the runtime, beside
# cudaMemcpy from pinned and from pageable memory). Writes one JSON summary
# and prints a ten-line report. Meant to finish within 8 minutes on one GPU;
# every step runs under a timeout taken from that budget, and what could not
# run is named.
#
#   scripts/gpu-check.sh [--out DIR] [--build-dir DIR] [--deps DIR]
#                        [--budget SECONDS]
#   scripts/gpu-check.sh --download-deps DIR
#
#   --out DIR        where summary.json, report.txt and the logs go
#                    (default: <build-dir>/results)
#   --build-dir DIR  the build tree (default: build/gpu-check)
#   --deps DIR       a folder of Debian packages (.deb) holding the build's
#                    dependencies, for a GPU machine without a package
#                    manager: they are unpacked into the build tree and found
#                    there. --download-deps DIR fills such a folder (run it
#                    where apt works).
#   --budget SECONDS the time budget (default 480)
#
# Exit status: 0 when everything ran and passed; 1 when anything failed or
# could not run; 2 when no GPU is there at all (nvidia-smi lists none).
#
# Environment: PYTHON (default python3: the interpreter whose numpy, torch
# and pytest the Python tests use), NVIDIA_SMI (default nvidia-smi),
# GPU_CHECK_BENCH_BYTES (default 4 GiB). GPU_CHECK_SKIP_BUILD=1 uses
# --build-dir as it is, for testing this script's logic
# (tests/device/gpu_check_script_test.sh).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD="$ROOT/build/gpu-check"
OUT=""
DEPS=""
BUDGET=480
PYTHON=${PYTHON:-python3}
NVIDIA_SMI=${NVIDIA_SMI:-nvidia-smi}
BENCH_BYTES=${GPU_CHECK_BENCH_BYTES:-4294967296}
SKIP_BUILD=${GPU_CHECK_SKIP_BUILD:-0}
# The GPU suites (tests/device/CMakeLists.txt): the binaries built and run.
GPU_SUITES=(cuda_device_test cuda_runtime_test)
# What the build needs beyond a compiler, CMake and the CUDA toolkit
# (pybind11 comes from $PYTHON's own package when it has one).
DEB_PACKAGES=(libabsl-dev libabsl20220623 libgtest-dev libgmock-dev
  librapidcheck-dev nlohmann-json3-dev libcli11-dev pybind11-dev)

die_usage() {
  echo "gpu-check: $1" >&2
  sed -n '12,24p' "${BASH_SOURCE[0]}" >&2
  exit 64
}

while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?}; shift 2 ;;
    --build-dir) BUILD=${2:?}; shift 2 ;;
    --deps) DEPS=${2:?}; shift 2 ;;
    --budget) BUDGET=${2:?}; shift 2 ;;
    --download-deps)
      dir=${2:?}
      mkdir -p "$dir" && cd "$dir" || exit 1
      apt-get download "${DEB_PACKAGES[@]}" || exit 1
      ls -l ./*.deb
      exit 0 ;;
    *) die_usage "unknown argument $1" ;;
  esac
done
BUILD=$(mkdir -p "$BUILD" && cd "$BUILD" && pwd)
OUT=${OUT:-$BUILD/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/*.xml "$OUT"/*.log "$OUT"/transfer.json "$OUT"/summary.json \
  "$OUT"/report.txt "$OUT"/steps.tsv

START=$SECONDS
# steps.tsv: one line per step: name, status (ok, failed, timed_out,
# not_run), seconds, detail.
step() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$OUT/steps.tsv"; }
left() { echo $((BUDGET - (SECONDS - START))); }
# The timeout for a step: at most $1 seconds, and 15 s less than what is left
# (for the steps after it and the report).
allow() {
  local cap=$1 remaining
  remaining=$(($(left) - 15))
  if [ "$remaining" -lt "$cap" ]; then echo "$remaining"; else echo "$cap"; fi
}
# Runs "$@" under timeout $1 (seconds), output to log $2; sets RC and TOOK.
run_step() {
  local limit=$1 log=$2
  shift 2
  local began=$SECONDS
  if [ "$limit" -lt 5 ]; then
    RC=124
    TOOK=0
    echo "no time left to run: $*" >"$log"
    return
  fi
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  RC=$?
  TOOK=$((SECONDS - began))
}
status_of() {
  case "$1" in
    0) echo ok ;;
    124|137) echo timed_out ;;
    *) echo failed ;;
  esac
}

report() {
  # The summary and the ten-line report, from steps.tsv and the results.
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "modelcache GPU check: FAIL: no Python interpreter ($PYTHON) to write the report"
    cat "$OUT/steps.tsv"
    return 1
  fi
  GPU_CHECK_OUT="$OUT" GPU_CHECK_ELAPSED=$((SECONDS - START)) \
    GPU_CHECK_BUDGET="$BUDGET" GPU_CHECK_BUILD="$BUILD" \
    GPU_CHECK_SUITES="${GPU_SUITES[*]}" "$PYTHON" - <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET

out = os.environ["GPU_CHECK_OUT"]
steps = {}
with open(os.path.join(out, "steps.tsv")) as f:
    for line in f:
        name, status, seconds, detail = (line.rstrip("\n").split("\t") + [""] * 4)[:4]
        steps[name] = {"status": status, "seconds": int(seconds or 0),
                       "detail": detail}

def read(name):
    try:
        with open(os.path.join(out, name)) as f:
            return f.read()
    except OSError:
        return ""

def junit(path):
    """Counts of a gtest or pytest JUnit file; None when absent."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0, "skips": [],
              "failures": []}
    for case in root.iter("testcase"):
        name = (case.get("classname", "") + "." + case.get("name", "")).strip(".")
        skipped = case.find("skipped")
        failed = case.find("failure") is not None or case.find("error") is not None
        if failed:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif skipped is not None or case.get("result") == "skipped":
            counts["skipped"] += 1
            why = (skipped.get("message") if skipped is not None else "") or ""
            counts["skips"].append(f"{name}: {why.strip()[:120]}")
        else:
            counts["passed"] += 1
    return counts

def gtest_log(path):
    """Counts from a gtest log cut short (killed at its timeout: no XML),
    naming the test that was running; None when there is no log."""
    text = read(os.path.basename(path))
    if not text:
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0, "skips": [],
              "failures": []}
    running = None
    for line in text.splitlines():
        if line.startswith("[ RUN      ] "):
            running = line[13:].strip()
        elif line.startswith("[       OK ] "):
            counts["passed"] += 1
            running = None
        elif line.startswith("[  FAILED  ] ") and running:
            counts["failed"] += 1
            counts["failures"].append(running)
            running = None
        elif line.startswith("[  SKIPPED ] ") and running:
            counts["skipped"] += 1
            counts["skips"].append(running)
            running = None
    if running:
        counts["failed"] += 1
        counts["failures"].append(running + " (cut off while running)")
    return counts

suites = os.environ["GPU_CHECK_SUITES"].split()
cpp = {"passed": 0, "failed": 0, "skipped": 0, "skips": [], "failures": []}
missing = []
for suite in suites:
    c = junit(os.path.join(out, suite + ".xml"))
    if c is None:
        missing.append(suite)
        c = gtest_log(os.path.join(out, suite + ".log"))
        if c is None:
            continue
    for k in cpp:
        cpp[k] += c[k]
py = junit(os.path.join(out, "pytest.xml"))
try:
    bench = json.loads(read("transfer.json") or "null")
except ValueError:
    bench = None

def described(name, step):
    text = name.replace("_", " ")
    if step["status"] == "timed_out":
        text += " (timed out)"
    return text + (f": {step['detail']}" if step["detail"] else "")

not_run = [described(n, s) for n, s in steps.items()
           if s["status"] in ("not_run", "timed_out")]
failures = [described(n, s) for n, s in steps.items()
            if s["status"] == "failed" and n in ("gpu", "build")]
if missing:
    failures.append("no XML results from " + ", ".join(missing) +
                    " (counts from the log)")
if cpp["failed"]:
    failures.append(f"{cpp['failed']} C++ GPU tests failed: " + ", ".join(cpp["failures"][:3]))
if cpp["passed"] == 0:
    failures.append("no C++ GPU test passed")
if py is None or py["passed"] == 0:
    failures.append("no Python CUDA test passed")
elif py["failed"]:
    failures.append(f"{py['failed']} Python CUDA tests failed: " + ", ".join(py["failures"][:3]))
if not bench or bench.get("status") != "ok":
    failures.append("transfer benchmark: " +
                    ((bench or {}).get("reason") or (bench or {}).get("status") or "no result"))
ok = not failures and not not_run

def gbps(key):
    try:
        return f"{bench[key]['gb_per_second']:.1f} GB/s"
    except (TypeError, KeyError):
        return "n/a"

def ratio(key):
    try:
        return f"{bench[key]:.2f}x"
    except (TypeError, KeyError):
        return "n/a"

def tests_line(c):
    if c is None:
        return "not run"
    line = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
    if c["skips"]:
        line += " (" + "; ".join(c["skips"][:2]) + ")"
    return line

gpu = steps.get("gpu", {}).get("detail", "") or "none found"
build = steps.get("build", {})
elapsed = int(os.environ["GPU_CHECK_ELAPSED"])
budget = int(os.environ["GPU_CHECK_BUDGET"])
size = (bench or {}).get("bytes")
size_text = (f"{size / (1 << 30):.2f} GiB" if size and size >= 1 << 30 else
             f"{size / (1 << 20):.2f} MiB" if size else "n/a")
lines = [
    f"modelcache GPU check: {'PASS' if ok else 'FAIL'} in {elapsed} s of {budget} s "
    f"(summary: {os.path.join(out, 'summary.json')})",
    f"GPU: {gpu}",
    f"build: {build.get('status', 'not_run').replace('_', ' ')} in {build.get('seconds', 0)} s "
    f"({os.environ['GPU_CHECK_BUILD']}){'; ' + build['detail'] if build.get('detail') else ''}",
    "C++ GPU tests (MODELCACHE_REQUIRE_GPU=1): " +
    (tests_line(cpp) if sum(cpp[k] for k in ("passed", "failed", "skipped"))
     else "not run"),
    "Python CUDA tests (MODELCACHE_REQUIRE_GPU=1): " + tests_line(py),
    f"transfer of {size_text} host to device, medians: runtime {gbps('runtime')}, "
    f"first placement {gbps('first')}",
    f"cudaMemcpy in the same run: pinned {gbps('pinned')}, pageable {gbps('pageable')}; "
    f"runtime/pinned {ratio('runtime_over_pinned')}, runtime/pageable {ratio('runtime_over_pageable')}",
    "read back after placement: " +
    ("exact" if (bench or {}).get("read_back_exact") else "not checked" if not bench or "read_back_exact" not in bench else "WRONG"),
    "could not run: " + ("; ".join(not_run) if not_run else "nothing"),
    "failures: " + ("; ".join(failures) if failures else "none"),
]
summary = {"status": "pass" if ok else "fail", "elapsed_seconds": elapsed,
           "budget_seconds": budget, "gpu": gpu, "steps": steps,
           "cpp_tests": cpp, "cpp_suites_without_results": missing,
           "python_tests": py, "transfer": bench, "failures": failures,
           "not_run": not_run, "report": lines}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
with open(os.path.join(out, "report.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
print("\n".join(lines))
sys.exit(0 if ok else 1)
PY
}

# ---- 1. Is there a GPU at all? ----
gpus=$("$NVIDIA_SMI" -L 2>&1)
smi_rc=$?
if [ $smi_rc -ne 0 ] || ! grep -q '^GPU ' <<<"$gpus"; then
  echo "gpu-check: FAIL: no NVIDIA GPU here: '$NVIDIA_SMI -L' $( [ $smi_rc -ne 0 ] && echo "failed ($smi_rc)" || echo "listed none"): $(head -c 300 <<<"$gpus")" >&2
  step gpu not_run 0 "no GPU: $NVIDIA_SMI -L: $(head -n 1 <<<"$gpus" | head -c 200)"
  for s in build cpp_tests python_tests transfer_bench; do
    step "$s" not_run 0 "no GPU"
  done
  report
  exit 2
fi
info=$("$NVIDIA_SMI" --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader 2>/dev/null | head -n 1)
nvcc_version=$( (command -v nvcc >/dev/null && nvcc --version ||
  /usr/local/cuda/bin/nvcc --version) 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
step gpu ok 0 "${info:-$(head -n 1 <<<"$gpus")} ($(grep -c '^GPU ' <<<"$gpus") visible); nvcc ${nvcc_version:-not found}"

# ---- 2. Build the release tree here. ----
python_built=1
if [ "$SKIP_BUILD" = 1 ]; then
  step build not_run 0 "GPU_CHECK_SKIP_BUILD=1: the tree at $BUILD used as it is"
  [ -e "$BUILD/python/modelcache/__init__.py" ] || python_built=0
else
  began=$SECONDS
  args=(-S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release
    -DMODELCACHE_BUILD_TESTS=ON -DMODELCACHE_BUILD_BENCH=OFF
    -DMODELCACHE_BUILD_CUDA_BENCH=ON -DCMAKE_POLICY_VERSION_MINIMUM=3.5)
  command -v ninja >/dev/null && args+=(-G Ninja)
  if [ -n "$DEPS" ]; then
    mkdir -p "$BUILD/deps"
    for deb in "$DEPS"/*.deb; do dpkg-deb -x "$deb" "$BUILD/deps"; done
    args+=(-DCMAKE_PREFIX_PATH="$BUILD/deps/usr")
  fi
  pybind11_dir=$("$PYTHON" -m pybind11 --cmakedir 2>/dev/null) &&
    args+=(-Dpybind11_DIR="$pybind11_dir")
  run_step "$(allow 120)" "$OUT/configure.log" cmake "${args[@]}" \
    -DMODELCACHE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PYTHON")"
  build_note=""
  if [ $RC -ne 0 ]; then
    # Perhaps only the Python package cannot be built here (no headers for
    # this interpreter): the C++ checks can still run.
    python_built=0
    build_note="Python package not configured: $(grep -m1 -iE 'error|could not' "$OUT/configure.log" | head -c 160)"
    run_step "$(allow 120)" "$OUT/configure.log" cmake "${args[@]}" \
      -DMODELCACHE_BUILD_PYTHON=OFF
  fi
  if [ $RC -ne 0 ]; then
    step build "$(status_of $RC)" $((SECONDS - began)) "configure failed: $(grep -m1 -iE 'error|could not|not found' "$OUT/configure.log" | head -c 200) (see configure.log; --deps may help)"
  elif ! grep -q "CUDA device backend on" "$OUT/configure.log"; then
    RC=1
    step build failed $((SECONDS - began)) "CMake did not find the CUDA toolkit (CUDAToolkit_ROOT or nvcc on PATH)"
  else
    targets=("${GPU_SUITES[@]}" cuda_corrupt_context_child modelcache_cuda_transfer_bench)
    [ $python_built = 1 ] && targets+=(modelcache_python)
    run_step "$(allow 330)" "$OUT/build.log" cmake --build "$BUILD" \
      --parallel "$(nproc)" --target "${targets[@]}"
    step build "$(status_of $RC)" $((SECONDS - began)) "$build_note"
  fi
  if [ $RC -ne 0 ]; then
    for s in cpp_tests python_tests transfer_bench; do
      step "$s" not_run 0 "the build failed"
    done
    report
    exit 1
  fi
fi

# ---- 3. The GPU suites, each in one process, a GPU test that would skip
# failing instead. ----
cpp_status=ok
cpp_detail=""
cpp_began=$SECONDS
for suite in "${GPU_SUITES[@]}"; do
  if [ ! -x "$BUILD/bin/$suite" ]; then
    cpp_status=failed
    cpp_detail+="$suite not built; "
    continue
  fi
  MODELCACHE_REQUIRE_GPU=1 run_step "$(allow 240)" "$OUT/$suite.log" \
    "$BUILD/bin/$suite" --gtest_output="xml:$OUT/$suite.xml"
  if [ $RC -ne 0 ]; then
    [ "$(status_of $RC)" = timed_out ] && cpp_status=timed_out
    [ $cpp_status = ok ] && cpp_status=failed
    cpp_detail+="$suite exited $RC; "
  fi
done
step cpp_tests "$cpp_status" $((SECONDS - cpp_began)) "${cpp_detail%; }"

# ---- 4. The Python CUDA tests. ----
if [ $python_built = 0 ]; then
  step python_tests not_run 0 "the Python package was not built here"
else
  MODELCACHE_REQUIRE_GPU=1 PYTHONPATH="$BUILD/python" run_step \
    "$(allow 180)" "$OUT/pytest.log" "$PYTHON" -m pytest -q -rs \
    -p no:cacheprovider --junitxml="$OUT/pytest.xml" \
    "$ROOT/python/tests/test_cuda.py"
  step python_tests "$(status_of $RC)" "$TOOK" \
    "$([ $RC -ne 0 ] && tail -n 1 "$OUT/pytest.log" | head -c 200)"
fi

# ---- 5. The transfer benchmark. ----
if [ ! -x "$BUILD/bin/modelcache_cuda_transfer_bench" ]; then
  step transfer_bench not_run 0 "modelcache_cuda_transfer_bench not built"
else
  mkdir -p "$BUILD/transfer-data"
  run_step "$(allow 180)" "$OUT/transfer.log" \
    "$BUILD/bin/modelcache_cuda_transfer_bench" --bytes "$BENCH_BYTES" \
    --dir "$BUILD/transfer-data" --json "$OUT/transfer.json"
  rm -rf "$BUILD/transfer-data"
  step transfer_bench "$(status_of $RC)" "$TOOK" \
    "$([ $RC -ne 0 ] && tail -n 1 "$OUT/transfer.log" | head -c 200)"
fi

report
