"""Learned prior vs training-free cache-prior: WikiText perplexity against miss rate at C = N/2 and N/4.

    python bench/bench_learned_prior.py --priors build/priors/default-c{size} [--tokens 32768]
        [--context 1024] [--sizes 0.5,0.25] [--lams 0,0.1,...] [--resume]

Every point is ``perplexity.wikitext_perplexity`` on the first ``--tokens`` tokens of the WikiText-2 raw test
text (context 1024, cache carried across chunks, per-layer LRU), with the default model. Learned priors are
read from ``--priors`` (``{size}`` is replaced by each cache size; one checkpoint folder ``w*`` per trained
weight, as ``python -m moejax.train_prior --out`` writes them). Points are appended to ``points.jsonl`` as
they are computed (``--resume`` skips those already there); ``front.png``/``front.svg`` and
``summary.json`` (fronts, dominance) are written from all points at the end, in ``--out`` (default
``results/learned_prior``). With no text given the shipped WikiText-2 copy in ``tests/data`` is scored.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py)

common.score_the_shipped_wikitext()
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "learned_prior")


def point_key(p: dict) -> tuple:
    r = p["routing"]
    return (p["cache"]["size"], r["kind"], r.get("lam"), r.get("top_j"), r.get("weight"), p.get("tokens"),
            p.get("context"))


def dominates(a: dict, b: dict) -> bool:
    """a is at least as good in both perplexity and miss rate, and strictly better in one."""
    return (a["ppl"] <= b["ppl"] and a["miss_rate"] <= b["miss_rate"]
            and (a["ppl"] < b["ppl"] or a["miss_rate"] < b["miss_rate"]))


def pareto(points: list[dict]) -> list[dict]:
    return sorted([p for p in points if not any(dominates(q, p) for q in points)], key=lambda p: p["miss_rate"])


def front_ppl_at(front: list[dict], miss: float) -> float | None:
    """Perplexity of the piecewise-linear cache-prior front at ``miss`` (None outside its miss-rate range)."""
    xs = [p["miss_rate"] for p in front]
    if not xs or miss < min(xs) or miss > max(xs):
        return None
    return float(np.interp(miss, xs, [p["ppl"] for p in front]))


def _label(p: dict) -> str:
    r = p["routing"]
    return f"lam={r['lam']:g},J={r['top_j']}" if r["kind"] == "cache-prior" else f"w={r['weight']:g}"


def compare(points: list[dict]) -> dict:
    """Per cache size: the cache-prior Pareto front (all λ and J) and, per learned point, which cache-prior
    points it dominates / is dominated by and its perplexity minus the front's (linear between points)."""
    out = {}
    for size in sorted({p["cache"]["size"] for p in points}, key=float, reverse=True):
        here = [p for p in points if p["cache"]["size"] == size]
        cp = [p for p in here if p["routing"]["kind"] == "cache-prior"]
        lp = [p for p in here if p["routing"]["kind"] == "learned-prior"]
        front = pareto(cp)
        rows = []
        for p in sorted(lp, key=lambda p: p["routing"]["weight"]):
            dominated_cp = [_label(q) for q in cp if dominates(p, q)]
            dominated_by = [_label(q) for q in cp if dominates(q, p)]
            ref = front_ppl_at(front, p["miss_rate"])
            rows.append({"weight": p["routing"]["weight"], "ppl": p["ppl"], "miss_rate": p["miss_rate"],
                         "dominates_cache_prior_lams": dominated_cp, "dominated_by_cache_prior_lams": dominated_by,
                         "cache_prior_front_ppl_at_same_miss": ref,
                         "ppl_minus_front": None if ref is None else p["ppl"] - ref})
        out[size] = {"capacity": here[0]["cache"]["capacity"],
                     "cache_prior_front": [(_label(q), q["miss_rate"], q["ppl"]) for q in front],
                     "learned": rows,
                     "learned_dominates_some_cache_prior_point": any(r["dominates_cache_prior_lams"] for r in rows),
                     "learned_below_cache_prior_front": any((r["ppl_minus_front"] or 0) < 0 for r in rows)}
    return out


def plot(points: list[dict], path_stem: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({p["cache"]["size"] for p in points}, key=float, reverse=True)
    fig, axes = plt.subplots(2, len(sizes), figsize=(5.6 * len(sizes), 8.4), squeeze=False)
    panels = [(ax, size, zoom) for zoom, row in zip((False, True), axes) for ax, size in zip(row, sizes)]
    for ax, size, zoom in panels:
        here = [p for p in points if p["cache"]["size"] == size]
        lp = sorted([p for p in here if p["routing"]["kind"] == "learned-prior"], key=lambda p: p["routing"]["weight"])
        js = sorted({p["routing"]["top_j"] for p in here if p["routing"]["kind"] == "cache-prior"}, reverse=True)
        for j, (marker, color) in zip(js, [("o-", "tab:blue"), ("^:", "tab:cyan"), ("v:", "tab:green")]):
            cp = sorted([p for p in here if p["routing"]["kind"] == "cache-prior" and p["routing"]["top_j"] == j],
                        key=lambda p: p["routing"]["lam"])
            ax.plot([p["miss_rate"] for p in cp], [p["ppl"] for p in cp], marker, color=color,
                    label=f"cache-prior (λ grid, J={j})")
            for p in cp:
                ax.annotate(f"{p['routing']['lam']:g}", (p["miss_rate"], p["ppl"]), fontsize=7, color=color,
                            textcoords="offset points", xytext=(3, 3))
        if lp:
            ax.plot([p["miss_rate"] for p in lp], [p["ppl"] for p in lp], "s--", color="tab:red",
                    label="learned prior (loss weight w)")
            for p in lp:
                ax.annotate(f"w={p['routing']['weight']:g}", (p["miss_rate"], p["ppl"]), fontsize=7,
                            color="tab:red", textcoords="offset points", xytext=(3, -10))
        cap = here[0]["cache"]["capacity"]
        panel = f"C = {cap} of {here[0]['cache']['n_experts']} experts per layer (LRU)"
        if zoom:  # the region where the fronts compete: perplexity within 3 % of original routing
            base = min(p["ppl"] for p in here)
            ax.set_ylim(base * 0.998, base * 1.03)
            panel += ", zoom: ppl ≤ +3 %"
        else:
            ax.set_yscale("log")
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("miss rate")
        ax.set_ylabel("WikiText-2 perplexity (per token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    for ext in ("png", "svg"):
        fig.savefig(f"{path_stem}.{ext}", dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--priors", default="build/priors/default-c{size}")
    ap.add_argument("--sizes", default="0.5,0.25")
    ap.add_argument("--lams", default="0,0.1,0.2,0.3,0.5,0.7,1")
    ap.add_argument("--top-j", type=int, default=None, help="cache-prior J (default: 1 if K=2 else 2)")
    ap.add_argument("--skip-learned", action="store_true", help="only the cache-prior points")
    ap.add_argument("--weights", default=None, help="only these trained weights (default: every w* folder)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args(argv)

    points_path = os.path.join(args.out, "points.jsonl")
    points: list[dict] = []
    if (args.resume or args.plot_only) and os.path.isfile(points_path):
        with open(points_path) as f:
            loaded = [json.loads(line) for line in f if line.strip()]
        unique = {}
        for p in loaded:  # an interrupted and resumed run may have written a point twice: keep the first
            unique.setdefault(point_key(p), p)
        points = list(unique.values())
        if len(points) != len(loaded):
            with open(points_path, "w") as f:
                f.writelines(json.dumps(p) + "\n" for p in points)
    elif os.path.exists(points_path):
        os.remove(points_path)
    done = {point_key(p) for p in points}

    if not args.plot_only:
        import moejax
        from moejax.evaluation import perplexity
        from moejax.experts import routing
        from moejax.runtime import simulate
        from moejax.experts import prior as prior_lib

        model = moejax.load(args.model)
        cfg = model.cfg
        text = perplexity.load_wikitext()
        wanted = None if args.weights is None else {float(w) for w in args.weights.split(",")}

        def run(size: str, rkey: dict, policy) -> None:
            cache = simulate.CacheConfig(size)
            point = {"routing": rkey, "cache": {"size": size, "capacity": cache.capacity(cfg),
                                                "n_experts": cfg.n_experts, "scope": "layer", "eviction": "lru"},
                     "tokens": args.tokens, "context": args.context, "model": args.model}
            if point_key(point) in done:
                return
            t0 = time.perf_counter()
            res = perplexity.wikitext_perplexity(model, text, args.context, args.tokens, policy, cache)
            point.update(ppl=res["ppl"], miss_rate=res["miss_rate"], lifetime=res["lifetime"],
                         bytes_per_token=res["bytes_per_token"], seconds=round(time.perf_counter() - t0, 1))
            points.append(point)
            done.add(point_key(point))
            with open(points_path, "a") as f:
                f.write(json.dumps(point) + "\n")
            print(f"C={size} {rkey}: ppl {res['ppl']:.3f} miss {res['miss_rate']:.4f} "
                  f"({point['seconds']} s)", flush=True)

        for size in args.sizes.split(","):
            top_j = routing.default_top_j(cfg.top_k) if args.top_j is None else args.top_j
            for lam in (float(x) for x in args.lams.split(",")):
                run(size, {"kind": "cache-prior", "lam": lam, "top_j": top_j},
                    routing.make_policy("cache-prior", cfg.top_k, lam=lam, top_j=top_j))
            folder = args.priors.format(size=size)
            for path in [] if args.skip_learned else sorted(glob.glob(os.path.join(folder, "w*"))):
                meta = prior_lib.read_sidecar(path)
                if wanted is not None and float(meta["weight"]) not in wanted:
                    continue
                if str(meta["cache"]["size"]) != size:
                    raise ValueError(f"{path} was trained with cache size {meta['cache']['size']}, not {size}")
                params = prior_lib.load_prior(path, cfg.n_moe_layers, cfg.n_experts, cfg.top_k)
                rkey = {"kind": "learned-prior", "weight": float(meta["weight"]),
                        "prior": os.path.relpath(path), "trained_cache_size": meta["cache"]["size"],
                        "steps": meta["steps"], "hidden": meta["arch"]["hidden"],
                        "train_tokens": meta["data"]["train_tokens"]}
                run(size, rkey, routing.make_policy("learned-prior", cfg.top_k, prior=params))

    summary = compare(points)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    plot(points, os.path.join(args.out, "front"),
         f"default model, WikiText-2 test first {args.tokens} tokens, context {args.context}, per-layer LRU")
    for size, s in summary.items():
        print(f"C={size}: learned dominates some cache-prior point: {s['learned_dominates_some_cache_prior_point']}; "
              f"below the cache-prior front somewhere: {s['learned_below_cache_prior_front']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
