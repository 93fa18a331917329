#!/usr/bin/env bash
# Builds the fuzzers (clang) and runs each for a bounded time: the
# safetensors reader, the trace readers of `modelcache replay`, what
# `modelcache ring` parses, then the parsers of `modelcache serve` (requests,
# replies, catalogs, maps lines, a predecessor's record and handover).
#
#   fuzz/run.sh [SECONDS] [BUILD_DIR]      (defaults: 20 each, build/fuzz)
#
# Run from the repository root. The seed corpora are the real files under
# ../shared/data/weights and ../shared/data/traces (read in place, never
# copied); inputs the fuzzers find go to BUILD_DIR/<fuzzer>-corpus, crash
# reproducers to BUILD_DIR/artifacts/. Exits non-zero when a fuzzer finds a
# crash. Reproduce one with
#   BUILD_DIR/safetensors_fuzzer BUILD_DIR/artifacts/crash-...
# (or trace_fuzzer, ring_fuzzer or serve_protocol_fuzzer, whichever
# reported it).
set -euo pipefail

seconds="${1:-20}"
build_dir="${2:-build/fuzz}"
data="${MODELCACHE_SHARED_DATA:-../shared/data}"

cmake -S fuzz -B "$build_dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++ >/dev/null
cmake --build "$build_dir" --target safetensors_fuzzer trace_fuzzer ring_fuzzer \
  serve_protocol_fuzzer
mkdir -p "$build_dir/artifacts"

# run FUZZER DICT SEEDS [libFuzzer flags...]
run() {
  local fuzzer="$1" dict="$2" seeds="$3"
  shift 3
  local corpora=("$build_dir/$fuzzer-corpus")
  mkdir -p "${corpora[0]}"
  if [ -d "$seeds" ]; then
    corpora+=("$seeds")
  else
    echo "fuzz/run.sh: no seed corpus at $seeds; starting from scratch" >&2
  fi
  "$build_dir/$fuzzer" \
    -max_total_time="$seconds" \
    -dict="$dict" \
    -artifact_prefix="$build_dir/artifacts/" \
    -print_final_stats=1 \
    "$@" \
    "${corpora[@]}"
}

run safetensors_fuzzer fuzz/safetensors.dict "$data/weights"
# Each input is read six ways and the real traces are up to 120 KB; shorter
# inputs keep the runs per second in the hundreds.
run trace_fuzzer fuzz/trace.dict "$data/traces" -max_len=16384
# Its inputs are a --nodes line, a --hash-type line, then a model list;
# fuzz/ring_seeds holds a few.
run ring_fuzzer fuzz/ring.dict fuzz/ring_seeds -max_len=4096
# The first byte picks the parser; fuzz/serve_protocol_seeds holds one input
# of each kind.
run serve_protocol_fuzzer fuzz/serve_protocol.dict fuzz/serve_protocol_seeds \
  -max_len=8192
