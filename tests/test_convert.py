"""Checkpoint conversion: HF <-> moejax round trips, sharding, dtypes, every promised error, atomicity, CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

import moejax
from moejax.base import atomic
from moejax.models import checkpoint, convert as convert_cli, layout, safetensors_io
from moejax.models.checkpoint import CheckpointError
from moejax.models.config import SUPPORTED_MODEL_TYPES, UnsupportedModelError

from support.hf_models import FAMILIES, VOCAB, get_hf_model, get_moejax_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPE_KEYS = ("dtype", "torch_dtype")
IDS = np.random.default_rng(7).integers(3, VOCAB, size=16).astype(np.int32)
# one config per family plus the ones whose key layout differs (biases, dense layers between MoE layers)
ROUNDTRIP = list(FAMILIES) + ["phimoe_longrope", "qwen2_moe_sparse_step", "qwen3_moe_mlp_only",
                              "deepseek_v2_group", "deepseek_v2_freq2"]


def read_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder (single or sharded), read with the reference ``safetensors`` package."""
    out: dict[str, np.ndarray] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            for k, v in _load(os.path.join(folder, name)).items():
                assert k not in out, f"{k} in two shards"
                out[k] = v
    return out


def _load(path: str) -> dict[str, np.ndarray]:
    """safetensors.numpy cannot return bfloat16; read those through moejax's reader (checked against
    safetensors for the dtypes both support in test_safetensors_reader_matches_reference)."""
    try:
        return load_file(path)
    except (TypeError, ValueError):
        f = safetensors_io.SafetensorsFile(path)
        return {k: np.array(f.get(k)) for k in f.keys()}


def read_config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _no_dtype(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in DTYPE_KEYS}


def hf_logits(model, ids=IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)[None], use_cache=False).logits[0].float().numpy()


def _siblings(folder: str) -> list[str]:
    return sorted(os.listdir(os.path.dirname(os.path.abspath(folder))))


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    """``roundtrip(name)`` -> (hf folder, moejax folder, exported hf folder), converted once per module."""
    root = tmp_path_factory.mktemp("roundtrip")
    cache: dict[str, tuple[str, str, str]] = {}

    def get(name: str):
        if name not in cache:
            src = get_hf_model(name).folder
            mj = checkpoint.convert_to_moejax(src, str(root / f"{name}-moejax"))
            back = checkpoint.convert_moejax_to_hf(mj, str(root / f"{name}-hf"))
            cache[name] = (src, mj, back)
        return cache[name]

    return get


# -------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", ROUNDTRIP)
def test_hf_moejax_hf_roundtrip_is_bit_exact(name, roundtrip):
    src, mj, back = roundtrip(name)
    assert checkpoint.is_moejax_folder(mj) and os.path.isfile(os.path.join(mj, "params.safetensors"))
    a, b = read_tensors(src), read_tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} changed in the round trip"
    assert _no_dtype(read_config(src)) == _no_dtype(read_config(back))
    assert read_config(back)["dtype"] == "float32"
    # generation config travels with the tokenizer files
    for f in ("generation_config.json",):
        with open(os.path.join(src, f)) as x, open(os.path.join(back, f)) as y:
            assert json.load(x) == json.load(y)


@pytest.mark.parametrize("name", [n for n in ROUNDTRIP if n != "deepseek_v2_freq2"])
def test_exported_folder_loads_in_transformers_with_same_logits(name, roundtrip):
    # (deepseek_v2_freq2 is left out: transformers 5.x ignores moe_layer_freq, so it cannot rebuild it)
    from transformers import AutoModelForCausalLM

    # against the source folder loaded the same way: the model in memory that wrote it can differ from any
    # loaded copy in the last bit (Granite's tied model, transformers 5.24), which says nothing about export
    src, _, back = roundtrip(name)
    reloaded, source = (AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32, attn_implementation="eager").eval()
                        for f in (back, src))
    np.testing.assert_array_equal(hf_logits(reloaded), hf_logits(source))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v2_group"])
def test_load_moejax_folder_equals_load_hf_folder(name, roundtrip):
    src, mj, _ = roundtrip(name)
    a, b = moejax.load(src), moejax.load(mj)
    assert a.cfg == b.cfg
    oa, ob = a.forward(IDS), b.forward(IDS)
    np.testing.assert_array_equal(oa.logits, ob.logits)
    np.testing.assert_array_equal(oa.router_logits, ob.router_logits)
    np.testing.assert_array_equal(oa.experts, ob.experts)
    assert np.abs(oa.logits - hf_logits(get_hf_model(name).model)).max() < 1e-4


# ----------------------------------------------------------------------------------------- sharding
def test_import_of_transformers_sharded_checkpoint(tmp_path):
    hm = get_hf_model("qwen2_moe")
    folder = str(tmp_path / "sharded")
    hm.model.save_pretrained(folder, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 2
    out = moejax.load(folder).forward(IDS)
    np.testing.assert_array_equal(out.logits, get_moejax_model("qwen2_moe").forward(IDS).logits)


def test_sharded_export_imports_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    mj = get_moejax_model("deepseek_v2_group")
    folder = checkpoint.save_hf(mj.params, mj.cfg, str(tmp_path / "out"), max_shard_bytes=16 << 10)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not os.path.exists(os.path.join(folder, "model.safetensors"))
    assert sorted(read_tensors(folder)) == sorted(index["weight_map"])
    np.testing.assert_array_equal(moejax.load(folder).forward(IDS).logits, mj.forward(IDS).logits)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    np.testing.assert_array_equal(hf_logits(reloaded.eval()), hf_logits(get_hf_model("deepseek_v2_group").model))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(shard_bytes=st.integers(min_value=1, max_value=200_000))
def test_any_shard_size_reads_back_identically(tmp_path_factory, shard_bytes):
    """Property: whatever the shard size, save_hf + read_hf_params reproduces every parameter exactly."""
    mj = get_moejax_model("olmoe")
    folder = checkpoint.save_hf(mj.params, mj.cfg, str(tmp_path_factory.mktemp("shards") / "m"),
                                max_shard_bytes=shard_bytes)
    n_files = len([f for f in os.listdir(folder) if f.endswith(".safetensors")])
    assert (n_files > 1) == os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    params = checkpoint.read_hf_params(folder, mj.cfg)
    import jax

    leaves_a, tree_a = jax.tree.flatten(layout.to_canonical(mj.params))
    leaves_b, tree_b = jax.tree.flatten(params)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_safetensors_reader_matches_reference(tmp_path):
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.arange(5, dtype=np.int64),
              "c": np.ones((2, 0), np.float16), "d": np.linspace(-1, 1, 6).astype(np.float16)}
    save_file(arrays, str(tmp_path / "ref.safetensors"))
    f = safetensors_io.SafetensorsFile(str(tmp_path / "ref.safetensors"))
    for k, v in arrays.items():
        assert f.shape(k) == v.shape and f.dtype(k) == v.dtype
        np.testing.assert_array_equal(f.get(k), v)
    safetensors_io.write(str(tmp_path / "ours.safetensors"), arrays.items())
    back = load_file(str(tmp_path / "ours.safetensors"))
    assert sorted(back) == sorted(arrays)
    for k, v in arrays.items():
        np.testing.assert_array_equal(back[k], v)


# -------------------------------------------------------------------------------------------- dtypes
def test_bfloat16_conversion(tmp_path):
    src = get_hf_model("qwen3_moe").folder
    mj = checkpoint.convert_to_moejax(src, str(tmp_path / "bf16"), dtype=jnp.bfloat16)
    with open(os.path.join(mj, checkpoint.FORMAT_FILE)) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    model = moejax.load(mj)
    assert {np.asarray(x).dtype for x in __import__("jax").tree.leaves(model.params)} == {np.dtype(jnp.bfloat16)}
    ref = get_moejax_model("qwen3_moe").forward(IDS).logits
    out = model.forward(IDS).logits
    assert out.dtype == np.float32 and np.isfinite(out).all()
    scale = np.abs(ref).max()
    assert np.abs(out - ref).max() < 0.05 * scale + 0.05, "bf16 logits far from fp32"
    assert np.abs(out - ref).max() > 0, "bf16 gave bit-identical logits: the cast did not happen"
    # export keeps bf16 on disk, exactly the bf16 rounding of the fp32 weights, and transformers loads it
    back = checkpoint.convert_moejax_to_hf(mj, str(tmp_path / "bf16-hf"))
    assert read_config(back)["dtype"] == "bfloat16"
    fp32, bf16 = read_tensors(src), read_tensors(back)
    for k, v in fp32.items():
        assert bf16[k].dtype == ml_dtypes.bfloat16, k
        np.testing.assert_array_equal(bf16[k], v.astype(ml_dtypes.bfloat16))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert reloaded.dtype == torch.bfloat16
    # and back up to float32 through the CLI path: the bf16 values, widened exactly
    up = convert_cli.convert("moejax-to-hf", mj, str(tmp_path / "fp32-hf"), dtype="float32")
    for k, v in read_tensors(up).items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, bf16[k].astype(np.float32))


# -------------------------------------------------------------------------------------------- errors
def _copy_hf(name: str, dst) -> str:
    return shutil.copytree(get_hf_model(name).folder, str(dst))


def _copy_hf_with(name: str, dst, **fields) -> str:
    """A copy of test model ``name`` whose config.json has ``fields`` set."""
    folder = _copy_hf(name, dst)
    cfg = read_config(folder)
    cfg.update(fields)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def _rewrite(folder: str, fn) -> None:
    """Apply ``fn`` to the tensor dict of a single-file HF folder and write it back."""
    path = os.path.join(folder, "model.safetensors")
    tensors = dict(load_file(path))
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        moejax.load(str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.convert_to_moejax(str(tmp_path / "nope"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no config.json"):
        moejax.load(str(tmp_path / "m"))


def test_unsupported_model_type_lists_supported(tmp_path):
    folder = _copy_hf_with("mixtral", tmp_path / "m", model_type="llama")
    with pytest.raises(UnsupportedModelError) as e:
        moejax.load(folder)
    msg = str(e.value)
    assert "'llama'" in msg and "supported model types" in msg
    assert all(t in msg for t in SUPPORTED_MODEL_TYPES)


def test_pickle_only_folder_is_refused_without_unpickling(tmp_path, monkeypatch):
    import pickle

    def boom(*a, **k):
        raise AssertionError("moejax tried to unpickle")

    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(os.path.join(get_hf_model("mixtral").folder, "config.json"), folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 not really a pickle")
    with pytest.raises(CheckpointError) as e:
        moejax.load(str(folder))
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "never" in msg and "unpickle" in msg
    assert "save_pretrained" in msg and "safe_serialization=True" in msg  # says how to convert
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        checkpoint.convert_to_moejax(str(folder), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_unexpected_key_is_named(tmp_path):
    folder = _copy_hf("mixtral", tmp_path / "m")
    _rewrite(folder, lambda t: t.__setitem__("model.layers.0.block_sparse_moe.bogus.weight",
                                             np.zeros((2, 2), np.float32)))
    with pytest.raises(CheckpointError, match=r"not in the mixtral key table.*model\.layers\.0\.block_sparse_moe\.bogus\.weight"):
        moejax.load(folder)


def test_ignored_rotary_buffer_is_accepted(tmp_path):
    folder = _copy_hf("mixtral", tmp_path / "m")
    _rewrite(folder, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq",
                                             np.ones(4, np.float32)))
    np.testing.assert_array_equal(moejax.load(folder).forward(IDS).logits,
                                  get_moejax_model("mixtral").forward(IDS).logits)


def test_missing_key_is_named(tmp_path):
    key = "model.layers.1.mlp.experts.5.down_proj.weight"
    folder = _copy_hf("qwen3_moe", tmp_path / "m")
    _rewrite(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match="missing tensors: " + re.escape(key)):
        moejax.load(folder)


def test_misshaped_tensor_is_named(tmp_path):
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    folder = _copy_hf("deepseek_v2", tmp_path / "m")
    _rewrite(folder, lambda t: t.__setitem__(key, t[key][:-1]))
    with pytest.raises(CheckpointError, match=re.escape(key) + ".*has shape"):
        moejax.load(folder)


def test_duplicate_key_across_shards_is_named(tmp_path):
    mj = get_moejax_model("mixtral")
    folder = checkpoint.save_hf(mj.params, mj.cfg, str(tmp_path / "m"), max_shard_bytes=32 << 10)
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    first, second = sorted(set(weight_map.values()))[:2]
    key = next(k for k, v in weight_map.items() if v == first)
    a, b = load_file(os.path.join(folder, first)), load_file(os.path.join(folder, second))
    b[key] = a[key]
    save_file(b, os.path.join(folder, second), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"duplicate tensor '{key}'")):
        moejax.load(folder)


def test_index_naming_a_missing_shard(tmp_path):
    mj = get_moejax_model("mixtral")
    folder = checkpoint.save_hf(mj.params, mj.cfg, str(tmp_path / "m"), max_shard_bytes=32 << 10)
    victim = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[-1]
    os.remove(os.path.join(folder, victim))
    with pytest.raises(CheckpointError, match=victim):
        moejax.load(folder)


# ---------------------------------------------------------------------------------------- atomicity
def _fail_on_call(n: int, real, exc=RuntimeError):
    calls = []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) >= n:
            raise exc("simulated crash mid-conversion")
        return real(*a, **k)

    return wrapped


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_interrupted_hf_export_leaves_nothing(tmp_path, monkeypatch, exc):
    mj = get_moejax_model("mixtral")
    target = tmp_path / "out" / "model"
    target.parent.mkdir()
    monkeypatch.setattr(safetensors_io, "write_stream", _fail_on_call(3, safetensors_io.write_stream, exc))
    with pytest.raises(exc, match="simulated crash"):
        checkpoint.save_hf(mj.params, mj.cfg, str(target), max_shard_bytes=32 << 10)
    assert os.listdir(target.parent) == []  # no target, no temporary folder


def test_extra_files_are_in_the_folder_when_it_appears_and_never_replace_its_own(tmp_path):
    mj = get_moejax_model("mixtral")
    target = tmp_path / "model"
    for bad in ("moejax.json", "../x.md", "params-00001-of-00001.safetensors"):
        with pytest.raises(ValueError, match="extra file"):
            checkpoint.save_moejax(mj.params, mj.cfg, str(target), extra_files={bad: "x"})
        assert os.listdir(tmp_path) == []  # nothing half-made
    checkpoint.save_moejax(mj.params, mj.cfg, str(target), extra_files={"README.md": "# tiny\n"})
    assert (target / "README.md").read_text() == "# tiny\n"
    assert moejax.load(str(target)).cfg.model_type == "mixtral"


def test_interrupted_moejax_conversion_leaves_nothing(tmp_path, monkeypatch):
    src = get_hf_model("olmoe").folder
    target = tmp_path / "out" / "model"
    target.parent.mkdir()
    # crash after the params are written, while writing moejax.json
    monkeypatch.setattr(atomic, "write_json", _fail_on_call(1, atomic.write_json))
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoint.convert_to_moejax(src, str(target))
    assert os.listdir(target.parent) == []
    with pytest.raises(CheckpointError):
        moejax.load(str(target))


def test_interrupted_overwrite_keeps_the_old_target(tmp_path, monkeypatch, roundtrip):
    _, mj, _ = roundtrip("mixtral")
    target = str(tmp_path / "model")
    shutil.copytree(mj, target)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(atomic, "write_json", _fail_on_call(1, atomic.write_json))
    with pytest.raises(RuntimeError, match="simulated crash"):
        checkpoint.convert_to_moejax(get_hf_model("olmoe").folder, target, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == before
    assert moejax.load(target).cfg.model_type == "mixtral"


def test_existing_target_needs_overwrite(tmp_path, capsys):
    src = get_hf_model("mixtral").folder
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="--overwrite"):
        checkpoint.convert_to_moejax(src, str(target))
    assert convert_cli.main(["hf-to-moejax", src, str(target)]) == 2  # usage: pass --overwrite
    assert "already exists" in capsys.readouterr().err
    assert (target / "keep.txt").read_text() == "precious"
    assert _siblings(str(target)) == ["out"]
    # --overwrite replaces checkpoints only, never an unrelated folder
    assert convert_cli.main(["hf-to-moejax", src, str(target), "--overwrite"]) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err
    assert (target / "keep.txt").read_text() == "precious" and _siblings(str(target)) == ["out"]
    (target / "keep.txt").unlink()
    assert convert_cli.main(["hf-to-moejax", src, str(target), "--overwrite"]) == 0  # empty folder: fine
    assert convert_cli.main(["hf-to-moejax", get_hf_model("olmoe").folder, str(target), "--overwrite"]) == 0
    assert moejax.load(str(target)).cfg.model_type == "olmoe" and _siblings(str(target)) == ["out"]
    # a checkpoint folder with the user's own files beside the weights is not replaced either
    (target / "notes.txt").write_text("precious")
    (target / "eval").mkdir()
    (target / "eval" / "r.jsonl").write_text("{}\n")
    before = _tree(str(target))
    capsys.readouterr()  # drop what building the reference printed (transformers 5.17 shows a save progress bar)
    assert convert_cli.main(["hf-to-moejax", src, str(target), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "files that are not part of it (eval/, notes.txt)" in err and err.count("\n") == 1, err
    assert _tree(str(target)) == before and _siblings(str(target)) == ["out"]
    with pytest.raises(checkpoint.TargetRefusedError, match="not part of it"):
        checkpoint.check_replaceable(str(target), True)  # what random_checkpoint and train --export call first


def _tree(folder) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): os.path.getsize(os.path.join(d, f))
            for d, _, files in os.walk(folder) for f in files}


@pytest.mark.parametrize("direction", ["hf-to-moejax", "moejax-to-hf"])
def test_overwrite_never_deletes_the_source_or_its_parent(tmp_path, capsys, direction):
    """DST == SRC or DST an ancestor of SRC is refused, not deleted wholesale."""
    parent = tmp_path / "models"
    parent.mkdir()
    src = str(parent / "src")
    if direction == "hf-to-moejax":
        shutil.copytree(get_hf_model("mixtral").folder, src)
    else:
        checkpoint.convert_to_moejax(get_hf_model("mixtral").folder, src)
    (parent / "sibling.txt").write_text("mine")
    before = _tree(str(tmp_path))
    capsys.readouterr()  # building the shared mixtral checkpoint (first use in this worker) prints progress
    for dst, message in ((src, "is the source itself"), (str(parent), "contains the source"),
                         (str(tmp_path), "contains the source"), (src + "/../src", "is the source itself")):
        assert convert_cli.main([direction, src, dst, "--overwrite"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
        assert _tree(str(tmp_path)) == before


def test_convert_accepts_the_default_model_name(tmp_path, capsys):
    out = str(tmp_path / "hf")
    assert convert_cli.main(["moejax-to-hf", "default", out]) == 0
    assert moejax.load(out).cfg.n_experts == moejax.load("default").cfg.n_experts


def test_cli_errors_are_reported_not_raised(tmp_path, capsys):
    src = get_hf_model("mixtral").folder
    assert convert_cli.main(["hf-to-moejax", str(tmp_path / "nope"), str(tmp_path / "o")]) == 1
    assert "does not exist" in capsys.readouterr().err
    # the direction must match the source
    assert convert_cli.main(["moejax-to-hf", src, str(tmp_path / "o")]) == 1
    assert "not a moejax checkpoint" in capsys.readouterr().err
    mj = checkpoint.convert_to_moejax(src, str(tmp_path / "mj"))
    assert convert_cli.main(["hf-to-moejax", mj, str(tmp_path / "o")]) == 1
    assert "already a moejax checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_cli.main(["hf-to-moejax", src, str(tmp_path / "o"), "--dtype", "int8"])
    assert not os.path.exists(tmp_path / "o")


# ----------------------------------------------------------------------------------------------- CLI
def test_cli_end_to_end(tmp_path):
    """``python -m moejax.convert`` and the convert/ wrapper scripts, as subprocesses."""
    src = get_hf_model("phimoe_longrope").folder
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    mj, back = str(tmp_path / "mj"), str(tmp_path / "hf")
    r = subprocess.run([sys.executable, "-m", "moejax.convert", "hf-to-moejax", src, mj, "--dtype", "float32"],
                       capture_output=True, text=True, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and checkpoint.is_moejax_folder(mj)
    r = subprocess.run([sys.executable, os.path.join(REPO, "convert", "moejax_to_hf.py"), mj, back],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    a, b = read_tensors(src), read_tensors(back)
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    r = subprocess.run([sys.executable, os.path.join(REPO, "convert", "hf_to_moejax.py"), src, mj],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path))
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr


# ------------------------------------------------------------------ untrusted headers
def _bad_header(path, header_bytes, n=None, tail=b""):
    import struct

    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes) if n is None else n))
        f.write(header_bytes + tail)


@pytest.mark.parametrize("case, message", [
    ("huge_length", "exceeds the file size"),
    ("list_header", "not a JSON object"),
    ("past_end", "past the file"),
    ("wrong_size", "needs"),
    ("bad_offsets", "invalid data_offsets"),
])
def test_safetensors_reader_does_not_trust_its_header(tmp_path, case, message):
    path = str(tmp_path / "x.safetensors")
    entry = {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}
    if case == "huge_length":
        _bad_header(path, b"{}", n=2**64 - 1)
    elif case == "list_header":
        _bad_header(path, b"[1, 2]")
    elif case == "past_end":
        _bad_header(path, json.dumps({"w": entry}).encode(), tail=b"\0" * 10)
    elif case == "wrong_size":
        _bad_header(path, json.dumps({"w": {**entry, "data_offsets": [0, 32]}}).encode(), tail=b"\0" * 64)
    else:
        _bad_header(path, json.dumps({"w": {**entry, "data_offsets": [64, 0]}}).encode(), tail=b"\0" * 64)
    with pytest.raises(safetensors_io.SafetensorsError, match=message):
        safetensors_io.SafetensorsFile(path)


def test_truncated_shard_and_escaping_index_are_named_errors(tmp_path, capsys):
    src = get_hf_model("olmoe").folder
    cut = tmp_path / "cut"
    shutil.copytree(src, cut)
    shard = cut / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    capsys.readouterr()  # building the fixture model may print progress
    rc = convert_cli.main(["hf-to-moejax", str(cut), str(tmp_path / "o1")])
    err = capsys.readouterr().err
    assert rc == 1 and "model.safetensors" in err and "past the file" in err and err.count("\n") == 1
    escape = tmp_path / "escape"
    shutil.copytree(src, escape)
    keys = safetensors_io.SafetensorsFile(str(escape / "model.safetensors")).keys()
    (escape / "model.safetensors").unlink()  # else the single file is read and the index ignored (transformers' order)
    for target in ("../cut/model.safetensors", str(cut / "model.safetensors")):
        (escape / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: target for k in keys}}))
        rc = convert_cli.main(["hf-to-moejax", str(escape), str(tmp_path / "o2")])
        err = capsys.readouterr().err
        assert rc != 0 and "outside the model folder" in err, err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_model_folder_that_cannot_be_read_says_so(tmp_path, monkeypatch):
    """Without read permission a folder's config.json is invisible: the error is the permission (as root the
    refusal cannot be produced for real, so the listing is made to fail as it would)."""
    folder = tmp_path / "locked"
    folder.mkdir()
    real = os.listdir

    def listdir(path="."):
        if os.fspath(path) == str(folder):
            raise PermissionError(13, "Permission denied", str(folder))
        return real(path)

    monkeypatch.setattr(checkpoint.os, "listdir", listdir)
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot read model folder .*locked: Permission denied"):
        checkpoint.read_hf_config(str(folder))
    monkeypatch.undo()
    with pytest.raises(checkpoint.CheckpointError, match="has no config.json"):
        checkpoint.read_hf_config(str(folder))


def test_a_single_weights_file_wins_over_an_index_as_in_transformers(tmp_path):
    """A folder with both model.safetensors and an index (a re-save over a sharded one) loads the single file,
    as transformers does, not whatever the index's shards hold."""
    src = get_hf_model("qwen3_moe").folder
    folder = tmp_path / "both"
    shutil.copytree(src, folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    ids = [3, 5, 7]
    np.testing.assert_array_equal(moejax.load(str(folder)).forward(ids).logits, moejax.load(src).forward(ids).logits)


def test_the_model_card_and_licence_travel_with_every_conversion(tmp_path, capsys):
    """A converted folder lost README.md (the default model's holds the corpus's share-alike licence),
    LICENSE and training.json: a user shipping an int8 copy shipped it without its terms."""
    src = _copy_hf("qwen3_moe", tmp_path / "hf")
    card = {"README.md": "---\nlicense: apache-2.0\n---\n# a model card \u00e9\n", "LICENSE": "Apache License 2.0\n",
            "training.json": '{"tokens": 1}\n'}
    for name, text in card.items():
        (tmp_path / "hf" / name).write_text(text, encoding="utf-8")
    mj = str(tmp_path / "mj")
    assert convert_cli.main(["hf-to-moejax", src, mj]) == 0
    q8 = str(tmp_path / "q8")
    assert convert_cli.main(["moejax-to-moejax", mj, q8, "--expert-dtype", "int8"]) == 0
    back = str(tmp_path / "back")
    assert convert_cli.main(["moejax-to-hf", q8, back]) == 0
    capsys.readouterr()
    for folder in (mj, q8, back):
        for name, text in card.items():
            assert open(os.path.join(folder, name), encoding="utf-8").read() == text, (folder, name)
    assert convert_cli.main(["moejax-to-moejax", mj, q8, "--overwrite"]) == 0  # the card is the checkpoint's own
    # the default model's card comes along too
    default = str(tmp_path / "default-int8")
    assert convert_cli.main(["moejax-to-moejax", "default", default, "--expert-dtype", "int8"]) == 0
    assert "share-alike" in open(os.path.join(default, "README.md"), encoding="utf-8").read()
    assert os.path.isfile(os.path.join(default, "training.json"))


@pytest.mark.parametrize("key,value", [("logits_scaling", 0), ("embedding_multiplier", "12"),
                                       ("residual_multiplier", -0.2), ("attention_multiplier", float("inf"))])
def test_a_bad_granite_multiplier_is_named(tmp_path, key, value):
    folder = _copy_hf_with("granitemoe", tmp_path / "m", **{key: value})
    with pytest.raises(UnsupportedModelError, match=f"config.json: {key} must be a finite number > 0"):
        moejax.load(folder)


def test_a_fused_granite_tensor_of_the_wrong_shape_is_named(tmp_path):
    """Granite's experts are one [N, 2F, D] tensor per layer: its shape is checked whole, before any slicing."""
    folder = _copy_hf("granitemoeshared", tmp_path / "m")
    key = "model.layers.1.block_sparse_moe.input_linear.weight"
    _rewrite(folder, lambda t: t.__setitem__(key, t[key][:, :-1]))  # one row short: up would lose its last
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)}' has shape \(8, 31, 32\), expected \(8, 32, 32\)"):
        moejax.load(folder)
    folder = _copy_hf("granitemoeshared", tmp_path / "s")
    key = "model.layers.0.shared_mlp.input_linear.weight"
    _rewrite(folder, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=rf"missing tensors: {re.escape(key)}"):
        moejax.load(folder)


def test_a_quantised_hub_checkpoint_is_refused_by_name(tmp_path):
    """DeepSeek-V3's fp8 release (and GPTQ/AWQ folders) declare quantization_config: named, not read as floats."""
    folder = _copy_hf_with("deepseek_v3", tmp_path / "m", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    with pytest.raises(UnsupportedModelError, match=r"quantised \(quantization_config, quant_method 'fp8'\).*bf16 copy"):
        moejax.load(folder)
    # GPT-OSS's MXFP4 release is read (test_mxfp4.py); its config on another family is refused by name
    folder = _copy_hf_with("olmoe", tmp_path / "mx", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(UnsupportedModelError, match=r"quant_method 'mxfp4'.*Mxfp4Config\(dequantize=True\)"):
        moejax.load(folder)


def test_deepseek_v3_multi_token_prediction_layers_are_skipped_and_nothing_else(tmp_path):
    """The hub's DeepSeek-V3 folders carry layer 61, the multi-token-prediction module (num_nextn_predict_layers):
    skipped as transformers skips it; any other stray tensor is still refused."""
    folder = _copy_hf("deepseek_v3", tmp_path / "m")
    n = read_config(folder)["num_hidden_layers"]
    _rewrite(folder, lambda t: t.__setitem__(f"model.layers.{n}.eh_proj.weight", np.zeros((4, 8), np.float32)))
    ref = get_moejax_model("deepseek_v3").forward(IDS).logits
    np.testing.assert_array_equal(moejax.load(folder).forward(IDS).logits, ref)
    _rewrite(folder, lambda t: t.__setitem__("model.layers.0.mlp.gate.stray", np.zeros((2,), np.float32)))
    with pytest.raises(CheckpointError, match=r"not in the deepseek_v3 key table.*model\.layers\.0\.mlp\.gate\.stray"):
        moejax.load(folder)


@pytest.mark.parametrize("factor", [0, 1.5, "half", 0.01])
def test_a_bad_partial_rotary_factor_is_named(tmp_path, factor):
    folder = _copy_hf("glm4_moe", tmp_path / "m")
    cfg = read_config(folder)
    cfg["partial_rotary_factor"] = factor
    cfg.get("rope_parameters", {}).pop("partial_rotary_factor", None)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor"):
        moejax.load(folder)


def test_ernie_keeps_router_and_selection_bias_float32_in_bf16_and_skips_its_mtp_tensors(tmp_path):
    """ERNIE-4.5's hub files hold the router weight and the [1, N] selection bias in float32 (transformers keeps them
    so): loaded as bf16 they stay float32 and exact, export writes them float32 again in their [1, N] shape, and the
    multi-token-prediction tensors (``model.mtp_*``) are skipped, as transformers skips them."""
    src = get_hf_model("ernie4_5_moe").folder
    m = moejax.load(src, dtype="bfloat16")
    ref = read_tensors(src)
    moe = m.params["layers"][1]["moe"]
    assert moe["router"].dtype == moe["score_bias"].dtype == np.float32 and m.params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(moe["router"]).T, ref["model.layers.1.mlp.gate.weight"])
    back = read_tensors(checkpoint.convert_moejax_to_hf(checkpoint.convert_to_moejax(src, str(tmp_path / "mj"),
                                                                                     dtype=jnp.bfloat16),
                                                        str(tmp_path / "hf")))
    for key in ("model.layers.1.mlp.gate.weight", "model.layers.1.mlp.moe_statics.e_score_correction_bias"):
        assert back[key].dtype == np.float32 and back[key].shape == ref[key].shape, key
        np.testing.assert_array_equal(back[key], ref[key])
    assert back["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == ml_dtypes.bfloat16
    folder = _copy_hf("ernie4_5_moe", tmp_path / "m")
    _rewrite(folder, lambda t: t.update({"model.mtp_block.0.self_attn.q_proj.weight": np.zeros((4, 8), np.float32),
                                         "model.mtp_linear_proj.0.weight": np.zeros((4, 8), np.float32)}))
    np.testing.assert_array_equal(moejax.load(folder).forward(IDS).logits, get_moejax_model("ernie4_5_moe").forward(IDS).logits)
    _rewrite(folder, lambda t: t.__setitem__("model.layers.1.mlp.gate.stray", np.zeros((2,), np.float32)))
    with pytest.raises(CheckpointError, match=r"not in the ernie4_5_moe key table.*model\.layers\.1\.mlp\.gate\.stray"):
        moejax.load(folder)


@pytest.mark.parametrize("key, value", [("moe_layer_interval", 0), ("moe_layer_start_index", -1),
                                        ("moe_norm_min", -1.0), ("moe_norm_min", "tiny"), ("use_bias", "yes"),
                                        ("moe_k", 0), ("moe_num_shared_experts", -2)])
def test_a_bad_ernie_moe_field_is_named(tmp_path, key, value):
    folder = _copy_hf_with("ernie4_5_moe", tmp_path / "m", **{key: value})
    with pytest.raises(UnsupportedModelError, match=key):
        moejax.load(folder)


@pytest.mark.parametrize("name, fields", [
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"])),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8, layer_types="sliding_attention")),
    ("dots1", dict(layer_types=["sliding_attention", "chunked_attention"])),
    ("gpt_oss", dict(layer_types=["full_attention"] * 9)),
])
def test_a_bad_layer_types_list_is_named(tmp_path, name, fields):
    """``layer_types`` decides which layers attend through a sliding window: one that does not name one of the two
    kinds for every layer is refused with its value, for every family that reads it (not run with a wrong window)."""
    folder = _copy_hf_with(name, tmp_path / "m", **fields)
    with pytest.raises(UnsupportedModelError, match=r"layer_types must list sliding_attention or full_attention"):
        moejax.load(folder)


@pytest.mark.parametrize("key, value, message", [
    ("moe_topk", [2, 3], r"moe_topk \[2, 3\] differs between layers"),
    ("use_cla", True, "use_cla"),
    ("num_shared_expert", [2, 2], "builds one shared MLP"),
    ("model_type", "hunyuan", "remote-code spelling of Hunyuan-A13B"),
    ("moe_intermediate_size", [24, 24], "differs from intermediate_size"),
    ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "fixed alpha"),
])
def test_hunyuan_fields_moejax_cannot_run_are_named(tmp_path, key, value, message):
    folder = _copy_hf_with("hunyuan_v1_moe", tmp_path / "m", **{key: value})
    with pytest.raises(UnsupportedModelError, match=message):
        moejax.load(folder)


def test_hunyuan_per_layer_lists_are_written_back_as_they_came():
    """moe_topk given per layer (all equal) runs as one K, and export writes the list back."""
    m = get_moejax_model("hunyuan_v1_moe_lists")
    assert m.cfg.top_k == 3 and m.cfg.hf["moe_topk"] == [3, 3, 3]


def test_hunyuan_router_stays_float32_in_bf16():
    """transformers makes Hunyuan's ``gate.wg`` float32 and keeps it so in a bf16 model: so does moejax."""
    m = moejax.load(get_hf_model("hunyuan_v1_moe").folder, dtype="bfloat16")
    assert m.params["layers"][0]["moe"]["router"].dtype == np.float32 and m.params["embed"].dtype == jnp.bfloat16
