"""Routing traces: file format, validation and fast replay through the cache (the command: ``trace_command``).

Trace file (``.npz``, loaded with ``allow_pickle=False``):
  experts    int   [T, L, K]  per token and MoE layer, the experts used, highest weight first; -1 = none
  weights    float [T, L, K]  optional: their mixing weights (needed by score-based eviction)
  logits     float [T, L, N]  optional: the router logits (needed to re-route with another policy)
  n_experts  int   []         optional: N (else logits.shape[-1], else max(experts) + 1)
  gating     str   []         optional: JSON of the gating that produced the trace, e.g.
                              {"kind": "softmax", "top_k": 2, "normalize": true, "scale": 1.0}
                              kinds: softmax | group-limited (+ n_group, topk_group) | sparsemixer
                              (+ jitter_eps) | sigmoid-group-limited (DeepSeek-V3: + n_group, topk_group) |
                              softmax-biased (ERNIE-4.5: + norm_min);
                              n_experts defaults to the trace's N. CLI flags override it.
  score_bias float [L, N]     optional: the model's selection biases (DeepSeek-V3's and ERNIE-4.5's
                              e_score_correction_bias), which its gating adds to the scores it chooses by;
                              re-routing uses them

Replay walks the trace in token-sequential order (token t: layers 0..L-1). Per-layer caches are independent
across layers, so their replay is ``vmap`` over layers of a ``lax.scan`` over tokens; global caches are one
``lax.scan`` over all T·L steps. Belady is replayed the same way, with each access told the index of that
expert's next use (tokens for per-layer scope, t·L + l for global scope).

    python -m moejax.trace replay FILE.npz --cache-size C [--scope layer|global]
        [--eviction lru|lfu|fld|score|least-stale|belady|belady-bypass] [--routing KIND --lam ... --top-j ...] [--json]
    python -m moejax.trace synth OUT.npz --tokens T --layers L --experts N --top-k K [--logits]
"""

from __future__ import annotations

import dataclasses
import functools
import math
import json
import os
import zipfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax.base import atomic
from moejax.base.errors import Failure
from moejax.base.typecheck import is_integer, is_number
from moejax.models import gating as gating_lib
from moejax.models.config import MAX_EXPERTS
from moejax.experts import cache as cache_lib, router as router_lib, routing as routing_lib
from moejax.experts import cache_metrics
from moejax.experts import capacity as capacity_lib

TRACE_KEYS = ("experts", "weights", "logits", "n_experts", "gating", "score_bias")


@dataclasses.dataclass(frozen=True)
class Trace:
    experts: np.ndarray  # [T, L, K] int32
    weights: np.ndarray | None  # [T, L, K] float32
    logits: np.ndarray | None  # [T, L, N] float32
    n_experts: int
    gating: dict | None  # gating spec (see module docstring)
    score_bias: np.ndarray | None = None  # [L, N] float32 selection biases (DeepSeek-V3), or None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.experts.shape


class TraceError(Failure):
    """A malformed trace; the message names the offending array."""


def _shape(a) -> str:
    return str(tuple(int(s) for s in a.shape))


def validate_trace(experts, weights=None, logits=None, n_experts=None, gating=None, score_bias=None) -> Trace:
    """Check shapes, dtypes and values; return a normalised ``Trace`` or raise ``TraceError``."""
    experts = np.asarray(experts)
    if experts.ndim != 3:
        raise TraceError(f"trace 'experts' must be [T, L, K], got shape {_shape(experts)}")
    if not np.issubdtype(experts.dtype, np.integer):
        raise TraceError(f"trace 'experts' must be integer, got dtype {experts.dtype}")
    t, n_layers, k = experts.shape
    if t < 1 or n_layers < 1 or k < 1:
        raise TraceError(f"trace 'experts' has an empty axis: shape {_shape(experts)}")
    if weights is not None:
        weights = np.asarray(weights)
        if weights.shape != experts.shape:
            raise TraceError(f"trace 'weights' has shape {_shape(weights)} but 'experts' is {_shape(experts)}")
        if not np.issubdtype(weights.dtype, np.floating) or not np.all(np.isfinite(weights)):
            raise TraceError(f"trace 'weights' must be finite floats (dtype {weights.dtype})")
    if logits is not None:
        logits = np.asarray(logits)
        if logits.ndim != 3 or logits.shape[:2] != experts.shape[:2]:
            raise TraceError(f"trace 'logits' has shape {_shape(logits)} but 'experts' is {_shape(experts)}; "
                             "expected [T, L, N] with the same T and L")
        if not np.issubdtype(logits.dtype, np.floating):
            raise TraceError(f"trace 'logits' must be floating point, got dtype {logits.dtype}")
    if n_experts is not None:
        n_arr = np.asarray(n_experts)
        if n_arr.ndim != 0 or not np.issubdtype(n_arr.dtype, np.integer):
            raise TraceError(f"trace 'n_experts' must be an integer scalar, got shape {_shape(n_arr)} "
                             f"dtype {n_arr.dtype}")
        n = int(n_arr)
        if logits is not None and logits.shape[-1] != n:
            raise TraceError(f"trace 'logits' has shape {_shape(logits)} but 'n_experts' is {n}")
    elif logits is not None:
        n = int(logits.shape[-1])
    else:
        n = int(experts.max()) + 1
    if n > MAX_EXPERTS:
        raise TraceError(f"trace says N={n} experts (at most {MAX_EXPERTS}): a damaged 'n_experts' or expert id?")
    if n < k:
        raise TraceError(f"trace 'experts' has K={k} slots but only N={n} experts")
    if experts.min() < -1 or experts.max() >= n:
        raise TraceError(f"trace 'experts' ids must be in [-1, {n - 1}], found [{experts.min()}, {experts.max()}]")
    ordered = np.sort(experts, axis=-1)
    dup = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if dup.any():
        where = tuple(int(i) for i in np.argwhere(dup)[0][:2])
        raise TraceError(f"trace 'experts' repeats an expert within one step at (token, layer) = {where}")
    if gating is not None and not isinstance(gating, dict):
        try:
            gating = json.loads(str(np.asarray(gating)))
        except json.JSONDecodeError as err:
            raise TraceError(f"trace 'gating' is not valid JSON: {err}") from None
        if not isinstance(gating, dict):
            raise TraceError("trace 'gating' must be a JSON object")
    if score_bias is not None:
        score_bias = np.asarray(score_bias)
        if score_bias.shape != (n_layers, n):
            raise TraceError(f"trace 'score_bias' has shape {_shape(score_bias)}; expected [L, N] = {(n_layers, n)}")
        if not np.issubdtype(score_bias.dtype, np.floating) or not np.all(np.isfinite(score_bias)):
            raise TraceError(f"trace 'score_bias' must be finite floats (dtype {score_bias.dtype})")
        score_bias = score_bias.astype(np.float32)
    return Trace(experts.astype(np.int32), None if weights is None else weights.astype(np.float32),
                 None if logits is None else logits.astype(np.float32), n, gating, score_bias)


def save_trace(path, experts, weights=None, logits=None, n_experts=None, gating: dict | None = None,
               score_bias=None) -> Trace:
    """Validate and write a trace (uncompressed npz: replay is I/O bound otherwise)."""
    tr = validate_trace(experts, weights, logits, n_experts, gating, score_bias)
    arrays = {"experts": tr.experts, "n_experts": np.asarray(tr.n_experts, np.int64)}
    if tr.weights is not None:
        arrays["weights"] = tr.weights
    if tr.logits is not None:
        arrays["logits"] = tr.logits
    if tr.gating is not None:
        arrays["gating"] = np.asarray(json.dumps(tr.gating))
    if tr.score_bias is not None:
        arrays["score_bias"] = tr.score_bias
    atomic.save_npz(trace_path(path), **arrays)
    return tr


def trace_path(path) -> str:
    """Where ``save_trace`` writes ``path``: with ``.npz`` appended unless it ends so (np.savez's naming)."""
    path = os.fspath(path)
    return path if path.endswith(".npz") else f"{path}.npz"


def _check_npz_header(path) -> None:
    """Refuse a file that is not a zip archive (empty, a bare .npy array, text) before ``np.load``."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as err:
        raise TraceError(f"cannot read trace {path}: {err.strerror or err}") from None
    if not head:
        raise TraceError(f"trace {path} is empty (0 bytes); expected an .npz archive")
    if head.startswith(b"\x93NUMPY"):
        raise TraceError(f"trace {path} is a single .npy array, not an .npz archive of named arrays")
    if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        raise TraceError(f"trace {path} is not an .npz archive (no zip header)")


def read_npz(path) -> dict[str, np.ndarray]:
    """Every array of an .npz file (``allow_pickle=False``); ``TraceError`` naming ``path`` if damaged."""
    _check_npz_header(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except OSError as err:
        raise TraceError(f"cannot read trace {path}: {err.strerror or err}") from None
    except (EOFError, ValueError, zipfile.BadZipFile, zlib.error) as err:
        raise TraceError(f"trace {path} is unreadable (damaged, truncated or pickled data): {err}") from None


def load_trace(path) -> Trace:
    arrays = read_npz(path)
    if "experts" not in arrays:
        raise TraceError(f"trace {path} has no 'experts' array (found {sorted(arrays)})")
    unknown = sorted(set(arrays) - set(TRACE_KEYS))
    if unknown:
        raise TraceError(f"trace {path} has unknown arrays {unknown}; expected some of {TRACE_KEYS}")
    try:
        return validate_trace(*(arrays.get(k) for k in TRACE_KEYS))
    except TraceError as err:
        raise TraceError(f"{path}: {err}") from None


GATING_KINDS = ("softmax", "group-limited", "sparsemixer", "sigmoid-group-limited", "softmax-biased")


def gating_from_spec(spec: dict, n_experts: int):
    """Build a moejax.models.gating object from a trace's gating spec, checked against the trace's N experts
    (a damaged spec raises ``TraceError`` naming the field, not a shape error deep inside re-routing)."""

    spec = dict(spec)
    kind = spec.pop("kind", "softmax")
    if kind not in GATING_KINDS:
        raise ValueError(f"unknown gating kind {kind!r}; expected one of {', '.join(GATING_KINDS)}")

    def count(key, default=None, low=1, high=None):
        v = spec.get(key, default)
        if not is_integer(v) or v < low or (high is not None and v > high):
            raise TraceError(f"trace 'gating' {key} must be an integer in [{low}, {high if high is not None else '∞'}]"
                             f", got {v!r}")
        return int(v)

    def number(key, default):
        v = spec.get(key, default)
        if not is_number(v) or not math.isfinite(v):
            raise TraceError(f"trace 'gating' {key} must be a finite number, got {v!r}")
        return float(v)

    n = count("n_experts", n_experts, n_experts, n_experts)
    common = dict(normalize=bool(spec.get("normalize", kind == "softmax")), scale=number("scale", 1.0),
                  norm_eps=number("norm_eps", 0.0))
    if kind == "softmax":
        return gating_lib.SoftmaxTopK(n, count("top_k", high=n), **common)
    if kind == "softmax-biased":
        norm_min = number("norm_min", 1e-12)
        if norm_min < 0:
            raise TraceError(f"trace 'gating' norm_min must be >= 0, got {norm_min!r}")
        return gating_lib.BiasedSoftmaxTopK(n, count("top_k", high=n), True, common["scale"], norm_min=norm_min)
    if kind in ("group-limited", "sigmoid-group-limited"):
        n_group = count("n_group", 1, high=n)
        if n % n_group or (kind == "sigmoid-group-limited" and n_group > 1 and n // n_group < 2):
            raise TraceError(f"trace 'gating' n_group {n_group} must divide the {n} experts"
                             + (" into groups of at least 2" if kind == "sigmoid-group-limited" else ""))
        groups = dict(n_group=n_group, topk_group=count("topk_group", 1, high=n_group))
        if kind == "sigmoid-group-limited":
            return gating_lib.SigmoidGroupLimited(n, count("top_k", high=n), common["normalize"], common["scale"],
                                                  **groups)
        return gating_lib.GroupLimited(n, count("top_k", high=n), **common, **groups)
    return gating_lib.SparseMixer(n, count("top_k", 2, high=n), number("jitter_eps", 0.01))


# -------------------------------------------------------------------------------------------- replay


def next_use_indices(experts: np.ndarray, scope: str) -> np.ndarray:
    """For every (t, l, k): position of the next access of the same (layer, expert) in the access order
    (token index for per-layer scope, t·L + l for global), or cache.NEVER. Empty slots get NEVER."""
    t_len, n_layers, k = experts.shape
    n = int(experts.max()) + 1 if experts.size else 1
    nxt = np.full((n_layers, max(n, 1) + 1), cache_lib.NEVER, np.int64)  # column n: sink for -1
    out = np.empty(experts.shape, np.int64)
    layer_idx = np.arange(n_layers)[:, None]
    for t in range(t_len - 1, -1, -1):
        e = np.where(experts[t] >= 0, experts[t], n)
        out[t] = nxt[layer_idx, e]
        pos = t if scope == "layer" else t * n_layers + np.arange(n_layers)[:, None]
        nxt[layer_idx, e] = pos
        nxt[:, n] = cache_lib.NEVER
    out[experts < 0] = cache_lib.NEVER
    return out.astype(np.int32)


@jax.jit
def _replay_layers(state, experts, weights, next_use):
    """Per-layer scope: vmap over layers of a scan over tokens. experts [T, L, K]."""

    def one_layer(cs, e_l, w_l, nu_l):
        def step(cs, x):
            e, w, nu = x
            cs, _ = cache_lib.access(cs, 0, e, w, None, nu if cs.eviction in cache_lib.OFFLINE_EVICTIONS else None)
            return cs, None

        return lax.scan(step, cs, (e_l, w_l, nu_l))[0]

    split = cache_lib.split_layers(state)
    return cache_lib.merge_layers(jax.vmap(one_layer, in_axes=(0, 1, 1, 1))(split, experts, weights, next_use))


@jax.jit
def _replay_global(state, experts, weights, next_use):
    """Global scope: one scan over all T·L steps in token-sequential order."""
    t_len, n_layers, k = experts.shape
    layers = jnp.tile(jnp.arange(n_layers, dtype=jnp.int32), t_len)

    def step(cs, x):
        layer, e, w, nu = x
        cs, _ = cache_lib.access(cs, layer, e, w, None, nu if cs.eviction in cache_lib.OFFLINE_EVICTIONS else None)
        return cs, None

    flat = lambda a: a.reshape(t_len * n_layers, k)  # noqa: E731
    return lax.scan(step, state, (layers, flat(experts), flat(weights), flat(next_use)))[0]


@functools.partial(jax.jit, static_argnames=("gating",))
def _reroute(state, routing_state, logits, policy, gating):
    if state.scope == "layer":
        out = router_lib.route_layers_parallel(logits, state, routing_state, policy, gating)
    else:
        out = router_lib.route_sequence(logits, state, routing_state, policy, gating)
    return out[0], out[3]


def check_finite_logits(trace: Trace) -> None:
    """Re-routing needs finite router logits; ``TraceError`` at the first NaN or inf."""
    bad = np.argwhere(~np.isfinite(trace.logits))
    if bad.size:
        where = tuple(int(i) for i in bad[0][:2])
        raise TraceError(f"trace 'logits' must be finite to re-route: {len(bad)} NaN/inf value(s), the first at "
                         f"(token, layer) = {where}")


def replay_state(trace: Trace, cache_size, scope: str = "layer", eviction: str = "lru", *, policy=None,
                 gating=None, init: str = "empty", seed: int = 0, state: cache_lib.CacheState | None = None):
    """Replay ``trace`` through a cache and return the final ``CacheState`` (stats inside) and the experts
    actually used [T, L, K] (the recorded ones, or the re-routed ones when ``policy`` is given)."""
    n_tokens, n_layers, k = trace.shape
    if state is None:
        capacity = capacity_lib.parse_capacity(cache_size, trace.n_experts, n_layers, scope)
        state = cache_lib.init_cache(n_layers, trace.n_experts, capacity, scope, eviction, init, seed)
    if policy is not None:
        if trace.logits is None:
            raise TraceError("re-routing needs trace 'logits' [T, L, N]; this trace has none")
        check_finite_logits(trace)
        if eviction in cache_lib.OFFLINE_EVICTIONS:
            raise ValueError(f"{eviction} is an oracle over fixed selections; it cannot be combined with re-routing")
        if gating is None:
            if trace.gating is None:
                raise ValueError("re-routing needs a gating: store 'gating' in the trace or pass --gating")
            gating = gating_from_spec(trace.gating, trace.n_experts)
        experts, state = _reroute(state, routing_lib.init_routing_state(n_layers, trace.score_bias),
                                  jnp.asarray(trace.logits), policy, gating)
        return state, np.asarray(experts)
    if eviction == "score" and trace.weights is None:
        raise TraceError("score-based eviction needs trace 'weights' [T, L, K]; this trace has none")
    weights = trace.weights if trace.weights is not None else np.zeros(trace.shape, np.float32)
    if eviction in cache_lib.OFFLINE_EVICTIONS:
        next_use = next_use_indices(trace.experts, scope)
    else:
        next_use = np.zeros((1, 1, 1), np.int32)
        next_use = np.broadcast_to(next_use, trace.shape)
    run = _replay_layers if scope == "layer" else _replay_global
    state = run(state, jnp.asarray(trace.experts), jnp.asarray(weights), jnp.asarray(next_use))
    return state, trace.experts


def replay(trace: Trace, cache_size, scope: str = "layer", eviction: str = "lru", *, policy=None, gating=None,
           init: str = "empty", seed: int = 0, expert_bytes: int | None = None) -> dict:
    """Replay a trace and return ``cache.summarize`` metrics plus the replay configuration."""
    state, _ = replay_state(trace, cache_size, scope, eviction, policy=policy, gating=gating, init=init, seed=seed)
    out = cache_metrics.summarize(state, expert_bytes)
    out.update(capacity=int(state.capacity), scope=scope, eviction=eviction,
               routing=policy.kind if policy is not None else "recorded", layers=trace.shape[1],
               experts_per_token=trace.shape[2], n_experts=trace.n_experts)
    return out


def synthetic_trace(n_tokens: int, n_layers: int, n_experts: int, top_k: int, seed: int = 0, rho: float = 0.9,
                    with_logits: bool = False) -> Trace:
    """Random trace with temporal locality: per layer, logits follow an AR(1) process over tokens
    (correlation ``rho``), experts = softmax top-K, renormalised weights."""
    rng = np.random.default_rng(seed)
    z = np.empty((n_tokens, n_layers, n_experts), np.float32)
    z[0] = rng.standard_normal((n_layers, n_experts))
    noise = rng.standard_normal((n_tokens, n_layers, n_experts)).astype(np.float32) * np.sqrt(1 - rho * rho)
    for t in range(1, n_tokens):
        z[t] = rho * z[t - 1] + noise[t]
    z *= 2.0
    experts = np.argsort(-z, axis=-1, kind="stable")[..., :top_k].astype(np.int32)
    top = np.take_along_axis(z, experts, -1)
    w = np.exp(top - top.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    gating = {"kind": "softmax", "top_k": top_k, "normalize": True, "scale": 1.0}
    return validate_trace(experts, w.astype(np.float32), z if with_logits else None, n_experts, gating)


# -------------------------------------------------------------------------------------------- CLI


def format_table(stats: dict) -> str:
    """Human-readable stats: configuration, overall figures, then one row per layer."""
    lines = [
        f"scope {stats['scope']}  eviction {stats['eviction']}  capacity {stats['capacity']}"
        + (f" ({stats['cache_memory_bytes'] / 2**20:.1f} MiB of experts)" if stats.get("cache_memory_bytes") else "")
        + f"  routing {stats['routing']}",
        f"tokens {stats['tokens']}  layers {stats['layers']}  K {stats['experts_per_token']}  N {stats['n_experts']}",
        f"misses {stats['misses']} / accesses {stats['accesses']}  miss_rate {stats['miss_rate']:.4f}",
        f"compulsory {stats['compulsory_misses']}  collisions {stats['collision_misses']}  loads {stats['loads']}  "
        f"evictions {stats['evictions']}  lifetime {stats['lifetime_mean']:.2f} ± {stats['lifetime_std']:.2f} tokens",
    ]
    if "bytes_moved" in stats:
        lines.append(f"bytes moved {stats['bytes_moved']}  per token {stats['bytes_per_token']:.1f}")
    pl = stats["per_layer"]
    lines.append(f"{'layer':>5} {'accesses':>10} {'misses':>10} {'miss_rate':>9} {'compulsory':>10} "
                 f"{'collisions':>10} {'lifetime':>9}")
    for i in range(len(pl["misses"])):
        lines.append(f"{i:>5} {pl['accesses'][i]:>10} {pl['misses'][i]:>10} {pl['miss_rate'][i]:>9.4f} "
                     f"{pl['compulsory_misses'][i]:>10} {pl['collision_misses'][i]:>10} {pl['lifetime_mean'][i]:>9.2f}")
    return "\n".join(lines)


def json_safe(x):
    """NaN (e.g. lifetime with nothing ever loaded) is not JSON; write null instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


