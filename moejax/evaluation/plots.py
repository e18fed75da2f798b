"""Figures for the evaluation studies (the trace heat map is ``heatmap``; what records say is ``records``).

Every study plot takes a list of result records (one JSON object per sweep point, the schema written by
the sweeps and read by ``moejax.report``) and an output path: ``fig.png``, ``fig.svg`` or ``fig.pdf`` writes
that one file, a *stem* without such a suffix writes ``stem.png`` and ``stem.svg`` (``figure_paths``; each
atomically: a temporary file in the same folder, then ``os.replace``); it returns the paths written.
A plot whose records hold nothing it can draw raises ``PlotError``.

    pareto          perplexity vs miss rate per routing kind, Pareto fronts, Belady bound (paper figs 4, 14)
    cache_size      miss rate vs cache size: LRU, Belady, cache-prior at +1/5/10 % perplexity (fig 10)
    sensitivity     perplexity vs k: drop ranks >= k, replace rank k by a random expert (fig 2)
    eviction        miss rate and collision-miss share per eviction policy and pool size (SpecMD fig 4)
    tasks           accuracy vs miss rate per task (figs 5, 6)
    init            empty vs random initial cache (appendix G)
    delta           running vs calibrated logit range Δ (appendix D, fig 15)

matplotlib is imported only inside the functions that draw (Agg canvas, no pyplot state), so
``import moejax`` never pulls it in.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import struct
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from moejax.base import atomic
from moejax.evaluation.records import (_eviction_name, _need, _rank_k, _scope_name, _size_key, _sort_value, cache_of,
    cache_size_series, capacity_of, collision_rate, delta_label, eviction_label, eviction_of, eviction_rank,
    first_token_miss_rates, group_by, init_group_label, init_label, is_belady, is_selection, kind_of, kind_rank,
    n_experts_of, num, original_records, pareto_indices, PlotError, policy_param, reference_ppl, sensitivity_split,
    top_k_of)

KIND_COLORS = {
    "original": "black", "pruning": "tab:gray", "max-rank": "tab:blue", "cumsum": "tab:green",
    "cache-prior": "tab:purple", "learned-prior": "tab:orange", "drop": "tab:brown", "random-replace": "tab:red",
}
PPL_VIEWS = (0.01, 0.02, 0.05, 0.10, 0.30)  # Pareto-plot zoom levels: perplexity up to +x % over original
PPL_VIEW_SHARE = 0.85  # the zoom keeps at least this share of a panel's points in view


# ------------------------------------------------------------------------------------ record access


"""N to fall back on when records cannot tell it (the report sets it from all the files it reads)."""


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


#: the image formats a figure path may name by its suffix, and the metadata left out of each (reproducible bytes)
FIGURE_FORMATS = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None},
                  "pdf": {"CreationDate": None, "Creator": None, "Producer": None}}
STEM_FORMATS = ("png", "svg")  # what a path without an image suffix (a stem) gets


def figure_paths(out, flag: str = "--out") -> list[Path]:
    """The files a figure path names: ``fig.png`` / ``fig.svg`` / ``fig.pdf`` exactly that one file (a user who
    names one file gets no sibling), a stem ``fig`` both ``fig.png`` and ``fig.svg``. An empty name or a
    folder (``''``, ``figs/``) is refused, naming ``flag``."""
    text = os.fspath(out)
    if not text.strip() or text.endswith(os.sep) or Path(text).name in ("", ".", ".."):
        raise ValueError(f"{flag} {text!r} must name a figure file ({', '.join('FIG.' + f for f in FIGURE_FORMATS)}) "
                         "or a stem (STEM.png and STEM.svg are written)")
    path = Path(text)
    if path.suffix.lower()[1:] in FIGURE_FORMATS:
        return [path]
    return [path.with_name(f"{path.name}.{ext}") for ext in STEM_FORMATS]


def save_figure(fig, out) -> list[Path]:
    """Write the files ``figure_paths(out)`` names, atomically and as a set (reproducible: no dates, fixed SVG
    ids): all are written before any replaces its target, so a full disk leaves none, not a new PNG beside an
    old SVG or none. Inside ``marking`` the files carry its mark."""
    matplotlib, _, _ = _mpl()
    paths = figure_paths(out)
    with matplotlib.rc_context({"svg.hashsalt": "moejax", "svg.fonttype": "path"}), contextlib.ExitStack() as pair:
        for target in paths:
            fmt = target.suffix.lower()[1:]
            fig.savefig(pair.enter_context(atomic.atomic_file(target, make_parents=True)), format=fmt, dpi=150,
                        metadata=_metadata(fmt))
    return paths


#: where a figure's mark goes in its metadata (``marking``): PNG text chunk, SVG ``dc:creator``
MARK_KEYS = {"png": "Software", "svg": "Creator"}
_MARK: contextvars.ContextVar[str | None] = contextvars.ContextVar("moejax_figure_mark", default=None)
_MARK_HEAD = 1 << 16  # a mark sits in the file's first bytes: PNG text before the image data, SVG metadata on top
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SVG_CREATOR = re.compile(rb"<dc:creator>\s*<cc:Agent>\s*<dc:title>([^<]*)</dc:title>")


@contextlib.contextmanager
def marking(mark: str) -> Iterator[None]:
    """Every PNG and SVG ``save_figure`` writes in this block (this thread) carries ``mark`` in its metadata,
    so that a command that writes figures under fixed names can tell its own earlier figures (``figure_mark``)
    from a user's file of the same name."""
    token = _MARK.set(mark)
    try:
        yield
    finally:
        _MARK.reset(token)


def _metadata(fmt: str) -> dict:
    """The metadata ``savefig`` gets for ``fmt`` (FIGURE_FORMATS), plus the mark inside ``marking``."""
    mark = _MARK.get()
    return dict(FIGURE_FORMATS[fmt], **({MARK_KEYS[fmt]: mark} if mark and fmt in MARK_KEYS else {}))


def figure_mark(path) -> str | None:
    """The mark ``marking`` left in the PNG or SVG file at ``path``; None for any other file, or one that
    cannot be read (a pipe is not opened: reading it would wait for a writer)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(_MARK_HEAD)
    except OSError:
        return None
    if head.startswith(_PNG_SIGNATURE):
        return _png_texts(head).get(MARK_KEYS["png"])
    found = _SVG_CREATOR.search(head)
    return found.group(1).decode("utf-8", "replace") if found else None


def _png_texts(head: bytes) -> dict[str, str]:
    """The ``tEXt`` chunks of a PNG's first bytes ``head``, up to its image data: {keyword: text}."""
    texts, pos = {}, len(_PNG_SIGNATURE)
    while pos + 8 <= len(head):
        length, kind = struct.unpack(">I4s", head[pos:pos + 8])
        if kind in (b"IDAT", b"IEND"):
            break
        if kind == b"tEXt":
            key, sep, value = head[pos + 8:pos + 8 + length].partition(b"\0")
            if sep:
                texts[key.decode("latin-1")] = value.decode("latin-1")
        pos += 12 + length
    return texts


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


# ----------------------------------------------------------------------------------- trace heat map


# ---------------------------------------------------------------------------------------------- CLI
