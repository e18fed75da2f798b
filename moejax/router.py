"""The router step: one pure function shared by simulation, offloaded decode, evaluation and replay.

    router_step(z, cache_state, routing_state, policy, gating, layer)
        -> (experts [K] int32, weights [K] f32, hits [K] bool, cache_state', routing_state')

1. fold this token's logit range into the routing state (Δavg for cache-prior);
2. re-rank the experts with the policy, given the layer's cache bitmask as it was after the previous step;
3. chosen = first K of the ranking (the first h-1 for pruning; the rest are -1 with weight 0);
4. weights = the architecture's own weights of the chosen set from the ORIGINAL logits;
5. order the K by weight, highest first (stable), which is also the cache's same-step order;
6. update the cache (hits, misses, loads, evictions, metrics).

``layer`` may be a Python int or a traced int32. With per-layer scope only that layer's row of the cache
is read and written, so ``route_tokens`` (one layer, all T tokens) run layer after layer gives exactly
what the token-sequential loop gives.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from moejax import cache as cache_lib
from moejax import routing as routing_lib
from moejax.cache import CacheState
from moejax.gating import descending_order, original_routing
from moejax.routing import RoutingPolicy, RoutingState


def choose(z: jax.Array, cache_mask: jax.Array, routing_state: RoutingState, policy: RoutingPolicy,
           gating: Any, layer=0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Steps 2-5 without touching any state: (experts [K] highest weight first, -1 = dropped; weights [K];
    valid [K])."""
    k = gating.top_k
    ranking, n_valid = routing_lib.rerank(z, cache_mask, routing_state, policy, gating, layer)
    valid = jnp.arange(k) < n_valid
    chosen = jnp.where(valid, ranking[:k], -1)
    # The policy picks a SET; weigh it in the original ranking's order, so order-dependent gatings
    # (sparsemixer's c1, c2) see the chosen experts exactly as the architecture would rank them.
    n = z.shape[-1]
    original = gating.ranking(z).astype(jnp.int32)
    original_pos = jnp.zeros((n,), jnp.int32).at[original].set(jnp.arange(n, dtype=jnp.int32))
    by_original = descending_order(-jnp.where(valid, original_pos[jnp.maximum(chosen, 0)], n))
    chosen, valid = chosen[by_original], valid[by_original]
    weights = jnp.where(valid, gating.weights(z, chosen, valid).astype(jnp.float32), 0.0)
    # highest weight first; dropped slots last (weight 0 and marked invalid); ties keep ranking order
    order = descending_order(jnp.where(valid, weights, -jnp.inf))
    return chosen[order], weights[order], valid[order]


def router_step(z: jax.Array, cache_state: CacheState, routing_state: RoutingState, policy: RoutingPolicy,
                gating: Any, layer=0):
    """Route one token at one MoE layer and update both states (module docstring). Belady needs the
    future, so it is not an online eviction here: replay it over a recorded trace (``trace.replay``)."""
    routing_state = routing_lib.observe(routing_state, layer, z)
    mask = cache_lib.resident_mask(cache_state, layer)
    experts, weights, valid = choose(z, mask, routing_state, policy, gating, layer)
    cache_state, hits = cache_lib.access(cache_state, layer, experts, weights, valid)
    return experts, weights, hits, cache_state, routing_state


def route_tokens(z: jax.Array, layer, cache_state: CacheState, routing_state: RoutingState,
                 policy: RoutingPolicy, gating: Any):
    """``lax.scan`` of ``router_step`` over T tokens of ONE layer (the layer-parallel path; per-layer scope).

    z: [T, N]. Returns (experts [T, K], weights [T, K], hits [T, K], cache_state', routing_state').
    """
    if cache_state.scope != "layer":
        raise ValueError("route_tokens is the layer-parallel path and needs a per-layer cache; "
                         "global caches couple layers and must be routed token by token")
    # the scan routes a one-layer row view as "layer 0": a learned prior is sliced to the true layer's row too
    policy = routing_lib.policy_row(policy, layer, routing_state.delta_sum.shape[0])

    def step(carry, z_t):
        cs, rs = carry
        experts, weights, hits, cs, rs = router_step(z_t, cs, rs, policy, gating, 0)
        return (cs, rs), (experts, weights, hits)

    # carry only this layer's row through the scan (a one-layer cache), written back once at the end:
    # slicing and rewriting the whole [L, N] state at every token cost ~60 % more per step
    row = cache_lib.row_view(cache_state, layer)
    row_rs = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, layer, 1), routing_state)
    (row, row_rs), (experts, weights, hits) = lax.scan(step, (row, row_rs), z)
    cache_state = cache_lib.write_row(cache_state, row, layer)
    routing_state = jax.tree.map(lambda a, b: lax.dynamic_update_slice_in_dim(a, b, layer, 0), routing_state, row_rs)
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
    split_prior = routing_lib.split_policy_prior(policy)  # a learned prior's rows go with their layer

    def one_layer(z_l, cs, rs, prior):
        return route_tokens(z_l, 0, cs, rs, policy.replace(prior=prior), gating)

    experts, weights, hits, cs, rs = jax.vmap(one_layer, in_axes=(1, 0, 0, 0), out_axes=(1, 1, 1, 0, 0))(
        z, split_cs, split_rs, split_prior)
    return experts, weights, hits, cache_lib.merge_layers(cs), jax.tree.map(lambda a: a[:, 0], rs)


def route_no_cache(z: jax.Array, gating: Any) -> tuple[jax.Array, jax.Array]:
    """Original routing with no cache at all: (experts [..., K] highest weight first, weights [..., K])."""
    return original_routing(gating, z)
