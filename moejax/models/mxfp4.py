"""MXFP4 weights as the hub stores them (GPT-OSS's release): decoded on the host, encoded for test checkpoints.

OCP Microscaling FP4: a block of 32 consecutive weights along a row's contraction axis shares one E8M0 scale
(a byte ``s``: 2^(s − 127); 255 is NaN), and each weight is an E2M1 code of 4 bits (sign, then one of
0, 0.5, 1, 1.5, 2, 3, 4, 6), two codes a byte, the even element in the low nibble. The hub keeps a matrix
``[rows, in]`` (the ``Linear`` orientation, rows = outputs) as ``*_blocks`` ``[rows, in / 32, 16]`` uint8 and
``*_scales`` ``[rows, in / 32]`` uint8: 4.25 bits a weight, 3.8× fewer bytes than bfloat16. transformers
decodes them the same way (``integrations/mxfp4.py``, ``_convert_moe_packed_tensors``: a table of the 16
values, then ``ldexp`` by ``s − 127``).

Every MXFP4 weight is exactly a bfloat16 number while ``2 <= s <= 252``: then ``decode_into`` builds the
bfloat16 bits with integer arithmetic (a table of the bits of the four codes of two bytes, plus ``s − 127`` added
to the exponent of the non-zero ones), which numpy does at memory speed; other scales go through float32
``ldexp`` (bfloat16 subnormals, infinities, NaN — exactly what ``ldexp`` and a cast give).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from moejax.base.errors import Failure

GROUP = 32  # weights per scale
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SAFE_SCALES = (2, 252)  # E8M0 scales with which every code times 2^(s - 127) is a normal bfloat16 number
NAN_SCALE = 255  # E8M0's NaN: a block with this scale holds no numbers, in any dtype
_BF16 = np.dtype(ml_dtypes.bfloat16)
DECODED = _BF16  # what the weights decode to unless asked otherwise (exactly, within SAFE_SCALES)
_CODE_BITS = FP4_VALUES.astype(_BF16).view(np.uint16).astype(np.uint32)
_BYTES = np.arange(256)
# per byte: the bfloat16 bits of its two codes (low nibble first: the lower half of a little-endian uint32),
# and 128 (one step of bfloat16's exponent field) in each half whose code is not ±0
_PAIR_BITS = (_CODE_BITS[_BYTES & 15] | (_CODE_BITS[_BYTES >> 4] << 16)).astype(np.uint64)
_PAIR_EXPONENT_STEP = (np.where(_BYTES & 7, 128, 0) | np.where(_BYTES & 0x70, 128 << 16, 0)).astype(np.uint64)
# the same for two bytes (a little-endian uint16: four codes, four bfloat16 numbers in a uint64): half the lookups
# (512 KB tables; measured 5x faster than byte tables on a [5760, 2880] matrix, GPT-OSS-20B's expert shape)
_PAIRS = np.arange(1 << 16)
_QUAD_BITS = _PAIR_BITS[_PAIRS & 255] | (_PAIR_BITS[_PAIRS >> 8] << np.uint64(32))
_QUAD_EXPONENT_STEP = _PAIR_EXPONENT_STEP[_PAIRS & 255] | (_PAIR_EXPONENT_STEP[_PAIRS >> 8] << np.uint64(32))
CHUNK_BYTES = 1 << 16  # blocks decoded at a time: their temporaries (8x) stay in the cache


class Mxfp4Error(ValueError):
    """Blocks and scales that do not make an MXFP4 tensor."""


class NonFiniteScaleError(Mxfp4Error, Failure):
    """Scales that are NaN (``NAN_SCALE``): a damaged file, which no wider dtype decodes."""


def check_scales(scales: np.ndarray) -> None:
    """``NonFiniteScaleError`` when any E8M0 scale is NaN. ``decode`` itself decodes them as transformers does
    (2^128: inf, or 0 for a zero code); loaders call this first, so a damaged file is refused by name instead of
    computing with infinities."""
    if scales.size and int(scales.max()) == NAN_SCALE:
        raise NonFiniteScaleError(f"MXFP4 scales that are not finite (E8M0 byte {NAN_SCALE}, NaN): the file is "
                                  "damaged")


def check_pair(blocks: np.ndarray, scales: np.ndarray) -> None:
    """``blocks [..., G, 16]`` and ``scales [..., G]``, both uint8, with the same leading shape."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise Mxfp4Error(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise Mxfp4Error(f"MXFP4 blocks [..., G, 16] and scales [..., G] do not match: blocks "
                         f"{list(blocks.shape)}, scales {list(scales.shape)}")


def decoded_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the weights ``blocks`` of this shape hold: ``[..., G * 32]``."""
    return (*blocks_shape[:-2], blocks_shape[-2] * GROUP)


def decode(blocks: np.ndarray, scales: np.ndarray, dtype=_BF16) -> np.ndarray:
    """The weights ``[..., G * 32]`` as ``dtype``."""
    out = np.empty(decoded_shape(blocks.shape), dtype)
    decode_into(blocks, scales, out)
    return out


def decode_into(blocks: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """Decode ``blocks [..., G, 16]`` with ``scales [..., G]`` into ``out [..., G * 32]`` (any float dtype; a
    strided view is fine), a few rows at a time."""
    check_pair(blocks, scales)
    if out.shape != decoded_shape(blocks.shape):
        raise Mxfp4Error(f"decoding MXFP4 blocks {list(blocks.shape)} into {list(out.shape)}: expected "
                         f"{list(decoded_shape(blocks.shape))}")
    if blocks.ndim == 2:  # one row
        blocks, scales, out = blocks[None], scales[None], out[None]
    step = max(1, CHUNK_BYTES // max(1, int(np.prod(blocks.shape[1:]))))
    for r in range(0, blocks.shape[0], step):
        _decode_rows(blocks[r:r + step], scales[r:r + step], out[r:r + step])


def _decode_rows(blocks: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    lo, hi = int(scales.min(initial=127)), int(scales.max(initial=127))
    if SAFE_SCALES[0] <= lo and hi <= SAFE_SCALES[1]:
        exponent = (scales.astype(np.int64) - 127).astype(np.uint64)
        pairs = np.ascontiguousarray(blocks).view(np.uint16)  # [..., G, 8]
        bits = np.take(_QUAD_BITS, pairs)  # [..., G, 8] uint64: four bfloat16 numbers each
        # each number's exponent field moves by s - 127 and stays in range: modulo 2^64 the sum is exact
        bits += np.take(_QUAD_EXPONENT_STEP, pairs) * exponent[..., None]
        values = bits.view(_BF16).reshape(out.shape)
    else:
        codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], GROUP)
        with np.errstate(over="ignore"):  # inf, as transformers decodes it (a loader refuses NaN scales first)
            values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127).reshape(out.shape)
    with np.errstate(over="ignore"):  # float16 out: what a cast gives, as for every other stored tensor
        out[...] = values


def take(blocks: np.ndarray, scales: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The weights at ``(rows, cols)`` of the ``[rows, in]`` matrix ``blocks [rows, G, 16]`` holds, float32."""
    byte = blocks[rows, cols // GROUP, (cols % GROUP) // 2]
    code = np.where(cols % 2 == 1, byte >> 4, byte & 15)
    with np.errstate(over="ignore"):
        return np.ldexp(FP4_VALUES[code], scales_at(scales, rows, cols).astype(np.int32) - 127)


def scales_at(scales: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The scales of the weights at ``(rows, cols)`` of the matrix whose scales are ``scales [rows, in / 32]``."""
    return scales[rows, cols // GROUP]


def encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``w [..., in]`` (``in`` a multiple of 32) as MXFP4 ``(blocks [..., in / 32, 16], scales [..., in / 32])``:
    each block's scale 2^(⌊log2 absmax⌋ − 2) (the OCP rule: E2M1's largest exponent is 2), each weight rounded to
    the nearest code, saturating at ±6 — what random and test checkpoints in the hub's format are made with."""
    w = np.asarray(w, np.float32)
    if w.ndim < 1 or w.shape[-1] % GROUP:
        raise Mxfp4Error(f"MXFP4 encodes rows of a multiple of {GROUP} weights, got shape {list(w.shape)}")
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = np.abs(groups).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1))) - 2, -127)
    scales = np.clip(exponent + 127, 0, 254).astype(np.uint8)
    scaled = np.abs(groups) / np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    magnitudes = FP4_VALUES[:8]
    code = np.searchsorted((magnitudes[1:] + magnitudes[:-1]) / 2, scaled).astype(np.uint8)  # nearest, saturating
    code |= np.where(np.signbit(groups), 8, 0).astype(np.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.astype(np.uint8), scales
