"""Where offloaded experts live and how a page lands in a device slot.

``ExpertStore`` holds every routed expert off the device, one array per (layer, expert, matrix): in host
memory (``pinned_host`` where the backend has it, read once from the checkpoint) or on "flash" — the
checkpoint's own files, each page read as exactly its expert's bytes (``SafetensorsFile.read``: no copy of
the model, no temporary file; a model loaded whole gets a temporary file, removed on exit). The device slots
are what the cache state names: an ``ExpertList`` of C buffers per MoE layer (or one pool) in the stored dtype
or int8; a page is written into its slot's buffer (donated: paging does not grow the heap), or, read from the
files in the serving layout, becomes it. ``offload`` drives the paging.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import functools
import os
import shutil
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import atomic, interrupts, tempfiles
from moejax.models import layout, quant, safetensors_io, weights
from moejax.models.config import ModelConfig
from moejax.experts import cache as cache_lib

STORES = ("host", "flash")
READ_AHEAD_PAGES, READ_AHEAD_BYTES = 4, 96 << 20  # a flash store reads up to 4 announced pages (<= 96 MiB)
READERS = 2  # ahead of the one being paged, on 2 threads (Qwen1.5-MoE shapes under 12 GiB: prompt paging 1.0 ->
#              ~1.9 GB/s against 1 page on 1 thread)


EXPERT_KEYS = ("gate", "up", "down")


def _host_sharding(device):
    """``pinned_host`` memory of ``device`` where the backend has it, else None (plain host numpy)."""
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 - older runtimes without memories
        return None
    if "pinned_host" not in kinds:
        return None
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


STORE_FORMAT = "moejax-experts"  # the flash tier's file says so in its safetensors metadata


def check_store_file(path: str) -> None:
    """Refuse to replace a file that is not an earlier flash store (``--store-dir`` pointing at user data)."""
    if not os.path.lexists(path):
        return
    try:
        ours = safetensors_io.SafetensorsFile(path).metadata.get("format") == STORE_FORMAT
    except Exception:  # unreadable, not safetensors: certainly not ours
        ours = False
    if not ours or not os.path.isfile(path) or os.path.islink(path):
        raise FileExistsError(f"{path} exists and is not a moejax expert store: refusing to overwrite it "
                              "(choose another --store-dir)")


class ExpertStore:
    """Every routed expert of every MoE layer, off the device, one array per (layer, expert, matrix)
    so one expert pages with one ``device_put`` per matrix; optional int8/int4 copies (cascade)."""

    def __init__(self, params: dict, cfg: ModelConfig, store: str = "host", bits: tuple = (),
                 group_size: int | None = None, store_dir: str | None = None, device=None):
        self.cfg, self.store = cfg, store
        self.device = device or jax.devices()[0]
        self.host_sharding = _host_sharding(self.device) if store == "host" else None
        # where pages go: the device's own memory (a plain device works where memory kinds do not exist)
        self.target = (jax.sharding.SingleDeviceSharding(self.device, memory_kind="device")
                       if _host_sharding(self.device) is not None else self.device)
        self.moe_ids = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]
        self.dtype = params["embed"].dtype
        self._tmp = None
        self._stacks = None  # the checkpoint's expert stacks, when pages come straight from its files
        self._scratch = None  # a page's serving buffers, for pages cut into blocked slots (main thread only)
        self.flip: tuple[str, ...] = ()  # matrices stored transposed (HF [out, in]): flipped on the device
        self.reads_serving = False  # get(..., serving=True) works: pages from the files in the serving layout
        self.int8 = False  # the experts are stored int8 (values + row scales): they page into int8 slots
        self.interleaved = False  # GPT-OSS's hub files (see ``_interleaved``)
        self.mxfp4_pair = False  # GPT-OSS's MXFP4 release: gate and up are read as one block and decoded
        layers = [expert_stacks(params["layers"][i]["moe"]) for i in self.moe_ids]
        lazy = all(isinstance(x, weights.ExpertStack) for layer in layers for x in layer.values())
        n = cfg.n_experts
        int8 = lazy and all(weights.is_int8_stack(x) for layer in layers for x in layer.values())
        self.int8 = int8
        if lazy and store == "flash":  # the checkpoint's own files are the flash tier: no copy, no file
            self._stacks = layers
            self._ahead: dict = {}  # (layer, expert, serving) -> future of its bytes, read in the background
            self._wanted: collections.deque = collections.deque()  # announced pages not yet being read
            self._reader = concurrent.futures.ThreadPoolExecutor(READERS, thread_name_prefix="moejax-pages")
            weakref.finalize(self, self._reader.shutdown, wait=False, cancel_futures=True)
            self.flip = tuple(k for k in EXPERT_KEYS if layers[0][k].transposed)
            # GPT-OSS: [in, out] with gate and up in alternate columns of one block, turned on the host as read
            self.interleaved = not int8 and not self.flip and _interleaved(layers[0])
            self.mxfp4_pair = weights.mxfp4_gate_up(layers[0]["gate"], layers[0]["up"])
            # stored [out, in] in the compute dtype, or int8 with row scales: a page can be read straight into
            # the serving layout of slots of that dtype
            self.reads_serving = (self.flip == EXPERT_KEYS or self.interleaved) and (int8 or all(
                layers[0][k].stored_dtype == np.dtype(self.dtype) for k in EXPERT_KEYS))
            # what the pages are: views of the files' mappings (no copy held; ``get`` reads them with preadv)
            self.full = [{k: [layer[k].stored(e) for e in range(n)] for k in EXPERT_KEYS} for layer in layers]
            self.expert_bytes = sum(layers[0][k].stored_expert_nbytes for k in EXPERT_KEYS)
        elif int8:  # host memory, int8 as stored (``[out, in]`` + scales), read once, one expert at a time
            self.flip = EXPERT_KEYS
            self.full = [{k: [jax.tree.map(self._place, layer[k].stored_copy(e)) for e in range(n)]
                          for k in EXPERT_KEYS} for layer in layers]
            self.expert_bytes = sum(layers[0][k].stored_expert_nbytes for k in EXPERT_KEYS)
        elif lazy:  # host memory, read once from the files, one expert at a time
            self.full = [{k: [self._place(layer[k].read_expert(e)) for e in range(n)] for k in EXPERT_KEYS}
                         for layer in layers]
            self.expert_bytes = sum(self.full[0][k][0].nbytes for k in EXPERT_KEYS)
        else:  # arrays of a model loaded whole
            full = [{k: weights.to_host(layer[k]) for k in EXPERT_KEYS} for layer in layers]
            self.expert_bytes = sum(full[0][k][0].nbytes for k in EXPERT_KEYS)
            if store == "flash":
                full = self._to_flash(full, store_dir)
            self.full = [{k: [self._place(layer[k][e]) for e in range(n)] for k in EXPERT_KEYS} for layer in full]
        self.low: dict[int, list] = {}
        self.low_bytes: dict[int, int] = {}
        for b in bits:
            low_layers = []
            for layer in layers:  # a lazy layer is read whole for quantising, then dropped
                q = quant.quantize_experts(weights.place(layer), b, group_size)
                low_layers.append({k: [jax.tree.map(self._place, quant.take(q[k], e)) for e in range(n)]
                                   for k in EXPERT_KEYS})
                self.low_bytes[b] = quant.expert_nbytes({k: q[k] for k in EXPERT_KEYS})
            self.low[b] = low_layers

    @property
    def pages_from_files(self) -> bool:
        return self._stacks is not None

    def _place(self, a):
        if self.host_sharding is not None:
            return jax.device_put(np.asarray(a), self.host_sharding)
        return np.asarray(a)

    def _to_flash(self, full: list, store_dir: str | None) -> list:
        """A model loaded whole has no checkpoint file to page from: write its experts to one safetensors
        file (``store_dir``, else a temporary folder removed at exit) and map it back."""
        with interrupts.deferred():  # no signal between making the folder and arranging its removal
            folder = store_dir or tempfiles.make_temp_dir("moejax-flash-")  # under MOEJAX_TMPDIR if set
            self._tmp = None if store_dir else folder
            if self._tmp:  # removed when the store is collected or the interpreter exits (normally or by an error)
                self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        made = atomic.missing_folders(folder)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "experts.safetensors")
        try:
            check_store_file(path)
            tensors = [(f"{j}.{k}", layer[k]) for j, layer in enumerate(full) for k in EXPERT_KEYS]
            safetensors_io.write(path, tensors, {"format": STORE_FORMAT})  # atomic: tmp name, then rename
        except BaseException:  # a full disk: the folders made for the store go too
            atomic.remove_empty_folders(made)
            raise
        reader = safetensors_io.SafetensorsFile(path)
        return [{k: reader.get(f"{j}.{k}") for k in EXPERT_KEYS} for j in range(len(full))]

    @property
    def nbytes(self) -> int:
        return self.expert_bytes * self.cfg.n_experts * len(self.moe_ids)

    def get(self, moe_index: int, expert: int, bits: int = 0, serving: bool = False, out: tuple | None = None):
        """One expert's matrices as stored, ready for ``device_put``: host arrays, or from the checkpoint's files
        a private copy read with ``SafetensorsFile.read`` (or already read in the background: ``prefetch``).
        ``serving`` (needs ``reads_serving``): the serving layout's ``(gate_up [2F, D], down [D, F])`` instead
        (int8 stores: each a ``quant.QuantizedTensor`` of values and row scales), gate and up read into the two
        halves of one buffer, so the page needs no rearranging on the device; ``out``: such a pair of host
        arrays to read into (``slot_views``: a slot's own memory) instead of new ones."""
        if bits == 0 and self._stacks is not None:
            key = (moe_index, int(expert), serving)
            ahead = self._ahead.pop(key, None)
            if ahead is None:
                data = self._read(*key, out=out)
            elif out is None:
                data = ahead.result()
            else:  # read in the background into buffers of its own: copied into ``out``
                data = out
                _copy_page(out, ahead.result())
            self._read_ahead()
            return data
        if out is not None:
            raise ValueError("pages are read into given buffers only from the checkpoint's files")
        layers = self.full if bits == 0 else self.low[bits]
        return {k: layers[moe_index][k][expert] for k in EXPERT_KEYS}

    def serving_buffers(self):
        """New host buffers for one expert in the serving layout: ``(gate_up, down)`` (``get``'s ``out``)."""
        d, f = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        if not self.int8:
            return np.empty((2 * f, d), self.dtype), np.empty((d, f), self.dtype)
        return _host_int8((2 * f, d), self.dtype), _host_int8((d, f), self.dtype)

    def _read(self, moe_index: int, expert: int, serving: bool = False, out: tuple | None = None):
        stacks = self._stacks[moe_index]
        if not serving:
            return {k: stacks[k].read_stored(expert) for k in EXPERT_KEYS}
        if not self.reads_serving:
            raise ValueError("this store's files do not hold the experts in the serving layout")
        blocked = out is not None and any(isinstance(m, layout.ColumnBlocks) for m in out)
        quantising = out is not None and not self.int8 and layout.is_int8(out[0])
        if blocked or quantising:  # blocked slots are cut here, int8 slots of a 16-bit store quantised here
            if self._scratch is None:  # one buffer kept for it (a new one page-faults in: ms per MB)
                self._scratch = self.serving_buffers()
            _copy_page(out, self._read(moe_index, expert, serving, out=self._scratch))
            return out
        gate_up, down = self.serving_buffers() if out is None else out
        if self.interleaved:  # one read of the [D, 2F] block, its columns turned into gate rows then up rows
            file, gate = stacks["gate"].parts[expert]
            _rows_of_alternate_columns(file.read(_alternating_block(gate)), gate_up)
            _transposed_into(stacks["down"].read_stored(expert), down)
            return gate_up, down
        if self.mxfp4_pair:  # one read of the [2F, D / 32, 16] blocks, decoded into gate rows then up rows
            weights.read_mxfp4_gate_up(stacks["gate"], expert, gate_up)
            stacks["down"].read_stored(expert, down)
            return gate_up, down
        f = self.cfg.moe_intermediate_size
        stacks["gate"].read_stored(expert, _rows(gate_up, 0, f))
        stacks["up"].read_stored(expert, _rows(gate_up, f, 2 * f))
        stacks["down"].read_stored(expert, down)
        return gate_up, down

    def _read_ahead(self) -> None:
        depth = max(1, min(READ_AHEAD_PAGES, READ_AHEAD_BYTES // self.expert_bytes))
        while self._wanted and len(self._ahead) < depth:
            key = self._wanted.popleft()
            if key not in self._ahead:
                self._ahead[key] = self._reader.submit(self._read, *key)

    def prefetch(self, moe_index: int, experts, serving: bool = False) -> None:
        """The experts of a layer ``get`` will be asked for next, in that order (a batched prefill pages a
        layer's experts one after another): they are read from the checkpoint's files in the background, up
        to ``READ_AHEAD_PAGES`` (``READ_AHEAD_BYTES``) ahead, while the pages before them are copied and
        computed with. Replaces any earlier announcement; a no-op for experts in memory."""
        if self._stacks is not None:
            self._wanted = collections.deque((moe_index, int(e), serving) for e in experts)
            wanted = set(self._wanted)
            for key in [k for k in self._ahead if k not in wanted]:  # announced before and never asked for
                self._ahead.pop(key).cancel()
            self._read_ahead()

    def nbytes_of(self, bits: int) -> int:
        return self.expert_bytes if bits == 0 else self.low_bytes[bits]


def _interleaved(stacks: dict) -> bool:
    """Whether a layer's expert stacks are GPT-OSS's hub layout: stored [in, out], gate and up the even and odd
    columns of one [D, 2F] block per expert (``hf_keys`` ``columns``), down a plain [F, D] block."""
    gate, up = stacks["gate"].stored(0), stacks["up"].stored(0)
    step = 2 * gate.itemsize
    up_after_gate = up.__array_interface__["data"][0] - gate.__array_interface__["data"][0] == gate.itemsize
    return (gate.ndim == 2 and gate.strides[1] == step and up.strides[1] == step and up_after_gate
            and stacks["down"].stored(0).flags.c_contiguous)


def _alternating_block(gate: np.ndarray) -> np.ndarray:
    """The whole [D, 2F] block of which ``gate`` [D, F] is the even columns (a view of the same file)."""
    return np.lib.stride_tricks.as_strided(gate, (gate.shape[0], 2 * gate.shape[1]), (gate.strides[0], gate.itemsize),
                                           writeable=False)


TILE = 256  # rows and columns of a host transpose's tiles: numpy's whole strided copy is 4-5x slower (docs/benchmarks.md)


def _rows_of_alternate_columns(block: np.ndarray, out: np.ndarray) -> None:
    """``out`` [2F, D] (gate rows, then up rows: the serving layout) from ``block`` [D, 2F] whose columns
    alternate gate, up (GPT-OSS's ``gate_up_proj``), tile by tile."""
    d, f = block.shape[0], block.shape[1] // 2
    src, dst = block.reshape(d, f, 2), out.reshape(2, f, d)
    for i in range(0, d, TILE):
        for j in range(0, f, TILE):
            dst[:, j:j + TILE, i:i + TILE] = src[i:i + TILE, j:j + TILE].transpose(2, 1, 0)


def _transposed_into(src: np.ndarray, out: np.ndarray) -> None:
    """``out`` = ``src``ᵀ, tile by tile."""
    for i in range(0, src.shape[0], TILE):
        for j in range(0, src.shape[1], TILE):
            out[j:j + TILE, i:i + TILE] = src[i:i + TILE, j:j + TILE].T


def _host_int8(shape: tuple[int, int], dtype) -> quant.QuantizedTensor:
    """An empty host ``[rows, cols]`` int8 matrix with a float32 scale per row (``layout.quantize_matrix``'s form)."""
    return quant.QuantizedTensor(q=np.empty(shape, np.int8), scale=np.empty((shape[0], 1), np.float32), bits=8,
                                 group_size=None, axis=-1, dtype=np.dtype(dtype))


def _copy_page(out: tuple, page: tuple) -> None:
    """Copy a page read into buffers of its own (serving layout, host) into the slot views ``out``; a 16-bit
    page into int8 slots is quantised on the way (``quant.quantize_rows_into``: the bits ``write_slot`` gives)."""
    for dst, src in zip(out, page):
        if layout.is_int8(dst) and not isinstance(src, quant.QuantizedTensor):
            if not isinstance(dst, layout.ColumnBlocks):
                quant.quantize_rows_into(src, dst.q, dst.scale)
                continue
            q = _host_int8(src.shape, src.dtype)
            quant.quantize_rows_into(src, q.q, q.scale)
            src = q
        if isinstance(dst, layout.ColumnBlocks):
            layout.copy_into_blocks(dst, src)
        else:
            for d, s in zip(jax.tree.leaves(dst), jax.tree.leaves(src)):
                np.copyto(d, s)


def _rows(matrix, start: int, stop: int):
    """Rows ``start:stop`` of a host matrix, or of an int8 one's values and scales (contiguous views)."""
    if isinstance(matrix, quant.QuantizedTensor):
        return matrix.replace(q=matrix.q[start:stop], scale=matrix.scale[start:stop])
    return matrix[start:stop]


def host_view(a) -> np.ndarray | None:
    """A writable numpy view of the memory of ``a``, a device array, where that memory is host memory (the CPU
    backend) laid out row-major; else None.

    What lets a page be read from the files straight into a slot's own buffer, the one copy there has to be:
    ``device_put`` copies on the CPU too, into a new allocation whose every page faults in (several times the read
    itself: ``python bench/bench_probes.py page-faults``). JAX treats its arrays as immutable: the caller must
    know that no computation reading ``a`` is in flight and that ``a`` is held nowhere else (``HostPager``
    writes only into its own slot buffers, after the computations that read them have finished)."""
    if not isinstance(a, jax.Array) or a.is_deleted() or len(a.devices()) != 1:
        return None
    if next(iter(a.devices())).platform != "cpu":
        return None
    try:
        major_to_minor = tuple(a.format.layout.major_to_minor)
    except Exception:  # noqa: BLE001 - runtimes without layouts: do not guess
        return None
    if major_to_minor != tuple(range(a.ndim)) or a.nbytes == 0:
        return None
    memory = (ctypes.c_char * a.nbytes).from_address(a.unsafe_buffer_pointer())
    return np.frombuffer(memory, a.dtype).reshape(a.shape)


def slot_views(buf: layout.ExpertList, s: int):
    """Slot ``s`` of serving-layout slots as writable host views ``(gate_up, down)`` (int8 slots: each a
    ``quant.QuantizedTensor`` of views), or None where the slots are not host memory (``host_view``)."""
    views = jax.tree.map(host_view, buf.expert(s))
    return None if any(v is None for v in jax.tree.leaves(views, is_leaf=lambda v: v is None)) else views


def distinct_host_buffers(tree) -> bool:
    """Whether every array of ``tree`` is host memory (``host_view``) of its own, shared with no other leaf."""
    leaves = jax.tree.leaves(tree)
    if any(host_view(a) is None for a in leaves):
        return False
    pointers = [a.unsafe_buffer_pointer() for a in leaves]
    return len(set(pointers)) == len(pointers)


def expert_stacks(moe: dict) -> dict:
    """A MoE layer's routed experts as canonical ``gate``/``up``/``down`` stacks: the arrays, the stacks left
    in the files, or canonical views of a serving-layout ``ExpertList`` (read one expert at a time)."""
    if "experts" in moe:
        return {k: layout.CanonicalExpertView(moe["experts"], k) for k in EXPERT_KEYS}
    return {k: moe[k] for k in EXPERT_KEYS}


def expert_store(params: dict, cfg: ModelConfig, store: str, store_dir: str | None = None, tiers: tuple = (),
                 group_size: int | None = None, stores: dict | None = None) -> ExpertStore:
    """The ``ExpertStore`` ("host" or "flash") for these settings, reused from ``stores`` (a model's own cache)
    when there: a host store reads the experts once per model, not once per call."""
    key = (store, store_dir, tiers, group_size, id(params))
    if stores is not None and key in stores:
        return stores[key]
    store = ExpertStore(params, cfg, store, tiers, group_size, store_dir)
    if stores is not None:
        stores.clear()  # one store per model at a time: a second set of host copies would double memory
        stores[key] = store
    return store


def split_params(params: dict, cfg: ModelConfig) -> dict:
    """The parameters without the routed experts (what stays on the device)."""
    layers = []
    for i, lp in enumerate(params["layers"]):
        if cfg.moe_layers[i]:
            lp = {**lp, "moe": {k: v for k, v in lp["moe"].items() if k not in (*EXPERT_KEYS, "experts")}}
        layers.append(lp)
    return {**params, "layers": layers}


def tree_nbytes(tree) -> int:
    return int(sum(np.prod(a.shape, dtype=np.int64) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def _zero_int8(rows: int, cols: int, dtype) -> quant.QuantizedTensor:
    return quant.QuantizedTensor(q=jnp.zeros((rows, cols), jnp.int8), scale=jnp.zeros((rows, 1), jnp.float32),
                                 bits=8, group_size=None, axis=-1, dtype=np.dtype(dtype))


def expert_list(cfg: ModelConfig, n: int, dtype, int8: bool = False) -> layout.ExpertList:
    """``n`` zeroed serving-layout expert buffers (``gate_up`` [2F, D], ``down`` [D, F]; ``int8``: each an int8
    ``quant.QuantizedTensor``), in column blocks where the loaded model's experts would be
    (``layout.in_column_blocks``: decode's one-row loop on the CPU)."""
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    zero = (lambda r, c: _zero_int8(r, c, dtype)) if int8 else (lambda r, c: jnp.zeros((r, c), dtype))  # noqa: E731
    return layout.ExpertList(tuple(layout.in_column_blocks(zero(2 * f, d)) for _ in range(n)),
                             tuple(layout.in_column_blocks(zero(d, f)) for _ in range(n)))


def blocked_slots(cfg: ModelConfig) -> bool:
    """Whether slots on the CPU are cut into column blocks (``expert_list``): an expert matrix's input row
    (D for gate_up, F for down) needs more than one block."""
    return any(len(layout.column_block_widths(k)) > 1 for k in (cfg.hidden_size, cfg.moe_intermediate_size))


def slot_nbytes(cfg: ModelConfig, dtype, int8: bool = False) -> int:
    """Device bytes of one slot of ``init_slots`` (an int8 slot counts its row scales): the unit a cache
    size given in bytes is divided by."""
    return tree_nbytes(jax.eval_shape(lambda: expert_list(cfg, 1, dtype, int8)))


def init_slots(cfg: ModelConfig, cache_state: cache_lib.CacheState, dtype, int8: bool = False):
    """Zeroed slot buffers, per MoE layer or one pool for a global cache: a ``layout.ExpertList`` of C slots
    (one buffer per slot, what both pagers compute with: each expert read in place; ``int8``: each an
    int8 ``quant.QuantizedTensor``, half the memory, filled by quantising the pages)."""
    cap = int(cache_state.capacity)
    if cache_state.scope == "global":
        return expert_list(cfg, cap, dtype, int8)
    return [expert_list(cfg, cap, dtype, int8) for _ in range(cfg.n_moe_layers)]


def fill_slots(slots, store: ExpertStore, cache_state: cache_lib.CacheState):
    """Load whatever the cache state says is resident (a random initial cache, a carried-over one)."""
    slot = np.asarray(cache_state.slot)
    for layer, expert in zip(*np.nonzero(slot >= 0)):
        s = int(slot[layer, expert])
        data = jax.device_put(store.get(int(layer), int(expert)), store.target)
        if cache_state.scope == "global":
            slots = write_slot(slots, data, s, store.flip)
        else:
            slots[layer] = write_slot(slots[layer], data, s, store.flip)
    return slots


def write_slot(buf, data, s: int, flip: tuple[str, ...] = ()):
    """Slot buffers with expert ``data`` (``gate``/``up``/``down`` on the device; ``flip``: matrices stored
    transposed, i.e. Hugging Face's ``[out, in]``) in slot ``s``: a new buffer for that slot of an
    ``ExpertList``. ``data`` already in the serving layout, a
    ``(gate_up, down)`` pair on the device, becomes the slot's buffers as it is (no copy; the old ones are freed)."""
    if isinstance(data, tuple):  # already the serving layout (``ExpertStore.get(..., serving=True)``): swap it in
        if not isinstance(buf, layout.ExpertList) or (layout.is_int8(data[0]) and not layout.is_int8(buf.gate_up[0])):
            raise ValueError("a serving-layout page goes into serving-layout slots of its own dtype, or a 16-bit "
                             "one into int8 slots")
        if layout.is_int8(buf.gate_up[0]) and not layout.is_int8(data[0]):  # quantised as it arrives
            data = tuple(_quantized_out_in(m, True, np.dtype(buf.gate_up[0].dtype)) for m in data)
        return buf.replace(s, *_like_slot(buf.expert(s), tuple(data)))
    stored_int8 = all(layout.is_int8(data[k]) for k in EXPERT_KEYS)  # paged from an int8 folder: [out, in]
    old = buf.expert(s)
    if layout.is_int8(old[0]) and stored_int8:
        gate_up, down = _like_slot(old, (_stack_rows(data["gate"], data["up"]), data["down"]))
    elif layout.is_int8(old[0]):
        gate_up, down = _like_slot(old, _int8_expert(data, flip, np.dtype(old[0].dtype)))
    elif stored_int8:
        gate_up, down = _serving_expert_into(*old, _dequantized(data), EXPERT_KEYS)
    else:
        gate_up, down = _serving_expert_into(*old, data, flip)
    return buf.replace(s, gate_up, down)


@jax.jit
def _dequantized(data: dict) -> dict:
    """An int8-stored expert (``[out, in]`` + scales) in its compute dtype, for full-precision slots."""
    return {k: quant.dequantize(data[k]) for k in EXPERT_KEYS}


@functools.partial(jax.jit, static_argnames=("flip",), donate_argnums=(0, 1))
def _serving_expert_into(gate_up, down, data: dict, flip: tuple[str, ...]):
    """One paged expert in the serving layout, ``(gate_up [2F, D], down [D, F])``, written into the slot's
    own buffers (donated: a page allocates nothing that lasts, so paging does not grow the heap)."""
    out_in = {k: (data[k] if k in flip else data[k].T).astype(gate_up.dtype) for k in EXPERT_KEYS}
    new = jnp.concatenate([out_in["gate"], out_in["up"]]), out_in["down"]
    return tuple(layout.blocked_like(old, m) for old, m in zip((gate_up, down), new))


@jax.jit
def _blocked_page(template: tuple, page: tuple) -> tuple:
    return tuple(layout.blocked_like(t, m) for t, m in zip(template, page))


def _like_slot(old: tuple, page: tuple) -> tuple:
    """A page ``(gate_up, down)`` in the slot's form: cut into its column blocks where the slot has them."""
    if not any(isinstance(m, layout.ColumnBlocks) for m in old):
        return page
    return _blocked_page(old, page)


def _int8_expert(data: dict, flip: tuple[str, ...], dtype):
    """One paged expert quantised for int8 slots, ``(gate_up, down)`` as ``quant.QuantizedTensor``s: each matrix
    in its own small program (rows are quantised independently; XLA:CPU runs the three reductions 3-4x
    slower fused in one program: 12 vs 3.5 ms per page at Qwen1.5-MoE shapes)."""
    q = {k: _quantized_out_in(data[k], k in flip, dtype) for k in EXPERT_KEYS}
    return _stack_rows(q["gate"], q["up"]), q["down"]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantized_out_in(x, stored_out_in: bool, dtype):
    return layout.quantize_matrix((x if stored_out_in else x.T).astype(dtype))


@jax.jit
def _stack_rows(a: quant.QuantizedTensor, b: quant.QuantizedTensor) -> quant.QuantizedTensor:
    return a.replace(q=jnp.concatenate([a.q, b.q]), scale=jnp.concatenate([a.scale, b.scale]))



def slot_changes(before: np.ndarray, after: np.ndarray) -> list[tuple[int, int, int]]:
    """(layer, expert, slot) for every entry that got a slot it did not hold before: what must be copied."""
    changed = (after >= 0) & (after != before)
    return [(int(l), int(e), int(after[l, e])) for l, e in zip(*np.nonzero(changed))]
