"""Cache-aware routing policies (docs/design.md §2) as data, and the re-ranking they define.

A policy only ever produces a new *ranking* of the N experts; the caller takes its first K (or h-1 for
pruning) and weights them from the ORIGINAL logits. Policies are a pytree whose numeric fields are
arrays, so a hyperparameter sweep is ``jax.vmap`` over a stacked policy, while ``kind`` is static and
picks the code path at trace time.

Routing state: per MoE layer, the running sum and count of the logit range ``max(z) - min(z)`` that
cache-prior scales its bias by (Δavg). Reading chosen here (paper §3.3, eq. 10 is a running average over
"sequences and tokens"): the current token's range is added BEFORE Δavg is used, so Δavg is defined from
the very first token and equals the mean over every token seen so far, the current one included.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import flags
from moejax.base.typecheck import is_number
from moejax.experts import prior as prior_lib

KINDS = ("original", "pruning", "max-rank", "cumsum", "cache-prior", "learned-prior")
#: each policy parameter and the kinds that read it (``make_policy``): any other kind would ignore it
PARAM_KINDS = {"lam": ("cache-prior",), "delta": ("cache-prior",), "top_j": ("cache-prior", "max-rank", "cumsum"),
               "max_rank": ("max-rank",), "cumsum_p": ("cumsum",), "prune_h": ("pruning",)}
#: each parameter's default on every command line (None: the kind's own, e.g. J from K, M = K): λ = 0.5 and
#: p = 0.9, so that naming a kind changes the routing (λ = 0 or p = 0 would route exactly as original)
PARAM_DEFAULTS = {"lam": 0.5, "delta": None, "top_j": None, "max_rank": None, "cumsum_p": 0.9, "prune_h": None}
#: the float parameters' ranges on every command line and in ``--sweep`` grids (argparse types): λ·Δ is added to
#: float32 logits, so each stays far inside float32's range (λ = 1e6 already ranks every cached expert first)
#: the largest |λ| and max-rank M a policy takes (the command lines' ranges; the device holds them as float32 / int32)
LAM_LIMIT, MAX_RANK_LIMIT = 1e6, 2**31 - 1
PARAM_RANGES = {"lam": flags.finite_float(-LAM_LIMIT, LAM_LIMIT), "delta": flags.finite_float(0.0, 1e6),
                "cumsum_p": flags.finite_float(0.0, 1.0)}


def unread_param(kind: str | None, values: dict, given: tuple = ()) -> tuple[str, tuple[str, ...]] | None:
    """The first parameter of ``values`` (name -> value) set away from its ``PARAM_DEFAULTS``, or named in
    ``given`` (a flag given at its default value), that ``kind`` (None: original routing) does not read, with
    the kinds that do; None when there is none. Such a value would change nothing, so the commands refuse it."""
    for name, default in PARAM_DEFAULTS.items():
        if (name in given or values.get(name, default) != default) and (kind or "original") not in PARAM_KINDS[name]:
            return name, PARAM_KINDS[name]
    return None


def default_top_j(top_k: int) -> int:
    """Paper §4.2: always keep the top-1 for K = 2 (Mixtral, Phi-MoE), the top-2 for granular MoEs."""
    return 1 if top_k <= 2 else 2


@flax.struct.dataclass
class RoutingPolicy:
    """One routing policy. All numeric fields are scalars (or stacked along a leading axis for vmap).

    Fields that a kind does not use are ignored by it. ``delta_fixed`` < 0 or NaN means "use the
    running mean of the logit range"; otherwise it is the calibrated Δ: one value for every layer, or one per
    MoE layer (shape [L]: the paper's Δavg is a per-layer quantity, appendix D calibrates it on other text;
    an entry < 0 runs that layer's running mean). ``prior`` holds the
    learned prior's MLP parameters (``moejax.experts.prior``: arrays with a leading MoE-layer axis) for kind
    ``learned-prior`` and is None for every other kind.
    """

    lam: jax.Array
    top_j: jax.Array
    max_rank: jax.Array
    cumsum_p: jax.Array
    prune_h: jax.Array
    delta_fixed: jax.Array
    kind: str = flax.struct.field(pytree_node=False, default="original")
    prior: Any = None


def _policy(kind: str, lam=0.0, top_j=1, max_rank=0, cumsum_p=0.0, prune_h=2, delta_fixed=-1.0, prior=None):
    if kind not in KINDS:
        raise ValueError(f"unknown routing kind {kind!r}; expected one of {KINDS}")
    as_f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    as_i = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return RoutingPolicy(
        lam=as_f(lam), top_j=as_i(top_j), max_rank=as_i(max_rank), cumsum_p=as_f(cumsum_p),
        prune_h=as_i(prune_h), delta_fixed=as_f(delta_fixed), kind=kind, prior=prior,
    )


def original() -> RoutingPolicy:
    return _policy("original")


def pruning(h) -> RoutingPolicy:
    """Keep ranks 1..h-1 of the original ranking (1 < h <= K); the rest are dropped."""
    return _policy("pruning", prune_h=h)


def max_rank(m, top_j) -> RoutingPolicy:
    """Promote cached experts ranked < M, then the top-J (paper Alg. 1)."""
    return _policy("max-rank", max_rank=m, top_j=top_j)


_max_rank_policy = max_rank  # make_policy's keyword ``max_rank`` shadows the constructor


def cumsum(p, top_j) -> RoutingPolicy:
    """max-rank with M = smallest prefix of the ranking whose probability mass reaches p (Alg. 2)."""
    return _policy("cumsum", cumsum_p=p, top_j=top_j)


def cache_prior(lam, top_j, delta=None) -> RoutingPolicy:
    """z' = z + lam * Δ * (cached or top-J); ``delta`` None = per-layer running mean of the logit range, a
    number = that Δ for every layer, a sequence = one Δ per MoE layer."""
    return _policy("cache-prior", lam=lam, top_j=top_j, delta_fixed=-1.0 if delta is None else delta)


def learned_prior(params) -> RoutingPolicy:
    """Rank by z + MLP(m, z) (``moejax.experts.prior``; parameters from ``prior.load_prior`` or ``prior.init_params``)."""
    if params is None:
        raise ValueError("routing kind 'learned-prior' needs prior= parameters (moejax.experts.prior.load_prior(PATH), "
                         "trained with python -m moejax.train_prior)")
    prior_lib.shape_of(params)
    return _policy("learned-prior", prior={k: jnp.asarray(params[k], jnp.float32) for k in prior_lib.PARAM_KEYS})


def make_policy(kind: str, top_k: int, *, lam=None, top_j=None, max_rank=None, cumsum_p=None,
                prune_h=None, delta=None, prior=None) -> RoutingPolicy:
    """Policy from CLI-style options, with the paper's defaults and range checks against K. A parameter left
    out takes the command line's default (``PARAM_DEFAULTS``: λ = 0.5, p = 0.9, J from K, M = h = K), so a
    kind named alone routes as ``--routing KIND`` does (λ = 0 or p = 0 would route exactly as original)."""
    lam = PARAM_DEFAULTS["lam"] if lam is None else lam
    cumsum_p = PARAM_DEFAULTS["cumsum_p"] if cumsum_p is None else cumsum_p
    if kind == "learned-prior":
        return learned_prior(prior)
    if prior is not None:
        raise ValueError(f"prior= parameters only apply to routing kind 'learned-prior', not {kind!r}")
    top_j = default_top_j(top_k) if top_j is None else int(top_j)
    if kind == "original":
        return original()
    if kind == "pruning":
        h = top_k if prune_h is None else int(prune_h)
        if not 1 < h <= top_k:
            raise ValueError(f"pruning needs 1 < h <= K={top_k}, got h={h}")
        return pruning(h)
    if not 0 <= top_j <= top_k:
        raise ValueError(f"top-J must be in [0, K={top_k}], got {top_j}")
    if kind == "max-rank":
        m = top_k if max_rank is None else int(max_rank)
        if not 0 <= m <= MAX_RANK_LIMIT:  # it becomes an int32 on the device
            raise ValueError(f"max-rank M must be in [0, {MAX_RANK_LIMIT}], got {m}")
        return _max_rank_policy(m, top_j)
    if kind == "cumsum":
        if not 0.0 <= float(cumsum_p) <= 1.0:
            raise ValueError(f"cumsum p must be in [0, 1], got {cumsum_p}")
        return cumsum(cumsum_p, top_j)
    if kind == "cache-prior":
        if not math.isfinite(float(lam)) or abs(float(lam)) > LAM_LIMIT:  # past it float32 holds inf
            raise ValueError(f"lambda must be finite, in [-{LAM_LIMIT:g}, {LAM_LIMIT:g}], got {lam}")
        if delta is not None:
            delta = check_delta(delta)
        return cache_prior(lam, top_j, delta)
    raise ValueError(f"unknown routing kind {kind!r}; expected one of {KINDS}")


def as_policy(routing, top_k: int) -> RoutingPolicy:
    """The policy ``routing=`` names: None (the original routing), a kind name (``make_policy``'s defaults,
    those of the command line), or a ``make_policy`` policy."""
    if routing is None or isinstance(routing, str):
        return make_policy(routing or "original", top_k)
    if not isinstance(routing, RoutingPolicy):
        raise TypeError(f"routing must be a kind name ({', '.join(KINDS)}) or a routing.make_policy(...) policy, "
                        f"got {type(routing).__name__} {routing!r}")
    return routing


def check_delta(delta):
    """A fixed Δ: a finite number >= 0, or a non-empty sequence of them (one per MoE layer); returned as a float
    or a tuple of floats."""
    per_layer = isinstance(delta, (list, tuple, np.ndarray, jax.Array)) and np.ndim(delta) == 1
    values = list(np.asarray(delta, dtype=object).ravel()) if per_layer else [delta]
    ok = bool(values) and all(is_number(v) and math.isfinite(float(v)) and float(v) >= 0 for v in values)
    if not ok or (not per_layer and np.ndim(delta) != 0):
        raise ValueError(f"delta must be a finite Δ >= 0, or one per MoE layer (omit it for the running mean), "
                         f"got {delta!r}")
    return tuple(float(v) for v in values) if per_layer else float(delta)


def delta_arg(text: str):
    """``--delta``'s value: one Δ (``2.5``) or one per MoE layer (``1.8,2.1,2.6``), each a finite Δ in
    ``PARAM_RANGES["delta"]`` (argparse gives a bad one one error line naming the flag)."""
    try:
        values = [PARAM_RANGES["delta"](v) for v in text.split(",")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"invalid Δ {text!r}: {e} (one Δ, or comma-separated: one per MoE "
                                         "layer)") from None
    return values[0] if len(values) == 1 else tuple(values)


def check_policy_layers(policy: RoutingPolicy, n_layers: int) -> None:
    """A policy with per-layer data (a learned prior, a Δ per layer) fits a model of ``n_layers`` MoE layers."""
    if policy.delta_fixed.ndim and policy.delta_fixed.shape[-1] != n_layers:
        raise ValueError(f"delta has {policy.delta_fixed.shape[-1]} per-layer values; this model has {n_layers} "
                         "MoE layers")
    if policy.prior is not None:
        prior_lib.check_compatible(policy.prior, n_layers)


def stack_policies(policies: list[RoutingPolicy]) -> RoutingPolicy:
    """Stack same-kind policies along a new leading axis, ready for ``jax.vmap(..., in_axes=0)`` (a Δ for every
    layer is spread over the layers where another policy of the batch has one per layer)."""
    kinds = {p.kind for p in policies}
    if len(kinds) != 1:
        raise ValueError(f"can only stack policies of one kind, got {sorted(kinds)}")
    widths = {p.delta_fixed.shape for p in policies}
    if len(widths) > 1:
        layers = max(widths, key=len)
        policies = [p.replace(delta_fixed=jnp.broadcast_to(p.delta_fixed, layers)) for p in policies]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *policies)


def policy_row(policy: RoutingPolicy, layer, n_layers: int) -> RoutingPolicy:
    """The policy as seen by a one-layer row view of the cache/routing state of MoE ``layer``: a learned
    prior and a per-layer Δ are sliced to that layer's row (nothing else is per layer)."""
    check_policy_layers(policy, n_layers)
    if policy.delta_fixed.ndim:
        policy = policy.replace(delta_fixed=jax.lax.dynamic_slice_in_dim(policy.delta_fixed, layer, 1))
    if policy.prior is None:
        return policy
    return policy.replace(prior=prior_lib.layer_rows(policy.prior, layer, n_layers))


def split_policy_layers(policy: RoutingPolicy) -> dict:
    """The per-layer fields as one-row views [L, 1, ...] to ``vmap`` over layers, for ``policy.replace``:
    a learned prior (None for every other kind) and a per-layer Δ (a single Δ is left as it is)."""
    out = {"prior": None if policy.prior is None else prior_lib.split_layers(policy.prior)}
    if policy.delta_fixed.ndim:
        out["delta_fixed"] = policy.delta_fixed[:, None]
    return out


# ----------------------------------------------------------------------------------------- routing state


@flax.struct.dataclass
class RoutingState:
    """Per-layer running statistics of the router logits: ``delta_sum``/``delta_count`` are [L] float32.
    ``bias`` [L, N] float32: the model's selection biases (DeepSeek-V3, GLM-4.5, dots.llm1, ERNIE-4.5;
    ``model.selection_biases``), which its gating adds to the scores it chooses by; None for the other families. It
    lives here because this state is what every routing path already slices per layer (one-row views, the vmap over
    layers)."""

    delta_sum: jax.Array
    delta_count: jax.Array
    bias: jax.Array | None = None


def init_routing_state(n_layers: int, bias=None) -> RoutingState:
    if bias is not None:
        bias = jnp.asarray(bias, jnp.float32)
        if bias.ndim != 2 or bias.shape[0] != n_layers:
            raise ValueError(f"selection biases must be [{n_layers}, N] (one row per MoE layer), got {bias.shape}")
    return RoutingState(jnp.zeros((n_layers,), jnp.float32), jnp.zeros((n_layers,), jnp.float32), bias)


def layer_bias(state: RoutingState, layer) -> jax.Array | None:
    """``layer``'s row of the selection biases (None without them)."""
    return None if state.bias is None else state.bias[layer]


def logit_range(z: jax.Array) -> jax.Array:
    """max(z) - min(z) over the finite logits (masked -inf entries would make Δ infinite)."""
    z = z.astype(jnp.float32)
    finite = jnp.isfinite(z)
    hi = jnp.max(jnp.where(finite, z, -jnp.inf))
    lo = jnp.min(jnp.where(finite, z, jnp.inf))
    return jnp.where(jnp.any(finite), hi - lo, 0.0)


def observe(state: RoutingState, layer, z: jax.Array) -> RoutingState:
    """Fold one token's logit range into the running mean of ``layer``."""
    return state.replace(
        delta_sum=state.delta_sum.at[layer].add(logit_range(z)),
        delta_count=state.delta_count.at[layer].add(1.0),
    )


def running_delta(state: RoutingState, layer) -> jax.Array:
    """Δavg of ``layer``; 0 before any token was observed (so the bias is 0, never NaN)."""
    count = state.delta_count[layer]
    return jnp.where(count > 0, state.delta_sum[layer] / jnp.maximum(count, 1.0), 0.0)


# ------------------------------------------------------------------------------------------ re-ranking


def _promote_cached_then_top_j(ranking, cache_mask, m, j):
    """promote(r[:J]; promote(r[:M] ∩ C; r)) as one sort by (group, original rank).

    group 0: original rank < J; group 1: rank < M and cached; group 2: everything else. Inside a group the
    original order is kept, which is exactly what the two order-preserving promotions produce.
    """
    n = ranking.shape[-1]
    rank = jnp.arange(n, dtype=jnp.int32)
    cached = cache_mask[ranking]
    group = jnp.where(rank < j, 0, jnp.where((rank < m) & cached, 1, 2))
    # keys group·N + rank are distinct, so sorting the values (cheaper than argsort) recovers the order
    return ranking[jnp.sort(group * n + rank) % n].astype(jnp.int32)


def cumsum_max_rank(probs_in_rank_order: jax.Array, p) -> jax.Array:
    """M = min i (1-based) with sum_{j<=i} probs[r_j] >= p, clipped to [1, N] against rounding."""
    cs = jnp.cumsum(probs_in_rank_order)
    m = jnp.sum(cs < p).astype(jnp.int32) + 1
    return jnp.clip(m, 1, probs_in_rank_order.shape[-1])


def cache_prior_logits(z, ranking, cache_mask, lam, delta, top_j):
    """z' = z + lam·Δ·m̃ with m̃ = cached ∨ top-J; entries outside m̃ keep z bit for bit."""
    n = z.shape[-1]
    z = z.astype(jnp.float32)
    top_j_mask = jnp.zeros((n,), bool).at[ranking].set(jnp.arange(n) < top_j)
    boosted = cache_mask | top_j_mask
    return jnp.where(boosted, z + lam * delta, z)


def rerank(z: jax.Array, cache_mask: jax.Array, routing_state: RoutingState, policy: RoutingPolicy,
           gating: Any, layer=0) -> tuple[jax.Array, jax.Array]:
    """The policy's ranking of all N experts for one token and how many of its first K are used.

    ``routing_state`` must already include this token (see ``observe``). Returns (ranking [N] int32,
    n_valid int32): K for every kind but pruning, where it is h-1.
    """
    k = gating.top_k
    bias = layer_bias(routing_state, layer)
    ranking = gating.ranking(z, bias).astype(jnp.int32)
    n_valid = jnp.asarray(k, jnp.int32)
    if policy.kind == "original":
        return ranking, n_valid
    if policy.kind == "pruning":
        return ranking, jnp.clip(policy.prune_h - 1, 0, k).astype(jnp.int32)
    if policy.kind == "max-rank":
        return _promote_cached_then_top_j(ranking, cache_mask, policy.max_rank, policy.top_j), n_valid
    if policy.kind == "cumsum":
        m = cumsum_max_rank(gating.probs(z)[ranking], policy.cumsum_p)
        return _promote_cached_then_top_j(ranking, cache_mask, m, policy.top_j), n_valid
    if policy.kind == "cache-prior":
        fixed = policy.delta_fixed
        if fixed.ndim:  # one Δ per layer (in a one-layer row view: that layer's, at row 0)
            check_policy_layers(policy, routing_state.delta_sum.shape[0])
            fixed = fixed[layer]
        delta = jnp.where(fixed >= 0, fixed, running_delta(routing_state, layer))  # NaN >= 0 is False
        z_prior = cache_prior_logits(z, ranking, cache_mask, policy.lam, delta, policy.top_j)
        return gating.ranking(z_prior, bias).astype(jnp.int32), n_valid
    if policy.kind == "learned-prior":
        # the prior has as many layer rows as the routing state: both are one-row views in the layer-parallel
        # router (``layer`` is then 0 and the rows are already the true layer's, see ``policy_row``)
        prior_lib.check_compatible(policy.prior, routing_state.delta_sum.shape[0], z.shape[-1])
        z_prior = prior_lib.biased_logits(policy.prior, layer, z, cache_mask)
        return gating.ranking(z_prior, bias).astype(jnp.int32), n_valid
    raise ValueError(f"unknown routing kind {policy.kind!r}")
