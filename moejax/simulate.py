"""Simulation mode: the model runs with an expert cache kept as bookkeeping around the router step.

All experts stay on the device; at every MoE layer the router hook calls ``router.router_step`` (one
token) or ``router.route_tokens`` (all tokens of a layer: the layer-parallel path of DESIGN §3), so the
chosen experts, their weights and the cache statistics are exactly what an offloaded run would see.

The router state that flows through the model (and through the decode loop) is one pytree::

    {"cache": CacheState, "routing": RoutingState, "policy": RoutingPolicy}

Everything numeric (λ, J, M, p, h, Δ) is data, so sweeps are ``jax.vmap`` over a stacked policy.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from moejax import cache as cache_lib
from moejax import routing as routing_lib
from moejax.config import ModelConfig
from moejax.gating import Gating
from moejax.model import ForwardOutput, forward, forward_sequential, init_kv
from moejax.router import route_tokens, router_step


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Expert cache: ``size`` as a count ("6") or a fraction of N — of L·N in global scope — ("0.5")."""

    size: str = "0.5"
    scope: str = "layer"  # "layer" | "global"
    eviction: str = "lru"  # lru | lfu | fld | score | least-stale
    init: str = "empty"  # empty | random
    seed: int = 0

    def capacity(self, cfg: ModelConfig) -> int:
        return cache_lib.parse_capacity(self.size, cfg.n_experts, cfg.n_moe_layers, self.scope)


@dataclasses.dataclass(frozen=True)
class CacheRouter:
    """Router hook that routes through the expert cache (static: it holds only the gating)."""

    gating: Gating

    @staticmethod
    def token_sequential(state: dict) -> bool:
        """A global cache couples layers: several tokens must then be routed one at a time."""
        return state["cache"].scope == "global"

    def __call__(self, moe_index: int, z: jax.Array, state: dict):
        cs, rs, policy = state["cache"], state["routing"], state["policy"]
        if z.shape[0] == 1:
            e, w, h, cs, rs = router_step(z[0], cs, rs, policy, self.gating, moe_index)
            e, w, h = e[None], w[None], h[None]
        else:
            e, w, h, cs, rs = route_tokens(z, moe_index, cs, rs, policy, self.gating)
        return e, w, {"cache": cs, "routing": rs, "policy": policy}, {"hits": h}


def init_router_state(cfg: ModelConfig, policy: routing_lib.RoutingPolicy, cache: CacheConfig) -> dict:
    cache_state = cache_lib.init_cache(cfg.n_moe_layers, cfg.n_experts, cache.capacity(cfg), cache.scope,
                                       cache.eviction, cache.init, cache.seed)
    return {"cache": cache_state, "routing": routing_lib.init_routing_state(cfg.n_moe_layers), "policy": policy}


def expert_bytes(params: dict, cfg: ModelConfig) -> int:
    """Bytes one routed expert occupies (what a miss moves)."""
    return cfg.expert_params * jnp.dtype(params["embed"].dtype).itemsize


@functools.partial(jax.jit, static_argnames=("cfg", "router"))
def forward_layer_parallel(params, cfg: ModelConfig, tokens, router, router_state) -> ForwardOutput:
    """Teacher-forced pass: each MoE layer routes all T tokens with one scan over its own cache.
    Exact for per-layer caches (a layer's routing depends only on its logits and its cache)."""
    return forward(params, cfg, tokens, 0, None, router, router_state)


@functools.partial(jax.jit, static_argnames=("cfg", "router"))
def forward_token_sequential(params, cfg: ModelConfig, tokens, router, router_state) -> ForwardOutput:
    """Teacher-forced pass one token at a time through all layers (KV cache), as decoding sees it.
    Needed for global caches, whose layers share one pool."""
    kv = init_kv(cfg, tokens.shape[0], params["embed"].dtype)
    out = forward_sequential(params, cfg, tokens, 0, kv, router, router_state)
    return dataclasses.replace(out, kv=None)


def forward_with_cache(params, cfg: ModelConfig, tokens, router_state: dict, sequential: bool | None = None):
    """Pick the exact path: layer-parallel for per-layer caches, token-sequential for global ones."""
    router = CacheRouter(cfg.gating)
    if sequential is None:
        sequential = router_state["cache"].scope == "global"
    if not sequential and router_state["cache"].scope == "global":
        raise ValueError("a global cache couples layers: it needs the token-sequential path")
    run = forward_token_sequential if sequential else forward_layer_parallel
    return run(params, cfg, tokens, router, router_state)


@functools.partial(jax.jit, static_argnames=("cfg", "sequential"))
def sweep_forward(params, cfg: ModelConfig, tokens, router_state: dict, policies, sequential: bool = False):
    """One vmapped pass over a stacked batch of policies (``routing.stack_policies``), same start state."""
    router = CacheRouter(cfg.gating)
    run = forward_token_sequential if sequential else forward_layer_parallel

    def one(policy):
        out = run(params, cfg, tokens, router, {**router_state, "policy": policy})
        return out.logits, out.experts, out.weights, out.records, out.router_state

    return jax.vmap(one)(policies)


def summarize(router_state: dict, params: dict, cfg: ModelConfig) -> dict:
    """Cache metrics as Python numbers, bytes included."""
    return cache_lib.summarize(router_state["cache"], expert_bytes(params, cfg))
