# Front door. `make demo` and `make test` install what is missing, build, and
# run; see README.md.
JOBS ?= $(shell nproc)
DEPS_STAMP := build/.deps-installed

.PHONY: all deps build demo test test-release test-asan test-tsan test-tsa \
	test-fuzz fuzz property bench bench-stream cluster soak clean
FUZZ_SECONDS ?= 600
PROPERTY_CASES ?= 100000
DRAIN_PROPERTY_CASES ?= 20000

all: build

$(DEPS_STAMP): scripts/install-deps.sh
	bash scripts/install-deps.sh
	mkdir -p build && touch $@

deps: $(DEPS_STAMP)

# Release build; the CLI lands in build/bin/.
build: deps
	cmake --preset release >/dev/null
	cmake --build build -j $(JOBS)

# The main job on its embedded default: replay a generated trace through the
# cache under several policies and budgets; prints a table and a report path.
demo: build
	./build/bin/modelcache replay

# The GPU suites (label "gpu") run in every configuration but ThreadSanitizer
# (where they are not built): without a GPU each skips, saying why. On a GPU
# machine, scripts/gpu-check.sh is the check to run. `make test GPU_TESTS=0`
# leaves them out.
GPU_TESTS ?= 1
CTEST_FILTER := $(if $(filter 0,$(GPU_TESTS)),-LE gpu,)

# One configuration: configure, build, run its tests.
define run_suite
	cmake --preset $(1) >/dev/null
	cmake --build $(2) -j $(JOBS)
	cd $(2) && ctest --output-on-failure -j $(JOBS) $(CTEST_FILTER) $(3)
endef

# Replays of the whole shared trace, single-threaded apart from runs in
# parallel that smaller tests cover: only the release build runs them. In the
# sanitizer and clang builds they take minutes and check no memory or thread
# behaviour the rest does not (the fuzzers run the same readers under ASan).
# So do the live runs checked against the replay (LiveReplay.*: the
# library's, tests/replay/live_agreement_test.cc, and the daemon's,
# LiveReplay.Daemon, tests/replay/live_daemon_test.cc): they run in real
# time, and a sanitizer's slowdown would be measured as waits the replay
# cannot predict.
RELEASE_ONLY_TESTS := -E '^(StreamReplay\.(CsvStreamGivesTheInMemoryResultsForEveryPolicyKind|SameJsonAsInMemoryOnTheSharedTraceAndCompressedCopies)|ReplayCli\.JsonOnTheSharedTrace|Replay\.NextUseLoadsFewerBytesThanEitherGdsfOnEveryWorkload|LiveReplay\..*)$$'

test-release: deps
	$(call run_suite,release,build,)
test-asan: deps
	$(call run_suite,asan,build/asan,$(RELEASE_ONLY_TESTS))
test-tsan: deps
	$(call run_suite,tsan,build/tsan,$(RELEASE_ONLY_TESTS))
test-tsa: deps
	$(call run_suite,clang-tsa,build/clang-tsa,$(RELEASE_ONLY_TESTS))

# The safetensors reader, the trace readers, `modelcache ring`'s inputs and
# the serve protocol's parsers under libFuzzer (clang, ASan+UBSan), seeded
# with the real files in ../shared/data/weights and ../shared/data/traces
# (and fuzz/ring_seeds, fuzz/serve_protocol_seeds): 20 s each in `make
# test`, longer on demand with
# `make fuzz FUZZ_SECONDS=3600`.
test-fuzz: deps
	bash fuzz/run.sh 20 build/fuzz
fuzz: deps
	bash fuzz/run.sh $(FUZZ_SECONDS) build/fuzz

# Every configuration; the release suite runs last so that ctest's summary
# line closes the output.
test: deps
	$(MAKE) --no-print-directory test-tsa
	$(MAKE) --no-print-directory test-asan
	$(MAKE) --no-print-directory test-tsan
	$(MAKE) --no-print-directory test-fuzz
	$(MAKE) --no-print-directory test-release

# The stateful property test of the cache API, far longer than in `make
# test` and with a fresh random seed each time (printed, with the minimal
# failing sequence, if it finds one). The drain property runs
# DRAIN_PROPERTY_CASES: each of its cases runs threads and settles after
# every step, some milliseconds a case.
property: build
	RC_PARAMS="max_success=$(PROPERTY_CASES) max_size=100" \
	  ./build/bin/property_test
	RC_PARAMS="max_success=$(DRAIN_PROPERTY_CASES) max_size=100" \
	  ./build/bin/drain_property_test

bench: build
	mkdir -p build/bench-results
	./build/bin/modelcache_hit_path_bench --benchmark_repetitions=5 \
	  --benchmark_report_aggregates_only=true \
	  --benchmark_out=build/bench-results/hit_path.json --benchmark_out_format=json
	./build/bin/modelcache_miss_storm_bench --benchmark_repetitions=5 \
	  --benchmark_report_aggregates_only=true \
	  --benchmark_out=build/bench-results/miss_storm.json --benchmark_out_format=json
	./build/bin/modelcache_eviction_bench --benchmark_repetitions=5 \
	  --benchmark_report_aggregates_only=true \
	  --benchmark_out=build/bench-results/eviction.json --benchmark_out_format=json
	./build/bin/modelcache_replay_bench --benchmark_repetitions=5 \
	  --benchmark_report_aggregates_only=true \
	  --benchmark_out=build/bench-results/replay.json --benchmark_out_format=json
	./build/bin/modelcache_load_safetensors_bench --benchmark_repetitions=5 \
	  --benchmark_report_aggregates_only=true \
	  --benchmark_out=build/bench-results/load_safetensors.json --benchmark_out_format=json
	./build/bin/modelcache_multi_device_bench \
	  --benchmark_out=build/bench-results/multi_device.json --benchmark_out_format=json
	./build/bin/modelcache_policy_bound 42 1 2 3 4 5 6 \
	  --azure ../shared/data/traces/azure-functions-2019-100fn.csv \
	  --memory ../shared/data/traces/azure-functions-2019-100fn-memory.csv
	./build/bin/modelcache_serve_bench acquire \
	  --out build/bench-results/serve_acquire.json
	./build/bin/modelcache_serve_bench memory \
	  --out build/bench-results/serve_memory.json
	./build/bin/modelcache_serve_bench first-tensor \
	  --out build/bench-results/serve_first_tensor.json
	PYTHONPATH=build/python /usr/bin/python3 bench/python/hit_path.py
	PYTHONPATH=build/python /usr/bin/python3 bench/python/miss_storm.py
	PYTHONPATH=build/python /usr/bin/python3 bench/python/node_server.py

# The soak of `modelcache serve` (tests/serve/serve_soak.cc): 8 workers
# acquiring, checking every byte and releasing while workers and the daemon
# are SIGKILLed, the daemon taken over, its catalog reloaded, floods, budget
# changes, drains (a short --drain-after picked from the seed; half the
# workers reuse leases locally, so drains recall them); sampled every 100 ms
# for the Never checks. Prints a summary (drains and refused reclaims' reasons
# included); exit 1 on any violation. Not in `make test`. `make soak
# SOAK_MINUTES=5`; `SOAK_ARGS=--no-takeover` leaves takeovers out, `--seed S`
# repeats a run, `--drain-after D` fixes the drain rule.
SOAK_MINUTES ?= 30
SOAK_ARGS ?=
soak: build
	./build/bin/serve_soak --minutes $(SOAK_MINUTES) $(SOAK_ARGS)

# The loopback cluster (examples/cluster/cluster.py): 4 nodes of `modelcache
# serve` and the example workers behind HAProxy, with Prometheus, every route
# measured beside `modelcache replay --nodes`, a node killed and restarted;
# results in build/cluster-results/. `make test` runs its short version
# (--quick).
cluster: build
	/usr/bin/python3 examples/cluster/cluster.py --build build

# The streaming reader on a generated 10^9-request trace (bench/stream_billion.sh;
# about an hour on one core, and 7 GB of disk while it runs). Not in `bench`.
bench-stream: build
	bench/stream_billion.sh build build/bench-stream

clean:
	rm -rf build
