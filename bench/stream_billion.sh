#!/bin/bash
# The streaming reader's benchmark (docs/benchmarks.md, "Streaming"):
#
#   1. generates a 10-million-request trace (10,000 models) as zstd and
#      replays it with one online policy in memory and as a stream, and
#      checks that the two JSON outputs are the same less their timings;
#   2. generates a 1,000,000,000-request trace with the same models, piped
#      into zstd (the CSV, about 26 GB, never lands on disk; the .zst is
#      about 6.3 GB), and replays it as a stream;
#   3. prints one table: wall and CPU seconds (user + system), peak RSS,
#      and requests per second by wall and by CPU-second, each end to end
#      (reading, decompressing and parsing included).
#
# Usage: bench/stream_billion.sh [BUILD_DIR [WORK_DIR]]
#   BUILD_DIR: holds bin/modelcache and bin/modelcache_trace_gen (build)
#   WORK_DIR:  where the traces and logs go (/tmp/modelcache-stream-bench);
#              the traces are deleted at the end unless KEEP=1
# Environment (defaults in brackets):
#   REQUESTS [1000000000]  SMALL [10000000]  MODELS [10000]  SEED [1]
#   POLICY [lru]  CAPACITY [1TiB]
#   REPLAY_FLAGS [--no-time]: the untimed replay, one pass per run. With the
#     time model (REPLAY_FLAGS=) the replay also searches for the capacity
#     its SLO needs, a dozen more passes over the trace: hours at 10^9.
#   TIMED_SMALL [1]: also replay the small trace with the time model (and
#     its SLO search), in memory and as a stream
#   REUSE [0]: 1 keeps a trace already in WORK_DIR instead of generating it
#   CPU: a CPU number to pin every step to (taskset), e.g. on a shared machine
#   NICE [0]: niceness of every step
#
# Needs zstd and GNU time (/usr/bin/time). One core does all the work: the
# replay runs with --threads 1 and zstd with -T1.
set -euo pipefail

BUILD=${1:-build}
WORK=${2:-/tmp/modelcache-stream-bench}
REQUESTS=${REQUESTS:-1000000000}
SMALL=${SMALL:-10000000}
MODELS=${MODELS:-10000}
SEED=${SEED:-1}
POLICY=${POLICY:-lru}
CAPACITY=${CAPACITY:-1TiB}
REPLAY_FLAGS=${REPLAY_FLAGS---no-time}
TIMED_SMALL=${TIMED_SMALL:-1}
REUSE=${REUSE:-0}
KEEP=${KEEP:-0}
NICE=${NICE:-0}

MC=$(realpath "$BUILD/bin/modelcache")
GEN=$(realpath "$BUILD/bin/modelcache_trace_gen")
mkdir -p "$WORK"
cd "$WORK"

RUN=(nice -n "$NICE")
if [[ -n ${CPU:-} ]]; then RUN=(taskset -c "$CPU" "${RUN[@]}"); fi
TIME_FORMAT="%e %U %S %M"  # wall, user, system (s), peak RSS (KiB)

rows=()
# row LABEL REQUESTS TIMEFILE: one line of the table.
row() {
  local label=$1 requests=$2 wall user sys rss
  read -r wall user sys rss < "$3"
  rows+=("$(awk -v l="$label" -v n="$requests" -v w="$wall" -v u="$user" \
    -v s="$sys" -v r="$rss" 'BEGIN {
      cpu = u + s
      printf "| %s | %.0f | %.1f | %.1f | %.0f MiB | %.3f | %.3f |", l, n,
             w, cpu, r / 1024, n / w / 1e6, n / cpu / 1e6 }')")
}

# generate N FILE: the trace, piped into zstd; times both.
generate() {
  local n=$1 file=$2
  if [[ $REUSE == 1 && -s $file ]]; then
    echo "reusing $file"
    return
  fi
  echo "generating $n requests into $file"
  local start end
  start=$(date +%s.%N)
  "${RUN[@]}" /usr/bin/time -f "$TIME_FORMAT" -o "$file.gen.time" \
    "$GEN" "$n" "$MODELS" "$SEED" |
    "${RUN[@]}" /usr/bin/time -f "$TIME_FORMAT" -o "$file.zstd.time" \
      zstd -q -f -T1 -3 -o "$file"
  end=$(date +%s.%N)
  awk -v s="$start" -v e="$end" -v f="$file" -v b="$(stat -c %s "$file")" \
    'BEGIN { printf "%s: %.0f s wall, %.2f GB\n", f, e - s, b / 1e9 }'
  read -r _ gu gs _ < "$file.gen.time"
  read -r _ zu zs _ < "$file.zstd.time"
  awk -v gu="$gu" -v gs="$gs" -v zu="$zu" -v zs="$zs" \
    'BEGIN { printf "  CPU: generator %.1f s, zstd %.1f s\n", gu + gs, zu + zs }'
}

# replay LABEL REQUESTS TRACE OUT [FLAGS...]: one replay, timed.
replay() {
  local label=$1 requests=$2 trace=$3 out=$4
  shift 4
  echo "replaying $trace: $label"
  "${RUN[@]}" /usr/bin/time -f "$TIME_FORMAT" -o "$out.time" \
    "$MC" replay "$trace" --policy "$POLICY" --capacity "$CAPACITY" \
    --threads 1 --json "$@" > "$out.json" 2> "$out.stderr"
  row "$label" "$requests" "$out.time"
}

# same A B: the two JSON outputs agree, less the time each run took.
same() {
  if diff <(grep -v -e '"seconds"' -e '"requests_per_second"' "$1") \
    <(grep -v -e '"seconds"' -e '"requests_per_second"' "$2") > /dev/null; then
    echo "same results: $1 $2"
  else
    echo "DIFFERENT results: $1 $2" >&2
    exit 1
  fi
}

small=small.csv.zst
large=large.csv.zst
generate "$SMALL" "$small"
# shellcheck disable=SC2086  # REPLAY_FLAGS is a list of flags
replay "$SMALL, in memory $REPLAY_FLAGS" "$SMALL" "$small" small-memory $REPLAY_FLAGS
# shellcheck disable=SC2086
replay "$SMALL, stream $REPLAY_FLAGS" "$SMALL" "$small" small-stream --stream $REPLAY_FLAGS
same small-memory.json small-stream.json

generate "$REQUESTS" "$large"
# shellcheck disable=SC2086
replay "$REQUESTS, stream $REPLAY_FLAGS" "$REQUESTS" "$large" large-stream \
  --stream --progress $REPLAY_FLAGS

if [[ $TIMED_SMALL == 1 ]]; then
  replay "$SMALL, in memory, time model + SLO search" "$SMALL" "$small" \
    small-memory-timed
  replay "$SMALL, stream, time model + SLO search" "$SMALL" "$small" \
    small-stream-timed --stream
  same small-memory-timed.json small-stream-timed.json
fi

if [[ $KEEP != 1 ]]; then rm -f "$small" "$large"; fi

echo
echo "$POLICY at $CAPACITY, --threads 1 ($(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg))"
echo "| requests, reader | requests | wall s | CPU s | peak RSS | M req/s (wall) | M req/CPU-s |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
