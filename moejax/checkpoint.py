"""Checkpoint folders: Hugging Face (safetensors) in and out, and the moejax format (orbax).

moejax checkpoint folder::

    moejax.json        {"format": "moejax", "version": 1, "dtype": ..., "hf_config": {...}}
    params/            the parameter tree, saved with orbax
    tokenizer.json ... tokenizer and generation files copied from the source folder

Every writer builds the folder under a temporary name beside the target and renames it at the end, so an
interrupted conversion never leaves a folder that loads. Pickled checkpoints (``.bin``/``.pt``) are refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from moejax import hf_keys, safetensors_io
from moejax.config import ModelConfig, UnsupportedModelError, from_hf

FORMAT_FILE = "moejax.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json",
)


class CheckpointError(ValueError):
    """A checkpoint folder is missing, malformed or does not match its configuration."""


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
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        flat = leaf.reshape(-1)
        h.update(f"{jax.tree_util.keystr(path)}:{tuple(leaf.shape)}:{leaf.dtype};".encode())
        if flat.size <= full_below:
            parts = [flat]
        else:
            stride = -(-flat.size // samples)
            parts = [flat[:4096], flat[::stride], flat[-4096:]]
        for part in parts:
            h.update(np.ascontiguousarray(np.asarray(part)).tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def atomic_folder(target: str, overwrite: bool = False, protect: tuple[str, ...] = ()) -> Iterator[str]:
    """Yield a temporary folder beside ``target``; rename it to ``target`` only if the block succeeds.

    Never destroys what the user had: ``target`` may not be (or contain) a ``protect``ed path (the source
    of a conversion), and ``overwrite`` replaces only an existing checkpoint folder or an empty one."""
    target = os.path.realpath(os.path.abspath(os.path.expanduser(target)))
    check_replaceable(target, overwrite, protect)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)
    try:
        yield tmp
        if os.path.exists(target):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=parent)
            os.replace(target, os.path.join(old, "x"))
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_checkpoint_folder(folder: str) -> bool:
    """A moejax checkpoint folder or a Hugging Face one (config.json beside safetensors weights)."""
    if is_moejax_folder(folder):
        return True
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return "config.json" in names and any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                                          for n in names)


def check_replaceable(target: str, overwrite: bool, protect: tuple[str, ...] = ()) -> None:
    """Raise ``FileExistsError`` / ``CheckpointError`` unless writing the folder ``target`` loses nothing."""
    target = os.path.realpath(os.path.abspath(os.path.expanduser(target)))
    for p in protect:
        p = os.path.realpath(os.path.abspath(os.path.expanduser(p)))
        if target == p:
            raise CheckpointError(f"the target {target} is the source itself: choose another target folder")
        if p.startswith(target.rstrip(os.sep) + os.sep):
            raise CheckpointError(f"the target {target} contains the source {p}: replacing it would delete the "
                                  "source; choose another target folder")
    if not os.path.lexists(target):
        return
    if not overwrite:
        raise FileExistsError(f"{target} already exists (pass overwrite=True / --overwrite to replace it)")
    if not os.path.isdir(target) or os.path.islink(target):
        raise CheckpointError(f"{target} exists and is not a folder: refusing to replace it")
    if os.listdir(target) and not is_checkpoint_folder(target):
        found = ", ".join(sorted(os.listdir(target))[:5])
        raise CheckpointError(f"{target} is not a checkpoint folder (it holds {found}...): --overwrite only "
                              "replaces a moejax or Hugging Face checkpoint; remove it yourself or choose "
                              "another target")


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _copy_tokenizer(src: str, dst: str) -> None:
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


# ------------------------------------------------------------------------------------ Hugging Face in
def _refuse_pickles(folder: str) -> None:
    pickled = sorted(f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".ckpt")))
    if pickled:
        raise CheckpointError(
            f"{folder} holds pickled weights ({', '.join(pickled)}) and no safetensors; moejax never "
            "unpickles. Convert them once with transformers: `AutoModelForCausalLM.from_pretrained(PATH)"
            ".save_pretrained(OUT, safe_serialization=True)` (or use the model's safetensors release)."
        )


def read_hf_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder {folder} does not exist")
    if not os.path.isfile(path):
        raise CheckpointError(f"{folder} has no config.json (nor {FORMAT_FILE}): not a model folder")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def _open_shards(folder: str) -> dict[str, safetensors_io.SafetensorsFile]:
    """Map every tensor key to the file holding it; fail on duplicates and broken indexes."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f).get("weight_map", {})
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if os.path.isabs(n) or os.path.basename(n) != n or n in (".", "..")]
        if outside:  # shards live in the folder itself: never follow an index elsewhere
            raise CheckpointError(f"{index_path} names shard {outside[0]!r} outside the model folder; refusing it")
    else:
        weight_map = None
        names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not names:
        _refuse_pickles(folder)
        raise CheckpointError(f"{folder} has no .safetensors weights")
    files, where = {}, {}
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{index_path} names shard {name}, which is missing")
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


def read_hf_params(folder: str, cfg: ModelConfig, dtype=None) -> dict:
    """Load a hub checkpoint into the moejax tree, checking every key and shape first."""
    tensors = _open_shards(folder)
    table = hf_keys.entries(cfg)
    expected = {e.hf_key for e in table}
    unexpected = sorted(k for k in tensors if k not in expected and not k.endswith(hf_keys.IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(f"{folder}: tensors not in the {cfg.model_type} key table: "
                              + ", ".join(unexpected[:10]) + (" ..." if len(unexpected) > 10 else ""))
    missing = [e.hf_key for e in table if e.hf_key not in tensors]
    if missing:
        raise CheckpointError(f"{folder}: missing tensors: " + ", ".join(missing[:10])
                              + (f" ... ({len(missing)} in all)" if len(missing) > 10 else ""))
    for e in table:
        got = tensors[e.hf_key].shape(e.hf_key)
        if got != e.shape:
            raise CheckpointError(f"tensor {e.hf_key!r} has shape {got}, expected {e.shape} for this config")
    if dtype is None:
        dtype = tensors[table[0].hf_key].dtype(table[0].hf_key)
    params: dict = {}
    stacks: dict[tuple, np.ndarray] = {}
    for e in table:
        value = tensors[e.hf_key].get(e.hf_key)
        value = value.T if e.transpose else value
        if e.expert is None:
            _set(params, e.path, jnp.asarray(np.asarray(value, dtype=dtype)))
        else:
            if e.path not in stacks:
                stacks[e.path] = np.empty(_stacked_shape(e, cfg), dtype=dtype)
            stacks[e.path][e.expert] = value
    for path, value in stacks.items():
        _set(params, path, jnp.asarray(value))
    return params


# ----------------------------------------------------------------------------------- Hugging Face out
def hf_tensors(params: dict, cfg: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    for e in hf_keys.entries(cfg):
        value = np.asarray(_get(params, e.path))
        if e.expert is not None:
            value = value[e.expert]
        yield e.hf_key, np.ascontiguousarray(value.T if e.transpose else value)


def save_hf(params: dict, cfg: ModelConfig, folder: str, *, tokenizer_from: str | None = None,
            overwrite: bool = False, max_shard_bytes: int = 4 << 30, protect: tuple[str, ...] = ()) -> str:
    """Write a Hugging Face folder (safetensors shards + index, config.json) that transformers loads."""
    with atomic_folder(folder, overwrite, protect) as tmp:
        shards: list[list[tuple[str, np.ndarray]]] = [[]]
        size = 0
        for key, value in hf_tensors(params, cfg):
            if shards[-1] and size + value.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((key, value))
            size += value.nbytes
        if len(shards) == 1:
            safetensors_io.write(os.path.join(tmp, "model.safetensors"), shards[0])
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                safetensors_io.write(os.path.join(tmp, name), shard)
                weight_map.update({k: name for k, _ in shard})
                total += sum(v.nbytes for _, v in shard)
            write_json_atomic(os.path.join(tmp, "model.safetensors.index.json"),
                              {"metadata": {"total_size": total}, "weight_map": weight_map})
        hf = cfg.hf
        hf["torch_dtype"] = hf["dtype"] = str(np.asarray(params["embed"]).dtype)
        write_json_atomic(os.path.join(tmp, "config.json"), hf)
        if tokenizer_from:
            _copy_tokenizer(tokenizer_from, tmp)
    return os.path.abspath(folder)


# ------------------------------------------------------------------------------------- moejax format
def is_moejax_folder(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, FORMAT_FILE))


def save_moejax(params: dict, cfg: ModelConfig, folder: str, *, tokenizer_from: str | None = None,
                overwrite: bool = False, protect: tuple[str, ...] = ()) -> str:
    import orbax.checkpoint as ocp

    with atomic_folder(folder, overwrite, protect) as tmp:
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(os.path.join(tmp, "params"), params)
        ckpt.wait_until_finished()
        ckpt.close()
        meta = {"format": "moejax", "version": FORMAT_VERSION,
                "dtype": str(np.asarray(params["embed"]).dtype), "hf_config": cfg.hf}
        write_json_atomic(os.path.join(tmp, FORMAT_FILE), meta)
        if tokenizer_from:
            _copy_tokenizer(tokenizer_from, tmp)
    return os.path.abspath(folder)


def read_moejax(folder: str, dtype=None) -> tuple[dict, ModelConfig]:
    import orbax.checkpoint as ocp

    with open(os.path.join(folder, FORMAT_FILE)) as f:
        meta = json.load(f)
    if meta.get("format") != "moejax" or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}/{FORMAT_FILE}: unknown format {meta.get('format')!r} "
                              f"version {meta.get('version')!r} (this moejax reads version {FORMAT_VERSION})")
    cfg = from_hf(meta["hf_config"])
    stored = jnp.dtype(meta.get("dtype", "float32"))
    ckpt = ocp.StandardCheckpointer()
    try:
        params = ckpt.restore(os.path.join(os.path.abspath(folder), "params"), abstract_params(cfg, stored))
    finally:
        ckpt.close()
    if dtype is not None:
        params = jax.tree.map(lambda x: x.astype(dtype), params)
    return params, cfg


def load_params(folder: str, dtype=None) -> tuple[dict, ModelConfig]:
    """Parameters and config from a moejax folder or a Hugging Face folder (converted on the fly)."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if not os.path.isdir(folder):
        raise CheckpointError(f"model folder {folder} does not exist")
    if is_moejax_folder(folder):
        return read_moejax(folder, dtype)
    cfg = from_hf(read_hf_config(folder))
    return read_hf_params(folder, cfg, dtype), cfg


def convert_hf_to_moejax(src: str, dst: str, dtype=None, overwrite: bool = False) -> str:
    check_replaceable(dst, overwrite, (src,))  # before reading a byte: refusals are instant
    params, cfg = load_params(src, dtype)
    return save_moejax(params, cfg, dst, tokenizer_from=src, overwrite=overwrite, protect=(src,))


def convert_moejax_to_hf(src: str, dst: str, dtype=None, overwrite: bool = False) -> str:
    check_replaceable(dst, overwrite, (src,))
    params, cfg = load_params(src, dtype)
    return save_hf(params, cfg, dst, tokenizer_from=src, overwrite=overwrite, protect=(src,))


__all__ = [
    "CheckpointError", "UnsupportedModelError", "load_params", "save_moejax", "save_hf",
    "convert_hf_to_moejax", "convert_moejax_to_hf", "read_hf_params",
]
