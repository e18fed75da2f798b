"""Offloaded prefill, a layer at a time: every prompt token of a MoE layer at once, each expert paged once.

Host-driven paging of one token at a time (``host_paging.HostPager.step``) pays a host round trip per token
and MoE layer, pages an expert every time the cache misses it, and multiplies each expert by one row: at
Qwen1.5-MoE shapes a prompt cost 0.15–0.27 s per token. A prefill here runs a piece of the prompt (T tokens)
through each MoE layer together, as the simulation's prefill does (the layer-parallel path of docs/design.md §3):

1. attention, router logits and the cache's routing scan over the T tokens (``router.route_tokens``: each
   token routes with the cache state the one before it left, so routing, misses, loads and every cache
   statistic are the simulation's, token for token);
2. each expert the layer's tokens use comes to the device once and runs on all of its tokens
   (``plan_layer``): the ones resident before the piece straight from their slots; then the slots are paged
   to what the cache holds after the piece; the rest (used, but resident neither before nor after) stream
   through K staging buffers;
3. the per-assignment rows are summed per token in the order the simulation's one-call dispatch sums them
   (``model.combine_expert_rows``). Routing and tokens are the simulation's (tested); logits agree up to the
   rounding of differently fused programs (~1e-6 in float32), as the token path's do.

A piece moves each expert it needs at most once per layer, where the token path moves one per miss; the
slots end exactly as the cache state says, so decoding continues as usual. This covers per-layer caches with
fetch, drop and substitute miss handling and prefetch; a global cache (its layers share one pool, so a token
must pass through every layer before the next routes) and cascade miss handling (transient low-bit copies
per token) take the token path (``batched_prefill_supported``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models import layout, model as model_lib
from moejax.models import attention as attention_lib
from moejax.models import moe as moe_lib
from moejax.models import ops as ops_lib
from moejax.models.config import ModelConfig
from moejax.experts.router import route_tokens

PREFILLS = ("batched", "token")
RECORD_NAMES = ("experts", "weights", "hits", "router_logits")  # what a pass records per MoE layer and token
MAX_PIECE = 512  # prompt tokens per batched piece (attention scores and activations grow with it; llama.cpp's ubatch)


def batched_prefill_supported(cache_state) -> str | None:
    """Why a prompt under this cache must be paged token by token, or None when it can run batched."""
    if cache_state.scope == "global":
        return "a global cache couples the layers (each token passes every layer before the next routes)"
    if cache_state.miss.mode == "cascade":
        return "cascade miss handling computes transient low-bit copies token by token"
    return None


def prefill_pieces(n: int, bucketed: bool) -> list[int]:
    """Piece lengths for an ``n``-token prompt: ``decode.prompt_pieces``'s powers of two when ``bucketed``
    (few programs for every length), else one piece; no piece longer than ``MAX_PIECE``."""
    whole, rest = divmod(int(n), MAX_PIECE)
    tail = [1 << b for b in reversed(range(rest.bit_length())) if rest >> b & 1] if bucketed else [rest] * bool(rest)
    return [MAX_PIECE] * whole + tail


# ------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class LayerPages:
    """How one MoE layer's experts reach the device for a piece of the prompt.

    ``resident``: used experts in a slot before the piece (computed first, from the slots as they were);
    ``loads``: (expert, slot) pages that bring the slots to the cache's state after the piece;
    ``paged``: used experts computed from their slot after those loads; ``streamed``: used experts in no slot
    before or after, paged through the staging buffers."""

    resident: dict
    loads: tuple
    paged: dict
    streamed: tuple

    @property
    def pages(self) -> int:
        return len(self.loads) + len(self.streamed)


def plan_layer(before: np.ndarray, after: np.ndarray, experts: np.ndarray) -> LayerPages:
    """``before`` / ``after``: the layer's slot table ([N], -1 = not resident) around the piece; ``experts``:
    the ids its tokens use (any shape, < 0 = none). Every used expert is computed exactly once, and each
    page is one the token-by-token cache also made (the slot of a load is one the cache filled; a streamed
    expert was missed at least once), so a piece never moves more than the token path."""
    used = np.unique(experts[experts >= 0]).tolist()
    resident = {e: int(before[e]) for e in used if before[e] >= 0}
    loads = tuple((int(e), int(after[e])) for e in np.nonzero((after >= 0) & (after != before))[0])
    paged = {e: int(after[e]) for e in used if e not in resident and after[e] >= 0}
    streamed = tuple(e for e in used if e not in resident and e not in paged)
    return LayerPages(resident, loads, paged, streamed)


def rounds(plan: LayerPages, staging: int) -> list[tuple[dict, tuple, bool]]:
    """The layer's compute rounds as (experts in the slots -> slot, experts through the staging buffers,
    whether the loads go into the slots before this round); empty rounds left out, the loads always made."""
    groups = [plan.streamed[i:i + staging] for i in range(0, len(plan.streamed), staging)]
    out = [(plan.resident, groups[0] if groups else (), False),
           (plan.paged, groups[1] if len(groups) > 1 else (), bool(plan.loads))]
    out += [({}, g, False) for g in groups[2:]]
    kept = [r for r in out if r[0] or r[1]]
    if plan.loads and not any(r[2] for r in kept):  # nothing computed after the loads: make them anyway
        kept.append(({}, (), True))
    return kept


def round_ids(experts: np.ndarray, in_slots: dict, streamed: tuple, capacity: int, n_experts: int) -> np.ndarray:
    """``experts`` [T, K] as indices into the round's expert list (the C slots, then the staging buffers);
    -1 where the assignment is not this round's."""
    table = np.full(n_experts, -1, np.int32)
    for e, s in in_slots.items():
        table[e] = s
    for j, e in enumerate(streamed):
        table[e] = capacity + j
    return np.where(experts >= 0, table[np.maximum(experts, 0)], -1).astype(np.int32)


# ------------------------------------------------------------------------------------------ stages


def layer_programs(cfg: ModelConfig) -> dict[int, int]:
    """Layer i -> the first layer of the same structure (sliding window, MoE or not): the layer whose
    compiled stages it shares, so a layer-at-a-time pass compiles one program per structure, not per layer."""
    return {i: min(j for j in range(cfg.num_layers) if cfg.sliding_windows[j] == cfg.sliding_windows[i]
                   and cfg.moe_layers[j] == cfg.moe_layers[i]) for i in range(cfg.num_layers)}


def _rope(cfg: ModelConfig, pos0, n: int):
    """(positions, cos, sin) of ``n`` tokens from position ``pos0``."""
    positions = jnp.asarray(pos0, jnp.int32) + jnp.arange(n, dtype=jnp.int32)
    return positions, *attention_lib.rope_tables(cfg, positions)


def attention(lp, cfg: ModelConfig, layer: int, x, pos0, kv):
    """A layer's attention on x [T, D] at positions pos0.. (KV written there), added to the residual."""
    positions, cos, sin = _rope(cfg, pos0, x.shape[0])
    attend = attention_lib.mla_attention if cfg.mla else attention_lib.gqa_attention
    a, kv = attend(lp["attn"], cfg, layer, ops_lib.norm(x, lp["attn_norm"], cfg), cos, sin, positions, kv, pos0)
    return model_lib.residual(cfg, x, a), kv


@functools.partial(jax.jit, static_argnames=("cfg", "layer"), donate_argnames=("kv",))
def dense_layer(lp, cfg: ModelConfig, layer: int, x, pos0, kv):
    """A dense (non-MoE) layer on x [T, D] at positions pos0.. (T = 1: a decode step)."""
    x, kv = attention(lp, cfg, layer, x, pos0, kv)
    return model_lib.residual(cfg, x, ops_lib.dense_mlp(lp["mlp"], cfg, ops_lib.norm(x, lp["mlp_norm"], cfg))), kv


@functools.partial(jax.jit, static_argnames=("cfg", "layer"), donate_argnames=("kv",))
def attend_piece(lp, cfg: ModelConfig, layer: int, x, pos0, kv):
    """Attention of a MoE layer over the piece, and the normed hidden state its router and experts read.
    Apart from ``route_piece``: this program is compiled per piece length and KV-cache length, the routing
    scan (the larger program) per piece length only."""
    x, kv = attention(lp, cfg, layer, x, pos0, kv)
    return x, ops_lib.norm(x, lp["mlp_norm"], cfg), kv


@functools.partial(jax.jit, static_argnames=("cfg",))
def route_piece(p, next_lp, cfg: ModelConfig, moe_index, x, h, state, z_pred):
    """The MoE layer's router logits and the cache's routing scan over the piece's tokens (with this layer's
    prefetch prediction ``z_pred`` from the previous MoE layer, as the simulation does); with ``next_lp`` (a
    prefetching cache) also the next MoE layer's prediction from this layer's post-attention state."""
    z = moe_lib.router_logits(p, h)
    cs, rs = state["cache"], state["routing"]
    experts, weights, hits, _, cs, rs = route_tokens(z, moe_index, cs, rs, state["policy"], cfg.gating,
                                                     z_pred=z_pred, with_tier=True)
    z_next = None
    if next_lp is not None:
        z_next = moe_lib.router_logits(next_lp["moe"], ops_lib.norm(x, next_lp["mlp_norm"], cfg))
    return {**state, "cache": cs, "routing": rs}, z_next, (experts, weights, hits, z)


@functools.partial(jax.jit, static_argnames=("cfg", "block_rows"), donate_argnames=("rows",))
def expert_round(experts_list: layout.ExpertList, cfg: ModelConfig, h, ids, rows, block_rows: int,
                 bias_tables: dict | None = None, experts=None):
    """``rows`` [T·K, D] float32 plus this round's assignments (``ids`` into ``experts_list``) computed.
    ``bias_tables``: GPT-OSS's expert biases, taken by the real ``experts`` [T, K] (``model.expert_biases``)."""
    biases = None if bias_tables is None else moe_lib.expert_biases(bias_tables, ids, experts, experts_list.n_experts)
    return rows + moe_lib.switched_expert_rows(experts_list, cfg, h, ids, block_rows, biases)


@functools.partial(jax.jit, static_argnames=("cfg",))
def finish_layer(p, cfg: ModelConfig, x, h, rows, experts, weights):
    """The MoE block's output from the per-assignment rows (+ shared experts), added to the residual."""
    y = moe_lib.combine_expert_rows(rows, experts, weights, h.dtype)
    if "shared" in p:
        y = y + moe_lib.shared_experts(p, cfg, h)
    return model_lib.residual(cfg, x, y)


@functools.partial(jax.jit, static_argnames=("n", "d"))
def zero_rows(n: int, d: int):
    return jnp.zeros((n, d), jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def embed_tokens(table, cfg: ModelConfig, tokens):
    return model_lib.embed_scaled({"embed": table}, cfg, tokens)


# ------------------------------------------------------------------------------------------ the driver


def run_piece(pager, tokens: np.ndarray, pos0: int, kv: list, record: list | None = None):
    """One piece of the prompt through every layer, batched, with real paging; returns (hidden [T, D], kv).

    ``pager`` is a ``host_paging.HostPager``: its router state, slots, store, link and statistics are used and
    updated. ``record`` receives one block {experts, weights, hits, router_logits}, each [moe_layers, T, ...]."""
    cfg = pager.cfg
    T = int(tokens.size)
    block_rows = moe_lib.grouped_block_rows(T, cfg.top_k, cfg.n_experts)  # the simulation's chunk size
    pos = jnp.int32(pos0)
    x = embed_tokens(pager.params["embed"], cfg, jax.device_put(np.asarray(tokens, np.int32), pager.device))
    z_pred, blocks, moe_index = None, [], 0
    for i, lp in enumerate(pager.params["layers"]):
        program = pager.layer_program(i)
        if not cfg.moe_layers[i]:
            x, kv[i] = dense_layer(lp, cfg, program, x, pos, kv[i])
            continue
        before = np.asarray(pager.state["cache"].slot)[moe_index]
        x, h, kv[i] = attend_piece(lp, cfg, program, x, pos, kv[i])
        pager.state, z_pred, routed = route_piece(lp["moe"], pager.predicting_for(moe_index), cfg,
                                                  jnp.int32(moe_index), x, h, pager.state, z_pred)
        experts, weights = routed[0], routed[1]
        experts_np = np.asarray(experts)
        plan = plan_layer(before, np.asarray(pager.state["cache"].slot)[moe_index], experts_np)
        rows = _run_rounds(pager, moe_index, plan, h, experts_np, block_rows, moe_lib.expert_biases(lp["moe"]),
                           experts)
        x = finish_layer(lp["moe"], cfg, x, h, rows, experts, weights)
        blocks.append(routed)
        moe_index += 1
        pager.release_finished()  # earlier layers' rows are done with (this layer's routing waited on them)
    if record is not None and blocks:
        record.append({name: np.stack([np.asarray(b[j]) for b in blocks])
                       for j, name in enumerate(RECORD_NAMES)})
    return x, kv


def _run_rounds(pager, moe_index: int, plan: LayerPages, h, experts: np.ndarray, block_rows: int,
                biases: dict | None = None, experts_device=None):
    """The layer's ``rounds`` with their pages (streamed experts into the staging buffers before their round,
    the loads into the slots before the first round that needs them); returns the rows [T·K, D] float32."""
    cfg = pager.cfg
    T, K = experts.shape
    rows = jax.device_put(zero_rows(n=T * K, d=cfg.hidden_size), pager.device)  # committed, as compiled
    capacity = pager.slots[moe_index].n_experts
    schedule = rounds(plan, pager.staging_size)
    pager.store.prefetch(moe_index, [e for _, streamed, after_loads in schedule  # read ahead, in paging order
                                     for e in [*(e for e, _ in plan.loads if after_loads), *streamed]],
                         serving=pager.serving_pages)
    for in_slots, streamed, after_loads in schedule:
        if after_loads:
            pager.page_into_slots(moe_index, plan.loads)
        if streamed:
            pager.page_into_staging(moe_index, streamed)
        if in_slots or streamed:
            ids = round_ids(experts, in_slots, streamed, capacity, cfg.n_experts)
            rows = expert_round(pager.round_experts(moe_index), cfg, h, jax.device_put(ids, pager.device), rows,
                                block_rows=block_rows, bias_tables=biases, experts=experts_device)
            for key in (moe_index, "staging"):  # pages written in place into either wait for this round
                pager.reading(key, rows)
    pager.stats.prefill_pages += plan.pages
    return rows


def compile_piece(pager, n_tokens: int, kv: list) -> None:
    """Compile every program ``run_piece`` runs for a piece of ``n_tokens``, lowered from committed shapes
    so the real calls find them in the jit cache (a program already compiled costs nothing): nothing runs,
    nothing is paged."""
    cfg = pager.cfg
    sharding = jax.sharding.SingleDeviceSharding(pager.device)

    def shaped(tree):  # the pager's arrays are committed to its device: shapes that say so
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding,
                                                           weak_type=getattr(a, "weak_type", False)), tree)

    def compiled(fn, *args, **kwargs):
        lowered = fn.lower(*args, **kwargs)
        lowered.compile()
        return shaped(lowered.out_info)

    block_rows = moe_lib.grouped_block_rows(n_tokens, cfg.top_k, cfg.n_experts)
    x = compiled(embed_tokens, pager.params["embed"], cfg, shaped(jax.ShapeDtypeStruct((n_tokens,), jnp.int32)))
    pos, state, z_pred, moe_index = jnp.int32(0), shaped(pager.state), None, 0
    rows = compiled(zero_rows, n=n_tokens * cfg.top_k, d=cfg.hidden_size)
    for i, lp in enumerate(pager.params["layers"]):
        program, layer_kv = pager.layer_program(i), shaped(kv[i])
        if not cfg.moe_layers[i]:
            x, _ = compiled(dense_layer, lp, cfg, program, x, pos, layer_kv)
            continue
        x, h, _ = compiled(attend_piece, lp, cfg, program, x, pos, layer_kv)
        state, z_pred, routed = compiled(route_piece, lp["moe"], pager.predicting_for(moe_index), cfg,
                                         jnp.int32(moe_index), x, h, state, z_pred)
        experts, weights = routed[0], routed[1]
        compiled(expert_round, pager.round_experts(moe_index), cfg, h, experts, rows, block_rows=block_rows,
                 bias_tables=moe_lib.expert_biases(lp["moe"]), experts=experts)
        x = compiled(finish_layer, lp["moe"], cfg, x, h, rows, experts, weights)
        moe_index += 1
