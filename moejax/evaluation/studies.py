"""The paper's studies on one model, each written to ``<out>/<study>.jsonl`` through the sweep machinery.

    python -m moejax.studies [--out results/studies] [--only pareto,cache_size] [--max-tokens 8184]
                             [--points 16] [--model default] [--batch-size N] [--cache-sizes all]
    python -m moejax.studies --protocol paper     # the paper's grids and budgets (below)

Every study resumes: rerunning the command skips the points already in its file (and copies a point that
another study's file already holds, e.g. the λ grid the ``delta`` study shares with ``pareto``). The first
``--max-tokens`` tokens of WikiText-2 test are scored, chunked to ``--context`` (a multiple of
``context - 1`` keeps every chunk the same length: one compiled program per policy kind).

``--protocol paper`` sets what the paper measured (§4): cumsum p and λ on 50 points, the first 65,536 tokens
(rounded up to whole chunks: 65 x 1023 = 66,495 at context 1024), the lifetimes on the whole test text and
the cache-size study at every C = 1..N; flags given explicitly still win.

Studies (paper: Skliar et al., "Mixture of Cache-Conditional Experts for Efficient Mobile Device Inference";
SpecMD: Hoang et al., "SpecMD: A Comprehensive Study on Speculative Expert Prefetching"):

  pareto       perplexity vs miss rate, per-layer LRU at C = N/2 and N/4: pruning h = 2..K, max-rank
               M = K..N (M <= K keeps the top-K set: it *is* original routing), cumsum p and cache-prior λ
               on ``--points`` equidistant points in [0, 1], original routing, and the Belady bound (the
               recorded original-routing trace replayed with Belady eviction: its miss rate at the
               original perplexity). Paper figures 4 and 14.
  cache_size   C = 1..N (``--cache-sizes``: 11 sizes by default, ``all`` = every C): LRU and Belady miss rates of original routing (trace replay), cache-prior on a λ
               grid, and per perplexity bound (+1/5/10 %) the grid point with the lowest miss rate within
               it (records with ``method: "selection"``). Figure 10.
  lifetimes    lifetime mean/std and miss rate at C = N/2 on ``--lifetimes-max-tokens`` (0 = the whole text):
               original routing (LRU, and its trace replayed with Belady), cache-prior λ = 0.5 and
               cache-prior at the knee of the pareto front (run pareto first). Table 2.
  sensitivity  no cache: drop all experts ranked >= k; replace the rank-k expert by a random one (router
               hooks below), k = 1..K, and the unmodified baseline. Figure 2.
  init         initial cache empty vs random (seeded), original and cache-prior λ = 0.5 / 0.8, C = N/2;
               ``metrics.miss_rate_first_tokens`` holds the miss rate over the first 16/64/256/1024 tokens.
               Appendix G.
  delta        cache-prior on the λ grid with the running Δavg vs a fixed Δ calibrated, per MoE layer, as the
               layer's mean logit range max(z) - min(z) over the first ``--max-tokens`` tokens of the held-out
               training shard 07 (``metrics.delta_calibration``). Appendix D.
  eviction     one global pool of 5/10/25/50 % of L·N experts: LRU, LFU, FLD, score, Least-Stale and
               Belady on the recorded original-routing trace, with collision misses (SpecMD figure 4); and
               speculative next-layer prefetch off / top-K / 80th percentile with per-layer LRU at N/2 and
               N/4 (real passes: ``prefetch_precision`` / ``prefetch_recall``).
  tasks        MMLU (5-shot) and GSM8K (8-shot CoT) accuracy vs miss rate on the first ``--mmlu-limit`` /
               ``--gsm8k-limit`` examples: cache-prior λ = 0 (= original routing), 0.3, 0.5, 0.9, C = N/2
               (needs ``moejax.evaluation.tasks``). Figures 5 and 6.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import lzma
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import atomic, collector, commands, compile_cache, distributed, errors, interrupts, paths, seeds
from moejax.models.gating import descending_order
from moejax.experts import routing as routing_lib
from moejax.runtime import api, cli_options, simulate
from moejax.evaluation import perplexity, results as results_file, sweep, sweep_points

STUDIES = ("pareto", "lifetimes", "init", "delta", "cache_size", "sensitivity", "eviction", "tasks")
CALIBRATION_SHARD = "enwiki-2015-wikitext-style-07.txt.gz"  # the training corpus's held-out shard
CALIBRATION_CHARS = 200_000
CACHE_SIZE_LAMS = (0.05, 0.1, 0.2, 0.3, 0.5)
PPL_BOUNDS = (0.01, 0.05, 0.10)
EVICTIONS = ("lru", "lfu", "fld", "score", "least-stale", "belady")
GLOBAL_SIZES = ("5%", "10%", "25%", "50%")
PREFETCH = {"off": {}, "top-K": {"prefetch": 1.0}, "p80": {"prefetch_percentile": 80.0}}


# ------------------------------------------------------------------------------------ sensitivity hooks


@dataclasses.dataclass(frozen=True)
class RankHook:
    """Router hook for the sensitivity study (paper §2.3, figure 2); same signature as ``model.original_router``
    hooks and ``simulate.CacheRouter``: ``hook(moe_index, z [T, N], state) -> (experts, weights, state, record)``.

    mode "drop":   keep the experts ranked 1..k-1 of the architecture's own ranking, drop the rest (k = 1
                   drops every routed expert); the kept ones are weighted by the architecture's gating of
                   the kept set (renormalised where it renormalises — the same as the pruning policy).
    mode "random": replace the rank-k expert (1-based) by an expert drawn uniformly from those outside the
                   original top-K; the new set is weighted by the architecture's gating from the original
                   logits. The draw for token position p at MoE layer l uses ``fold_in(fold_in(key(seed),
                   l), p)``, so it is reproducible and independent of chunking.

    ``k`` is data (``state["rank"]``), so every k shares one compiled program; ``state["pos"]`` counts the
    tokens seen, advanced after the last MoE layer of each pass. Start from ``init_state(k)``.
    """

    gating: Any
    n_layers: int
    mode: str = "random"
    seed: int = 0

    def __post_init__(self):
        if self.mode not in ("drop", "random"):
            raise ValueError(f"RankHook mode must be 'drop' or 'random', got {self.mode!r}")

    def init_state(self, rank: int, bias=None) -> dict:
        """``bias``: the model's selection biases [L, N] (``model.selection_biases``; DeepSeek-V3), or None."""
        k = self.gating.top_k
        if not 1 <= int(rank) <= k:
            raise ValueError(f"rank k must be in 1..K={k}, got {rank}")
        state = {"pos": jnp.asarray(0, jnp.int32), "rank": jnp.asarray(rank, jnp.int32)}
        return state if bias is None else {**state, "bias": jnp.asarray(bias, jnp.float32)}

    def choose(self, moe_index: int, z: jax.Array, pos: jax.Array, rank: jax.Array, bias=None):
        """(experts [T, K] highest weight first, -1 = dropped; weights [T, K]) for logits z [T, N] at
        token positions ``pos`` [T] (``bias``: this layer's selection bias)."""
        g = self.gating
        t_len, n = z.shape
        k = g.top_k
        ranking = g.ranking(z, bias).astype(jnp.int32)  # [T, N]
        chosen = ranking[:, :k]
        slot = jnp.arange(k, dtype=jnp.int32)[None, :]
        if self.mode == "drop":
            valid = jnp.broadcast_to(slot < rank - 1, chosen.shape)
        else:
            base = jax.random.fold_in(seeds.prng_key(self.seed), moe_index)
            u = jax.vmap(lambda p: jax.random.uniform(jax.random.fold_in(base, p), (n,)))(pos)  # [T, N]
            taken = jnp.any(jnp.arange(n)[None, None, :] == chosen[:, :, None], axis=1)  # [T, N]
            pick = jnp.argmax(jnp.where(taken, -1.0, u), axis=-1).astype(jnp.int32)
            chosen = jnp.where(slot == rank - 1, pick[:, None], chosen)
            valid = jnp.ones(chosen.shape, bool)
            # weigh the set in the original ranking's order (order-dependent gatings, as router.choose does)
            original_pos = jnp.zeros((t_len, n), jnp.int32).at[jnp.arange(t_len)[:, None], ranking].set(
                jnp.arange(n, dtype=jnp.int32)[None, :])
            order = descending_order(-jnp.take_along_axis(original_pos, chosen, axis=-1))
            chosen = jnp.take_along_axis(chosen, order, axis=-1)
        weights = jnp.where(valid, g.weights(z, chosen, valid).astype(jnp.float32), 0.0)
        experts = jnp.where(valid, chosen, -1)
        return _by_weight(experts, weights, valid)

    def __call__(self, moe_index: int, z: jax.Array, state: dict):
        t_len = z.shape[0]
        pos = state["pos"] + jnp.arange(t_len, dtype=jnp.int32)
        experts, weights = self.choose(moe_index, z, pos, state["rank"],
                                       state["bias"][moe_index] if "bias" in state else None)
        if moe_index == self.n_layers - 1:
            state = {**state, "pos": state["pos"] + t_len}
        return experts, weights, state, {}


def _by_weight(experts, weights, valid):
    """Highest weight first, dropped slots last (weight 0, id -1)."""
    order = descending_order(jnp.where(valid, weights, -jnp.inf))
    return jnp.take_along_axis(experts, order, -1), jnp.take_along_axis(weights, order, -1)


# ------------------------------------------------------------------------------------------ context


@dataclasses.dataclass
class Context:
    model: Any
    label: str
    out: str
    max_tokens: int | None
    context: int
    points: int
    data: str | None
    batch_size: int
    progress: bool
    dtype: str | None
    mmlu_limit: int
    gsm8k_limit: int
    evictions: tuple = EVICTIONS
    lifetimes_max_tokens: int | None = None
    cache_sizes: str = "default"
    mesh: Any = None  # distributed.points_mesh: a sweep's batches spread over these devices
    calibration_text: str | None = None  # the delta study's text (None: ``calibration_source``)

    @property
    def cfg(self):
        return self.model.cfg

    def half(self) -> int:
        return max(1, self.cfg.n_experts // 2)

    def quarter(self) -> int:
        return max(1, self.cfg.n_experts // 4)

    def grid(self) -> list[float]:
        return np.linspace(0.0, 1.0, self.points).tolist() if self.points > 1 else [0.5]

    def _base(self, study: str, task: str = "wikitext"):
        return dict(task=task, study=study, data=self.data if task == "wikitext" else None, context=self.context,
                    max_tokens=self.max_tokens)

    def point(self, study: str, kind: str, size: str | int | None, *, sweep_values: dict | None = None,
              scope: str = "layer", eviction: str = "lru", init: str = "empty", seed: int = 0,
              method: str = "forward", task: str = "wikitext", limit: int | None = None,
              cache_options: dict | None = None, **params) -> sweep_points.Point:
        """A point of routing ``kind`` (with ``params``) against a cache of ``size`` (None: no cache);
        ``cache_options``: further ``simulate.CacheConfig`` fields (prefetch)."""

        k = self.cfg.top_k
        policy = cache = None
        if size is not None:
            cache = simulate.CacheConfig(size=str(size), scope=scope, eviction=eviction, init=init, seed=seed,
                                         **(cache_options or {}))
            cache.capacity(self.cfg)
            if method != "replay":
                policy = routing_lib.make_policy(kind, k, **params)
        routing = sweep_points.routing_record(kind, k, **params)
        base = self._base(study, task)
        if task != "wikitext":
            base.update(limit=limit)
        return sweep_points.make_point(self.model, self.label, routing=routing, policy=policy, cache=cache,
                                       sweep=sweep_values, method=method, **base)

    def hook_point(self, study: str, hook: RankHook | None, rank: int | None, extra: dict) -> sweep_points.Point:
        routing = sweep_points.routing_record("original", self.cfg.top_k, **extra)
        p = sweep_points.make_point(self.model, self.label, routing=routing, sweep=dict(extra), hook=hook,
                                    hook_state=None if hook is None else hook.init_state(
                                        rank, self.model.selection_biases), **self._base(study))
        return p

    def runner(self, study: str) -> sweep.Runner:

        return sweep.Runner(self.model, results=os.path.join(self.out, f"{study}.jsonl"),
                            batch_size=self.batch_size, progress=self.progress,
                            trace_dir=os.path.join(self.out, "traces"), load_text=perplexity.load_wikitext,
                            reuse=self.reusable(study), mesh=self.mesh)

    def reusable(self, study: str) -> dict[str, dict]:
        """Records of the other studies' files, by key (a point computed once serves every study)."""
        out = {}
        for name in STUDIES:
            if name != study:
                for rec in results_file.load_results(os.path.join(self.out, f"{name}.jsonl")):
                    if rec.get("method") != "selection":
                        out.setdefault(rec["key"], rec)
        return out


# ------------------------------------------------------------------------------------------ studies


def max_rank_values(k: int, n: int) -> list[int]:
    """M = K, K+1, K+2, then roughly geometric up to N."""
    vals = {k, min(k + 1, n), min(k + 2, n), n}
    m = float(k)
    while m < n:
        m *= math.sqrt(2)
        vals.add(min(n, int(round(m))))
    return sorted(vals)


def study_pareto(ctx: Context) -> list[dict]:
    k, n = ctx.cfg.top_k, ctx.cfg.n_experts
    pts = []
    for size in (ctx.half(), ctx.quarter()):
        sv = lambda **kw: {"cache_size": str(size), **kw}  # noqa: E731
        pts.append(ctx.point("pareto", "original", size, sweep_values=sv()))
        pts += [ctx.point("pareto", "pruning", size, prune_h=h, sweep_values=sv(prune_h=h)) for h in range(2, k + 1)]
        pts += [ctx.point("pareto", "max-rank", size, max_rank=m, sweep_values=sv(max_rank=m))
                for m in max_rank_values(k, n)]
        pts += [ctx.point("pareto", "cumsum", size, cumsum_p=p, sweep_values=sv(cumsum_p=p)) for p in ctx.grid()]
        pts += [ctx.point("pareto", "cache-prior", size, lam=lam, sweep_values=sv(lam=lam)) for lam in ctx.grid()]
        pts += [ctx.point("pareto", "original", size, eviction=ev, method="replay", sweep_values=sv())
                for ev in ("belady", "lru")]
    return ctx.runner("pareto").run(pts)


def knee_index(miss: list[float], ppl: list[float]) -> int:
    """Index of a front's knee: the point farthest below the chord from its first to its last point, both axes
    scaled to [0, 1] (the "kneedle" rule). The points are in grid order (λ ascending: miss rate falling,
    perplexity rising); a front of fewer than 3 points, or a flat one, has its knee at the middle."""
    n = len(miss)
    if n < 3:
        return n // 2
    m, q = np.asarray(miss, np.float64), np.asarray(ppl, np.float64)
    span_m, span_q = np.ptp(m), np.ptp(q)
    if span_m <= 0 or span_q <= 0:
        return n // 2
    x, y = (m[0] - m) / span_m, (q - q[0]) / span_q  # both grow along the front, from (0, 0)
    x_end, y_end = x[-1], y[-1]
    dist = (x * y_end - y * x_end) / max(math.hypot(x_end, y_end), 1e-12)  # > 0: below the chord (a good trade)
    return int(np.argmax(dist))


def pareto_knee_lam(ctx: Context, size: int) -> tuple[float, str]:
    """(λ, how it was chosen): the knee of the cache-prior front at capacity ``size`` in ``pareto.jsonl``
    (the largest run there, by scored tokens), else 0.5."""
    recs = [r for r in results_file.load_results(os.path.join(ctx.out, "pareto.jsonl"))
            if r["routing"]["kind"] == "cache-prior" and r.get("model") == ctx.label and r.get("method") == "forward"
            and (r.get("cache") or {}).get("capacity") == size and r.get("ppl") is not None
            and r.get("miss_rate") is not None and r["routing"].get("delta") is None]
    if len(recs) < 3:
        return 0.5, "default (no cache-prior front in pareto.jsonl)"
    tokens_of = lambda r: (r.get("metrics") or {}).get("tokens") or 0  # noqa: E731
    tokens = max(tokens_of(r) for r in recs)
    recs = sorted((r for r in recs if tokens_of(r) == tokens), key=lambda r: r["routing"]["lam"])
    if len(recs) < 3:
        return 0.5, "default (fewer than 3 cache-prior points in pareto.jsonl)"
    i = knee_index([r["miss_rate"] for r in recs], [r["ppl"] for r in recs])
    return float(recs[i]["routing"]["lam"]), f"knee of the pareto front at C = {size} ({len(recs)} points, {tokens} tokens)"


def study_lifetimes(ctx: Context) -> list[dict]:
    """Table 2 on ``--lifetimes-max-tokens`` tokens: original routing (LRU, and the Belady replay of its
    trace), cache-prior λ = 0.5 and cache-prior at the knee of the pareto front, C = N/2."""
    size = ctx.half()
    lctx = dataclasses.replace(ctx, max_tokens=ctx.lifetimes_max_tokens)
    sv = {"cache_size": str(size)}
    pts = [lctx.point("lifetimes", "original", size, sweep_values=sv),
           lctx.point("lifetimes", "original", size, eviction="belady", method="replay", sweep_values=sv),
           lctx.point("lifetimes", "cache-prior", size, lam=0.5, sweep_values={**sv, "lam": 0.5})]
    knee, how = pareto_knee_lam(ctx, size)
    if knee != 0.5:
        p = lctx.point("lifetimes", "cache-prior", size, lam=knee, sweep_values={**sv, "lam": knee, "knee": True})
        p.extra["knee"] = how
        pts.append(p)
    return lctx.runner("lifetimes").run(pts)


def study_init(ctx: Context) -> list[dict]:
    size = ctx.half()
    pts = []
    for init in ("empty", "random"):
        sv = lambda **kw: {"cache_size": str(size), "init": init, **kw}  # noqa: E731
        pts.append(ctx.point("init", "original", size, init=init, sweep_values=sv()))
        pts += [ctx.point("init", "cache-prior", size, lam=lam, init=init, sweep_values=sv(lam=lam)) for lam in (0.5, 0.8)]
    return ctx.runner("init").run(pts)


def calibration_source(path: str | None) -> str:
    """The delta study's calibration text: ``path``, else the corpus's held-out shard in ``$MOEJAX_DATA/corpus``,
    else ``hf:wikitext-2-raw-v1/train`` (a split the evaluation never scores)."""
    corpus = paths.corpus_dir()
    return path or (os.path.join(corpus, CALIBRATION_SHARD) if corpus else "hf:wikitext-2-raw-v1/train")


def read_calibration_text(source: str, chars: int) -> str:
    """The first ``chars`` characters of ``source``: a text file (``.gz`` and ``.xz`` read compressed) or the
    HF ``datasets`` split ``calibration_source`` names."""
    if source.startswith("hf:"):
        return perplexity.hf_wikitext("train", "calibration text for the delta study",
                                      "--calibration-text PATH")[:chars]
    if not os.path.isfile(source):
        raise FileNotFoundError(f"calibration text {source} does not exist" if not os.path.exists(source)
                                else f"calibration text {source} is not a regular file")
    opener = gzip.open if source.endswith(".gz") else lzma.open if source.endswith(".xz") else open
    with opener(source, "rt", encoding="utf-8") as f:
        return f.read(chars)


def calibrate_delta(ctx: Context) -> dict:
    """Mean router-logit range max(z) - min(z) over the first ``max_tokens`` tokens (default 8184) of the
    calibration text (``calibration_source``: a text the evaluation never scores), per MoE layer and overall."""
    source = calibration_source(ctx.calibration_text)
    want = ctx.max_tokens or 8184
    text = read_calibration_text(source, max(CALIBRATION_CHARS, want * 8))
    ids = np.asarray(ctx.model.tokenizer.encode(text, add_special_tokens=False), np.int32)[:want]
    sums = np.zeros(ctx.cfg.n_moe_layers)
    count = 0
    for chunk in perplexity.chunk_tokens(ids, ctx.context, ctx.cfg.bos_token_id):
        z = ctx.model.forward(chunk).router_logits.astype(np.float64)  # [L, T, N]
        sums += (z.max(-1) - z.min(-1)).sum(-1)
        count += z.shape[1]
    per_layer = sums / count
    where = source if source.startswith("hf:") else os.path.relpath(os.path.realpath(source),
                                                                     os.path.dirname(os.path.abspath(ctx.out)))
    return {"source": where,
            "tokens": int(len(ids)), "routed_tokens": int(count), "per_layer": per_layer.tolist(),
            "delta": float(per_layer.mean())}


def _read_calibration(path: str) -> dict | None:
    """The Δ calibration an earlier run left at ``path`` (None: none yet), or ``{"error": ...}`` where the file
    there is not one: it is refused on every process, neither used as Δ nor replaced."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            calib = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        calib = None
    per_layer = calib.get("per_layer") if isinstance(calib, dict) else None
    if isinstance(per_layer, list) and per_layer and \
            all(isinstance(d, (int, float)) and not isinstance(d, bool) for d in per_layer):
        return calib
    return {"error": f"{path} is not a delta calibration of the studies: move it away (it is computed again) "
                     "or choose another --out"}


def study_delta(ctx: Context) -> list[dict]:
    size = ctx.half()
    calib_path = os.path.join(ctx.out, "traces", "delta_calibration.json")
    calib = distributed.broadcast(_read_calibration(calib_path) if distributed.is_leader() else None)
    if calib is not None and "error" in calib:
        raise errors.Failure(calib["error"])
    if calib is None:
        calib = calibrate_delta(ctx)
        if distributed.is_leader():
            atomic.write_json(calib_path, calib, indent=None, sort_keys=False, make_parents=True)
    delta = [round(d, 6) for d in calib["per_layer"]]  # Δavg is per layer (docs/design.md §2; paper eq. 10, appendix D)
    pts = []
    for lam in ctx.grid():
        sv = {"cache_size": str(size), "lam": lam}
        pts.append(ctx.point("delta", "cache-prior", size, lam=lam, sweep_values=dict(sv, delta="running")))
        p = ctx.point("delta", "cache-prior", size, lam=lam, delta=delta, sweep_values=dict(sv, delta="calibrated"))
        p.extra["delta_calibration"] = calib  # what the fixed Δ is: kept in the record's metrics
        pts.append(p)
    return ctx.runner("delta").run(pts)


def cache_sizes(spec: str, n: int | None) -> list[int]:
    """The capacities of the cache-size study: ``"default"`` (11 sizes from 1 to N), ``"all"`` (every C = 1..N)
    or a comma-separated list of counts (each in 1..N)."""
    if spec == "default":
        if n == 32:
            return [1, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32]
        return sorted({int(c) for c in np.linspace(1, n, 11).round()})
    if spec == "all":
        return list(range(1, n + 1))
    try:
        sizes = sorted({int(c) for c in spec.split(",") if c.strip()})  # a set: a size given twice runs once
    except ValueError:
        raise ValueError(f"--cache-sizes takes 'default', 'all' or comma-separated counts, got {spec!r}") from None
    if not sizes or sizes[0] < 1 or (n is not None and sizes[-1] > n):
        raise ValueError(f"--cache-sizes {spec!r}: every size must be in 1..N" + ("" if n is None else f" = {n}"))
    return sizes


def study_cache_size(ctx: Context) -> list[dict]:
    n = ctx.cfg.n_experts
    sizes = cache_sizes(ctx.cache_sizes, n)
    pts = []
    for c in sizes:
        sv = {"cache_size": str(c)}
        pts += [ctx.point("cache_size", "original", c, eviction=ev, method="replay", sweep_values=sv)
                for ev in ("lru", "belady")]
        if c < n:  # with C = N every expert stays: only compulsory misses, whatever the policy
            pts += [ctx.point("cache_size", "cache-prior", c, lam=lam, sweep_values=dict(sv, lam=lam))
                    for lam in CACHE_SIZE_LAMS]
    runner = ctx.runner("cache_size")
    records = runner.run(pts)
    selections = select_within_bounds(records, runner)
    done = {r["key"] for r in results_file.load_results(runner.results)}
    for rec in selections:
        if rec["key"] not in done:
            results_file.append_result(runner.results, rec)
    return records + selections


def select_within_bounds(records: list[dict], runner: sweep.Runner) -> list[dict]:
    """Per cache size and perplexity bound: the cache-prior grid point (or original routing, λ = 0) with the
    lowest miss rate whose perplexity is within (1 + bound) × the original's (paper figure 10)."""
    import datetime

    out = []
    by_size: dict[str, list[dict]] = {}
    for r in records:
        by_size.setdefault(r["sweep"]["cache_size"], []).append(r)
    for size, recs in by_size.items():
        lru = [r for r in recs if r["method"] == "replay" and r["cache"]["eviction"] == "lru"]
        grid = [r for r in recs if r["routing"]["kind"] == "cache-prior"]
        if not lru:
            continue
        base = lru[0]
        for bound in PPL_BOUNDS:
            ok = [r for r in grid if r["ppl"] <= base["ppl"] * (1 + bound)]
            best = min(ok + [base], key=lambda r: (r["miss_rate"], -(r["routing"]["lam"] or 0.0)))
            ident = {"selection": "min miss rate within ppl bound", "bound": bound,
                     "candidates": sorted(r["key"] for r in grid + [base])}
            rec = {k: best[k] for k in ("task", "model", "routing", "cache", "ppl", "accuracy", "miss_rate", "lifetime",
                                        "lifetime_std", "bytes_per_token", "collision_misses",
                                        "prefetch_precision", "prefetch_recall")}
            rec.update(key=sweep_points.point_key(ident), study="cache_size", method="selection",
                       sweep={"cache_size": size, "ppl_bound": bound},
                       metrics={"selected_key": best["key"], "selected_method": best["method"],
                                "lam": best["routing"]["lam"] or 0.0, "ppl_original": base["ppl"],
                                "ppl_increase": best["ppl"] / base["ppl"] - 1, "lru_miss_rate": base["miss_rate"],
                                "candidates": len(ok) + 1},
                       time_s=0.0, finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
            out.append(results_file.as_json(rec))
    return out


def study_sensitivity(ctx: Context) -> list[dict]:
    k = ctx.cfg.top_k
    pts = [ctx.hook_point("sensitivity", None, None, {})]
    for mode, field in (("drop", "drop_rank"), ("random", "random_rank")):
        hook = RankHook(ctx.cfg.gating, ctx.cfg.n_moe_layers, mode, seed=0)
        for r in range(1, k + 1):
            extra = {field: r} if mode == "drop" else {field: r, "seed": 0}
            pts.append(ctx.hook_point("sensitivity", hook, r, extra))
    return ctx.runner("sensitivity").run(pts)


def study_eviction(ctx: Context) -> list[dict]:
    pts = [ctx.point("eviction", "original", size, scope="global", eviction=ev, method="replay",
                     sweep_values={"cache_size": size, "eviction": ev})
           for size in GLOBAL_SIZES for ev in ctx.evictions]
    # speculative next-layer prefetch (needs the model's hidden states, so these are real passes): original
    # routing, per-layer LRU at N/2 and N/4, prefetch off / top-K / above the 80th percentile
    for size in (ctx.half(), ctx.quarter()):
        for label, opts in PREFETCH.items():
            pts.append(ctx.point("eviction", "original", size, sweep_values={"cache_size": str(size), "prefetch": label},
                                 **{"cache_options": opts}))
    return ctx.runner("eviction").run(pts)


def study_tasks(ctx: Context) -> list[dict]:
    """Original routing is run as cache-prior with λ = 0, which reproduces it bit for bit (routing tests):
    the four policies then share every compiled program (with a cache, tasks compile once per prompt length)."""
    size = ctx.half()
    pts = []
    for task, limit in (("mmlu", ctx.mmlu_limit), ("gsm8k", ctx.gsm8k_limit)):
        for lam in (0.0, 0.3, 0.5, 0.9):
            p = ctx.point("tasks", "cache-prior", size, lam=lam, task=task, limit=limit, method="task",
                          sweep_values={"task": task, "cache_size": str(size), "lam": lam})
            if lam == 0.0:
                p.extra["note"] = "lambda = 0: original routing (bit for bit)"
            pts.append(p)
    return ctx.runner("tasks").run(pts)


RUNNERS = {"pareto": study_pareto, "lifetimes": study_lifetimes, "init": study_init, "delta": study_delta,
           "cache_size": study_cache_size, "sensitivity": study_sensitivity, "eviction": study_eviction,
           "tasks": study_tasks}


# ------------------------------------------------------------------------------------------ summary


def summarize(study: str, records: list[dict]) -> str:
    """A few lines per study for the terminal."""
    lines = [f"== {study}: {len(records)} records"]
    f = lambda x, s=".3f": "-" if x is None else format(x, s)  # noqa: E731
    for r in records:
        what = r["routing"]["kind"]
        if r.get("method") in ("replay", "selection"):
            what += f" [{r['method']}{' ' + r['cache']['eviction'] if r.get('cache') else ''}]"
        sw = " ".join(f"{k}={sweep._fmt(v)}" for k, v in r.get("sweep", {}).items())
        quality = f"ppl {f(r.get('ppl'), '.2f')}" if r.get("ppl") is not None else f"acc {f(r.get('accuracy'))}"
        lines.append(f"  {what:<28} {sw:<40} {quality:>12}  miss {f(r.get('miss_rate'), '.4f')}  "
                     f"life {f(r.get('lifetime'), '.1f')}  coll {r.get('collision_misses') if r.get('collision_misses') is not None else '-'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("studies"), description=__doc__,
                                formatter_class=commands.HelpFormatter)
    p.add_argument("--out", default=os.path.join("results", "studies"), help="folder of the records, REPORT.md and "
                   "the figures (default: results/studies)")
    p.add_argument("--only", action="append", default=[], help=f"comma-separated subset of {', '.join(STUDIES)}")
    p.add_argument("--protocol", choices=("quick", "paper"), default="quick",
                   help="quick (default): 11-point fronts on 8,184 tokens; paper: 50-point fronts on >= 65,536 tokens, "
                        "lifetimes on the whole text, every cache size (explicit flags override)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    g1 = p.add_argument_group("model and data")
    g1.add_argument("--model", default=api.DEFAULT_MODEL_NAME)
    g1.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="compute dtype (default float32: faster than bf16 on XLA:CPU, and exact to report)")
    g1.add_argument("--data", default=None, help="WikiText-2 test text (default: $MOEJAX_WIKITEXT, "
                    "$MOEJAX_DATA/wikitext-2-raw-v1/test.txt, else the HF datasets copy)")
    g1.add_argument("--calibration-text", default=None, help="delta study: the text whose router-logit ranges "
                    f"calibrate the fixed delta (.gz/.xz read compressed; default: $MOEJAX_DATA/corpus/"
                    f"{CALIBRATION_SHARD}, else WikiText-2's train split from HF datasets)")
    g2 = p.add_argument_group("how much each study runs (unset: what --protocol says)")
    g2.add_argument("--max-tokens", type=int, default=None, help="score the first N WikiText tokens (default 8184 "
                    "= 8 chunks of 1023; paper: 65,536 rounded up to whole chunks); 0 = all")
    g2.add_argument("--lifetimes-max-tokens", type=int, default=None, help="tokens the lifetimes study scores "
                    "(default: --max-tokens; 0 = the whole test text, the paper's table 2)")
    g2.add_argument("--context", type=int, default=1024, help="tokens per scored chunk, the first a BOS (default: "
                    "1024)")
    g2.add_argument("--points", type=int, default=None, help="points per continuous front: cumsum p and λ on that many "
                    "equidistant values in [0, 1] (default 11: steps of 0.1; paper: 50)")
    g2.add_argument("--cache-sizes", default=None, help="cache-size study: 'default' (11 sizes), 'all' (C = 1..N; "
                    "paper) or comma-separated counts")
    g2.add_argument("--batch-size", type=int, default=None, help="points per vmapped batch (default: 1 on CPU, 8 on "
                    "accelerators)")
    g2.add_argument("--evictions", default=None, help="eviction study: comma-separated policies "
                    f"(default {','.join(EVICTIONS)})")
    g2.add_argument("--mmlu-limit", type=int, default=None, help=f"tasks study: MMLU questions (default {MMLU_LIMIT})")
    g2.add_argument("--gsm8k-limit", type=int, default=None, help=f"tasks study: GSM8K problems (default {GSM8K_LIMIT})")
    cli_options.add_distributed_args(p)
    return p


PAPER_TOKENS = 65_536
MMLU_LIMIT, GSM8K_LIMIT = 40, 10
# Flags that only one study reads: given while --only leaves that study out, they are refused.
STUDY_FLAGS = {"lifetimes_max_tokens": "lifetimes", "cache_sizes": "cache_size", "evictions": "eviction",
               "mmlu_limit": "tasks", "gsm8k_limit": "tasks", "calibration_text": "delta"}


def apply_protocol(args: argparse.Namespace) -> None:
    """Fill the flags left unset from ``--protocol`` (quick or paper)."""
    paper = args.protocol == "paper"
    if args.points is None:
        args.points = 50 if paper else 11
    if args.max_tokens is None:
        per_chunk = max(1, args.context - 1)
        args.max_tokens = -(-PAPER_TOKENS // per_chunk) * per_chunk if paper else 8184
    if args.lifetimes_max_tokens is None and paper:
        args.lifetimes_max_tokens = 0
    if args.cache_sizes is None:
        args.cache_sizes = "all" if paper else "default"
    if args.evictions is None:
        args.evictions = ",".join(EVICTIONS)
    if args.mmlu_limit is None:
        args.mmlu_limit = MMLU_LIMIT
    if args.gsm8k_limit is None:
        args.gsm8k_limit = GSM8K_LIMIT


def check_args(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...]]:
    """(studies to run, eviction policies) from the flags; a ``ValueError`` naming the flag it refuses."""
    named = [s.strip() for item in args.only for s in item.split(",") if s.strip()]
    if args.only and not named:
        raise errors.UsageError(f"--only {args.only[-1]!r} names no study; expected some of {', '.join(STUDIES)}")
    chosen = named or list(STUDIES)
    unknown = [s for s in chosen if s not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown study {unknown}; expected some of {', '.join(STUDIES)}")
    for name, study in STUDY_FLAGS.items():
        if getattr(args, name) is not None and study not in chosen:
            raise errors.UsageError(f"--{name.replace('_', '-')} is read by the {study} study only, which --only "
                                    "leaves out")
    apply_protocol(args)
    evictions = tuple(dict.fromkeys(e.strip() for e in args.evictions.split(",") if e.strip()))  # each once
    if not evictions or any(e not in EVICTIONS for e in evictions):
        raise ValueError(f"--evictions {args.evictions!r}: expected some of {', '.join(EVICTIONS)}")
    for flag, limit in (("--mmlu-limit", args.mmlu_limit), ("--gsm8k-limit", args.gsm8k_limit)):
        if limit is not None and limit < 1:  # checked before any study runs, not when the tasks study comes
            raise ValueError(f"{flag} must be at least 1, got {limit}")
    if args.points > sweep_points.MAX_POINTS:
        raise ValueError(f"--points {args.points}: at most {sweep_points.MAX_POINTS}")
    if args.points < 1 or args.context < 2 or args.max_tokens < 0 or (args.lifetimes_max_tokens or 0) < 0:
        raise ValueError("--points must be >= 1, --context >= 2, --max-tokens and --lifetimes-max-tokens >= 0")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.cache_sizes not in ("default", "all"):
        cache_sizes(args.cache_sizes, None)  # the form only; the range is checked against N once loaded
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise errors.UsageError(f"--out {args.out} exists and is not a folder")
    if args.calibration_text is not None and not os.path.isfile(args.calibration_text):
        raise errors.UsageError(f"--calibration-text {args.calibration_text} "
                                + ("is not a regular file" if os.path.exists(args.calibration_text) else "does not exist"))
    return chosen, evictions


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    errors.plain_warnings()
    args = build_parser().parse_args(argv)
    compile_cache.enable()
    collector.for_compiling()
    try:
        chosen, evictions = check_args(args)
        # every study scores text: say so before loading, not in each study
        folder = api.text_model_folder(args.model, "the studies score WikiText and task text")
        mesh = cli_options.start_distributed(args)
        model = api.load(folder, dtype=getattr(jnp, args.dtype))
        read_manifest(manifest_path(args.out))  # one the run cannot merge into is refused before computing
    except errors.HANDLED as e:
        return errors.report(e)
    label = sweep_points.model_label(args.model) + ("" if args.dtype == "bfloat16" else f"@{args.dtype}")
    ctx = Context(model, label, args.out, args.max_tokens or None, args.context, args.points, args.data,
                  args.batch_size or sweep.default_batch_size(), not args.no_progress, args.dtype, args.mmlu_limit,
                  args.gsm8k_limit, evictions,
                  args.max_tokens or None if args.lifetimes_max_tokens is None else args.lifetimes_max_tokens or None,
                  args.cache_sizes, mesh, args.calibration_text)
    try:
        cache_sizes(args.cache_sizes, model.cfg.n_experts)
    except ValueError as e:
        return errors.report(e)
    existed = os.path.isdir(args.out)
    timings, status = run_studies(ctx, [s for s in STUDIES if s in chosen])
    if distributed.is_leader() and (timings or (not existed and os.path.isdir(args.out))):  # something computed
        try:
            _write_manifest(args, ctx, timings)
        except errors.HANDLED as e:  # changed while the studies ran, or not writable: the records are kept
            status = max(status, errors.report(e))
    return status


def run_studies(ctx: Context, names: list[str]) -> tuple[dict, int]:
    """Run the studies in turn, each failure reported and the next one tried: ({study: seconds}, status)."""
    status, timings = 0, {}
    for name in names:
        start = time.perf_counter()
        try:
            records = RUNNERS[name](ctx)
        except (*errors.HANDLED, ImportError) as e:
            status = max(status, errors.report(e if not isinstance(e, ImportError) else errors.Failure(str(e)),
                                               f"study {name}: "))
            continue
        timings[name] = round(time.perf_counter() - start, 1)
        if distributed.is_leader() and errors.print_result(f"{summarize(name, records)}\n   ({timings[name]} s)"):
            status = max(status, errors.FAILURE)  # the records are written; the next study still runs
    return timings, status


_MANIFEST_KEYS = {"model", "dtype", "context", "evictions", "n_experts", "top_k", "moe_layers", "cache_size_lams",
                  "ppl_bounds", "global_sizes", "studies",
                  "max_tokens", "points", "batch_size", "mmlu_limit", "gsm8k_limit", "seconds"}  # (older ones)


def manifest_path(out: str) -> str:
    return os.path.join(out, "manifest.json")


def read_manifest(path: str) -> dict:
    """The studies manifest at ``path`` ({} when there is none), or a ``Failure`` naming it when it cannot be
    read or is not one: the studies merge into it, so a damaged or foreign file was either a traceback after
    hours of computing or silently rewritten."""
    if not os.path.lexists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise errors.Failure(f"cannot read the studies manifest {path}: {e}; move it away (the studies merge "
                             "their settings into it) or choose another --out") from None
    foreign = sorted(set(manifest) - _MANIFEST_KEYS) if isinstance(manifest, dict) else None
    studies = manifest.get("studies", {}) if isinstance(manifest, dict) else None
    if foreign is None or foreign or not isinstance(studies, dict) or \
            not all(isinstance(v, dict) for v in studies.values()):
        what = f"keys {', '.join(foreign[:5])}" if foreign else f"a JSON {type(manifest).__name__}" \
            if not isinstance(manifest, dict) else "a 'studies' entry that is not an object of objects"
        raise errors.Failure(f"{path} is not a studies manifest ({what}): the studies would rewrite it; move it "
                             "away or choose another --out")
    return manifest


def _write_manifest(args, ctx: Context, timings: dict) -> None:
    """What the files in ``--out`` were computed with: the model and settings shared by all studies at the
    top, and per study (under "studies") the tokens, grid, batch and wall time of its last run — merged over
    runs, so studies run separately with different budgets each keep their own."""
    path = manifest_path(args.out)
    os.makedirs(args.out, exist_ok=True)
    manifest = read_manifest(path)
    for stale in ("max_tokens", "points", "batch_size", "mmlu_limit", "gsm8k_limit", "seconds"):
        manifest.pop(stale, None)  # older manifests kept these once for all studies
    manifest.update(model=ctx.label, dtype=args.dtype, context=args.context, evictions=list(ctx.evictions),
                    n_experts=ctx.cfg.n_experts, top_k=ctx.cfg.top_k, moe_layers=ctx.cfg.n_moe_layers,
                    cache_size_lams=list(CACHE_SIZE_LAMS), ppl_bounds=list(PPL_BOUNDS), global_sizes=list(GLOBAL_SIZES))
    per_study = manifest.setdefault("studies", {})
    for name, seconds in timings.items():
        entry = {"seconds": seconds, "max_tokens": ctx.lifetimes_max_tokens if name == "lifetimes" else ctx.max_tokens,
                 "points": ctx.points, "batch_size": ctx.batch_size, "devices": distributed.mesh_size(ctx.mesh),
                 "processes": jax.process_count(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if name == "tasks":
            entry.update(mmlu_limit=ctx.mmlu_limit, gsm8k_limit=ctx.gsm8k_limit)
        if name == "cache_size":
            entry.update(cache_sizes=cache_sizes(ctx.cache_sizes, ctx.cfg.n_experts))
        per_study[name] = entry
    atomic.write_json(path, manifest, indent=1, sort_keys=False)


if __name__ == "__main__":
    sys.exit(main())
