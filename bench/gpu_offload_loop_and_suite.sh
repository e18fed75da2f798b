#!/usr/bin/env bash
# Offloaded decode on the GPU, the research loop at OLMoE-1B-7B shapes and the suite with the GPU visible, in ONE
# device call, each step boxed by what is left of DEADLINE_S so that a slow step leaves the others their results:
#   0. the int8 product by row count (bench/gpu_numerics_probe.py, seconds)
#   1. in the background, on the CPU: a random bf16 checkpoint with OLMoE-1B-7B's config (LAYERS, default all 16;
#      13.8 GB) written on the device machine (never carried) for step 3
#   2. bench_offload.py's GPU suite (pinned host -> device peak; offloaded decode vs the roofline)
#      over SHAPES x ROUTINGS x SIZES x PAGINGS, the GPU otherwise quiet (the writer only uses one CPU core)
#   3. the research loop: bench_teacher_forced.py on that checkpoint, GPU visible: moejax vs transformers (bf16,
#      same GPU, same weights) without and with the Python routing hook (cache-prior λ = 0.5 + per-layer LRU,
#      C = N/2), and a 16-point vmapped λ sweep vs 16 passes
#   4. the test suite with the GPU visible in what is left (FIRST_TESTS first, then the rest)
# $OUT gets at most 8 files (the run tool's limit): env.txt, probe.txt, bench.txt, offload_gpu.json,
# teacher_forced.txt, teacher_forced_gpu.json, suite.txt, failures.txt.
#
#     DEADLINE_S=560 bash bench/gpu_offload_loop_and_suite.sh
#         # on the device (run tool, timeout_s 590; carry .shared-data.tar.xz)
#     SMALL=1 OUT=/tmp/gpu-offload-loop DEADLINE_S=300 bash bench/gpu_offload_loop_and_suite.sh
#         # the same path on this CPU (tiny shapes)
#
# Call from a throw-away branch without results/ and the shipped model (the tree must fit 64 MiB; see
# gpu_offload.sh). A second call on the same warm machine finds the checkpoint already written (REUSE=1 keeps it;
# STEPS picks steps, e.g. STEPS="offload suite"). LOOP_ARGS passes bench_teacher_forced.py flags (e.g. --route-on
# device for the one-program cache pass, --skip-plain).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_out
t_start=$(date +%s)
DEADLINE_S=${DEADLINE_S:-560}
STEPS=${STEPS:-"probe offload loop suite"}
work=${WORK:-/tmp/moejax-research-loop}
left() { echo $(( DEADLINE_S - ($(date +%s) - t_start) )); }
box() {  # box WANTED: WANTED seconds, or what is left (minus a margin) if less; at least 1
    local l; l=$(( $(left) - 10 )); local b=$(( $1 < l ? $1 : l )); echo $(( b > 1 ? b : 1 ))
}
want() { [[ " $STEPS " == *" $1 "* ]]; }
stamp() { echo "[$(( $(date +%s) - t_start )) s] $*" | tee -a "$OUT/env.txt"; }
small=()
[[ -n "${SMALL:-}" ]] && small=(--small)

{
    device_env torch
    shared_data
    nproc; free -g | head -2; df -h /tmp | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if want probe; then
    timeout "$(box 40)" python3 bench/gpu_numerics_probe.py > "$OUT/probe.txt" 2>&1
    stamp "probe exit $?: $(tail -1 "$OUT/probe.txt")"
fi

# 1. the checkpoint for step 3, in the background
writer=
if want loop; then
    if [[ -n "${SMALL:-}" ]]; then
        shape=(--layers 2 --set hidden_size=64 --set intermediate_size=32 --set num_experts=16
               --set num_experts_per_tok=4 --set vocab_size=512 --set num_attention_heads=4 --set num_key_value_heads=4)
        run=(--chunks 2 --context 128 --repeats 1)
    else
        shape=(--layers "${LAYERS:-16}")
        run=(--chunks "${CHUNKS:-2}" --context 1024 --repeats "${REPEATS:-1}" --threads 16)
    fi
    if [[ -n "${REUSE:-}" && -f "$work/olmoe/config.json" && -f "$work/written" ]]; then
        stamp "checkpoint kept from an earlier call"
    else
        mkdir -p "$work"; rm -f "$work/written"
        ( nice python3 -m moejax.testing.random_checkpoint olmoe-1b-7b "$work/olmoe" "${shape[@]}" --overwrite \
            > "$work/checkpoint.txt" 2>&1 && touch "$work/written" ) &
        writer=$!
        stamp "writing the checkpoint (pid $writer)"
    fi
fi

# 2. offloaded decode vs the roofline
if want offload; then
    timeout "$(box "${OFFLOAD_BOX:-150}")" python3 bench/bench_offload.py --suite gpu --layers 4 "${small[@]}" \
        --out "$OUT/offload_gpu.json" --shapes "${SHAPES:-olmoe}" --routings "${ROUTINGS:-original}" \
        --sizes "${SIZES:-0.5,0.25,0.125}" --pagings "${PAGINGS:-jit,host}" > "$OUT/bench.txt" 2>&1
    stamp "offload bench exit $? (124 = its box ran out)"
    tail -12 "$OUT/bench.txt"
fi

# 3. the research loop
if want loop; then
    if [[ -n "$writer" ]]; then
        wait "$writer"; stamp "checkpoint written (exit $?): $(du -sh "$work/olmoe" 2>/dev/null | cut -f1)"
    fi
    cat "$work/checkpoint.txt" >> "$OUT/env.txt" 2>/dev/null
    if [[ -f "$work/written" ]]; then
        XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.6} timeout "$(box "${LOOP_BOX:-240}")" \
            python3 bench/bench_teacher_forced.py --model "$work/olmoe" --dtype bfloat16 --lam 0.5 --cache-size 0.5 \
            --sweep-points 16 "${run[@]}" ${LOOP_ARGS:-} --out "$OUT/teacher_forced_gpu.json" > "$OUT/teacher_forced.txt" 2>&1
        stamp "research loop exit $? (124 = its box ran out; 1 = the engines disagree)"
        grep -v "Warning\|warner" "$OUT/teacher_forced.txt" | tail -14
    fi
    [[ -n "${REUSE:-}" ]] || rm -rf "$work"
fi

# 4. the suite with the GPU visible, in what is left: FIRST_TESTS, then the other files (two pytest runs: one run
# given both would take the folder in its own order, and a call cut short would never reach the files chosen first)
if want suite && (( $(left) > 40 )); then
    first=${FIRST_TESTS:-"tests/test_int8.py tests/test_layout.py tests/test_offload.py tests/test_overlap.py
        tests/test_page_writes.py tests/test_prefill_paging.py tests/test_prior.py tests/test_quant.py
        tests/test_random_checkpoint.py tests/test_routing.py tests/test_safety.py tests/test_scale.py
        tests/test_seeds.py tests/test_serve.py tests/test_simulate.py tests/test_studies.py tests/test_sweep.py
        tests/test_tasks.py tests/test_tempfiles.py tests/test_trace.py tests/test_train.py tests/test_cache.py
        tests/test_convert.py tests/test_dispatch.py"}
    rest=()
    for f in tests/test_*.py; do [[ " $(echo $first) " == *" $f "* ]] || rest+=("$f"); done
    export XLA_PYTHON_CLIENT_PREALLOCATE=false MOEJAX_TEST_FAILURE_LOG="$OUT/failures.txt"
    # shellcheck disable=SC2086  # a list of paths
    timeout "$(box 600)" python3 -m pytest -v -rfE -p no:cacheprovider -n "${SUITE_WORKERS:-8}" -m "not slow" \
        --durations 15 $first > "$OUT/suite.txt" 2>&1
    stamp "suite, first files: exit $? (124 = its box ran out): $(grep -c " PASSED " "$OUT/suite.txt") passed"
    if (( $(left) > 40 )); then
        timeout "$(box 600)" python3 -m pytest -v -rfE -p no:cacheprovider -n "${SUITE_WORKERS:-8}" -m "not slow" \
            "${rest[@]}" >> "$OUT/suite.txt" 2>&1
        stamp "suite, the rest: exit $?: $(grep -c " PASSED " "$OUT/suite.txt") passed in all"
    fi
    unset XLA_PYTHON_CLIENT_PREALLOCATE MOEJAX_TEST_FAILURE_LOG
    grep " FAILED \| ERROR " "$OUT/suite.txt" | head -40
fi
stamp "done"
ls -la "$OUT"
