"""Checkpoint folders: Hugging Face (safetensors) in and out, and the moejax format.

moejax checkpoint folder (version 2)::

    moejax.json        {"format": "moejax", "version": 2, "dtype": ..., "hf_config": {...}}
    params.safetensors every tensor under its tree path ("layers.3.moe.gate"); routed experts as one
                       [N, in, out] stack per MoE layer and matrix, so one expert is one contiguous slice
                       (or params-0000i-of-0000n.safetensors + params.safetensors.index.json)
    tokenizer.json ... tokenizer and generation files copied from the source folder

Version 3 is version 2 with the routed experts stored as int8 (``save_moejax(..., expert_dtype="int8")``,
``python -m moejax.convert ... --expert-dtype int8``; ``"experts": "int8"`` in moejax.json): per stack
``layers.3.moe.gate.q8`` int8 ``[N, out, in]`` and ``layers.3.moe.gate.scale`` float32 ``[N, out, 1]``, each
expert exactly ``layout.quantize_matrix`` of its ``[out, in]`` matrix (symmetric, one scale per output row),
so loading it int8 gives bit for bit the model that ``moejax.load(..., expert_dtype="int8")`` makes from
the full-precision folder, and offloading pages half the bytes per expert from storage. Everything else
stays in ``dtype``.

Version 1 folders (``params/`` saved with orbax) are still read, whole. Both readers hand back lazy trees
(``weights``): nothing is read until placed, so a model larger than memory opens instantly and its
experts can stay in the files for offloading.

Every writer builds the folder under a temporary name beside the target and renames it at the end, so an
interrupted conversion never leaves a folder that loads. Pickled checkpoints (``.bin``/``.pt``) are refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import atomic, orbax_io
from moejax.base.errors import Failure, UsageError
from moejax.models import hf_keys, layout, quant, safetensors_io, weights
from moejax.models import mxfp4 as mxfp4_lib
from moejax.models.config import GPT_OSS, ModelConfig, UnsupportedModelError, from_hf

FORMAT_FILE = "moejax.json"
FORMAT_VERSION = 2  # written (3 when the experts are int8); version 1 (orbax params/) is still read
INT8_EXPERTS_VERSION = 3
READ_VERSIONS = (1, 2, 3)
EXPERT_DTYPES = ("stored", "int8")  # how save_moejax writes the routed experts
INT8_SUFFIX, SCALE_SUFFIX = ".q8", ".scale"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json",
)
#: the model card and its terms: a conversion carries them along with the tokenizer (the default model's
#: README holds the corpus's share-alike licence; an HF folder's, the model's)
CARD_FILES = ("README.md", "LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "training.json")


class CheckpointError(Failure):
    """A checkpoint folder is missing, malformed or does not match its configuration."""


class TargetRefusedError(CheckpointError, UsageError):
    """An output folder that writing would destroy something in (the source, an unrelated folder)."""


# ------------------------------------------------------------------------------------------ helpers
def _set(tree: dict, path: tuple, value: Any) -> None:
    node = tree
    for key, nxt in zip(path[:-1], path[1:]):
        if isinstance(key, int):
            while len(node) <= key:
                node.append({})
            node = node[key]
        else:
            node = node.setdefault(key, [] if isinstance(nxt, int) else {})
    node[path[-1]] = value


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _stacked_shape(entry: hf_keys.Entry, cfg: ModelConfig) -> tuple[int, ...]:
    shape = entry.param_shape
    return (cfg.n_experts, *shape) if entry.expert is not None else shape


def param_shapes(cfg: ModelConfig) -> dict:
    """The parameter tree's structure with shapes as leaves (tuples), from the key table."""
    tree: dict = {}
    for e in hf_keys.entries(cfg):
        if e.expert in (None, 0):
            _set(tree, e.path, _stacked_shape(e, cfg))
    return tree


def abstract_params(cfg: ModelConfig, dtype) -> Any:
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def params_fingerprint(params, full_below: int = 1 << 20, samples: int = 1 << 16) -> str:
    """A content hash of the weights: every leaf's path, shape and dtype, all the bytes of small leaves and
    a strided sample (plus both ends) of large ones. Results are keyed by it, so a sweep resumed after the
    weights at a path changed (re-exported, re-trained, damaged) recomputes instead of reporting old numbers,
    without reading all of a model larger than memory."""
    h = hashlib.sha1()
    params = layout.canonical_view(params)  # one model, one hash, whatever its layout
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=weights.is_lazy)[0]:
        size = int(np.prod(leaf.shape, dtype=np.int64))
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(leaf.shape)}:{np.dtype(leaf.dtype)};".encode())
        if size <= full_below:
            parts = [np.arange(size)]
        else:
            stride = -(-size // samples)
            parts = [np.arange(4096), np.arange(0, size, stride), np.arange(size - 4096, size)]
        for idx in parts:  # lazy leaves: only the sampled elements are read from the files
            h.update(np.ascontiguousarray(weights.sample_flat(leaf, idx)).tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def atomic_folder(target: str, overwrite: bool = False, protect: tuple[str, ...] = ()) -> Iterator[str]:
    """Yield a temporary folder beside ``target``; rename it to ``target`` only if the block succeeds.

    Never destroys what the user had: ``target`` may not be (or contain) a ``protect``ed path (the source
    of a conversion), and ``overwrite`` replaces only an existing checkpoint folder or an empty one."""
    target = os.path.realpath(os.path.abspath(os.path.expanduser(target)))
    check_replaceable(target, overwrite, protect)
    with atomic.atomic_dir(target) as tmp:  # also removes a killed run's half-written folder
        yield tmp


def is_checkpoint_folder(folder: str) -> bool:
    """A moejax checkpoint folder or a Hugging Face one (config.json beside safetensors weights)."""
    if is_moejax_folder(folder):
        return True
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return "config.json" in names and any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                                          for n in names)


#: what a checkpoint folder holds (moejax, Hugging Face, an exported training run): ``--overwrite`` replaces a
#: checkpoint folder only when it holds nothing else, so no file the user kept beside the weights is deleted
CHECKPOINT_NAMES = frozenset((*TOKENIZER_FILES, *CARD_FILES, "config.json", FORMAT_FILE,
                              "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", ".gitattributes"))
CHECKPOINT_SUFFIXES = (".safetensors", ".safetensors.index.json")
CHECKPOINT_FOLDERS = frozenset(("params",))  # version-1 moejax folders: orbax's parameters


def not_checkpoint_files(folder: str) -> list[str]:
    """The entries of ``folder`` that are no part of a checkpoint (sorted)."""
    out = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            if name not in CHECKPOINT_FOLDERS:
                out.append(name + "/")
        elif name not in CHECKPOINT_NAMES and not name.endswith(CHECKPOINT_SUFFIXES):
            out.append(name)
    return out


def check_replaceable(target: str, overwrite: bool, protect: tuple[str, ...] = ()) -> None:
    """Raise ``FileExistsError`` / ``CheckpointError`` unless writing the folder ``target`` loses nothing."""
    target = os.path.realpath(os.path.abspath(os.path.expanduser(target)))
    for p in protect:
        p = os.path.realpath(os.path.abspath(os.path.expanduser(p)))
        if target == p:
            raise TargetRefusedError(f"the target {target} is the source itself: choose another target folder")
        if p.startswith(target.rstrip(os.sep) + os.sep):
            raise TargetRefusedError(f"the target {target} contains the source {p}: replacing it would delete the "
                                  "source; choose another target folder")
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise FileExistsError(f"{target} already exists (pass overwrite=True / --overwrite to replace it)")
    if not os.path.isdir(target) or os.path.islink(target):
        raise TargetRefusedError(f"{target} exists and is not a folder: refusing to replace it")
    if os.listdir(target) and not is_checkpoint_folder(target):
        found = ", ".join(sorted(os.listdir(target))[:5])
        raise TargetRefusedError(f"{target} is not a checkpoint folder (it holds {found}...): --overwrite only "
                              "replaces a moejax or Hugging Face checkpoint; remove it yourself or choose "
                              "another target")
    others = not_checkpoint_files(target)
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise TargetRefusedError(f"{target} holds a checkpoint and files that are not part of it ({shown}): "
                                 "--overwrite would delete them; move them out or choose another target")


def _copy_companion_files(src: str, dst: str) -> None:
    """The tokenizer and the model card of ``src`` (what a checkpoint holds beside its weights) into ``dst``."""
    for name in (*TOKENIZER_FILES, *CARD_FILES):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


# ------------------------------------------------------------------------------------ Hugging Face in
#: pickled weight files: never read (``refuse_pickles``)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def refuse_pickles(where: str, names, source: str = "PATH") -> None:
    """The error for weights that exist only pickled (``.bin``, ``.pt``, ...) among ``names``: moejax never
    unpickles; it says how to re-save them (``source``: what ``from_pretrained`` is given)."""
    pickled = sorted(f for f in names if f.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise CheckpointError(
            f"{where} has only pickled weights ({', '.join(pickled)}) and no safetensors; moejax never "
            f"unpickles. Convert them once with transformers: `AutoModelForCausalLM.from_pretrained({source})"
            ".save_pretrained(OUT, safe_serialization=True)` (or use the model's safetensors release)."
        )


def regular_file(path: str) -> bool:
    """Whether ``path`` exists (a regular file, or a link to one); a ``CheckpointError`` naming it when it is
    something else — a device such as /dev/zero, a named pipe, a directory, a broken link — which reading would
    block on, never finish or fail on obscurely. Looks with stat, never by opening."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(path):
            raise CheckpointError(f"{path} is a link to {os.readlink(path)}, which does not exist") from None
        return False
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path} is not a regular file ({safetensors_io.file_kind(path, mode)})")
    return True


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder {folder} " + ("is a file, not a folder" if os.path.exists(folder)
                                                           else "does not exist"))
    if not regular_file(path):
        regular_file(os.path.join(folder, FORMAT_FILE))  # a moejax.json that is no file: say so
        try:
            os.listdir(folder)  # a folder this user may not read hides its config.json: say so instead
        except PermissionError as e:
            raise CheckpointError(f"cannot read model folder {folder}: {e.strerror}") from None
        raise CheckpointError(f"{folder} has no config.json (nor {FORMAT_FILE}): not a model folder")
    return read_json_object(path, "a model configuration")


def read_json_object(path: str, what: str) -> dict:
    """A checkpoint's JSON file (config, generation config, tokenizer config) as a dict, or a
    ``CheckpointError`` naming the file when it is not UTF-8 JSON holding an object."""
    regular_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, an integer of over 4300 digits, too deep
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object ({what}), not a {type(value).__name__}")
    return value


def weight_files(names, read_index, where: str, index_name: str = "model.safetensors.index.json",
                 stem: str = "", source: str = "PATH") -> tuple[list[str], dict | None]:
    """The weight files a checkpoint holding the files ``names`` is read from, in transformers' order: the single
    file (``model.safetensors``), else the shards its index names (``read_index()``: the index's text), else every
    ``.safetensors`` whose name starts with ``stem`` (the moejax format's ``params*``); and the index's weight map
    (None without one). ``where`` names the checkpoint in errors (a folder, a hub id): a broken index, a shard
    outside the folder, no
    weights at all (pickled ones refused by name, ``refuse_pickles``)."""
    single = index_name[:-len(".index.json")]
    if single in names:  # transformers' order: the single file wins over an index
        return [single], None
    if index_name in names:
        try:
            weight_map = json.loads(read_index()).get("weight_map", {})
        except CheckpointError:
            raise
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{os.path.join(where, index_name)}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{os.path.join(where, index_name)}: 'weight_map' must map tensor names to shard "
                                  "file names")
        shards = sorted(set(weight_map.values()))
        outside = [n for n in shards if os.path.isabs(n) or os.path.basename(n) != n or n in (".", "..")]
        if outside:  # shards live in the folder itself: never follow an index elsewhere
            raise CheckpointError(f"{os.path.join(where, index_name)} names shard {outside[0]!r} outside the model "
                                  "folder; refusing it")
        return shards, weight_map
    found = sorted(f for f in names if f.endswith(".safetensors") and f.startswith(stem))
    if not found:
        refuse_pickles(where, names, source)
        raise CheckpointError(f"{where} has no .safetensors weights")
    return found, None


def _open_shards(folder: str, index_name: str = "model.safetensors.index.json",
                 stem: str = "") -> dict[str, safetensors_io.SafetensorsFile]:
    """Map every tensor key to the (memory-mapped) file holding it; fail on duplicates and broken indexes.
    ``stem``: only files whose names start with it count (the moejax format's ``params*.safetensors``)."""
    index_path = os.path.join(folder, index_name)

    def read_index() -> str:
        regular_file(index_path)
        with open(index_path) as f:
            return f.read()

    names, weight_map = weight_files(os.listdir(folder), read_index, folder, index_name, stem)
    files, where = {}, {}
    for name in names:
        path = os.path.join(folder, name)
        if not regular_file(path):
            raise CheckpointError(f"{index_path} names shard {name}, which is missing" if weight_map is not None
                                  else f"{path} is missing")
        files[name] = safetensors_io.SafetensorsFile(path)
        for key in files[name].keys():
            if key in where:
                raise CheckpointError(f"duplicate tensor {key!r} in {where[key]} and {name}")
            where[key] = name
    if weight_map is not None:
        for key, name in weight_map.items():
            if where.get(key) != name:
                raise CheckpointError(f"index.json says {key!r} is in {name}, but it is "
                                      + (f"in {where[key]}" if key in where else "in no shard"))
    return {key: files[name] for key, name in where.items()}


def _fused_keys(layer: int) -> tuple[str, str]:
    """transformers 5's in-memory expert layout, as some folders store it: ``gate_up_proj`` [N, 2F, D]
    (gate rows first) and ``down_proj`` [N, D, F] per MoE layer."""
    pre = f"model.layers.{layer}.mlp.experts"
    return f"{pre}.gate_up_proj", f"{pre}.down_proj"


def _hf_candidates(key: str) -> tuple[str, ...]:
    # transformers 5 names Mixtral's / Phi-MoE's block "mlp" in memory; the hub keeps "block_sparse_moe"
    alias = key.replace(".block_sparse_moe.", ".mlp.")
    return (key,) if alias == key else (key, alias)


def _check_shape(key: str, got: tuple, want: tuple) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"tensor {key!r} has shape {tuple(got)}, expected {tuple(want)} for this config")


def _check_float(file: safetensors_io.SafetensorsFile, key: str) -> None:
    """A hub checkpoint's weights are floating point; integers would be cast and run as garbage."""
    dtype = file.dtype(key)
    if dtype.kind in "biu":  # bool / signed / unsigned integers
        raise CheckpointError(f"tensor {key!r} in {file.path} is stored as {dtype.name}; hub checkpoints must "
                              "hold floating-point weights (quantized checkpoints are not read here)")


def _check_mxfp4(file: safetensors_io.SafetensorsFile, key: str) -> None:
    """MXFP4 blocks and scales are bytes (uint8); anything else is not the format ``mxfp4`` decodes."""
    dtype = file.dtype(key)
    if dtype != np.uint8:
        raise CheckpointError(f"tensor {key!r} in {file.path} is stored as {dtype.name}; MXFP4 blocks and scales "
                              "are uint8")


def hf_tree(folder: str, cfg: ModelConfig) -> dict:
    """The parameter tree of a hub checkpoint with every leaf left in the files (``weights.LazyTensor``,
    ``weights.ExpertStack``), after checking every key and shape. Reads both the hub's one-tensor-per-expert
    layout and transformers 5's fused one (``mlp.experts.gate_up_proj`` / ``down_proj``), and GPT-OSS's MXFP4
    release (its experts as ``weights.Mxfp4ExpertStack``, decoded as they are read)."""
    tensors = _open_shards(folder)
    d, f, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_experts
    fused = {}
    for i in range(cfg.num_layers):
        gate_up, down = _fused_keys(i)
        # GPT-OSS's own tensors have these names, in another layout (hf_keys)
        if cfg.moe_layers[i] and gate_up in tensors and down in tensors and cfg.model_type != GPT_OSS:
            _check_shape(gate_up, tensors[gate_up].shape(gate_up), (n, 2 * f, d))
            _check_shape(down, tensors[down].shape(down), (n, d, f))
            _check_float(tensors[gate_up], gate_up)
            _check_float(tensors[down], down)
            fused[i] = (gate_up, down)
    used, missing = set(), []
    tree: dict = {}
    parts: dict[tuple, list] = {}
    scale_parts: dict[tuple, list] = {}  # MXFP4 experts (GPT-OSS's release): their scales, beside the blocks
    transposed: dict[tuple, bool] = {}  # expert stacks: stored [out, in] per expert (hub), or [in, out] (GPT-OSS)
    mxfp4 = hf_keys.is_mxfp4_release(tensors, cfg)
    if mxfp4 and (d % mxfp4_lib.GROUP or f % mxfp4_lib.GROUP):
        raise CheckpointError(f"{folder}: MXFP4 experts need hidden_size and intermediate_size multiples of "
                              f"{mxfp4_lib.GROUP}, got {d} and {f}")
    for hf_key, pieces in hf_keys.by_tensor(hf_keys.entries(cfg, mxfp4)).items():
        if pieces[0].expert is not None and pieces[0].path[1] in fused:
            continue
        key = next((k for k in _hf_candidates(hf_key) if k in tensors), None)
        if key is None:
            missing.append(hf_key)
            continue
        used.add(key)
        _check_shape(key, tensors[key].shape(key), hf_keys.tensor_shape(pieces, n))
        file = tensors[key]
        if pieces[0].mxfp4:
            _check_mxfp4(file, key)
        else:
            _check_float(file, key)
        view = file.get(key)
        for e in pieces:
            if e.expert is None:
                _set(tree, e.path, weights.LazyTensor(file, hf_keys.piece_of(view, e), e.transpose))
            else:
                into = scale_parts if e.mxfp4 == "scales" else parts
                into.setdefault(e.path, [None] * n)[e.expert] = (file, hf_keys.piece_of(view, e))
                transposed[e.path] = e.transpose
    if missing:
        raise CheckpointError(f"{folder}: missing tensors: " + ", ".join(missing[:10])
                              + (f" ... ({len(missing)} in all)" if len(missing) > 10 else ""))
    for i, (gate_up, down) in fused.items():
        used.update((gate_up, down))
        gu, dn = tensors[gate_up].get(gate_up), tensors[down].get(down)
        path = ("layers", i, "moe")
        parts[path + ("gate",)] = [(tensors[gate_up], gu[e, :f]) for e in range(n)]
        parts[path + ("up",)] = [(tensors[gate_up], gu[e, f:]) for e in range(n)]
        parts[path + ("down",)] = [(tensors[down], dn[e]) for e in range(n)]
    # tensors with no elements carry nothing: transformers writes a zero-width shared expert for n_shared_experts 0
    unexpected = sorted(k for k in tensors if k not in used and not hf_keys.ignored(k, cfg)
                        and 0 not in tensors[k].shape(k))
    if unexpected:
        raise CheckpointError(f"{folder}: tensors not in the {cfg.model_type} key table: "
                              + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else ""))
    for path, experts in parts.items():
        _set(tree, path, weights.Mxfp4ExpertStack(experts, scale_parts[path]) if path in scale_parts
             else weights.ExpertStack(experts, transposed=transposed.get(path, True)))
    return tree


def stored_dtype(tree: dict) -> np.dtype:
    """The checkpoint's dtype: its embedding's (what a model computes in unless told otherwise)."""
    return np.dtype(tree["embed"].dtype)


def read_hf_params(folder: str, cfg: ModelConfig, dtype=None, experts: str = "device") -> dict:
    """Load a hub checkpoint into the moejax tree (every key and shape checked first), one tensor at a
    time; ``experts="lazy"`` leaves the routed experts in the files (``weights.place``)."""
    tree = hf_tree(folder, cfg)
    return weights.place(weights.with_dtype(tree, dtype or stored_dtype(tree), cfg.model_type), experts)


# ----------------------------------------------------------------------------------- streaming writer
def _leaf_dtype(leaf) -> np.dtype:
    return np.dtype(leaf.dtype)


def write_sharded(folder: str, stem: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]], data,
                  max_shard_bytes: int = 4 << 30, metadata: dict | None = None) -> list[str]:
    """Write tensors ``specs`` (key, dtype, shape) as ``{stem}.safetensors``, or as shards
    ``{stem}-00001-of-0000n.safetensors`` with ``{stem}.safetensors.index.json`` (the hub's layout),
    streaming: ``data(key)`` yields each tensor's pieces, so no tensor is ever held whole by the writer."""
    shards: list[list] = [[]]
    size = total = 0
    for spec in specs:
        nbytes = int(np.prod(spec[2], dtype=np.int64)) * np.dtype(spec[1]).itemsize
        total += nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    if len(shards) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        safetensors_io.write_stream(os.path.join(folder, name), shard, data, metadata)
    if len(shards) > 1:
        weight_map = {key: name for name, shard in zip(names, shards) for key, _, _ in shard}
        atomic.write_json(os.path.join(folder, f"{stem}.safetensors.index.json"),
                          {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


# ----------------------------------------------------------------------------------- Hugging Face out
def _hf_value(params: dict, e: hf_keys.Entry) -> np.ndarray:
    leaf = _get(params, e.path)
    value = weights.expert_matrix(leaf, e.expert) if e.expert is not None else weights.to_host(leaf)
    return np.ascontiguousarray(value.T if e.transpose else value)


def _hf_pieces(params: dict, pieces: list[hf_keys.Entry]):
    """One HF tensor's values in file order: each entry's piece, or where the file interleaves columns (GPT-OSS's
    gate/up), each expert's (or the whole tensor's) pieces woven together."""
    if pieces[0].columns is None:
        yield from (_hf_value(params, e) for e in pieces)
        return
    step = pieces[0].columns[1]
    for start in range(0, len(pieces), step):
        group = sorted(pieces[start:start + step], key=lambda e: e.columns[0])
        yield np.stack([_hf_value(params, e) for e in group], axis=-1).reshape(*group[0].shape[:-1], -1)


def save_hf(params: dict, cfg: ModelConfig, folder: str, *, tokenizer_from: str | None = None,
            overwrite: bool = False, max_shard_bytes: int = 4 << 30, protect: tuple[str, ...] = ()) -> str:
    """Write a Hugging Face folder (safetensors shards + index, config.json) that transformers loads,
    tensor by tensor (``params`` may be lazy: a conversion holds one tensor at a time; or serving-layout).
    ``tokenizer_from``: a folder whose tokenizer and model card (``CARD_FILES``) come along."""
    params = layout.canonical_view(params)
    dtype = _leaf_dtype(params["embed"])
    table = hf_keys.by_tensor(hf_keys.entries(cfg))
    specs = [(key, np.dtype(np.float32) if weights.is_float32_param(pieces[0].path, cfg.model_type) else dtype,
              hf_keys.tensor_shape(pieces, cfg.n_experts)) for key, pieces in table.items()]
    with atomic_folder(folder, overwrite, protect) as tmp:
        write_sharded(tmp, "model", specs, lambda key: _hf_pieces(params, table[key]), max_shard_bytes)
        hf = cfg.hf
        hf["torch_dtype"] = hf["dtype"] = str(dtype)
        hf.pop("quantization_config", None)  # the weights written are floating point (an MXFP4 source's decoded)
        atomic.write_json(os.path.join(tmp, "config.json"), hf)
        if tokenizer_from:
            _copy_companion_files(tokenizer_from, tmp)
    return os.path.abspath(folder)


# ------------------------------------------------------------------------------------- moejax format
PARAMS_STEM = "params"


def is_moejax_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, FORMAT_FILE))


def tree_paths(cfg: ModelConfig) -> list[tuple]:
    """Every leaf path of the parameter tree, in the key table's order (expert stacks once)."""
    return [e.path for e in hf_keys.entries(cfg) if e.expert in (None, 0)]


def expert_paths(cfg: ModelConfig) -> set[tuple]:
    return {e.path for e in hf_keys.entries(cfg) if e.expert is not None}


def tensor_key(path: tuple) -> str:
    """A tree path as a safetensors key: ("layers", 3, "moe", "gate") -> "layers.3.moe.gate"."""
    return ".".join(str(p) for p in path)


def _int8_expert(leaf, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``e`` of a stack (lazy, an array or a canonical view; ``[N, in, out]``) as int8 ``[out, in]``
    and float32 scales ``[out, 1]``: stored int8 as it is, anything else through ``layout.quantize_matrix``
    (what int8 serving does at load time, so both give the same bits)."""
    if weights.is_int8_stack(leaf):
        qt = leaf.stored_copy(e)
    else:
        qt = layout.quantize_matrix(np.ascontiguousarray(weights.expert_matrix(leaf, e).T))
    return np.asarray(qt.q), np.asarray(qt.scale, np.float32)


def _int8_expert_pieces(leaves: dict):
    """``data(key)`` of ``write_sharded`` for an int8 folder: the ``.q8`` and ``.scale`` tensors of each expert
    stack, one expert at a time (each expert quantised once: its scales wait for the ``.scale`` tensor)."""
    pending: dict[str, list] = {}

    def data(name: str):
        if name.endswith(INT8_SUFFIX):
            stack = name[: -len(INT8_SUFFIX)]
            scales = pending[stack] = []
            for e in range(leaves[stack].shape[0]):
                q, scale = _int8_expert(leaves[stack], e)
                scales.append(scale)
                yield q
        elif name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in leaves:
            stack = name[: -len(SCALE_SUFFIX)]
            scales = pending.pop(stack, None)
            if scales is None:  # written before its values (never with write_sharded's order): quantise again
                scales = [_int8_expert(leaves[stack], e)[1] for e in range(leaves[stack].shape[0])]
            yield from scales
        else:
            yield from weights.chunks(leaves[name])

    return data


def save_moejax(params: dict, cfg: ModelConfig, folder: str, *, tokenizer_from: str | None = None,
                overwrite: bool = False, protect: tuple[str, ...] = (), max_shard_bytes: int = 4 << 30,
                expert_dtype: str = "stored", extra_files: dict[str, str] | None = None) -> str:
    """Write a moejax folder (format version 2): every tensor in safetensors shards under its tree path,
    each MoE layer's experts as one ``[N, in, out]`` stack per matrix (one expert = one contiguous slice,
    so offloading pages it straight from the file). Streams: ``params`` may be lazy (or serving-layout).
    ``expert_dtype="int8"``: the routed experts as int8 + scales (version 3, module docstring).
    ``tokenizer_from``: a folder whose tokenizer and model card (``CARD_FILES``) come along; ``extra_files``:
    file name -> text, written into the folder before it appears (a README, a record; they win over a copy)."""
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype must be one of {', '.join(EXPERT_DTYPES)}, got {expert_dtype!r}")
    for name in extra_files or {}:
        if os.path.basename(name) != name or name in (FORMAT_FILE, "", ".", "..") or name.startswith(PARAMS_STEM):
            raise ValueError(f"extra file {name!r}: a plain file name that is not the checkpoint's own")
    params = layout.canonical_view(params)
    paths = tree_paths(cfg)
    leaves = {tensor_key(p): _get(params, p) for p in paths}
    dtype = _leaf_dtype(params["embed"])
    shapes = param_shapes(cfg)
    for key, path in zip(leaves, paths):
        _check_shape(key, leaves[key].shape, _get(shapes, path))
    int8 = expert_dtype == "int8" or (expert_dtype == "stored" and weights.has_int8_experts(params))
    stacks = {tensor_key(p) for p in expert_paths(cfg)} if int8 else set()
    specs = []
    for key, leaf in leaves.items():
        if key in stacks:
            n, d_in, d_out = (int(x) for x in leaf.shape)
            specs += [(key + INT8_SUFFIX, np.dtype(np.int8), (n, d_out, d_in)),
                      (key + SCALE_SUFFIX, np.dtype(np.float32), (n, d_out, 1))]
        else:
            specs.append((key, _leaf_dtype(leaf), tuple(leaf.shape)))
    with atomic_folder(folder, overwrite, protect) as tmp:
        write_sharded(tmp, PARAMS_STEM, specs, _int8_expert_pieces(leaves) if int8 else
                      (lambda key: weights.chunks(leaves[key])), max_shard_bytes, {"format": "moejax"})
        meta = {"format": "moejax", "version": INT8_EXPERTS_VERSION if int8 else FORMAT_VERSION, "dtype": str(dtype),
                "hf_config": cfg.hf}
        if int8:
            meta["experts"] = "int8"
        atomic.write_json(os.path.join(tmp, FORMAT_FILE), meta)
        if tokenizer_from:
            _copy_companion_files(tokenizer_from, tmp)
        for name, text in (extra_files or {}).items():
            atomic.write_text(os.path.join(tmp, name), text)
    return os.path.abspath(folder)


def _read_meta(folder: str) -> dict:
    path = os.path.join(folder, FORMAT_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "moejax" or meta.get("version") not in READ_VERSIONS:
        got = meta if not isinstance(meta, dict) else f"{meta.get('format')!r} version {meta.get('version')!r}"
        raise CheckpointError(f"{path}: unknown format {got} (this moejax reads versions "
                              f"{', '.join(map(str, READ_VERSIONS))})")
    if not isinstance(meta.get("hf_config"), dict):
        raise CheckpointError(f"{path}: no 'hf_config' object")
    return meta


def _read_orbax(folder: str, cfg: ModelConfig, stored) -> dict:
    """Version 1 folders: the whole tree restored with orbax (not lazily; re-save to get version 2)."""
    path = os.path.join(os.path.abspath(folder), "params")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} does not exist: a version 1 moejax folder keeps its weights there")
    try:
        return orbax_io.restore(path, abstract_params(cfg, stored))
    except Failure as e:  # names the folder and tensorstore's cause, in one line
        raise CheckpointError(f"{path}: the version 1 parameters cannot be restored ({e}); re-convert the model "
                              "from its source") from None


def _check_int8_scales(file: safetensors_io.SafetensorsFile, name: str, view: np.ndarray) -> None:
    """int8 experts' scales are finite: a NaN or infinite one is a damaged file, refused at load (they are a
    few bytes per row, so all are read; the pages are released again)."""
    bad = quant.count_nonfinite(view)
    file.release(view)
    if bad:
        raise CheckpointError(f"{file.path}: {bad} of the int8 scales in tensor {name!r} are not finite (NaN or "
                              "infinite): the file is damaged")


def _int8_stack(folder: str, tensors: dict, key: str, want: tuple, dtype) -> "weights.QuantizedExpertStack":
    """The int8 expert stack ``key`` of a version 3 folder (``.q8`` + ``.scale``), shapes and dtypes checked."""
    n, d_in, d_out = want
    parts = {}
    for suffix, shape, kind in ((INT8_SUFFIX, (n, d_out, d_in), np.int8), (SCALE_SUFFIX, (n, d_out, 1), np.float32)):
        name = key + suffix
        if name not in tensors:
            raise CheckpointError(f"{folder}: missing tensor {name!r} (its experts are stored as int8)")
        file = tensors[name]
        _check_shape(name, file.shape(name), shape)
        view = file.get(name)
        if view.dtype != kind:
            raise CheckpointError(f"{folder}: tensor {name!r} is {view.dtype}, expected {np.dtype(kind)}")
        if suffix == SCALE_SUFFIX:
            _check_int8_scales(file, name, view)
        parts[suffix] = [(file, view[e]) for e in range(n)]
    return weights.QuantizedExpertStack(parts[INT8_SUFFIX], parts[SCALE_SUFFIX], dtype)


def moejax_tree(folder: str, cfg: ModelConfig, meta: dict | None = None) -> dict:
    """A version 2 or 3 folder's parameter tree with every leaf left in its files, keys and shapes checked
    (version 3: the routed experts as ``weights.QuantizedExpertStack``, computing in the folder's dtype)."""
    meta = meta or {}
    tensors = _open_shards(folder, f"{PARAMS_STEM}.safetensors.index.json", PARAMS_STEM)
    shapes, stacks = param_shapes(cfg), expert_paths(cfg)
    int8 = meta.get("experts") == "int8"
    tree: dict = {}
    used = set()
    for path in tree_paths(cfg):
        key = tensor_key(path)
        if int8 and path in stacks:
            stack = _int8_stack(folder, tensors, key, _get(shapes, path), jnp.dtype(meta.get("dtype", "bfloat16")))
            used.update((key + INT8_SUFFIX, key + SCALE_SUFFIX))
            _set(tree, path, stack)
            continue
        if key not in tensors:
            raise CheckpointError(f"{folder}: missing tensor {key!r}")
        used.add(key)
        file = tensors[key]
        _check_shape(key, file.shape(key), _get(shapes, path))
        view = file.get(key)
        if path in stacks:
            _set(tree, path, weights.ExpertStack([(file, view[e]) for e in range(view.shape[0])], False))
        else:
            _set(tree, path, weights.LazyTensor(file, view))
    unexpected = sorted(set(tensors) - used)
    if unexpected:
        raise CheckpointError(f"{folder}: tensors not in the {cfg.model_type} tree: {', '.join(unexpected[:10])}")
    return tree


def stored_expert_dtype(folder: str) -> str:
    """"int8" for a moejax folder whose routed experts are stored as int8 (version 3), else "stored"."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if os.path.isdir(folder) and is_moejax_folder(folder):
        return "int8" if _read_meta(folder).get("experts") == "int8" else "stored"
    return "stored"


def open_params(folder: str, dtype=None) -> tuple[dict, ModelConfig]:
    """The parameter tree of a moejax or Hugging Face folder without reading the weights (lazy leaves;
    version 1 moejax folders are restored whole), as ``dtype`` (default: the checkpoint's own)."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder {folder} " + ("is a file, not a folder" if os.path.exists(folder)
                                                           else "does not exist"))
    if is_moejax_folder(folder):
        meta = _read_meta(folder)
        cfg = from_hf(meta["hf_config"])
        if meta["version"] == 1:
            tree = _read_orbax(folder, cfg, jnp.dtype(meta.get("dtype", "float32")))
        else:
            tree = moejax_tree(folder, cfg, meta)
    else:
        cfg = from_hf(read_hf_config(folder))
        tree = hf_tree(folder, cfg)
    return weights.with_dtype(tree, dtype or stored_dtype(tree), cfg.model_type), cfg


def load_params(folder: str, dtype=None, experts: str = "device",
                arrangement: str = "canonical", quantization=None, mesh=None) -> tuple[dict, ModelConfig]:
    """Parameters and config from a moejax or Hugging Face folder, placed: non-expert weights on the
    device, routed experts on the device (``"device"``) or left in the files (``"lazy"``, for offload);
    in the canonical or the serving layout (``moejax.models.layout``; ``quantization``: int8 matrices there);
    ``mesh``: the experts split over its devices (``weights.place``)."""
    tree, cfg = open_params(folder, dtype)
    return weights.place(tree, experts, arrangement, quantization, mesh), cfg


def convert_to_moejax(src: str, dst: str, dtype=None, overwrite: bool = False, expert_dtype: str = "stored") -> str:
    """A Hugging Face or moejax folder as a moejax folder (``expert_dtype="int8"``: int8 experts, version 3).
    Streams: one tensor (one expert) in memory at a time, whatever the model size."""
    check_replaceable(dst, overwrite, (src,))  # before reading a byte: refusals are instant
    tree, cfg = open_params(src, dtype)
    return save_moejax(tree, cfg, dst, tokenizer_from=src, overwrite=overwrite, protect=(src,),
                       expert_dtype=expert_dtype)


def convert_moejax_to_hf(src: str, dst: str, dtype=None, overwrite: bool = False) -> str:
    check_replaceable(dst, overwrite, (src,))
    tree, cfg = open_params(src, dtype)
    return save_hf(tree, cfg, dst, tokenizer_from=src, overwrite=overwrite, protect=(src,))



__all__ = [
    "CheckpointError", "UnsupportedModelError", "load_params", "open_params", "save_moejax", "save_hf",
    "convert_to_moejax", "convert_moejax_to_hf", "read_hf_params",
]
