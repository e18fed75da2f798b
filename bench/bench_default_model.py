"""A side-by-side of default-model candidates: quality, routing shape and the cache-prior front.

    python bench/bench_default_model.py                                     # the shipped default alone
    python bench/bench_default_model.py --model default --model RUN/export  # the current one beside a candidate

Per model (float32 compute, as the studies run):

1. WikiText-2 raw test, whole, at ``--context`` 1024 with original routing and a per-layer LRU cache of
   C = N/2 (original routing ignores the cache, so this is the plain pass): perplexity per token and per
   word, expert-usage entropy per layer (share of its maximum log2 N), dead experts, the LRU miss rate and
   cache lifetime, and the fraction of a token's experts that the previous token also chose (``reuse``,
   beside what independent routing with the same usage shares would give).
2. The pareto study (``python -m moejax.studies --only pareto``, quick protocol: λ, cumsum p on
   ``--points`` 11 points, max-rank M = K..N, first ``--pareto-tokens`` 8,184 tokens), resumable in
   ``--work/<label>``; summarised at C = N/2 as the lowest miss rate each method reaches within +1/5/10 %
   of original routing's perplexity. Where the fronts coincide, the paper's comparison cannot show.
3. The default model's goals: word perplexity <= 150, usage entropy within 85-97 % of log2 N in every layer, no dead
   expert.

Prints a markdown table (models side by side) and writes every figure to ``--out`` (atomically).
docs/benchmarks.md#training has the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

import moejax
from moejax.base import atomic, errors
from moejax.evaluation import perplexity, studies, sweep_points
from moejax.runtime import simulate
from moejax.training import recipe

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, also when imported by path
import common  # noqa: E402  (bench/common.py)

common.score_the_shipped_wikitext()

WORD_PPL_GOAL = 150.0
ENTROPY_GOAL = (0.85, 0.97)  # usage entropy / log2 N, every layer
GOALS = ("word_ppl", "entropy", "no_dead_expert")  # the table's order (JSON files keep them sorted)
PPL_BOUNDS = (0.01, 0.05, 0.10)  # the front summary: lowest miss rate within +1/5/10 % of original's perplexity
FRONT_METHODS = ("cache-prior", "max-rank", "cumsum", "pruning")


def quality(model_arg: str, text: str, context: int, max_tokens: int | None, progress: bool) -> dict:
    """Step 1: one pass over the text, original routing, LRU at C = N/2."""
    model = moejax.load(model_arg, dtype=jnp.float32)
    n, k = model.cfg.n_experts, model.cfg.top_k
    context = min(context, model.cfg.max_position_embeddings)
    start = time.perf_counter()
    res = perplexity.wikitext_perplexity(model, text, context, max_tokens, routing="original",
                                         cache=simulate.CacheConfig(size=str(n // 2), eviction="lru"),
                                         progress=progress)
    usage = res["expert_usage"]
    return {
        "experts": n, "top_k": k, "layers": model.cfg.num_layers, "moe_layers": model.cfg.n_moe_layers,
        "parameters": recipe.count_params(model.params),
        "context": context, "tokens": res["tokens"], "words": res["words"], "seconds": time.perf_counter() - start,
        "ppl": res["ppl"], "ppl_word": res["ppl_word"], "bits_per_byte": res["bits_per_byte"],
        "entropy_bits": usage["entropy_bits"], "entropy_max_bits": usage["entropy_max_bits"],
        "normalized_entropy": usage["normalized_entropy"], "dead_experts": usage["dead_experts"],
        "max_share_over_uniform": usage["max_share_over_uniform"],
        "min_share_over_uniform": float(np.min(usage["share"]) * n),
        "lru_half": {"cache_size": n // 2, "miss_rate": res["miss_rate"],
                     "miss_rate_per_layer": res["cache"]["per_layer"]["miss_rate"],
                     "lifetime": res["lifetime"], "lifetime_std": res["lifetime_std"]},
        "reuse": usage["reuse"], "reuse_any": usage["reuse_any"], "reuse_independent": usage["reuse_independent"],
    }


def pareto(model_arg: str, work: str, context: int, tokens: int, points: int, progress: bool) -> list[dict]:
    """Step 2: the pareto study's records (computed, or read back where ``work`` already holds them)."""
    argv = ["--only", "pareto", "--model", model_arg, "--out", work, "--context", str(context),
            "--max-tokens", str(tokens), "--points", str(points)] + ([] if progress else ["--no-progress"])
    status = studies.main(argv)
    if status:
        raise errors.Failure(f"the pareto study of {model_arg} failed (exit {status}); see above")
    with open(os.path.join(work, "pareto.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    want = sweep_points.model_label(model_arg) + "@float32"  # how the studies name it (float32 compute)
    return [r for r in records if r.get("model") == want and r["metrics"].get("context") == context
            and r["metrics"].get("tokens") == tokens]


def front_summary(records: list[dict], cache_size: int) -> dict:
    """Per method at ``cache_size``: the lowest miss rate within each perplexity bound of original routing,
    and the method's Pareto-optimal (miss rate, perplexity) points."""
    at = [r for r in records if r.get("cache") and r["cache"]["capacity"] == cache_size and r.get("ppl")]
    original = [r for r in at if r["routing"]["kind"] == "original" and r.get("method") == "forward"]
    if not original:
        raise errors.Failure(f"the pareto records hold no original-routing pass at C = {cache_size}")
    base = original[0]["ppl"]
    belady = [r for r in at if r.get("method") == "replay" and r["cache"]["eviction"] == "belady"]
    out = {"cache_size": cache_size, "original": {"ppl": base, "miss_rate": original[0]["miss_rate"]},
           "belady_miss_rate": belady[0]["miss_rate"] if belady else None, "methods": {}}
    for method in FRONT_METHODS:
        pts = sorted((r["miss_rate"], r["ppl"]) for r in at if r["routing"]["kind"] == method
                     and r.get("method") == "forward")
        if not pts:
            continue
        front, best = [], math.inf
        for miss, ppl in pts:  # by miss rate: a point is optimal when nothing that misses less is as good
            if ppl < best:
                front.append([miss, ppl])
                best = ppl
        within = {f"+{round(b * 100)}%": min((m for m, p in pts if p <= base * (1 + b)), default=None)
                  for b in PPL_BOUNDS}
        out["methods"][method] = {"points": len(pts), "front": front, "lowest_miss_within": within}
    return out


def goals(q: dict) -> dict:
    low, high = ENTROPY_GOAL
    return {"word_ppl": q["ppl_word"] <= WORD_PPL_GOAL,
            "entropy": all(low <= e <= high for e in q["normalized_entropy"]),
            "no_dead_expert": q["dead_experts"] == 0}


def _fmt(x, spec=".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(results: dict) -> str:
    """The markdown table: one column per model."""
    labels = list(results)
    rows = [("parameters", lambda r: f"{r['quality']['parameters'] / 1e6:.1f}M"),
            ("experts, top-k, MoE layers", lambda r: f"{r['quality']['experts']}, {r['quality']['top_k']}, "
                                                     f"{r['quality']['moe_layers']}"),
            ("ppl per token (ctx %d)", lambda r: _fmt(r["quality"]["ppl"], ".2f")),
            ("ppl per word", lambda r: _fmt(r["quality"]["ppl_word"], ".1f")),
            ("usage entropy / max, per layer", lambda r: " ".join(f"{e:.3f}" for e in r["quality"]["normalized_entropy"])),
            ("dead experts; share min/max × uniform", lambda r: f"{r['quality']['dead_experts']}; "
             f"{r['quality']['min_share_over_uniform']:.2f}/{r['quality']['max_share_over_uniform']:.2f}"),
            ("LRU miss rate, C = N/2", lambda r: _fmt(r["quality"]["lru_half"]["miss_rate"], ".4f")),
            ("cache lifetime (tokens)", lambda r: f"{r['quality']['lru_half']['lifetime']:.1f} ± "
                                                  f"{r['quality']['lru_half']['lifetime_std']:.1f}"),
            ("experts the previous token chose (independent)",
             lambda r: f"{np.mean(r['quality']['reuse']):.3f} ({np.mean(r['quality']['reuse_independent']):.3f})"),
            ("consecutive tokens sharing an expert", lambda r: f"{np.mean(r['quality']['reuse_any']):.3f}")]
    for bound in PPL_BOUNDS:
        key = f"+{round(bound * 100)}%"
        rows.append((f"lowest miss rate within {key} ppl: λ / max-rank / cumsum",
                     lambda r, key=key: " / ".join(
                         _fmt(r["front"]["methods"].get(m, {}).get("lowest_miss_within", {}).get(key), ".3f")
                         for m in ("cache-prior", "max-rank", "cumsum")) if r.get("front") else "-"))
    rows.append(("Belady miss rate, C = N/2 (original routing)",
                 lambda r: _fmt(r["front"]["belady_miss_rate"], ".3f") if r.get("front") else "-"))
    rows.append(("goals: word ppl ≤ 150 / entropy 85–97 % / no dead",
                 lambda r: " / ".join("yes" if r["goals"][g] else "no" for g in GOALS)))
    context = results[labels[0]]["quality"]["context"]
    lines = ["| | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name, cell in rows:
        lines.append(f"| {name.replace('%d', str(context))} | "
                     + " | ".join(cell(results[label]) for label in labels) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="a model (repeat to compare; default: default)")
    p.add_argument("--label", action="append", default=[], help="a column name per --model (default: the path)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N WikiText tokens (step 1)")
    p.add_argument("--pareto-tokens", type=int, default=8184, help="tokens of the pareto study (0: skip it)")
    p.add_argument("--points", type=int, default=11)
    p.add_argument("--data", default=None, help="WikiText-2 raw test (default: the copy in tests/data)")
    p.add_argument("--work", default=os.path.join("bench", "results", "default_model"),
                   help="the pareto studies' folders, one per label (resumable)")
    p.add_argument("--out", default=os.path.join("bench", "results", "default_model.json"))
    p.add_argument("--include", action="append", default=[], metavar="JSON",
                   help="columns measured earlier: an --out file of this script, its models shown first (the GPU run "
                        "measures the candidate alone and shows it beside the CPU's figures of the shipped model)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    models = args.model or ["default"]
    labels = args.label or [m if m == "default" else os.path.basename(os.path.normpath(m)) for m in models]
    try:
        if len(labels) != len(models):
            raise errors.UsageError(f"{len(labels)} --label for {len(models)} --model: give one per model, or none")
        if len(set(labels)) != len(labels):
            raise errors.UsageError(f"two models would share a column: labels {labels} (give --label)")
        if args.context < 2 or args.points < 1 or args.pareto_tokens < 0 or (args.max_tokens or 1) < 1:
            raise errors.UsageError("--context must be >= 2, --points >= 1, --pareto-tokens >= 0, --max-tokens >= 1")
        results = {}
        for path in args.include:
            try:
                with open(path, encoding="utf-8") as f:
                    earlier = json.load(f)["models"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise errors.UsageError(f"--include {path}: not a results file of this script ({e})") from None
            for label, entry in earlier.items():
                if label in labels or label in results:
                    raise errors.UsageError(f"--include {path}: its column {label!r} is also measured here "
                                            "(give --label)")
                results[label] = entry
        text = perplexity.load_wikitext(args.data)
        for model_arg, label in zip(models, labels):
            print(f"== {label}: {model_arg}", file=sys.stderr)
            q = quality(model_arg, text, args.context, args.max_tokens, not args.no_progress)
            entry = {"model": model_arg, "quality": q, "goals": goals(q), "front": None}
            if args.pareto_tokens:
                recs = pareto(model_arg, os.path.join(args.work, label), q["context"], args.pareto_tokens,
                              args.points, not args.no_progress)
                entry["front"] = front_summary(recs, q["experts"] // 2)
            results[label] = entry
    except errors.HANDLED as e:
        return errors.report(e)
    atomic.write_json(args.out, {"command": ["python", "bench/bench_default_model.py", *(argv or sys.argv[1:])],
                                 "goals": {"word_ppl_max": WORD_PPL_GOAL, "normalized_entropy": ENTROPY_GOAL},
                                 "models": results}, make_parents=True)
    print(table(results))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
