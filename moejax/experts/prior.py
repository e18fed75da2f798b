"""The learned cache prior (paper appendix E; docs/design.md §2 "learned prior"): a small MLP that biases the router.

Per MoE layer l, a two-layer MLP reads the cache bitmask m [N] and the router logits z [N] and outputs a
bias b [N]; the experts are ranked by ``z' = z + b`` (RANKING ONLY: the chosen experts' mixing weights
stay the architecture's weights of the original logits, as for every policy — ``router.choose``).

    x = [m, z - mean(z)]                  (2N features; softmax is shift-invariant, so z is centred)
    h = relu(x @ w1[l] + b1[l])           (H hidden units)
    b = h @ w2[l] + b2[l]                 (N outputs)

Parameters are one plain pytree with a leading MoE-layer axis (``{"w1": [L, 2N, H], "b1": [L, H],
"w2": [L, H, N], "b2": [L, N]}``), so a policy holding them is still a pytree: it jits, vmaps over a
stacked batch of priors, and the layer-parallel router slices it to one layer exactly as it slices the
routing state. One MLP per layer (rather than one shared MLP with a layer embedding): the layers' logit
scales and cache dynamics differ (cache-prior needs a per-layer Δavg for the same reason), the MLPs are
tiny (L·(2N·H + H + H·N + N) parameters: 25k for the default model), and slicing a per-layer pytree keeps
the layer-parallel path free of any extra input.

A zero output layer (``w2 = b2 = 0``, the initialisation) gives b = 0 exactly, so z' = z bit for bit and
the policy reproduces original routing. Training (``python -m moejax.train_prior``) lives in
``moejax.train_prior``; this module holds the MLP, its checks and the checkpoint format:

    PATH/prior.json     sidecar: format, architecture (N, L, H, activation), cache size, weight, steps, loss
    PATH/params/        orbax StandardCheckpointer folder with the four arrays

A checkpoint folder is built under a temporary name next to PATH and renamed into place when complete.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import atomic, orbax_io
from moejax.base.errors import Failure, excerpt

FORMAT = "moejax-learned-prior"
VERSION = 1
ACTIVATION = "relu"
PARAM_KEYS = ("w1", "b1", "w2", "b2")
SIDECAR = "prior.json"
PARAMS_DIR = "params"


class PriorError(ValueError):
    """A missing, malformed or mismatched learned-prior checkpoint (or parameter pytree)."""


# ---------------------------------------------------------------------------------------------- the MLP


def init_params(key: jax.Array, n_layers: int, n_experts: int, hidden: int = 64,
                zero_output: bool = True) -> dict:
    """He-initialised first layer; the output layer is zero (b = 0: original routing) unless told."""
    if min(n_layers, n_experts, hidden) < 1:
        raise PriorError(f"layers, experts and hidden units must be >= 1, got {n_layers}, {n_experts}, {hidden}")
    k1, k2 = jax.random.split(key)
    d_in = 2 * n_experts
    w1 = jax.random.normal(k1, (n_layers, d_in, hidden), jnp.float32) * np.sqrt(2.0 / d_in)
    if zero_output:
        w2 = jnp.zeros((n_layers, hidden, n_experts), jnp.float32)
    else:
        w2 = jax.random.normal(k2, (n_layers, hidden, n_experts), jnp.float32) * np.sqrt(1.0 / hidden)
    return {"w1": w1, "b1": jnp.zeros((n_layers, hidden), jnp.float32), "w2": w2,
            "b2": jnp.zeros((n_layers, n_experts), jnp.float32)}


def shape_of(params: Any) -> tuple[int, int, int]:
    """(layers L, experts N, hidden H) of a prior pytree, checking that its four arrays agree."""
    if not isinstance(params, dict) or set(params) != set(PARAM_KEYS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise PriorError(f"a learned prior is a dict with keys {list(PARAM_KEYS)}, got {got}")
    w1, b1, w2, b2 = (np.shape(params[k]) for k in PARAM_KEYS)
    if len(w1) != 3 or len(b1) != 2 or len(w2) != 3 or len(b2) != 2:
        raise PriorError(f"learned prior arrays must be w1 [L, 2N, H], b1 [L, H], w2 [L, H, N], b2 [L, N]; got "
                         f"w1 {w1}, b1 {b1}, w2 {w2}, b2 {b2}")
    n_layers, hidden, n_experts = w2
    if w1 != (n_layers, 2 * n_experts, hidden) or b1 != (n_layers, hidden) or b2 != (n_layers, n_experts):
        raise PriorError(f"inconsistent learned prior shapes: w1 {w1}, b1 {b1}, w2 {w2}, b2 {b2} "
                         f"(expected w1 [L, 2N, H], b1 [L, H], w2 [L, H, N], b2 [L, N])")
    return n_layers, n_experts, hidden


def check_compatible(params: Any, n_layers: int | None = None, n_experts: int | None = None) -> None:
    """Raise a clear PriorError when the prior was made for another number of MoE layers or experts."""
    prior_layers, prior_experts, _ = shape_of(params)
    if n_experts is not None and prior_experts != n_experts:
        raise PriorError(f"the learned prior was trained for N={prior_experts} experts per layer but the "
                         f"model routes over N={n_experts}")
    if n_layers is not None and prior_layers != n_layers:
        raise PriorError(f"the learned prior has {prior_layers} MoE layers but the model has {n_layers}")


def features(z: jax.Array, cache_mask: jax.Array) -> jax.Array:
    """[m, z - mean(z)] over the last axis; non-finite (masked) logits enter as 0 and do not shift the mean."""
    z = z.astype(jnp.float32)
    finite = jnp.isfinite(z)
    zf = jnp.where(finite, z, 0.0)
    mean = jnp.sum(zf, -1, keepdims=True) / jnp.maximum(jnp.sum(finite, -1, keepdims=True), 1)
    return jnp.concatenate([cache_mask.astype(jnp.float32), jnp.where(finite, zf - mean, 0.0)], -1)


def mlp(layer_params: dict, x: jax.Array) -> jax.Array:
    """One layer's MLP on features x [..., 2N] -> bias [..., N]."""
    h = jax.nn.relu(x @ layer_params["w1"] + layer_params["b1"])
    return h @ layer_params["w2"] + layer_params["b2"]


def biased_logits(params: dict, layer, z: jax.Array, cache_mask: jax.Array) -> jax.Array:
    """z' = z + b for one token at MoE ``layer`` (an int or a traced int32) of the ``params`` pytree.

    Non-finite logits stay as they are (a masked expert is never promoted)."""
    z = z.astype(jnp.float32)
    layer_params = jax.tree.map(lambda a: a[layer], params)
    b = mlp(layer_params, features(z, cache_mask))
    return jnp.where(jnp.isfinite(z), z + b, z)


def bias_all_layers(params: dict, z: jax.Array, cache_mask: jax.Array) -> jax.Array:
    """Biases for a batch: z, cache_mask [..., L, N] -> b [..., L, N] (layer l uses MLP l). For training."""
    x = features(z, cache_mask)
    h = jax.nn.relu(jnp.einsum("...li,lih->...lh", x, params["w1"]) + params["b1"])
    return jnp.einsum("...lh,lhn->...ln", h, params["w2"]) + params["b2"]


def layer_rows(params: dict, layer, n_layers: int) -> dict:
    """The one-layer view ``[layer:layer+1]`` of a prior (the layer-parallel router's row view).

    ``n_layers`` is the caller's number of MoE layers (its routing state's rows): a prior made for another
    number of layers is an error here, before any slicing could clamp silently."""
    check_compatible(params, n_layers=n_layers)
    if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < n_layers:
        raise PriorError(f"MoE layer {layer} is out of range for a learned prior of {n_layers} layers")
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, layer, 1, axis=0), params)


def split_layers(params: dict) -> dict:
    """[L, ...] -> [L, 1, ...]: one one-layer prior per MoE layer, for ``vmap`` over layers."""
    return jax.tree.map(lambda a: a[:, None], params)


# ----------------------------------------------------------------------------------------- checkpoints


def save_prior(path: str, params: dict, meta: dict | None = None, overwrite: bool = True) -> str:
    """Write a checkpoint folder atomically (``atomic.atomic_dir``: orbax params + sidecar, then renamed);
    ``overwrite`` replaces a learned-prior folder only (``check_replaceable``).

    ``meta`` goes into the sidecar beside the architecture (N, L, H, activation) derived from ``params``."""
    n_layers, n_experts, hidden = shape_of(params)
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.lexists(path) and not overwrite:
        raise PriorError(f"{path} already exists")
    check_replaceable(path)
    with atomic.atomic_dir(path) as tmp:
        try:
            orbax_io.save(os.path.join(tmp, PARAMS_DIR), {k: np.asarray(params[k], np.float32) for k in PARAM_KEYS})
        except ValueError as e:  # orbax's form of a full disk: a failure, not a usage error
            raise Failure(f"could not write the prior {path}: {excerpt(e)}") from e
        sidecar = {"format": FORMAT, "version": VERSION,
                   "arch": {"kind": "mlp2", "activation": ACTIVATION, "inputs": ["cache_mask", "logits_centred"],
                            "n_experts": n_experts, "n_layers": n_layers, "hidden": hidden,
                            "per_layer": True},
                   **(meta or {})}
        atomic.write_json(os.path.join(tmp, SIDECAR), sidecar)
    return path


def check_prior_flag(routing: str | None, path: str | None) -> None:
    """``--prior PATH`` goes with ``--routing learned-prior`` and that routing needs it (every command's check)."""
    if routing == "learned-prior" and not path:
        raise ValueError("--routing learned-prior needs --prior PATH (a checkpoint folder written by "
                         "`python -m moejax.train_prior`)")
    if path and routing != "learned-prior":
        raise ValueError(f"--prior only applies to --routing learned-prior (got --routing {routing or 'original'})")


def check_replaceable(path: str) -> None:
    """``PriorError`` unless writing a prior at ``path`` loses nothing: nothing there, an empty folder, or a
    learned-prior folder holding only its own ``prior.json`` and ``params/`` (a folder of the user's that
    happened to have the name, e.g. ``PRIORS/w1``, was replaced whole)."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        raise PriorError(f"{path} exists and is not a folder: refusing to replace it with a learned prior")
    names = sorted(os.listdir(path))
    if not names:
        return
    others = [n for n in names if n not in (SIDECAR, PARAMS_DIR)]
    if others or SIDECAR not in names:
        shown = ", ".join((others or names)[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise PriorError(f"{path} holds files that are not a learned prior ({shown}): writing the prior there "
                         "would delete them; move them out or choose another --out")


def read_sidecar(path: str) -> dict:
    """The sidecar of a checkpoint folder, checked for format and a sane architecture."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise PriorError(f"no learned-prior checkpoint at {path} (train one with python -m moejax.train_prior)")
    side = os.path.join(path, SIDECAR)
    if not os.path.isfile(side):
        raise PriorError(f"{path} is not a learned-prior checkpoint: {SIDECAR} is missing")
    try:
        with open(side) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PriorError(f"cannot read {side}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PriorError(f"{side} is not a {FORMAT} sidecar")
    if meta.get("version") != VERSION:
        raise PriorError(f"{side} has format version {meta.get('version')}; this moejax reads version {VERSION}")
    arch = meta.get("arch") or {}
    for key in ("n_experts", "n_layers", "hidden"):
        if not isinstance(arch.get(key), int) or arch[key] < 1:
            raise PriorError(f"{side}: arch.{key} must be a positive integer, got {arch.get(key)!r}")
    if arch.get("activation") != ACTIVATION:
        raise PriorError(f"{side}: unsupported activation {arch.get('activation')!r} (expected {ACTIVATION!r})")
    return meta


def load_prior(path: str, n_layers: int | None = None, n_experts: int | None = None,
               top_k: int | None = None) -> dict:
    """Parameters of a checkpoint folder written by ``save_prior`` / ``python -m moejax.train_prior``.

    Given the model's ``n_layers`` (MoE layers), ``n_experts`` and ``top_k``, a prior trained for another
    shape is rejected with a clear error."""
    meta = read_sidecar(path)
    arch = meta["arch"]
    n_l, n_e, h = arch["n_layers"], arch["n_experts"], arch["hidden"]
    if top_k is not None and meta.get("top_k") is not None and int(meta["top_k"]) != int(top_k):
        raise PriorError(f"the learned prior at {path} was trained for top-{meta['top_k']} routing but the model "
                         f"uses top-{top_k}")
    shapes = {"w1": (n_l, 2 * n_e, h), "b1": (n_l, h), "w2": (n_l, h, n_e), "b2": (n_l, n_e)}
    target = {k: jax.ShapeDtypeStruct(s, np.float32) for k, s in shapes.items()}
    params_dir = os.path.join(os.path.abspath(os.path.expanduser(path)), PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise PriorError(f"{path} is incomplete: its {PARAMS_DIR}/ folder is missing")
    try:
        params = orbax_io.restore(params_dir, target)
    except Failure as e:  # names the folder and tensorstore's cause
        raise PriorError(f"cannot restore the learned prior at {path} (sidecar says L={n_l}, N={n_e}, H={h}): "
                         f"{e}") from e
    params = {k: jnp.asarray(params[k], jnp.float32) for k in PARAM_KEYS}
    got = shape_of(params)
    if got != (n_l, n_e, h):
        raise PriorError(f"{path}: stored arrays have (L, N, H) = {got} but the sidecar says {(n_l, n_e, h)}")
    check_compatible(params, n_layers=n_layers, n_experts=n_experts)
    return params
