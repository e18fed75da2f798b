"""What an expert cache measured, as plain numbers: miss rate, loads and bytes moved, evictions and how long
entries lived (``summarize`` of a ``cache.CacheState``)."""

from __future__ import annotations

import math

import jax
import numpy as np

from moejax.experts.cache import CacheState


def summarize(state: CacheState, expert_bytes: int | None = None, include_resident: bool = True,
              low_bit_bytes: dict | None = None) -> dict:
    """Python-float metrics. miss_rate = misses / accesses with accesses = K · tokens · layers.

    Lifetime (tokens from load to eviction): over every completed residency; with ``include_resident`` the
    entries still cached are added as residencies censored at the last routed token (so a cache that never
    evicts still reports how long its entries have lived rather than nothing).
    """
    s = jax.tree.map(np.asarray, state.stats)
    acc = s.accesses.astype(np.float64)
    life_n = s.evictions.astype(np.float64)
    life_sum = s.life_sum.astype(np.float64)
    life_sq = s.life_sq.astype(np.float64)
    if include_resident:
        res = np.asarray(state.resident)
        last = int(np.asarray(state.token).max())
        age = np.where(res, last - np.asarray(state.load_pass) + 1, 0).astype(np.float64)
        if last >= 0:
            life_n = life_n + res.sum(axis=1)
            life_sum = life_sum + age.sum(axis=1)
            life_sq = life_sq + (age * age).sum(axis=1)
    n = life_n.sum()
    mean = life_sum.sum() / n if n else float("nan")
    var = life_sq.sum() / n - mean * mean if n else float("nan")
    tokens = int(np.asarray(state.token).max()) + 1
    loads = int(s.loads.sum())
    prefetch_loads = int(s.prefetch_loads.sum())
    low = {8: int(s.low8_loads.sum()), 4: int(s.low4_loads.sum())}
    rate = lambda m, a: float(m / a) if a else 0.0  # noqa: E731
    ratio = lambda m, a: float(m / a) if a else None  # noqa: E731
    out = {
        "tokens": tokens,
        "accesses": int(acc.sum()),
        "misses": int(s.misses.sum()),
        "miss_rate": rate(s.misses.sum(), acc.sum()),
        "compulsory_misses": int(s.compulsory.sum()),
        "collision_misses": int(s.collisions.sum()),
        "loads": loads,
        "prefetch_loads": prefetch_loads,
        "evictions": int(s.evictions.sum()),
        "lifetime_mean": float(mean),
        "lifetime_std": float(math.sqrt(max(var, 0.0))) if n else float("nan"),
        "dropped": int(s.dropped.sum()),
        "substituted": int(s.substituted.sum()),
        "int8_loads": low[8],
        "int4_loads": low[4],
        "prefetch_predicted": int(s.predicted.sum()),
        "prefetch_precision": ratio(s.predicted_used.sum(), s.predicted.sum()),
        "prefetch_recall": ratio(s.predicted_used.sum(), s.predicted_for.sum()),
        "per_layer": {
            "accesses": [int(x) for x in s.accesses],
            "misses": [int(x) for x in s.misses],
            "miss_rate": [rate(m, a) for m, a in zip(s.misses, acc)],
            "compulsory_misses": [int(x) for x in s.compulsory],
            "collision_misses": [int(x) for x in s.collisions],
            "loads": [int(x) for x in s.loads],
            "lifetime_mean": [float(ls / ln) if ln else float("nan") for ls, ln in zip(life_sum, life_n)],
            "hit_rate": [1.0 - rate(m, a) for m, a in zip(s.misses, acc)],
            "prefetch_precision": [ratio(u, p) for u, p in zip(s.predicted_used, s.predicted)],
            "prefetch_recall": [ratio(u, f) for u, f in zip(s.predicted_used, s.predicted_for)],
        },
    }
    if expert_bytes is not None:
        moved = (loads + prefetch_loads) * int(expert_bytes)
        for bits, n_low in low.items():
            if n_low:
                if not low_bit_bytes or bits not in low_bit_bytes:
                    raise ValueError(f"{n_low} int{bits} loads need the int{bits} expert size (low_bit_bytes)")
                moved += n_low * int(low_bit_bytes[bits])
        out["prefetch_bytes"] = prefetch_loads * int(expert_bytes)
        out["bytes_moved"] = moved
        out["bytes_per_token"] = moved / tokens if tokens > 0 else 0.0
    return out
