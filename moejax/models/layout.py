"""The serving layout: weights arranged so that inference reads each one in place, in its stored dtype.

Why another layout. moejax's canonical parameters (``model.py``: ``x @ W``, experts stacked ``[N, in, out]``)
are what training, conversion and the checkpoint formats use. On XLA:CPU two things about them cost a
bandwidth-bound decode step most of its speed (measured in docs/benchmarks.md#decode-speed
and #one-row-products):

- a product with a bf16 matrix and one row of activations goes to XLA's f32 matrix-vector emitter, which
  first writes an f32 copy of the whole matrix (read 2 bytes, write 4, read 4 per weight);
- an expert picked by a traced id (``stack[e]``, a gather or a dynamic slice) is copied out of the stack
  before any matmul reads it.

In the serving layout

- every matrix that ``model.linear`` multiplies by is stored ``[out, in]`` (Hugging Face's own orientation)
  and wrapped in ``OutIn``: ``y = x · wᵀ`` contracts the minor axes of both operands, which XLA hands to
  its matmul library (YNNPACK) in the stored dtype; rows are padded to ``MIN_ROWS`` for 16-bit types (one
  row would go to the f32 emitter) and, on the CPU, past the bf16 row counts it runs at half speed
  (``fast_rows``). One row on the CPU (batch-1 decode) of at most ``ROW_DOT_MAX_IN`` (4,095) is ``row_dot``
  instead: XLA's fused matrix-vector loop over ``w``'s rows, which converts each weight as it reads it and runs
  2-3x faster than the library with padded rows. On the CPU a matrix whose
  ``in`` is longer is held as ``ColumnBlocks`` (contiguous column blocks of at most ``ROW_DOT_MAX_IN``, each
  a buffer of its own) so that one row still runs that loop, a block at a time.
- the routed experts of a MoE layer are an ``ExpertList``: one array per expert and matrix (gate and up
  fused, ``[2F, D]``; down ``[D, F]``), so ``lax.switch(e, ...)`` gives expert ``e``'s own buffer to its
  matmul, read in place (``model.switched_routed_experts``).

Everything else (embeddings, norms, routers, biases, MLA's ``kv_b``, Qwen's ``shared_gate``) keeps its
canonical form.

**int8 weights** (``Quantization``; ``moejax.load(..., expert_dtype="int8")`` / ``weight_dtype="int8"``): any
of those matrices may instead be a ``quant.QuantizedTensor`` of the ``[out, in]`` matrix, symmetric int8
with one float32 scale per output row (``quant.quantize(w, 8, axis=-1)``). For two or more rows ``nt_dot``
quantises each row of activations on the fly (one scale per row, absmax / 127) and multiplies int8 × int8
with int32 accumulation in XLA's matmul library, which reads the int8 weights in place: half the bytes of
bf16. This is what XNNPACK calls "qd8" and close to llama.cpp's ``Q8_0`` (which scales blocks of 32
instead of whole rows). The error against the dequantised weights in float32 is the activation rounding
alone, bounded per output by ``s_x / 2 · Σ_i |deq(w)_i|`` (tested); the weights' own rounding is
``quant``'s bound. One row on the CPU (decode) goes through ``row_dot`` in float32: no activation
rounding, and about twice the int8 library's speed. ``to_serving``/``to_canonical`` convert whole trees;
``arrange`` builds the serving tree from any leaves through caller-given readers (``weights.place`` reads
checkpoint files straight into it).
"""

from __future__ import annotations

from typing import Any, Callable

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import xla
from moejax.models import quant

ARRANGEMENTS = ("canonical", "serving")
# the longest row XLA:CPU fuses into its matrix-vector loop: from 4,096 it writes a transposed f32 copy of w
# first (55 ms for DeepSeek-V2's [2048, 10944] down matrix), and column slices of w defeat the loop
# (1-2 GB/s), so longer rows go to the library
ROW_DOT_MAX_IN = 4095
MIN_ROWS = 4  # rows of a 16-bit matmul: YNNPACK takes >= 2 (one row goes to the f32 emitter); 4 read fastest
# Row counts at which XLA:CPU's matmul library (YNNPACK) multiplies by a bf16 matrix with more than 1,024 columns
# at about half its speed per row, and the first count past each band that runs at full speed. Measured on AMD
# Zen 4 (AVX-512 BF16, and the same bands under --xla_cpu_max_isa=AVX2), one thread and two, for
# [out, in] = [2048, 2048], [2048, 1408], [1024, 4096], [50304, 2048] (``python bench/bench_row_counts.py``): 64 rows
# of a [2048, 2048] matrix took 2.8 ms and 65 rows 1.3 ms. ``fast_rows`` pads a product's rows past such a
# band; ``model.grouped_block_rows`` picks its chunk sizes outside them. Float32 and in <= 1,024 show no bands.
SLOW_BF16_ROWS = ((9, 10, 11), (13, 15, 16), (17, 20, 21), (25, 30, 31), (37, 45, 46), (49, 55, 56), (61, 64, 65))
SLOW_BF16_MIN_IN = 1025
WEIGHT_DTYPES = ("stored", "int8")
TIED_INT8_HEAD = "tied_lm_head"  # a tied model's int8 copy of its embedding, multiplied as the LM head

# matrices that model.py multiplies through linear(), by where they sit in the tree
ATTENTION_MATRICES = ("q", "k", "v", "o", "q_a", "q_b", "kv_a")
MLP_MATRICES = ("gate", "up", "down")
EXPERT_MATRICES = ("gate", "up", "down")


@jax.tree_util.register_pytree_node_class
class OutIn:
    """A matrix stored ``[out, in]``: ``linear(x, OutIn(w))`` computes ``x @ w.T`` reading ``w`` in place."""

    def __init__(self, w):
        self.w = w

    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def dtype(self):
        return self.w.dtype

    def __repr__(self) -> str:
        return f"OutIn({getattr(self.w, 'shape', '?')}, {getattr(self.w, 'dtype', '?')})"


@jax.tree_util.register_pytree_node_class
class ColumnBlocks:
    """An ``[out, in]`` matrix stored as ``blocks``, a tuple of contiguous ``[out, in_b]`` column blocks
    (each an array, or an int8 ``quant.QuantizedTensor`` with the matrix's scale per output row), in order.

    Why: XLA:CPU fuses a one-row product into its matrix-vector loop only for rows under 16 KiB of float32
    (``ROW_DOT_MAX_IN``); Mixtral's and Phi-3.5-MoE's hidden size is 4,096. A row cut into pieces under the
    limit, each multiplied with a block that is a buffer of its own, gets the loop back (column slices of one
    array do not; nor do blocks stacked in one array for more rows: the library then copies or batches
    them); more rows run one library product per block at the unblocked speed. ``shape`` and ``dtype`` are
    the logical matrix's; ``dense`` gives it back. Made by ``in_column_blocks`` where it pays (CPU arrays,
    rows past the limit)."""

    def __init__(self, blocks):
        self.blocks = tuple(blocks)

    def tree_flatten(self):
        return (self.blocks,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.blocks[0].shape[0]), sum(self.widths)

    @property
    def dtype(self):
        return self.blocks[0].dtype

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(int(b.shape[1]) for b in self.blocks)

    @property
    def ndim(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"ColumnBlocks({self.shape} in {len(self.blocks)} blocks, {self.dtype})"


@jax.tree_util.register_pytree_node_class
class ExpertList:
    """The routed experts of one MoE layer: ``gate_up[e]`` ``[2F, D]`` (gate rows first), ``down[e]``
    ``[D, F]``. Held either one buffer per expert (tuples: slots a pager writes one at a time, int8 or column-
    blocked experts) or ``stacked``: one ``[N, 2F, D]`` and one ``[N, D, F]`` buffer, indexed by a traced
    expert id inside the product that reads it (``model.switched_routed_experts``): one program for every
    expert instead of a ``lax.switch`` branch per expert, each compiled on its own (see ``stacks``)."""

    def __init__(self, gate_up, down, stacked: bool = False):
        self.stacked = stacked
        self.gate_up, self.down = (gate_up, down) if stacked else (tuple(gate_up), tuple(down))
        if not stacked and (len(self.gate_up) != len(self.down) or not self.gate_up):
            raise ValueError(f"an expert list needs as many gate_up as down matrices (>= 1), got "
                             f"{len(self.gate_up)} and {len(self.down)}")

    @classmethod
    def of_stacks(cls, gate_up, down) -> "ExpertList":
        """The list of stacked buffers ``gate_up [N, 2F, D]``, ``down [N, D, F]``."""
        return cls(gate_up, down, stacked=True)

    def tree_flatten(self):
        return (self.gate_up, self.down), self.stacked

    @classmethod
    def tree_unflatten(cls, stacked, children):
        return cls(*children, stacked=stacked)

    @property
    def n_experts(self) -> int:
        return self.gate_up.shape[0] if self.stacked else len(self.gate_up)

    @property
    def dtype(self):
        return self.gate_up.dtype if self.stacked else self.gate_up[0].dtype

    def expert(self, e) -> tuple:
        """Expert ``e``'s ``(gate_up, down)``; for a stacked list ``e`` may be traced (a slice of each stack)."""
        if self.stacked:
            return (jax.lax.dynamic_index_in_dim(self.gate_up, e, keepdims=False),
                    jax.lax.dynamic_index_in_dim(self.down, e, keepdims=False))
        return self.gate_up[e], self.down[e]

    def replace(self, e: int, gate_up, down) -> "ExpertList":
        """The list with expert ``e``'s buffers replaced (the others are shared, not copied)."""
        if self.stacked:
            return ExpertList.of_stacks(self.gate_up.at[e].set(gate_up), self.down.at[e].set(down))
        gu, d = list(self.gate_up), list(self.down)
        gu[e], d[e] = gate_up, down
        return ExpertList(tuple(gu), tuple(d))

    def __repr__(self) -> str:
        held = "stacked" if self.stacked else "one buffer each"
        return (f"ExpertList({self.n_experts} x ({self.gate_up[0].shape}, {self.down[0].shape}), {self.dtype}, "
                f"{held})")


#: one expert's bytes up to which loading holds a layer's experts ``stacked`` (``stacks``). Stacked against one
#: buffer each on the CPU (2 cores; ``python bench/bench_stacked_experts.py --models default,OLMOE_CUT``): the
#: default model (92 KB experts, 8 MoE layers x 64) compiled its first ``generate`` 3x faster and decoded at 0.96x
#: (median of 10 alternating runs); an OLMoE-1B-7B expert (12.6 MB) read through the dynamic slice decoded at
#: 0.32x and its 512-token pass ran at 0.62x (each expert copied per chunk), so experts that size keep buffers.
STACK_EXPERT_MAX_BYTES = 1 << 20


def stacks(gate_up, down) -> bool:
    """Whether experts like this one (its ``gate_up`` and ``down`` matrices) are held ``stacked``
    (``ExpertList``): plain arrays read whole by the one-row product (not int8, not ``ColumnBlocks``) of at most
    ``STACK_EXPERT_MAX_BYTES`` an expert."""
    plain = all(isinstance(w, (np.ndarray, jax.Array)) and w.ndim == 2 and w.shape[1] <= ROW_DOT_MAX_IN
                for w in (gate_up, down))
    return plain and gate_up.nbytes + down.nbytes <= STACK_EXPERT_MAX_BYTES


@dataclasses.dataclass(frozen=True)
class Quantization:
    """Which serving-layout matrices are held as int8 (``quantize_matrix``); the rest keep their dtype."""

    experts: bool = False  # the routed experts
    matrices: bool = False  # every other matrix: attention, dense and shared MLPs, the LM head

    @classmethod
    def from_dtypes(cls, weight_dtype: str | None = None, expert_dtype: str | None = None) -> "Quantization | None":
        """``weight_dtype`` for every matrix, ``expert_dtype`` overriding it for the routed experts; each
        None, "stored" or "int8". None when nothing is quantised."""
        for flag, value in (("weight_dtype", weight_dtype), ("expert_dtype", expert_dtype)):
            if value is not None and value not in WEIGHT_DTYPES:
                raise ValueError(f"{flag} must be one of {', '.join(WEIGHT_DTYPES)}, got {value!r}")
        matrices = weight_dtype == "int8"
        q = cls(experts=matrices if expert_dtype is None else expert_dtype == "int8", matrices=matrices)
        return q if q.experts or q.matrices else None

    def matrix(self, w):
        return quantize_matrix(w) if self.matrices else w

    def expert(self, w):
        return quantize_matrix(w) if self.experts else w


def quantize_matrix(w) -> "quant.QuantizedTensor":
    """An ``[out, in]`` matrix as symmetric int8 with one float32 scale per output row (for ``nt_dot``)."""
    if isinstance(w, quant.QuantizedTensor):
        return w
    return quant.quantize(jnp.asarray(w), 8, axis=-1, scale_dtype=jnp.float32)


def is_int8(w) -> bool:
    return isinstance(w.blocks[0] if isinstance(w, ColumnBlocks) else w, quant.QuantizedTensor)


def matrix_nbytes(w) -> int:
    """Bytes a serving-layout matrix occupies (int8 values + scales, or the array's own)."""
    if isinstance(w, ColumnBlocks):
        return sum(quant.nbytes(b) for b in w.blocks)
    return quant.nbytes(w)


def column_block_widths(k: int) -> tuple[int, ...]:
    """Widths of the column blocks a row of ``k`` needs for the one-row loop (``ColumnBlocks``): the fewest
    near-equal blocks of at most ``ROW_DOT_MAX_IN``; ``(k,)`` when it fits whole."""
    nb = -(-k // ROW_DOT_MAX_IN)
    return tuple(len(part) for part in np.array_split(np.arange(k), nb))


def column_pieces(x, widths: tuple[int, ...]) -> list:
    """``x [rows, Σ widths]`` (numpy, a jax array, or traced) cut into consecutive column pieces of ``widths``:
    the one cut behind ``ColumnBlocks`` (blocks from a matrix, row pieces for the blocks, pages for slots)."""
    starts = np.cumsum((0,) + tuple(widths))
    return [x[:, a:b] for a, b in zip(starts[:-1], starts[1:])]


def placed(host, put: Reader = jnp.asarray, quantize: Callable | None = None):
    """``put(host)``, quantised by ``quantize`` if given, as ``ColumnBlocks`` where ``in_column_blocks`` makes
    them. A wide host (numpy) matrix that stays in its dtype is cut into blocks on the host and each block
    put: one copy, as putting it whole (cutting a placed array reads it back off the device first, which
    doubled the load time of Mixtral's shapes)."""
    if isinstance(host, np.ndarray) and host.ndim == 2 and quantize is None and jax.default_backend() == "cpu":
        widths = column_block_widths(host.shape[1])
        if len(widths) > 1:
            put_block = jax.device_put if put is jnp.asarray else put  # device_put keeps the host copy, asarray copies it again
            return ColumnBlocks(put_block(np.ascontiguousarray(piece)) for piece in column_pieces(host, widths))
    w = put(host)
    return in_column_blocks(quantize(w) if quantize is not None else w)


def _on_cpu(a) -> bool:
    return (isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer)
            and all(d.platform == "cpu" for d in a.devices()))


def blocked_like(template, w):
    """``w`` (an ``[out, in]`` array or int8 ``quant.QuantizedTensor``, or already blocks) cut into the column
    blocks of ``template`` when ``template`` is ``ColumnBlocks`` (a page written into blocked slots); else
    ``w`` as it is. Traceable: the cut is a slice of the placed matrix."""
    if not isinstance(template, ColumnBlocks) or isinstance(w, ColumnBlocks):
        return w
    if isinstance(w, quant.QuantizedTensor):
        return ColumnBlocks(w.replace(q=q) for q in column_pieces(w.q, template.widths))
    return ColumnBlocks(column_pieces(w, template.widths))


def copy_into_blocks(dst: ColumnBlocks, src) -> None:
    """Copy the host matrix ``src`` (an array or int8 ``quant.QuantizedTensor`` of numpy arrays) into the
    writable host views ``dst`` of column blocks (a page read for blocked slots, ``expert_store.slot_views``)."""
    int8 = isinstance(src, quant.QuantizedTensor)
    for block, piece in zip(dst.blocks, column_pieces(src.q if int8 else src, dst.widths)):
        if int8:
            np.copyto(block.q, piece)
            np.copyto(block.scale, src.scale)
        else:
            np.copyto(block, piece)


def in_column_blocks(w):
    """``w`` (an ``[out, in]`` array or int8 ``quant.QuantizedTensor`` with one scale per row) as
    ``ColumnBlocks`` when one-row products with it would otherwise leave XLA:CPU's fused loop: a CPU array
    whose ``in`` is past ``ROW_DOT_MAX_IN``. Anything else as it is. Copies ``w`` once (one program per shape)."""
    values = w.q if isinstance(w, quant.QuantizedTensor) else w
    widths = column_block_widths(int(values.shape[-1])) if getattr(values, "ndim", 0) == 2 else (0,)
    if len(widths) == 1 or not _on_cpu(values):
        return w
    if isinstance(w, quant.QuantizedTensor) and (w.bits != 8 or w.scale.shape != (values.shape[0], 1)):
        return w
    blocks = _cut_columns(values, widths)
    if isinstance(w, quant.QuantizedTensor):  # each block its own copy of the scales: a buffer per leaf
        return ColumnBlocks(w.replace(q=b, scale=jnp.array(w.scale, copy=True)) for b in blocks)
    return ColumnBlocks(blocks)


_cut_columns = jax.jit(column_pieces, static_argnums=1)  # one program per shape, no host round trip


@jax.tree_util.register_pytree_node_class
class ExpertShards:
    """The routed experts of one MoE layer split over devices (expert parallelism): canonical stacks
    ``gate``/``up`` ``[N, D, F]`` and ``down`` ``[N, F, D]`` laid along the mesh axis ``axis``, N / devices
    experts on each (``model.sharded_routed_experts`` computes them where they are)."""

    def __init__(self, gate, up, down, mesh, axis: str = "experts"):
        self.gate, self.up, self.down, self.mesh, self.axis = gate, up, down, mesh, axis

    def tree_flatten(self):
        return (self.gate, self.up, self.down), (self.mesh, self.axis)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def n_experts(self) -> int:
        return int(self.gate.shape[0])

    @property
    def dtype(self):
        return self.gate.dtype

    def stacks(self) -> dict:
        return {"gate": self.gate, "up": self.up, "down": self.down}

    def __repr__(self) -> str:
        return f"ExpertShards({self.n_experts} experts over {self.mesh.devices.size} devices, {self.dtype})"


def is_serving(params: dict) -> bool:
    """True when ``params`` is in the serving layout (any MoE layer holds an ``ExpertList``, or any
    attention matrix is an ``OutIn``)."""
    for lp in params["layers"]:
        if isinstance(lp.get("moe", {}).get("experts"), (ExpertList, ExpertShards)) or \
                isinstance(lp["attn"].get("q"), OutIn):
            return True
        if isinstance(lp["attn"].get("q_a"), OutIn) or isinstance(lp["attn"].get("kv_a"), OutIn):
            return True
    return False


# ------------------------------------------------------------------------------------------- compute
def nt_dot(x: jax.Array, w) -> jax.Array:
    """``x @ w.T`` for ``x [..., in]``, ``w [out, in]`` (an array or an int8 ``quant.QuantizedTensor``),
    accumulated and returned in float32.

    One row (batch-1 decode) on the CPU: ``row_dot``. Otherwise the matmul library reads the weights in
    place; on the CPU 16-bit rows are padded to ``MIN_ROWS`` for it (one row would go to XLA's f32
    matrix-vector emitter, which copies the whole matrix to f32 first), and bf16 rows past the counts it runs
    at half speed (``fast_rows``). ``ColumnBlocks``: ``blocked_nt_dot``."""
    if isinstance(w, ColumnBlocks):
        return blocked_nt_dot(x, w)
    if isinstance(w, quant.QuantizedTensor):
        return int8_nt_dot(x, w)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.dtype != w.dtype:
        rows = rows.astype(w.dtype)
    one_row = row_dot if k <= ROW_DOT_MAX_IN else _library_dot
    return one_row_on_cpu(rows, one_row, _library_dot, w).reshape(*lead, w.shape[0])


def nt_dot_at(x: jax.Array, stack: jax.Array, e) -> jax.Array:
    """``nt_dot(x, stack[e])`` for a stack ``[N, out, in]`` and a traced expert id ``e``. One row on the CPU:
    ``row_dot`` with the slice inside its loop, so the expert is read in place, not copied out first; more rows
    (or another platform): the matmul library on the slice (a copy of the one expert)."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.dtype != stack.dtype:
        rows = rows.astype(stack.dtype)

    def library(rows, stack, e):
        return _library_dot(rows, jax.lax.dynamic_index_in_dim(stack, e, keepdims=False))

    return one_row_on_cpu(rows, row_dot_at, library, stack, e).reshape(*lead, stack.shape[1])


def row_dot_at(row: jax.Array, stack: jax.Array, e) -> jax.Array:
    """``row_dot(row, stack[e])`` with the dynamic slice fused into the loop. The barrier ties the whole stack
    and the id to the row (``row_dot``): tied to a loop-invariant row, XLA hoisted the float32 conversion of
    every expert of the stack out of the decode loop."""
    row, stack, e = jax.lax.optimization_barrier((row, stack, e))
    w = jax.lax.dynamic_index_in_dim(stack, e, keepdims=False)
    return jnp.dot(row, w.astype(row.dtype).T, preferred_element_type=jnp.float32)


def fast_rows(n: int, k: int, dtype) -> int:
    """Rows to give the matmul library for ``n`` rows of ``in`` = ``k`` by a ``dtype`` matrix: ``n``, or the
    first count past a ``SLOW_BF16_ROWS`` band (bf16, ``k`` >= ``SLOW_BF16_MIN_IN``), where the padded
    product takes 30-50 % less time than the unpadded one."""
    if jnp.dtype(dtype) == jnp.bfloat16 and k >= SLOW_BF16_MIN_IN:
        for lo, hi, fast in SLOW_BF16_ROWS:
            if lo <= n <= hi:
                return fast
    return n


def _library_dot(rows: jax.Array, w: jax.Array) -> jax.Array:
    n, k = rows.shape
    least = max(n, MIN_ROWS) if w.dtype.itemsize < 4 else n
    fast = fast_rows(least, k, w.dtype)
    if fast == least:
        return _padded_dot(rows, w, least - n)
    return jax.lax.platform_dependent(rows, w, cpu=functools.partial(_padded_dot, pad=fast - n),
                                      default=functools.partial(_padded_dot, pad=least - n))


def _padded_dot(rows: jax.Array, w: jax.Array, pad: int) -> jax.Array:
    """``rows @ w.T`` in float32, with ``pad`` zero rows appended (and cut off again)."""
    n = rows.shape[0]
    if pad:
        rows = jnp.concatenate([rows, jnp.zeros((pad, rows.shape[1]), rows.dtype)])
    return jax.lax.dot_general(rows, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)[:n]


def one_row_on_cpu(rows: jax.Array, cpu: Callable, default: Callable, *operands):
    """``cpu(rows, *operands)`` for a single row (one token: batch-1 decode) on the CPU, ``default(rows,
    *operands)`` for more rows or on other platforms: where decode takes a CPU-only path."""
    if rows.shape[0] != 1:
        return default(rows, *operands)
    return jax.lax.platform_dependent(rows, *operands, cpu=cpu, default=default)


def row_dot(row: jax.Array, w: jax.Array) -> jax.Array:
    """``row [1, in] @ w.T`` for ``w [out, in]`` in the row's dtype or int8 (then multiplied in the row's
    float32), float32: the product of a batch-1 decode step on the CPU, for ``in`` up to ``ROW_DOT_MAX_IN``.

    Written as a product with the transposed matrix, XLA:CPU fuses the conversion of ``w`` to float32, the
    transpose and the dot into one loop over ``w``'s rows, split over the threads, reading ``w`` in place
    once: 2-4x the weights per second of the matmul library with padded rows, near the memory bandwidth
    for large matrices (``python bench/bench_probes.py row-dot``, docs/benchmarks.md#one-row-products).

    The row must be a buffer of shape ``[1, in]``: one that XLA sees as a reshape of another shape
    (attention's ``[1, heads, head_dim]``) makes the loop index every element through that shape, 10x
    slower; such callers pass it through ``as_rows`` first. The optimisation barrier ties ``w`` to the row:
    inside a decode loop XLA would otherwise hoist the loop-invariant conversion out of the loop and keep a
    float32 copy of every matrix."""
    row, w = jax.lax.optimization_barrier((row, w))
    return jnp.dot(row, w.astype(row.dtype).T, preferred_element_type=jnp.float32)


def as_rows(x: jax.Array) -> jax.Array:
    """``x.reshape(T, -1)`` held by XLA in that shape: for a reshaped row that goes to ``row_dot`` (see there).
    One token on the CPU is ``xla.materialised``; anything else is the reshape alone."""
    return one_row_on_cpu(x.reshape(x.shape[0], -1), xla.materialised, lambda r: r)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 rows of ``x [R, in]`` and their float32 scales ``[R, 1]`` (absmax / 127 per row; an
    all-zero row gets scale 0). A NaN row gets a NaN scale, so NaN still comes out of the product."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    # XLA:CPU's max-reduction drops NaN in rows of 2,048 and more (-inf or the largest finite value), so
    # a NaN row is found separately
    s = jnp.where(jnp.isnan(x).any(axis=-1, keepdims=True), jnp.nan, s)
    safe = jnp.where(s > 0, s, 1.0)
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), s


def int8_nt_dot(x: jax.Array, w: "quant.QuantizedTensor") -> jax.Array:
    """``x @ deq(w).T`` with ``w`` int8 ``[out, in]`` (one scale per output row), float32. The activation
    rows are quantised per row, multiplied int8 x int8 -> int32 in the matmul library (weights read in
    place), then scaled; one row on the CPU is multiplied in float32 by ``row_dot`` instead (faster, and
    without the activation rounding)."""
    if w.bits != 8 or w.axis != -1 or w.scale.shape[-1] != 1:
        raise ValueError(f"int8_nt_dot needs int8 weights with one scale per output row, got {w.bits}-bit "
                         f"weights with scales {tuple(w.scale.shape)} along axis {w.axis}")
    lead, k = x.shape[:-1], x.shape[-1]
    scale = w.scale[:, 0].astype(jnp.float32)[None, :]
    one_row = (lambda row, q: row_dot(row.astype(jnp.float32), q)) if k <= ROW_DOT_MAX_IN else _int8_library_dot
    y = one_row_on_cpu(x.reshape(-1, k), one_row, _int8_library_dot, w.q)
    return (y * scale).reshape(*lead, w.q.shape[0])


def _int8_library_dot(rows: jax.Array, *qs: jax.Array) -> jax.Array:
    """Rows quantised whole, multiplied int8 x int8 by ``q [out, in]`` or its column blocks ``qs`` (the int32
    partial sums add up to the whole product), then scaled."""
    xq, xs = quantize_rows(rows)
    pieces = column_pieces(xq, tuple(q.shape[1] for q in qs)) if len(qs) > 1 else [xq]
    acc = functools.reduce(jnp.add, [_int8_product(piece, q) for piece, q in zip(pieces, qs)])
    return acc.astype(jnp.float32) * xs


def _int8_product(xq: jax.Array, q: jax.Array) -> jax.Array:
    """int8 rows x int8 ``q [out, in]``ᵀ, int32. A single row is padded to two: the library's one-row int8
    product reads 0.8 GB/s on the CPU, two rows 14-15 GB/s."""
    n = xq.shape[0]
    if n == 1:
        xq = jnp.concatenate([xq, jnp.zeros_like(xq)])
    return jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)[:n]


def blocked_nt_dot(x: jax.Array, w: ColumnBlocks) -> jax.Array:
    """``nt_dot`` for ``ColumnBlocks`` (float or int8), float32: the partial products of the row pieces with
    their blocks, summed. One row on the CPU: each piece through ``row_dot``, every piece and partial product
    ``xla.materialised`` (fused into one sum, the loops run 20x slower). More rows: the library per block
    (int8: rows quantised whole, int32 partial sums: the same numbers as the unblocked product)."""
    int8 = isinstance(w.blocks[0], quant.QuantizedTensor)
    values = tuple(b.q for b in w.blocks) if int8 else w.blocks
    lead, (out, k) = x.shape[:-1], w.shape
    rows = x.reshape(-1, k).astype(jnp.float32 if int8 else values[0].dtype)
    library = _int8_library_dot if int8 else _blocked_library_dot
    y = one_row_on_cpu(rows, _blocked_row_dot, library, *values)
    if int8:
        y = y * w.blocks[0].scale[:, 0].astype(jnp.float32)[None, :]
    return y.reshape(*lead, out)


def _row_pieces(rows: jax.Array, blocks: tuple) -> list[jax.Array]:
    return column_pieces(rows, tuple(b.shape[1] for b in blocks))


def _blocked_row_dot(row: jax.Array, *blocks: jax.Array) -> jax.Array:
    parts = [xla.materialised(row_dot(xla.materialised(piece), b)) for piece, b in zip(_row_pieces(row, blocks), blocks)]
    return functools.reduce(jnp.add, parts)


def _blocked_library_dot(rows: jax.Array, *blocks: jax.Array) -> jax.Array:
    return functools.reduce(jnp.add, [_library_dot(piece, b) for piece, b in zip(_row_pieces(rows, blocks), blocks)])


def matmul(x: jax.Array, w) -> jax.Array:
    """``x @ w`` for a canonical ``[in, out]`` matrix or an ``OutIn``; result in x's dtype."""
    if isinstance(w, OutIn):
        return nt_dot(x, w.w).astype(x.dtype)
    return x @ w


# ------------------------------------------------------------------------------------------- conversion
Reader = Callable[[Any], Any]


def _expert_reader_from_stacks(moe: dict) -> Callable[[int], tuple]:
    def read(e: int):
        g, u, d = (np.asarray(moe[k][e]) for k in EXPERT_MATRICES)
        return np.concatenate([g.T, u.T]), np.ascontiguousarray(d.T)
    return read


def arrange(params: dict, out_in: Reader, experts: Callable[[dict], Any], put: Reader = jnp.asarray,
            quantization: Quantization | None = None) -> dict:
    """The serving tree of a canonical tree (whose leaves may be anything ``out_in``/``put`` can read).

    ``out_in(leaf)``: the leaf as an ``[out, in]`` host array; ``experts(moe)``: the layer's experts as an
    ``ExpertList`` (or left as they are, e.g. in their files for offload; quantised by the caller, see
    ``expert_list``); ``put``: any other leaf placed. ``quantization``: the matrices to hold as int8 (each
    quantised as soon as it is placed; a tied LM head gets an int8 copy of the embedding as ``lm_head``).
    Placed one tensor at a time, so the host never holds more than one."""
    q = quantization or Quantization()

    def mat(w):
        return OutIn(placed(out_in(w), quantize=quantize_matrix if q.matrices else None))

    def mlp(p):
        return {k: (mat(v) if k in MLP_MATRICES else put(v)) for k, v in p.items()}

    layers = []
    for i, lp in enumerate(params["layers"]):
        new = {k: jax.tree.map(put, v) for k, v in lp.items() if k not in ("attn", "mlp", "moe")}
        new["attn"] = {k: (mat(v) if k in ATTENTION_MATRICES else put(v)) for k, v in lp["attn"].items()}
        if "mlp" in lp:
            new["mlp"] = mlp(lp["mlp"])
        if "moe" in lp:
            moe = {k: v for k, v in lp["moe"].items() if k not in EXPERT_MATRICES}
            moe = {k: (mlp(v) if k == "shared" else put(v)) for k, v in moe.items()}
            arranged = experts(lp["moe"])
            if isinstance(arranged, (ExpertList, ExpertShards)):
                moe["experts"] = arranged
            else:
                moe.update(arranged)
            new["moe"] = moe
        layers.append(new)
    out = {k: jax.tree.map(put, v) for k, v in params.items() if k not in ("layers", "lm_head")}
    out["layers"] = layers
    if "lm_head" in params:
        out["lm_head"] = mat(params["lm_head"])
    elif q.matrices:  # tied: the embedding stays for the lookup, the head multiplies an int8 copy
        out[TIED_INT8_HEAD] = OutIn(in_column_blocks(quantize_matrix(out["embed"])))
    return out


def expert_list(n: int, read: Callable[[int], tuple], put: Reader = jnp.asarray,
                quantization: Quantization | None = None) -> ExpertList:
    """An ``ExpertList`` of ``n`` experts, ``read(e) -> (gate_up [2F, D], down [D, F])`` one at a time (each
    quantised right after it is placed when ``quantization.experts``). Experts that ``stacks`` allows are
    gathered into one host stack per matrix and placed once (the host then holds one layer's experts)."""
    q = quantization or Quantization()
    first = read(0)
    if not q.experts and all(isinstance(w, np.ndarray) for w in first) and stacks(*first):
        held = [np.empty((n, *w.shape), w.dtype) for w in first]
        for e in range(n):
            for stack, w in zip(held, first if e == 0 else read(e)):
                stack[e] = w
        gate_up, down = (put(stack) for stack in held)
        return ExpertList.of_stacks(gate_up, down)
    gate_up, down = [], []
    for e in range(n):
        gu, d = first if e == 0 else read(e)
        gate_up.append(placed(gu, put, quantize_matrix if q.experts else None))
        down.append(placed(d, put, quantize_matrix if q.experts else None))
    return ExpertList(tuple(gate_up), tuple(down))


def to_serving(params: dict, quantization: Quantization | None = None) -> dict:
    """Canonical (arrays) -> serving layout. Copies every matrix once (transposed); ``quantization``: the
    matrices to hold as int8."""
    if is_serving(params):
        if quantization is not None:
            raise ValueError("to_serving(..., quantization=) needs a canonical tree: these params are already "
                             "in the serving layout (load them again with the dtype you want)")
        return params

    def experts(moe):
        return expert_list(int(moe["gate"].shape[0]), _expert_reader_from_stacks(moe), quantization=quantization)

    return arrange(params, lambda w: np.ascontiguousarray(np.asarray(w).T), experts, quantization=quantization)


def _map_serving(params, matrix: Callable, experts: Callable[[ExpertList], dict]):
    """The tree with every ``OutIn`` replaced by ``matrix(it)`` and every ``ExpertList`` by the
    ``gate``/``up``/``down`` entries of ``experts(it)`` (the canonical tree's paths)."""
    if isinstance(params, OutIn):
        return matrix(params)
    if isinstance(params, dict):
        out = {}
        for k, v in params.items():
            if isinstance(v, ExpertList):
                out.update(experts(v))
            elif isinstance(v, ExpertShards):  # already canonical stacks, only spread over devices
                out.update(v.stacks())
            else:
                out[k] = _map_serving(v, matrix, experts)
        return out
    if isinstance(params, list):
        return [_map_serving(v, matrix, experts) for v in params]
    return params


def to_canonical(params: dict) -> dict:
    """Serving -> canonical (``x @ W`` matrices, experts stacked ``[N, in, out]``): for checkpoint writers,
    training and anything that needs the stacks. Copies."""
    return _map_serving(_without_copies(params), lambda m: dense(m.w).T, canonical_experts)


def _without_copies(params: dict) -> dict:
    """The tree without what ``arrange`` derived from other weights (a tied model's int8 head)."""
    return {k: v for k, v in params.items() if k != TIED_INT8_HEAD} if TIED_INT8_HEAD in params else params


def dense(w) -> jax.Array:
    """A serving-layout matrix as a plain ``[out, in]`` array: int8 ones dequantised to their original dtype,
    ``ColumnBlocks`` put back together."""
    if isinstance(w, ColumnBlocks):
        return jnp.concatenate([dense(b) for b in w.blocks], axis=1)
    return quant.dequantize(w) if isinstance(w, quant.QuantizedTensor) else jnp.asarray(w)


def canonical_experts(experts: ExpertList) -> dict:
    """``{"gate", "up", "down"}`` stacks ``[N, D, F]``/``[N, F, D]`` of an ``ExpertList`` (a copy)."""
    f = experts.gate_up[0].shape[0] // 2
    gate_up = [dense(gu) for gu in experts.gate_up]
    gate = jnp.stack([gu[:f].T for gu in gate_up])
    up = jnp.stack([gu[f:].T for gu in gate_up])
    down = jnp.stack([dense(d).T for d in experts.down])
    return {"gate": gate, "up": up, "down": down}


def gather_experts(experts: ExpertList, ids: jax.Array) -> dict:
    """Canonical ``gate``/``up``/``down`` stacks ``[K, ...]`` of the experts ``ids`` [K] (traced ids: one
    ``lax.switch`` per id copies that expert; for the rare paths that need stacks, e.g. low-bit copies)."""
    f = experts.gate_up[0].shape[0] // 2

    def branch(e):
        gu, d = experts.expert(e)
        return lambda: (dense(gu)[:f].T, dense(gu)[f:].T, dense(d).T)

    branches = [branch(e) for e in range(experts.n_experts)]
    parts = [jax.lax.switch(i, branches) for i in ids]
    return {k: jnp.stack([p[j] for p in parts]) for j, k in enumerate(EXPERT_MATRICES)}


class CanonicalExpertView:
    """One canonical expert stack (``gate``/``up``/``down``, ``[N, in, out]``) of an ``ExpertList``, read
    on demand: shape, dtype, one expert, or sampled elements (fingerprints) without stacking the layer."""

    def __init__(self, experts: ExpertList, which: str):
        self.experts, self.which = experts, which
        gu = experts.gate_up[0]
        f, d = gu.shape[0] // 2, gu.shape[1]
        self.dtype = np.dtype(gu.dtype)  # int8 experts: the dtype they dequantise to
        self.shape = (experts.n_experts, f, d) if which == "down" else (experts.n_experts, d, f)

    @property
    def ndim(self) -> int:
        return 3

    def read_expert(self, e: int) -> np.ndarray:
        """Expert ``e`` as a host array in the canonical orientation."""
        f = self.shape[2] if self.which != "down" else self.shape[1]
        if self.which == "down":
            return np.asarray(dense(self.experts.down[e])).T
        gu = np.asarray(dense(self.experts.gate_up[e]))
        return (gu[:f] if self.which == "gate" else gu[f:]).T

    def read(self) -> np.ndarray:
        return np.stack([self.read_expert(e) for e in range(self.shape[0])])

    def take_flat(self, idx: np.ndarray) -> np.ndarray:
        e, r, c = np.unravel_index(idx, self.shape)
        out = np.empty(idx.shape, self.dtype)
        for j in np.unique(e):
            sel = e == j
            out[sel] = self.read_expert(int(j))[r[sel], c[sel]]
        return out


class CanonicalMatrixView:
    """An ``OutIn`` seen as its canonical ``[in, out]`` matrix (shape, dtype, sampled elements)."""

    def __init__(self, w: OutIn):
        self.w = w.w
        self.dtype = np.dtype(self.w.dtype)  # int8: the dtype it dequantises to
        self.shape = tuple(reversed(self.w.shape))

    @property
    def ndim(self) -> int:
        return 2

    def read(self) -> np.ndarray:
        return np.asarray(dense(self.w)).T

    def take_flat(self, idx: np.ndarray) -> np.ndarray:
        r, c = np.unravel_index(idx, self.shape)
        return np.asarray(dense(self.w))[c, r]


def canonical_view(params: dict) -> dict:
    """The canonical tree of a serving-layout tree without copying: ``OutIn`` leaves as
    ``CanonicalMatrixView``, ``ExpertList`` as three ``CanonicalExpertView`` stacks (same tree paths and
    shapes as the canonical tree, so fingerprints and writers see one model whatever its layout)."""
    return _map_serving(_without_copies(params), CanonicalMatrixView,
                        lambda el: {m: CanonicalExpertView(el, m) for m in EXPERT_MATRICES})


VIEW_TYPES = (CanonicalExpertView, CanonicalMatrixView)
