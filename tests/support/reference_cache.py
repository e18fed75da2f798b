"""Plain-Python reference expert cache (LRU, LFU), written independently of moejax.experts.cache for property tests
and as the replay benchmark's baseline.

Same semantics as moejax.experts.cache (docs/design.md §2): steps in token-sequential order (token t, layers
0..L-1); in a step the experts arrive highest weight first; all are inserted, then entries are evicted while over
capacity; this step's experts go last, the higher-weighted of them first (it counts as older); LFU counts
accesses over the whole history and breaks ties by least recent use. Belady evicts the entry whose next
use is farthest (ties: least recent), this step's experts last like every policy; ``belady-bypass`` lets
this step's experts go first too (the classic bound with a transient buffer).
"""

from __future__ import annotations

from collections import OrderedDict


def simulate(experts, capacity: int, scope: str = "layer", eviction: str = "lru") -> dict:
    """experts: nested lists / array [T][L][K] (-1 = empty slot). Returns per-layer counters."""
    n_tokens = len(experts)
    n_layers = len(experts[0])
    misses = [0] * n_layers
    compulsory = [0] * n_layers
    collisions = [0] * n_layers
    evictions = [0] * n_layers
    pools = {}  # pool id -> OrderedDict of (layer, expert) in recency order, oldest first
    freq = {}
    seen = set()
    evicted_in_pass = {}  # (layer, expert) -> token whose forward pass evicted it

    def next_use(entry, t, layer):
        """Position of the next step after (t, layer) that uses entry: per pool's own step order."""
        lay, e = entry
        start = t + 1 if (scope == "layer" or lay <= layer) else t
        for u in range(start, n_tokens):
            if e in [int(x) for x in experts[u][lay]]:
                return u if scope == "layer" else u * n_layers + lay
        return float("inf")

    def pool_of(layer):
        key = layer if scope == "layer" else 0
        return pools.setdefault(key, OrderedDict())

    for t in range(n_tokens):
        for layer in range(n_layers):
            pool = pool_of(layer)
            step = [(layer, int(e)) for e in experts[t][layer] if int(e) >= 0]
            for entry in step:
                freq[entry] = freq.get(entry, 0) + 1
                if entry in pool:
                    pool.move_to_end(entry)
                    continue
                misses[layer] += 1
                if entry not in seen:
                    compulsory[layer] += 1
                    seen.add(entry)
                if evicted_in_pass.get(entry) == t:
                    collisions[layer] += 1
                pool[entry] = True
            while len(pool) > capacity:
                if eviction == "lru":
                    victim = next(iter(pool))
                elif eviction == "lfu":
                    order = {e: i for i, e in enumerate(pool)}
                    victim = min(pool, key=lambda e: (e in step, 0 if e in step else freq[e], order[e]))
                elif eviction in ("belady", "belady-bypass"):
                    order = {e: i for i, e in enumerate(pool)}
                    protect = (lambda e: e in step) if eviction == "belady" else (lambda e: False)
                    victim = min(pool, key=lambda e: (protect(e), -next_use(e, t, layer), order[e]))
                else:
                    raise ValueError(f"reference has no eviction {eviction!r}")
                del pool[victim]
                evictions[victim[0]] += 1
                evicted_in_pass[victim] = t
    return {"misses": misses, "compulsory": compulsory, "collisions": collisions, "evictions": evictions}
