"""The training recipe of a moejax model: the architecture presets, initialisation, the loss (cross-entropy +
the router losses), the learning-rate schedule, the optimizer, and the jitted train/eval steps that
``train`` loops over. The forward is the pure ``moejax.models.model.forward`` (vmapped over the batch) with
the architecture's own routing, so what is trained is exactly what inference runs; a capacity-bounded
sparse forward (``sparse_batch_forward``) is the fast path for training at scale.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moejax.models import checkpoint, model as M
from moejax.models import attention as attention_lib
from moejax.models import moe as moe_lib
from moejax.models import ops as ops_lib
from moejax.models.config import ModelConfig
from moejax.models.gating import original_routing
from moejax.models.model import forward
from moejax.training import data

# name -> (hidden, layers, heads, kv heads, head_dim, experts, top_k, expert ffn)
CONFIGS = {
    "micro": (32, 2, 4, 2, 8, 8, 2, 16),
    "tiny": (128, 2, 4, 2, 32, 32, 4, 64),
    "small": (256, 4, 8, 4, 32, 32, 4, 112),
    "medium": (384, 6, 12, 4, 32, 64, 8, 96),
    # the GPU-trained default model's: OLMoE-like granularity, 64 experts top-8, ~30M parameters
    "granular": (384, 8, 6, 2, 64, 64, 8, 40),
}


def hf_config(name: str = "small", vocab_size: int = data.DEFAULT_VOCAB, max_len: int = 1024,
              eos_id: int = 0, **overrides) -> dict:
    """A Qwen3-MoE ``config.json`` dict for one of ``CONFIGS`` (what transformers loads)."""
    d, layers, heads, kv, hd, n, k, f = CONFIGS[name]
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab_size,
        "hidden_size": d, "intermediate_size": 4 * f, "moe_intermediate_size": f, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "num_experts": n,
        "num_experts_per_tok": k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": max_len,
        "tie_word_embeddings": True, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": False, "sliding_window": None, "initializer_range": 0.02,
        "router_aux_loss_coef": 0.01, "output_router_logits": False, "use_cache": True,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": None,
    }
    hf.update(overrides)
    return hf


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> dict:
    """Normal(0, std) matrices (output projections scaled by 1/sqrt(2·layers)), ones for norm scales."""
    shapes = checkpoint.abstract_params(cfg, jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    out_std = std / np.sqrt(2 * cfg.num_layers)
    values = []
    for (path, leaf), k in zip(leaves, keys):
        name = str(getattr(path[-1], "key", path[-1]))
        if name in ("scale", "q_norm", "k_norm"):
            values.append(jnp.ones(leaf.shape, leaf.dtype))
        else:
            s = out_std if name in ("o", "down") else std
            values.append(s * jax.random.normal(k, leaf.shape, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, values)


# ---------------------------------------------------------------------------------------- the loss
def load_balancing_loss(router_logits: jax.Array, experts: jax.Array, n_experts: int) -> jax.Array:
    """Switch/Qwen auxiliary loss per MoE layer, averaged over layers: ``N · Σ_i f_i · P_i``.

    router_logits [L, ..., N], experts [L, ..., K]. It is 1 for perfectly uniform routing."""
    L = router_logits.shape[0]
    probs = jax.nn.softmax(router_logits.reshape(L, -1, n_experts).astype(jnp.float32), -1)
    onehot = jax.nn.one_hot(experts.reshape(L, -1, experts.shape[-1]), n_experts, dtype=jnp.float32)
    f = jax.lax.stop_gradient(onehot.sum(-2).mean(-2) / experts.shape[-1])  # [L, N], sums to 1
    P = probs.mean(-2)  # [L, N]
    return (n_experts * jnp.sum(f * P, -1)).mean()


def router_z_loss(router_logits: jax.Array) -> jax.Array:
    """ST-MoE router z-loss ``mean(logsumexp(z)^2)``: keeps router logits small, so the softmax stays
    soft and the router cannot lock onto a few experts early in training."""
    return jnp.mean(jax.nn.logsumexp(router_logits.astype(jnp.float32), -1) ** 2)


def router_offset_loss(router_logits: jax.Array) -> jax.Array:
    """Spread across experts of the batch-mean router logit, per MoE layer, averaged.

    Early in training the residual stream is dominated by one direction shared by every token (the model
    learns unigram statistics first), so ``z = W·h`` ranks the experts alike for all tokens and the router
    collapses onto K of them. The batch mean of ``z`` is the router's response to that shared direction;
    asking it to be equal for all experts keeps routing decided by what differs between tokens."""
    L, N = router_logits.shape[0], router_logits.shape[-1]
    mean = router_logits.reshape(L, -1, N).astype(jnp.float32).mean(1)  # [L, N]
    return jnp.mean(jnp.var(mean, -1))


def cast_params(params, dtype):
    """Mixed precision: every weight in ``dtype`` except the routers (routing decisions in float32)."""
    if dtype is None:
        return params

    def cast(path, x):
        return x if any(getattr(k, "key", None) == "router" for k in path) else x.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


def batched_attention(lp: dict, cfg: ModelConfig, h: jax.Array, cos, sin, implementation: str | None):
    """Causal grouped-query attention over a batch [B, T, D] with ``jax.nn.dot_product_attention``
    (``implementation`` None lets JAX pick a fused kernel, e.g. cuDNN flash attention on GPUs)."""
    q, k, v = attention_lib.gqa_qkv(lp, cfg, h, cos, sin)
    out = jax.nn.dot_product_attention(q, k, v, scale=cfg.attn_scale, is_causal=True,
                                       implementation=implementation)
    B, T = h.shape[:2]
    return ops_lib.linear(out.reshape(B, T, -1), lp["o"], lp.get("o_bias"))


def batch_forward(params, cfg: ModelConfig, tokens: jax.Array):
    """``model.forward`` vmapped over a batch of sequences [B, T] -> (logits [B,T,V], router logits
    [L,B,T,N], experts [L,B,T,K], dropped fraction 0). Exact, but every expert runs on every token."""
    out = jax.vmap(lambda t: forward(params, cfg, t))(tokens)
    return (out.logits, jnp.moveaxis(out.router_logits, 1, 0), jnp.moveaxis(out.experts, 1, 0),
            jnp.zeros((), jnp.float32))


def sparse_batch_forward(params, cfg: ModelConfig, tokens: jax.Array, capacity_factor: float,
                         attention: str = "model"):
    """The decoder of ``moejax.models.model`` over [B, T] with capacity-based sparse experts (batch-wide
    capacity ``ceil(capacity_factor · B·T·K / N)``); routing is ``model``'s own function. ``attention``:
    "model" = ``attention.gqa_attention`` per sequence; "auto" / "xla" / "cudnn" = ``batched_attention``
    (full causal attention only: no sliding windows, no MLA)."""
    B, T = tokens.shape
    S = B * T
    capacity = min(S, int(np.ceil(capacity_factor * S * cfg.top_k / cfg.n_experts)))
    positions = jnp.arange(T, dtype=jnp.int32)
    cos, sin = attention_lib.rope_tables(cfg, positions)
    x = M.scale_embeddings(cfg, params["embed"][tokens])  # [B, T, D]
    zs, es, drops = [], [], []
    fused = attention != "model"
    if fused and (cfg.mla or any(cfg.sliding_windows)):
        raise ValueError("batched attention supports full causal grouped-query attention only")
    for i, lp in enumerate(params["layers"]):
        if fused:
            x = M.residual(cfg, x, batched_attention(lp["attn"], cfg, ops_lib.norm(x, lp["attn_norm"], cfg), cos, sin,
                                                     None if attention == "auto" else attention))
        else:
            attend = lambda h: attention_lib.gqa_attention(lp["attn"], cfg, i, h, cos, sin, positions, None, 0)[0]  # noqa: E731,B023
            x = M.residual(cfg, x, jax.vmap(attend)(ops_lib.norm(x, lp["attn_norm"], cfg)))
        h = ops_lib.norm(x, lp["mlp_norm"], cfg).reshape(S, -1)
        z = moe_lib.router_logits(lp["moe"], h)
        e, w = original_routing(cfg.gating, z, lp["moe"].get("score_bias"))
        y, drop = moe_lib.capacity_experts(lp["moe"], cfg, h, e, w, capacity)
        x = M.residual(cfg, x, y.reshape(B, T, -1))
        zs.append(z.reshape(B, T, -1)), es.append(e.reshape(B, T, -1)), drops.append(drop)
    x = ops_lib.norm(x, params["final_norm"], cfg)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return M.scale_logits(cfg, x @ head).astype(jnp.float32), jnp.stack(zs), jnp.stack(es), jnp.stack(drops).mean()


def loss_fn(params, cfg: ModelConfig, batch: jax.Array, aux_coef: float, capacity_factor: float = 0.0,
            z_coef: float = 0.0, compute_dtype=None, attention: str = "model", offset_coef: float = 0.0):
    """batch [B, T+1] int32 -> (total loss, metrics). ``capacity_factor`` 0: exact dense experts
    (``model.forward``); > 0: capacity-based sparse experts (3-4x cheaper for 32 experts, top-4).
    ``compute_dtype`` (e.g. bfloat16): mixed precision, float32 master weights and routers."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    p = cast_params(params, compute_dtype)
    if capacity_factor > 0:
        logits, z, e, dropped = sparse_batch_forward(p, cfg, inputs, capacity_factor, attention)
    else:
        logits, z, e, dropped = batch_forward(p, cfg, inputs)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
    ce = -jnp.take_along_axis(logp, targets[..., None], -1).mean()
    aux = load_balancing_loss(z, e, cfg.n_experts)
    zloss = router_z_loss(z)
    offset = router_offset_loss(z)
    load = jax.nn.one_hot(e.reshape(e.shape[0], -1), cfg.n_experts).mean(1)  # [L, N] share of slots
    metrics = {"ce": ce, "aux": aux, "z_loss": zloss, "offset_loss": offset, "min_load": load.min() * cfg.n_experts,
               "max_load": load.max() * cfg.n_experts, "dead_experts": jnp.sum(load == 0) / load.shape[0],
               "dropped": dropped}
    return ce + aux_coef * aux + z_coef * zloss + offset_coef * offset, metrics


def lr_at(step, total, peak: float, warmup: int, min_lr_ratio: float = 0.1):
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps, then cosine
    decay to ``min_lr_ratio · peak`` at ``total``. ``step`` and ``total`` may be traced: a run whose length
    is fixed by a time budget (``--steps auto``) sets ``total`` once it has measured its speed."""
    step = jnp.asarray(step, jnp.float32)
    total = jnp.maximum(jnp.asarray(total, jnp.float32), warmup + 1)
    warm = peak * step / max(1, warmup)
    frac = jnp.clip((step - warmup) / (total - warmup), 0.0, 1.0)
    cos = peak * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + jnp.cos(jnp.pi * frac)))
    return jnp.where(step < warmup, warm, cos)


def make_optimizer(weight_decay: float = 0.1, clip: float = 1.0):
    """Clipping + AdamW with unit learning rate: the scheduled rate (and the router's scale) multiply
    its updates in ``train_step``, which is exactly AdamW with that rate (decoupled weight decay)."""
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731  no decay on norm scales
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(1.0, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask))


def _is_router(path) -> bool:
    return any(getattr(k, "key", None) == "router" for k in path)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Everything a compiled training step depends on (hashable: one compilation per distinct value)."""

    lr: float
    warmup: int
    weight_decay: float = 0.1
    clip: float = 1.0
    aux_coef: float = 0.5
    aux_coef_start: float | None = None  # balancing weight at step 0, decaying linearly to aux_coef
    aux_decay_steps: int = 0
    z_coef: float = 0.0
    offset_coef: float = 0.0
    offset_decay_steps: int = 0  # > 0: the offset penalty fades linearly to 0 over these first steps
    router_lr_scale: float = 1.0
    capacity_factor: float = 0.0
    eval_capacity_factor: float = 0.0
    compute_dtype: str | None = None
    attention: str = "model"
    min_lr_ratio: float = 0.1


def aux_coef_at(step, sc: StepConfig):
    """Balancing-loss weight at ``step``: ``aux_coef``, or a linear decay from ``aux_coef_start`` to it over
    the first ``aux_decay_steps`` steps. An untrained model's tokens share most of their MLP input, so they
    all rank the experts alike; a strong balancing push while representations form keeps the router
    spread, and the small standard weight takes over once experts have specialised."""
    if sc.aux_coef_start is None or sc.aux_decay_steps <= 0:
        return jnp.float32(sc.aux_coef)
    return _linear(step, sc.aux_coef_start, sc.aux_coef, sc.aux_decay_steps)


def offset_coef_at(step, sc: StepConfig):
    """Offset-penalty weight at ``step``: ``offset_coef``, or with ``offset_decay_steps`` a linear fade from it
    to 0 over those steps. The penalty is for the collapse of an untrained router (every token ranking the
    experts alike); kept on, it also holds every expert's mean logit equal for good, and usage stays near
    uniform (the H200 run: 98.5-99.4 % of the maximum entropy, where real MoEs are less even)."""
    if sc.offset_decay_steps <= 0:
        return jnp.float32(sc.offset_coef)
    return _linear(step, sc.offset_coef, 0.0, sc.offset_decay_steps)


def _linear(step, start: float, end: float, steps: int):
    """``start`` at step 0, linear to ``end`` at ``steps``, ``end`` after (float32)."""
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / steps, 0.0, 1.0)
    return jnp.float32(start) + (end - start) * frac


def make_steps(cfg: ModelConfig, opt, sc: StepConfig):
    dtype = None if sc.compute_dtype in (None, "float32") else jnp.dtype(sc.compute_dtype)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, step, total):
        aux_coef, offset_coef = aux_coef_at(step, sc), offset_coef_at(step, sc)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, cfg, batch, aux_coef, sc.capacity_factor, sc.z_coef, dtype, sc.attention, offset_coef)
        updates, opt_state = opt.update(grads, opt_state, params)
        lr = lr_at(step, total, sc.lr, sc.warmup, sc.min_lr_ratio)
        updates = jax.tree_util.tree_map_with_path(
            lambda path, u: u * (lr * (sc.router_lr_scale if _is_router(path) else 1.0)).astype(u.dtype), updates)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads), "lr": lr,
                                   "aux_coef": aux_coef, "offset_coef": offset_coef}

    @jax.jit
    def eval_step(params, batch):
        return loss_fn(params, cfg, batch, sc.aux_coef, sc.eval_capacity_factor, sc.z_coef, dtype, sc.attention,
                       sc.offset_coef)[1]

    return train_step, eval_step


@functools.lru_cache(maxsize=8)
def compiled_steps(cfg: ModelConfig, sc: StepConfig):
    """Optimizer and jitted steps, shared by runs with the same settings in one process (tests)."""
    opt = make_optimizer(sc.weight_decay, sc.clip)
    return (opt, *make_steps(cfg, opt, sc))
