"""Routing policies and the router step: docs/design.md §2 properties (chex + hypothesis, fixed shapes)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.models.gating import GroupLimited, SoftmaxTopK, SparseMixer, descending_order
from moejax.experts import cache, router, routing

N = 16
GATINGS = {
    "softmax-norm": SoftmaxTopK(N, 4, True),
    "softmax-scaled": SoftmaxTopK(N, 4, False, 2.5),
    "group-limited": GroupLimited(N, 4, False, 1.0, n_group=4, topk_group=2),
    "sparsemixer": SparseMixer(N, 2, 0.01),
}
SETTINGS = settings(max_examples=15, deadline=None)
seeds = st.integers(0, 2**31 - 1)


def _inputs(seed, n=N):
    """Decisive random logits (scaled, so ties do not hide bugs), a random cache mask and a Δ history."""
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal(n) * 3.0, jnp.float32)
    mask = jnp.asarray(rng.random(n) < 0.5)
    rs = routing.RoutingState(jnp.asarray([rng.random() * 10 + 1], jnp.float32), jnp.asarray([2.0], jnp.float32))
    return z, mask, rs


_choose = jax.jit(router.choose, static_argnames=("gating",))


def _original(z, gating):
    return _choose(z, jnp.zeros(z.shape, bool), routing.init_routing_state(1), routing.original(), gating=gating)


def test_appendix_b_max_rank_example():
    """Paper appendix B: r = [E1..E6], C = {E3, E4, E6}, M = 4, J = 1 -> [E1, E3, E4, E2, E5, E6]."""
    r = jnp.arange(6, dtype=jnp.int32)  # E1..E6 as ids 0..5
    cached = jnp.asarray([False, False, True, True, False, True])
    out = routing._promote_cached_then_top_j(r, cached, 4, 1)
    np.testing.assert_array_equal(out, [0, 2, 3, 1, 4, 5])


def test_cumsum_max_rank_threshold():
    probs = jnp.asarray([0.5, 0.3, 0.15, 0.05])
    assert int(routing.cumsum_max_rank(probs, 0.0)) == 1
    assert int(routing.cumsum_max_rank(probs, 0.5)) == 1
    assert int(routing.cumsum_max_rank(probs, 0.51)) == 2
    assert int(routing.cumsum_max_rank(probs, 0.96)) == 4
    assert int(routing.cumsum_max_rank(probs, 1.0 + 1e-6)) == 4  # clipped, never past N


def test_cache_prior_boosts_cached_expert_by_lambda_delta():
    g = SoftmaxTopK(4, 1, False)
    z = jnp.asarray([3.0, 2.0, 1.0, 0.0])
    mask = jnp.asarray([False, False, False, True])
    rs = routing.observe(routing.init_routing_state(1), 0, z)  # Δ = 3
    for lam, expected in [(0.9, 0), (1.01, 3)]:  # 0 + 3·λ overtakes 3 only for λ > 1
        ranking, _ = routing.rerank(z, mask, rs, routing.cache_prior(lam, 0), g)
        assert int(ranking[0]) == expected
    # a fixed Δ replaces the running mean
    ranking, _ = routing.rerank(z, mask, rs, routing.cache_prior(0.5, 0, delta=10.0), g)
    assert int(ranking[0]) == 3


def test_running_delta_is_mean_logit_range_including_current_token():
    rs = routing.init_routing_state(2)
    assert float(routing.running_delta(rs, 0)) == 0.0  # no NaN before any token
    zs = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    for z in zs:
        rs = routing.observe(rs, 1, jnp.asarray(z))
    np.testing.assert_allclose(routing.running_delta(rs, 1), np.mean(zs.max(1) - zs.min(1)), rtol=1e-6)
    assert float(routing.running_delta(rs, 0)) == 0.0
    # masked (-inf) logits do not make Δ infinite
    assert np.isfinite(float(routing.logit_range(jnp.asarray([1.0, -jnp.inf, -2.0]))))


@pytest.mark.parametrize("name", sorted(GATINGS))
@SETTINGS
@given(seed=seeds, lam_seed=st.integers(0, 3))
def test_lambda_zero_is_bit_identical_to_original(name, seed, lam_seed):
    g = GATINGS[name]
    z, mask, rs = _inputs(seed)
    e0, w0, v0 = _original(z, g)
    pol = routing.cache_prior(0.0, lam_seed % (g.top_k + 1), delta=None if lam_seed < 2 else 7.0)
    e1, w1, v1 = _choose(z, mask, rs, pol, gating=g)
    np.testing.assert_array_equal(e0, e1)
    np.testing.assert_array_equal(np.asarray(w0).view(np.uint32), np.asarray(w1).view(np.uint32))  # bits
    np.testing.assert_array_equal(v0, v1)


@pytest.mark.parametrize("name", sorted(GATINGS))
@SETTINGS
@given(seed=seeds, m_seed=st.integers(0, 100))
def test_max_rank_within_k_and_cumsum_p_zero_change_nothing(name, seed, m_seed):
    g = GATINGS[name]
    z, mask, rs = _inputs(seed)
    e0, w0, _ = _original(z, g)
    m, j = m_seed % (g.top_k + 1), (m_seed // 7) % (g.top_k + 1)
    for pol in (routing.max_rank(m, j), routing.cumsum(0.0, j), routing.cumsum(1e-9, j)):
        e1, w1, _ = _choose(z, mask, rs, pol, gating=g)
        np.testing.assert_array_equal(e0, e1)
        np.testing.assert_array_equal(w0, w1)


def _all_policies(k, seed):
    rng = np.random.default_rng(seed)
    j = int(rng.integers(0, k + 1))
    return [
        routing.original(),
        routing.pruning(int(rng.integers(2, k + 1))),
        routing.max_rank(int(rng.integers(0, N + 1)), j),
        routing.cumsum(float(rng.random()), j),
        routing.cache_prior(float(rng.random()), j),
        routing.cache_prior(float(rng.random()) * 3, j, delta=float(rng.random() * 5)),
    ]


@pytest.mark.parametrize("name", ["softmax-norm", "group-limited", "sparsemixer"])
@SETTINGS
@given(seed=seeds)
def test_choice_invariants(name, seed):
    """Top-J kept, K distinct (h-1 for pruning), weights = original-logit weights of the chosen set."""
    g = GATINGS[name]
    z, mask, rs = _inputs(seed)
    top = np.asarray(g.ranking(z))
    for pol in _all_policies(g.top_k, seed):
        e, w, v = (np.asarray(a) for a in _choose(z, mask, rs, pol, gating=g))
        n_valid = int(pol.prune_h) - 1 if pol.kind == "pruning" else g.top_k
        assert v.sum() == n_valid and v[:n_valid].all(), pol.kind
        used = e[v]
        assert len(set(used.tolist())) == n_valid and (used >= 0).all() and (e[~v] == -1).all()
        assert (w[~v] == 0).all()
        assert np.all(np.diff(w[v]) <= 0), "experts must come highest weight first"
        if pol.kind in ("max-rank", "cumsum", "cache-prior"):
            assert set(top[: int(pol.top_j)].tolist()) <= set(used.tolist()), pol.kind
        if pol.kind == "pruning":
            assert set(used.tolist()) == set(top[:n_valid].tolist())
        # weights: the architecture's weights of this set (in original-rank order) from the ORIGINAL logits
        in_rank_order = np.asarray(sorted(used.tolist(), key=lambda x: list(top).index(x)) + [-1] * (g.top_k - n_valid))
        expected = np.asarray(g.weights(z, jnp.asarray(in_rank_order), jnp.asarray(in_rank_order >= 0)))
        got = dict(zip(e.tolist(), w.tolist()))
        for x, wx in zip(in_rank_order.tolist(), expected.tolist()):
            if x >= 0:
                assert got[x] == pytest.approx(wx, rel=1e-6, abs=1e-7)


def test_cache_prior_lambda_one_prefers_cached_experts():
    """With λ large enough every chosen non-top-J expert is a cached one (when enough are cached)."""
    g = SoftmaxTopK(N, 4, True)
    z, _, _ = _inputs(3)
    mask = jnp.zeros(N, bool).at[jnp.asarray([1, 5, 9, 12, 14])].set(True)
    rs = routing.observe(routing.init_routing_state(1), 0, z)
    e, _, _ = _choose(z, mask, rs, routing.cache_prior(1.0, 1), gating=g)
    top1 = int(g.ranking(z)[0])
    assert all(bool(mask[x]) or x == top1 for x in np.asarray(e).tolist())


@pytest.mark.parametrize("kind", ["cache-prior", "max-rank", "cumsum"])
def test_vmap_over_policy_equals_python_loop(kind):
    """A sweep is one vmapped pass; it must equal running the policies one by one."""
    g = SoftmaxTopK(8, 2, True)
    z = jax.random.normal(jax.random.PRNGKey(1), (30, 3, 8)) * 3.0
    values = [0.0, 0.2, 0.5, 1.0]
    make = {
        "cache-prior": lambda x: routing.cache_prior(x, 1),
        "max-rank": lambda x: routing.max_rank(int(x * 8), 1),
        "cumsum": lambda x: routing.cumsum(x, 1),
    }[kind]
    pols = [make(x) for x in values]
    cs0 = cache.init_cache(3, 8, 3, "layer", "lru")
    rs0 = routing.init_routing_state(3)
    run = jax.jit(router.route_sequence, static_argnames=("gating",))
    batched = jax.jit(jax.vmap(lambda p: router.route_sequence(z, cs0, rs0, p, g)))(routing.stack_policies(pols))
    for i, p in enumerate(pols):
        single = run(z, cs0, rs0, p, gating=g)
        for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(batched)):
            np.testing.assert_array_equal(a, b[i])


_route_tokens = jax.jit(router.route_tokens, static_argnames=("gating",))


@pytest.mark.parametrize("eviction", ["lru", "score"])
def test_layer_parallel_equals_token_sequential(eviction):
    g = SoftmaxTopK(8, 2, True)
    z = jax.random.normal(jax.random.PRNGKey(2), (40, 3, 8)) * 3.0
    pol = routing.cache_prior(0.4, 1)
    cs0 = cache.init_cache(3, 8, 3, "layer", eviction, init="random", seed=1)
    rs0 = routing.init_routing_state(3)
    seq = jax.jit(router.route_sequence, static_argnames=("gating",))(z, cs0, rs0, pol, gating=g)
    par = jax.jit(router.route_layers_parallel, static_argnames=("gating",))(z, cs0, rs0, pol, gating=g)
    chex.assert_trees_all_equal(seq, par)
    # and route_tokens layer after layer, the way model.forward drives it
    cs, rs = cs0, rs0
    for layer in range(3):
        e, w, h, cs, rs = _route_tokens(z[:, layer], jnp.int32(layer), cs, rs, pol, gating=g)
        np.testing.assert_array_equal(e, seq[0][:, layer])
        np.testing.assert_array_equal(h, seq[2][:, layer])
    chex.assert_trees_all_equal((cs, rs), seq[3:])


def _token_by_layers(deferred: bool, z, z_pred, cs, rs, pol, g):
    """One token through every layer's router step, each layer's cache update at once (``router_step``) or all
    after the last layer (``router_step_deferred`` + ``cache.access_layers``, what ``model.forward`` runs)."""
    outs, pending = [], []
    for layer in range(z.shape[0]):
        zp = None if z_pred is None else z_pred[layer]
        if deferred:
            e, w, h, tier, left, cs, rs = router.router_step_deferred(z[layer], cs, rs, pol, g, layer, z_pred=zp)
            pending.append(left)
        else:
            e, w, h, tier, cs, rs = router.router_step(z[layer], cs, rs, pol, g, layer, z_pred=zp, with_tier=True)
        outs.append((e, w, h, tier))
    if deferred:
        cs = cache.access_layers(cs, *(jnp.stack(parts) for parts in zip(*pending)))
    return outs, cs, rs


@functools.partial(jax.jit, static_argnums=(0, 6))
def _tokens_by_layers(deferred: bool, zs, z_preds, cs, rs, pol, g):
    """``_token_by_layers`` for each of T tokens in turn (zs [T, L, N]): the per-token outputs and the final states."""
    def token(states, inputs):
        outs, cs, rs = _token_by_layers(deferred, *inputs, *states, pol, g)
        return (cs, rs), outs

    return jax.lax.scan(token, (cs, rs), (zs, z_preds))


@SETTINGS
@given(seed=seeds, eviction=st.sampled_from(["lru", "lfu", "score", "least-stale", "fld"]),
       miss=st.sampled_from(["fetch", "drop", "substitute", "cascade"]), prefetch=st.booleans(),
       capacity=st.integers(1, 8))
def test_a_tokens_cache_updates_after_its_last_layer_equal_each_after_its_layer(seed, eviction, miss, prefetch,
                                                                                capacity):
    """A per-layer cache's rows never read one another, so updating all L rows after a token's last layer (one
    update in the program) decides and counts exactly as updating each row right after its layer."""
    g = SoftmaxTopK(8, 3, True)
    key = jax.random.PRNGKey(seed % 2**31)
    zs = jax.random.normal(key, (12, 3, 8)) * 3.0
    zps = zs + jax.random.normal(jax.random.fold_in(key, 1), zs.shape) if prefetch else None
    cs0 = cache.init_cache(3, 8, capacity, "layer", eviction, init="random", seed=seed % 1000,
                           miss=cache.MissConfig(miss, (1,), (8,), None),
                           prefetcher=cache.PrefetchConfig(1.0 if prefetch else 0.0, None))
    rs0 = routing.init_routing_state(3)
    pol = routing.cache_prior(0.5, 1)
    now = _tokens_by_layers(False, zs, zps, cs0, rs0, pol, g)
    later = _tokens_by_layers(True, zs, zps, cs0, rs0, pol, g)
    chex.assert_trees_all_equal(now, later)


def test_only_a_per_layer_cache_updates_its_layers_after_the_token():
    cs = cache.init_cache(3, 8, 4, "global", "lru")
    with pytest.raises(ValueError, match="per-layer cache"):
        router.router_step_deferred(jnp.zeros(8), cs, routing.init_routing_state(3), routing.cache_prior(0.5, 1),
                                    SoftmaxTopK(8, 2, True), 0)
    with pytest.raises(ValueError, match="per-layer cache"):
        cache.access_layers(cs, jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)), jnp.ones((3, 2), bool),
                            jnp.zeros((3, 2), jnp.int32))


def test_a_delta_per_layer_is_each_layers_own_delta():
    """Δavg is per layer (docs/design.md §2, paper eq. 10): a fixed Δ per MoE layer routes layer l as the single Δ_l
    does, on every path (token-sequential, layer-parallel, route_tokens layer by layer), and a batch may mix
    it with single values (``stack_policies`` spreads those over the layers)."""
    g = SoftmaxTopK(8, 2, True)
    z = jax.random.normal(jax.random.PRNGKey(3), (40, 3, 8)) * 3.0
    deltas = (0.5, 3.0, 9.0)
    cs0 = cache.init_cache(3, 8, 3, "layer", "lru", init="random", seed=1)
    rs0 = routing.init_routing_state(3)
    seq_fn = jax.jit(router.route_sequence, static_argnames=("gating",))
    par_fn = jax.jit(router.route_layers_parallel, static_argnames=("gating",))
    per_layer = routing.make_policy("cache-prior", 2, lam=0.4, top_j=1, delta=list(deltas))
    seq, par = seq_fn(z, cs0, rs0, per_layer, gating=g), par_fn(z, cs0, rs0, per_layer, gating=g)
    chex.assert_trees_all_equal(seq, par)
    cs, rs = cs0, rs0
    for layer, d in enumerate(deltas):
        single = par_fn(z, cs0, rs0, routing.make_policy("cache-prior", 2, lam=0.4, top_j=1, delta=d), gating=g)
        np.testing.assert_array_equal(par[0][:, layer], single[0][:, layer])
        e, _, _, cs, rs = _route_tokens(z[:, layer], jnp.int32(layer), cs, rs, per_layer, gating=g)
        np.testing.assert_array_equal(e, par[0][:, layer])
    assert (par[0] != par_fn(z, cs0, rs0, routing.make_policy("cache-prior", 2, lam=0.4, top_j=1, delta=3.0),
                             gating=g)[0]).any()
    mixed = routing.stack_policies([per_layer, routing.make_policy("cache-prior", 2, lam=0.4, top_j=1, delta=3.0)])
    lanes = jax.jit(jax.vmap(lambda p: router.route_layers_parallel(z, cs0, rs0, p, g)))(mixed)
    np.testing.assert_array_equal(lanes[0][0], par[0])
    with pytest.raises(ValueError, match="delta has 2 per-layer values; .* 3 MoE layers"):
        par_fn(z, cs0, rs0, routing.make_policy("cache-prior", 2, delta=[1.0, 2.0]), gating=g)
    for bad in ([], [1.0, -1.0], [float("nan")], "2", [[1.0]], True):
        with pytest.raises(ValueError, match="delta must be"):
            routing.make_policy("cache-prior", 2, delta=bad)


class RouterStepJitTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_equals_no_jit(self):
        g = SoftmaxTopK(8, 2, True)
        pol = routing.cumsum(0.7, 1)
        step = self.variant(router.router_step, static_argnames=("gating",))
        cs = cache.init_cache(2, 8, 3, "global", "least-stale", init="random", seed=3)
        rs = routing.init_routing_state(2)
        outs = []
        for t, z in enumerate(np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32) * 3):
            e, w, h, cs, rs = step(jnp.asarray(z), cs, rs, pol, gating=g, layer=jnp.int32(t % 2))
            outs.append((e, w, h))
        ref_cs = cache.init_cache(2, 8, 3, "global", "least-stale", init="random", seed=3)
        ref_rs = routing.init_routing_state(2)
        for t, z in enumerate(np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32) * 3):
            e, w, h, ref_cs, ref_rs = jax.jit(router.router_step, static_argnames=("gating", "layer"))(
                jnp.asarray(z), ref_cs, ref_rs, pol, gating=g, layer=t % 2)
            chex.assert_trees_all_close(outs[t], (e, w, h))
        chex.assert_trees_all_close(cs, ref_cs)


def test_route_no_cache_matches_original_policy():
    g = SoftmaxTopK(N, 4, True)
    z = jax.random.normal(jax.random.PRNGKey(4), (5, N)) * 3
    e, w = router.route_no_cache(z, g)
    for t in range(5):
        e0, w0, _ = _original(z[t], g)
        np.testing.assert_array_equal(e[t], e0)
        np.testing.assert_array_equal(w[t], w0)


def test_make_policy_defaults_and_errors():
    assert int(routing.make_policy("cache-prior", 2, lam=0.3).top_j) == 1
    assert int(routing.make_policy("cache-prior", 8, lam=0.3).top_j) == 2
    assert int(routing.make_policy("pruning", 4).prune_h) == 4
    with pytest.raises(ValueError, match="1 < h"):
        routing.make_policy("pruning", 4, prune_h=1)
    with pytest.raises(ValueError, match="cumsum p"):
        routing.make_policy("cumsum", 4, cumsum_p=1.5)
    with pytest.raises(ValueError, match="unknown routing"):
        routing.make_policy("nope", 4)
    with pytest.raises(ValueError, match="one kind"):
        routing.stack_policies([routing.original(), routing.pruning(2)])


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.sampled_from([0.0, 1.0, -2.5, 3.0, float("nan"), float("inf"), float("-inf")]),
                       min_size=1, max_size=12))
def test_descending_order_is_a_permutation_even_with_nan(values):
    """NaN must not break the ranking (ids such as 496 or -2**31): NaN ranks last, ties by index."""
    from moejax.models.gating import descending_order

    order = np.asarray(descending_order(jnp.asarray(values, jnp.float32)))
    assert sorted(order.tolist()) == list(range(len(values)))
    key = [(-np.inf if np.isnan(v) else v) for v in values]
    ref = sorted(range(len(values)), key=lambda i: (-key[i], i))
    assert order.tolist() == ref


@jax.jit
def _cache_prior_ranking(z, mask, lam, delta):
    """cache-prior's ranking of one token, as one program (compiled once per N, not per example)."""
    return descending_order(routing.cache_prior_logits(z, descending_order(z), mask, lam, delta, 2))


@pytest.mark.numerics  # at XLA's default optimisation level, as users compile: the main pass's level 0 hid it
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.sampled_from([8, 32, 64, 128]))
def test_the_cache_prior_ranking_fused_into_one_program_is_a_permutation(seed, n):
    """cache-prior's z' = z + λ·Δ, where XLA:CPU fuses it into a pairwise ranking, is computed once per side of
    each pair and the two can round apart: at N = 64 half of random steps then rank an expert ahead of itself,
    the ranking sums two ids into one that does not exist, and decode reads NaN. Only the ranking leaves the
    program (returning z' too would materialise it and hide the fault)."""
    rng = np.random.default_rng(seed)
    for _ in range(8):
        z = rng.normal(size=n).astype(np.float32) * np.float32(rng.uniform(0.5, 5.0))
        mask = rng.random(n) < 0.5
        lam, delta = np.float32(rng.uniform(0.05, 1.0)), np.float32(rng.uniform(0.5, 20.0))
        order = np.asarray(_cache_prior_ranking(jnp.asarray(z), jnp.asarray(mask), lam, delta))
        assert sorted(order.tolist()) == list(range(n)), order.tolist()
        boosted = mask.copy()
        boosted[np.argsort(-z, kind="stable")[:2]] = True
        z_prior = np.where(boosted, z + lam * delta, z)
        ulp = np.spacing(np.abs(z_prior).max())  # z' made with or without a fused multiply-add: an ulp apart
        assert np.all(z_prior[order][:-1] >= z_prior[order][1:] - 2 * ulp)


@settings(max_examples=10, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, -0.0, 1.0, -2.5, 3.0, 1e-30, float("nan"), float("inf"),
                                                 float("-inf")]), min_size=9, max_size=9), min_size=1, max_size=6))
def test_large_batches_sort_to_the_same_order(rows):
    """A batch past PAIRWISE_LIMIT sorts instead of comparing pairwise (a training batch's [tokens, N, N]
    comparison took minutes to compile on a GPU): the same order, ties, NaN and signed zeros included."""
    from moejax.models import gating

    x = jnp.asarray(rows, jnp.float32)
    clean = jnp.where(jnp.isnan(x), -jnp.inf, x)
    np.testing.assert_array_equal(gating.order_by_sort(clean), gating.order_by_comparison(clean))
    big = jnp.tile(x, (gating.PAIRWISE_LIMIT // (len(rows) * 81) + 1, 1))  # past the limit: the sort path
    np.testing.assert_array_equal(gating.descending_order(big)[: len(rows)], gating.descending_order(x))
    def lowered(a, platform):
        return jax.jit(gating.descending_order).trace(a).lower(lowering_platforms=(platform,)).as_text()

    assert "sort" not in lowered(x, "cpu") and "sort" in lowered(big, "cpu") and "sort" in lowered(x, "cuda")


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, -0.0, 1.0, 1e-30, 3.0, float("nan"), float("-inf")]),
                              min_size=6, max_size=6), min_size=1, max_size=4),
       first=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=4, max_size=4))
def test_an_order_with_some_entries_first_is_the_two_key_sort(rows, first):
    """``descending_order(scores, first)``: the marked entries ahead, each part by score, ties by index; the
    pairwise and the sorting paths agree (group-limited gatings rank their chosen groups first so)."""
    from moejax.models import gating

    x = jnp.asarray(rows, jnp.float32)
    f = jnp.asarray(first[: len(rows)])
    got = np.asarray(gating.descending_order(x, f))
    clean = np.where(np.isnan(rows), -np.inf, rows)
    ref = [sorted(range(6), key=lambda i: (not first[r][i], -clean[r][i], i)) for r in range(len(rows))]
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(gating.order_by_sort(jnp.asarray(clean, jnp.float32), f), got)


def test_group_limited_ranks_close_probabilities_in_the_chosen_groups_by_value():
    """Adding 2 to the chosen groups' probabilities (the old way to put them first) rounded 0.01 and 0.01 + 1e-8
    to one float and ranked them by index; the two-key order ranks the larger first, as HF's top-k does."""
    p = np.array([0.01, 0.01 + 1e-8, 0.3, 0.2, 0.001, 0.001, 0.05, 0.0778], np.float64)
    g = GroupLimited(8, 2, False, 1.0, n_group=2, topk_group=1)  # groups 0-3 (best 0.3, chosen) and 4-7
    z = jnp.asarray(np.log(p / p.sum()), jnp.float32)
    probs = np.asarray(g.probs(z))
    assert probs[1] > probs[0] and np.float32(probs[1] + 2.0) == np.float32(probs[0] + 2.0)  # the old tie
    assert np.asarray(g.ranking(z)).tolist() == [2, 3, 1, 0, 7, 6, 4, 5]


@pytest.mark.parametrize("kind, params, words", [
    ("cache-prior", dict(lam=1e300), "lambda"), ("cache-prior", dict(lam=-1e7), "lambda"),
    ("cache-prior", dict(lam=float("inf")), "lambda"), ("max-rank", dict(max_rank=10**23), "max-rank M"),
    ("max-rank", dict(max_rank=-1), "max-rank M"),
])
def test_make_policy_refuses_numbers_the_device_cannot_hold(kind, params, words):
    """The API takes the command lines' ranges: λ = 1e300 became inf in float32, M = 10**23 overflowed int32."""
    with pytest.raises(ValueError, match=words):
        routing.make_policy(kind, 4, **params)
