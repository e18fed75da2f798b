"""Figures for the evaluation studies, and the routing-trace heat map.

Every study plot takes a list of result records (one JSON object per sweep point, the schema written by
the sweeps and read by ``moejax.report``) and an output *stem*; it writes ``stem.png`` and ``stem.svg``
(each atomically: a temporary file in the same folder, then ``os.replace``) and returns their paths.
A plot whose records hold nothing it can draw raises ``PlotError``.

    pareto          perplexity vs miss rate per routing kind, Pareto fronts, Belady bound (paper figs 4, 14)
    cache_size      miss rate vs cache size: LRU, Belady, cache-prior at +1/5/10 % perplexity (fig 10)
    sensitivity     perplexity vs k: drop ranks >= k, replace rank k by a random expert (fig 2)
    eviction        miss rate and collision-miss share per eviction policy and pool size (SpecMD fig 4)
    tasks           accuracy vs miss rate per task (figs 5, 6)
    init            empty vs random initial cache (appendix G)
    delta           running vs calibrated logit range Δ (appendix D, fig 15)
    lifetimes_table markdown: cache lifetimes and miss rates, original vs cache-prior (table 2)
    trace_heatmap   tokens x experts of one layer: hit, miss, resident, empty (figs 7, 18)

matplotlib is imported only inside the functions that draw (Agg canvas, no pyplot state), so
``import moejax`` never pulls it in.

    python -m moejax.plots heatmap TRACE.npz [MORE.npz ...] --layer 0 --cache-size 16 --out figs/heatmap
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import math
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from moejax.base import errors, interrupts
from moejax.experts import cache as cache_lib, trace as trace_lib

KIND_ORDER = ("original", "pruning", "max-rank", "cumsum", "cache-prior", "learned-prior", "drop", "random-replace")
KIND_COLORS = {
    "original": "black", "pruning": "tab:gray", "max-rank": "tab:blue", "cumsum": "tab:green",
    "cache-prior": "tab:purple", "learned-prior": "tab:orange", "drop": "tab:brown", "random-replace": "tab:red",
}
# the swept parameter of each routing kind (for labels and sorting)
KIND_PARAM = {"pruning": "prune_h", "max-rank": "max_rank", "cumsum": "cumsum_p", "cache-prior": "lam",
              "learned-prior": "lam", "drop": "drop_rank", "random-replace": "random_rank"}
PARAM_SYMBOL = {"lam": "λ", "prune_h": "h", "max_rank": "M", "cumsum_p": "p", "random_rank": "k", "drop_rank": "k",
                "top_j": "J", "delta": "Δ"}
EVICTION_ORDER = ("lru", "lfu", "fld", "score", "least-stale", "belady", "belady-bypass")
PPL_TOLERANCES = (0.01, 0.05, 0.10)  # cache-size ablation and headlines: +1 / +5 / +10 % perplexity
PPL_VIEWS = (0.01, 0.02, 0.05, 0.10, 0.30)  # Pareto-plot zoom levels: perplexity up to +x % over original
PPL_VIEW_SHARE = 0.85  # the zoom keeps at least this share of a panel's points in view
_STD_CACHE_KEYS = ("size", "capacity", "scope", "eviction", "init", "seed")


class PlotError(ValueError):
    """The records hold nothing this plot can draw (the message says what is missing)."""


# ------------------------------------------------------------------------------------ record access


def num(x) -> float | None:
    """A finite float, or None (null, NaN, inf, strings, bools)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def routing_of(r: dict) -> dict:
    return r.get("routing") or {}


def cache_of(r: dict) -> dict:
    return r.get("cache") or {}


def kind_of(r: dict) -> str:
    """The routing kind; the sensitivity hooks on top of original routing (``drop_rank``: drop experts
    ranked >= k; ``random_rank``: replace the rank-k expert by a random one) count as kinds "drop" and
    "random-replace", so "original" always means plain original routing."""
    ro = routing_of(r)
    kind = str(ro.get("kind") or "?")
    if kind in ("original", "?"):
        if ro.get("drop_rank") is not None:
            return "drop"
        if ro.get("random_rank") is not None:
            return "random-replace"
    return kind


def is_belady(r: dict) -> bool:
    return routing_of(r).get("bound") == "belady" or cache_of(r).get("eviction") == "belady"


def capacity_of(r: dict) -> int | None:
    c = num(cache_of(r).get("capacity"))
    return None if c is None else int(c)


def eviction_of(r: dict) -> str:
    return str(cache_of(r).get("eviction") or "-")


N_EXPERTS_HINT: contextvars.ContextVar = contextvars.ContextVar("n_experts_hint", default=None)
"""N to fall back on when records cannot tell it (the report sets it from all the files it reads)."""


def metric_of(r: dict, name: str):
    """``metrics[name]``, else the cache statistics' ``metrics["cache"][name]`` (the sweeps store the
    evaluation's full result under ``metrics``, its cache summary under ``metrics.cache``)."""
    m = r.get("metrics") or {}
    if m.get(name) is not None:
        return m[name]
    c = m.get("cache")
    return c.get(name) if isinstance(c, dict) else None


def n_experts_of(records: Iterable[dict]) -> int | None:
    """N (routed experts per layer), from the first record that tells: ``metrics.n_experts`` (or under
    ``metrics.cache``), the expert-usage entropy bound log2 N, or a per-layer cache given as a fraction
    of N (``cache.size`` "1.0" / "0.5" with its capacity)."""
    records = list(records)
    for r in records:
        n = num(metric_of(r, "n_experts"))
        if n is not None:
            return int(n)
        usage = metric_of(r, "expert_usage")
        if isinstance(usage, dict) and num(usage.get("entropy_max_bits")) is not None:
            return int(round(2 ** usage["entropy_max_bits"]))
    best = None
    for r in records:
        c, size = cache_of(r), str(cache_of(r).get("size") or "")
        cap = capacity_of(r)
        if c.get("scope", "layer") != "layer" or cap is None or "." not in size or size.endswith("%"):
            continue
        try:
            frac = float(size)
        except ValueError:
            continue
        if 0 < frac <= 1 and (best is None or frac > best[0]):
            best = (frac, cap)
    if best is not None:
        frac, cap = best
        exact = [n for n in range(cap, int(cap / frac) + 2) if abs(frac * n - cap) < 1e-9]
        if len(exact) == 1:  # e.g. "0.5" -> 16 means N = 32 (not 31, which also rounds to 16)
            return exact[0]
    return N_EXPERTS_HINT.get()


def top_k_of(records: Iterable[dict]) -> int | None:
    """K (experts per token), from ``metrics.experts_per_token`` / ``top_k`` or the cache statistics
    (accesses per layer = K · tokens)."""
    for r in records:
        k = num(metric_of(r, "experts_per_token"))
        if k is None:
            k = num(metric_of(r, "top_k"))
        if k is not None:
            return int(k)
        pl, tokens = metric_of(r, "per_layer"), num(metric_of(r, "tokens"))
        if isinstance(pl, dict) and pl.get("accesses") and tokens:
            k = pl["accesses"][0] / tokens
            if k >= 1 and float(k).is_integer():
                return int(k)
    return None


def policy_param(r: dict) -> tuple[str | None, Any]:
    """(name, value) of the parameter a routing kind is swept over (λ, M, p, h, k), else the first sweep
    parameter, else (None, None)."""
    ro = routing_of(r)
    name = KIND_PARAM.get(kind_of(r))
    if name is not None and ro.get(name) is not None:
        return name, ro[name]
    if kind_of(r) == "random-replace":
        for alt in ("rank", "replace_rank", "k"):
            if ro.get(alt) is not None:
                return "random_rank", ro[alt]
    sweep = r.get("sweep") or {}
    for k, v in sweep.items():
        return k, v
    return None, None


def fmt_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def routing_label(r: dict, with_param: bool = True) -> str:
    """"cache-prior λ=0.5", "pruning h=3", "original" ..."""
    kind = kind_of(r)
    if not with_param or kind == "original":
        return kind
    name, value = policy_param(r)
    if name is None or value is None:
        return kind
    return f"{kind} {PARAM_SYMBOL.get(name, name)}={fmt_value(value)}"


def _sort_value(v) -> tuple:
    """A sort key that orders numbers numerically, then strings, with None last."""
    if v is None:
        return (2, 0.0, "")
    f = num(v)
    return (0, f, "") if f is not None else (1, 0.0, str(v))


def kind_rank(kind: str) -> tuple:
    return (KIND_ORDER.index(kind), "") if kind in KIND_ORDER else (len(KIND_ORDER), kind)


def eviction_rank(ev: str) -> tuple:
    return (EVICTION_ORDER.index(ev), "") if ev in EVICTION_ORDER else (len(EVICTION_ORDER), ev)


def collision_rate(r: dict) -> float | None:
    """Collision misses as a fraction of all accesses (so it sits inside the miss-rate bar), from
    ``metrics.collision_rate``, or the counts (``collision_misses`` with ``metrics.accesses``, or with
    ``metrics.misses`` and the miss rate)."""
    for name in ("collision_rate", "collision_miss_rate"):
        if num(metric_of(r, name)) is not None:
            return num(metric_of(r, name))
    coll = num(r.get("collision_misses"))
    if coll is None:
        coll = num(metric_of(r, "collision_misses"))
    if coll is None:
        return None
    acc = num(metric_of(r, "accesses"))
    if acc:
        return coll / acc
    misses, mr = num(metric_of(r, "misses")), num(r.get("miss_rate"))
    if misses and mr is not None:
        return coll / misses * mr
    if misses == 0:
        return 0.0
    return None


# ----------------------------------------------------------------------------------- pure analysis


def ppl_view(ys: Sequence[float], ref: float) -> float | None:
    """The tightest zoom in PPL_VIEWS (perplexity up to ref·(1 + v)) that keeps PPL_VIEW_SHARE of ``ys`` in
    view, or None when every point fits under the widest one anyway."""
    if not ys or max(ys) <= ref * (1 + PPL_VIEWS[0]):
        return None
    for v in PPL_VIEWS:
        if sum(y <= ref * (1 + v) for y in ys) >= PPL_VIEW_SHARE * len(ys):
            return v if max(ys) > ref * (1 + v) else None
    return PPL_VIEWS[-1]


def pareto_indices(points: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the points not dominated when minimising both coordinates, ordered by (x, y).

    q dominates p when q <= p in both coordinates and q != p; identical points do not dominate each
    other (both stay). Points with a missing or non-finite coordinate are never on the front.
    """
    good = [i for i, p in enumerate(points) if num(p[0]) is not None and num(p[1]) is not None]
    order = sorted(good, key=lambda i: (float(points[i][0]), float(points[i][1])))
    front, best_x, best_y = [], math.inf, math.inf
    for i in order:
        x, y = float(points[i][0]), float(points[i][1])
        # every earlier point has x' <= x (and y' <= y when x' == x); the earliest one with the least y
        # has the least x among them, so it alone decides whether (x, y) is dominated
        if best_y < y or (best_y == y and best_x < x):
            continue
        front.append(i)
        if y < best_y:
            best_x, best_y = x, y
    return front


def pareto_front(points: Sequence[Sequence[float]]) -> list[tuple[float, float]]:
    """The non-dominated points (minimising both x and y), ordered by x: e.g. (miss rate, perplexity)."""
    return [(float(points[i][0]), float(points[i][1])) for i in pareto_indices(points)]


def is_selection(r: dict) -> bool:
    """A derived record (``method: "selection"``): a copy of the sweep point a study selected (e.g. the
    lowest miss rate within a perplexity bound), not a measurement of its own."""
    return r.get("method") == "selection"


def original_records(records: Sequence[dict]) -> list[dict]:
    """Original-routing measurements (not Belady, not selections), best first: a real forward pass before a
    trace replay, LRU before other evictions. With none, cache-prior at λ = 0, which is original routing
    bit for bit (the tasks study runs original routing that way)."""
    orig = [r for r in records if kind_of(r) == "original" and not is_belady(r) and not is_selection(r)]
    if not orig:
        orig = [r for r in records if kind_of(r) == "cache-prior" and num(routing_of(r).get("lam")) == 0.0
                and not is_selection(r)]
    return sorted(orig, key=lambda r: (r.get("method") not in (None, "forward", "task"), eviction_of(r) != "lru"))


def reference_ppl(records: Sequence[dict], capacity: int | None = None) -> float | None:
    """Perplexity of original routing (lossless: it does not depend on the cache). Prefers an original,
    non-Belady record at ``capacity``, then any original record, then cache-prior at λ = 0."""
    def ppls(pred):
        return [num(r.get("ppl")) for r in records if pred(r) and num(r.get("ppl")) is not None]

    for pred in (lambda r: kind_of(r) == "original" and not is_belady(r) and capacity_of(r) == capacity,
                 lambda r: kind_of(r) == "original",
                 lambda r: kind_of(r) == "cache-prior" and num(routing_of(r).get("lam")) == 0.0):
        found = ppls(pred)
        if found:
            return float(np.median(found))
    return None


def best_within(records: Sequence[dict], ref: float, tolerance: float, metric: str = "ppl") -> dict | None:
    """The record with the lowest miss rate whose ``metric`` stays within ``tolerance`` of ``ref``:
    for perplexity ppl <= ref·(1 + tolerance); for accuracy accuracy >= ref − tolerance (absolute).
    Ties go to the better metric. None when nothing qualifies."""
    ok = []
    for r in records:
        mr, v = num(r.get("miss_rate")), num(r.get(metric))
        if mr is None or v is None:
            continue
        if metric == "accuracy":
            if v >= ref - tolerance - 1e-12:
                ok.append((mr, -v, r))
        elif v <= ref * (1.0 + tolerance) * (1 + 1e-12):
            ok.append((mr, v, r))
    if not ok:
        return None
    return min(ok, key=lambda t: (t[0], t[1]))[2]


def cache_size_series(records: Sequence[dict], tolerances: Sequence[float] = PPL_TOLERANCES) -> dict:
    """Figure 10's curves: {"lru": [(C, miss)], "belady": [(C, miss)], "cache-prior +1%": [(C, miss, rec)],
    ...}, each sorted by C. Cache-prior at C is the point with the lowest miss rate whose perplexity stays
    within the tolerance of original routing's."""
    caps = sorted({capacity_of(r) for r in records if capacity_of(r) is not None})
    out: dict[str, list] = {"lru": [], "belady": []}
    for t in tolerances:
        out[f"cache-prior +{t:.0%}"] = []
    for c in caps:
        at = [r for r in records if capacity_of(r) == c and num(r.get("miss_rate")) is not None
              and not is_selection(r)]
        lru = [r for r in at if kind_of(r) == "original" and not is_belady(r) and eviction_of(r) == "lru"]
        if lru:
            out["lru"].append((c, float(np.mean([r["miss_rate"] for r in lru]))))
        bel = [r for r in at if is_belady(r)]
        if bel:
            out["belady"].append((c, float(np.mean([r["miss_rate"] for r in bel]))))
        ref = reference_ppl(records, c)
        # candidates: the cache-prior grid and original routing with LRU itself (λ = 0)
        cand = [r for r in at if kind_of(r) == "cache-prior"] + [r for r in lru if num(r.get("ppl")) is not None]
        if ref is None or not cand:
            continue
        for t in tolerances:
            best = best_within(cand, ref, t)
            if best is not None:
                out[f"cache-prior +{t:.0%}"].append((c, float(best["miss_rate"]), best))
    return out


def selection_mismatches(records: Sequence[dict], series: dict | None = None) -> list[str]:
    """Compare a study's own selection records (``method: "selection"``, ``sweep.ppl_bound``) with
    ``cache_size_series``: the selected miss rates must agree (ties may pick different λ)."""
    series = series if series is not None else cache_size_series(records)
    mine = {(p[0], name): p[1] for name, pts in series.items() if name.startswith("cache-prior") for p in pts}
    out = []
    for r in records:
        if not is_selection(r):
            continue
        bound = num((r.get("sweep") or {}).get("ppl_bound"))
        if bound is None or capacity_of(r) is None:
            continue
        name = f"cache-prior +{bound:.0%}"
        got = mine.get((capacity_of(r), name))
        if got is None or abs(got - float(r["miss_rate"])) > 1e-9:
            out.append(f"C = {capacity_of(r)}, +{bound:.0%}: study selected miss rate {r['miss_rate']:.4f}, "
                       f"recomputed {'nothing' if got is None else f'{got:.4f}'}")
    return out


def group_by(records: Iterable[dict], key: Callable[[dict], Any]) -> dict:
    out: dict = defaultdict(list)
    for r in records:
        out[key(r)].append(r)
    return dict(out)


# ------------------------------------------------------------------------------------------ output


def _mpl():
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return matplotlib, Figure, FigureCanvasAgg


def new_figure(nrows: int = 1, ncols: int = 1, panel: tuple[float, float] = (5.0, 3.8)):
    """A Figure on an Agg canvas (no pyplot) with a [nrows, ncols] array of axes."""
    _, Figure, FigureCanvasAgg = _mpl()
    fig = Figure(figsize=(panel[0] * ncols, panel[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write(path, write: Callable[[Any], None], binary: bool = True) -> Path:
    """Write ``path`` through ``write(fileobj)`` into a temporary file in the same folder, then rename it
    over ``path`` (readers never see a partial file; a failure leaves any old file untouched)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _stem(stem) -> Path:
    stem = Path(stem)
    return stem.with_suffix("") if stem.suffix.lower() in (".png", ".svg") else stem


def save_figure(fig, stem) -> list[Path]:
    """Write ``stem.png`` and ``stem.svg`` atomically (reproducible: no dates, fixed SVG ids)."""
    matplotlib, _, _ = _mpl()
    stem = _stem(stem)
    paths = []
    with matplotlib.rc_context({"svg.hashsalt": "moejax", "svg.fonttype": "path"}):
        for ext, meta in (("png", {"Software": None}), ("svg", {"Date": None, "Creator": None})):
            target = stem.with_name(f"{stem.name}.{ext}")
            paths.append(atomic_write(target, lambda f, ext=ext, meta=meta: fig.savefig(
                f, format=ext, dpi=150, metadata=meta)))
    return paths


def _percent_axis(axis) -> None:
    from matplotlib.ticker import PercentFormatter

    axis.set_major_formatter(PercentFormatter(xmax=1.0, decimals=None))


def _color(kind: str, fallback_index: int = 0):
    if kind in KIND_COLORS:
        return KIND_COLORS[kind]
    return f"C{(fallback_index + 3) % 10}"


def _panel_title(model, task, capacity, n_experts, size=None) -> str:
    parts = [p for p in (model, task) if p]
    if capacity is not None:
        cap = f"C = {capacity}" + (f" / {n_experts}" if n_experts else "")
        if size is not None and str(size) != str(capacity):
            cap += f" (size {size})"
        parts.append(cap)
    return " · ".join(str(p) for p in parts)


def _need(records: Sequence[dict], what: str, pred: Callable[[dict], bool]) -> list[dict]:
    found = [r for r in records if pred(r)]
    if not found:
        raise PlotError(f"no records with {what} ({len(records)} records given)")
    return found


def _many(records, field) -> bool:
    return len({r.get(field) for r in records}) > 1


def _grid(n: int) -> tuple[int, int]:
    ncols = min(n, 3)
    return math.ceil(n / ncols), ncols


def _hide_unused(axes, n: int) -> None:
    for ax in axes.flat[n:]:
        ax.set_visible(False)


# ---------------------------------------------------------------------------------- quality vs misses


def _tradeoff(records: Sequence[dict], stem, metric: str, panel_key: Callable[[dict], tuple],
              title: Callable[[tuple, list], str]) -> list[Path]:
    """Shared by pareto (ppl, minimised) and tasks (accuracy, maximised): one panel per key, one Pareto
    line per routing kind over faint sweep points, original routing as a star, Belady as a dashed line."""
    usable = _need(records, f"miss_rate and {metric}",
                   lambda r: num(r.get("miss_rate")) is not None and num(r.get(metric)) is not None
                   and not is_belady(r) and not is_selection(r))
    bel = [r for r in records if is_belady(r) and num(r.get("miss_rate")) is not None]
    panels = group_by(usable, panel_key)
    keys = sorted(panels, key=lambda k: tuple(_sort_value(v) for v in k))
    nrows, ncols = _grid(len(keys))
    fig, axes = new_figure(nrows, ncols)
    sign = -1.0 if metric == "accuracy" else 1.0
    for ax, key in zip(axes.flat, keys):
        pts = panels[key]
        kinds = sorted({kind_of(r) for r in pts if kind_of(r) != "original"}, key=kind_rank)
        for i, kind in enumerate(kinds):
            rs = [r for r in pts if kind_of(r) == kind]
            xs = [r["miss_rate"] for r in rs]
            ys = [r[metric] for r in rs]
            color = _color(kind, i)
            ax.scatter(xs, ys, s=12, color=color, alpha=0.3, linewidths=0)
            front = [rs[j] for j in pareto_indices([(x, sign * y) for x, y in zip(xs, ys)])]
            ax.plot([r["miss_rate"] for r in front], [r[metric] for r in front], "-o", ms=3.5, lw=1.6,
                    color=color, label=kind)
        model, task, cap = key[0], key[1], key[2]
        orig = original_records(pts)
        if orig:  # one star: the best original-routing measurement (see original_records)
            r = orig[0]
            lam0 = "; run as cache-prior λ=0" if kind_of(r) != "original" else ""
            ax.plot([r["miss_rate"]], [r[metric]], "*", ms=14, color="black", zorder=5,
                    label=f"original routing ({_eviction_name(eviction_of(r))}{lam0})")
            ax.axhline(r[metric], color="black", lw=0.6, ls=":", zorder=0)
        for j, r in enumerate(b for b in bel if capacity_of(b) == cap and b.get("model") == model):
            ax.axvline(r["miss_rate"], color="black", ls="--", lw=1.2,
                       label="Belady bound (optimal eviction)" if j == 0 else None)
            ax.annotate(f" Belady {r['miss_rate']:.1%}", (r["miss_rate"], 1.0), xycoords=("data", "axes fraction"),
                        ha="left", va="top", fontsize=7)
        ys_all = [float(r[metric]) for r in pts]
        ref = reference_ppl(pts, cap) if metric == "ppl" else None
        view = ppl_view(ys_all, ref) if ref is not None else None
        if view is not None:
            # keep the interesting region readable (paper figures 4/14 do the same): clip far-off points
            low, top = min(ys_all), ref * (1 + view)
            ax.set_ylim(low - 0.04 * (top - low), top + 0.02 * (top - low))
            shown = [r["miss_rate"] for r in pts if r[metric] <= top] + \
                [b["miss_rate"] for b in bel if capacity_of(b) == cap and b.get("model") == model]
            pad = 0.04 * (max(shown) - min(shown) or 0.05)
            ax.set_xlim(min(shown) - pad, max(shown) + pad)
            hidden = sum(y > top for y in ys_all)
            ax.set_title(f"{title(key, pts)}\n(zoomed to ≤ +{view:.0%} perplexity: {hidden} point(s) above it off the plot)",
                         fontsize=9)
        else:
            ax.set_title(title(key, pts), fontsize=10)
        ax.set_xlabel("miss rate")
        ax.set_ylabel("WikiText perplexity" if metric == "ppl" and task == "wikitext" else metric)
        _percent_axis(ax.xaxis)
        if metric == "accuracy":
            _percent_axis(ax.yaxis)
        ax.grid(alpha=0.3)
    _hide_unused(axes, len(keys))
    _shared_legend(fig, axes)
    fig.suptitle("lines: Pareto fronts per routing policy · faint dots: every sweep point", fontsize=9)
    return save_figure(fig, stem)


def _shared_legend(fig, axes) -> None:
    """One legend under the panels, each label once (the kinds keep their colours across panels)."""
    seen: dict = {}
    for ax in np.asarray(axes).flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    if seen:
        fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center", ncols=min(len(seen), 4),
                   fontsize=8, frameon=False)


def pareto(records: Sequence[dict], stem) -> list[Path]:
    """Perplexity vs miss rate (paper figures 4 and 14): one panel per cache capacity (and model/task when
    several), one line per routing kind through its Pareto front, all sweep points faint, original
    routing starred, the Belady bound (``routing.bound == "belady"`` or ``cache.eviction == "belady"``) as
    a vertical dashed line at its miss rate."""
    n = n_experts_of(records)
    return _tradeoff(records, stem, "ppl",
                     lambda r: (r.get("model"), r.get("task"), capacity_of(r)),
                     lambda key, pts: _panel_title(key[0], key[1], key[2], n, cache_of(pts[0]).get("size")))


def tasks(records: Sequence[dict], stem) -> list[Path]:
    """Task accuracy vs miss rate, one panel per task (paper figures 5 and 6); Pareto fronts maximise
    accuracy and minimise misses."""
    n = n_experts_of(records)
    return _tradeoff(records, stem, "accuracy",
                     lambda r: (r.get("model"), r.get("task"), capacity_of(r)),
                     lambda key, pts: _panel_title(key[0] if _many(records, "model") else None, key[1], key[2], n))


def cache_size(records: Sequence[dict], stem) -> list[Path]:
    """Miss rate vs cache size C (paper figure 10): LRU with original routing, Belady, and cache-prior at
    the λ that minimises misses while perplexity stays within +1 / +5 / +10 % of original routing."""
    _need(records, "cache capacity and miss_rate",
          lambda r: capacity_of(r) is not None and num(r.get("miss_rate")) is not None)
    panels = group_by(records, lambda r: (r.get("model"), r.get("task")))
    keys = sorted(panels, key=lambda k: tuple(_sort_value(v) for v in k))
    nrows, ncols = _grid(len(keys))
    fig, axes = new_figure(nrows, ncols, panel=(6.0, 4.0))
    shades = {0: "#c9b3e6", 1: "#8c62c2", 2: "#4b2386"}
    drawn = 0
    for ax, key in zip(axes.flat, keys):
        series = cache_size_series(panels[key])
        if series["lru"]:
            ax.plot(*zip(*series["lru"]), "-o", color="black", ms=4, label="LRU (original routing)")
        if series["belady"]:
            ax.plot(*zip(*series["belady"]), "--s", color="tab:gray", ms=4, label="Belady (optimal eviction)")
        prior = [name for name in series if name.startswith("cache-prior")]
        for i, name in enumerate(reversed(prior)):  # the loosest budget first and widest: coinciding lines stay visible
            pts = series[name]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-^", ms=3 + 2 * (len(prior) - 1 - i),
                        lw=1.2 + 1.2 * (len(prior) - 1 - i), color=shades.get(len(prior) - 1 - i, "tab:purple"),
                        label=f"{name} ppl")
        drawn += sum(len(v) for v in series.values())
        n, k = n_experts_of(panels[key]), top_k_of(panels[key])
        if n:
            ax.axvline(n / 2, color="black", lw=2.0, alpha=0.25, label=f"C = N/2 = {n // 2}")
        if k:
            ax.axvline(k, color="tab:blue", lw=1.0, alpha=0.5, ls=":", label=f"C = K = {k}")
        ax.set_title(_panel_title(key[0], key[1], None, None), fontsize=10)
        ax.set_xlabel("cache size C (experts per layer)")
        ax.set_ylabel("miss rate")
        _percent_axis(ax.yaxis)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if not drawn:
        raise PlotError("no LRU, Belady or cache-prior points per cache size")
    _hide_unused(axes, len(keys))
    return save_figure(fig, stem)


def _rank_k(r: dict) -> float | None:
    """k of a sensitivity point: h for pruning (ranks >= h dropped), ``drop_rank``, ``random_rank``."""
    ro = routing_of(r)
    if kind_of(r) == "pruning":
        return num(ro.get("prune_h"))
    for name in ("drop_rank", "random_rank", "rank", "replace_rank", "k"):
        if num(ro.get(name)) is not None:
            return num(ro[name])
    sweep = r.get("sweep") or {}
    vals = [num(v) for v in sweep.values() if num(v) is not None]
    return vals[0] if len(vals) == 1 else None


def _mean_band(rs: list[dict], x: Callable[[dict], float | None], y: str):
    """(xs, mean, lower err, upper err) over records grouped by x (several seeds -> min/max band)."""
    by = defaultdict(list)
    for r in rs:
        if x(r) is not None and num(r.get(y)) is not None:
            by[x(r)].append(float(r[y]))
    xs = sorted(by)
    mean = np.array([np.mean(by[v]) for v in xs])
    lo = mean - np.array([min(by[v]) for v in xs])
    hi = np.array([max(by[v]) for v in xs]) - mean
    return xs, mean, lo, hi


def sensitivity_split(records: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(drop-ranks->=k points, replace-rank-k points), each with a rank and a perplexity."""
    ok = [r for r in records if _rank_k(r) is not None and num(r.get("ppl")) is not None]
    drop = [r for r in ok if kind_of(r) in ("pruning", "drop")]
    repl = [r for r in ok if kind_of(r) not in ("pruning", "drop", "original")]
    return drop, repl


def sensitivity(records: Sequence[dict], stem) -> list[Path]:
    """Perplexity vs expert rank k (paper figure 2): left, drop every expert ranked >= k (pruning with
    h = k); right, replace the rank-k expert by a random one (mean and min/max over seeds). The dashed
    line is original routing's perplexity."""
    drop, repl = sensitivity_split(records)
    if not drop and not repl:
        raise PlotError("no pruning or random-replacement records with a rank and a perplexity")
    base = reference_ppl(records)
    fig, axes = new_figure(1, 2)
    for ax, rs, title, xlabel in (
            (axes[0, 0], drop, "drop all experts ranked ≥ k", "k (experts ranked ≥ k dropped)"),
            (axes[0, 1], repl, "replace the rank-k expert by a random one", "k (rank replaced)")):
        for i, (kind, group) in enumerate(sorted(group_by(rs, kind_of).items(), key=lambda kv: kind_rank(kv[0]))):
            xs, mean, lo, hi = _mean_band(group, _rank_k, "ppl")
            ax.errorbar(xs, mean, yerr=[lo, hi], fmt="-o", ms=4, capsize=3, color=_color(kind, i), label=kind)
        if base is not None:
            ax.axhline(base, color="black", ls="--", lw=1, label=f"original ({base:.2f})")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("perplexity")
        if rs and max(float(r["ppl"]) for r in rs) > 3 * min(float(r["ppl"]) for r in rs):
            ax.set_yscale("log")
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if rs or base is not None:
            ax.legend(fontsize=8)
        if not rs:
            ax.text(0.5, 0.5, "no records", transform=ax.transAxes, ha="center", va="center", color="gray")
    return save_figure(fig, stem)


# ------------------------------------------------------------------------------------- eviction bars


def varying_cache_options(records: Sequence[dict]) -> list[str]:
    """Cache keys beyond size/capacity/scope/eviction/init/seed (prefetch, miss handling, ...) whose value
    differs between records: what tells otherwise equal configurations apart."""
    keys: list[str] = []
    for r in records:
        keys += [k for k in cache_of(r) if k not in _STD_CACHE_KEYS and k not in keys]
    return [k for k in keys if len({repr(cache_of(r).get(k)) for r in records}) > 1]


def cache_options_text(r: dict, keys: Sequence[str]) -> str:
    parts = []
    for k in keys:
        v = cache_of(r).get(k)
        if v is True:
            parts.append(k)
        elif v is not None and v is not False:
            parts.append(f"{k}={fmt_value(v) if not isinstance(v, (list, tuple)) else ','.join(map(str, v))}")
    return " ".join(parts)


def varying_sweep_keys(records: Sequence[dict], skip: Sequence[str] = ("cache_size", "eviction", "task")) -> list[str]:
    """Sweep parameters (e.g. ``prefetch``) whose value differs between records."""
    keys: list[str] = []
    for r in records:
        keys += [k for k in (r.get("sweep") or {}) if k not in skip and k not in keys]
    return [k for k in keys if len({repr((r.get("sweep") or {}).get(k)) for r in records}) > 1]


def eviction_label(r: dict, records: Sequence[dict] = ()) -> str:
    """The eviction policy, plus what else tells records of the same pool size apart among ``records``:
    routing kind, scope, and the cache options and sweep values that vary (e.g. ``prefetch=top-K``)."""
    records = records or [r]
    parts = [eviction_of(r)]
    if kind_of(r) not in ("original", "?"):
        parts.append(routing_label(r))
    if len({cache_of(x).get("scope") for x in records}) > 1:
        parts.append(str(cache_of(r).get("scope")))
    sweep_keys = varying_sweep_keys(records)
    for k in sweep_keys:  # the study's own names for what it varies (e.g. prefetch=top-K) ...
        v = (r.get("sweep") or {}).get(k)
        if v is not None:
            parts.append(f"{k}={fmt_value(v)}")
    if not sweep_keys:  # ... else the raw cache options that differ
        extra = cache_options_text(r, varying_cache_options(records) if len(records) > 1 else
                                   [k for k in cache_of(r) if k not in _STD_CACHE_KEYS])
        if extra:
            parts.append(extra)
    return " ".join(parts)


def _size_key(r: dict) -> tuple:
    """(capacity, size text) of a record's cache, for grouping and ordering pool sizes."""
    c = cache_of(r)
    return (capacity_of(r), str(c.get("size") if c.get("size") is not None else c.get("capacity")))


def _scope_name(scope) -> str:
    return {"global": "global pool", "layer": "per layer"}.get(str(scope), str(scope))


def eviction_panels(records: Sequence[dict]) -> list[tuple[tuple, list[dict]]]:
    """[((scope, (capacity, size)), records)] in order: global pools first (SpecMD's setting), then
    per-layer caches (e.g. the prefetch comparison), each by size."""
    rs = [r for r in records if r.get("cache") is not None and num(r.get("miss_rate")) is not None]
    groups = group_by(rs, lambda r: (str(cache_of(r).get("scope")), _size_key(r)))
    return sorted(groups.items(), key=lambda kv: (kv[0][0] != "global", kv[0][0], _sort_value(kv[0][1][0]), kv[0][1][1]))


def eviction(records: Sequence[dict], stem) -> list[Path]:
    """Miss rate (gray) and its collision-miss part (red: misses on an expert evicted earlier in the same
    forward pass) per eviction policy, one panel per cache scope and size (SpecMD figure 4); configurations
    that differ in more than the policy (prefetch settings ...) are labelled by what differs. When the
    records carry prefetch precision/recall a last panel shows them."""
    rs = _need(records, "a cache and a miss_rate",
               lambda r: r.get("cache") is not None and num(r.get("miss_rate")) is not None)
    panels = eviction_panels(rs)
    by_scope = group_by(rs, lambda r: str(cache_of(r).get("scope")))
    label = lambda r: eviction_label(r, by_scope[str(cache_of(r).get("scope"))])  # noqa: E731
    pref = [r for r in rs if num(r.get("prefetch_precision")) is not None or num(r.get("prefetch_recall")) is not None]
    n_labels = max(len({label(r) for r in group}) for _, group in panels)
    n_axes = len(panels) + bool(pref)
    ncols = min(n_axes, 4)
    fig, axes = new_figure(math.ceil(n_axes / ncols), ncols, panel=(max(3.0, 0.5 * n_labels + 1.2), 4.4))
    for ax, ((scope, size), group) in zip(axes.flat, panels):
        cells = group_by(group, label)
        names = sorted(cells, key=lambda s: (eviction_rank(s.split(" ")[0]), s))
        for i, name in enumerate(names):
            mr = float(np.mean([g["miss_rate"] for g in cells[name]]))
            ax.bar(i, mr, 0.75, color="lightgray", edgecolor="dimgray", lw=0.6, label="all misses" if i == 0 else None)
            cr = [collision_rate(g) for g in cells[name]]
            if all(c is not None for c in cr) and max(cr) > 0:
                ax.bar(i, float(np.mean(cr)), 0.45, color="tab:red", label="collision misses")
            ax.text(i, mr, f"{mr:.1%}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_ylim(0, max(g["miss_rate"] for g in group) * 1.15 + 1e-9)
        _percent_axis(ax.yaxis)
        n = n_experts_of(records) if scope == "layer" else None
        if size[0] is None:
            cap = ""
        elif n:
            cap = f" (C = {size[0]} / {n})" if size[1] != str(size[0]) else f" / {n}"
        else:
            cap = "" if size[1] == str(size[0]) else f" (C = {size[0]})"
        ax.set_title(f"{_scope_name(scope)}, cache size {size[1]}{cap}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    for ax in axes[:, 0]:
        ax.set_ylabel("share of expert accesses")
    _hide_unused(axes, n_axes)
    _shared_legend(fig, axes.flat[:len(panels)])
    fig.suptitle("misses and collision misses per eviction policy", fontsize=10)
    if pref:
        ax2 = axes.flat[len(panels)]
        cells = group_by(pref, lambda r: (_size_key(r), label(r)))
        names = sorted(cells, key=lambda t: (_sort_value(t[0][0]), t[0][1], eviction_rank(t[1].split(" ")[0]), t[1]))
        xs = np.arange(len(names))
        for off, field, color in ((-0.2, "prefetch_precision", "tab:blue"), (0.2, "prefetch_recall", "tab:orange")):
            vals = []
            for name in names:
                got = [num(g.get(field)) for g in cells[name] if num(g.get(field)) is not None]
                vals.append(float(np.mean(got)) if got else 0.0)
            ax2.bar(xs + off, vals, 0.38, color=color, label=field.replace("prefetch_", ""))
        ax2.set_xticks(xs)
        ax2.set_xticklabels([f"{lab} @ {size[1]}" for size, lab in names], rotation=35, ha="right", fontsize=7)
        ax2.set_ylim(0, 1.05)
        _percent_axis(ax2.yaxis)
        ax2.set_title("prefetch precision and recall", fontsize=9)
        ax2.legend(fontsize=8)
        ax2.grid(alpha=0.3, axis="y")
    return save_figure(fig, stem)


# ------------------------------------------------------------------------------------- init / delta


def init_label(r: dict) -> str:
    return str(cache_of(r).get("init") or "empty")


def first_token_miss_rates(r: dict) -> list[tuple[int, float]]:
    """[(n, miss rate over the first n tokens)] from ``metrics.miss_rate_first_tokens`` ({"16": 0.41, ...})."""
    early = metric_of(r, "miss_rate_first_tokens")
    if not isinstance(early, dict):
        return []
    out = []
    for k, v in early.items():
        try:
            n = int(k)
        except (TypeError, ValueError):
            continue
        if num(v) is not None:
            out.append((n, float(v)))
    return sorted(out)


def init_group_label(r: dict, records: Sequence[dict]) -> str:
    """The routing label, plus the cache size when the records span several."""
    label = routing_label(r)
    if len({capacity_of(x) for x in records}) > 1 and capacity_of(r) is not None:
        label += f" C={capacity_of(r)}"
    return label


def init(records: Sequence[dict], stem) -> list[Path]:
    """Empty vs random initial cache (paper appendix G): miss rate, and perplexity when present, per
    routing policy; bars are means over seeds with min/max whiskers."""
    rs = _need(records, "a miss_rate", lambda r: num(r.get("miss_rate")) is not None)
    metrics = ["miss_rate"] + (["ppl"] if any(num(r.get("ppl")) is not None for r in rs) else [])
    policies = sorted({init_group_label(r, rs) for r in rs}, key=lambda s: (kind_rank(s.split(" ")[0]), s))
    inits = sorted({init_label(r) for r in rs}, key=lambda s: (s != "empty", s))
    early = any(first_token_miss_rates(r) for r in rs)
    fig, axes = new_figure(1, len(metrics) + early, panel=(min(7.0, max(4.5, 1.0 * len(policies) * len(inits))), 3.8))
    if early:  # miss rate over the first n tokens: how fast the initial content stops mattering
        ax = axes[0, -1]
        styles = ("-", "--", ":", "-.")
        for i, pol in enumerate(policies):
            for j, ini in enumerate(inits):
                curves = [first_token_miss_rates(r) for r in rs if init_group_label(r, rs) == pol and init_label(r) == ini]
                curves = [c for c in curves if c]
                if not curves:
                    continue
                ns = sorted(set.intersection(*(set(n for n, _ in c) for c in curves)))
                ys = [np.mean([dict(c)[n] for c in curves]) for n in ns]
                ax.plot(ns, ys, styles[j % 4], marker="o", ms=3, color=f"C{i}", label=f"{pol}, {ini}")
        ax.set_xscale("log", base=2)
        ticks = sorted({n for r in rs for n, _ in first_token_miss_rates(r)})
        ax.set_xticks(ticks, [str(n) for n in ticks])
        ax.set_xlabel("first n tokens")
        ax.set_ylabel("miss rate over the first n tokens")
        _percent_axis(ax.yaxis)
        ax.set_title("warm-up: empty vs random initial cache", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    width = 0.8 / len(inits)
    for ax, metric in zip(axes.flat[:len(metrics)], metrics):
        for j, ini in enumerate(inits):
            means, lo, hi, xs = [], [], [], []
            for i, pol in enumerate(policies):
                vals = [float(r[metric]) for r in rs if init_group_label(r, rs) == pol and init_label(r) == ini
                        and num(r.get(metric)) is not None]
                if vals:
                    xs.append(i + (j - (len(inits) - 1) / 2) * width)
                    means.append(np.mean(vals))
                    lo.append(np.mean(vals) - min(vals))
                    hi.append(max(vals) - np.mean(vals))
            spread = any(v > 0 for v in lo + hi)  # whiskers only where several seeds differ
            ax.bar(xs, means, width * 0.9, yerr=[lo, hi] if spread else None, capsize=3, label=f"{ini} cache",
                   color=("tab:blue", "tab:orange", "tab:green", "tab:red")[j % 4])
        ax.set_xticks(range(len(policies)))
        ax.set_xticklabels(policies, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("miss rate" if metric == "miss_rate" else "perplexity")
        if metric == "miss_rate":
            _percent_axis(ax.yaxis)
        else:
            vals = [float(r["ppl"]) for r in rs if num(r.get("ppl")) is not None]
            pad = max(0.02 * (max(vals) - min(vals)), 0.01 * max(vals))
            ax.set_ylim(min(vals) - 4 * pad, max(vals) + 4 * pad)
        ax.set_title(f"initial cache state: {'miss rate' if metric == 'miss_rate' else 'perplexity'}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, stem)


def delta_label(r: dict) -> str:
    ro = routing_of(r)
    for name in ("delta_source", "delta_mode", "delta_kind"):
        if ro.get(name):
            src = str(ro[name])
            return src if num(ro.get("delta")) is None else f"{src} Δ={fmt_value(ro['delta'])}"
    d = ro.get("delta")
    if d is None:
        return "running Δavg"
    if isinstance(d, (list, tuple)):
        return f"calibrated Δ (per layer, mean {np.mean(d):.3g})"
    return f"calibrated Δ={fmt_value(d)}"


def delta(records: Sequence[dict], stem) -> list[Path]:
    """Running vs calibrated logit range Δ (paper appendix D, figure 15): perplexity vs miss rate with one
    line per Δ strategy through its λ sweep; original routing starred."""
    rs = _need(records, "miss_rate and ppl",
               lambda r: num(r.get("miss_rate")) is not None and num(r.get("ppl")) is not None and not is_belady(r))
    fig, axes = new_figure(1, 1, panel=(6.0, 4.2))
    ax = axes[0, 0]
    prior = [r for r in rs if kind_of(r) != "original"]
    for i, (label, group) in enumerate(sorted(group_by(prior, delta_label).items())):
        group = sorted(group, key=lambda r: _sort_value(policy_param(r)[1]))
        ax.plot([r["miss_rate"] for r in group], [r["ppl"] for r in group], "-o", ms=3, color=f"C{i}",
                label=f"{label} ({len(group)} λ)")
    for j, r in enumerate(r for r in rs if kind_of(r) == "original"):
        ax.plot([r["miss_rate"]], [r["ppl"]], "*", ms=14, color="black", label="original" if j == 0 else None)
    ax.set_xlabel("miss rate")
    ax.set_ylabel("perplexity")
    _percent_axis(ax.xaxis)
    ax.set_title("cache-prior: running vs calibrated logit range Δ", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, stem)


# ------------------------------------------------------------------------------------------ tables


def md_escape(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: Sequence[str] | None = None) -> str:
    """A GitHub markdown table; ``align`` per column: "l" or "r"."""
    align = align or ["l"] * len(header)
    lines = ["| " + " | ".join(md_escape(h) for h in header) + " |",
             "|" + "|".join("---:" if a == "r" else ":---" for a in align) + "|"]
    lines += ["| " + " | ".join(md_escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt_pct(x, digits: int = 2) -> str:
    x = num(x)
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def fmt_num(x, digits: int = 3) -> str:
    x = num(x)
    return "–" if x is None else f"{x:.{digits}f}"


def lifetimes_table(records: Sequence[dict]) -> str:
    """Paper table 2 as markdown: per model and cache size, original vs cache-prior routing, with the mean
    cache lifetime (± std, tokens from load to eviction) and the miss rate."""
    rs = _need(records, "a lifetime or a miss_rate",
               lambda r: num(r.get("lifetime")) is not None or num(r.get("miss_rate")) is not None)
    n = n_experts_of(rs)
    rs = sorted(rs, key=lambda r: (str(r.get("model")), str(r.get("task")), _sort_value(capacity_of(r)),
                                   is_belady(r), kind_rank(kind_of(r)), _sort_value(policy_param(r)[1])))
    rows = []
    for r in rs:
        life = num(r.get("lifetime"))
        std = num(r.get("lifetime_std"))
        cap = capacity_of(r)
        rows.append([r.get("model") or "–", r.get("task") or "–",
                     "–" if cap is None else (f"{cap} / {n}" if n else str(cap)),
                     routing_label(r) + (" (Belady)" if is_belady(r) and eviction_of(r) != "belady" else ""),
                     eviction_of(r),
                     "–" if life is None else (f"{life:.1f} (± {std:.1f})" if std is not None else f"{life:.1f}"),
                     fmt_pct(r.get("miss_rate"), 1)])
    return md_table(["model", "task", "cache size", "routing", "eviction", "lifetime (tokens)", "miss rate"],
                    rows, ["l", "l", "r", "l", "l", "r", "r"])


# ----------------------------------------------------------------------------------- trace heat map

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
            cache_lib.parse_capacity(capacity, tr.n_experts, tr.shape[1], scope)
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
    cap = cache_lib.parse_capacity(capacity, n, n_layers, scope)
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


def _eviction_name(ev: str) -> str:
    return ev.upper() if ev in ("lru", "lfu", "fld") else ev


def trace_heatmap(trace_path_or_dict, layer: int, capacity, stem, eviction: str = "lru", max_tokens: int = 200,
                  *, start: int = 0, scope: str = "layer", init: str = "empty", seed: int = 0,
                  labels: Sequence[str] | None = None, check_hits: bool | None = None) -> list[Path]:
    """Paper figure 7: tokens (x) × experts (y) of one MoE layer, each cell a cache hit (green), a miss
    (red), resident but unused (blue) or empty (white), for tokens [start, start + max_tokens). Several
    traces (a list) give stacked panels, e.g. original routing above cache-prior. See ``classify_trace``."""
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


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    parser = argparse.ArgumentParser(prog="python -m moejax.plots", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    hp = sub.add_parser("heatmap", help="routing-trace heat map of one layer (paper figure 7)")
    hp.add_argument("traces", nargs="+", metavar="TRACE.npz", help="one or more traces (stacked panels)")
    hp.add_argument("--layer", type=int, default=0)
    hp.add_argument("--cache-size", required=True, help="count ('16') or fraction of N ('0.5')")
    hp.add_argument("--eviction", choices=EVICTION_ORDER, default="lru")
    hp.add_argument("--cache-scope", "--scope", dest="scope", choices=("layer", "global"), default="layer",
                    help="as in generate/evaluate (--scope is the older spelling)")
    hp.add_argument("--cache-init", choices=("empty", "random"), default="empty")
    hp.add_argument("--seed", type=int, default=0, help="seed of --cache-init random")
    hp.add_argument("--max-tokens", type=int, default=200)
    hp.add_argument("--start", type=int, default=0, help="first token shown (the replay starts at token 0)")
    hp.add_argument("--label", action="append", default=None, help="panel title, once per trace")
    hp.add_argument("--out", required=True, help="output stem: writes STEM.png and STEM.svg")
    args = parser.parse_args(argv)
    try:
        check_heatmap(args.traces, args.layer, args.cache_size, args.scope)
        paths = trace_heatmap(args.traces, args.layer, args.cache_size, args.out, args.eviction, args.max_tokens,
                              start=args.start, scope=args.scope, init=args.cache_init, seed=args.seed,
                              labels=args.label)
    except errors.HANDLED as err:
        return errors.report(err)
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
