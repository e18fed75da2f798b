"""The router step: one pure function shared by simulation, offloaded decode, evaluation and replay.

    router_step(z, cache_state, routing_state, policy, gating, layer)
        -> (experts [K] int32, weights [K] f32, hits [K] bool, cache_state', routing_state')

1. fold this token's logit range into the routing state (Δavg for cache-prior);
2. re-rank the experts with the policy, given the layer's cache bitmask as it was after the previous step;
3. chosen = first K of the ranking (the first h-1 for pruning; the rest are -1 with weight 0);
4. weights = the architecture's own weights of the chosen set from the ORIGINAL logits;
5. order the K by weight, highest first (stable), which is also the cache's same-step order;
6. miss handling (``cache_state.miss``: fetch, drop, substitute, cascade) on the low-importance misses;
7. update the cache (hits, misses, loads, evictions, metrics).

Prefetch (``cache_state.prefetcher``): when the caller passes ``z_pred`` — this layer's router applied to
the previous MoE layer's hidden state — the predicted experts are loaded into this layer's cache before it
routes (step 0), and the prediction's precision/recall are counted after step 5. The event order
route(l) → prefetch(l+1) → route(l+1) is the same on the token-sequential and the layer-parallel paths.

``layer`` may be a Python int or a traced int32. With per-layer scope only that layer's row of the cache
is read and written, so ``route_tokens`` (one layer, all T tokens) run layer after layer gives exactly
what the token-sequential loop gives.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from moejax.models.gating import descending_order, fenced_probs, original_routing
from moejax.experts import cache as cache_lib, routing as routing_lib
from moejax.experts.cache import CacheState
from moejax.experts.routing import RoutingPolicy, RoutingState


def choose(z: jax.Array, cache_mask: jax.Array, routing_state: RoutingState, policy: RoutingPolicy,
           gating: Any, layer=0, probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Steps 2-5 without touching any state: (experts [K] highest weight first, -1 = dropped; weights [K];
    valid [K]). ``probs``: ``gating.probs(z)``, computed by a caller that routes many tokens at once."""
    k = gating.top_k
    ranking, n_valid = routing_lib.rerank(z, cache_mask, routing_state, policy, gating, layer)
    valid = jnp.arange(k) < n_valid
    chosen = jnp.where(valid, ranking[:k], -1)
    # The policy picks a SET; weigh it in the original ranking's order, so order-dependent gatings
    # (sparsemixer's c1, c2) see the chosen experts exactly as the architecture would rank them.
    n = z.shape[-1]
    original = gating.ranking(z, routing_lib.layer_bias(routing_state, layer)).astype(jnp.int32)
    original_pos = jnp.zeros((n,), jnp.int32).at[original].set(jnp.arange(n, dtype=jnp.int32))
    by_original = descending_order(-jnp.where(valid, original_pos[jnp.maximum(chosen, 0)], n))
    chosen, valid = chosen[by_original], valid[by_original]
    weights = jnp.where(valid, gating.weights(z, chosen, valid, probs=probs).astype(jnp.float32), 0.0)
    # highest weight first; dropped slots last (weight 0 and marked invalid); ties keep ranking order
    order = descending_order(jnp.where(valid, weights, -jnp.inf))
    return chosen[order], weights[order], valid[order]


def predicted_experts(z_pred: jax.Array, prefetcher: cache_lib.PrefetchConfig, gating: Any, bias=None):
    """The prefetcher's guess for one token: (ids [E] most likely first, valid [E]); ``bias``: the predicted
    layer's selection bias."""
    n = z_pred.shape[-1]
    ranking = gating.ranking(z_pred, bias).astype(jnp.int32)
    count = prefetcher.count(gating.top_k, n)
    if prefetcher.percentile is not None:
        probs = gating.probs(z_pred).astype(jnp.float32)
        threshold = jnp.percentile(probs, prefetcher.percentile)
        return ranking, probs[ranking] > threshold
    return ranking[:count], jnp.ones((count,), bool)


def handle_misses(z: jax.Array, experts: jax.Array, weights: jax.Array, valid: jax.Array, cache_mask: jax.Array,
                  miss: cache_lib.MissConfig, gating: Any, bias=None):
    """Apply the miss handling to the low-importance misses (positions >= ``miss.rank[0]`` not cached).

    Returns (experts, weights, valid, tier [K] (8/4 = served from that low-bit copy, else 0), counts)."""
    k = experts.shape[0]
    n = z.shape[-1]
    pos = jnp.arange(k)
    tier = jnp.zeros((k,), jnp.int32)
    low = valid & ~cache_mask[jnp.maximum(experts, 0)] & (pos >= miss.rank[0])
    if miss.mode == "fetch":
        return experts, weights, valid, tier, {}
    if miss.mode == "drop":
        kept = valid & ~low
        total = jnp.sum(jnp.where(valid, weights, 0.0))
        kept_sum = jnp.sum(jnp.where(kept, weights, 0.0))
        scale = jnp.where(kept_sum > 0, total / jnp.where(kept_sum > 0, kept_sum, 1.0), 0.0)
        weights = jnp.where(kept, weights * scale, 0.0)
        return jnp.where(kept, experts, -1), weights, kept, tier, {"dropped": low.sum()}
    if miss.mode == "substitute":
        original = gating.ranking(z, bias).astype(jnp.int32)
        rank_of = jnp.zeros((n,), jnp.int32).at[original].set(jnp.arange(n, dtype=jnp.int32))
        chosen = jnp.zeros((n + 1,), bool).at[jnp.where(valid, experts, n)].set(True)[:n]
        avail = cache_mask & ~chosen
        done = jnp.zeros((), jnp.int32)
        for j in range(k):  # K is small: unrolled, best-ranked available expert first
            best = jnp.argmin(jnp.where(avail, rank_of, n)).astype(jnp.int32)
            do = low[j] & avail[best]
            experts = experts.at[j].set(jnp.where(do, best, experts[j]))
            avail = avail & ~((jnp.arange(n) == best) & do)
            done = done + do.astype(jnp.int32)
        return experts, weights, valid, tier, {"substituted": done}
    # cascade
    tier = jnp.where(low, jnp.asarray(miss.tier_bits(k), jnp.int32), 0)
    return experts, weights, valid, tier, {}


def prefetch_step(cache_state: CacheState, layer, z_pred: jax.Array, gating: Any, bias=None):
    """Load the prefetcher's guess for ``layer`` (from its router on the previous layer's hidden state; ``bias``:
    that layer's selection bias). Returns (cache_state', prediction = (ids [E], valid [E])) for
    ``router_step(prediction=...)``."""
    pred_ids, pred_valid = predicted_experts(z_pred, cache_state.prefetcher, gating, bias)
    cache_state, _ = cache_lib.prefetch(cache_state, layer, pred_ids, pred_valid)
    return cache_state, (pred_ids, pred_valid)


def _decide(z, cache_state: CacheState, routing_state: RoutingState, policy: RoutingPolicy, gating: Any, layer,
            z_pred, prediction, probs):
    """Steps 0-6 (prefetch, observe, choose, miss handling) and the counts they add; the cache's own update
    (step 7) is the caller's. Returns (experts, weights, valid, tier, counts, cache_state', routing_state')."""
    routing_state = routing_lib.observe(routing_state, layer, z)
    bias = routing_lib.layer_bias(routing_state, layer)
    if z_pred is not None and cache_state.prefetcher.enabled:
        cache_state, prediction = prefetch_step(cache_state, layer, z_pred, gating, bias)
    mask = cache_lib.resident_mask(cache_state, layer)
    experts, weights, valid = choose(z, mask, routing_state, policy, gating, layer, probs)
    experts, weights, valid, tier, counts = handle_misses(z, experts, weights, valid, mask, cache_state.miss, gating,
                                                          bias)
    if prediction is not None:
        pred_ids, pred_valid = prediction
        used = pred_valid & jnp.isin(pred_ids, jnp.where(valid, experts, -1))
        counts = {**counts, "predicted": pred_valid.sum(), "predicted_used": used.sum(),
                  "predicted_for": valid.sum()}
    return experts, weights, valid, tier, counts, cache_state, routing_state


def router_step(z: jax.Array, cache_state: CacheState, routing_state: RoutingState, policy: RoutingPolicy,
                gating: Any, layer=0, *, z_pred: jax.Array | None = None, prediction=None,
                with_tier: bool = False, probs: jax.Array | None = None):
    """Route one token at one MoE layer and update both states (module docstring). Belady needs the
    future, so it is not an online eviction here: replay it over a recorded trace (``trace.replay``).

    ``prediction`` instead of ``z_pred``: the prefetch was already applied (``prefetch_step``, by an
    offloader that starts the transfers early); only its precision/recall are counted here.
    Returns (experts, weights, hits, cache_state', routing_state'), with ``tier`` [K] after hits when
    ``with_tier`` (the precision each chosen expert is computed at: 0 full, 8 / 4 low-bit copy).
    ``probs``: ``gating.probs(z)`` when the caller computed it for all its tokens at once (``route_tokens``):
    the weights are then bit-identical to the plain batched pass's."""
    experts, weights, valid, tier, counts, cache_state, routing_state = _decide(
        z, cache_state, routing_state, policy, gating, layer, z_pred, prediction, probs)
    cache_state, hits = cache_lib.access(cache_state, layer, experts, weights, valid, tier=tier)
    if counts:
        cache_state = cache_lib.count(cache_state, layer, **counts)
    if with_tier:
        return experts, weights, hits, tier, cache_state, routing_state
    return experts, weights, hits, cache_state, routing_state


def router_step_deferred(z: jax.Array, cache_state: CacheState, routing_state: RoutingState, policy: RoutingPolicy,
                         gating: Any, layer, *, z_pred: jax.Array | None = None):
    """``router_step`` of one token at a per-layer cache, with the cache's update left for later: the rows of a
    per-layer cache never read one another, so a token's updates at its L layers can all wait until after its
    last layer and run as one update of every row (``cache.access_layers``), which the program then holds once
    instead of once per layer (the cache-routed decode program compiled about twice as fast: ``python
    bench/bench_fixed_costs.py --parts start``). Same decisions, same state afterwards.

    Returns (experts, weights, hits, tier, pending, cache_state', routing_state'); ``pending`` = (experts,
    weights, valid, tier) for ``cache.access_layers``."""
    if cache_state.scope != "layer":
        raise ValueError("only a per-layer cache can update its layers after the token's last layer")
    experts, weights, valid, tier, counts, cache_state, routing_state = _decide(
        z, cache_state, routing_state, policy, gating, layer, z_pred, None, None)
    if counts:
        cache_state = cache_lib.count(cache_state, layer, **counts)
    hits = cache_lib.hits(cache_state, layer, experts, valid)
    return experts, weights, hits, tier, (experts, weights, valid, tier), cache_state, routing_state


def route_tokens(z: jax.Array, layer, cache_state: CacheState, routing_state: RoutingState,
                 policy: RoutingPolicy, gating: Any, *, z_pred: jax.Array | None = None, with_tier: bool = False,
                 probs: jax.Array | None = None):
    """``lax.scan`` of ``router_step`` over T tokens of ONE layer (the layer-parallel path; per-layer scope).

    z: [T, N]; z_pred: [T, N] predicted logits for prefetch (optional); probs: ``gating.probs(z)`` if the
    caller has it (computed here otherwise). Returns (experts [T, K],
    weights [T, K], hits [T, K], cache_state', routing_state'), with tier [T, K] after hits if ``with_tier``.
    """
    if cache_state.scope != "layer":
        raise ValueError("route_tokens is the layer-parallel path and needs a per-layer cache; "
                         "global caches couple layers and must be routed token by token")
    # the scan routes a one-layer row view as "layer 0": a learned prior is sliced to the true layer's row too
    policy = routing_lib.policy_row(policy, layer, routing_state.delta_sum.shape[0])

    def step(carry, inputs):
        cs, rs = carry
        z_t, zp_t, p_t = inputs
        experts, weights, hits, tier, cs, rs = router_step(z_t, cs, rs, policy, gating, 0, z_pred=zp_t,
                                                           with_tier=True, probs=p_t)
        return (cs, rs), (experts, weights, hits, tier)

    # carry only this layer's row through the scan (a one-layer cache), written back once at the end:
    # slicing and rewriting the whole [L, N] state at every token cost ~60 % more per step
    row = cache_lib.row_view(cache_state, layer)
    row_rs = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, layer, 1), routing_state)
    # the probabilities of all T tokens at once, as the plain pass computes them: a softmax of one [N] row
    # inside the scan sums in another order, and λ = 0 differed from original routing in the last bits
    if probs is None:
        probs = fenced_probs(gating, z)
    (row, row_rs), (experts, weights, hits, tier) = lax.scan(step, (row, row_rs), (z, z_pred, probs))
    cache_state = cache_lib.write_row(cache_state, row, layer)
    routing_state = jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b, layer, 0), routing_state, row_rs)
    if with_tier:
        return experts, weights, hits, tier, cache_state, routing_state
    return experts, weights, hits, cache_state, routing_state


def route_sequence(z: jax.Array, cache_state: CacheState, routing_state: RoutingState, policy: RoutingPolicy,
                   gating: Any):
    """Token-sequential routing of precomputed logits z [T, L, N] (any scope): token t, layers 0..L-1.

    Returns (experts [T, L, K], weights [T, L, K], hits [T, L, K], cache_state', routing_state').
    """
    n_layers = z.shape[1]

    def token(carry, z_t):
        def layer_step(carry, inputs):
            cs, rs = carry
            layer, z_tl = inputs
            experts, weights, hits, cs, rs = router_step(z_tl, cs, rs, policy, gating, layer)
            return (cs, rs), (experts, weights, hits)

        return lax.scan(layer_step, carry, (jnp.arange(n_layers, dtype=jnp.int32), z_t))

    (cache_state, routing_state), out = lax.scan(token, (cache_state, routing_state), z)
    return (*out, cache_state, routing_state)


def route_layers_parallel(z: jax.Array, cache_state: CacheState, routing_state: RoutingState,
                          policy: RoutingPolicy, gating: Any):
    """Per-layer scope on precomputed logits z [T, L, N]: the layers are independent, so vmap the per-layer
    token scan over layers. Same outputs and states as ``route_sequence``, much faster."""
    split_cs = cache_lib.split_layers(cache_state)
    split_rs = jax.tree.map(lambda a: a[:, None], routing_state)
    routing_lib.check_policy_layers(policy, routing_state.delta_sum.shape[0])
    split = routing_lib.split_policy_layers(policy)  # a learned prior's rows, a per-layer Δ go with their layer

    def one_layer(z_l, p_l, cs, rs, per_layer):
        return route_tokens(z_l, 0, cs, rs, policy.replace(**per_layer), gating, probs=p_l)

    # all layers' probabilities at once, outside the vmap: inside it, the softmax's summation order followed
    # the layout XLA picked for the batched program, and a vmap over policies differed in the last bit
    probs = fenced_probs(gating, z)
    experts, weights, hits, cs, rs = jax.vmap(one_layer, in_axes=(1, 1, 0, 0, 0), out_axes=(1, 1, 1, 0, 0))(
        z, probs, split_cs, split_rs, split)
    return experts, weights, hits, cache_lib.merge_layers(cs), jax.tree.map(lambda a: a[:, 0], rs)


def route_no_cache(z: jax.Array, gating: Any, bias=None) -> tuple[jax.Array, jax.Array]:
    """Original routing with no cache at all: (experts [..., K] highest weight first, weights [..., K])."""
    return original_routing(gating, z, bias)
