#!/usr/bin/env bash
# scripts/gpu-check.sh must fail loudly, never pass, where CUDA cannot be
# used. Two cases, on any machine (a GPU, if there is one, is hidden):
#   1. no GPU at all (nvidia-smi missing): exit 2 at once, saying so, with
#      the summary and the ten-line report written;
#   2. nvidia-smi lists a GPU but CUDA cannot use it (CUDA_VISIBLE_DEVICES=-1;
#      on a machine without a driver, also none): the GPU suites run under
#      MODELCACHE_REQUIRE_GPU=1 and fail instead of skipping, the Python CUDA
#      tests fail, the benchmark reports CUDA unavailable; exit 1, and the
#      report says what failed. The build step is skipped
#      (GPU_CHECK_SKIP_BUILD=1): the suites of this build tree are used.
#
#   gpu_check_script_test.sh SCRIPT BUILD_DIR PYTHON
set -uo pipefail
script=$1
build=$2
python=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() {
  echo "FAIL: $*"
  for f in "$tmp"/*.out; do echo "--- $f"; cat "$f"; done
  exit 1
}
summary() {  # summary() DIR EXPRESSION: prints the expression's value
  "$python" -c "import json,sys; s=json.load(open(sys.argv[1]+'/summary.json')); print($2)" "$1"
}
ten_lines() {
  [ "$(wc -l <"$1/report.txt")" -eq 10 ] || fail "the report in $1 is not ten lines"
}

# ---- 1. No GPU at all.
NVIDIA_SMI="$tmp/no-such-nvidia-smi" PYTHON="$python" \
  bash "$script" --build-dir "$tmp/build1" --out "$tmp/out1" >"$tmp/1.out" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "case 1: exit $rc without nvidia-smi, expected 2"
grep -q "gpu-check: FAIL: no NVIDIA GPU here" "$tmp/1.out" ||
  fail "case 1: no loud failure"
grep -q "^modelcache GPU check: FAIL" "$tmp/1.out" || fail "case 1: no report"
[ "$(summary "$tmp/out1" 's["status"]')" = fail ] || fail "case 1: summary"
ten_lines "$tmp/out1"
echo "case 1 (no GPU): exit 2, loud"

# ---- 2. A GPU listed, CUDA unusable.
mkdir -p "$tmp/bin"
cat >"$tmp/bin/nvidia-smi" <<'SMI'
#!/bin/sh
case "$1" in
  -L) echo "GPU 0: Stand-in GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)" ;;
  *) echo "Stand-in GPU, 1024 MiB, 0.0" ;;
esac
SMI
chmod +x "$tmp/bin/nvidia-smi"
CUDA_VISIBLE_DEVICES=-1 GPU_CHECK_SKIP_BUILD=1 NVIDIA_SMI="$tmp/bin/nvidia-smi" \
  GPU_CHECK_BENCH_BYTES=1048576 PYTHON="$python" \
  bash "$script" --build-dir "$build" --out "$tmp/out2" >"$tmp/2.out" 2>&1
rc=$?
[ $rc -eq 1 ] || fail "case 2: exit $rc, expected 1"
grep -q "^modelcache GPU check: FAIL" "$tmp/2.out" || fail "case 2: not FAIL"
ten_lines "$tmp/out2"
[ "$(summary "$tmp/out2" 's["status"]')" = fail ] || fail "case 2: summary"
[ "$(summary "$tmp/out2" 's["cpp_tests"]["passed"]')" = 0 ] ||
  fail "case 2: a C++ GPU test passed without CUDA"
[ "$(summary "$tmp/out2" 's["cpp_tests"]["failed"] > 10')" = True ] ||
  fail "case 2: the C++ GPU tests did not fail under MODELCACHE_REQUIRE_GPU=1"
[ "$(summary "$tmp/out2" 's["cpp_tests"]["skipped"]')" = 0 ] ||
  fail "case 2: a C++ GPU test skipped under MODELCACHE_REQUIRE_GPU=1"
[ "$(summary "$tmp/out2" '(s["python_tests"] or {}).get("passed", 0)')" = 0 ] ||
  fail "case 2: a Python CUDA test passed without CUDA"
[ "$(summary "$tmp/out2" 's["transfer"]["status"]')" = unavailable ] ||
  fail "case 2: the benchmark did not report CUDA unavailable"
grep -q "MODELCACHE_REQUIRE_GPU=1 but CUDA unavailable" "$tmp/out2/cuda_device_test.log" ||
  fail "case 2: the suites did not say why CUDA is unavailable"
grep -q "^failures: .*C++ GPU tests failed" "$tmp/2.out" ||
  fail "case 2: the report does not name the failures"
echo "case 2 (GPU listed, CUDA unusable): exit 1, every GPU test failed"
echo "--- the report of case 2:"
cat "$tmp/out2/report.txt"
