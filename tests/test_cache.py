"""Expert cache: capacity parsing, eviction policies against a plain-Python reference and Belady, invariants.

Shapes are fixed (T=24 tokens, L=3 layers, K=3, N=8) so each (scope, eviction) compiles once; capacity is
a traced field, so hypothesis can vary it freely.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.experts import cache, trace
from moejax.experts import cache_metrics
from moejax.experts import capacity as capacity_lib
from moejax.runtime.simulate import CacheConfig
from support.reference_cache import simulate
from support.scatter_bounds import out_of_range_scatters

T, L, K, N = 24, 3, 3, 8
ONLINE = ("lru", "lfu", "fld", "score", "least-stale")
SETTINGS = settings(max_examples=15, deadline=None)


def random_trace(seed, n_experts=N, with_empty=True):
    """Random selections with some locality (experts drawn from a per-layer hot set) and a few -1 slots."""
    rng = np.random.default_rng(seed)
    experts = np.empty((T, L, K), np.int32)
    for t in range(T):
        for layer in range(L):
            hot = rng.random() < 0.7
            pool = np.arange(n_experts // 2) if hot else np.arange(n_experts)
            experts[t, layer] = rng.choice(pool, K, replace=False)
    if with_empty:
        experts[rng.random((T, L, K)) < 0.05] = -1
    weights = np.where(experts >= 0, rng.random((T, L, K)), 0).astype(np.float32)
    order = np.argsort(-weights, axis=-1, kind="stable")  # highest weight first, as recorded traces are
    return trace.validate_trace(np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1),
                                n_experts=np.int64(n_experts))


_access = jax.jit(cache.access)  # eager op-by-op dispatch is several times slower than one compile
_prefetch = jax.jit(cache.prefetch)


def run(tr, capacity, scope, eviction, init="empty", seed=0):
    state, _ = trace.replay_state(tr, str(capacity), scope, eviction, init=init, seed=seed)
    return state


# ------------------------------------------------------------------------------------------ capacity


def test_parse_capacity():
    assert capacity_lib.parse_capacity("6", 64) == 6
    assert capacity_lib.parse_capacity(6, 64) == 6
    assert capacity_lib.parse_capacity("0.5", 60) == 30
    assert capacity_lib.parse_capacity("1.0", 60) == 60
    assert capacity_lib.parse_capacity("0.25", 10) == 3  # 2.5 rounds half up
    assert capacity_lib.parse_capacity("0.05", 64, 16, "global") == 51  # 5% of 1024 entries
    assert capacity_lib.parse_capacity("5%", 64, 16, "global") == 51
    assert capacity_lib.parse_capacity("100", 64, 16, "global") == 100
    for bad, match in [("0", "between 1"), ("-3", "between 1"), ("65", "between 1"), ("1.5", r"\(0, 1\]"),
                       ("0.0", r"\(0, 1\]"), ("0.001", "rounds to 0"), ("abc", "not a count"), ("nan", "not a count")]:
        with pytest.raises(ValueError, match=match):
            capacity_lib.parse_capacity(bad, 64)
    with pytest.raises(ValueError, match="scope"):
        capacity_lib.parse_capacity("6", 64, scope="pool")


def test_init_cache_random_is_seeded_and_full():
    a = cache.init_cache(4, 16, 5, "layer", init="random", seed=1)
    b = cache.init_cache(4, 16, 5, "layer", init="random", seed=1)
    c = cache.init_cache(4, 16, 5, "layer", init="random", seed=2)
    np.testing.assert_array_equal(a.resident.sum(1), [5, 5, 5, 5])
    np.testing.assert_array_equal(a.resident, b.resident)
    assert not np.array_equal(a.resident, c.resident)
    for layer in range(4):
        assert sorted(np.asarray(a.slot[layer][a.resident[layer]]).tolist()) == list(range(5))
    g = cache.init_cache(4, 16, 20, "global", init="random", seed=1)
    assert int(g.resident.sum()) == 20
    assert sorted(np.asarray(g.slot[g.resident]).tolist()) == list(range(20))
    with pytest.raises(ValueError, match="capacity"):
        cache.init_cache(4, 16, 17, "layer")


# ------------------------------------------------------------------------------------------ semantics


def test_same_step_order_keeps_lowest_weighted_when_capacity_below_k():
    """Paper §4.2: with C < K the lowest-weighted selected experts stay, the higher-weighted go first."""
    for eviction in ONLINE:
        st_ = cache.init_cache(1, 8, 2, "layer", eviction)
        st_, hits = _access(st_, 0, jnp.asarray([5, 1, 3]), jnp.asarray([0.6, 0.3, 0.1]))
        assert not np.asarray(hits).any()
        assert set(np.flatnonzero(st_.resident[0]).tolist()) == {1, 3}, eviction
        assert int(st_.stats.loads[0]) == 3 and int(st_.stats.evictions[0]) == 1


def test_lru_evicts_least_recent_and_current_step_last():
    st_ = cache.init_cache(1, 8, 3, "layer", "lru")
    for experts in ([0, 1], [2], [0]):  # recency now: 1 < 2 < 0
        st_, _ = _access(st_, 0, jnp.asarray(experts), jnp.ones(len(experts)))
    st_, hits = _access(st_, 0, jnp.asarray([4, 2]), jnp.asarray([0.7, 0.3]))
    np.testing.assert_array_equal(hits, [False, True])
    assert set(np.flatnonzero(st_.resident[0]).tolist()) == {0, 2, 4}  # 1 was least recent


def test_lfu_and_score_victims():
    lfu = cache.init_cache(1, 8, 2, "layer", "lfu")
    score = cache.init_cache(1, 8, 2, "layer", "score")
    for experts, weights in (([0, 1], [0.9, 0.1]), ([0], [0.2]), ([1], [0.05])):
        lfu, _ = _access(lfu, 0, jnp.asarray(experts), jnp.asarray(weights))
        score, _ = _access(score, 0, jnp.asarray(experts), jnp.asarray(weights))
    lfu, _ = _access(lfu, 0, jnp.asarray([2]), jnp.asarray([1.0]))
    score, _ = _access(score, 0, jnp.asarray([2]), jnp.asarray([1.0]))
    # counts 0:2 1:2 -> tie, LRU breaks it: 0 is older. scores 0:1.1 1:0.15 -> 1 goes.
    assert set(np.flatnonzero(lfu.resident[0]).tolist()) == {1, 2}
    assert set(np.flatnonzero(score.resident[0]).tolist()) == {0, 2}


def test_fld_global_evicts_layer_farthest_ahead():
    st_ = cache.init_cache(4, 4, 4, "global", "fld")
    for layer in range(4):  # token 0: layer l uses expert l -> full
        st_, _ = _access(st_, layer, jnp.asarray([layer]), jnp.ones(1))
    res = lambda: {tuple(x) for x in np.argwhere(np.asarray(st_.resident)).tolist()}  # noqa: E731
    # token 1, layer 1 misses on 3: layer 1's other entry is next needed a full pass later (d = 4) -> it goes
    st_, _ = _access(st_, 0, jnp.asarray([0]), jnp.ones(1))
    st_, _ = _access(st_, 1, jnp.asarray([3]), jnp.ones(1))
    assert res() == {(0, 0), (1, 3), (2, 2), (3, 3)}
    # layer 2 hits; layer 3 uses 3 (hit) and misses on 0: d(layer 0) = 1, d(1) = 2, d(2) = 3 -> layer 2's goes
    st_, _ = _access(st_, 2, jnp.asarray([2]), jnp.ones(1))
    st_, _ = _access(st_, 3, jnp.asarray([3, 0]), jnp.asarray([0.6, 0.4]))
    assert res() == {(0, 0), (1, 3), (3, 3), (3, 0)}


def test_least_stale_global_evicts_stale_left_first_and_counts_collisions():
    st_ = cache.init_cache(3, 4, 3, "global", "least-stale")
    for layer in range(3):  # pass 0 fills the cache: (0,0) (1,0) (2,0)
        st_, _ = _access(st_, layer, jnp.asarray([0]), jnp.ones(1))
    # pass 1, layer 0 uses expert 1: every other entry is stale; FIFO by layer position evicts layer 0's
    st_, _ = _access(st_, 0, jnp.asarray([1]), jnp.ones(1))
    assert not bool(st_.resident[0, 0]) and bool(st_.resident[1, 0]) and bool(st_.resident[2, 0])
    # pass 1, layer 1 uses expert 2: stale (1,0), (2,0); layer 1 < layer 2 -> (1,0) goes; (0,1) is current
    st_, _ = _access(st_, 1, jnp.asarray([2]), jnp.ones(1))
    assert bool(st_.resident[0, 1]) and not bool(st_.resident[1, 0]) and bool(st_.resident[2, 0])
    assert int(st_.stats.collisions.sum()) == 0
    # LRU instead would evict (1,0) first at layer 0 and then miss on it at layer 1: a collision miss
    lru = cache.init_cache(3, 4, 3, "global", "lru")
    for layer, e in [(0, 0), (1, 0), (2, 0), (0, 1), (1, 0)]:
        lru, _ = _access(lru, layer, jnp.asarray([e]), jnp.ones(1))
    assert int(lru.stats.collisions.sum()) == 0  # (0,0) was the LRU victim, not a same-pass collision
    lru2 = cache.init_cache(3, 4, 3, "global", "lru")
    for layer, e in [(0, 0), (1, 0), (2, 0), (2, 1), (0, 1), (1, 0)]:
        lru2, _ = _access(lru2, layer, jnp.asarray([e]), jnp.ones(1))
    # pass 1, layer 0 evicts LRU (1,0) [(0,0) went at (2,1)]; layer 1 then misses on it in the same pass
    assert int(lru2.stats.collisions[1]) == 1


def test_prefetch_counts_loads_not_misses():
    st_ = cache.init_cache(2, 8, 2, "layer", "least-stale")
    st_, new = _prefetch(st_, 1, jnp.asarray([3, 4, -1]))
    np.testing.assert_array_equal(new, [True, True, False])
    st_, hits = _access(st_, 1, jnp.asarray([4, 3]), jnp.asarray([0.5, 0.5]))
    assert np.asarray(hits).all()
    s = cache_metrics.summarize(st_, expert_bytes=100)
    assert s["misses"] == 0 and s["prefetch_loads"] == 2 and s["bytes_moved"] == 200


def test_summarize_lifetimes():
    st_ = cache.init_cache(1, 8, 1, "layer", "lru")
    for e in (0, 0, 0, 1, 1):  # expert 0 lives tokens 0..2 (evicted at 3), expert 1 from 3, still resident
        st_, _ = _access(st_, 0, jnp.asarray([e]), jnp.ones(1))
    s = cache_metrics.summarize(st_, include_resident=False)
    assert s["evictions"] == 1 and s["lifetime_mean"] == 3.0 and s["lifetime_std"] == 0.0
    s = cache_metrics.summarize(st_)  # + expert 1, resident for tokens 3..4 -> 2
    assert s["lifetime_mean"] == 2.5 and s["lifetime_std"] == pytest.approx(0.5)
    assert s["misses"] == 2 and s["accesses"] == 5 and s["miss_rate"] == 0.4 and s["tokens"] == 5


# ------------------------------------------------------------------------------------------ properties


@pytest.mark.parametrize("eviction", ["lru", "lfu", "belady", "score", "least-stale"])
def test_vmapped_cache_updates_keep_every_scatter_index_in_range(eviction):
    """The per-layer replay is a vmap over layers; on an H200 with --xla_gpu_deterministic_ops its scatters'
    dropped (out-of-range) columns landed in the next layer and the last layer's miss count came out wrong.
    Every index stays in range instead (a scratch column), for access and prefetch alike."""
    tr = random_trace(3)
    state = cache.init_cache(L, N, 2, "layer", eviction)
    offline = eviction in cache.OFFLINE_EVICTIONS
    nu = trace.next_use_indices(tr.experts, "layer") if offline else np.zeros(tr.shape, np.int32)
    assert out_of_range_scatters(trace._replay_layers, state, tr.experts, tr.weights, nu) == []
    split = cache.split_layers(state)
    step = int(np.argmax((tr.experts < 0).any(axis=(1, 2))))
    wanted = jnp.asarray(tr.experts[step])  # [L, K] with a -1 (none) entry
    assert (wanted < 0).any()
    assert out_of_range_scatters(jax.vmap(lambda s, e: cache.prefetch(s, 0, e)), split, wanted) == []


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("eviction", ["lru", "lfu", "belady", "belady-bypass"])
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), capacity=st.integers(1, N))
def test_matches_reference_simulator(scope, eviction, seed, capacity):
    tr = random_trace(seed)
    cap = capacity if scope == "layer" else capacity * 2  # global pool: 2..16 of 24 entries
    state = run(tr, cap, scope, eviction)
    ref = simulate(tr.experts.tolist(), cap, scope, eviction)
    np.testing.assert_array_equal(state.stats.misses, ref["misses"])
    np.testing.assert_array_equal(state.stats.compulsory, ref["compulsory"])
    np.testing.assert_array_equal(state.stats.collisions, ref["collisions"])
    np.testing.assert_array_equal(state.stats.evictions, ref["evictions"])
    np.testing.assert_array_equal(state.stats.accesses, [T * K] * L)


@pytest.mark.parametrize("scope", ["layer", "global"])
@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), capacity=st.integers(1, N))
def test_belady_is_a_lower_bound(scope, seed, capacity):
    tr = random_trace(seed)
    cap = capacity if scope == "layer" else capacity * 2
    best = int(run(tr, cap, scope, "belady").stats.misses.sum())
    for eviction in ONLINE:
        assert best <= int(run(tr, cap, scope, eviction).stats.misses.sum()), eviction


@functools.partial(jax.jit, static_argnames=("per_layer",))
def _trajectory(state, experts, weights, per_layer):
    """Occupancy after every step and whether slots stay a bijection onto [0, occupancy)."""
    def step(cs, x):
        layer, e, w = x
        cs, _ = cache.access(cs, layer, e, w)
        occ = cs.resident.sum(axis=1) if per_layer else cs.resident.sum()[None]
        slots_ok = jnp.all((cs.slot >= 0) == cs.resident) & jnp.all(cs.slot < cs.capacity)
        flat = jnp.where(cs.resident, cs.slot, -1 - jnp.arange(cs.slot.size).reshape(cs.slot.shape))
        if per_layer:
            distinct = jnp.all(jnp.sort(flat, axis=1)[:, 1:] != jnp.sort(flat, axis=1)[:, :-1])
        else:
            s = jnp.sort(flat.reshape(-1))
            distinct = jnp.all(s[1:] != s[:-1])
        return cs, (occ.max(), slots_ok & distinct)

    layers = jnp.tile(jnp.arange(L, dtype=jnp.int32), T)
    return jax.lax.scan(step, state, (layers, experts.reshape(T * L, K), weights.reshape(T * L, K)))[1]


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("eviction", ONLINE)
def test_occupancy_never_exceeds_capacity_and_slots_are_consistent(scope, eviction):
    for seed, capacity in [(0, 1), (1, 2), (2, 5), (3, 8)]:
        tr = random_trace(seed)
        cap = capacity if scope == "layer" else 3 * capacity - 1
        state = cache.init_cache(L, N, cap, scope, eviction, init="random" if seed % 2 else "empty", seed=seed)
        occ, ok = _trajectory(state, jnp.asarray(tr.experts), jnp.asarray(tr.weights), per_layer=scope == "layer")
        assert int(occ.max()) <= cap
        assert bool(ok.all())


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_full_capacity_misses_are_compulsory(scope):
    for seed in range(3):
        tr = random_trace(seed)
        for eviction in ("lru", "least-stale", "belady"):
            state = run(tr, "1.0", scope, eviction)
            s = cache_metrics.summarize(state)
            assert s["misses"] == s["compulsory_misses"] and s["evictions"] == 0
            # every distinct (layer, expert) of the trace is missed exactly once
            assert s["misses"] == len({(l_, e) for t in tr.experts.tolist() for l_, es in enumerate(t) for e in es if e >= 0})


def test_parse_capacity_of_a_memory_size():
    """A memory size is the bytes all cached experts may take: ⌊bytes / (L · expert bytes)⌋ per layer, the
    pool's ⌊bytes / expert bytes⌋ in global scope, at most the limit; units binary or decimal, any case."""
    eb = 1_000_000  # one expert: 1 MB
    assert capacity_lib.parse_capacity("64MB", 64, 16, "layer", eb) == 4
    assert capacity_lib.parse_capacity("63.9 MB", 64, 16, "layer", eb) == 3
    assert capacity_lib.parse_capacity("64MiB", 64, 16, "layer", eb) == 4  # 67.1 MB
    assert capacity_lib.parse_capacity("0.1gb", 64, 16, "global", eb) == 100
    assert capacity_lib.parse_capacity("1TB", 64, 16, "layer", eb) == 64  # more than every expert: all of them
    assert capacity_lib.parse_capacity("1TB", 64, 16, "global", eb) == 1024
    assert capacity_lib.parse_byte_size("6GiB") == 6 * 2**30 and capacity_lib.parse_byte_size("6") is None
    assert capacity_lib.parse_byte_size("5%") is None and capacity_lib.parse_byte_size("0.5") is None
    huge = "9" * 400 + "GB"  # past a float: exact, and more than every expert (a float overflowed, a traceback)
    assert capacity_lib.parse_byte_size(huge) == int("9" * 400) * 10**9 and capacity_lib.parse_byte_size("1.5 kB") == 1500
    assert capacity_lib.parse_capacity(huge, 64, 16, "layer", eb) == 64
    for bad, match in [("15MB", r"less than one expert per MoE layer \(16 × 1.0 MB\): give at least 16.0 MB"),
                       ("0GB", "less than"), ("6 XB", "unknown unit 'XB'"), ("6e", "unknown unit")]:
        with pytest.raises(ValueError, match=match):
            capacity_lib.parse_capacity(bad, 64, 16, "layer", eb)
    with pytest.raises(ValueError, match="less than one expert"):
        capacity_lib.parse_capacity("999kB", 64, 16, "global", eb)
    with pytest.raises(ValueError, match="only a loaded model knows"):
        capacity_lib.parse_capacity("6GiB", 64, 16)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 64), st.integers(1, 8), st.integers(1, 10**7),
       st.sampled_from(["layer", "global"]))
def test_a_memory_size_gets_the_most_slots_it_holds(budget, n, layers, eb, scope):
    sets = layers if scope == "layer" else 1
    limit = n if scope == "layer" else n * layers
    try:
        c = capacity_lib.parse_capacity(f"{budget}B", n, layers, scope, eb)
    except ValueError:
        assert budget < sets * eb
        return
    assert 1 <= c <= limit and c * sets * eb <= budget
    assert c == limit or (c + 1) * sets * eb > budget


def test_a_cache_config_refuses_a_size_no_model_could_take_when_it_is_made():
    """``CacheConfig(size="abc")`` or ``"-3"`` is refused where it is made, not at the first model call."""
    for good in ("4", "0.5", "5%", "6GiB", "auto", "1e-3", 4, 0.25):
        CacheConfig(size=good)
    for bad, match in (("abc", "is not a count"), ("-3", "positive"), ("0", "positive"), ("-0.5", "positive"),
                       ("0GB", "positive"), ("nan", "is not a count"), ("6 XB", "unknown unit")):
        with pytest.raises(ValueError, match=match):
            CacheConfig(size=bad)
