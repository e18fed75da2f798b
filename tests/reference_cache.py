"""Plain-Python reference expert cache (LRU, LFU), written independently of moejax.cache for property tests
and as the replay benchmark's baseline.

Same semantics as moejax.cache (DESIGN §2): steps in token-sequential order (token t, layers 0..L-1); in a
step the experts arrive highest weight first; all are inserted, then entries are evicted while over
capacity; this step's experts go last, the higher-weighted of them first (it counts as older); LFU counts
accesses over the whole history and breaks ties by least recent use.
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
                else:
                    raise ValueError(f"reference has no eviction {eviction!r}")
                del pool[victim]
                evictions[victim[0]] += 1
                evicted_in_pass[victim] = t
    return {"misses": misses, "compulsory": compulsory, "collisions": collisions, "evictions": evictions}
