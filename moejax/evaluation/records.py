"""What a study record says: its routing kind, parameter, cache and metrics, labels for people, and the pure
analysis the figures and the report share (Pareto fronts, the best point within a perplexity bound, the
cache-size series, markdown tables). Records are the JSON objects of ``results`` files (schema in ``sweep``)."""

from __future__ import annotations

import contextvars
import math
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from moejax.base.typecheck import is_number


KIND_ORDER = ("original", "pruning", "max-rank", "cumsum", "cache-prior", "learned-prior", "drop", "random-replace")


# the swept parameter of each routing kind (for labels and sorting)
KIND_PARAM = {"pruning": "prune_h", "max-rank": "max_rank", "cumsum": "cumsum_p", "cache-prior": "lam",
              "learned-prior": "lam", "drop": "drop_rank", "random-replace": "random_rank"}


PARAM_SYMBOL = {"lam": "λ", "prune_h": "h", "max_rank": "M", "cumsum_p": "p", "random_rank": "k", "drop_rank": "k",
                "top_j": "J", "delta": "Δ"}


EVICTION_ORDER = ("lru", "lfu", "fld", "score", "least-stale", "belady", "belady-bypass")


PPL_TOLERANCES = (0.01, 0.05, 0.10)  # cache-size ablation and headlines: +1 / +5 / +10 % perplexity


_STD_CACHE_KEYS = ("size", "capacity", "scope", "eviction", "init", "seed")


def num(x) -> float | None:
    """A finite float, or None (null, NaN, inf, strings, bools)."""
    if not is_number(x):
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


def sensitivity_split(records: Sequence[dict]) -> tuple[list[dict], list[dict]]:
    """(drop-ranks->=k points, replace-rank-k points), each with a rank and a perplexity."""
    ok = [r for r in records if _rank_k(r) is not None and num(r.get("ppl")) is not None]
    drop = [r for r in ok if kind_of(r) in ("pruning", "drop")]
    repl = [r for r in ok if kind_of(r) not in ("pruning", "drop", "original")]
    return drop, repl


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


class PlotError(ValueError):
    """The records hold nothing this plot can draw (the message says what is missing)."""


def _need(records: Sequence[dict], what: str, pred: Callable[[dict], bool]) -> list[dict]:
    found = [r for r in records if pred(r)]
    if not found:
        raise PlotError(f"no records with {what} ({len(records)} records given)")
    return found


def _eviction_name(ev: str) -> str:
    return ev.upper() if ev in ("lru", "lfu", "fld") else ev
