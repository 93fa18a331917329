#!/usr/bin/env bash
# Builds the safetensors fuzzer (clang) and runs it for a bounded time.
#
#   fuzz/run.sh [SECONDS] [BUILD_DIR]      (defaults: 20, build/fuzz)
#
# Run from the repository root. The seed corpus is the real files under
# ../shared/data/weights (read in place, never copied); inputs the fuzzer
# finds go to BUILD_DIR/corpus, crash reproducers to BUILD_DIR/artifacts/.
# Exits non-zero when the fuzzer finds a crash. Reproduce one with
#   BUILD_DIR/safetensors_fuzzer BUILD_DIR/artifacts/crash-...
set -euo pipefail

seconds="${1:-20}"
build_dir="${2:-build/fuzz}"
seeds="${MODELCACHE_SHARED_DATA:-../shared/data}/weights"

cmake -S fuzz -B "$build_dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build_dir" --target safetensors_fuzzer
mkdir -p "$build_dir/corpus" "$build_dir/artifacts"

corpora=("$build_dir/corpus")
if [ -d "$seeds" ]; then
  corpora+=("$seeds")
else
  echo "fuzz/run.sh: no seed corpus at $seeds; starting from scratch" >&2
fi

"$build_dir/safetensors_fuzzer" \
  -max_total_time="$seconds" \
  -dict=fuzz/safetensors.dict \
  -artifact_prefix="$build_dir/artifacts/" \
  -print_final_stats=1 \
  "${corpora[@]}"
