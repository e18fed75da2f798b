"""Low-bit expert copies that moejax makes itself: symmetric int8 / int4 weight quantisation.

The precision cascade (docs/design.md §2, miss handling) holds every expert also as int8 and int4 copies; a
low-importance miss pages in the low-bit copy, so the bytes it moves are the *real* stored size of the
copy (``nbytes``: quantised values + scales).

Scheme
------
Symmetric, round to nearest (half to even), no zero point. A weight ``W [..., D, F]`` used as ``x @ W``
contracts over ``axis`` (default -2, the D axis); scales run along the contraction axis:

- **per output channel** (``group_size=None``): one scale per column, over all D entries of it;
- **grouped** (``group_size=G``, G divides D): one scale per G consecutive contraction entries and column.

For each group ``s = ceil_sd(absmax / qmax)`` and ``q = clip(round(w / s), -qmax, qmax)``, where
``ceil_sd`` rounds the float32 quotient *up* to the scale dtype ``sd``. int8 uses ``[-127, 127]``
(qmax 127); int4 uses ``[-7, 7]`` (qmax 7), packed two per ``uint8`` byte along the last axis (element
``2j`` in the low nibble, ``2j+1`` in the high nibble, two's complement). int4 is symmetric rather than
``[-8, 7]`` because with an absmax scale the largest magnitude must map to ``±qmax`` on either sign: with
``-8`` we would either never use ``-8`` (``s = absmax/7``: nothing gained) or take ``s = absmax/8`` and
then be unable to represent ``+absmax`` (clipping error up to a whole step). Symmetric keeps 0 exact,
``deq(q(-w)) = -deq(q(w))`` and the error bound below uniform. An all-zero group gets scale 0 and
dequantises to exactly 0 (no division by zero).

Scale dtype: **bfloat16** by default (``float32`` selectable). Two bytes like float16, but with float32's
exponent range, so neither huge (float16 overflows above 65504·qmax absmax) nor tiny (float16 loses
precision below 6e-5) weights break it. Because the scale is rounded *up* to bfloat16 and ``q`` is
computed against that stored scale, the coarser scale never clips; it only widens the step by at most
2^-7 relative.

Error statement (tested in tests/test_quant.py)
-----------------------------------------------
1. Element-wise, exactly by construction: ``|w - dequantize(quantize(w))| <= s/2`` for every element,
   ``s`` its group's *stored* scale (up to float32 rounding of ``w / s``: the test allows
   ``s/2 · (1 + 1e-6)``), computed with ``dequantize(..., jnp.float32)``. Dequantising into a narrower
   dtype adds that dtype's rounding of the result (bf16: ``|deq| · 2^-8``). ``s <= absmax/qmax · (1 + 2^-7)``
   for bfloat16 scales. Holds for finite inputs whose group scales are normal float32 numbers (``absmax``
   from ~qmax·1.2e-38, i.e. 1.5e-36 for int8, up to ~3e38); XLA may flush subnormals to zero below that.
2. Relative Frobenius error ``||W - deq||_F / ||W||_F`` and 3. relative error of the expert output
   ``(SiLU(x@g) * (x@u)) @ d`` with all three matrices dequantised, against float32, 64 Gaussian tokens.
   Gaussian weights: 8 experts g/u [256, 128], d [128, 256] (max over experts and matrices);
   default model: the shipped trained bf16 experts, all 4 layers x 32 experts ([256, 112] / [112, 256];
   max), 32 Gaussian tokens per layer. bfloat16 scales. Measured values, and the bounds the tests assert:

   ================  ===================  ===================  ===================  ===================
   scheme            Gaussian weight      Gaussian output      default weight       default output
   ================  ===================  ===================  ===================  ===================
   int8 per-channel  0.71 %  (< 1 %)      1.22 %  (< 1.5 %)    0.71 %  (< 1 %)      0.99 %  (< 1.5 %)
   int8 grouped-32   0.55 %  (< 0.75 %)   0.98 %  (< 1.25 %)   (32 does not divide F=112)
   int8 grouped-16   0.49 %               0.87 %               0.49 %               0.77 %
   int4 per-channel  13.0 %  (< 15 %)     22.2 %  (< 25 %)     12.9 %  (< 15 %)     18.4 %  (< 21 %)
   int4 grouped-32   9.9 %   (< 11 %)     17.4 %  (< 19 %)     (32 does not divide F=112)
   int4 grouped-16   8.7 %   (< 10 %)     15.2 %  (< 17 %)     8.7 %   (< 10 %)     12.9 %  (< 15 %)
   ================  ===================  ===================  ===================  ===================

   The expert output error is ~1.7x the weight error (gate and up errors multiply through SiLU, then
   down adds its own). The default model's experts are near-Gaussian (short training from a Gaussian init).

Bytes per expert of the default model (gate + up + down, D=256, F=112, 86 016 weights): float32 344 064,
bfloat16 172 032, int8 per-channel 86 976, int8 grouped-16 96 768, int4 per-channel 43 968, int4 grouped-16
53 760 (bfloat16 scales; group sizes must divide both D and F, so 32 does not fit F=112, 16 does).

API
---
``quantize(w, bits, group_size=None, axis=-2, scale_dtype=jnp.bfloat16) -> QuantizedTensor``,
``dequantize(qt, dtype=None) -> Array``, ``take(qt, index) -> QuantizedTensor`` (also ``qt[index]``),
``nbytes(x) -> int``, ``quantize_experts(moe_params, bits, group_size=None, scale_dtype=...) -> dict``,
``expert_nbytes(experts) -> int``, ``pack_int4`` / ``unpack_int4``. All array functions are pure jnp,
jit-able (``bits``, ``group_size``, ``axis``, ``scale_dtype`` static) and vmap-able.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moejax.base.typecheck import is_integer

BITS = (4, 8)
SCALE_DTYPES = ("bfloat16", "float32")
EXPERT_KEYS = ("gate", "up", "down")


def qmax(bits: int) -> int:
    """Largest quantised magnitude: 127 for int8, 7 for int4 (symmetric ranges)."""
    return 2 ** (bits - 1) - 1


@flax.struct.dataclass
class QuantizedTensor:
    """A symmetric int8/int4 quantised tensor.

    ``q``: int8 values (8-bit) or uint8 bytes holding two int4 values along the last axis (4-bit);
    ``scale``: the scales, shaped like the logical tensor with the contraction axis replaced by the number
    of groups (1 for per-channel). ``axis`` is stored negative (counted from the end) so it stays right
    when leading (expert) axes are indexed away by ``take`` or mapped over by ``vmap``; for the same reason
    ``shape`` is derived from ``q`` rather than stored."""

    q: jax.Array
    scale: jax.Array
    bits: int = flax.struct.field(pytree_node=False, default=8)
    group_size: int | None = flax.struct.field(pytree_node=False, default=None)
    axis: int = flax.struct.field(pytree_node=False, default=-2)
    dtype: Any = flax.struct.field(pytree_node=False, default=np.dtype("float32"))

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantised) shape."""
        s = tuple(self.q.shape)
        return s[:-1] + (2 * s[-1],) if self.bits == 4 else s

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def nbytes(self) -> int:
        return nbytes(self)

    def __getitem__(self, index) -> "QuantizedTensor":
        return take(self, index)


# ------------------------------------------------------------------------------------------- int4 packing
@jax.jit
def pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-8, 7], last axis even -> uint8 with element 2j in the low nibble, 2j+1 in the high."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even last axis, got shape {tuple(q.shape)}")
    u = lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8) & jnp.uint8(0x0F)
    return u[..., 0::2] | (u[..., 1::2] << jnp.uint8(4))


@jax.jit
def unpack_int4(packed: jax.Array) -> jax.Array:
    """Inverse of ``pack_int4``: uint8 [..., n] -> int8 [..., 2n] (sign-extended nibbles)."""
    b = packed.astype(jnp.uint8)
    lo = lax.bitcast_convert_type(b << jnp.uint8(4), jnp.int8) >> jnp.int8(4)
    hi = lax.bitcast_convert_type(b, jnp.int8) >> jnp.int8(4)
    return jnp.stack([lo, hi], axis=-1).reshape(b.shape[:-1] + (2 * b.shape[-1],))


# ------------------------------------------------------------------------------------------ quantisation
def _scale_dtype_name(scale_dtype) -> str:
    name = jnp.dtype(scale_dtype).name
    if name not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {name} (float16 is not accepted: "
                         "its range overflows or loses precision for large or tiny weights)")
    return name


def _ceil_scale(s: jax.Array, name: str) -> jax.Array:
    """float32 scales (>= 0) rounded *up* to the scale dtype, so ``|w| / stored <= qmax`` (no clipping)."""
    if name == "float32":
        return s
    bits = lax.bitcast_convert_type(s, jnp.uint32)
    up = (bits + jnp.uint32(0xFFFF)) & jnp.uint32(0xFFFF0000)  # ceil to the top 16 bits (positive floats)
    return lax.bitcast_convert_type((up >> jnp.uint32(16)).astype(jnp.uint16), jnp.bfloat16)


def _check_args(shape: tuple[int, ...], bits: int, group_size: int | None, axis: int) -> tuple[int, int]:
    """Validate; return (non-negative contraction axis, group length)."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    ndim = len(shape)
    if ndim < 1:
        raise ValueError("cannot quantise a scalar: it needs a contraction axis")
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a tensor of shape {shape}")
    ax = axis % ndim
    d = shape[ax]
    if group_size is None:
        g = d
    else:
        if not is_integer(group_size) or group_size < 1:
            raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
        if d % group_size:
            raise ValueError(f"group_size {group_size} does not divide the contraction axis (axis {axis}, "
                             f"length {d}) of shape {shape}")
        g = int(group_size)
    if bits == 4 and shape[-1] % 2:
        raise ValueError(f"int4 packs two values per byte along the last axis, which must be even; "
                         f"got shape {shape}")
    return ax, g


def quantize(w: jax.Array, bits: int, group_size: int | None = None, axis: int = -2,
             scale_dtype=jnp.bfloat16) -> QuantizedTensor:
    """Symmetric round-to-nearest quantisation of ``w`` (any float dtype) to int8 or packed int4.

    ``axis`` is the contraction axis (-2 for a weight used as ``x @ W``); scales are per output channel
    (``group_size=None``) or per ``group_size`` consecutive contraction entries and channel."""
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise ValueError(f"quantize expects a floating-point tensor, got dtype {w.dtype}")
    shape = tuple(w.shape)
    ax, g = _check_args(shape, bits, group_size, axis)
    sname = _scale_dtype_name(scale_dtype)
    q, scale = _quantize(w, bits, g, ax, sname)
    return QuantizedTensor(q=q, scale=scale, bits=bits, group_size=None if group_size is None else g,
                           axis=ax - len(shape), dtype=np.dtype(w.dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(w: jax.Array, bits: int, g: int, ax: int, sname: str) -> tuple[jax.Array, jax.Array]:
    # one compiled program per shape/configuration (eager op-by-op dispatch is ~8x slower to first result)
    shape = tuple(w.shape)
    m = qmax(bits)
    gshape = shape[:ax] + (shape[ax] // g, g) + shape[ax + 1:]
    wg = w.astype(jnp.float32).reshape(gshape)
    amax = jnp.max(jnp.abs(wg), axis=ax + 1)
    # XLA:CPU's max-reduction drops NaN from rows of 2,048 and more (-inf or a finite value): found separately
    amax = jnp.where(jnp.isnan(wg).any(axis=ax + 1), jnp.nan, amax)
    # products with reciprocals, written out: what XLA's simplifier makes of ``amax / m`` and ``wg / safe``
    # anyway (the same bits, tested), stated so that ``quantize_rows_into`` can compute them on the host exactly
    scale = _ceil_scale(amax * (np.float32(1) / np.float32(m)), sname)
    s = scale.astype(jnp.float32)
    safe = jnp.expand_dims(jnp.where(s > 0, s, 1.0), ax + 1)
    q = jnp.clip(jnp.round(wg * (1.0 / safe)), -m, m).astype(jnp.int8).reshape(shape)
    return (pack_int4(q) if bits == 4 else q), scale


ROWS_PER_CHUNK = 32  # host quantisation works in row blocks whose float32 temporaries stay well under 1 MiB


def quantize_rows_into(w: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """``quantize(w, 8, axis=-1, scale_dtype=float32)`` of a host matrix ``w`` ``[rows, in]`` (any float dtype),
    computed with numpy into the given arrays ``q`` (int8 ``[rows, in]``) and ``scale`` (float32 ``[rows, 1]``):
    the same bits as the device program (tested), without a new buffer. A page quantised as it arrives in an
    int8 slot is written this way, straight into the slot's memory: on the device every page's new output
    buffers were fresh mappings under the pager's mmap threshold, ~6,500 page faults (8-10 ms) per expert at
    Qwen3-30B-A3B's shapes. Works in ``ROWS_PER_CHUNK``-row blocks (temporaries small enough for the heap)."""
    rows, cols = w.shape
    if q.shape != (rows, cols) or scale.shape != (rows, 1):
        raise ValueError(f"quantize_rows_into: {w.shape} into q {q.shape} and scale {scale.shape}")
    m = np.float32(qmax(8))
    inv_m = np.float32(1) / m
    block = np.empty((min(ROWS_PER_CHUNK, rows), cols), np.float32)
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, rows)
        b, s = block[: stop - start], scale[start:stop]
        np.copyto(b, w[start:stop], casting="unsafe")
        amax = np.max(np.abs(b), axis=1, keepdims=True)  # NaN propagates (the device program makes it so)
        np.multiply(amax, inv_m, out=s)
        inv = np.float32(1) / np.where(s > 0, s, np.float32(1))
        np.multiply(b, inv, out=b)
        np.rint(b, out=b)  # half to even, as jnp.round
        np.clip(b, -m, m, out=b)
        with np.errstate(invalid="ignore"):  # a NaN row (its scale NaN too: dequantised, NaN again)
            np.copyto(q[start:stop], b, casting="unsafe")


def count_nonfinite(scale: np.ndarray) -> int:
    """How many of stored scales ``scale`` are NaN or infinite: such a scale makes its whole row NaN or infinite
    in every dtype, so a file holding one is damaged (no wider dtype loads it)."""
    return int(scale.size - np.count_nonzero(np.isfinite(scale)))


def dequantize(qt: QuantizedTensor | jax.Array, dtype=None) -> jax.Array:
    """The tensor ``qt`` stands for, in ``dtype`` (default: the original dtype); computed in float32.
    Works on any slice of a stacked tensor along leading axes (``take``) and under ``vmap``.
    A plain array is returned as is (cast to ``dtype`` if given), so full-precision and quantised experts
    can go through one code path."""
    if not isinstance(qt, QuantizedTensor):
        x = jnp.asarray(qt)
        return x if dtype is None else x.astype(dtype)
    return _dequantize(qt.q, qt.scale, qt.bits, qt.axis, jnp.dtype(qt.dtype if dtype is None else dtype))


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _dequantize(q: jax.Array, scale: jax.Array, bits: int, axis: int, dtype) -> jax.Array:
    q = unpack_int4(q) if bits == 4 else q
    shape = tuple(q.shape)
    ax = len(shape) + axis
    ng = scale.shape[ax]
    gshape = shape[:ax] + (ng, shape[ax] // ng) + shape[ax + 1:]
    out = q.astype(jnp.float32).reshape(gshape) * jnp.expand_dims(scale.astype(jnp.float32), ax + 1)
    return out.reshape(shape).astype(dtype)


def take(qt: QuantizedTensor, index) -> QuantizedTensor:
    """The QuantizedTensor of ``w[index]``, indexing the leading axis (an expert of an [N, D, F] stack).

    ``index``: a Python int, a (traced) integer scalar or array, or a slice — numpy indexing semantics
    (negative indices count from the end; out-of-range traced indices are clamped, as in jnp)."""
    if qt.ndim + qt.axis == 0:
        raise ValueError(f"take indexes axis 0, which is the contraction axis of this tensor (shape "
                         f"{qt.shape}); only leading batch (expert) axes can be indexed")
    if not isinstance(index, slice):
        index = jnp.asarray(index)
        if not jnp.issubdtype(index.dtype, jnp.integer):
            raise ValueError(f"take needs an integer index, got dtype {index.dtype}")
    return qt.replace(q=qt.q[index], scale=qt.scale[index])


def nbytes(x: QuantizedTensor | jax.Array) -> int:
    """Real stored size in bytes: q bytes + scale bytes (a plain array: its own bytes)."""
    if isinstance(x, QuantizedTensor):
        return nbytes(x.q) + nbytes(x.scale)
    return int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize


# ---------------------------------------------------------------------------------------- MoE experts
def quantize_experts(moe_params: dict, bits: int, group_size: int | None = None,
                     scale_dtype=jnp.bfloat16) -> dict:
    """One MoE layer's params with the stacked routed experts ``gate``/``up`` [N, D, F] and ``down``
    [N, F, D] replaced by QuantizedTensors (contraction axis -2 for all three); every other key (router,
    shared experts, ...) is passed through untouched. ``group_size`` must divide both D and F."""
    missing = [k for k in EXPERT_KEYS if k not in moe_params]
    if missing:
        raise ValueError(f"moe params lack the expert weights {missing} (have {sorted(moe_params)})")
    out = dict(moe_params)
    for k in EXPERT_KEYS:
        w = moe_params[k]
        if isinstance(w, QuantizedTensor):
            raise ValueError(f"expert weight {k!r} is already quantised")
        if w.ndim != 3:
            raise ValueError(f"expert weight {k!r} must be stacked [N, in, out], got shape {tuple(w.shape)}")
        try:
            out[k] = quantize(w, bits, group_size, axis=-2, scale_dtype=scale_dtype)
        except ValueError as e:
            raise ValueError(f"expert weight {k!r}: {e}") from None
    return out


def expert_nbytes(experts: dict) -> int:
    """Bytes of ONE expert (gate + up + down) at the precision the dict holds them (quantised or not),
    i.e. what paging one expert moves."""
    total = 0
    for k in EXPERT_KEYS:
        x = experts[k]
        n = x.q.shape[0] if isinstance(x, QuantizedTensor) else x.shape[0]
        b = nbytes(x)
        if b % n:
            raise ValueError(f"{k!r}: {b} bytes do not split evenly over {n} experts")
        total += b // n
    return total
