"""Hugging Face folders with the exact config of a real MoE model and random weights, written streaming.

    python -m moejax.testing.random_checkpoint PRESET OUT [--layers L] [--dtype bfloat16] [--seed S]
        [--set key=value ...] [--shard-gb 5] [--overwrite]
    python -m moejax.testing.random_checkpoint --list

Presets (``moejax/testing/presets/*.json``, the models' own ``config.json``): mixtral-8x7b, phi-3.5-moe,
qwen1.5-moe-a2.7b, qwen3-30b-a3b, olmoe-1b-7b, deepseek-v2-lite, moonlight-16b-a3b, deepseek-v3 (671B:
``--layers`` cuts it), glm-4.5-air, granite-3.0-1b-a400m, granite-3.0-3b-a800m, ernie-4.5-21b-a3b, dots.llm1,
hunyuan-a13b; PRESET may also be a config.json path.
``--layers`` keeps the first L decoder layers (a cut with the real per-layer shapes), ``--mxfp4`` writes
GPT-OSS's experts as its hub release does (MXFP4 blocks and scales: uniformly random codes), ``--set`` overrides
config values (JSON values: ``--set hidden_size=64 --set vocab_size=512`` makes a tiny test model).

Weights are N(0, 0.02²), norm scales 1 and norm biases 0, drawn per tensor from (seed, key), so a tensor
does not depend on the shard layout or on the other tensors. The safetensors shards use the hub's key
layout (one tensor per expert and matrix) and the hub's file names with an index; tensors are generated
and written in chunks of a few MB, so peak memory stays far below one tensor, whatever the model size.
The folder is built under a temporary name beside OUT and renamed when complete; the free disk space is
checked first. ``transformers`` loads the result (``AutoModelForCausalLM.from_pretrained``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import zlib

import ml_dtypes
import numpy as np

from moejax.base import atomic, commands, errors, flags, interrupts
from moejax.base.memory import format_bytes
from moejax.base.typecheck import is_integer
from moejax.models import checkpoint, hf_keys, mxfp4, safetensors_io, weights
from moejax.models.config import GPT_OSS, from_hf

PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
STD = 0.02
CHUNK = 1 << 22  # elements generated at a time (16 MB of float32)


def presets() -> list[str]:
    if not os.path.isdir(PRESETS_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".json"))


def preset_config(name: str) -> dict:
    """The config.json of preset ``name`` (or of the config.json file at path ``name``)."""
    path = os.path.join(PRESETS_DIR, f"{name}.json")
    if not os.path.isfile(path):
        path = os.path.expanduser(name)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"unknown preset {name!r} (presets: {', '.join(presets())}; or a config.json path)")
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as e:  # bad JSON or UTF-8, an integer of over 4300 digits
            raise errors.Failure(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise errors.Failure(f"{path}: a config.json holds a JSON object")
    return config


_SIZE_SUFFIXES = ("_size", "_dim", "_rank", "_position_embeddings", "_heads")
_MAY_BE_ZERO = ("shared_expert_intermediate_size", "n_shared_experts", "num_nextn_predict_layers")


def parse_sets(items: list[str]) -> dict:
    """``key=value`` pairs; values are JSON (``64``, ``true``, ``null``, ``[1, 2]``) or else strings."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        _check_size(item, key, out[key])
    return out


def _check_size(item: str, key: str, value) -> None:
    """A size or count (``hidden_size``, ``num_experts``, ...) is null or an integer >= 1 (>= 0 where a
    family uses 0 to switch a part off)."""
    if value is None or not (key.endswith(_SIZE_SUFFIXES) or key.startswith(("num_", "n_"))):
        return
    low = 0 if key in _MAY_BE_ZERO else 1
    if not is_integer(value) or value < low:
        raise ValueError(f"--set {item!r}: {key} must be an integer >= {low}")


def with_overrides(config: dict, layers: int | None = None, sets: dict | None = None, dtype: str = "bfloat16") -> dict:
    """The config with ``sets`` applied, cut to ``layers`` decoder layers, and the weights' dtype recorded."""
    config = {**config, **(sets or {})}
    if layers is not None:
        total = int(config["num_hidden_layers"])
        if not 1 <= layers <= total:
            raise ValueError(f"--layers {layers}: the model has {total} layers (1..{total})")
        config["num_hidden_layers"] = layers
        # per-layer lists follow the cut
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:layers]
        if isinstance(config.get("mlp_only_layers"), list):
            config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    config["torch_dtype"] = config["dtype"] = dtype
    return config


def tensor_plan(config: dict, mxfp4: bool = False) -> list[tuple[str, tuple[int, ...], str]]:
    """(hub key, shape, kind) of every tensor, kind "scale" (norm weight: ones), "shift" (norm bias:
    zeros), "random", or for ``mxfp4`` experts "blocks" / "scales"; from moejax's key table, which is also what
    import checks against."""
    return _plan(config, mxfp4)[0]


#: GPT-OSS's release keeps these in bfloat16 and its experts in MXFP4 (its config.json's quantization_config)
MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def _plan(config: dict, mxfp4: bool = False) -> tuple[list[tuple[str, tuple[int, ...], str]], set[str]]:
    """``tensor_plan`` and the keys written float32 whatever the dtype (``weights.is_float32_param``: DeepSeek-V3's
    selection bias, float32 in the released files too; ERNIE-4.5's router)."""
    cfg = from_hf(config)
    plan, float32 = [], set()
    for key, pieces in hf_keys.by_tensor(hf_keys.entries(cfg, mxfp4)).items():
        e = pieces[0]
        # every norm's weight is 1 and its bias 0: the layer norms and the per-head q/k norms alike (those were
        # drawn at random, N(0, 0.02²), which scaled q·k by ~4e-4 and left the attention nearly uniform)
        kind = e.mxfp4 or ("scale" if key.endswith("norm.weight") else "shift" if key.endswith("norm.bias")
                           else "random")
        plan.append((key, tuple(hf_keys.tensor_shape(pieces, cfg.n_experts)), kind))
        if weights.is_float32_param(e.path, cfg.model_type):
            float32.add(key)
    return plan, float32


def check_mxfp4(cfg) -> None:
    """``--mxfp4`` writes GPT-OSS's experts as the loader reads them back: rows of whole MXFP4 blocks, so the
    experts' two contraction sizes (hidden_size for gate/up, intermediate_size for down) are multiples of 32."""
    if cfg.model_type != GPT_OSS:
        raise ValueError(f"--mxfp4 writes GPT-OSS's release format; this is a {cfg.model_type} model")
    sizes = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.moe_intermediate_size}
    bad = {k: v for k, v in sizes.items() if v % mxfp4.GROUP}
    if bad:
        raise ValueError(f"--mxfp4 stores the experts in blocks of {mxfp4.GROUP} weights: "
                         + " and ".join(f"{k} {v}" for k, v in bad.items())
                         + f" must be a multiple of {mxfp4.GROUP} (--set {next(iter(bad))}=...)")


def mxfp4_scale(std: float) -> int:
    """The E8M0 scale byte with which uniformly random FP4 codes (root mean square 2.93) have about ``std``."""
    rms = float(np.sqrt(np.mean(mxfp4.FP4_VALUES ** 2)))
    return int(np.clip(round(127 + math.log2(std / rms)), 0, 254)) if std > 0 else 127


def tensor_chunks(key: str, shape: tuple[int, ...], kind: str, seed: int, dtype, std: float = STD):
    """The tensor's values in row-major chunks: a function of (seed, key) only."""
    n = int(np.prod(shape, dtype=np.int64))
    if kind in hf_keys.MXFP4_PARTS:  # random codes (none when std is 0) under one scale that gives them ~std
        rng, scale = np.random.default_rng([seed, zlib.crc32(key.encode())]), mxfp4_scale(std)
        for start in range(0, n, CHUNK):
            m = min(CHUNK, n - start)
            if kind == "scales":
                yield np.full(m, scale, np.uint8)
            else:
                yield rng.integers(0, 256, m, dtype=np.uint8) if std > 0 else np.zeros(m, np.uint8)
        return
    if kind != "random":
        fill = 1.0 if kind == "scale" else 0.0
        for start in range(0, n, CHUNK):
            yield np.full(min(CHUNK, n - start), fill, dtype)
        return
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    for start in range(0, n, CHUNK):
        part = rng.standard_normal(min(CHUNK, n - start), dtype=np.float32)
        part *= std
        yield part.astype(dtype)


def shard_plan(plan: list, itemsize: dict[str, int], shard_bytes: int) -> list[list]:
    """Consecutive tensors grouped into shards of at most ``shard_bytes`` (one tensor may exceed it);
    ``itemsize``: bytes an element, by key."""
    shards, size = [[]], 0
    for item in plan:
        nbytes = int(np.prod(item[1], dtype=np.int64)) * itemsize[item[0]]
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    return shards


def write_checkpoint(config: dict, out: str, *, dtype: str = "bfloat16", seed: int = 0,
                     shard_bytes: int = 5 << 30, overwrite: bool = False, progress=None, std: float = STD,
                     mxfp4: bool = False) -> str:
    """Write the folder; returns its absolute path. ``config`` as from ``with_overrides``. ``mxfp4``: GPT-OSS's
    routed experts as its hub release stores them (MXFP4 blocks and scales, ``quantization_config`` mxfp4)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    np_dtype = np.dtype(DTYPES[dtype])
    largest = float(ml_dtypes.finfo(np_dtype).max)
    if not (math.isfinite(std) and 0 <= std * 10 <= largest):  # normal samples reach ~6.5 σ in a big tensor
        raise ValueError(f"--std {std} would overflow {dtype} (at most {largest / 10:.3g})")
    if mxfp4:
        check_mxfp4(from_hf(config))
        config = {**config, "quantization_config": MXFP4_CONFIG}
    plan, float32 = _plan(config, mxfp4)
    dtype_of = {k: np.dtype(np.uint8) if kind in hf_keys.MXFP4_PARTS else np.dtype(np.float32) if k in float32
                else np_dtype for k, _, kind in plan}
    total = sum(int(np.prod(s, dtype=np.int64)) * dtype_of[k].itemsize for k, s, _ in plan)
    out = os.path.abspath(os.path.expanduser(out))
    checkpoint.check_replaceable(out, overwrite)
    parent = atomic.existing_ancestor(os.path.dirname(out))  # folders are made (and removed on failure) by the write
    free = shutil.disk_usage(parent).free
    need = total + min(256 << 20, max(1 << 20, total // 20))  # the index, config and tokenizer, with a margin
    if free < need:
        raise OSError(f"{parent}: {format_bytes(free)} free, the checkpoint needs {format_bytes(need)}")
    shards = shard_plan(plan, {k: d.itemsize for k, d in dtype_of.items()}, shard_bytes)
    shapes = {k: (s, kind) for k, s, kind in plan}
    with checkpoint.atomic_folder(out, overwrite) as tmp:
        weight_map = {}
        for i, shard in enumerate(shards):
            name = ("model.safetensors" if len(shards) == 1
                    else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
            specs = [(k, dtype_of[k], s) for k, s, _ in shard]
            safetensors_io.write_stream(
                os.path.join(tmp, name), specs,
                lambda key: tensor_chunks(key, shapes[key][0], shapes[key][1], seed, np_dtype, std),
                metadata={"format": "pt"})
            weight_map.update({k: name for k, _, _ in shard})
            if progress:
                progress(f"{name}: {len(shard)} tensors")
        if len(shards) > 1:
            atomic.write_json(os.path.join(tmp, "model.safetensors.index.json"),
                              {"metadata": {"total_size": total}, "weight_map": weight_map})
        atomic.write_json(os.path.join(tmp, "config.json"), config)
        gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
        atomic.write_json(os.path.join(tmp, "generation_config.json"), gen)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("random-checkpoint"),
                                description=__doc__.split("\n\n")[0],
                                formatter_class=commands.HelpFormatter, epilog=__doc__)
    p.add_argument("preset", nargs="?", help="preset name or a config.json path")
    p.add_argument("out", nargs="?", help="folder to write (must not exist unless --overwrite)")
    p.add_argument("--list", action="store_true", help="list the presets and their sizes, then exit")
    p.add_argument("--layers", type=int, default=None, help="keep the first L decoder layers (default: all)")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    p.add_argument("--seed", type=errors.seed_arg, default=0)
    p.add_argument("--std", type=flags.finite_float(0.0, flags.FLOAT32_MAX / 10),
                   default=STD, help="standard deviation of the random weights (0.02)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--shard-gb", type=flags.finite_float(0.0, 1e6, low_open=True),
                   default=5.0, help="largest shard size in GB (default 5)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint folder")
    p.add_argument("--mxfp4", action="store_true",
                   help="GPT-OSS only: the experts in MXFP4, as the hub release stores them (random codes)")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values no checkpoint can be written with (NaN included)."""
    if not (math.isfinite(args.shard_gb) and args.shard_gb > 0):
        raise ValueError(f"--shard-gb must be a finite number > 0, got {args.shard_gb}")
    if not (math.isfinite(args.std) and args.std >= 0):
        raise ValueError(f"--std must be a finite number >= 0, got {args.std}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")


def check_config(preset: dict, config: dict, overrides: str) -> None:
    """Refuse a config moejax cannot run before anything is written: a usage error naming ``overrides`` (the
    flags that made ``config`` of ``preset``) where the preset itself parses, else the preset's own failure."""
    try:
        from_hf(config)
    except errors.Failure as e:
        try:
            from_hf(preset)
        except errors.Failure:
            raise e from None
        raise errors.UsageError(f"{overrides}: {e}") from None


def _size_line(name: str) -> str:
    cfg = from_hf(preset_config(name))
    n = sum(int(np.prod(s, dtype=np.int64)) for _, s, _ in tensor_plan(preset_config(name)))
    return (f"{name:20s} {cfg.model_type:12s} {n / 1e9:6.2f}B params  {2 * n / 1e9:6.1f} GB bf16  "
            f"{cfg.num_layers} layers, {cfg.n_experts} experts, top-{cfg.top_k}")


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    p = build_parser()
    args = p.parse_args(argv)
    try:
        if args.list:
            for name in presets():
                print(_size_line(name))
            return 0
        if not args.preset or not args.out:
            p.error("PRESET and OUT are required (or --list)")
        check_args(args)
        preset, sets = preset_config(args.preset), parse_sets(args.set)
        config = with_overrides(preset, args.layers, sets, args.dtype)
        check_config(preset, config, "--set" if sets else f"--layers {args.layers}")
        if args.mxfp4:
            check_mxfp4(from_hf(config))
        for key in sets:
            if key not in preset:  # a family may read it, but a typo ("hiden_size") would change nothing
                print(f"note: --set {key}: the {args.preset} config has no such key; it is added as given "
                      "(check the spelling)", file=sys.stderr)
        folder = write_checkpoint(config, args.out, dtype=args.dtype, seed=args.seed,
                                  shard_bytes=int(args.shard_gb * 1e9),
                                  overwrite=args.overwrite, progress=lambda s: print(s, file=sys.stderr),
                                  std=args.std, mxfp4=args.mxfp4)
    except errors.HANDLED as e:
        return errors.report(e)
    return errors.print_result(folder)


if __name__ == "__main__":
    sys.exit(main())
