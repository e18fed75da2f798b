"""Simulation mode: the model runs with an expert cache kept as bookkeeping around the router step.

All experts stay on the device; at every MoE layer the router hook calls ``router.router_step`` (one
token) or ``router.route_tokens`` (all tokens of a layer: the layer-parallel path of docs/design.md §3), so the
chosen experts, their weights and the cache statistics are exactly what an offloaded run would see.

The router state that flows through the model (and through the decode loop) is one pytree::

    {"cache": CacheState, "routing": RoutingState, "policy": RoutingPolicy}

Everything numeric (λ, J, M, p, h, Δ) is data, so sweeps are ``jax.vmap`` over a stacked policy.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from moejax.base import distributed, seeds
from moejax.base.typecheck import is_integer, is_number
from moejax.models import layout, model as model_lib, quant, weights
from moejax.models import moe as moe_lib
from moejax.models import ops as ops_lib
from moejax.models.config import ModelConfig
from moejax.models.gating import Gating
from moejax.models.model import ForwardOutput, forward, forward_sequential
from moejax.models.attention import init_kv
from moejax.models.moe import routed_experts
from moejax.experts import cache as cache_lib, routing as routing_lib
from moejax.experts import cache_metrics
from moejax.experts import capacity as capacity_lib
from moejax.experts.router import route_tokens, router_step, router_step_deferred
from moejax.runtime import prefill_paging


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Expert cache: ``size`` as a count ("6"), a fraction of N — of L·N in global scope — ("0.5"), or the
    memory the cached experts may occupy in all ("6GiB": ``capacity.parse_capacity``; ``Model.resolve_cache``
    turns it into a count for that model's experts, device slots when offloading).

    Miss handling (``miss``, ``miss_rank``, ``cascade_bits``, ``quant_group``: ``cache.MissConfig``) and
    speculative prefetch (``prefetch`` overfetch factor or ``prefetch_percentile``: ``cache.PrefetchConfig``)
    are part of the cache: they change what is loaded, and for the lossy miss modes what is computed."""

    size: str = "0.5"
    scope: str = "layer"  # "layer" | "global"
    eviction: str = "lru"  # lru | lfu | fld | score | least-stale
    init: str = "empty"  # empty | random
    seed: int = 0
    miss: str = "fetch"  # fetch | drop | substitute | cascade
    miss_rank: tuple = (1,)
    cascade_bits: tuple = (8,)
    quant_group: int | None = None
    prefetch: float = 0.0
    prefetch_percentile: float | None = None
    memory: str | None = None  # the memory size ("6GiB") that ``size`` was resolved from, for the records
    # ``Model.resolve_cache`` checked these slots against the free memory: later calls of the same run do not
    # measure again (the slots they would count may already be allocated, e.g. a server's kept slots)
    fit_checked: bool = False

    def __post_init__(self):
        """Refuse what no model could run, when the config is made (the size's form here, its value per model)."""
        for name, value, allowed in (("scope", self.scope, cache_lib.SCOPES),
                                     ("eviction", self.eviction, cache_lib.EVICTIONS),
                                     ("init", self.init, cache_lib.INITS)):
            if value not in allowed:
                raise ValueError(f"CacheConfig {name} {value!r}: expected one of {', '.join(allowed)}")
        if not (isinstance(self.size, str) or is_number(self.size)):
            raise TypeError(f"CacheConfig size must be a count, a fraction of N or a memory size (a string such "
                            f"as '4', '0.5' or '6GiB'), got {type(self.size).__name__} {self.size!r}")
        capacity_lib.check_size(self.size)
        if not is_integer(self.seed):
            raise TypeError(f"CacheConfig seed must be an integer, got {self.seed!r}")
        seeds.check_seed(int(self.seed))
        self.miss_config(), self.prefetch_config()  # their own checks (miss ranks, bit widths, group, percentile)

    def capacity(self, cfg: ModelConfig, expert_bytes: int | None = None) -> int:
        """Slots per layer (per pool in global scope); a memory size needs ``expert_bytes``, one expert's.
        Also checks the miss ranks against this model's K."""
        if self.miss != "fetch" and max(self.miss_rank) >= cfg.top_k:
            raise ValueError(f"miss rank {max(self.miss_rank)} is past the last of the K={cfg.top_k} experts a token "
                             f"uses (positions 0..{cfg.top_k - 1}): no miss would be handled by {self.miss!r}")
        return capacity_lib.parse_capacity(self.size, cfg.n_experts, cfg.n_moe_layers, self.scope, expert_bytes)

    def miss_config(self) -> cache_lib.MissConfig:
        return cache_lib.MissConfig(self.miss, self.miss_rank, self.cascade_bits, self.quant_group)

    def prefetch_config(self) -> cache_lib.PrefetchConfig:
        return cache_lib.PrefetchConfig(float(self.prefetch), self.prefetch_percentile)


def lowbit_experts(p: dict, ids: jax.Array | None, bits: int, group_size: int | None) -> dict:
    """The routed experts as their ``bits`` copy would compute (quantise, dequantise); ``ids`` [K] gathers
    first (one token), None keeps all N. Quantisation is per expert, so gathering first is the same."""

    if "experts" in p:  # serving layout: canonical stacks of the experts needed
        p = layout.canonical_experts(p["experts"]) if ids is None else layout.gather_experts(p["experts"], ids)
        ids = None
    out = {}
    for name in ("gate", "up", "down"):
        w = p[name] if ids is None else p[name][ids]
        out[name] = quant.dequantize(quant.quantize(w, bits, group_size), w.dtype)
    return out


def compute_tiers(p: dict, cfg: ModelConfig, h, experts, weights, tier, miss: cache_lib.MissConfig):
    """Routed experts where ``tier`` [T, K] says which are computed from a low-bit copy (cascade)."""
    y = routed_experts(p, cfg, h, jnp.where(tier == 0, experts, -1), jnp.where(tier == 0, weights, 0.0))
    biases = moe_lib.expert_biases(p) or {}  # GPT-OSS's stay full precision, by the real expert ids
    for bits in sorted(set(miss.bits)):
        sel = tier == bits
        if h.shape[0] == 1:  # gather the K experts, then quantise them: ids are 0..K-1 in the copy
            low = {**lowbit_experts(p, jnp.maximum(experts[0], 0), bits, miss.group_size), **biases}
            ids = jnp.where(sel, jnp.arange(experts.shape[1])[None], -1)
            y = y + routed_experts(low, cfg, h, ids, jnp.where(sel, weights, 0.0), bias_ids=experts)
        else:
            low = {**lowbit_experts(p, None, bits, miss.group_size), **biases}
            y = y + routed_experts(low, cfg, h, jnp.where(sel, experts, -1), jnp.where(sel, weights, 0.0))
    return y


def _record(cache_state: cache_lib.CacheState, hits, tier) -> dict:
    """What a cache router reports per MoE layer: the hits, and under cascade miss handling the tiers."""
    return {"hits": hits, "tier": tier} if cache_state.miss.mode == "cascade" else {"hits": hits}


@dataclasses.dataclass(frozen=True)
class CacheRouter:
    """Router hook that routes through the expert cache (static: it holds only the gating)."""

    gating: Gating

    @staticmethod
    def token_sequential(state: dict) -> bool:
        """A global cache couples layers: several tokens must then be routed one at a time."""
        return state["cache"].scope == "global"

    @staticmethod
    def wants_prediction(state: dict) -> bool:
        return state["cache"].prefetcher.enabled

    def __call__(self, moe_index: int, z: jax.Array, state: dict, z_pred: jax.Array | None = None):
        cs, rs, policy = state["cache"], state["routing"], state["policy"]
        if z.shape[0] == 1:
            e, w, h, tier, cs, rs = router_step(z[0], cs, rs, policy, self.gating, moe_index,
                                                z_pred=None if z_pred is None else z_pred[0], with_tier=True)
            e, w, h, tier = e[None], w[None], h[None], tier[None]
        else:
            e, w, h, tier, cs, rs = route_tokens(z, moe_index, cs, rs, policy, self.gating, z_pred=z_pred,
                                                 with_tier=True)
        return e, w, {**state, "cache": cs, "routing": rs}, _record(cs, h, tier)

    @staticmethod
    def defers_access(state: dict, tokens: int) -> bool:
        """One token at a per-layer cache: its cache updates wait for the last layer (``route_deferred``)."""
        return tokens == 1 and state["cache"].scope == "layer"

    def route_deferred(self, moe_index: int, z: jax.Array, state: dict, z_pred: jax.Array | None = None):
        """``__call__`` for one token with the cache's update left to ``access_all`` (``router_step_deferred``):
        returns (experts, weights, state', record, pending)."""
        e, w, h, tier, pending, cs, rs = router_step_deferred(z[0], state["cache"], state["routing"], state["policy"],
                                                              self.gating, moe_index,
                                                              z_pred=None if z_pred is None else z_pred[0])
        return e[None], w[None], {**state, "cache": cs, "routing": rs}, _record(cs, h[None], tier[None]), pending

    @staticmethod
    def access_all(state: dict, pending: list) -> dict:
        """The cache updates ``route_deferred`` left, for all MoE layers at once (``cache.access_layers``)."""
        experts, weights, valid, tier = (jnp.stack(parts) for parts in zip(*pending))
        return {**state, "cache": cache_lib.access_layers(state["cache"], experts, weights, valid, tier)}

    @staticmethod
    def compute(moe_index, p, cfg, h, experts, weights, record, state):
        return expert_output(p, cfg, h, experts, weights, record.get("tier"), state["cache"].miss), state


def expert_output(p: dict, cfg: ModelConfig, h, experts, weights, tier, miss: cache_lib.MissConfig):
    """The routed experts' output under ``miss`` handling: cascade serves the ``tier`` misses from low-bit
    copies (``compute_tiers``); every other mode computes the chosen experts as they are."""
    if miss.mode != "cascade":
        return routed_experts(p, cfg, h, experts, weights)
    return compute_tiers(p, cfg, h, experts, weights, tier, miss)


def init_router_state(cfg: ModelConfig, policy: routing_lib.RoutingPolicy, cache: CacheConfig,
                      bias=None) -> dict:
    """A fresh router state; ``bias``: the model's selection biases (``model.selection_biases``; DeepSeek-V3,
    GLM-4.5, dots.llm1, ERNIE-4.5)."""
    model_lib.require_selection_biases(cfg, bias)
    cache_state = cache_lib.init_cache(cfg.n_moe_layers, cfg.n_experts, cache.capacity(cfg), cache.scope,
                                       cache.eviction, cache.init, cache.seed, cache.miss_config(),
                                       cache.prefetch_config())
    return {"cache": cache_state, "routing": routing_lib.init_routing_state(cfg.n_moe_layers, bias), "policy": policy}


def expert_bytes(params: dict, cfg: ModelConfig) -> int:
    """Bytes one routed expert occupies (what a miss moves): int8 experts count their values and scales
    (in memory, or stored int8 in the files an offloaded model pages from)."""
    for lp in params["layers"]:
        moe = lp.get("moe", {})
        experts = moe.get("experts")
        if isinstance(experts, layout.ExpertList) and layout.is_int8(experts.gate_up[0]):
            return layout.matrix_nbytes(experts.gate_up[0]) + layout.matrix_nbytes(experts.down[0])
        if weights.is_int8_stack(moe.get("gate")):
            return sum(moe[k].stored_expert_nbytes for k in layout.EXPERT_MATRICES)
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


def forward_with_cache(params, cfg: ModelConfig, tokens, router_state: dict, sequential: bool | None = None,
                       route_on_host: bool | None = None):
    """Pick the exact path: layer-parallel for per-layer caches, token-sequential for global ones.
    ``route_on_host`` (None: when the model is not on the CPU) runs the layer-parallel path with each
    layer's routing scan on the host CPU (``forward_routed_on_host``)."""
    router = CacheRouter(cfg.gating)
    if sequential is None:
        sequential = router_state["cache"].scope == "global"
    if not sequential and router_state["cache"].scope == "global":
        raise ValueError("a global cache couples layers: it needs the token-sequential path")
    if route_on_host is None:
        device = _single_device(params)
        route_on_host = not sequential and device is not None and device.platform != "cpu"
    if route_on_host:
        if sequential:
            raise ValueError("routing on the host is the layer-parallel path (per-layer caches)")
        return forward_routed_on_host(params, cfg, tokens, router_state)
    run = forward_token_sequential if sequential else forward_layer_parallel
    return run(params, cfg, tokens, router, router_state)


# ------------------------------------------------------------------------------ routing on the host CPU


def _single_device(params) -> jax.Device | None:
    """The one device the model's weights are on (this process's first if not placed yet); None when they
    are spread over several (expert parallelism: the one-program pass, whose programs span the mesh)."""
    embed = params["embed"]
    devices = embed.devices() if isinstance(embed, jax.Array) else {distributed.local_device()}
    return next(iter(devices)) if len(devices) == 1 else None


@functools.partial(jax.jit, static_argnames=("cfg", "layer"))
def _attend_and_route_logits(lp, next_lp, cfg: ModelConfig, layer: int, x):
    """A MoE layer's attention (teacher-forced, no KV cache), the hidden state its router and experts read,
    its router logits, and with ``next_lp`` the next MoE layer's prediction from this state (prefetch)."""
    x, _ = prefill_paging.attention(lp, cfg, layer, x, 0, None)
    h = ops_lib.norm(x, lp["mlp_norm"], cfg)
    z_next = None
    if next_lp is not None:
        z_next = moe_lib.router_logits(next_lp["moe"], ops_lib.norm(x, next_lp["mlp_norm"], cfg))
    return x, h, moe_lib.router_logits(lp["moe"], h), z_next


@functools.partial(jax.jit, static_argnames=("router",))
def _route_layer(router: CacheRouter, moe_index, z, state: dict, z_pred):
    """The one-program pass's router hook, alone (on the host): (experts, weights, state, record)."""
    return router(moe_index, z, state, z_pred=z_pred)


@functools.partial(jax.jit, static_argnames=("cfg", "miss"))
def _experts_and_residual(p, cfg: ModelConfig, x, h, experts, weights, tier, miss):
    y = expert_output(p, cfg, h, experts, weights, tier, miss)
    if "shared" in p:
        y = y + moe_lib.shared_experts(p, cfg, h)
    return model_lib.residual(cfg, x, y)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(table, cfg: ModelConfig, tokens):
    return model_lib.embed_scaled({"embed": table}, cfg, tokens)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(head: dict, cfg: ModelConfig, x):
    return model_lib.output_logits(head, cfg, ops_lib.norm(x, head["final_norm"], cfg))


def forward_routed_on_host(params, cfg: ModelConfig, tokens, router_state: dict,
                           host: jax.Device | None = None) -> ForwardOutput:
    """``forward_layer_parallel`` a layer at a time, each layer's routing scan on the host CPU (``host``).

    The scan routes a layer's T tokens one after another (each with the cache the one before left): on an
    H200 its small per-token steps cost ~75 µs each as GPU kernels, ~9 µs on one CPU core, so the
    teacher-forced cache pass spent 1.2 s of 1.6 s a 1,024-token chunk (16 layers) routing
    (``bench/bench_teacher_forced.py`` on the GPU).
    Here the accelerator runs attention, router logits and experts; each layer's logits [T, N] go to the
    host, the cache and router state stay there, the chosen experts and weights come back. Same routing,
    statistics and state as the one-program pass (the scan is the same function); logits agree up to the
    rounding of differently fused programs. The router state comes back on the model's device (a few KB),
    where the one-program pass leaves it, so decoding or another pass can continue from it."""
    host = host or jax.devices("cpu")[0]
    device = _single_device(params)
    if device is None:
        raise ValueError("routing on the host needs the model on one device (its experts are spread over several)")
    state = jax.device_put(router_state, host)
    router, miss = CacheRouter(cfg.gating), state["cache"].miss
    predict = bool(state["cache"].prefetcher.enabled)
    programs = prefill_paging.layer_programs(cfg)
    moe_ids = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
    x = _embed(params["embed"], cfg, jax.device_put(jnp.asarray(tokens, jnp.int32), device))
    zs, es, ws, recs = [], [], [], []
    z_pred, moe_index = None, 0
    for i, lp in enumerate(params["layers"]):
        if not cfg.moe_layers[i]:
            x, _ = prefill_paging.dense_layer(lp, cfg, programs[i], x, 0, None)
            continue
        nxt = params["layers"][moe_ids[moe_index + 1]] if predict and moe_index + 1 < len(moe_ids) else None
        x, h, z, z_next = _attend_and_route_logits(lp, nxt, cfg, programs[i], x)
        e, w, state, record = _route_layer(router, jax.device_put(jnp.int32(moe_index), host),
                                           jax.device_put(z, host), state, z_pred)
        e_dev, w_dev, tier_dev = jax.device_put((e, w, record.get("tier")), device)
        x = _experts_and_residual(lp["moe"], cfg, x, h, e_dev, w_dev, tier_dev, miss)
        z_pred = None if z_next is None else jax.device_put(z_next, host)
        zs.append(z), es.append(e), ws.append(w), recs.append(record)
        moe_index += 1
    head = {k: params[k] for k in ("final_norm", "lm_head", "lm_head_bias", "embed", layout.TIED_INT8_HEAD)
            if k in params}
    return ForwardOutput(
        logits=_logits(head, cfg, x),
        router_logits=jnp.stack(zs) if zs else jnp.zeros((0, len(tokens), cfg.n_experts)),
        experts=jnp.stack(es) if es else jnp.zeros((0, len(tokens), cfg.top_k), jnp.int32),
        weights=jnp.stack(ws) if ws else jnp.zeros((0, len(tokens), cfg.top_k)),
        records=jax.tree.map(lambda *r: jnp.stack(r), *recs) if recs else {}, kv=None,
        router_state=jax.device_put(state, device))


@functools.partial(jax.jit, static_argnames=("cfg", "sequential"))
def sweep_forward(params, cfg: ModelConfig, tokens, router_state: dict, policies, sequential: bool = False):
    """One vmapped pass over a stacked batch of policies (``routing.stack_policies``), same start state."""
    router = CacheRouter(cfg.gating)
    run = forward_token_sequential if sequential else forward_layer_parallel

    def one(policy):
        out = run(params, cfg, tokens, router, {**router_state, "policy": policy})
        return out.logits, out.experts, out.weights, out.records, out.router_state

    return jax.vmap(one)(policies)


def lowbit_expert_bytes(cfg: ModelConfig, bits: int, group_size: int | None, dtype=jnp.float32) -> int:
    """Real stored bytes of one expert's ``bits`` copy (values + scales), from ``quant``'s layout."""

    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"gate": (1, d, f), "up": (1, d, f), "down": (1, f, d)}
    q = {k: jax.eval_shape(lambda s=s: quant.quantize(jnp.zeros(s, dtype), bits, group_size)) for k, s in shapes.items()}
    return quant.expert_nbytes(q)


def summarize(router_state: dict, params: dict, cfg: ModelConfig) -> dict:
    """Cache metrics as Python numbers, bytes included (low-bit loads at their real size)."""
    cs = router_state["cache"]
    low = None
    if cs.miss.mode == "cascade":
        low = {b: lowbit_expert_bytes(cfg, b, cs.miss.group_size, params["embed"].dtype) for b in cs.miss.bits}
    return cache_metrics.summarize(cs, expert_bytes(params, cfg), low_bit_bytes=low)
