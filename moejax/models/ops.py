"""The layers every block is made of: norms, activations, a linear map in any weight layout, the dense MLP."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from moejax.models import layout
from moejax.models.config import ModelConfig


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


def dense_mlp(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    h = activation(cfg, linear(x, p["gate"], p.get("gate_bias"))) * linear(x, p["up"], p.get("up_bias"))
    return linear(h, p["down"], p.get("down_bias"))
