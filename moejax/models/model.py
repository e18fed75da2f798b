"""The decoder for every supported family, as pure functions over a parameter pytree.

Parameters (``x @ W`` orientation, experts stacked per layer so they can be sliced, cached and paged)::

    {"embed": [V, D], "final_norm": {"scale", ("bias")}, ("lm_head": [D, V]), ("lm_head_bias": [V]),
     "layers": [ {"attn_norm", "mlp_norm", "attn": {...},
                  "mlp": {"gate": [D, F], "up": [D, F], "down": [F, D]}                     # dense layers
                  or "moe": {"router": [D, N], "gate": [N, D, F], "up": [N, D, F], "down": [N, F, D],
                             ("shared": {"gate", "up", "down"}), ("shared_gate": [D, 1])}}, ...]}

The MoE block never decides which experts run: at every MoE layer the forward pass calls a *router
hook* ``router(moe_index, logits[T, N], state) -> (experts[T, K], weights[T, K], state', record)`` and
computes exactly the experts it is given with the weights it is given. Routing policies and expert caches
(``moejax.experts.router``) plug in there; ``original_router`` reproduces the architecture's own top-K.

Two optional hook attributes (both decided at trace time):
- ``router.wants_prediction(state) -> bool``: then the hook is called with ``z_pred=`` — this MoE layer's
  router applied to the previous MoE layer's post-attention hidden state (speculative prefetch); None at
  the first MoE layer.
- ``router.compute(moe_index, p, cfg, h, experts, weights, record, state) -> (y, state')``: computes the
  routed experts instead of ``routed_experts`` (offloaded slot buffers paged in-jit, low-bit copies).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from moejax.models import layout
from moejax.models.config import ModelConfig
from moejax.models.gating import original_routing

Params = dict[str, Any]
RouterHook = Callable[[int, jax.Array, Any], tuple[jax.Array, jax.Array, Any, dict]]


# ----------------------------------------------------------------------------------------------- layers
def norm(x: jax.Array, p: dict, cfg: ModelConfig) -> jax.Array:
    """RMSNorm (or Phi-MoE's LayerNorm) computed in float32, as HF does."""
    xf = x.astype(jnp.float32)
    if cfg.norm_type == "layer":
        xf = xf - xf.mean(-1, keepdims=True)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + cfg.norm_eps)
    y = y.astype(x.dtype) * p["scale"]
    return y + p["bias"] if "bias" in p else y


def rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * scale


def activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return _activate(cfg.hidden_act, x)


def glu(act, g: jax.Array, u: jax.Array) -> jax.Array:
    """An expert's gated activation of its gate and up projections (``ModelConfig.expert_act``): act(g) · u, or
    GPT-OSS's clamped SwiGLU ``(clip(u, ±limit) + 1) · g' · σ(alpha · g')`` with g' = min(g, limit)."""
    if isinstance(act, tuple):
        _, limit, alpha = act
        g = jnp.minimum(g, limit)
        return (jnp.clip(u, -limit, limit) + 1) * (g * jax.nn.sigmoid(g * alpha))
    return _activate(act, g) * u


def _activate(act: str, x: jax.Array) -> jax.Array:
    if act == "silu":
        return jax.nn.silu(x)
    if act == "relu":
        return jax.nn.relu(x)
    return jax.nn.gelu(x, approximate=act != "gelu")


def linear(x: jax.Array, w, b: jax.Array | None = None) -> jax.Array:
    """``x @ w (+ b)`` for a canonical ``[in, out]`` matrix or a serving-layout ``layout.OutIn``."""
    y = layout.matmul(x, w)
    return y if b is None else y + b


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [T, dim/2] for the given positions, with the family's cos/sin scale."""
    inv = jnp.asarray(cfg.rope_inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[:, None] * inv[None, :]
    scale = jnp.where(jnp.max(positions) + 1 > cfg.rope_long_after, cfg.rope_long_scale, cfg.rope_scale)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """x [T, H, dim]. Half rotation (Llama style) or (even, odd) pairs (DeepSeek's complex form). Tables for
    fewer dimensions than ``dim`` (GLM-4.5's partial rotary) turn the first 2·cos.shape[-1] and pass the rest."""
    turned = 2 * cos.shape[-1]
    if turned < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :turned], cos, sin, interleaved), x[..., turned:]], axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    xf = x.astype(jnp.float32)
    if interleaved:
        x0, x1 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1).reshape(x.shape)
    else:
        half = x.shape[-1] // 2
        x0, x1 = xf[..., :half], xf[..., half:]
        out = jnp.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)
    return out.astype(x.dtype)


def attention_mask(cfg: ModelConfig, layer: int, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """[T, S] bool: causal, and within the sliding window where the layer has one."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    window = cfg.sliding_windows[layer]
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def _softmax_attend(scores: jax.Array, mask: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """softmax over the keys of scores [H, T, S] where ``mask`` [T, S] allows, float32. ``sinks`` [H] (GPT-OSS):
    one more logit per head in each row's denominator, with no value (the row may attend to nothing)."""
    scores = jnp.where(mask[None], scores.astype(jnp.float32), -jnp.inf)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*scores.shape[:-1], 1))
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - top)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))


def _write(cache: jax.Array, new: jax.Array, pos: jax.Array) -> jax.Array:
    """``new`` rows into a KV cache at ``pos`` (a bfloat16 cache holds bit patterns: see ``init_kv``)."""
    if cache.dtype == KV_BITS:
        new = jax.lax.bitcast_convert_type(new.astype(jnp.bfloat16), KV_BITS)
    return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), pos, axis=0)


def cache_values(stored: jax.Array) -> jax.Array:
    """A KV cache's values as stored by ``init_kv`` / ``_write``: bfloat16 from bit patterns, else as is."""
    return jax.lax.bitcast_convert_type(stored, jnp.bfloat16) if stored.dtype == KV_BITS else stored


def gqa_qkv(p: dict, cfg: ModelConfig, x: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotated queries [..., T, H, hd] and keys / values [..., T, Hk, hd] of x [..., T, D]: projections,
    q/k norm and qkv clipping as the family does them (shared by inference and batched training)."""
    lead, H, Hk, hd = x.shape[:-1], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = linear(x, p["q"], p.get("q_bias"))
    k = linear(x, p["k"], p.get("k_bias"))
    v = linear(x, p["v"], p.get("v_bias"))
    if cfg.qk_norm == "proj":
        q, k = rms(q, p["q_norm"], cfg.norm_eps), rms(k, p["k_norm"], cfg.norm_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (jnp.clip(t, -cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q, k, v = q.reshape(*lead, H, hd), k.reshape(*lead, Hk, hd), v.reshape(*lead, Hk, hd)
    if cfg.qk_norm == "head":
        q, k = rms(q, p["q_norm"], cfg.norm_eps), rms(k, p["k_norm"], cfg.norm_eps)
    pairs = cfg.rope_interleaved  # ERNIE-4.5 turns (even, odd) pairs; the other GQA families rotate halves
    q, k = apply_rope(q, cos, sin, pairs), apply_rope(k, cos, sin, pairs)
    if cfg.qk_norm == "head_after_rope":  # Hunyuan normalises the rotated heads
        q, k = rms(q, p["q_norm"], cfg.norm_eps), rms(k, p["k_norm"], cfg.norm_eps)
    return q, k, v


ATTENTION_BLOCK = 256  # query rows per block of a long teacher-forced pass (causal key ranges shrink)


def _attend_groups(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                   sinks: jax.Array | None = None) -> jax.Array:
    """softmax(q kᵀ·scale, mask) v for q [T, H, hd], k/v [S, Hk, hd] -> [T, H·hd].

    Laid out as Hk batched matmuls of [(H/Hk)·T, hd] x [hd, S]: the query heads that share a KV head are
    stacked into one matrix (about 2x faster on CPU than contracting with the group axis in the middle)."""
    T, H, hd = q.shape
    S, Hk = k.shape[:2]
    r = H // Hk
    qg = q.reshape(T, Hk, r, hd).transpose(1, 2, 0, 3).reshape(Hk, r * T, hd)
    scores = jnp.matmul(qg, k.astype(q.dtype).transpose(1, 2, 0)) * scale
    probs = _softmax_attend(scores.reshape(H, T, S), mask, sinks)
    out = jnp.matmul(probs.reshape(Hk, r * T, S).astype(v.dtype), v.transpose(1, 0, 2))
    return out.reshape(Hk, r, T, -1).transpose(2, 0, 1, 3).reshape(T, -1)


KV_BLOCK = 512  # cache rows per block of attention over a KV cache on the CPU (_attend_cache_blocks)


def visible_key_blocks(cfg: ModelConfig, layer: int, positions: jax.Array, rows: int) -> list[tuple[int, int, jax.Array]]:
    """The ``KV_BLOCK``-row blocks [a, b) of a KV cache of ``rows`` rows, each with a traced bool: can any of
    the query ``positions`` see a key in it (causal, and within the layer's sliding window)?"""
    last, first, window = jnp.max(positions), jnp.min(positions), cfg.sliding_windows[layer]
    blocks = []
    for a in range(0, rows, KV_BLOCK):
        b = min(a + KV_BLOCK, rows)
        seen = a <= last
        if window:
            seen &= b - 1 > first - window
        blocks.append((a, b, seen))
    return blocks


def _blockwise(blocks, fn: Callable, empty: Callable, *operands) -> list:
    """``fn(a, b, *operands)`` for each visible block, ``empty(b - a)`` for the others. The whole operands go
    into each ``lax.cond`` and are sliced inside the taken branch: operands sliced outside would be copied
    out, block by block, every step, visible or not. A cache of one block holds the query's own row, so
    that block is computed without a ``cond``."""
    if len(blocks) == 1:
        a, b, _ = blocks[0]
        return [fn(a, b, *operands)]
    return [jax.lax.cond(seen, functools.partial(fn, a, b), lambda *_, n=b - a: empty(n), *operands)
            for a, b, seen in blocks]


def _attend_cache_blocks(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                         blocks: list, sinks: jax.Array | None = None) -> jax.Array:
    """``_attend_groups`` over a KV cache as ``init_kv`` stores it, one block of rows at a time, skipping
    blocks no query sees.

    XLA:CPU multiplies in float32: a bfloat16 cache was widened (and transposed) whole every step, 23 ms a
    layer for 8,192 rows of 8 heads of 128 against 0.6 ms for the product itself (docs/benchmarks.md#long-contexts). Per block the widened rows stay in the processor's cache, and blocks
    past the last position are not read at all (the cache is allocated to a power-of-two bucket). Scores,
    softmax and the values' sum run in float32 and are rounded once, at the end."""
    T, H, hd = q.shape
    Hk = k.shape[1]
    r = H // Hk
    qf = q.astype(jnp.float32).reshape(T, Hk, r, hd)

    def block_scores(a, b, k):
        return jnp.einsum("tgrd,sgd->grts", qf, cache_values(k[a:b]).astype(jnp.float32)) * scale

    def no_scores(n):
        return jnp.zeros((Hk, r, T, n), jnp.float32)  # masked below

    scores = jnp.concatenate(_blockwise(blocks, block_scores, no_scores, k), axis=-1)
    probs = _softmax_attend(scores.reshape(H, T, -1), mask, sinks).reshape(Hk, r, T, -1)

    def block_values(a, b, probs, v):
        return jnp.einsum("grts,sgd->grtd", probs[..., a:b], cache_values(v[a:b]).astype(jnp.float32))

    def no_values(n):
        return jnp.zeros((Hk, r, T, hd), jnp.float32)

    out = functools.reduce(jnp.add, _blockwise(blocks, block_values, no_values, probs, v))
    return out.transpose(2, 0, 1, 3).reshape(T, H * hd).astype(q.dtype)


def gqa_attention(p: dict, cfg: ModelConfig, layer: int, x: jax.Array, cos, sin, positions, kv, pos0):
    """Grouped-query attention with optional q/k norm, qkv clipping, sliding window and KV cache (on the CPU
    read in blocks: ``_attend_cache_blocks``; a long prompt written at position 0 attends to itself alone:
    ``_attend_new``)."""
    T = x.shape[0]
    q, k, v = gqa_qkv(p, cfg, x, cos, sin)
    sinks = p.get("sinks")
    if kv is None:
        out = _attend_new(cfg, layer, q, k, v, positions, sinks)
    else:
        kv = {"k": _write(kv["k"], k, pos0), "v": _write(kv["v"], v, pos0)}

        def cached(q, cache_k, cache_v):  # the mask [T, rows] is made only where the cache is read
            rows = cache_k.shape[0]
            mask, blocks = attention_mask(cfg, layer, positions, jnp.arange(rows)), visible_key_blocks(
                cfg, layer, positions, rows)
            return jax.lax.platform_dependent(
                q, cache_k, cache_v, mask, cpu=lambda *a: _attend_cache_blocks(*a, cfg.attn_scale, blocks, sinks),
                default=lambda q, k, v, mask: _attend_groups(q, cache_values(k), cache_values(v), mask,
                                                             cfg.attn_scale, sinks))

        if T <= ATTENTION_BLOCK:
            out = cached(q, kv["k"], kv["v"])
        else:  # a prompt at position 0 (generate's) sees only its own rows: the blocked pass, no cache read
            out = jax.lax.cond(pos0 == 0, lambda q, k, v, *_: _attend_new(cfg, layer, q, k, v, positions, sinks),
                               lambda q, k, v, cache_k, cache_v: cached(q, cache_k, cache_v),
                               q, k, v, kv["k"], kv["v"])
    return linear(layout.as_rows(out), p["o"], p.get("o_bias")), kv


def _attend_new(cfg: ModelConfig, layer: int, q: jax.Array, k: jax.Array, v: jax.Array, positions,
                sinks: jax.Array | None = None) -> jax.Array:
    """Attention of T tokens to themselves (no earlier positions). A long pass runs in blocks of
    ``ATTENTION_BLOCK`` queries, each against the keys up to its own last position only (positions increase,
    so later keys are masked anyway): exact, and it skips about half of the score matrix."""
    T = q.shape[0]
    if T <= ATTENTION_BLOCK:
        return _attend_groups(q, k, v, attention_mask(cfg, layer, positions, positions), cfg.attn_scale, sinks)
    return jnp.concatenate([
        _attend_groups(q[a:a + ATTENTION_BLOCK], k[:a + ATTENTION_BLOCK], v[:a + ATTENTION_BLOCK],
                       attention_mask(cfg, layer, positions[a:a + ATTENTION_BLOCK], positions[:a + ATTENTION_BLOCK]),
                       cfg.attn_scale, sinks)
        for a in range(0, T, ATTENTION_BLOCK)])


def _attend_latent(q_latent, q_pe, latent, k_pe, mask, scale: float) -> jax.Array:
    """MLA's absorbed attention: softmax(q_latent latentᵀ + q_pe k_peᵀ) latent, [T, H, r]."""
    scores = jnp.einsum("thr,sr->hts", q_latent, latent) + jnp.einsum("thd,sd->hts", q_pe, k_pe)
    probs = _softmax_attend(scores * scale, mask)
    return jnp.einsum("hts,sr->thr", probs.astype(q_latent.dtype), latent)


def _attend_latent_blocks(q_latent, q_pe, latent, k_pe, mask, scale: float, blocks: list) -> jax.Array:
    """``_attend_latent`` over a cache as ``init_kv`` stores it, one block of rows at a time, skipping blocks
    no query sees (as ``_attend_cache_blocks`` does for grouped-query attention; float32 throughout)."""
    T, H, r = q_latent.shape
    f32 = jnp.float32
    ql, qp = q_latent.astype(f32), q_pe.astype(f32)

    def block_scores(a, b, latent, k_pe):
        return (jnp.einsum("thr,sr->hts", ql, cache_values(latent[a:b]).astype(f32))
                + jnp.einsum("thd,sd->hts", qp, cache_values(k_pe[a:b]).astype(f32)))

    scores = jnp.concatenate(_blockwise(blocks, block_scores, lambda n: jnp.zeros((H, T, n), f32), latent, k_pe),
                             axis=-1)
    probs = _softmax_attend(scores * scale, mask)

    def block_latent(a, b, probs, latent):
        return jnp.einsum("hts,sr->thr", probs[..., a:b], cache_values(latent[a:b]).astype(f32))

    parts = _blockwise(blocks, block_latent, lambda n: jnp.zeros((T, H, r), f32), probs, latent)
    return functools.reduce(jnp.add, parts).astype(q_latent.dtype)


def mla_attention(p: dict, cfg: ModelConfig, layer: int, x: jax.Array, cos, sin, positions, kv, pos0):
    """DeepSeek-V2 multi-head latent attention. The KV cache holds the compressed latent and the shared
    rotary key (as HF does); per-head keys and values are folded into the query and output ("absorbed")."""
    T, H = x.shape[0], cfg.num_heads
    nope, rope_d, vd, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = linear(x, p["q"])
    else:
        q = linear(rms(linear(x, p["q_a"], p.get("q_a_bias")), p["q_a_norm"], 1e-6), p["q_b"])
    q = q.reshape(T, H, nope + rope_d)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    ckv = linear(x, p["kv_a"], p.get("kv_a_bias"))
    latent = rms(ckv[:, :r], p["kv_a_norm"], 1e-6)
    k_pe = ckv[:, None, r:]
    pairs = cfg.rope_interleaved  # DeepSeek-V2 and V3 by default; V3 with rope_interleave false rotates halves
    q_pe, k_pe = apply_rope(q_pe, cos, sin, pairs), apply_rope(k_pe, cos, sin, pairs)[:, 0]
    if kv is not None:
        kv = {"latent": _write(kv["latent"], latent, pos0), "k_pe": _write(kv["k_pe"], k_pe, pos0)}
        k_pos = jnp.arange(kv["latent"].shape[0])
    else:
        k_pos = positions
    w_kv = p["kv_b"].reshape(r, H, nope + vd)
    w_k, w_v = w_kv[..., :nope], w_kv[..., nope:]
    q_latent = jnp.einsum("thn,rhn->thr", q_nope, w_k)
    mask = attention_mask(cfg, layer, positions, k_pos)
    if kv is None:
        out_latent = _attend_latent(q_latent, q_pe, latent, k_pe, mask, cfg.attn_scale)
    else:
        blocks = visible_key_blocks(cfg, layer, positions, k_pos.size)
        out_latent = jax.lax.platform_dependent(
            q_latent, q_pe, kv["latent"], kv["k_pe"], mask,
            cpu=lambda *a: _attend_latent_blocks(*a, cfg.attn_scale, blocks),
            default=lambda q_latent, q_pe, latent, k_pe, mask: _attend_latent(
                q_latent, q_pe, cache_values(latent).astype(x.dtype), cache_values(k_pe).astype(x.dtype), mask,
                cfg.attn_scale))
    out = _latent_values(out_latent, w_v)
    return linear(layout.as_rows(out), p["o"], p.get("o_bias")), kv


def _latent_values(out_latent: jax.Array, w_v: jax.Array) -> jax.Array:
    """MLA's values from the attended latent: ``Σ_r out_latent[t, h, r] · w_v[r, h, v]`` -> [T, H, vd].

    One token on the CPU is the elementwise product summed over r: XLA's batched product for it took 1.8 ms
    a layer at DeepSeek-V2-Lite's shapes (16 heads, r = 512, 128 values), the sum 0.25 ms (docs/benchmarks.md#one-row-products). The barrier keeps a decode loop from hoisting ``w_v``'s conversion (an f32 copy) out."""
    def summed(out_latent, w_v):
        out_latent, w_v = jax.lax.optimization_barrier((out_latent, w_v))
        terms = w_v.astype(jnp.float32) * out_latent[0].astype(jnp.float32).T[:, :, None]
        return jnp.sum(terms, axis=0)[None].astype(out_latent.dtype)

    def product(out_latent, w_v):
        return jnp.einsum("thr,rhv->thv", out_latent, w_v)

    return layout.one_row_on_cpu(out_latent, summed, product, w_v)


def dense_mlp(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    h = activation(cfg, linear(x, p["gate"], p.get("gate_bias"))) * linear(x, p["up"], p.get("up_bias"))
    return linear(h, p["down"], p.get("down_bias"))


SORTED_MIN_TOKENS = 64  # below this the dense einsum is within ~1.5x of the sorted path (one MoE layer of tests/data/cpu-default-model)


EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")  # GPT-OSS's, [N, F], [N, F], [N, D]: resident, never paged


def expert_biases(p: dict, experts: jax.Array | None = None, bias_ids: jax.Array | None = None,
                  n: int | None = None) -> dict | None:
    """GPT-OSS's expert biases as tables aligned with the ids that ``experts`` uses (None for the other families).

    They are 17 KB an expert against its 49.8 MB of matrices (gpt-oss-20b), so they stay on the device beside
    the router and are never paged: ``experts`` naming the layer's own experts read the layer's tables;
    ``experts`` naming slots (an offloaded cache's buffers) read tables of ``n`` rows built from ``bias_ids``
    [T, K], the real experts those slots hold (scattered to their slots; rows of unused slots are zero)."""
    if "down_bias" not in p:
        return None
    tables = {k: p[k] for k in EXPERT_BIASES}
    if bias_ids is None:
        return tables
    flat, real = experts.reshape(-1), jnp.maximum(bias_ids.reshape(-1), 0)
    at = jnp.where(flat >= 0, flat, n)  # invalid assignments land in a dummy row
    return {k: jnp.zeros((n + 1, t.shape[-1]), t.dtype).at[at].set(t[real])[:n] for k, t in tables.items()}


def _gate_up_bias(b: dict | None, e) -> tuple:
    """Expert ``e``'s (gate_up bias [2F], down bias [D]) of aligned tables (``expert_biases``), or (None, None)."""
    if b is None:
        return None, None
    return jnp.concatenate([b["gate_bias"][e], b["up_bias"][e]]), b["down_bias"][e]


def routed_experts(p: dict, cfg: ModelConfig, x: jax.Array, experts: jax.Array, weights: jax.Array,
                   bias_ids: jax.Array | None = None):
    """Σ_k weights[t,k] · E_{experts[t,k]}(x_t) over T tokens. Invalid slots (id < 0) must carry weight 0.
    ``bias_ids``: where ``experts`` are slot ids, the real experts they hold (GPT-OSS's biases: ``expert_biases``).

    Picks the exact path by shape (all give the same result; measured in docs/benchmarks.md#evaluation-speed): one token
    gathers the K chosen experts' weights; from ``SORTED_MIN_TOKENS`` tokens on, when N > 2K, the CPU sorts
    the T·K assignments by expert and runs each expert on its own tokens only (``sorted_routed_experts``: on
    the default model 2.1x faster than dense at T = 128, 2.8x at 1024); otherwise every expert runs on every
    token (``dense_routed_experts``: at most twice the needed work when N ≤ 2K, and for a few tokens it costs
    little and compiles faster). Off the CPU many tokens also take the dense path, in chunks of tokens
    (``dense_chunk_rows``): the sorted path's loop of ~T·K/64 sequential small products per layer ran the
    H200's teacher-forced pass at 0.40x transformers' grouped GEMM (``bench/bench_teacher_forced.py``), where
    N/K times the work in one large product costs a GPU less than the loop."""
    held = p.get("experts")
    n = held.n_experts if held is not None else p["gate"].shape[0]
    biases = expert_biases(p, experts, bias_ids, n)
    if isinstance(held, layout.ExpertShards):  # spread over devices: each computes its own
        return sharded_routed_experts(held, cfg, x, experts, weights, biases)
    if held is not None:  # serving layout (layout.ExpertList): every path reads the experts in place
        return switched_routed_experts(held, cfg, x, experts, weights, biases=biases)
    p = {**{k: p[k] for k in ("gate", "up", "down")}, **(biases or {})}
    T, K = experts.shape
    if T == 1:
        return gathered_routed_experts(p, cfg, x, experts, weights)
    if T >= SORTED_MIN_TOKENS and n > 2 * K:
        chunk = dense_chunk_rows(n, p["gate"].shape[-1])
        return jax.lax.platform_dependent(
            x, experts, weights, cpu=lambda *a: sorted_routed_experts(p, cfg, *a),
            default=lambda *a: dense_routed_experts(p, cfg, *a, chunk_rows=chunk))
    return dense_routed_experts(p, cfg, x, experts, weights)


def dense_chunk_rows(n_experts: int, ff: int, budget_bytes: int = 1 << 28) -> int:
    """Tokens per chunk of the dense path off the CPU: the [rows, N, F] float32 intermediate within
    ``budget_bytes`` (256 MiB), a power of two in [64, 4096]."""
    rows = max(1, budget_bytes // (n_experts * ff * 4))
    return int(min(4096, max(64, 1 << (rows.bit_length() - 1))))


def _expert_mlp_act(act, x: jax.Array, g: jax.Array, u: jax.Array, d: jax.Array, gb=None, ub=None,
                    db=None) -> jax.Array:
    """One expert's gated MLP on rows x [R, D]: glu(x g (+ gb), x u (+ ub)) @ d (+ db)."""
    y = glu(act, _plus(x @ g, gb), _plus(x @ u, ub)) @ d
    return _plus(y, db)


def _plus(y: jax.Array, b) -> jax.Array:
    """``y + b`` in y's dtype (a bias, as HF adds it after the product is rounded), or y."""
    return y if b is None else y + b.astype(y.dtype)


def gathered_routed_experts(p: dict, cfg: ModelConfig, x, experts, weights):
    """One token (decode): gather the K chosen experts' weights (and biases), nothing else is read."""
    ids = jnp.maximum(experts[0], 0)
    g, u, d = p["gate"][ids], p["up"][ids], p["down"][ids]  # [K, D, F], [K, F, D]
    gb, ub, db = (p[k][ids] if k in p else None for k in EXPERT_BIASES)
    h = glu(cfg.expert_act, _plus(jnp.einsum("td,kdf->tkf", x, g), gb), _plus(jnp.einsum("td,kdf->tkf", x, u), ub))
    y = _plus(jnp.einsum("tkf,kfd->tkd", h, d), db)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def dense_routed_experts(p: dict, cfg: ModelConfig, x, experts, weights, chunk_rows: int | None = None):
    """Every expert on every token, combined with a [T, N] matrix: N/K times the work, but one big
    einsum: the reference the sparse path is tested against, and the fastest for a few tokens.
    ``chunk_rows``: more tokens than that run as a sequence of chunks (padded), bounding the [rows, N, F]
    intermediate."""
    T, n = x.shape[0], p["gate"].shape[0]
    if chunk_rows is not None and T > chunk_rows:
        nc = -(-T // chunk_rows)
        pad = nc * chunk_rows - T

        def chunks(a, fill):
            a = jnp.concatenate([a, jnp.full((pad, *a.shape[1:]), fill, a.dtype)]) if pad else a
            return a.reshape(nc, chunk_rows, *a.shape[1:])

        y = jax.lax.map(lambda c: dense_routed_experts(p, cfg, *c),
                        (chunks(x, 0), chunks(experts, -1), chunks(weights, 0)))
        return y.reshape(nc * chunk_rows, -1)[:T]
    ids = jnp.maximum(experts, 0)
    combine = jnp.zeros((T, n), weights.dtype)
    combine = combine.at[jnp.arange(T)[:, None], ids].add(jnp.where(experts >= 0, weights, 0))
    gb, ub, db = (p.get(k) for k in EXPERT_BIASES)
    h = glu(cfg.expert_act, _plus(jnp.einsum("td,edf->tef", x, p["gate"]), gb),
            _plus(jnp.einsum("td,edf->tef", x, p["up"]), ub))
    y = jnp.einsum("tef,efd,te->td", h, p["down"], combine.astype(h.dtype))
    return y if db is None else y + (combine.astype(h.dtype) @ db.astype(h.dtype))


def sorted_block_rows(T: int, K: int, n: int) -> int:
    """Rows per block of the sorted layout: about half the mean number of assignments per expert, a power
    of two in [8, 64] (smaller blocks waste fewer padding rows, larger ones make better matmuls; on the
    CPU-trained model in tests/data/cpu-default-model at T = 1024 every size from 8 to 128 ran within 10 %)."""
    half_mean = max(1, (T * K) // (2 * n))
    return int(min(64, max(8, 1 << (half_mean - 1).bit_length())))


def sorted_routed_experts(p: dict, cfg: ModelConfig, x, experts, weights, block_rows: int | None = None):
    """Exact sparse dispatch with static shapes (no capacity, nothing dropped).

    The T·K assignments are sorted by expert; each expert's run of rows is padded to a multiple of
    ``block_rows`` so every block belongs to one expert; a loop over the blocks runs each block through its
    expert (the weights are read in place, never gathered into a copy), and blocks past the last used one
    are skipped. Σ_e ceil(count_e / B) ≤ (T·K + N·(B-1)) / B bounds the number of blocks statically.
    Invalid slots (id < 0) sort last and land in a dummy row. Results are combined in float32.

    Under ``jax.vmap`` with expert weights shared by every lane (a sweep over routing policies, a training
    batch) the mapped axis is folded into the tokens: one sort over all lanes' assignments, each expert's
    weights read once per block for all lanes (mapping the loop instead would turn its skip into a select
    and gather a copy of the weights per lane and block: 9x slower at 4 lanes on the default model)."""
    stack = {k: p[k] for k in ("gate", "up", "down", *EXPERT_BIASES) if k in p}
    return _sorted_dispatch_op(cfg.expert_act, block_rows)(stack, x, experts, weights)


def lane_folding(plain, again):
    """``plain(w, x, experts, weights)`` as a ``custom_vmap`` whose batching rule folds the mapped axis into
    the tokens when the weights ``w`` are shared by every lane (a sweep over routing policies, a training
    batch): one dispatch over all lanes' assignments, each expert's weights read once for all lanes
    (mapping the dispatch instead would gather a copy of the weights per lane, or turn a ``lax.switch`` into
    running every expert). ``again()`` is what the folded call runs (the final op, so an outer vmap folds
    its lanes in as well); weights that differ per lane map ``plain``."""
    op = jax.custom_batching.custom_vmap(plain)

    @op.def_vmap
    def _fold_lanes(axis_size, in_batched, w, x, experts, weights):
        w_b, x_b, e_b, g_b = in_batched
        if any(jax.tree.leaves(w_b)):  # weights differ per lane: nothing to share, map the plain function
            axes = (jax.tree.map(lambda b: 0 if b else None, w_b), *(0 if b else None for b in (x_b, e_b, g_b)))
            return jax.vmap(plain, in_axes=axes)(w, x, experts, weights), True
        lanes = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in ((x, x_b), (experts, e_b),
                                                                                      (weights, g_b))]
        x, experts, weights = (a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in lanes)
        y = again()(w, x, experts, weights)
        return y.reshape(axis_size, -1, y.shape[-1]), True

    return op


@functools.lru_cache(maxsize=None)
def _sorted_dispatch_op(act, block_rows: int | None):
    """``_sorted_dispatch`` with the lane-folding batching rule and a reverse-mode rule (``custom_vmap``
    alone has none): the backward pass is the plain function's own VJP."""

    def plain(w, x, experts, weights):
        return _sorted_dispatch(act, w, x, experts, weights, block_rows)

    folding = lane_folding(plain, lambda: op)  # op, not plain: an outer vmap folds its lanes in as well

    def fwd(w, x, experts, weights):
        return folding(w, x, experts, weights), (w, x, experts, weights)

    def bwd(res, g):
        w, x, experts, weights = res
        _, pull = jax.vjp(lambda w, x, weights: plain(w, x, experts, weights), w, x, weights)
        dw, dx, dweights = pull(g)
        return dw, dx, None, dweights

    op = jax.custom_vjp(folding)
    op.defvjp(fwd, bwd)
    return op


def _sorted_dispatch(act, p: dict, x, experts, weights, block_rows: int | None):
    """The sorted layout itself (see ``sorted_routed_experts``); ``p`` holds the stacked gate/up/down (and
    GPT-OSS's biases)."""
    T, K = experts.shape
    n, D = p["gate"].shape[0], x.shape[-1]
    B = block_rows or sorted_block_rows(T, K, n)
    A = T * K
    nb = (A + n * (B - 1)) // B
    flat = experts.reshape(-1)
    key = jnp.where(flat >= 0, flat, n)  # invalid sort last
    order = jnp.argsort(key, stable=True)
    sorted_e = key[order]
    counts = jnp.zeros(n + 1, jnp.int32).at[key].add(1)[:n]
    blocks = (counts + B - 1) // B
    blocks_end = jnp.cumsum(blocks)
    first_row = (blocks_end - blocks) * B
    first_sorted = jnp.cumsum(counts) - counts
    e = jnp.minimum(sorted_e, n - 1)
    row = jnp.where(sorted_e < n, first_row[e] + jnp.arange(A) - first_sorted[e], nb * B)
    tok = order // K
    xin = jnp.zeros((nb * B + 1, D), x.dtype).at[row].set(x[tok])[:-1].reshape(nb, B, D)
    block_expert = jnp.minimum(jnp.searchsorted(blocks_end, jnp.arange(nb), side="right"), n - 1)
    used = blocks_end[-1]

    def run_block(b, out):
        def compute(o):
            ex = block_expert[b]
            w = [jax.lax.dynamic_index_in_dim(p[k], ex, 0, keepdims=False) for k in ("gate", "up", "down",
                                                                                    *EXPERT_BIASES) if k in p]
            return jax.lax.dynamic_update_index_in_dim(o, _expert_mlp_act(act, xin[b], *w).astype(o.dtype), b, 0)
        return jax.lax.cond(b < used, compute, lambda o: o, out)

    y = jax.lax.fori_loop(0, nb, run_block, jnp.zeros((nb, B, D), x.dtype)).reshape(nb * B, D)
    y = jnp.concatenate([y, jnp.zeros((1, D), y.dtype)])
    w = jnp.where(flat >= 0, weights.reshape(-1), 0)[order].astype(jnp.float32)
    out = jnp.zeros((T, D), jnp.float32).at[tok].add(y[row].astype(jnp.float32) * w[:, None])
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------- expert parallelism
def sharded_routed_experts(shards: layout.ExpertShards, cfg: ModelConfig, x, experts, weights, biases=None):
    """``routed_experts`` with the experts split over the devices of ``shards.mesh`` (expert parallelism):
    every device holds N / devices experts and the (replicated) tokens, runs the assignments that fall on
    its own experts through the usual exact paths (the others masked as dropped slots), and the devices'
    shares are summed in float32 (``psum``); the result is replicated. The same model as one device up to
    the order of that sum. ``biases`` (GPT-OSS's tables, ``expert_biases``) are spread as the experts are."""
    from jax.sharding import PartitionSpec as P

    axis = shards.axis

    def local(stacks, x, experts, weights):
        n_local = stacks["gate"].shape[0]
        ids = experts - jax.lax.axis_index(axis) * n_local
        mine = (experts >= 0) & (ids >= 0) & (ids < n_local)
        y = routed_experts(stacks, cfg, x, jnp.where(mine, ids, -1), jnp.where(mine, weights, 0).astype(weights.dtype))
        return jax.lax.psum(y.astype(jnp.float32), axis)

    spread, whole = P(axis), P()
    stacks = {**shards.stacks(), **(biases or {})}
    out = jax.shard_map(local, mesh=shards.mesh, in_specs=(jax.tree.map(lambda _: spread, stacks), whole, whole, whole),
                        out_specs=whole, check_vma=False)(stacks, x, experts, weights)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------- serving-layout experts
def switched_routed_experts(experts_list: layout.ExpertList, cfg: ModelConfig, x, experts, weights,
                            block_rows: int | None = None, biases: dict | None = None):
    """``routed_experts`` for the serving layout: each expert's matrices are their own buffers and
    ``lax.switch`` on the expert id hands them to the matmuls, so nothing is gathered or copied and the
    bytes read are those of the experts chosen (in their stored dtype).

    One token (decode): a loop over its K experts. More tokens: the T·K assignments are sorted by expert
    and a loop over the experts runs each one's rows in chunks of ``block_rows`` (a dynamic number of
    chunks: an unused expert costs nothing, a used one is read once per chunk). Exact; results are
    combined in float32. Under ``jax.vmap`` with shared weights the mapped axis is folded into the tokens
    (a mapped ``lax.switch`` would run every expert on every lane). Not differentiable (the chunk loop has
    a traced trip count): training uses the canonical layout. ``biases``: GPT-OSS's bias tables aligned with
    the list (``expert_biases``)."""
    return _switched_op(cfg.expert_act, block_rows)((experts_list, biases), x, experts, weights)


#: chunk sizes of the grouped loop: multiples of 8 outside ``layout.SLOW_BF16_ROWS`` (64 rows of a bf16 expert ran
#: at half the speed of 72 or 80: the OLMoE-1B-7B-shaped teacher-forced pass took 1.9 s a 1,024-token chunk with
#: 64-row chunks, 1.42-1.54 s with any of 48-120; ``python bench/bench_row_counts.py``)
GROUPED_BLOCKS = (8, 16, 24, 32, 48, 56, 72, 80, 96, 112, 128)


def grouped_block_rows(T: int, K: int, n: int) -> int:
    """Rows per chunk of the grouped loop: room for an expert's assignments at the mean plus two standard
    deviations (an expert's count is about Poisson), split into as few chunks of at most 128 rows as that needs,
    each rounded up to the next ``GROUPED_BLOCKS`` size. Most experts then run in one or two chunks with little
    padding, and no chunk has a row count XLA:CPU's matmul library runs at half speed."""
    mean = T * K / n
    need = mean + 2 * math.sqrt(mean)
    per_chunk = need / math.ceil(need / GROUPED_BLOCKS[-1])
    return next(b for b in GROUPED_BLOCKS if b >= per_chunk - 1e-9)


def _expert_rows(act, rows: jax.Array, gate_up: jax.Array, down: jax.Array, gate_up_bias=None,
                 down_bias=None, product=layout.nt_dot) -> jax.Array:
    """One serving-layout expert on rows [R, D] -> [R, D] float32; rounded after each matmul (and bias) to the
    rows' dtype as the canonical path (and Hugging Face) round. ``product(x, w)`` is x @ w.T: ``layout.nt_dot``
    on one expert's matrices, or ``layout.nt_dot_at`` bound to expert e of a stacked list's [N, ., .] stacks
    (read in place for one row on the CPU): the same arithmetic either way."""
    f = gate_up.shape[-2] // 2
    gu = _plus(product(rows, gate_up).astype(rows.dtype), gate_up_bias)
    h = glu(act, gu[:, :f], gu[:, f:])
    return _plus(product(h, down).astype(rows.dtype), down_bias).astype(jnp.float32)


def _stacked_expert_rows(act, rows: jax.Array, el: layout.ExpertList, e, gate_up_bias=None,
                         down_bias=None) -> jax.Array:
    """``_expert_rows`` of expert ``e`` (traced) of a stacked list."""
    return _expert_rows(act, rows, el.gate_up, el.down, gate_up_bias, down_bias,
                        product=lambda x, stack: layout.nt_dot_at(x, stack, e))


@functools.partial(jax.jit, static_argnums=0)
def _expert_rows_once(act, rows: jax.Array, gate_up: jax.Array, down: jax.Array, gate_up_bias=None,
                      down_bias=None) -> jax.Array:
    """``_expert_rows`` behind ``jit``, for ``_expert_branches``: ``lax.switch`` traces one branch per expert in
    every MoE layer's program (64 experts x 8 layers x 2 programs for the default model), and a branch that
    calls this reuses one trace for all of them (the default model's first ``generate`` spent 4.3 s of its 11
    tracing the same expert computation again and again). XLA inlines the call: the same arithmetic."""
    return _expert_rows(act, rows, gate_up, down, gate_up_bias, down_bias)


def _expert_branches(act, n: int) -> list:
    """``lax.switch`` branches: expert e's computation on (rows, ExpertList, bias tables or None); branch n
    returns zeros. A stacked list needs none: ``_one_expert`` indexes it."""
    def one(e):
        return lambda rows, el, b: _expert_rows_once(act, rows, *el.expert(e), *_gate_up_bias(b, e))

    def none(rows, el, b):
        return jnp.zeros((rows.shape[0], el.down[0].shape[0]), jnp.float32)

    return [one(e) for e in range(n)] + [none]


#: one expert's bytes up to which the grouped (many-token) loop copies the expert out of its list and runs one
#: shared computation on the copy, instead of computing inside a ``lax.switch`` branch per expert. XLA compiles
#: every branch separately: the default model's prompt program held 8 x 64 expert computations and took ~5 s
#: of the first ``generate``'s ~17 s to compile; with the copy the loop body is compiled once per layer, and
#: at this size the copy (once per chunk of rows) costs nothing measurable (bench/bench_teacher_forced.py).
#: Larger experts (every real model's: OLMoE 12.6 MB, Mixtral 352 MB) keep the in-place branches. Decode
#: (one row) keeps its branches at every size: a copy per expert and token slowed the default model's decode.
COPY_EXPERT_MAX_BYTES = 1 << 20


def copies_experts(el: layout.ExpertList) -> bool:
    """Whether the grouped loop runs ``el``'s experts on a copy (``COPY_EXPERT_MAX_BYTES``)."""
    return layout.matrix_nbytes(el.gate_up[0]) + layout.matrix_nbytes(el.down[0]) <= COPY_EXPERT_MAX_BYTES


def _expert_copy(el: layout.ExpertList, e):
    """Expert ``e``'s ``(gate_up, down)`` (traced ``e`` in [0, N)): a ``lax.switch`` whose branches only hand
    out a buffer, so XLA copies it instead of compiling a computation per expert."""
    return jax.lax.switch(e, [functools.partial(lambda i, el: el.expert(i), i) for i in range(el.n_experts)], el)


def _one_expert(act, branches: list | None, el: layout.ExpertList, x, e, biases=None):
    """Expert ``e``'s output on one token's row (``_expert_branches``, or the stack indexed; zeros for ``e`` < 0):
    the one computation ``one_token_expert_sum`` and ``one_token_expert_rows`` share, so their rows are the same
    bits."""
    if el.stacked:
        def compute(x, el, e, biases):
            return _stacked_expert_rows(act, x, el, e, *_gate_up_bias(biases, e))

        return jax.lax.cond(e >= 0, compute, lambda x, el, e, biases: jnp.zeros((x.shape[0], x.shape[-1]),
                                                                                 jnp.float32), x, el, e, biases)
    return jax.lax.switch(jnp.where(e >= 0, e, len(branches) - 1), branches, x, el, biases)


def one_token_expert_sum(act, el: layout.ExpertList, x, experts, weights, early_rows=None, early=None,
                         biases: dict | None = None):
    """One token's Σ_k weights[0,k] · E_{experts[0,k]}(x), a float32 sum in k order rounded to x's dtype
    (``switched_routed_experts`` for T = 1). ``early_rows`` [K, D] / ``early`` [K]: outputs computed before
    (``one_token_expert_rows``, e.g. while the other experts were still being paged in) are taken for the
    positions ``early`` marks, whose ``experts`` entry is then -1; the sum is the same, bit for bit.
    ``biases``: GPT-OSS's bias tables aligned with ``el`` (``expert_biases``)."""
    branches = None if el.stacked else _expert_branches(act, el.n_experts)

    def body(k, acc):
        y = _one_expert(act, branches, el, x, experts[0, k], biases)
        if early_rows is not None:
            y = jnp.where(early[k], early_rows[k][None], y)
        return acc + y * weights[0, k].astype(jnp.float32)

    out = jax.lax.fori_loop(0, experts.shape[1], body, jnp.zeros((1, x.shape[-1]), jnp.float32))
    return out.astype(x.dtype)


def one_token_expert_rows(act, el: layout.ExpertList, x, experts, biases: dict | None = None):
    """Each of one token's K expert outputs [K, D] float32 (zero where ``experts[0,k]`` < 0), as
    ``one_token_expert_sum`` computes them: the part of the sum that can run before the rest is ready."""
    K = experts.shape[1]
    branches = None if el.stacked else _expert_branches(act, el.n_experts)

    def body(k, rows):
        return rows.at[k].set(_one_expert(act, branches, el, x, experts[0, k], biases)[0])

    return jax.lax.fori_loop(0, K, body, jnp.zeros((K, x.shape[-1]), jnp.float32))


def _switched_sorted_rows(act, el: layout.ExpertList, x, experts, B: int, biases: dict | None = None):
    """The grouped loop of ``_switched_grouped``: every valid assignment's expert output, float32, in
    expert-sorted order (invalid ones zero, at the end). Returns (rows [T·K, D], order, tokens of the rows)."""
    T, K = experts.shape
    n, D = el.n_experts, x.shape[-1]
    A = T * K
    flat = experts.reshape(-1)
    key = jnp.where(flat >= 0, flat, n)  # invalid sort last and belong to no expert
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros(n + 1, jnp.int32).at[key].add(1)
    starts = jnp.cumsum(counts) - counts
    tok = order // K
    xs = jnp.concatenate([x[tok], jnp.zeros((B, D), x.dtype)])  # a chunk may read past the last row
    if el.stacked:
        def expert_on(e, rows):
            return _stacked_expert_rows(act, rows, el, e, *_gate_up_bias(biases, e))
    elif copies_experts(el):
        def expert_on(e, rows):
            return _expert_rows(act, rows, *_expert_copy(el, e), *_gate_up_bias(biases, e))
    else:
        branches = _expert_branches(act, n)[:n]

        def expert_on(e, rows):
            return jax.lax.switch(e, branches, rows, el, biases)

    def per_expert(e, y):
        start_e, end_e = starts[e], starts[e] + counts[e]

        def chunk(j, y):
            start = start_e + j * B
            rows = jax.lax.dynamic_slice_in_dim(xs, start, B)
            out = expert_on(e, rows)
            keep = (start + jnp.arange(B) < end_e)[:, None]  # rows past this expert's run are the next's
            return jax.lax.dynamic_update_slice_in_dim(
                y, jnp.where(keep, out, jax.lax.dynamic_slice_in_dim(y, start, B)), start, 0)

        return jax.lax.fori_loop(0, (counts[e] + B - 1) // B, chunk, y)

    y = jax.lax.fori_loop(0, n, per_expert, jnp.zeros((A + B, D), jnp.float32))[:A]
    return y, order, tok


def _combine_sorted(y, order, tok, experts, weights, dtype):
    """Σ_k weights · rows per token, rows ``y`` in the expert-sorted ``order`` (float32 sums, in that order)."""
    T, D = experts.shape[0], y.shape[-1]
    w = jnp.where(experts.reshape(-1) >= 0, weights.reshape(-1), 0)[order].astype(jnp.float32)
    out = jnp.zeros((T, D), jnp.float32).at[tok].add(y * w[:, None])
    return out.astype(dtype)


def _switched_grouped(act, el: layout.ExpertList, x, experts, weights, block_rows: int | None, biases=None):
    T, K = experts.shape
    B = block_rows or grouped_block_rows(T, K, el.n_experts)
    y, order, tok = _switched_sorted_rows(act, el, x, experts, B, biases)
    return _combine_sorted(y, order, tok, experts, weights, x.dtype)


def switched_expert_rows(el: layout.ExpertList, cfg: ModelConfig, x, experts, block_rows: int,
                         biases: dict | None = None):
    """Each assignment's expert output [T·K, D] float32, in assignment order (row t·K + k), zero where
    ``experts`` < 0. Rows computed in several calls over disjoint assignments (different expert lists: slots,
    staging buffers) add up exactly, and ``combine_expert_rows`` then sums them per token in the order
    ``switched_routed_experts`` does, so the result is that of one call over all the experts (given the same
    ``block_rows``: a row's arithmetic is that of the chunk size)."""
    y, order, _ = _switched_sorted_rows(cfg.expert_act, el, x, experts, block_rows, biases)
    return jnp.zeros_like(y).at[order].set(y)


def combine_expert_rows(rows, experts, weights, dtype):
    """``switched_routed_experts``'s weighted sum of per-assignment ``rows`` [T·K, D] (assignment order)
    for the assignments' real expert ids ``experts`` [T, K]: sorted by expert id as it sorts them."""
    flat = experts.reshape(-1)
    order = jnp.argsort(jnp.where(flat >= 0, flat, jnp.iinfo(jnp.int32).max), stable=True)
    return _combine_sorted(rows[order], order, order // experts.shape[1], experts, weights, dtype)


@functools.lru_cache(maxsize=None)
def _switched_op(act, block_rows: int | None):
    """The serving-layout dispatch with the lane-folding batching rule (``lane_folding``); its weights are the
    pair (ExpertList, bias tables or None)."""

    def plain(w, x, experts, weights):
        el, biases = w
        if experts.shape[0] == 1:
            return one_token_expert_sum(act, el, x, experts, weights, biases=biases)
        return _switched_grouped(act, el, x, experts, weights, block_rows, biases)

    op = lane_folding(plain, lambda: op)
    return op


def queue_positions(a: jax.Array, n: int) -> jax.Array:
    """Each entry's place in its value's queue, in order: ``a`` [M] int in [0, n) -> [M], 0 for the first
    entry with its value, 1 for the second... One stable sort, not the running count of a one-hot [M, n]
    matrix: 2x faster on the CPU at a 64x1024 batch, top-8 of 64, and no [M, n] intermediate (134 MB there)."""
    order = jnp.argsort(a, stable=True)
    counts = jnp.bincount(a, length=n)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(a.shape[0], dtype=a.dtype) - starts[a[order]].astype(a.dtype)
    return jnp.zeros_like(a).at[order].set(ranked)


def capacity_experts(p: dict, cfg: ModelConfig, x: jax.Array, experts: jax.Array, weights: jax.Array,
                     capacity: int) -> tuple[jax.Array, jax.Array]:
    """Capacity-based sparse MoE over S tokens (training; drops assignments past the capacity): x [S, D], experts/weights [S, K].

    Assignments are queued per expert, first choices of all tokens before second choices (Switch
    priority); each expert takes at most ``capacity`` of them, computed as one batched matmul over
    [N, capacity, D]. Returns (output [S, D], fraction of assignments dropped). With
    ``capacity >= S`` nothing is dropped and the result equals ``routed_experts``."""
    S, K = experts.shape
    N, D = cfg.n_experts, x.shape[-1]
    a = experts.T.reshape(-1)  # [K*S], k-major
    tok = jnp.tile(jnp.arange(S), K)
    w = weights.T.reshape(-1)
    pos = queue_positions(a, N)
    keep = pos < capacity
    slot = jnp.where(keep, a * capacity + pos, N * capacity)  # dropped -> a dummy slot
    xin = jnp.zeros((N * capacity + 1, D), x.dtype).at[slot].set(x[tok])[:-1].reshape(N, capacity, D)
    gb, ub, db = (p[k][:, None] if k in p else None for k in EXPERT_BIASES)
    h = glu(cfg.expert_act, _plus(jnp.einsum("ecd,edf->ecf", xin, p["gate"]), gb),
            _plus(jnp.einsum("ecd,edf->ecf", xin, p["up"]), ub))
    y = _plus(jnp.einsum("ecf,efd->ecd", h, p["down"]), db).reshape(N * capacity, D)
    y = jnp.concatenate([y, jnp.zeros((1, D), y.dtype)])
    contrib = y[slot] * (w * keep).astype(y.dtype)[:, None]
    return jnp.zeros((S, D), y.dtype).at[tok].add(contrib), jnp.mean(~keep)


def router_logits(p: dict, x: jax.Array) -> jax.Array:
    """[T, N] float32 router logits (DeepSeek computes them in float32; equal for fp32 weights), + GPT-OSS's bias."""
    z = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    return z + p["router_bias"].astype(jnp.float32) if "router_bias" in p else z


def shared_experts(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return combine_shared(*shared_expert_parts(p, cfg, x))


def shared_expert_parts(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple:
    """The shared experts' MLP output and their sigmoid gate (Qwen2-MoE; None without one), apart: a caller that
    computes them early (the host pager) applies the gate where ``shared_experts`` would, so that XLA fuses the
    product into the same sum and rounds it the same way."""
    gate = jax.nn.sigmoid(x @ p["shared_gate"]) if "shared_gate" in p else None
    return dense_mlp(p["shared"], cfg, x), gate


def combine_shared(y: jax.Array, gate) -> jax.Array:
    return y if gate is None else gate * y


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """The embedding rows of ``tokens``. XLA:CPU gathers bf16 from an f32 conversion of the table (fused:
    only the rows gathered are converted), but inside a loop it hoists that conversion out as loop-
    invariant: an f32 copy of the whole table every decode chunk (80 ms at a 50k vocabulary). Tying the
    table to the tokens in one optimisation barrier keeps the conversion in the loop, fused."""
    table, tokens = jax.lax.optimization_barrier((params["embed"], tokens))
    return table[tokens]


def scale_embeddings(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Embedding rows × Granite's ``embedding_multiplier``, in the table's dtype as HF multiplies (1: unchanged)."""
    return x if cfg.embedding_multiplier == 1.0 else x * cfg.embedding_multiplier


def scale_logits(cfg: ModelConfig, logits: jax.Array) -> jax.Array:
    """LM-head outputs ÷ Granite's ``logits_scaling``, in the head's dtype as HF divides (1: unchanged)."""
    return logits if cfg.logits_scaling == 1.0 else logits / cfg.logits_scaling


def embed_scaled(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The embeddings a model's first layer reads (``embed``, ``scale_embeddings``)."""
    return scale_embeddings(cfg, embed(params, tokens))


def residual(cfg: ModelConfig, x: jax.Array, y: jax.Array) -> jax.Array:
    """The residual stream after a block whose output is ``y``: x + y (Granite: x + y × residual_multiplier).
    A multiplier of 1 adds nothing to the program, so the other families keep their bits."""
    return x + (y if cfg.residual_multiplier == 1.0 else y * cfg.residual_multiplier)


def output_logits(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Float32 logits of the final-normed hidden states ``x``: the LM head (+ Phi-MoE's bias), ``scale_logits``."""
    return scale_logits(cfg, linear(x, lm_head(params, cfg), params.get("lm_head_bias"))).astype(jnp.float32)


def lm_head(params: Params, cfg: ModelConfig):
    """The output projection: ``lm_head``, or the embedding (``[V, D]``, already ``[out, in]``) when tied
    (or its int8 copy, when the serving layout quantised the matrices)."""
    if not cfg.tie_word_embeddings:
        return params["lm_head"]
    return params[layout.TIED_INT8_HEAD] if layout.TIED_INT8_HEAD in params else layout.OutIn(params["embed"])


# ------------------------------------------------------------------------------------------- forward
def selection_biases(params: Params, cfg: ModelConfig) -> jax.Array | None:
    """The MoE layers' selection biases [L, N] float32 (the ``e_score_correction_bias`` of DeepSeek-V3, GLM-4.5,
    dots.llm1 and ERNIE-4.5), None for the families without one. Cache routers carry them in their routing state
    (``routing.RoutingState.bias``)."""
    layers = [params["layers"][i]["moe"] for i in cfg.moe_layer_ids]
    if not layers or "score_bias" not in layers[0]:
        return None
    return jnp.stack([jnp.asarray(p["score_bias"], jnp.float32) for p in layers])


def require_selection_biases(cfg: ModelConfig, biases) -> None:
    """Refuse to route a model whose gating chooses with selection biases without them: unbiased routing would
    silently be another model (``original_router``, ``simulate.init_router_state``)."""
    if biases is None and getattr(cfg.gating, "needs_bias", False):
        raise ValueError(f"{cfg.model_type} chooses experts with per-layer selection biases: pass them "
                         "(model.selection_biases(params, cfg))")


def original_router(cfg: ModelConfig, biases: jax.Array | None = None) -> RouterHook:
    """The architecture's own routing, with no cache: the reference every policy is compared with
    (``biases``: ``selection_biases``, for the gatings that have them)."""
    require_selection_biases(cfg, biases)

    def hook(moe_index: int, z: jax.Array, state: Any):
        experts, weights = original_routing(cfg.gating, z, None if biases is None else biases[moe_index])
        return experts, weights, state, {}

    return hook


@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # [T, V]
    router_logits: jax.Array  # [moe_layers, T, N]
    experts: jax.Array  # [moe_layers, T, K], highest weight first
    weights: jax.Array  # [moe_layers, T, K]
    records: dict  # router hook records, each stacked to [moe_layers, T, ...]
    kv: Any
    router_state: Any


jax.tree_util.register_dataclass(
    ForwardOutput,
    data_fields=["logits", "router_logits", "experts", "weights", "records", "kv", "router_state"],
    meta_fields=[],
)


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: jax.Array,
    pos0: jax.Array | int = 0,
    kv: list | None = None,
    router: RouterHook | None = None,
    router_state: Any = None,
    last_logits_only: bool = False,
) -> ForwardOutput:
    """Run ``tokens`` [T] at positions ``pos0..pos0+T-1``.

    With ``kv`` (from ``init_kv``) the new keys/values are written at ``pos0`` and attention covers the
    cache; without it attention covers ``tokens`` alone (teacher-forced pass). ``last_logits_only``: the
    logits of the last position only ([1, V]; a prefill needs no more, and the LM head is the largest
    matrix)."""
    router = router or original_router(cfg, selection_biases(params, cfg))
    T = tokens.shape[0]
    positions = jnp.asarray(pos0, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
    cos, sin = rope_tables(cfg, positions)
    x = embed_scaled(params, cfg, tokens)
    attend = mla_attention if cfg.mla else gqa_attention
    new_kv, zs, es, ws, recs = [], [], [], [], []
    moe_index = 0
    wants = getattr(router, "wants_prediction", None)
    predict = bool(wants is not None and wants(router_state))
    moe_ids = [i for i in range(len(params["layers"])) if cfg.moe_layers[i]]
    compute = getattr(router, "compute", None)
    z_pred = None
    for i, lp in enumerate(params["layers"]):
        a, layer_kv = attend(lp["attn"], cfg, i, norm(x, lp["attn_norm"], cfg), cos, sin, positions,
                             None if kv is None else kv[i], pos0)
        new_kv.append(layer_kv)
        x = residual(cfg, x, a)
        h = norm(x, lp["mlp_norm"], cfg)
        if cfg.moe_layers[i]:
            p = lp["moe"]
            z = router_logits(p, h)
            if predict:
                experts, weights, router_state, rec = router(moe_index, z, router_state, z_pred=z_pred)
                if moe_index + 1 < len(moe_ids):  # the next MoE layer's router on this hidden state
                    nxt = params["layers"][moe_ids[moe_index + 1]]
                    z_pred = router_logits(nxt["moe"], norm(x, nxt["mlp_norm"], cfg))
            else:
                experts, weights, router_state, rec = router(moe_index, z, router_state)
            if compute is not None:
                y, router_state = compute(moe_index, p, cfg, h, experts, weights, rec, router_state)
            else:
                y = routed_experts(p, cfg, h, experts, weights)
            if "shared" in p:
                y = y + shared_experts(p, cfg, h)
            zs.append(z), es.append(experts), ws.append(weights), recs.append(rec)
            moe_index += 1
        else:
            y = dense_mlp(lp["mlp"], cfg, h)
        x = residual(cfg, x, y)
    x = norm(x[-1:] if last_logits_only else x, params["final_norm"], cfg)
    logits = output_logits(params, cfg, x)
    records = jax.tree.map(lambda *r: jnp.stack(r), *recs) if recs and recs[0] else {}
    return ForwardOutput(
        logits=logits,
        router_logits=jnp.stack(zs) if zs else jnp.zeros((0, T, cfg.n_experts)),
        experts=jnp.stack(es) if es else jnp.zeros((0, T, cfg.top_k), jnp.int32),
        weights=jnp.stack(ws) if ws else jnp.zeros((0, T, cfg.top_k)),
        records=records,
        kv=None if kv is None else new_kv,
        router_state=router_state,
    )


def forward_sequential(params: Params, cfg: ModelConfig, tokens: jax.Array, pos0, kv: list, router=None,
                       router_state: Any = None) -> ForwardOutput:
    """``forward`` one token at a time (a ``lax.scan`` over the KV-cache path), so every token routes with
    the router state left by the previous one in *all* layers — what a global expert cache needs.
    Outputs are laid out as ``forward``'s ([moe_layers, T, ...])."""

    def step(carry, inp):
        kv, state = carry
        pos, tok = inp
        out = forward(params, cfg, tok[None], pos, kv, router, state)
        keep = (out.logits[0], out.router_logits[:, 0], out.experts[:, 0], out.weights[:, 0],
                jax.tree.map(lambda r: r[:, 0], out.records))
        return (out.kv, out.router_state), keep

    positions = jnp.asarray(pos0, jnp.int32) + jnp.arange(tokens.shape[0], dtype=jnp.int32)
    (kv, state), (logits, z, e, w, rec) = jax.lax.scan(step, (kv, router_state), (positions, tokens))
    swap = lambda a: jnp.swapaxes(a, 0, 1)  # noqa: E731  [T, L, ...] -> [L, T, ...]
    return ForwardOutput(logits, swap(z), swap(e), swap(w), jax.tree.map(swap, rec), kv, state)


KV_BITS = jnp.uint16  # how a bfloat16 KV cache is held (init_kv)


def init_kv(cfg: ModelConfig, max_len: int, dtype=jnp.float32) -> list[dict]:
    """An empty KV cache for ``max_len`` positions (MLA: compressed latent + shared rotary key).

    A bfloat16 cache is held as its bit patterns (``KV_BITS``, the same bytes; ``cache_values`` reads them):
    XLA:CPU writes a row into a bfloat16 array by widening the whole array to float32 and back, so each
    token rewrote every layer's whole cache (5.5 ms a write at 65,536 rows of 8 heads of 128), while an
    integer row is written in place (0.1 ms)."""
    if cfg.mla:
        shape = {"latent": (max_len, cfg.kv_lora_rank), "k_pe": (max_len, cfg.qk_rope_head_dim)}
    else:
        shape = {"k": (max_len, cfg.num_kv_heads, cfg.head_dim), "v": (max_len, cfg.num_kv_heads, cfg.head_dim)}
    stored = KV_BITS if jnp.dtype(dtype) == jnp.bfloat16 else dtype
    return [{k: jnp.zeros(s, stored) for k, s in shape.items()} for _ in range(cfg.num_layers)]
