"""Weights that stay where they are: tensors left in a checkpoint's own files until placed.

A checkpoint opened lazily is the usual parameter tree whose leaves are ``LazyTensor`` (one tensor, a
read-only view into its safetensors file's memory map) and ``ExpertStack`` (one MoE layer's routed experts
for one matrix, ``[N, in, out]`` in moejax's orientation, one view per expert — in whatever orientation
the file stores them: HF keeps ``[out, in]`` per expert, so those views are transposed). Nothing is read
until a leaf is placed, and every read releases the mapped pages it touched again, so the process's
resident set holds what was placed, not the file.

Placement (``place``) puts every non-expert tensor on the device (embeddings, attention, norms, routers,
shared experts, dense layers, LM head) and the routed experts either on the device too (simulation: one
stacked array per layer and matrix, built one stack at a time) or nowhere (``experts="lazy"``: the expert
stacks stay in the files; the offload store pages them from there, one expert at a time).

Streaming writers (``chunks``) take any leaf — a lazy one, a numpy or a jax array — and yield it piece by
piece in moejax's orientation, so conversions never hold more than one expert (or one non-expert tensor).
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import distributed
from moejax.models import layout, mxfp4, quant
from moejax.models.config import ERNIE, HUNYUAN
from moejax.models.safetensors_io import SafetensorsFile

EXPERTS_PLACEMENTS = ("device", "lazy")


def _copy(file: SafetensorsFile, view: np.ndarray, transposed: bool, dtype) -> np.ndarray:
    """A host copy of a stored view in moejax's orientation, as ``dtype``; the mapped pages are released."""
    with np.errstate(over="ignore"):  # an overflowing cast is refused by name where it is written or loaded
        out = np.array(view.T if transposed else view, dtype=dtype, order="C")
    file.release(view)
    return out


def _to_device(file: SafetensorsFile, view: np.ndarray, transposed: bool, dtype) -> jax.Array:
    """A device array of a stored view in moejax's orientation: straight from the mapped bytes when no
    transpose or conversion is needed (no host copy in between), else through one; pages released."""
    if transposed or view.dtype != np.dtype(dtype):
        return jnp.asarray(_copy(file, view, transposed, dtype))
    out = jnp.asarray(view)
    jax.block_until_ready(out)
    file.release(view)
    return out


def _take(view: np.ndarray, transposed: bool, coords: tuple) -> np.ndarray:
    """Elements at moejax-orientation ``coords`` of a stored view (the last two axes swapped if transposed)."""
    if transposed:
        coords = (*coords[:-2], coords[-1], coords[-2])
    return view[coords]


class LazyTensor:
    """One tensor in a checkpoint file, read (as ``dtype``, in moejax's orientation) only when placed."""

    def __init__(self, file: SafetensorsFile, view: np.ndarray, transposed: bool = False, dtype=None):
        self.file, self.view, self.transposed = file, view, transposed
        self.stored_dtype = view.dtype
        self.dtype = np.dtype(dtype or view.dtype)
        self.shape = tuple(reversed(view.shape)) if transposed else tuple(view.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def astype(self, dtype) -> "LazyTensor":
        return LazyTensor(self.file, self.view, self.transposed, dtype)

    def read(self) -> np.ndarray:
        """A copy in host memory (the mapped pages are released again)."""
        return _copy(self.file, self.view, self.transposed, self.dtype)

    def take_flat(self, idx: np.ndarray) -> np.ndarray:
        """Elements at these indices of the flattened (moejax-orientation) tensor, as ``dtype``."""
        coords = np.unravel_index(idx, self.shape)
        return np.asarray(_take(self.view, self.transposed, coords), dtype=self.dtype)

    def __repr__(self) -> str:
        return f"LazyTensor({self.shape}, {self.dtype}, {self.file.path})"


class ExpertStack:
    """The routed experts of one MoE layer and matrix, ``[N, in, out]`` in moejax's orientation, left in
    the checkpoint files: ``stored(e)`` is expert ``e``'s bytes as the file holds them (a contiguous
    read-only view; transposed when ``transposed``), ``read_expert(e)`` a host copy in moejax's layout."""

    def __init__(self, parts: list[tuple[SafetensorsFile, np.ndarray]], transposed: bool, dtype=None):
        if not parts:
            raise ValueError("an expert stack needs at least one expert")
        shapes = {v.shape for _, v in parts}
        if len(shapes) != 1:
            raise ValueError(f"experts of one stack differ in shape: {sorted(shapes)}")
        self.parts, self.transposed = parts, transposed
        view = parts[0][1]
        self.stored_dtype = view.dtype
        self.dtype = np.dtype(dtype or view.dtype)
        one = tuple(reversed(view.shape)) if transposed else tuple(view.shape)
        self.shape = (len(parts), *one)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def n_experts(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def stored_expert_nbytes(self) -> int:
        """Bytes of one expert as stored (what paging it from the file moves)."""
        return self.parts[0][1].nbytes

    def astype(self, dtype) -> "ExpertStack":
        return ExpertStack(self.parts, self.transposed, dtype)

    def stored(self, e: int) -> np.ndarray:
        return self.parts[e][1]

    def files(self) -> set:
        """The checkpoint files this stack's experts are in."""
        return {f for f, _ in self.parts}

    def read_stored(self, e: int, out: np.ndarray | None = None) -> np.ndarray:
        """A private copy of expert ``e`` as stored (``SafetensorsFile.read``: no page of the mapping touched),
        into ``out`` when given."""
        file, view = self.parts[e]
        return file.read(view, out)

    def release(self, e: int) -> None:
        file, view = self.parts[e]
        file.release(view)

    def read_expert(self, e: int) -> np.ndarray:
        file, view = self.parts[e]
        return _copy(file, view, self.transposed, self.dtype)

    def read(self) -> np.ndarray:
        """The whole stack in host memory (one copy; each expert's pages released after it is copied)."""
        out = np.empty(self.shape, self.dtype)
        for e in range(self.n_experts):
            view = self.stored(e)
            out[e] = view.T if self.transposed else view
            self.release(e)
        return out

    def take_flat(self, idx: np.ndarray) -> np.ndarray:
        e, *rest = np.unravel_index(idx, self.shape)
        out = np.empty(idx.shape, self.dtype)
        for j in np.unique(e):
            sel = e == j
            out[sel] = _take(self.stored(int(j)), self.transposed, tuple(r[sel] for r in rest))
        return out

    def __repr__(self) -> str:
        files = sorted({f.path for f, _ in self.parts})
        return f"ExpertStack({self.shape}, {self.dtype}, {len(files)} file(s), transposed={self.transposed})"


class DecodedExpertStack(ExpertStack):
    """An ``ExpertStack`` whose stored bytes are decoded as they are read (int8 values and scales, MXFP4 blocks and
    scales): ``read_out_in(e)`` gives expert ``e``'s numbers ``[out, in]`` in ``dtype``, and the canonical reads
    follow from it."""

    def read_out_in(self, e: int) -> np.ndarray:
        raise NotImplementedError

    def read_expert(self, e: int) -> np.ndarray:
        return np.ascontiguousarray(self.read_out_in(e).T)

    def read(self) -> np.ndarray:
        out = np.empty(self.shape, self.dtype)
        for e in range(self.n_experts):
            out[e] = self.read_out_in(e).T
        return out


class QuantizedExpertStack(DecodedExpertStack):
    """An ``ExpertStack`` stored as int8 (a moejax folder written with ``expert_dtype="int8"``): per expert one
    ``[out, in]`` int8 matrix (``parts``) and its float32 scales ``[out, 1]`` (``scale_parts``), exactly
    ``layout.quantize_matrix`` of the matrix. ``stored(e)`` is the ``quant.QuantizedTensor`` as the file holds
    it (views: what int8 serving and int8 offload slots take as they are, half the bytes of bf16);
    everything that wants numbers (``read``, ``read_expert``, ``take_flat``: the canonical layout, conversion
    to Hugging Face, fingerprints) gets the dequantised values in ``dtype``."""

    def __init__(self, parts: list[tuple[SafetensorsFile, np.ndarray]],
                 scale_parts: list[tuple[SafetensorsFile, np.ndarray]], dtype):
        super().__init__(parts, transposed=True, dtype=dtype)
        if len(scale_parts) != len(parts):
            raise ValueError(f"{len(parts)} int8 experts but {len(scale_parts)} scale tensors")
        rows = parts[0][1].shape[0]
        for _, view in scale_parts:
            if view.shape != (rows, 1) or view.dtype != np.float32:
                raise ValueError(f"int8 expert scales must be float32 [{rows}, 1], got {view.dtype} {list(view.shape)}")
        self.scale_parts = scale_parts

    @property
    def stored_expert_nbytes(self) -> int:
        return self.parts[0][1].nbytes + self.scale_parts[0][1].nbytes

    def astype(self, dtype) -> "QuantizedExpertStack":
        return QuantizedExpertStack(self.parts, self.scale_parts, dtype)

    def stored(self, e: int) -> quant.QuantizedTensor:
        return quant.QuantizedTensor(q=self.parts[e][1], scale=self.scale_parts[e][1], bits=8, group_size=None,
                                     axis=-1, dtype=self.dtype)

    def files(self) -> set:
        return {f for f, _ in (*self.parts, *self.scale_parts)}

    def read_stored(self, e: int, out: quant.QuantizedTensor | None = None) -> quant.QuantizedTensor:
        """Expert ``e`` as stored (int8 values and scales), private copies read without touching the mapping,
        into ``out``'s arrays when given."""
        (file, view), (scale_file, scale_view) = self.parts[e], self.scale_parts[e]
        return self.stored(e).replace(q=file.read(view, None if out is None else out.q),
                                      scale=scale_file.read(scale_view, None if out is None else out.scale))

    def release(self, e: int) -> None:
        for file, view in (self.parts[e], self.scale_parts[e]):
            file.release(view)

    def stored_copy(self, e: int) -> quant.QuantizedTensor:
        """Expert ``e`` as int8 in host memory (copies; the mapped pages are released)."""
        q = self.stored(e)
        out = q.replace(q=np.array(q.q), scale=np.array(q.scale))
        self.release(e)
        return out

    def read_out_in(self, e: int) -> np.ndarray:
        """Expert ``e`` dequantised, ``[out, in]`` (float32 products, then ``dtype``: ``quant.dequantize``)."""
        q, s = self.parts[e][1], self.scale_parts[e][1]
        out = (q.astype(np.float32) * s).astype(self.dtype)
        self.release(e)
        return out

    def take_flat(self, idx: np.ndarray) -> np.ndarray:
        e, rows, cols = np.unravel_index(idx, self.shape)  # canonical [N, in, out]: stored [out, in]
        q = np.empty(idx.shape, np.float32)
        for j in np.unique(e):
            sel = e == j
            q[sel] = self.parts[int(j)][1][cols[sel], rows[sel]] * self.scale_parts[int(j)][1][cols[sel], 0]
        return q.astype(self.dtype)


class Mxfp4ExpertStack(DecodedExpertStack):
    """An ``ExpertStack`` stored as MXFP4 (GPT-OSS's hub release, ``mxfp4``): per expert the ``[out, in / 32, 16]``
    uint8 blocks (``parts``: views of the files; GPT-OSS's gate and up are the even and odd rows of one
    ``gate_up_proj_blocks`` tensor, so theirs are strided) and ``[out, in / 32]`` E8M0 scales (``scale_parts``).
    Every read decodes on the host (``mxfp4.decode_into``) into ``dtype``, ``[out, in]`` as stored
    (``read_stored``, ``read_out_in``) or moejax's ``[in, out]`` (``read_expert``, ``read``): the device holds
    the decoded weights; paging one from the files reads 4.25 bits a weight."""

    def __init__(self, parts: list[tuple[SafetensorsFile, np.ndarray]],
                 scale_parts: list[tuple[SafetensorsFile, np.ndarray]], dtype=None):
        super().__init__(parts, transposed=True, dtype=dtype or mxfp4.DECODED)
        if len(scale_parts) != len(parts):
            raise ValueError(f"{len(parts)} MXFP4 experts but {len(scale_parts)} scale tensors")
        for (_, blocks), (_, scales) in zip(parts, scale_parts):
            mxfp4.check_pair(blocks, scales)
        self.scale_parts = scale_parts
        blocks = parts[0][1]
        if blocks.ndim != 3:
            raise ValueError(f"MXFP4 expert blocks must be [out, in / 32, 16], got {list(blocks.shape)}")
        rows, n_in = mxfp4.decoded_shape(blocks.shape)
        self.shape = (len(parts), n_in, rows)
        self.stored_dtype = self.dtype  # what a read gives: the decoded weights

    @property
    def stored_expert_nbytes(self) -> int:
        return self.parts[0][1].nbytes + self.scale_parts[0][1].nbytes

    def astype(self, dtype) -> "Mxfp4ExpertStack":
        return Mxfp4ExpertStack(self.parts, self.scale_parts, dtype)

    def files(self) -> set:
        return {f for f, _ in (*self.parts, *self.scale_parts)}

    def read_stored(self, e: int, out: np.ndarray | None = None) -> np.ndarray:
        """Expert ``e`` decoded, ``[out, in]``: blocks and scales read without touching the mapping, into
        ``out`` when given."""
        (file, blocks), (scale_file, scales) = self.parts[e], self.scale_parts[e]
        if out is None:
            out = np.empty(self.shape[:0:-1], self.dtype)
        stored = scale_file.read(scales)
        _check_scales(scale_file, scales, stored)
        mxfp4.decode_into(file.read(blocks), stored, out)
        return out

    def release(self, e: int) -> None:
        for file, view in (self.parts[e], self.scale_parts[e]):
            file.release(view)

    def read_out_in(self, e: int) -> np.ndarray:
        out = self.read_stored(e)
        self.release(e)
        return out

    def take_flat(self, idx: np.ndarray) -> np.ndarray:
        e, rows, cols = np.unravel_index(idx, self.shape)  # canonical [N, in, out]: stored [out, in]
        out = np.empty(idx.shape, np.float32)
        for j in np.unique(e):
            sel = e == j
            scale_file, scales = self.scale_parts[int(j)]
            _check_scales(scale_file, scales, mxfp4.scales_at(scales, cols[sel], rows[sel]))
            out[sel] = mxfp4.take(self.parts[int(j)][1], scales, cols[sel], rows[sel])
        return out.astype(self.dtype)


def mxfp4_gate_up(gate: ExpertStack, up: ExpertStack) -> bool:
    """Whether ``gate`` and ``up`` are the even and odd rows of one MXFP4 tensor (GPT-OSS's ``gate_up_proj``), so
    that an expert's two can be read as one block (``read_mxfp4_gate_up``)."""
    if not (isinstance(gate, Mxfp4ExpertStack) and isinstance(up, Mxfp4ExpertStack)):
        return False
    pairs = ((gate.parts[0][1], up.parts[0][1]), (gate.scale_parts[0][1], up.scale_parts[0][1]))
    return all(g.shape == u.shape and g[0].flags.c_contiguous and g.strides[0] == u.strides[0] == 2 * g[0].nbytes
               and u.__array_interface__["data"][0] - g.__array_interface__["data"][0] == g[0].nbytes
               for g, u in pairs)


def read_mxfp4_gate_up(gate: Mxfp4ExpertStack, e: int, out: np.ndarray) -> np.ndarray:
    """Expert ``e``'s gate and up (``mxfp4_gate_up``) decoded into ``out [2F, D]``, gate rows then up rows (the
    serving layout), from one read of the tensor's ``[2F, D / 32, 16]`` blocks and ``[2F, D / 32]`` scales."""
    (file, blocks), (scale_file, scales) = gate.parts[e], gate.scale_parts[e]
    f = blocks.shape[0]
    whole = [np.lib.stride_tricks.as_strided(v, (2 * f, *v.shape[1:]), (v.strides[0] // 2, *v.strides[1:]),
                                             writeable=False) for v in (blocks, scales)]
    b, s = file.read(whole[0]), scale_file.read(whole[1])
    _check_scales(scale_file, scales, s)
    mxfp4.decode_into(b.reshape(f, 2, *b.shape[1:]), s.reshape(f, 2, -1), out.reshape(2, f, -1).transpose(1, 0, 2))
    return out


def _check_scales(file: SafetensorsFile, view: np.ndarray, stored: np.ndarray) -> None:
    """``mxfp4.check_scales`` of ``stored`` (scales read from ``view``, a view of ``file``), the refusal naming
    the file and tensor that hold them, in one line."""
    try:
        mxfp4.check_scales(stored)
    except mxfp4.NonFiniteScaleError as e:
        raise mxfp4.NonFiniteScaleError(f"{file.path}: tensor {file.key_of(view)!r}: {e}") from None


# leaves read on demand: tensors in their files, and canonical views of serving-layout arrays
LAZY_TYPES = (LazyTensor, ExpertStack, *layout.VIEW_TYPES)


def is_lazy(x: Any) -> bool:
    return isinstance(x, LAZY_TYPES)


def tree_map(fn, tree):
    """``jax.tree.map`` that treats lazy leaves as leaves."""
    return jax.tree.map(fn, tree, is_leaf=is_lazy)


def leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=is_lazy)


def has_lazy_experts(params: dict) -> bool:
    """True when any routed expert stack of ``params`` is still in its files (a model loaded for offload)."""
    return any(isinstance(x, ExpertStack) for x in leaves(params))


#: parameters held in float32 whatever the model's dtype: DeepSeek-V3's selection bias, whose differences of
#: 1e-4 between experts decide the choice and would vanish in bf16's 8 bits (HF keeps it in fp32 too)
FLOAT32_PARAMS = ("score_bias",)
#: families whose router weight is float32 whatever the model's dtype, as transformers keeps it: ERNIE-4.5
#: (``_keep_in_fp32_modules_strict``), Hunyuan (its ``gate.wg`` is made float32)
FLOAT32_ROUTERS = (ERNIE, HUNYUAN)


def is_float32_param(path, model_type: str | None = None) -> bool:
    """Whether the leaf at ``path`` (a tree path: keys, or jax path entries) is one of ``FLOAT32_PARAMS``, or the
    router of a ``FLOAT32_ROUTERS`` family."""
    last = path[-1] if path else None
    name = getattr(last, "key", last)
    return name in FLOAT32_PARAMS or (name == "router" and model_type in FLOAT32_ROUTERS)


def with_dtype(tree, dtype, model_type: str | None = None):
    """Every leaf as ``dtype`` (lazy leaves convert when read; arrays now) but the float32 ones
    (``is_float32_param`` for ``model_type``); None keeps the stored dtypes."""
    if dtype is None:
        return tree
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(np.float32 if is_float32_param(path, model_type) else dtype), tree, is_leaf=is_lazy)


def place(tree, experts: str = "device", arrangement: str = "canonical",
          quantization: "layout.Quantization | None" = None, mesh=None):
    """Non-expert tensors on the default device; routed expert stacks on the device too (``"device"``) or
    left in their files (``"lazy"``). Reads one tensor (one stack, or one expert) at a time: the host never
    holds more. ``arrangement="serving"`` places the tree in ``layout``'s serving layout (matrices
    ``[out, in]``, one buffer per expert), reading Hugging Face files' ``[out, in]`` bytes as they are;
    ``quantization`` (serving only) holds the matrices it names as int8, each quantised as it is placed.
    ``mesh`` (axis "experts"): every MoE layer's experts as ``layout.ExpertShards`` split over its devices
    (each device reads only its own experts from the files), everything else replicated on them."""
    if experts not in EXPERTS_PLACEMENTS:
        raise ValueError(f"unknown expert placement {experts!r}; expected one of {EXPERTS_PLACEMENTS}")
    if arrangement not in layout.ARRANGEMENTS:
        raise ValueError(f"unknown layout {arrangement!r}; expected one of {layout.ARRANGEMENTS}")
    if quantization is not None and arrangement != "serving":
        raise ValueError("int8 weights need the serving layout (layout='serving'): the canonical layout is for "
                         "training and checkpoints")
    if mesh is not None:
        if experts != "device" or quantization is not None:
            raise ValueError("experts spread over devices stay in their dtype on the devices: expert sharding "
                             "does not combine with offload or int8 weights")
        return _place_sharded(tree, arrangement, mesh)

    def one(x):
        if isinstance(x, ExpertStack):
            return x if experts == "lazy" else jnp.asarray(x.read())
        if isinstance(x, LazyTensor):
            return _to_device(x.file, x.view, x.transposed, x.dtype)
        if is_lazy(x):  # a canonical view of serving-layout arrays
            return jnp.asarray(x.read())
        return x

    if arrangement == "canonical":
        return tree_map(one, tree)

    def arrange_experts(moe: dict):
        stacks = {k: moe[k] for k in layout.EXPERT_MATRICES}
        if experts == "lazy":
            return stacks
        if quantization is not None and quantization.experts and all(is_int8_stack(x) for x in stacks.values()):
            return layout.expert_list(int(stacks["gate"].shape[0]), lambda e: stored_int8_out_in(stacks, e),
                                      put=lambda q: jax.tree.map(jnp.asarray, q))  # stored int8, as it is
        return layout.expert_list(int(stacks["gate"].shape[0]), lambda e: expert_out_in(stacks, e),
                                  quantization=quantization)

    return layout.arrange(tree, read_out_in, arrange_experts, one, quantization)


def placed_nbytes(tree, experts: str = "device", arrangement: str = "canonical",
                  quantization: "layout.Quantization | None" = None) -> tuple[int, int]:
    """What ``place(tree, experts, arrangement, quantization)`` will hold on the device, in bytes, and the most it
    holds on the host at once while placing (one tensor's copy; the canonical layout reads an expert stack whole,
    the serving layout one expert): enough to refuse a model that cannot fit before a byte is read. Leaves
    already on a device count nothing; int8 matrices count one byte a weight and a float32 scale per row."""
    q = quantization if arrangement == "serving" and quantization is not None else layout.Quantization()

    def nbytes(x, int8: bool = False) -> int:
        if isinstance(x, jax.Array) or not hasattr(x, "shape"):
            return 0
        n = int(np.prod(x.shape, dtype=np.int64))
        if int8 and len(x.shape) >= 2:
            return n + 4 * (n // max(int(x.shape[-2]), 1))  # canonical [.., in, out]: a scale per output row
        return n * np.dtype(x.dtype).itemsize

    total = largest = 0

    def add(x, int8: bool = False, whole: bool = True) -> None:
        nonlocal total, largest
        for leaf in leaves(x):
            b = nbytes(leaf, int8)
            total += b
            if isinstance(leaf, ExpertStack) and not whole:
                b //= max(leaf.n_experts, 1)
            largest = max(largest, b)

    def matrices(p: dict, names) -> None:
        for k, v in p.items():
            add(v, q.matrices and k in names)

    for lp in tree["layers"]:
        for k, v in lp.items():
            if k == "attn":
                matrices(v, layout.ATTENTION_MATRICES)
            elif k == "mlp":
                matrices(v, layout.MLP_MATRICES)
            elif k == "moe":
                for mk, mv in v.items():
                    if mk in layout.EXPERT_MATRICES:
                        if experts == "device":
                            add(mv, q.experts or isinstance(mv, QuantizedExpertStack), arrangement != "serving")
                    elif mk == "shared":
                        matrices(mv, layout.MLP_MATRICES)
                    else:
                        add(mv)
            else:
                add(v)
    for k, v in tree.items():
        if k != "layers":
            add(v, q.matrices and k == "lm_head")
    if q.matrices and "lm_head" not in tree:  # a tied head gets an int8 copy of the embedding, [V, D] + [V, 1]
        total += int(np.prod(tree["embed"].shape, dtype=np.int64)) + 4 * int(tree["embed"].shape[0])
    return total, largest


def _sharded_stack(stack, mesh) -> jax.Array:
    """One expert stack ``[N, a, b]`` (lazy or an array) split along N over ``mesh``'s devices: each device's
    experts are read (from the files, for a lazy stack) straight into that device's shard."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    shape = tuple(int(n) for n in stack.shape)
    devices = int(mesh.devices.size)
    if shape[0] % devices:
        raise ValueError(f"{shape[0]} experts do not split evenly over {devices} devices: pick a device count "
                         f"that divides {shape[0]}")
    dtype = np.dtype(stack.dtype)

    def shard(index):
        first, stop, _ = index[0].indices(shape[0])
        return np.stack([np.asarray(expert_matrix(stack, e), dtype) for e in range(first, stop)])

    return jax.make_array_from_callback(shape, NamedSharding(mesh, P(distributed.EXPERTS)), shard)


def _place_sharded(tree, arrangement: str, mesh):
    """``place`` for expert parallelism (see there)."""
    everywhere = distributed.replicated(mesh)

    def replicate(x):
        if isinstance(x, ExpertStack):
            x = x.read()
        elif isinstance(x, LazyTensor):
            x = x.read()
        elif is_lazy(x):
            x = x.read()
        return distributed.global_array(x, everywhere)

    def shards(moe: dict):
        stacks = {k: _sharded_stack(moe[k], mesh) for k in layout.EXPERT_MATRICES}
        return layout.ExpertShards(stacks["gate"], stacks["up"], stacks["down"], mesh, distributed.EXPERTS)

    if arrangement == "serving":
        out = layout.arrange(tree, read_out_in, shards, replicate)
    else:
        out = _with_expert_shards(tree, shards, replicate)
    return jax.tree.map(lambda x: x if isinstance(x, layout.ExpertShards) else distributed.global_array(x, everywhere),
                        out, is_leaf=lambda x: isinstance(x, layout.ExpertShards))


def _with_expert_shards(tree, shards, put):
    layers = []
    for lp in tree["layers"]:
        new = {k: tree_map(put, v) for k, v in lp.items() if k != "moe"}
        if "moe" in lp:
            moe = {k: tree_map(put, v) for k, v in lp["moe"].items() if k not in layout.EXPERT_MATRICES}
            moe["experts"] = shards(lp["moe"])
            new["moe"] = moe
        layers.append(new)
    out = {k: tree_map(put, v) for k, v in tree.items() if k != "layers"}
    out["layers"] = layers
    return out


def read_out_in(x):
    """A 2-D leaf (lazy or an array, canonical ``[in, out]``) as an ``[out, in]`` array: a Hugging Face
    file's bytes as they are stored (placed straight from the mapping), anything else transposed."""
    if isinstance(x, LazyTensor):
        return _to_device(x.file, x.view, not x.transposed, x.dtype)
    return np.ascontiguousarray(np.asarray(x).T)


def _expert_out_in(stack, e: int) -> np.ndarray:
    if isinstance(stack, DecodedExpertStack):
        return stack.read_out_in(e)
    if isinstance(stack, ExpertStack):
        file, view = stack.parts[e]
        return _copy(file, view, not stack.transposed, stack.dtype)
    return np.ascontiguousarray(np.asarray(stack[e]).T)


def expert_out_in(stacks: dict, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``e`` of canonical ``gate``/``up``/``down`` stacks (lazy or arrays) in the serving layout:
    ``(gate_up [2F, D], down [D, F])``."""
    gate, up = _expert_out_in(stacks["gate"], e), _expert_out_in(stacks["up"], e)
    return np.concatenate([gate, up]), _expert_out_in(stacks["down"], e)


def is_int8_stack(x) -> bool:
    """An expert stack stored as int8 in its files (``QuantizedExpertStack``)."""
    return isinstance(x, QuantizedExpertStack)


def has_int8_experts(tree) -> bool:
    """True when the routed experts of ``tree`` are stored as int8 (a moejax folder saved that way)."""
    return any(is_int8_stack(x) for x in leaves(tree))


def stored_int8_out_in(stacks: dict, e: int) -> tuple[quant.QuantizedTensor, quant.QuantizedTensor]:
    """Expert ``e`` of int8-stored stacks in the int8 serving layout, ``(gate_up [2F, D], down [D, F])``,
    copied from the files as stored (no dequantise/requantise round trip)."""
    gate, up = stacks["gate"].stored_copy(e), stacks["up"].stored_copy(e)
    gate_up = gate.replace(q=np.concatenate([gate.q, up.q]), scale=np.concatenate([gate.scale, up.scale]))
    return gate_up, stacks["down"].stored_copy(e)


def to_host(x) -> np.ndarray:
    """A leaf (lazy or an array) whole in host memory, in moejax's orientation."""
    return x.read() if is_lazy(x) else np.asarray(x)


def chunks(x) -> Iterator[np.ndarray]:
    """A leaf's data in moejax's orientation, in pieces whose concatenation (row-major) is the leaf: one
    expert at a time for an expert stack, the whole tensor otherwise."""
    if hasattr(x, "read_expert"):
        for e in range(x.shape[0]):
            yield x.read_expert(e)
    else:
        yield to_host(x)


def expert_matrix(x, e: int) -> np.ndarray:
    """Expert ``e`` of a stacked leaf (lazy, a canonical view or an array) as a host array in moejax's
    orientation."""
    return x.read_expert(e) if hasattr(x, "read_expert") else np.asarray(x[e])


def sample_flat(x, idx: np.ndarray) -> np.ndarray:
    """Elements ``idx`` of the flattened leaf, reading only those (lazy leaves) — for fingerprints."""
    if is_lazy(x):
        return x.take_flat(idx)
    return np.asarray(x).reshape(-1)[idx]
