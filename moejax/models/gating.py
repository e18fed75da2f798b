"""How each architecture turns router logits into a ranking and mixing weights.

docs/design.md §2: a routing policy only changes the *ranking*; the K experts chosen are the first K of it, and
their mixing weights always come from the **original** logits through the architecture's own weighting.
Each gating here therefore offers three pure functions:

- ``ranking(z)``: experts in the architecture's order of preference (``ranking(z)[:K]`` is exactly what
  Hugging Face selects);
- ``probs(z)``: the router probabilities (what cumsum thresholds accumulate);
- ``weights(z, chosen, valid)``: the mixing weights the architecture gives ``chosen`` from logits ``z``.

DeepSeek-V3's and ERNIE-4.5's gatings also rank by a per-layer *selection bias* (``e_score_correction_bias``, a
weight of the model, not of the configuration): ``ranking(z, bias)`` takes that layer's [N] bias, which changes
which experts are chosen but never their weights. The other gatings take ``bias=None`` and have none.

Gatings are frozen dataclasses so they can be static arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from moejax.base import xla
from moejax.base.errors import Failure


# rows x N^2 above which descending_order sorts on the CPU (there, 1,024 x 64 compare faster than they sort,
# 4,096 x 64 sort faster); on accelerators it always sorts: a training batch's [65536, 64, 64] comparison
# fusion (per-sequence [1024, 64] under vmap) took Triton 2.5 minutes to compile on an H200, twice
PAIRWISE_LIMIT = 1 << 24


def descending_order(scores: jax.Array, first: jax.Array | None = None) -> jax.Array:
    """Indices that sort ``scores`` from highest to lowest; ties go to the lower index (like torch.topk);
    NaN ranks last, so the result is always a permutation. ``first`` (bool, like ``scores``): those entries
    rank ahead of all others, each part by score (a two-key order, exact where adding an offset to the scores
    would round close ones together).

    Computed by pairwise comparison instead of ``argsort`` where that is small: N is at most a few hundred
    experts, and inside the per-token routing scan a sort costs ~50 µs on XLA:CPU while N² compares cost
    ~1 µs. Large batches on the CPU, and every batch elsewhere, sort: the same order (tested), without an
    N² intermediate."""
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    return jax.lax.platform_dependent(scores, first, cpu=_order_on_cpu, default=order_by_sort)


def _order_on_cpu(scores: jax.Array, first: jax.Array | None = None) -> jax.Array:
    rows, n = int(np.prod(scores.shape[:-1], dtype=np.int64)), scores.shape[-1]
    return order_by_sort(scores, first) if rows * n * n > PAIRWISE_LIMIT else order_by_comparison(scores, first)


def order_by_comparison(scores: jax.Array, first: jax.Array | None = None) -> jax.Array:
    """``descending_order`` of NaN-free ``scores`` by N² comparisons.

    The scores are read from a buffer (``xla.materialised``): fused into the comparison, the expression that
    made them (cache-prior's ``z + λ·Δ``) was computed once per side of each pair, the two could round apart,
    and an expert then ranked ahead of itself: positions collided, the one-hot below summed two expert ids
    into one that does not exist, and decode read NaN (the shipped model's GSM8K study at λ = 0.3, session
    18; at N = 64 half of random cache-prior steps, none at N = 32)."""
    scores = xla.materialised(scores)
    idx = jnp.arange(scores.shape[-1])
    s_i, s_j = scores[..., :, None], scores[..., None, :]
    ahead = (s_j > s_i) | ((s_j == s_i) & (idx[None, :] < idx[:, None]))  # [.., i, j]: j ranks before i
    if first is not None:
        f_i, f_j = first[..., :, None], first[..., None, :]
        ahead = (f_j & ~f_i) | ((f_j == f_i) & ahead)
    position = jnp.sum(ahead, axis=-1)  # rank of expert i
    onehot = position[..., None, :] == idx[:, None]  # [.., r, i]: expert i sits at rank r
    return jnp.sum(jnp.where(onehot, idx[None, :], 0), axis=-1).astype(jnp.int32)


def order_by_sort(scores: jax.Array, first: jax.Array | None = None) -> jax.Array:
    """``descending_order`` of NaN-free ``scores`` by one stable sort of the negated scores (-0.0 made 0.0
    first: the comparison above finds them equal, a sort's total order need not)."""
    neg = -jnp.where(scores == 0, 0.0, scores).astype(jnp.float32)
    idx = jnp.broadcast_to(jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape)
    if first is not None:
        keys = (jnp.where(first, 0, 1).astype(jnp.int32), neg, idx)
        return jax.lax.sort(keys, dimension=scores.ndim - 1, num_keys=2, is_stable=True)[2]
    return jax.lax.sort((neg, idx), dimension=scores.ndim - 1, num_keys=1, is_stable=True)[1]


class NonFiniteError(Failure):
    """Router logits (or model outputs) that are NaN or infinite: damaged weights or an overflow."""


def check_finite(values, what: str = "router logits", cfg=None, layer_names=None) -> None:
    """Raise ``NonFiniteError`` naming the first layer and token where ``values`` [L, T, ...] is not finite
    (host-side check of a pass's outputs: NaN routing must not pass for a result). With ``cfg`` the MoE
    layers are named with their model layer."""
    if cfg is not None and layer_names is None:
        layer_names = [f"MoE layer {j} (model layer {i})" for j, i in enumerate(cfg.moe_layer_ids)]
    v = np.asarray(values)
    if v.size == 0 or np.isfinite(v).all():
        return
    bad = ~np.isfinite(v.reshape(v.shape[0], v.shape[1], -1)).all(-1)  # [L, T]
    layer, token = (int(i[0]) for i in np.nonzero(bad))
    name = f"MoE layer {layer}" if layer_names is None else layer_names[layer]
    kind = "NaN" if np.isnan(v[layer, token]).any() else "infinite"
    raise NonFiniteError(f"{what} of {name} are {kind} at token {token} (damaged weights, or an overflow in "
                         "this dtype); refusing to report a result computed from them")


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, jnp.maximum(idx, 0), axis=-1)


class _RankByLogits:
    """Shared by gatings that rank experts by their logits and expose softmax probabilities."""

    def probs(self, z: jax.Array) -> jax.Array:
        return jax.nn.softmax(z.astype(jnp.float32), axis=-1)

    def ranking(self, z: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        return descending_order(z.astype(jnp.float32))


@dataclasses.dataclass(frozen=True)
class SoftmaxTopK(_RankByLogits):
    """softmax over all experts, top-K, optionally renormalised over the chosen ones, then scaled.

    Mixtral (normalize=True), Qwen1.5/Qwen3-MoE and OLMoE (``norm_topk_prob``), DeepSeek-V2 greedy
    (``routed_scaling_factor`` as ``scale``).
    """

    n_experts: int
    top_k: int
    normalize: bool
    scale: float = 1.0
    norm_eps: float = 0.0

    def weights(self, z: jax.Array, chosen: jax.Array, valid: jax.Array | None = None,
                probs: jax.Array | None = None) -> jax.Array:
        """``probs``: ``self.probs(z)`` when the caller has it (``fenced_probs``: the same bits in every program)."""
        if valid is None:
            valid = chosen >= 0
        w = jnp.where(valid, _take(self.probs(z) if probs is None else probs, chosen), 0.0)
        if self.normalize:
            w = self.renormalised(w)
        return w * self.scale

    def renormalised(self, w: jax.Array) -> jax.Array:
        """The chosen experts' probabilities ``w`` divided by their sum (+ ``norm_eps``)."""
        return w / (jnp.sum(w, axis=-1, keepdims=True) + self.norm_eps)


@dataclasses.dataclass(frozen=True)
class GroupLimited(SoftmaxTopK):
    """DeepSeek-V2 ``group_limited_greedy``: only experts of the ``topk_group`` best groups compete.

    A group's score is the best probability inside it. The ranking lists the experts of the chosen groups
    first (by probability), then the rest (by probability), so its first K is exactly HF's choice (a two-key
    order: adding 2 to the chosen groups' probabilities, as before, rounded ones within 2.4e-7 of each other
    together and ordered them by index).
    """

    n_group: int = 1
    topk_group: int = 1

    def ranking(self, z: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        p = self.probs(z)
        grouped = p.reshape(*p.shape[:-1], self.n_group, self.n_experts // self.n_group)
        group_best = grouped.max(axis=-1)
        top_groups = descending_order(group_best)[..., : self.topk_group]
        in_top = jnp.any(jnp.arange(self.n_group) == top_groups[..., :, None], axis=-2)
        expert_in_top = jnp.repeat(in_top, self.n_experts // self.n_group, axis=-1)
        return descending_order(p, first=expert_in_top)


@dataclasses.dataclass(frozen=True)
class BiasedSoftmaxTopK(SoftmaxTopK):
    """ERNIE-4.5's router: float32 softmax over all experts; experts are chosen by probability + the layer's
    selection bias (``moe_statics.e_score_correction_bias``, added to the *probabilities*); the weights are the
    chosen experts' unbiased probabilities divided by their sum, clamped below at ``norm_min``."""

    norm_min: float = 1e-12
    needs_bias = True  # a model's routing without its selection biases is not the model's (``original_router``)

    def ranking(self, z: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        p = self.probs(z)
        return descending_order(p if bias is None else p + bias.astype(jnp.float32))

    def renormalised(self, w: jax.Array) -> jax.Array:
        """``w`` divided by its sum, the sum clamped below at ``norm_min`` (transformers' ``moe_norm_min``)."""
        return w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), self.norm_min)


@dataclasses.dataclass(frozen=True)
class SparseMixer(_RankByLogits):
    """Phi-3.5-MoE ``sparsemixer`` as Hugging Face runs it in eval mode (top-2).

    For the first chosen expert c1, the weight is softmax over the logits that lie within a relative
    ``2·jitter_eps`` of z[c1] (others masked to -inf), taken at c1; for the second, c1 is masked out and
    the same is done around z[c2]. With the original ranking (c1 = argmax, c2 = second) this is HF's
    computation verbatim; for a re-ranked choice it is the same formula applied to the chosen experts.
    """

    n_experts: int
    top_k: int = 2
    jitter_eps: float = 0.01

    def _gate(self, scores: jax.Array, z: jax.Array, expert: jax.Array) -> jax.Array:
        threshold = _take(scores, expert[..., None])
        factor = jnp.maximum(jnp.abs(z), threshold)
        masked = jnp.where((threshold - z) / factor > 2 * self.jitter_eps, -jnp.inf, scores)
        return _take(jax.nn.softmax(masked, axis=-1), expert[..., None])[..., 0]

    def weights(self, z: jax.Array, chosen: jax.Array, valid: jax.Array | None = None,
                probs: jax.Array | None = None) -> jax.Array:
        """``probs`` is ignored: these weights are softmaxes of logits masked around the chosen experts."""
        if valid is None:
            valid = chosen >= 0
        z = z.astype(jnp.float32)
        c1, c2 = jnp.maximum(chosen[..., 0], 0), jnp.maximum(chosen[..., 1], 0)
        w1 = self._gate(z, z, c1)
        without_c1 = jnp.where(jnp.arange(self.n_experts) == c1[..., None], -jnp.inf, z)
        w2 = self._gate(without_c1, z, c2)
        return jnp.where(valid, jnp.stack([w1, w2], axis=-1), 0.0)


@dataclasses.dataclass(frozen=True)
class SigmoidGroupLimited:
    """DeepSeek-V3 ``noaux_tc``: sigmoid scores; experts are chosen by score + the layer's selection bias,
    only from the ``topk_group`` groups whose two best biased scores sum highest; the weights are the chosen
    experts' *unbiased* scores, renormalised (+1e-20) when ``normalize``, times ``scale``
    (``routed_scaling_factor``, applied either way as the reference and HF do).

    ``ranking(z, bias)`` lists the experts of the chosen groups first, then the rest, each by biased score, so
    its first K is HF's choice; ``probs`` are the scores normalised to sum 1 (what cumsum thresholds and a
    percentile prefetcher read)."""

    n_experts: int
    top_k: int
    normalize: bool
    scale: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    needs_bias = True  # a model's routing without its selection biases is not the model's (``original_router``)

    def scores(self, z: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(z.astype(jnp.float32))

    def probs(self, z: jax.Array) -> jax.Array:
        s = self.scores(z)
        return s / jnp.sum(s, axis=-1, keepdims=True)

    def ranking(self, z: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        choice = self.scores(z) if bias is None else self.scores(z) + bias.astype(jnp.float32)
        if self.n_group == 1 or self.topk_group >= self.n_group:
            return descending_order(choice)
        size = self.n_experts // self.n_group
        grouped = choice.reshape(*choice.shape[:-1], self.n_group, size)
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, size))[0], axis=-1)
        top_groups = descending_order(group_score)[..., : self.topk_group]
        in_top = jnp.any(jnp.arange(self.n_group) == top_groups[..., :, None], axis=-2)
        return descending_order(choice, first=jnp.repeat(in_top, size, axis=-1))

    def weights(self, z: jax.Array, chosen: jax.Array, valid: jax.Array | None = None,
                probs: jax.Array | None = None) -> jax.Array:
        """``probs`` is ignored: the weights are sigmoid scores (elementwise, the same bits in every program)."""
        if valid is None:
            valid = chosen >= 0
        w = jnp.where(valid, _take(self.scores(z), chosen), 0.0)
        if self.normalize:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * self.scale


Gating = SoftmaxTopK | GroupLimited | BiasedSoftmaxTopK | SparseMixer | SigmoidGroupLimited


def fenced_probs(gating: Gating, z: jax.Array) -> jax.Array:
    """``gating.probs(z)`` for many tokens at once, as a computation of its own. XLA fuses a softmax into its
    neighbours and lays it out for them, so its summation order (the last bit of every weight) depended on the
    program around it: cache-prior at λ = 0 differed from original routing, and a vmap over policies from
    single runs. Fenced off, the plain pass, the router's scan and a vmapped sweep compute the same bits."""
    return lax.optimization_barrier(gating.probs(lax.optimization_barrier(z)))


def original_routing(gating: Gating, z: jax.Array, bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The architecture's own top-K: expert ids [..., K] (highest weight first) and their weights (``bias``:
    the layer's selection bias, for the gatings that have one)."""
    chosen = gating.ranking(z, bias)[..., : gating.top_k]
    return sort_by_weight(chosen, gating.weights(z, chosen, probs=fenced_probs(gating, z)))


def sort_by_weight(experts: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Order chosen experts by weight, highest first (stable: equal weights keep ranking order)."""
    order = descending_order(weights)
    return jnp.take_along_axis(experts, order, -1), jnp.take_along_axis(weights, order, -1)


def spec(gating: Gating) -> dict:
    """A JSON-able description of a gating (stored in routing traces so replay can re-route)."""
    if isinstance(gating, SparseMixer):
        return {"kind": "sparsemixer", "n_experts": gating.n_experts, "top_k": gating.top_k,
                "jitter_eps": gating.jitter_eps}
    if isinstance(gating, SigmoidGroupLimited):
        return {"kind": "sigmoid-group-limited", "n_experts": gating.n_experts, "top_k": gating.top_k,
                "normalize": gating.normalize, "scale": gating.scale, "n_group": gating.n_group,
                "topk_group": gating.topk_group}
    if isinstance(gating, BiasedSoftmaxTopK):
        return {"kind": "softmax-biased", "n_experts": gating.n_experts, "top_k": gating.top_k,
                "scale": gating.scale, "norm_min": gating.norm_min}
    out = {"kind": "softmax", "n_experts": gating.n_experts, "top_k": gating.top_k,
           "normalize": gating.normalize, "scale": gating.scale, "norm_eps": gating.norm_eps}
    if isinstance(gating, GroupLimited):
        out.update(kind="group-limited", n_group=gating.n_group, topk_group=gating.topk_group)
    return out
