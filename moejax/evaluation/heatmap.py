"""The routing-trace heat map (paper figures 7, 18): one layer's tokens x experts, each cell a hit, a miss,
resident-but-unused or empty, reconstructed by replaying the recorded selections through ``experts.cache``.

    python -m moejax.plots heatmap TRACE.npz [MORE.npz ...] --layer 0 --cache-size 16 --out figs/heatmap
    python -m moejax.plots heatmap TRACE.npz --cache-size 0.5 --out fig.pdf --overwrite
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moejax.base import atomic, commands, errors, interrupts
from moejax.experts import cache as cache_lib, trace as trace_lib
from moejax.experts import capacity as capacity_lib
from moejax.evaluation.plots import figure_paths, new_figure, save_figure
from moejax.evaluation.records import _eviction_name, EVICTION_ORDER


HEAT_EMPTY, HEAT_RESIDENT, HEAT_HIT, HEAT_MISS = 0, 1, 2, 3
HEAT_NAMES = ("empty", "in cache, unused", "cache hit", "cache miss")


HEAT_COLORS = ("white", "#9ecae1", "#31a354", "#de2d26")  # paper figure 7: green hit, red miss, blue cached


_TRACE_META = ("hits", "capacity", "eviction", "scope", "cache_init", "init", "cache_seed")


def load_trace_data(src) -> tuple[Any, dict]:
    """(moejax.experts.trace.Trace, extras) from a trace path (.npz), a dict of arrays, or a Trace. Extras are the
    optional ``hits`` [T, L, K] and the recording's cache settings (``capacity``, ``eviction``, ...), which
    the heat map uses to cross-check its replay."""
    if isinstance(src, trace_lib.Trace):
        return src, {}
    if isinstance(src, (str, os.PathLike)):
        arrays, where = trace_lib.read_npz(src), str(src)
    elif isinstance(src, dict):
        arrays, where = dict(src), "trace dict"
    else:
        raise TypeError(f"expected a trace path, dict or moejax.experts.trace.Trace, got {type(src).__name__}")
    if "experts" not in arrays:
        raise trace_lib.TraceError(f"{where} has no 'experts' array (found {sorted(arrays)})")
    unknown = sorted(set(arrays) - set(trace_lib.TRACE_KEYS) - set(_TRACE_META))
    if unknown:
        raise trace_lib.TraceError(f"{where} has unknown arrays {unknown}; expected some of "
                                   f"{trace_lib.TRACE_KEYS + _TRACE_META}")
    tr = trace_lib.validate_trace(*(arrays.get(k) for k in trace_lib.TRACE_KEYS))
    extras = {}
    for k in _TRACE_META:
        if k in arrays:
            v = np.asarray(arrays[k])
            extras[k] = v if k == "hits" else v.item()
            if isinstance(extras[k], bytes):
                extras[k] = extras[k].decode()
    if "hits" in extras and extras["hits"].shape != tr.experts.shape:
        raise trace_lib.TraceError(f"{where}: 'hits' has shape {extras['hits'].shape} but 'experts' is "
                                   f"{tr.experts.shape}")
    return tr, extras


def _heat_replay_fn():
    import jax
    from jax import lax

    @jax.jit
    def run(state, layers, experts, weights, next_use):
        def step(cs, x):
            layer, e, w, nu = x
            before = cache_lib.resident_mask(cs, layer)
            cs, hits = cache_lib.access(cs, layer, e, w, None, nu if cs.eviction in cache_lib.OFFLINE_EVICTIONS else None)
            return cs, (before, hits)

        return lax.scan(step, state, (layers, experts, weights, next_use))

    return run


_HEAT_REPLAY = None


def _check_layer(layer: int, n_layers: int) -> None:
    if not 0 <= int(layer) < n_layers:
        raise ValueError(f"layer {layer} out of range: the trace has {n_layers} MoE layers")


def check_heatmap(traces: Sequence, layer: int, capacity, scope: str = "layer",
                  flags: tuple[str, str] = ("--layer", "--cache-size")) -> None:
    """Read every trace and check ``layer`` and ``capacity`` against it, before any replay or figure; the
    message names the flag (``flags``: layer, cache size) of a bad value."""
    for t in traces:
        tr, _ = load_trace_data(t)
        if not 0 <= int(layer) < tr.shape[1]:
            raise ValueError(f"{flags[0]} {layer} is out of range: {t} has {tr.shape[1]} MoE layers")
        try:
            capacity_lib.parse_capacity(capacity, tr.n_experts, tr.shape[1], scope)
        except ValueError as err:
            raise ValueError(f"{flags[1]}: {err}") from None


def classify_trace(trace, layer: int, capacity, eviction: str = "lru", scope: str = "layer",
                   init: str = "empty", seed: int = 0, check_hits: bool | None = None) -> dict:
    """Replay a trace's selected experts through ``moejax.experts.cache`` and classify every (expert, token) cell
    of ``layer``: HEAT_HIT (used and resident before the access), HEAT_MISS (used, not resident),
    HEAT_RESIDENT (resident, unused), HEAT_EMPTY.

    Per-layer scope replays the token sequence of that layer (the other layers do not affect it); global
    scope replays all T·L steps in token-sequential order through one pool. Residency is read with
    ``cache.resident_mask`` before each ``cache.access``. When the trace carries ``hits`` they are
    compared with the replay's: with ``check_hits=None`` only when the trace records the same capacity and
    eviction (a mismatch then raises ValueError), always with True, never with False.

    Returns {"cells": int8 [N, T], "hits": bool [T, K], "used": bool [T, N], "capacity", "n_experts",
    "top_k", "misses", "accesses"}.
    """
    global _HEAT_REPLAY
    import jax.numpy as jnp

    tr, extras = load_trace_data(trace)
    n_tokens, n_layers, k = tr.shape
    n = tr.n_experts
    _check_layer(layer, n_layers)
    layer = int(layer)
    cap = capacity_lib.parse_capacity(capacity, n, n_layers, scope)
    if eviction == "score" and tr.weights is None:
        raise trace_lib.TraceError("score-based eviction needs trace 'weights' [T, L, K]; this trace has none")
    weights = tr.weights if tr.weights is not None else np.zeros(tr.shape, np.float32)
    next_use = (trace_lib.next_use_indices(tr.experts, scope) if eviction in cache_lib.OFFLINE_EVICTIONS
                else np.zeros(tr.shape, np.int32))
    state = cache_lib.init_cache(n_layers, n, cap, scope, eviction, init, seed)
    if scope == "layer":
        layers = np.full((n_tokens,), layer, np.int32)
        sl = (slice(None), layer)
        steps = (tr.experts[sl], weights[sl], next_use[sl])
    else:
        layers = np.tile(np.arange(n_layers, dtype=np.int32), n_tokens)
        steps = tuple(a.reshape(n_tokens * n_layers, k) for a in (tr.experts, weights, next_use))
    if _HEAT_REPLAY is None:
        _HEAT_REPLAY = _heat_replay_fn()
    _, (before, hits) = _HEAT_REPLAY(state, jnp.asarray(layers), *(jnp.asarray(a) for a in steps))
    before, hits = np.asarray(before), np.asarray(hits)
    if scope == "global":
        before, hits = before[layers == layer], hits[layers == layer]
    experts = tr.experts[:, layer]  # [T, K]
    valid = experts >= 0
    used = np.zeros((n_tokens, n), bool)
    rows = np.repeat(np.arange(n_tokens), k)
    used[rows[valid.reshape(-1)], experts[valid]] = True
    # internal consistency: a hit is exactly a used expert that was resident before the access
    expect = valid & before[np.arange(n_tokens)[:, None], np.where(valid, experts, 0)]
    if not np.array_equal(expect, hits & valid):
        raise RuntimeError("cache.access hits disagree with cache.resident_mask read before the access")
    if "hits" in extras and check_hits is not False:
        same = (extras.get("capacity") is not None and int(extras["capacity"]) == cap
                and str(extras.get("eviction", "lru")) == eviction
                and str(extras.get("scope", "layer")) == scope
                and str(extras.get("init", extras.get("cache_init", "empty"))) == init)
        if check_hits or same:
            rec = np.asarray(extras["hits"])[:, layer].astype(bool) & valid
            bad = np.argwhere(rec != (hits & valid))
            if bad.size:
                t = int(bad[0][0])
                raise ValueError(
                    f"trace 'hits' disagree with the replay at token {t}, layer {layer}: recorded "
                    f"{rec[t].astype(int).tolist()}, replayed {(hits[t] & valid[t]).astype(int).tolist()} for experts "
                    f"{experts[t].tolist()} (capacity {cap}, eviction {eviction}, scope {scope}, init {init}); "
                    f"{len(bad)} slot(s) differ")
    cells = np.where(used & before, HEAT_HIT, np.where(used, HEAT_MISS, np.where(before, HEAT_RESIDENT, HEAT_EMPTY)))
    misses = int((valid & ~hits).sum())
    return {"cells": cells.T.astype(np.int8), "hits": hits & valid, "used": used, "capacity": cap,
            "n_experts": n, "top_k": k, "misses": misses, "accesses": int(n_tokens * k)}


def trace_heatmap(trace_path_or_dict, layer: int, capacity, stem, eviction: str = "lru", max_tokens: int = 200,
                  *, start: int = 0, scope: str = "layer", init: str = "empty", seed: int = 0,
                  labels: Sequence[str] | None = None, check_hits: bool | None = None) -> list[Path]:
    """Paper figure 7: tokens (x) × experts (y) of one MoE layer, each cell a cache hit (green), a miss
    (red), resident but unused (blue) or empty (white), for tokens [start, start + max_tokens). Several
    traces (a list) give stacked panels, e.g. original routing above cache-prior. ``stem``: a figure path
    (``plots.figure_paths``). See ``classify_trace``."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    traces = list(trace_path_or_dict) if isinstance(trace_path_or_dict, (list, tuple)) else [trace_path_or_dict]
    if not traces:
        raise ValueError("no traces given")
    if labels is not None and len(labels) != len(traces):
        raise ValueError(f"{len(labels)} labels for {len(traces)} traces")
    if max_tokens < 1 or start < 0:
        raise ValueError(f"need max_tokens >= 1 and start >= 0, got {max_tokens}, {start}")
    results = [classify_trace(t, layer, capacity, eviction, scope, init, seed, check_hits) for t in traces]
    n = results[0]["n_experts"]
    width = min(max_tokens, max(r["cells"].shape[1] for r in results) - start)
    if width < 1:
        raise ValueError(f"start {start} is past the end of the trace(s)")
    fig, axes = new_figure(len(traces), 1, panel=(max(6.0, min(18.0, 0.06 * width + 2)), max(2.2, 0.13 * n + 1.2)))
    cmap = ListedColormap(list(HEAT_COLORS))
    for i, (ax, res) in enumerate(zip(axes[:, 0], results)):
        cells = res["cells"][:, start:start + width]
        ax.imshow(cells, aspect="auto", cmap=cmap, vmin=-0.5, vmax=3.5, interpolation="nearest",
                  extent=(start - 0.5, start + cells.shape[1] - 0.5, n - 0.5, -0.5))
        shown = cells.shape[1] * res["top_k"]
        win_miss = int((cells == HEAT_MISS).sum())
        name = labels[i] if labels else (str(traces[i]) if isinstance(traces[i], (str, os.PathLike)) else f"trace {i}")
        ax.set_title(f"{name} — layer {layer}, C = {res['capacity']} / {n}, {_eviction_name(eviction)}: miss rate "
                     f"{win_miss / shown:.1%} on tokens {start}–{start + cells.shape[1] - 1} "
                     f"({res['misses'] / res['accesses']:.1%} over all {res['cells'].shape[1]})", fontsize=9)
        ax.set_ylabel("expert")
        if n <= 64:
            ax.set_yticks(range(0, n, max(1, n // 8)))
    axes[-1, 0].set_xlabel("token")
    fig.legend(handles=[Patch(facecolor=c, edgecolor="gray", label=l) for c, l in zip(HEAT_COLORS, HEAT_NAMES)],
               loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    return save_figure(fig, stem)


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    parser = argparse.ArgumentParser(prog=commands.prog("plots"), description=__doc__.split("\n\n")[0],
                                     formatter_class=commands.HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    hp = sub.add_parser("heatmap", help="routing-trace heat map of one layer (paper figure 7)")
    hp.add_argument("traces", nargs="+", metavar="TRACE.npz", help="one or more traces (stacked panels)")
    hp.add_argument("--layer", type=int, default=0)
    hp.add_argument("--cache-size", required=True, help="count ('16') or fraction of N ('0.5')")
    hp.add_argument("--eviction", choices=EVICTION_ORDER, default="lru")
    hp.add_argument("--cache-scope", "--scope", dest="scope", choices=("layer", "global"), default="layer",
                    help="as in generate/evaluate (--scope is the older spelling)")
    hp.add_argument("--cache-init", choices=("empty", "random"), default="empty")
    hp.add_argument("--seed", type=errors.seed_arg, default=None, help="seed of --cache-init random (default 0)")
    hp.add_argument("--max-tokens", type=int, default=200)
    hp.add_argument("--start", type=int, default=0, help="first token shown (the replay starts at token 0)")
    hp.add_argument("--label", action="append", default=None, help="panel title, once per trace (default: the trace's file name)")
    hp.add_argument("--out", required=True, help="figure file: FIG.png, FIG.svg or FIG.pdf writes that file; a "
                                                 "stem without such a suffix writes STEM.png and STEM.svg")
    hp.add_argument("--overwrite", action="store_true", help="replace the figure file(s) if they exist")
    args = parser.parse_args(argv)
    try:
        for path in figure_paths(args.out):  # every file it would write, before reading a trace
            atomic.check_output(path, args.overwrite, "--out")
        if args.seed is not None and args.cache_init != "random":
            raise errors.UsageError("--seed only applies with --cache-init random")
        check_heatmap(args.traces, args.layer, args.cache_size, args.scope)
        paths = trace_heatmap(args.traces, args.layer, args.cache_size, args.out, args.eviction, args.max_tokens,
                              start=args.start, scope=args.scope, init=args.cache_init, seed=args.seed or 0,
                              labels=args.label)
    except errors.HANDLED as err:
        return errors.report(err)
    return errors.print_result("\n".join(map(str, paths)))


if __name__ == "__main__":
    sys.exit(main())
