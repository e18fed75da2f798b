"""The Belady bound under the co-residency rule vs the looser bypass variant, on the default model's own
original-routing trace.

    python bench/bench_belady.py [--chunks 8] [--context 1024] [--out bench/results/belady.json]

Records the experts original routing picks on the first ``--chunks`` chunks of the WikiText-2 test text
(the studies' tokens: 8 × 1,023 + BOS at context 1024), concatenates them into one trace (the cache carries
across chunks, as in the studies), and replays it with per-layer caches of every size C = 1…N under LRU,
``belady`` (this step's K experts co-resident and evicted last, like every policy: the bound of the
caches moejax compares) and ``belady-bypass`` (classic Belady that may evict this step's experts at once);
then the same for one global pool of 5/10/25/50 % of all L·N experts.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import moejax
from moejax.base import atomic
from moejax.experts import trace as trace_lib
from moejax.evaluation import perplexity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when imported by path
import common  # noqa: E402  (bench/common.py)

common.score_the_shipped_wikitext()


def record(model, n_chunks: int, context: int) -> trace_lib.Trace:
    ids = np.asarray(model.tokenizer.encode(perplexity.load_wikitext(), add_special_tokens=False), np.int32)
    chunks = perplexity.chunk_tokens(ids, context, model.cfg.bos_token_id)[:n_chunks]
    experts, weights = [], []
    for chunk in chunks:
        out = model.forward(chunk)
        experts.append(np.asarray(out.experts).transpose(1, 0, 2))  # [T, L, K]
        weights.append(np.asarray(out.weights).transpose(1, 0, 2))
    return trace_lib.validate_trace(np.concatenate(experts), np.concatenate(weights), n_experts=model.cfg.n_experts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/belady.json")
    args = ap.parse_args()
    model = moejax.load("default", dtype="float32")
    tr = record(model, args.chunks, args.context)
    n = model.cfg.n_experts
    rows = []
    print(f"original-routing trace: {tr.shape[0]} tokens × {tr.shape[1]} layers × K = {tr.shape[2]}, N = {n}")
    print(f"{'C':>3s} {'lru':>8s} {'belady':>8s} {'bypass':>8s}")
    for c in range(1, n + 1):
        rates = {ev: trace_lib.replay(tr, str(c), "layer", ev)["miss_rate"] for ev in ("lru", "belady", "belady-bypass")}
        rows.append({"capacity": c, **rates})
        print(f"{c:3d} {rates['lru']:8.4f} {rates['belady']:8.4f} {rates['belady-bypass']:8.4f}", flush=True)
    print("one global pool (a share of all L·N experts):")
    pool = []
    for size in ("5%", "10%", "25%", "50%"):
        rates = {ev: trace_lib.replay(tr, size, "global", ev)["miss_rate"] for ev in ("lru", "belady", "belady-bypass")}
        pool.append({"size": size, **rates})
        print(f"{size:>4s} {rates['lru']:8.4f} {rates['belady']:8.4f} {rates['belady-bypass']:8.4f}", flush=True)
    result = {"command": " ".join(sys.argv), "tokens": int(tr.shape[0]), "chunks": args.chunks,
              "context": args.context, "scope": "layer", "rows": rows, "global": pool}
    atomic.write_json(args.out, result, indent=1, sort_keys=False, make_parents=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
