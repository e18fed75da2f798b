#!/usr/bin/env bash
# The research loop at OLMoE-1B-7B shapes on a lent GPU machine, in ONE device call. A random
# bf16 checkpoint with OLMoE-1B-7B's config (16 layers, 64 experts, top-8, 6.9B parameters, 13.8 GB) is written
# on the device machine itself (never carried), then bench_teacher_forced.py runs on it with the GPU visible:
# moejax vs transformers (bf16, same GPU, same weights) on a teacher-forced pass, without and with the Python
# routing hook that simulates cache-prior lambda = 0.5 + a per-layer LRU of C = N/2 (goals >= 1x and >= 5x), and a
# 16-point vmapped lambda sweep vs 16 passes (goal >= 3x). $OUT gets the JSON and the log.
#
#     bash bench/gpu_research_loop.sh          # on the device (run tool; nothing to carry), timeout_s 580
#     SMALL=1 OUT=/tmp/gpu-loop bash bench/gpu_research_loop.sh   # the same path on this CPU (tiny shapes, ~1 min)
#
# Time on the device: writing the checkpoint took 9 s a layer on this 2-core CPU (numpy's generator, one
# thread): ~2.5 minutes for 16 layers, so LAYERS (default 16) may cut it (a cut keeps the real per-layer shapes:
# say which in docs/benchmarks.md). The tree a call carries must fit 64 MiB: call from a branch without results/ (see
# gpu_offload.sh). The device image has torch (the tests need it); torch runs on cuda when it sees the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
device_out
work=${WORK:-/tmp/moejax-research-loop}
mkdir -p "$work"
{
    device_env torch
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [[ -n "${SMALL:-}" ]]; then
    shape=(--layers 2 --set hidden_size=64 --set intermediate_size=32 --set num_experts=16 --set num_experts_per_tok=4
           --set vocab_size=512 --set num_attention_heads=4 --set num_key_value_heads=4)
    run=(--chunks 2 --context 128 --repeats 1)
else
    shape=(--layers "${LAYERS:-16}")
    # a λ sweep's 16 sequential passes run 1 + repeats times (LAYERS=4 CHUNKS=4 with 2 repeats ran past a 190 s
    # box on an H200), so the defaults are 2 chunks and 1 timed repeat; the bench logs every run: raise them
    # when the log shows the time is there
    run=(--chunks "${CHUNKS:-2}" --context 1024 --repeats "${REPEATS:-1}" --threads 16)
fi
t0=$(date +%s)
timeout "${WRITE_BOX:-240}" python3 -m moejax.testing.random_checkpoint olmoe-1b-7b "$work/olmoe" "${shape[@]}" --overwrite \
    > "$OUT/checkpoint.txt" 2>&1
write_rc=$?
echo "checkpoint written in $(( $(date +%s) - t0 )) s (exit $write_rc)" | tee -a "$OUT/env.txt"
timeout "${BENCH_BOX:-300}" python3 bench/bench_teacher_forced.py --model "$work/olmoe" --dtype bfloat16 \
    --lam 0.5 --cache-size 0.5 --sweep-points 16 "${run[@]}" --out "$OUT/teacher_forced_gpu.json" \
    > "$OUT/teacher_forced.txt" 2>&1
bench_rc=$?
grep -v "Warning\|warner" "$OUT/teacher_forced.txt" | tail -12
echo "summary: checkpoint exit $write_rc, bench exit $bench_rc (124 = its time box ran out; 1 = the engines disagree)" \
    | tee -a "$OUT/env.txt"
rm -rf "$work"
ls -la "$OUT"
