"""The expert cache as a pytree: residency, eviction bookkeeping and metrics (docs/design.md §2).

Layout. Every per-entry array is dense over (MoE layer, expert), shape [L, N]; counters are per layer,
shape [L]. Which entries compete for room is the *scope* (static): ``"layer"`` gives each layer its own
``capacity`` slots, ``"global"`` makes one pool of ``capacity`` entries over all L·N (layer, expert) pairs.
The dense layout keeps every update a fixed-shape scatter, so the state can be a ``lax.scan`` carry, a
``vmap`` operand, or sliced per layer for the layer-parallel path.

Time. ``token[l]`` is the index of the forward pass (token) that layer l last routed, -1 before any.
A routing step at layer l starts pass ``token[l] + 1``; in the token-sequential order the pass index of a
layer therefore equals the token index, in both scopes. ``clock`` ticks once per touched expert and orders
recency (LRU); in global scope all L entries of ``clock`` hold the same value (one shared clock).

Same-step ordering (docs/design.md §2, paper §4.2). The K experts of one step arrive highest weight first and get
increasing ticks, so the higher-weighted one is *older*; every policy evicts experts selected in the
current step only after all others (Belady included: it is the bound of caches that must hold a token's
K experts at once, as the offload engine must), in that LRU order — with capacity < K the lowest-weighted
selected experts stay. Evictions happen after all K are inserted, never in between.

Eviction policies (static ``eviction``), smallest key evicted first, ties by LRU tick:
  lru          last-touch tick.
  lfu          accesses over the whole history (kept across evictions, as SpecMD's appendix B), then LRU.
  score        accumulated mixing weight over the whole history, then LRU.
  fld          global: the layer farthest ahead in forward order, d = ((l' - l - 1) mod L) + 1 ∈ [1, L]
               (the current layer's other entries are next needed a full pass later, d = L); per-layer
               scope: every candidate is in the same layer, so FLD reduces to LRU.
  least-stale  stale (not touched or prefetched in this forward pass) before current; inside each queue
               FIFO by layer position (lower layer first, which is "left of the execution point" first),
               then by last touch. Per-layer scope: current = prefetched for this pass, otherwise LRU.
  belady       offline oracle: the entry whose next use is farthest (``next_use`` supplied by the caller
               from a recorded trace), this step's experts last (among them, farthest next use first).
               The optimal eviction under the same co-residency rule as every online policy: the bound.
  belady-bypass  the looser classic variant: may evict this step's experts right after inserting them, as
               if a token's misses could stream through a transient buffer beside the C slots. Models
               no engine here; reported under its own name, never as "the Belady bound".

Metrics (``CacheStats``, per layer, attributed to the routing layer, evictions/lifetimes to the evicted
entry's layer): accesses (+K per step even when pruning drops slots), misses, compulsory misses (first
load ever of that (layer, expert)), collision misses (a miss on an entry evicted earlier in the same
forward pass — only possible in global scope), loads, prefetch loads, evictions and lifetimes
(passes from load to eviction). ``summarize`` adds still-resident entries as lifetimes censored at the
last token when asked to.
"""

from __future__ import annotations

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from moejax.base import seeds
from moejax.base.typecheck import is_integer

SCOPES = ("layer", "global")
EVICTIONS = ("lru", "lfu", "fld", "score", "least-stale", "belady", "belady-bypass")
OFFLINE_EVICTIONS = ("belady", "belady-bypass")  # need next_use from a recorded trace
ONLINE_EVICTIONS = tuple(e for e in EVICTIONS if e not in OFFLINE_EVICTIONS)
INITS = ("empty", "random")
NEVER = 2**31 - 1  # next_use of an entry that is never used again; "infinitely far" key
MISS_MODES = ("fetch", "drop", "substitute", "cascade")


@dataclasses.dataclass(frozen=True)
class MissConfig:
    """What a miss costs (docs/design.md §2 miss handling). Static: it picks code paths at trace time.

    ``rank``: 0-based positions in the chosen list (highest weight first) from which a miss counts as
    low-importance; positions before ``rank[0]`` are always fetched in full.
      fetch       block and load every miss (lossless).
      drop        a low-importance miss is skipped; the remaining weights are rescaled to the full set's sum.
      substitute  a low-importance miss is replaced by the best-ranked cached expert not already chosen,
                  which takes the missing expert's weight (fetched in full if no such expert exists).
      cascade     a low-importance miss is served from a low-bit copy (``bits[i]`` from position
                  ``rank[i]`` on): loaded transiently (a miss, bytes at the low-bit size), never cached.
    """

    mode: str = "fetch"
    rank: tuple = (1,)
    bits: tuple = (8,)
    group_size: int | None = None

    def __post_init__(self):
        if self.mode not in MISS_MODES:
            raise ValueError(f"unknown miss handling {self.mode!r}; expected one of {MISS_MODES}")
        for name, value in (("miss_rank", self.rank), ("cascade_bits", self.bits)):  # int() truncated 1.5 to 1
            if not isinstance(value, (tuple, list)) or not all(is_integer(v) for v in value):
                raise TypeError(f"CacheConfig {name} must be a tuple of integers, got {value!r}")
        if self.group_size is not None and (not is_integer(self.group_size) or self.group_size < 1):
            raise ValueError(f"CacheConfig quant_group (--quant-group) must be a positive integer or None, got "
                             f"{self.group_size!r}")
        rank = tuple(int(r) for r in self.rank)
        if not rank or any(r < 0 for r in rank) or list(rank) != sorted(set(rank)):
            raise ValueError(f"miss rank must be increasing non-negative positions, got {self.rank}")
        bits = tuple(int(b) for b in self.bits)
        if self.mode == "cascade":
            if len(bits) != len(rank):
                raise ValueError(f"cascade needs one bit width per rank threshold, got ranks {rank} bits {bits}")
            if any(b not in (8, 4) for b in bits):
                raise ValueError(f"cascade bit widths must be 8 or 4, got {bits}")
        elif len(rank) != 1:
            raise ValueError(f"miss handling {self.mode!r} takes one rank threshold, got {rank}")
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "bits", bits)

    def tier_bits(self, k: int) -> tuple[int, ...]:
        """Bit width of a low-importance miss at each of the K positions (0 = full precision)."""
        if self.mode != "cascade":
            return (0,) * k
        out = []
        for pos in range(k):
            b = 0
            for r, bits in zip(self.rank, self.bits):
                if pos >= r:
                    b = bits
            out.append(b)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class PrefetchConfig:
    """Speculative next-layer prefetch (docs/design.md §2): layer l+1's router applied to layer l's hidden state.

    ``overfetch`` > 0: prefetch the top round(K · overfetch) predicted experts; or ``percentile`` q in
    (0, 100): every expert whose predicted probability is above the q-th percentile of the N. Off when both
    are unset."""

    overfetch: float = 0.0
    percentile: float | None = None

    def __post_init__(self):
        if not (math.isfinite(self.overfetch) and self.overfetch >= 0):
            raise ValueError(f"prefetch overfetch factor must be >= 0, got {self.overfetch}")
        if self.percentile is not None and not 0 < self.percentile < 100:
            raise ValueError(f"prefetch percentile must be in (0, 100), got {self.percentile}")
        if self.overfetch > 0 and self.percentile is not None:
            raise ValueError("give either a prefetch overfetch factor or a percentile, not both")

    @property
    def enabled(self) -> bool:
        return self.overfetch > 0 or self.percentile is not None

    def count(self, k: int, n: int) -> int:
        """Static number of candidate ids per prediction."""
        if self.percentile is not None:
            return n
        return max(1, min(n, int(math.floor(k * self.overfetch + 0.5)))) if self.overfetch > 0 else 0


@flax.struct.dataclass
class CacheStats:
    """Per-layer counters, all shape [L]."""

    accesses: jax.Array
    misses: jax.Array
    compulsory: jax.Array
    collisions: jax.Array
    loads: jax.Array
    prefetch_loads: jax.Array
    evictions: jax.Array
    life_sum: jax.Array  # float32: sum of (eviction pass - load pass) over evictions
    life_sq: jax.Array  # float32: sum of squares of the same
    dropped: jax.Array  # low-importance misses skipped (miss handling "drop")
    substituted: jax.Array  # low-importance misses replaced by a cached expert ("substitute")
    low8_loads: jax.Array  # misses served from the int8 copy ("cascade")
    low4_loads: jax.Array  # misses served from the int4 copy ("cascade")
    predicted: jax.Array  # experts the prefetcher predicted for this layer
    predicted_used: jax.Array  # ... of which the layer then chose (precision = used / predicted)
    predicted_for: jax.Array  # chosen experts at steps that had a prediction (recall = used / this)


def _zero_stats(n_layers: int) -> CacheStats:
    i = lambda: jnp.zeros((n_layers,), jnp.int32)  # noqa: E731
    f = lambda: jnp.zeros((n_layers,), jnp.float32)  # noqa: E731
    return CacheStats(i(), i(), i(), i(), i(), i(), i(), f(), f(), i(), i(), i(), i(), i(), i(), i())


@flax.struct.dataclass
class CacheState:
    """Expert-cache state; arrays [L, N] unless noted. ``slot`` is the device slot an entry occupies
    (per layer 0..C-1, or 0..C-1 over the global pool), -1 when not resident."""

    resident: jax.Array  # bool
    slot: jax.Array  # int32
    last_touch: jax.Array  # int32 clock tick of the last access or prefetch
    freq: jax.Array  # int32 accesses over the whole history (LFU)
    score: jax.Array  # float32 accumulated mixing weight (score-based)
    load_pass: jax.Array  # int32 pass at which the current residency began
    touch_pass: jax.Array  # int32 pass of the last access / the pass a prefetch was made for
    evict_pass: jax.Array  # int32 pass of the last eviction, -1 if never (collision misses)
    next_use: jax.Array  # int32 next use index (Belady variants only), NEVER otherwise
    seen: jax.Array  # bool: ever loaded (compulsory misses)
    token: jax.Array  # [L] int32 pass index each layer last routed, -1 before any
    clock: jax.Array  # [L] int32 recency clock (equal across layers in global scope)
    capacity: jax.Array  # [] int32: per layer (scope "layer") or in total (scope "global")
    stats: CacheStats
    scope: str = flax.struct.field(pytree_node=False, default="layer")
    eviction: str = flax.struct.field(pytree_node=False, default="lru")
    miss: MissConfig = flax.struct.field(pytree_node=False, default=MissConfig())
    prefetcher: PrefetchConfig = flax.struct.field(pytree_node=False, default=PrefetchConfig())

    @property
    def n_layers(self) -> int:
        return self.resident.shape[0]

    @property
    def n_experts(self) -> int:
        return self.resident.shape[1]


# ------------------------------------------------------------------------------------------ capacity


# ------------------------------------------------------------------------------------------ initial state


def init_cache(n_layers: int, n_experts: int, capacity: int, scope: str = "layer", eviction: str = "lru",
               init: str = "empty", seed: int = 0, miss: MissConfig = MissConfig(),
               prefetcher: PrefetchConfig = PrefetchConfig()) -> CacheState:
    """A fresh cache: ``empty``, or ``random`` (seeded; per layer ``capacity`` distinct experts, or in
    global scope ``capacity`` distinct (layer, expert) entries). Random entries count as seen and are
    older than anything touched later, in a random recency order."""
    if scope not in SCOPES:
        raise ValueError(f"unknown cache scope {scope!r}; expected one of {SCOPES}")
    if eviction not in EVICTIONS:
        raise ValueError(f"unknown eviction {eviction!r}; expected one of {EVICTIONS}")
    if init not in INITS:
        raise ValueError(f"unknown cache init {init!r}; expected one of {INITS}")
    limit = n_experts if scope == "layer" else n_layers * n_experts
    if not 1 <= int(capacity) <= limit:
        raise ValueError(f"capacity {capacity} must be in [1, {limit}] for scope {scope!r}")
    shape = (n_layers, n_experts)
    minus1 = jnp.full(shape, -1, jnp.int32)
    state = CacheState(
        resident=jnp.zeros(shape, bool), slot=minus1, last_touch=minus1, freq=jnp.zeros(shape, jnp.int32),
        score=jnp.zeros(shape, jnp.float32), load_pass=minus1, touch_pass=minus1, evict_pass=minus1,
        next_use=jnp.full(shape, NEVER, jnp.int32), seen=jnp.zeros(shape, bool),
        token=jnp.full((n_layers,), -1, jnp.int32), clock=jnp.zeros((n_layers,), jnp.int32),
        capacity=jnp.asarray(capacity, jnp.int32), stats=_zero_stats(n_layers), scope=scope, eviction=eviction,
        miss=miss, prefetcher=prefetcher,
    )
    if init == "random":
        state = _fill_random(state, int(capacity), seed)
    return state


def _fill_random(state: CacheState, capacity: int, seed: int) -> CacheState:
    n_layers, n_experts = state.resident.shape
    key = seeds.prng_key(seed)
    if state.scope == "layer":
        keys = jax.random.split(key, n_layers)
        perms = jax.vmap(lambda k: jax.random.permutation(k, n_experts))(keys)  # [L, N]
        order = jnp.zeros((n_layers, n_experts), jnp.int32).at[jnp.arange(n_layers)[:, None], perms].set(
            jnp.arange(n_experts, dtype=jnp.int32))  # position of each expert in its layer's permutation
    else:
        perm = jax.random.permutation(key, n_layers * n_experts)
        order = jnp.zeros((n_layers * n_experts,), jnp.int32).at[perm].set(
            jnp.arange(n_layers * n_experts, dtype=jnp.int32)).reshape(n_layers, n_experts)
    resident = order < capacity
    return state.replace(
        resident=resident, seen=resident,
        slot=jnp.where(resident, order, -1),
        last_touch=jnp.where(resident, order - capacity, -1),  # distinct negative ticks: older than any touch
        load_pass=jnp.where(resident, 0, -1),
    )


def reset_stats(state: CacheState) -> CacheState:
    """Carry the cache contents over (e.g. to the next sequence) but start counting afresh."""
    return state.replace(stats=_zero_stats(state.n_layers))


def resident_mask(state: CacheState, layer) -> jax.Array:
    """Bitmask m [N] of the experts of ``layer`` that are in the cache."""
    return state.resident[layer]


def occupancy(state: CacheState) -> jax.Array:
    """Resident entries per layer [L] (per-layer scope) or in total [] (global scope)."""
    return state.resident.sum(axis=1) if state.scope == "layer" else state.resident.sum()


# ------------------------------------------------------------------------------------- per-layer views


def _map_rows(f, state: CacheState) -> CacheState:
    """Apply ``f`` to every leaf with a leading layer axis (all but ``capacity``)."""
    return jax.tree.map(f, state.replace(capacity=None)).replace(capacity=state.capacity)


def row_view(state: CacheState, layer) -> CacheState:
    """The one-layer cache of ``layer`` (leaves [1, ...]); only meaningful in per-layer scope."""
    return _map_rows(lambda a: lax.dynamic_slice_in_dim(a, layer, 1, axis=0), state)


def write_row(state: CacheState, row: CacheState, layer) -> CacheState:
    leaves, treedef = jax.tree.flatten(state.replace(capacity=None))
    new = [lax.dynamic_update_slice_in_dim(a, b.astype(a.dtype), layer, axis=0)
           for a, b in zip(leaves, jax.tree.leaves(row.replace(capacity=None)))]
    return jax.tree.unflatten(treedef, new).replace(capacity=state.capacity)


def split_layers(state: CacheState) -> CacheState:
    """[L, ...] -> L stacked one-layer caches [L, 1, ...], for ``jax.vmap`` over independent layers."""
    if state.scope != "layer":
        raise ValueError("only per-layer caches split into independent layers")
    out = _map_rows(lambda a: a[:, None], state)
    return out.replace(capacity=jnp.broadcast_to(state.capacity, (state.n_layers,)))


def merge_layers(stacked: CacheState) -> CacheState:
    """Inverse of ``split_layers``."""
    out = _map_rows(lambda a: a[:, 0], stacked)
    return out.replace(capacity=stacked.capacity[0])


# ------------------------------------------------------------------------------------------ eviction


def _eviction_keys(st: CacheState, row, now: jax.Array, pass_now) -> tuple[jax.Array, ...]:
    """Lexicographic keys [P, N] per policy over resident entries; the smallest tuple is evicted first.
    Every tuple ends with the recency tick, so ties go to the least recently used."""
    if st.eviction == "lru":  # this step's experts already hold the newest ticks
        return (st.last_touch,)
    if st.eviction == "belady-bypass":
        return (-st.next_use, st.last_touch)
    protect = now.astype(jnp.int32)  # this step's experts go after every other entry
    if st.eviction == "belady":
        return (protect, -st.next_use, st.last_touch)
    n_rows = st.resident.shape[0]
    layer_pos = jnp.broadcast_to(jnp.arange(n_rows, dtype=jnp.int32)[:, None], st.resident.shape)
    if st.eviction == "lfu":
        primary = (jnp.where(now, 0, st.freq),)
    elif st.eviction == "score":
        primary = (jnp.where(now, 0.0, st.score),)
    elif st.eviction == "fld":
        ahead = (layer_pos - row - 1) % n_rows + 1
        primary = (jnp.where(now, 0, -ahead),)
    elif st.eviction == "least-stale":
        current = (st.touch_pass >= pass_now).astype(jnp.int32)
        primary = (jnp.where(now, 0, current), jnp.where(now, 0, layer_pos))
    else:
        raise ValueError(f"unknown eviction {st.eviction!r}")
    return (protect, *primary, st.last_touch)


def _victims(keys: tuple[jax.Array, ...], candidates: jax.Array, n_evict, max_evict: int) -> jax.Array:
    """Boolean mask of the ``n_evict`` (<= max_evict, static) candidates with the smallest key tuples.

    Repeated lexicographic minimum, unrolled max_evict times: each round narrows the remaining candidates
    key by key; the last key is the recency tick, distinct for every resident entry (one clock per pool),
    so exactly one entry survives a round. On XLA:CPU this is ~8x cheaper than a sort (and far cheaper
    than top_k / multi-operand sort), which dominates replay time.
    """
    taken = jnp.zeros(candidates.shape, bool)
    for i in range(max_evict):
        sel = candidates & ~taken
        for key in keys:
            top = jnp.inf if jnp.issubdtype(key.dtype, jnp.floating) else jnp.iinfo(key.dtype).max
            masked = jnp.where(sel, key, top)
            sel = sel & (masked == masked.min())
        taken = taken | (sel & (i < n_evict))
    return taken


def put_columns(a: jax.Array, row, cols: jax.Array, values, add: bool = False) -> jax.Array:
    """``a[row, cols] = values`` (``+=`` with ``add``) where a column equal to ``a.shape[1]`` means *none*.

    The none-column is written into a scratch column that is cut off again rather than left out of range
    for the scatter to drop: XLA:GPU's deterministic scatter (``--xla_gpu_deterministic_ops``, which
    reproducible GPU runs set) flattens a vmapped scatter's indices, and an out-of-range column of one batch
    element then lands in the next one's column 0 (openxla/xla#34870 fixed a sibling of it). On the H200 the
    per-layer replay (a vmap over layers) counted one miss too many in its last layer that way.
    """
    n_cols = a.shape[1]
    line = jnp.concatenate([lax.dynamic_index_in_dim(a, row, keepdims=False), jnp.zeros((1,), a.dtype)])
    at = line.at[cols]
    line = at.add(values, mode="promise_in_bounds") if add else at.set(values, mode="promise_in_bounds")
    return lax.dynamic_update_index_in_dim(a, line[:n_cols], row, axis=0)


def _assign_slots(slot: jax.Array, row, cols: jax.Array, place: jax.Array, capacity) -> jax.Array:
    """Give each entry (row, cols[j]) with place[j] (their slot is -1) the lowest free slot in
    [0, capacity), in j order. Unrolled over the few j (a repeated masked minimum), because nonzero/cumsum
    over the whole pool cost more than the rest of a replay step on XLA:CPU."""
    n_rows, n_experts = slot.shape
    n_slots = slot.size
    iota = jnp.arange(n_slots, dtype=jnp.int32)
    flat = slot.reshape(-1)
    used = jnp.zeros((n_slots + 1,), bool).at[jnp.where(flat >= 0, flat, n_slots)].set(True)[:n_slots]
    free = ~used & (iota < capacity)
    new = []
    for j in range(cols.shape[0]):
        lowest = jnp.min(jnp.where(free, iota, n_slots))
        new.append(jnp.where(place[j], lowest, -1))
        free = free & ~((iota == lowest) & place[j])
    return put_columns(slot, row, jnp.where(place, cols, n_experts), jnp.stack(new))


def _evict_and_place(st: CacheState, row, now: jax.Array, cols: jax.Array, loaded: jax.Array, pass_now):
    """Evict down to capacity, free the victims' slots, give newly loaded survivors a free slot.

    ``now`` [P, N]: entries inserted/touched by this update (evicted last); ``cols`` [E]: their columns in
    ``row`` (out of range = none); ``loaded`` [E]: which of them were not resident before.
    Returns (state, evicted mask [P, N]).
    """
    max_evict = cols.shape[0]
    n_evict = jnp.clip(st.resident.sum() - st.capacity, 0, max_evict)
    evicted = _victims(_eviction_keys(st, row, now, pass_now), st.resident, n_evict, max_evict)
    resident = st.resident & ~evicted
    n_experts = resident.shape[1]
    stays = loaded & resident[row, jnp.minimum(cols, n_experts - 1)]
    slot = _assign_slots(jnp.where(evicted, -1, st.slot), row, cols, stays, st.capacity)
    life = jnp.where(evicted, pass_now - st.load_pass, 0).astype(jnp.float32)
    stats = st.stats.replace(
        evictions=st.stats.evictions + evicted.sum(axis=1).astype(jnp.int32),
        life_sum=st.stats.life_sum + life.sum(axis=1),
        life_sq=st.stats.life_sq + (life * life).sum(axis=1),
    )
    st = st.replace(resident=resident, slot=slot, evict_pass=jnp.where(evicted, pass_now, st.evict_pass),
                    stats=stats)
    return st, evicted


# ------------------------------------------------------------------------------------------ updates


def _pool_access(st: CacheState, row, experts, weights, valid, next_use, tier):
    """One routing step on a pool (all layers for global scope, one layer's row view otherwise)."""
    n_rows, n_experts = st.resident.shape
    k = experts.shape[0]
    col = jnp.where(valid, experts, 0)
    transient = valid & (tier > 0)  # served from a low-bit copy: a miss, but never cached
    counted = jnp.where(valid, experts, n_experts)  # accessed (LFU / score count them)
    drop = jnp.where(valid & ~transient, experts, n_experts)  # inserted / touched; out of range -> dropped
    pass_now = st.token[row] + 1
    tick0 = st.clock.max()
    ticks = tick0 + 1 + jnp.arange(k, dtype=jnp.int32)  # highest weight first = oldest
    was_resident = st.resident[row, col]
    hit = valid & was_resident
    miss = valid & ~was_resident
    loaded = miss & ~transient
    compulsory = loaded & ~st.seen[row, col]
    collision = miss & (st.evict_pass[row, col] == pass_now)
    miss_col = jnp.where(loaded, experts, n_experts)

    def put(a, v, c=drop):
        return put_columns(a, row, c, v)

    now = put(jnp.zeros_like(st.resident), True)
    stats = st.stats
    n_miss = miss.sum().astype(jnp.int32)
    stats = stats.replace(
        accesses=stats.accesses.at[row].add(k),
        misses=stats.misses.at[row].add(n_miss),
        compulsory=stats.compulsory.at[row].add(compulsory.sum().astype(jnp.int32)),
        collisions=stats.collisions.at[row].add(collision.sum().astype(jnp.int32)),
        loads=stats.loads.at[row].add(loaded.sum().astype(jnp.int32)),
        low8_loads=stats.low8_loads.at[row].add((transient & (tier == 8)).sum().astype(jnp.int32)),
        low4_loads=stats.low4_loads.at[row].add((transient & (tier == 4)).sum().astype(jnp.int32)),
    )
    st = st.replace(
        resident=st.resident | now,
        last_touch=put(st.last_touch, ticks),
        freq=put_columns(st.freq, row, counted, 1, add=True),
        score=put_columns(st.score, row, counted, weights.astype(jnp.float32), add=True),
        touch_pass=put(st.touch_pass, pass_now),
        load_pass=put(st.load_pass, pass_now, miss_col),
        seen=put(st.seen, True, miss_col),
        next_use=st.next_use if next_use is None else put(st.next_use, next_use),
        token=st.token.at[row].set(pass_now),
        clock=jnp.full_like(st.clock, tick0 + k),
        stats=stats,
    )
    st, _ = _evict_and_place(st, row, now, drop, loaded, pass_now)
    return st, hit


def access(state: CacheState, layer, experts: jax.Array, weights: jax.Array, valid: jax.Array | None = None,
           next_use: jax.Array | None = None, tier: jax.Array | None = None) -> tuple[CacheState, jax.Array]:
    """Record that ``layer`` used ``experts`` [K] (distinct, highest weight first; -1 or valid=False for a
    dropped slot) with mixing ``weights`` [K]: count hits/misses, load the misses, evict down to capacity.

    ``next_use`` [K] (Belady only): index in the access sequence of each expert's next use, NEVER if none.
    ``tier`` [K] (cascade miss handling): 8 or 4 for a miss served from a low-bit copy — counted as a miss
    and a low-bit load, not inserted; 0 otherwise.
    Returns (state', hits [K] bool); dropped slots are neither hits nor misses.
    """
    experts = jnp.asarray(experts, jnp.int32)
    valid = (experts >= 0) if valid is None else (valid & (experts >= 0))
    tier = jnp.zeros(experts.shape, jnp.int32) if tier is None else jnp.asarray(tier, jnp.int32)
    if state.eviction in OFFLINE_EVICTIONS and next_use is None:
        raise ValueError(f"{state.eviction} eviction needs next_use (it is an offline oracle over a recorded trace)")
    if state.scope == "global":
        return _pool_access(state, layer, experts, weights, valid, next_use, tier)
    row, hits = _pool_access(row_view(state, layer), 0, experts, weights, valid, next_use, tier)
    return write_row(state, row, layer), hits


def hits(state: CacheState, layer, experts: jax.Array, valid: jax.Array) -> jax.Array:
    """Which of ``experts`` [K] (valid ones) ``layer`` holds now: the hits ``access`` would report."""
    valid = valid & (experts >= 0)
    return valid & state.resident[layer, jnp.where(valid, experts, 0)]


def access_layers(state: CacheState, experts: jax.Array, weights: jax.Array, valid: jax.Array,
                  tier: jax.Array) -> CacheState:
    """``access`` of every layer of a per-layer cache at once: row l records ``experts[l]`` [K] with
    ``weights[l]``, ``valid[l]`` and ``tier[l]`` (arrays [L, K]). Each row's update reads only that row, so this
    equals L calls of ``access`` in any order (``router.router_step_deferred``)."""
    if state.scope != "layer":
        raise ValueError("only a per-layer cache updates its layers independently")
    if state.eviction in OFFLINE_EVICTIONS:
        raise ValueError(f"{state.eviction} eviction needs next_use (it is an offline oracle over a recorded trace)")
    experts = jnp.asarray(experts, jnp.int32)
    valid = valid & (experts >= 0)

    def one(row, e, w, v, t):
        return _pool_access(row, 0, e, w, v, None, jnp.asarray(t, jnp.int32))[0]

    rows = jax.vmap(one)(split_layers(state), experts, weights, valid, tier)
    return merge_layers(rows)


def count(state: CacheState, layer, **amounts) -> CacheState:
    """Add scalar amounts to per-layer counters of ``layer`` (e.g. dropped=2, predicted=4)."""
    stats = state.stats
    for name, amount in amounts.items():
        cur = getattr(stats, name)
        stats = stats.replace(**{name: cur.at[layer].add(jnp.asarray(amount).astype(cur.dtype))})
    return state.replace(stats=stats)


def _pool_prefetch(st: CacheState, row, experts, valid):
    n_rows, n_experts = st.resident.shape
    e = experts.shape[0]
    col = jnp.where(valid, experts, 0)
    drop = jnp.where(valid, experts, n_experts)
    for_pass = st.token[row] + 1  # the pass in which this layer routes next
    new = valid & ~st.resident[row, col]
    new_col = jnp.where(new, experts, n_experts)
    tick0 = st.clock.max()

    def put(a, v, c=drop):
        return put_columns(a, row, c, v)

    now = put(jnp.zeros_like(st.resident), True)
    st = st.replace(
        resident=st.resident | now,
        last_touch=put(st.last_touch, tick0 + 1 + jnp.arange(e, dtype=jnp.int32)),
        touch_pass=put(st.touch_pass, for_pass),
        load_pass=put(st.load_pass, for_pass, new_col),
        seen=put(st.seen, True, new_col),
        clock=jnp.full_like(st.clock, tick0 + e),
    )
    st, _ = _evict_and_place(st, row, now, drop, new, for_pass)
    # a prediction larger than the cache evicts some of its own entries at once: those never move
    new = new & st.resident[row, col]
    st = st.replace(stats=st.stats.replace(
        prefetch_loads=st.stats.prefetch_loads.at[row].add(new.sum().astype(jnp.int32))))
    return st, new


def prefetch(state: CacheState, layer, expert_ids: jax.Array, valid: jax.Array | None = None):
    """Speculatively load ``expert_ids`` [E] (distinct, most wanted first; -1 = none) of ``layer`` before it
    routes. Loads count as prefetch loads (bytes moved), never as misses; the entries become *current* for
    Least-Stale and newest for LRU. Returns (state', newly_loaded [E] bool)."""
    expert_ids = jnp.asarray(expert_ids, jnp.int32)
    valid = (expert_ids >= 0) if valid is None else (valid & (expert_ids >= 0))
    if state.scope == "global":
        return _pool_prefetch(state, layer, expert_ids, valid)
    row, new = _pool_prefetch(row_view(state, layer), 0, expert_ids, valid)
    return write_row(state, row, layer), new
