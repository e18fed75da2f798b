"""GPT-OSS's MXFP4 release: decoding as transformers does, loading, conversion and paging from its files."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import moejax
from moejax.models import checkpoint, layout, mxfp4, weights
from moejax.models.checkpoint import CheckpointError
from moejax.runtime import expert_store, offload
from moejax.runtime.simulate import CacheConfig
from moejax.testing import random_checkpoint as rc

TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 32, "num_local_experts": 8,
        "num_experts_per_tok": 2, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "sliding_window": 4, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}
IDS = np.random.default_rng(0).integers(3, 256, 12)


def _hf_decode(blocks: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """transformers' own decoding, ``[..., rows, in]`` (it returns the [in, rows] transpose)."""
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    out = _convert_moe_packed_tensors(torch.from_numpy(blocks[None]), torch.from_numpy(scales[None]), dtype=dtype)
    return out[0].T.float().numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_code_and_scale_decodes_as_transformers_decodes(dtype):
    """All 256 bytes under scales across E8M0's range (bfloat16's subnormals, overflow to inf, 255) and the
    ones real weights use: the integer fast path and the float path agree with transformers bit for bit."""
    scales = np.array([0, 1, 2, 3, 100, 119, 126, 127, 128, 135, 250, 252, 253, 254, 255], np.uint8)
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (len(scales), 1, 1))  # [rows, G=16, 16]
    rows = np.repeat(scales[:, None], 16, axis=1)  # one scale a row: safe rows and unsafe rows
    ours = mxfp4.decode(blocks, rows, np.float32 if dtype == torch.float32 else ml_dtypes.bfloat16)
    np.testing.assert_array_equal(ours.astype(np.float32), _hf_decode(blocks, rows, dtype))
    safe = (mxfp4.SAFE_SCALES[0] <= scales) & (scales <= mxfp4.SAFE_SCALES[1])
    np.testing.assert_array_equal(mxfp4.decode(blocks[safe], rows[safe]).astype(np.float32),
                                  _hf_decode(blocks[safe], rows[safe], torch.float32))  # the integer path


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 9), groups=st.integers(1, 5),
       low=st.integers(2, 252), width=st.integers(0, 30))
def test_decoded_weights_encode_back_to_themselves(seed, rows, groups, low, width):
    """Every decoded block re-encodes exactly (the OCP scale rule and round to nearest lose nothing on numbers
    MXFP4 holds), and ``take`` reads single weights as ``decode`` does."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, groups, 16), dtype=np.uint8)
    scales = rng.integers(low, min(low + width, 252) + 1, (rows, groups), dtype=np.uint8)
    w = mxfp4.decode(blocks, scales, np.float32)
    np.testing.assert_array_equal(mxfp4.decode(*mxfp4.encode(w), np.float32), w)
    r, c = rng.integers(0, rows, 50), rng.integers(0, groups * 32, 50)
    np.testing.assert_array_equal(mxfp4.take(blocks, scales, r, c), w[r, c])


def test_decoding_into_a_strided_destination_and_chunked_rows(monkeypatch):
    """GPT-OSS's gate and up rows alternate in one tensor: decoded straight into the serving layout's gate rows
    then up rows (a strided view), in chunks of rows, the same numbers as decoding the rows one by one."""
    monkeypatch.setattr(mxfp4, "CHUNK_BYTES", 100)  # several chunks
    rng = np.random.default_rng(1)
    f, g = 7, 3
    blocks = rng.integers(0, 256, (2 * f, g, 16), dtype=np.uint8)
    scales = rng.integers(110, 130, (2 * f, g), dtype=np.uint8)
    out = np.empty((2 * f, g * 32), ml_dtypes.bfloat16)
    mxfp4.decode_into(blocks.reshape(f, 2, g, 16), scales.reshape(f, 2, g), out.reshape(2, f, -1).transpose(1, 0, 2))
    np.testing.assert_array_equal(out[:f], mxfp4.decode(blocks[0::2], scales[0::2]))
    np.testing.assert_array_equal(out[f:], mxfp4.decode(blocks[1::2], scales[1::2]))
    with pytest.raises(mxfp4.Mxfp4Error, match="do not match"):
        mxfp4.decode(blocks, scales[:, :2])


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A tiny GPT-OSS in the hub release's form (MXFP4 experts, quantization_config), in several shards."""
    config = rc.with_overrides(rc.preset_config("gpt-oss-20b"), 2, TINY, "float32")
    return rc.write_checkpoint(config, str(tmp_path_factory.mktemp("mx") / "oss"), dtype="float32", seed=2,
                               std=0.3, shard_bytes=100_000, mxfp4=True)


def test_the_release_loads_with_the_logits_transformers_gives(release):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32).eval()  # dequantised on the CPU
    with torch.no_grad():
        ref = hf(torch.tensor(IDS)[None]).logits[0].numpy()
    m = moejax.load(release)
    assert json.load(open(os.path.join(release, "config.json")))["quantization_config"]["quant_method"] == "mxfp4"
    np.testing.assert_allclose(m.forward(IDS).logits, ref, atol=2e-5 * float(np.abs(ref).max()), rtol=0)
    tree, _ = checkpoint.open_params(release)
    stack = tree["layers"][1]["moe"]["up"]
    assert isinstance(stack, weights.Mxfp4ExpertStack) and stack.shape == (8, 64, 32)
    assert stack.stored_expert_nbytes == 32 * 2 * 16 + 32 * 2  # 4.25 bits a weight: blocks + scales
    idx = np.random.default_rng(3).integers(0, int(np.prod(stack.shape)), 200)
    np.testing.assert_array_equal(stack.take_flat(idx), stack.read().reshape(-1)[idx])  # fingerprints' reads


def test_the_release_converts_to_floating_point_folders(release, tmp_path):
    """To a moejax folder (decoded experts) and back to a Hugging Face folder that says nothing of MXFP4 any more,
    same logits throughout; to int8 experts, the int8 of the decoded weights."""
    from transformers import AutoModelForCausalLM

    ref = moejax.load(release).forward(IDS).logits
    mj = checkpoint.convert_to_moejax(release, str(tmp_path / "mj"))
    np.testing.assert_array_equal(moejax.load(mj).forward(IDS).logits, ref)
    back = checkpoint.convert_moejax_to_hf(mj, str(tmp_path / "hf"))
    assert "quantization_config" not in json.load(open(os.path.join(back, "config.json")))
    hf = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(IDS)[None]).logits[0].numpy(), ref,
                                   atol=2e-5 * float(np.abs(ref).max()), rtol=0)
    q8 = checkpoint.convert_to_moejax(release, str(tmp_path / "q8"), expert_dtype="int8")  # the decoded, quantised
    q8_of_decoded = checkpoint.convert_to_moejax(mj, str(tmp_path / "q8d"), expert_dtype="int8")
    np.testing.assert_array_equal(moejax.load(q8).forward(IDS).logits, moejax.load(q8_of_decoded).forward(IDS).logits)


def test_the_release_pages_from_its_files_as_from_memory(release):
    """A flash store reads a page's gate and up as one block of 4.25-bit codes and decodes it into the serving
    layout on the host: the pages equal the model loaded whole, and offloaded generation gives the simulation's
    tokens from the files and from host memory, the flash store moving the stored bytes."""
    m = moejax.load(release, offload="flash")
    store = expert_store.ExpertStore(m.params, m.cfg, "flash")
    assert store.mxfp4_pair and store.reads_serving and store.expert_bytes == 3 * 32 * 2 * 16 + 3 * 32 * 2
    whole = moejax.load(release).params["layers"][1]["moe"]["experts"]
    for e in (0, 5, 7):
        gate_up, down = store.get(1, e, serving=True)
        np.testing.assert_array_equal(gate_up, np.asarray(layout.dense(whole.gate_up[e])))
        np.testing.assert_array_equal(down, np.asarray(layout.dense(whole.down[e])))
        plain = store.get(1, e)  # [out, in] per matrix, flipped on the device
        np.testing.assert_array_equal(np.concatenate([plain["gate"], plain["up"]]), gate_up)
    cc = CacheConfig(size="3", prefetch=1.0)
    prompt = [int(i) for i in IDS[:6]]
    ref = m.generate(prompt, 6, routing="cache-prior", cache=cc, stop_at_eos=False)
    for where in ("flash", "host"):
        off = m.generate(prompt, 6, routing="cache-prior", cache=cc, stop_at_eos=False,
                         offload=offload.OffloadConfig(store=where))
        assert off.token_ids == ref.token_ids, where
        stats = off.stats["offload"]
        assert stats["bytes_moved"] > 0
        if where == "flash":
            assert stats["expert_bytes"] == store.expert_bytes


def test_blocks_that_are_not_bytes_are_named(release, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = shutil.copytree(release, str(tmp_path / "bad"))
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]
    key = "model.layers.0.mlp.experts.down_proj_scales"
    path = os.path.join(folder, index[key])
    tensors = dict(load_file(path))
    tensors[key] = tensors[key].astype(np.int8)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{key}' .* stored as int8; MXFP4 blocks and scales are uint8"):
        moejax.load(folder)



def _nan_scales(release: str, folder: str, experts=slice(0, 1)) -> str:
    """A copy of the release whose layer-0 gate_up scales of ``experts`` are E8M0's NaN (byte 255), in place."""
    import shutil

    from moejax.models import safetensors_io

    shutil.copytree(release, folder)
    key = "model.layers.0.mlp.experts.gate_up_proj_scales"
    name = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"][key]
    path = os.path.join(folder, name)
    f = safetensors_io.SafetensorsFile(path)
    start, _ = f.byte_range(key)
    per_expert = int(np.prod(f.shape(key)[1:]))
    with open(path, "r+b") as out:
        for e in range(f.shape(key)[0])[experts]:
            out.seek(start + e * per_expert)
            out.write(b"\xff")
    return path


def test_nan_scales_are_a_damaged_file_named_without_warnings(release, tmp_path):
    """E8M0's NaN scale (255) decodes to infinities whatever the dtype: loading, converting and paging refuse the
    file in one line naming it and the tensor (a Failure: exit status 1), with no numpy warning on the way."""
    import warnings

    from moejax.base.errors import Failure

    folder = str(tmp_path / "nan")
    path = _nan_scales(release, folder, slice(None))
    message = rf"{path}: tensor 'model.layers.0.mlp.experts.gate_up_proj_scales': MXFP4 scales that are not finite"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(mxfp4.NonFiniteScaleError, match=message) as e:
            moejax.load(folder)
        assert isinstance(e.value, Failure) and "\n" not in str(e.value)
        with pytest.raises(mxfp4.NonFiniteScaleError, match=message):
            checkpoint.convert_to_moejax(folder, str(tmp_path / "out"))
        assert not os.path.exists(tmp_path / "out")
        tree, _ = checkpoint.open_params(folder)
        with pytest.raises(mxfp4.NonFiniteScaleError, match=message):
            tree["layers"][0]["moe"]["gate"].take_flat(np.arange(4))  # fingerprints' sampled reads
        m = moejax.load(folder, offload="flash")  # the files are the store: refused when a page is read
        with pytest.raises(mxfp4.NonFiniteScaleError, match=message):
            m.generate([int(i) for i in IDS[:4]], 2, stop_at_eos=False)
        # decoding itself stays transformers' (255: 2^128), without overflow warnings
        assert np.isinf(mxfp4.decode(np.full((1, 1, 16), 0x77, np.uint8), np.full((1, 1), 255, np.uint8),
                                     np.float32)).all()


def test_mxfp4_is_gpt_oss_only_in_random_checkpoints(tmp_path):
    config = rc.with_overrides(rc.preset_config("olmoe-1b-7b"), 1, {
        "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 256})
    with pytest.raises(ValueError, match="--mxfp4 writes GPT-OSS's release format; this is a olmoe model"):
        rc.write_checkpoint(config, str(tmp_path / "x"), mxfp4=True)
