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

Optional hook attributes (all decided at trace time):
- ``router.wants_prediction(state) -> bool``: then the hook is called with ``z_pred=`` — this MoE layer's
  router applied to the previous MoE layer's post-attention hidden state (speculative prefetch); None at
  the first MoE layer.
- ``router.compute(moe_index, p, cfg, h, experts, weights, record, state) -> (y, state')``: computes the
  routed experts instead of ``routed_experts`` (offloaded slot buffers paged in-jit, low-bit copies).
- ``router.defers_access(state, T) -> bool``: then each MoE layer calls ``router.route_deferred(...)``, which
  returns the hook's four results and a fifth, what the layer left to do, and after the last layer
  ``router.access_all(state, [left, ...])`` finishes it (an expert cache whose L per-layer updates run as one).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from moejax.models import layout
from moejax.models.config import ModelConfig
from moejax.models.gating import original_routing
from moejax.models.ops import dense_mlp, linear, norm
from moejax.models.attention import gqa_attention, mla_attention, rope_tables
from moejax.models.moe import routed_experts, router_logits, shared_experts

Params = dict[str, Any]
RouterHook = Callable[[int, jax.Array, Any], tuple[jax.Array, jax.Array, Any, dict]]


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
    defers = getattr(router, "defers_access", None)
    pending = [] if defers is not None and defers(router_state, T) else None
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
            route = router if pending is None else router.route_deferred
            out = route(moe_index, z, router_state, z_pred=z_pred) if predict else route(moe_index, z, router_state)
            experts, weights, router_state, rec = out[:4]
            if pending is not None:
                pending.append(out[4])
            if predict and moe_index + 1 < len(moe_ids):  # the next MoE layer's router on this hidden state
                nxt = params["layers"][moe_ids[moe_index + 1]]
                z_pred = router_logits(nxt["moe"], norm(x, nxt["mlp_norm"], cfg))
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
    if pending:
        router_state = router.access_all(router_state, pending)
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
