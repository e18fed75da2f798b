#!/usr/bin/env bash
# Issue 15 on the lent GPU machine in ONE device call: train the granular default model on the corpus
# carried there, export it, put it side by side with the shipped default (bench_default_model.py), and
# leave in $OUT what must come back (at most 8 files of <= 16 MiB, 64 MiB together).
#
# Here, before the call (no device time):
#     bash bench/gpu_default_model.sh --prepare      # .corpus/ (shard 00 + the head of shard 07) and
#                                                    # .corpus-tokenizer/ (the shipped default's tokenizer),
#                                                    # both git-ignored: they travel only when carried
# The call (run tool; carry both folders; MINUTES of training, the rest is set-up, export and evaluation):
#     MINUTES=5 bash bench/gpu_default_model.sh      # carry: [".corpus", ".corpus-tokenizer"], timeout_s 600
# Back here: cat $files_at/model.tar.part-* | tar x -C /somewhere; the card is $files_at/card.json.
#
# A dry run of the whole path on this CPU (tiny model, minutes): CONFIG=micro MINUTES=0.5 BATCH=4 SEQ=128 \
#     PARETO_TOKENS=0 OUT=/tmp/gpu-out bash bench/gpu_default_model.sh
#
# Why the corpus is cut: the device call carries the working tree and the carried paths in 64 MiB; the
# tree is ~36 MiB (the shipped default is 28 of them), so one training shard (18.8 MB gzip, 13.3M tokens)
# and the validation text fit, not more. A run longer than one pass sees the shard again in a new order.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--prepare" ]]; then
    src=${CORPUS_SRC:-../shared/data/corpus}
    rm -rf .corpus .corpus-tokenizer && mkdir -p .corpus .corpus-tokenizer
    cp "$src"/enwiki-2015-wikitext-style-00.txt.gz .corpus/
    # validation reads the first 4M characters of the last shard: carry 5M of them
    python3 -c "import gzip,sys; sys.stdout.write(gzip.open(sys.argv[1],'rt',encoding='utf-8').read(5_000_000))" \
        "$src"/enwiki-2015-wikitext-style-07.txt.gz | gzip -9 > .corpus/enwiki-2015-wikitext-style-07.txt.gz
    cp moejax/assets/default-model/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} .corpus-tokenizer/
    du -sh .corpus .corpus-tokenizer
    exit 0
fi

: "${OUT:?OUT must name the folder to return files from}"
MINUTES=${MINUTES:-5}
CONFIG=${CONFIG:-granular}
BATCH=${BATCH:-64}
SEQ=${SEQ:-1024}
PARETO_TOKENS=${PARETO_TOKENS:-8184}
WORK=${WORK:-/tmp/moejax-gpu}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
log="$WORK/log.txt"
{
    date
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -2 || true
    python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
    rm -rf "$WORK/data" && mkdir -p "$WORK/data" && cp .corpus-tokenizer/* "$WORK/data/"
    # the recipe (bench/train_default.md, "The GPU run"): balancing 0.01 with the router remedies
    python3 -m moejax.train --out "$WORK/run" --overwrite --config "$CONFIG" --steps auto --time-budget-min "$MINUTES" \
        --batch "$BATCH" --seq-len "$SEQ" --lr 3e-3 --warmup 200 --min-lr-ratio 0.1 \
        --aux-coef 0.01 --z-coef 1e-3 --router-lr-scale 0.1 --offset-coef "${OFFSET_COEF:-1.0}" \
        --compute-dtype bfloat16 --attention auto --eval-every 200 --eval-seqs 64 --ckpt-every 0 --ckpt-minutes 1000 \
        --corpus-dir .corpus --data-dir "$WORK/data" --seed 0
    python3 -m moejax.train --out "$WORK/run" --export "$WORK/model"
    if [[ "$PARETO_TOKENS" == 0 ]]; then extra=(--max-tokens 20000); else extra=(); fi
    # the shipped model's column was measured on the CPU (bench/results/default_model.json): only the new one here
    python3 bench/bench_default_model.py --include bench/results/default_model.json --model "$WORK/model" \
        --label trained --pareto-tokens "$PARETO_TOKENS" --work "$WORK/card" --out "$OUT/card.json" --no-progress \
        "${extra[@]}"
    date
} 2>&1 | tee "$log" | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" || status=$?
# what comes back, whatever failed above: the model in parts of 15 MiB, the metrics, the log
if [[ -d "$WORK/model" ]]; then tar cf - -C "$WORK" model | split -b 15M - "$OUT/model.tar.part-"; fi
if [[ -f "$WORK/run/metrics.jsonl" ]]; then gzip -c "$WORK/run/metrics.jsonl" > "$OUT/metrics.jsonl.gz"; fi
tr '\r' '\n' < "$log" | grep -v "it/s\]\|s/it\]" | tail -c 1000000 > "$OUT/log.txt" || true
ls -la "$OUT"
exit "${status:-0}"
