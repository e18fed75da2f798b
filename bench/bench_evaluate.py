"""Evaluation harness benchmark: full WikiText-2 test perplexity + miss rate for one policy point,
and a λ sweep timed as a loop of single points and as vmapped batches, extrapolated to the full text.

    python bench/bench_evaluate.py [--model default] [--dtype float32] [--context 1024]
        [--full-tokens 0] [--sweep-points 50] [--sweep-tokens 2046] [--batch-sizes 1,8]

1. One point, the whole WikiText-2 raw test (``--full-tokens 0``): cache-prior λ = 0.5, per-layer LRU cache
   of N/2, context 1024 — what ``python -m moejax.evaluate --routing cache-prior --lam 0.5 --cache-size 0.5``
   computes (through the sweep engine, one point, compilation included in the wall time).
2. ``--sweep-points`` equidistant λ in [0, 1] over the first ``--sweep-tokens`` tokens, through
   ``sweep.Runner`` (JSONL appends included), for each batch size; compilation is timed apart (one warm-up
   batch on the first chunk). The full-text figure is extrapolated: steady-state seconds per point-chunk ×
   points × chunks of the full text, plus the compilation — labelled as an extrapolation.

Writes ``bench/results/evaluate.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.experts import routing
from moejax.runtime import simulate
from moejax.evaluation import perplexity, sweep, sweep_points

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when imported by path
import common  # noqa: E402  (bench/common.py)

common.score_the_shipped_wikitext()


def lam_points(model, label, n_points, tokens, context, size):
    out = []
    for lam in np.linspace(0.0, 1.0, n_points).tolist():
        out.append(sweep_points.make_point(model, label, context=context, max_tokens=tokens, sweep={"lam": lam},
                                           routing=sweep_points.routing_record("cache-prior", model.cfg.top_k, lam=lam),
                                           policy=routing.make_policy("cache-prior", model.cfg.top_k, lam=lam),
                                           cache=simulate.CacheConfig(size)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--full-tokens", type=int, default=0, help="tokens of the one-point run (0 = all)")
    p.add_argument("--sweep-points", type=int, default=50)
    p.add_argument("--sweep-tokens", type=int, default=2046)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--skip-full", action="store_true")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "evaluate.json"))
    args = p.parse_args(argv)
    model = moejax.load(args.model, dtype=getattr(jnp, args.dtype))
    label = sweep_points.model_label(args.model) + f"@{args.dtype}"
    text = perplexity.load_wikitext()
    size = str(model.cfg.n_experts // 2)
    full_inp = sweep.wikitext_input(model, text, args.context, args.full_tokens or None)
    n_full_chunks = len(full_inp.chunks)
    result = {"model": label, "context": args.context, "cache_size": size, "machine": platform.processor() or
              platform.machine(), "cpus": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
              "load_average_start": os.getloadavg()}

    if not args.skip_full:
        pt = sweep_points.make_point(model, label, context=args.context, max_tokens=args.full_tokens or None,
                                     routing=sweep_points.routing_record("cache-prior", model.cfg.top_k, lam=0.5),
                                     policy=routing.make_policy("cache-prior", model.cfg.top_k, lam=0.5),
                                     cache=simulate.CacheConfig(size))
        runner = sweep.Runner(model, batch_size=1, progress=True, load_text=lambda data: text)
        t0 = time.perf_counter()
        rec = runner.run([pt])[0]
        wall = time.perf_counter() - t0
        result["full_point"] = {"tokens": rec["metrics"]["tokens"], "chunks": rec["metrics"]["chunks"],
                                "ppl": rec["ppl"], "ppl_word": rec["metrics"]["ppl_word"],
                                "miss_rate": rec["miss_rate"], "lifetime": rec["lifetime"],
                                "bytes_per_token": rec["bytes_per_token"], "wall_s": wall,
                                "s_per_chunk": wall / rec["metrics"]["chunks"]}
        print(f"full WikiText-2 test, cache-prior λ=0.5, C={size}: ppl {rec['ppl']:.2f}  miss rate "
              f"{rec['miss_rate']:.4f}  lifetime {rec['lifetime']:.1f}  {wall:.0f} s "
              f"({rec['metrics']['chunks']} chunks)", flush=True)

    inp = sweep.wikitext_input(model, text, args.context, args.sweep_tokens)
    n_chunks = len(inp.chunks)
    result["sweep"] = {"points": args.sweep_points, "tokens": int(len(inp.ids)), "chunks": n_chunks, "runs": []}
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        pts = lam_points(model, label, args.sweep_points, args.sweep_tokens, args.context, size)
        t0 = time.perf_counter()  # compile: one batch on the first chunk (same shape as every chunk)
        sweep.run_forward_batch(model, inp.chunks[:1], inp.text, inp.ids, args.context, pts[:b], b)
        first = time.perf_counter() - t0
        with tempfile.TemporaryDirectory() as tmp:
            runner = sweep.Runner(model, results=os.path.join(tmp, "r.jsonl"), batch_size=b, progress=True,
                                  load_text=lambda data: text)
            t0 = time.perf_counter()
            recs = runner.run(pts)
            wall = time.perf_counter() - t0
        n_batches = math.ceil(args.sweep_points / b)
        per_batch_chunk = wall / (n_batches * n_chunks)
        compile_s = max(first - per_batch_chunk, 0.0)
        per_point_chunk = wall / (args.sweep_points * n_chunks)  # padding of the last batch charged to all
        full_est = per_point_chunk * args.sweep_points * n_full_chunks + compile_s
        run = {"batch_size": b, "wall_s": wall, "compile_s": compile_s, "s_per_point_chunk": per_point_chunk,
               "extrapolated_full_sweep_s": full_est, "full_chunks": n_full_chunks,
               "ppl_lam0": recs[0]["ppl"], "ppl_lam1": recs[-1]["ppl"], "miss_lam0": recs[0]["miss_rate"],
               "miss_lam1": recs[-1]["miss_rate"]}
        result["sweep"]["runs"].append(run)
        print(f"{args.sweep_points}-point λ sweep, batch {b}: {wall:.0f} s on {len(inp.ids)} tokens "
              f"({per_point_chunk:.2f} s per point-chunk, compile {compile_s:.0f} s); full text extrapolated: "
              f"{full_est / 3600:.2f} h", flush=True)
    result["load_average_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
