#!/usr/bin/env bash
# Offloading on a lent GPU machine in ONE device call (timeout_s 600): the offload equality tests with the GPU
# visible (host and in-jit paging: same tokens as the simulation, bytes = loads x expert bytes) and the whole
# suite in TESTS_BOX seconds, then bench_offload.py's GPU suite (81 s on an H200; it prints where host paging's
# time a token goes) (pinned host -> device bandwidth; offloaded decode at OLMoE expert shapes vs the roofline,
# host and in-jit paging, C = N/2 and N/4). Everything lands in $OUT (<= 8 files).
#
#     bash bench/gpu_offload.sh                                # on the device (run tool; carry .shared-data.tar.xz)
#
# The tree a call carries must fit 64 MiB, and main's is 98 MB: the shipped model (60), tests/data (28: the
# suite's stand-in default model) and results/ (6). Call from a throw-away branch without the shipped model and
# results/ (32 MB; `git checkout -b device-call && git rm -rq results moejax/assets/default-model && git commit
# -qm tmp`): only tests/test_default_model.py then fails (5 tests, expected). Never drop tests/data (without it
# every test of the stand-in default model fails). For runs that read the full task sets there
# (MOEJAX_DATA), `bash bench/device_env.sh --pack-shared` first and carry .shared-data.tar.xz.
# The suite runs FIRST_TESTS first (default: the files a suite cut short by its box would otherwise not reach, and
# those whose numerics differ on a GPU), then the rest.
# The device machine is released 30 s after a call ends: a second call must be the very next step.
#     SMALL=1 OUT=/tmp/gpu-offload bash bench/gpu_offload.sh   # the same path on this CPU (tiny shapes, ~2 min)
#
# The device image runs Python 3.12 and jax 0.11.2 (this machine: 3.11, jax 0.10.2); the bench part also ran
# here under Python 3.12.1 + jax 0.11.2 (SMALL=1). The tests need torch for their tiny checkpoints: the image has it.
# Each step has its own time box so that one that hangs or fails still leaves the others' results; the
# summary at the end names each step's exit status. Failures' tracebacks land in $OUT/failures.txt as they
# happen (MOEJAX_TEST_FAILURE_LOG), so a suite cut off by its box still says why.
# Part 3's grid: SHAPES (olmoe,qwen1.5), ROUTINGS (original,cache-prior,prefetch), SIZES (0.5,0.25,0.125), PAGINGS
# (host,jit) pick it (defaults: olmoe, original, 0.5,0.25, host,jit: 81 s on the H200); every run compiles its own
# programs (~15 s), so the whole grid (36 runs) needs a call of its own: TESTS=0 skips the tests. Mixtral beyond
# the GPU's memory and part 4 (bench/gpu_research_loop.sh) are not in this call.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_out
small=(); tests_box=${TESTS_BOX:-300}; bench_box=${BENCH_BOX:-150}
if [[ -n "${SMALL:-}" ]]; then small=(--small); fi
{
    device_env torch
    shared_data
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# 0. the int8 product by row count (seconds): XLA:GPU's int8 decode on few rows (bench/gpu_numerics_probe.py)
timeout 60 python3 bench/gpu_numerics_probe.py > "$OUT/probe.txt" 2>&1; echo "probe exit $?"; tail -1 "$OUT/probe.txt"

# 1. the test suite, GPU visible (the offload equality tests first, then the rest; 8 workers, each without
# preallocating the GPU's memory). TF32 matmuls break a float32 offload comparison (tests/conftest.py asks for full
# float32 where a GPU is visible): the offload tests run first to check it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false MOEJAX_TEST_FAILURE_LOG="$OUT/failures.txt"
tests_rc=skipped
if [[ "${TESTS:-1}" != 0 ]]; then
timeout 120 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_offload.py tests/test_overlap.py \
    tests/test_page_writes.py -k "simulation or slots or bytes or compiles" > "$OUT/tests.txt" 2>&1
tests_rc=$?
tail -3 "$OUT/tests.txt"
if [[ -z "${SMALL:-}" ]]; then
    first=${FIRST_TESTS:-"tests/test_seeds.py tests/test_serve.py tests/test_simulate.py tests/test_studies.py
        tests/test_sweep.py tests/test_tasks.py tests/test_tempfiles.py tests/test_trace.py tests/test_train.py
        tests/test_int8.py tests/test_hf_parity.py tests/test_dispatch.py tests/test_cache_memory.py tests/test_convert.py
        tests/test_attention.py tests/test_prior.py tests/test_evaluate.py tests/test_layout.py tests/test_distributed.py
        tests/test_generate.py"}
    # shellcheck disable=SC2086  # a list of paths; pytest collects a path given twice once, in first-given order
    timeout "$tests_box" python3 -m pytest -v -rfE -p no:cacheprovider -n 8 -m "not slow" --durations 15 $first tests \
        > "$OUT/suite.txt" 2>&1; echo "whole suite exit $? (124 = its time box ran out)" | tee -a "$OUT/env.txt"
    grep -c " PASSED " "$OUT/suite.txt"; grep " FAILED \| ERROR " "$OUT/suite.txt" | head -40
fi
fi
unset XLA_PYTHON_CLIENT_PREALLOCATE MOEJAX_TEST_FAILURE_LOG

# 2-3. bandwidth and offloaded decode vs the roofline
timeout "$bench_box" python3 bench/bench_offload.py --suite gpu --layers 4 "${small[@]}" --out "$OUT/offload_gpu.json" \
    --shapes "${SHAPES:-olmoe}" --routings "${ROUTINGS:-original}" --sizes "${SIZES:-0.5,0.25}" --pagings "${PAGINGS:-host,jit}" \
    > "$OUT/bench.txt" 2>&1
bench_rc=$?
tail -8 "$OUT/bench.txt"
echo "summary: tests exit $tests_rc, bench exit $bench_rc (124 = its time box ran out)" | tee -a "$OUT/env.txt"
ls -la "$OUT"
