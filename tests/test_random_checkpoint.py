"""Random checkpoints at real shapes: every preset's config is read by moejax, the written
folder loads in transformers and in moejax with the same logits (tiny overrides), writing is streaming,
deterministic and atomic, and bad arguments are one-line errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import moejax
from moejax.models.config import UnsupportedModelError, from_hf
from moejax.testing import random_checkpoint as rc

TINY_COMMON = {"vocab_size": 256, "max_position_embeddings": 4096}
TINY = {  # per preset: small dimensions that keep every structural option of the real config
    "mixtral-8x7b": {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "num_local_experts": 4},
    "phi-3.5-moe": {"hidden_size": 256, "intermediate_size": 32, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "num_local_experts": 4,
                    "max_position_embeddings": 131072},  # head_dim 128 as the longrope factors need
    "qwen1.5-moe-a2.7b": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
                          "shared_expert_intermediate_size": 48, "num_attention_heads": 4,
                          "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2},
    "qwen3-30b-a3b": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
                      "num_experts_per_tok": 2},
    "olmoe-1b-7b": {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2},
    "deepseek-v2-lite": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
                         "num_attention_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                         "num_experts_per_tok": 2, "n_shared_experts": 1},
    "moonlight-16b-a3b": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
                          "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
                          "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
                          "num_experts_per_tok": 2},
    "glm-4.5-air": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 2,
                    "pad_token_id": 0, "eos_token_id": 2},
    "granite-3.0-1b-a400m": {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2},
    "dots.llm1": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "num_attention_heads": 4,
                  "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "eos_token_id": 2},
    "hunyuan-a13b": {"hidden_size": 64, "head_dim": 16, "intermediate_size": 32, "moe_intermediate_size": 32,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8, "moe_topk": 2,
                     "eos_token_id": 2, "pad_token_id": 0},
    "ernie-4.5-21b-a3b": {"hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "moe_num_experts": 8, "moe_k": 2,
                          "moe_layer_end_index": 1},
}
EXPECTED = {  # (model_type, layers, routed experts, top-k, hidden): the real models' shapes
    "mixtral-8x7b": ("mixtral", 32, 8, 2, 4096),
    "phi-3.5-moe": ("phimoe", 32, 16, 2, 4096),
    "qwen1.5-moe-a2.7b": ("qwen2_moe", 24, 60, 4, 2048),
    "qwen3-30b-a3b": ("qwen3_moe", 48, 128, 8, 2048),
    "olmoe-1b-7b": ("olmoe", 16, 64, 8, 2048),
    "deepseek-v2-lite": ("deepseek_v2", 27, 64, 6, 2048),
    "granite-3.0-1b-a400m": ("granitemoe", 24, 32, 8, 1024),
    "moonlight-16b-a3b": ("deepseek_v3", 27, 64, 6, 2048),
    "deepseek-v3": ("deepseek_v3", 61, 256, 8, 7168),
    "glm-4.5-air": ("glm4_moe", 46, 128, 8, 4096),
    "granite-3.0-3b-a800m": ("granitemoe", 32, 40, 8, 1536),
    "ernie-4.5-21b-a3b": ("ernie4_5_moe", 28, 64, 6, 2560),
    "dots.llm1": ("dots1", 62, 128, 6, 4096),
    "hunyuan-a13b": ("hunyuan_v1_moe", 32, 64, 8, 4096),
    "gpt-oss-20b": ("gpt_oss", 24, 32, 4, 2880),
    "gpt-oss-120b": ("gpt_oss", 36, 128, 4, 2880),
}


def test_every_preset_is_there_with_the_real_shapes():
    assert rc.presets() == sorted(EXPECTED)
    for name, (model_type, layers, n, k, d) in EXPECTED.items():
        cfg = from_hf(rc.preset_config(name))
        assert (cfg.model_type, cfg.num_layers, cfg.n_experts, cfg.top_k, cfg.hidden_size) == \
            (model_type, layers, n, k, d), name
    olmoe = sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config("olmoe-1b-7b")))
    assert 6.9e9 < olmoe < 6.95e9  # OLMoE-1B-7B: 6.92B parameters
    granite = [sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config(f"granite-3.0-{n}")))
               for n in ("1b-a400m", "3b-a800m")]
    assert 1.3e9 < granite[0] < 1.4e9 and 3.25e9 < granite[1] < 3.35e9  # Granite-3.0 1B-A400M and 3B-A800M
    deepseek = [sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config(n)))
                for n in ("moonlight-16b-a3b", "deepseek-v3")]
    assert 15.9e9 < deepseek[0] < 16.0e9 and 671.0e9 < deepseek[1] < 671.1e9  # without DeepSeek-V3's MTP layer
    glm = sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config("glm-4.5-air")))
    assert 106.8e9 < glm < 106.9e9  # GLM-4.5-Air: "106B", without its MTP layer
    ernie = sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config("ernie-4.5-21b-a3b")))
    assert 21.8e9 < ernie < 21.9e9  # ERNIE-4.5-21B-A3B: "21B", 21.8B counted, without its MTP layer
    dots = sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config("dots.llm1")))
    assert 142.7e9 < dots < 142.8e9  # dots.llm1: "142B"
    hunyuan = sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(rc.preset_config("hunyuan-a13b")))
    assert 80.3e9 < hunyuan < 80.4e9  # Hunyuan-A13B: "80B"


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_preset_loads_in_transformers_and_moejax_with_the_same_logits(name, tmp_path):
    from transformers import AutoModelForCausalLM

    config = rc.with_overrides(rc.preset_config(name), 2, {**TINY_COMMON, **TINY[name]}, "float32")
    folder = rc.write_checkpoint(config, str(tmp_path / name), dtype="float32", seed=1, std=0.3,
                                 shard_bytes=200_000)  # several shards and an index
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    m = moejax.load(folder)
    ids = np.random.default_rng(0).integers(0, 256, 12)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)[None]).logits[0].numpy()
    got = m.forward(ids).logits
    scale = float(np.abs(ref).max())
    assert scale > 0.1  # std 0.3: logits large enough for the comparison to mean something
    np.testing.assert_allclose(got, ref, atol=2e-4 * scale, rtol=0)


def test_writing_is_deterministic_shard_independent_and_refuses_to_clobber(tmp_path, capsys):
    argv = ["olmoe-1b-7b", str(tmp_path / "a"), "--layers", "1", "--dtype", "bfloat16", "--seed", "3",
            *[f"--set={k}={v}" for k, v in {**TINY_COMMON, **TINY["olmoe-1b-7b"]}.items()]]
    assert rc.main(argv) == 0
    assert "note:" not in capsys.readouterr().err  # every override names a key of the preset
    assert rc.main([*argv[:1], str(tmp_path / "b"), *argv[2:], "--shard-gb", "0.00005", "--set", "hiden_size=32"]) == 0
    assert "note: --set hiden_size: the olmoe-1b-7b config has no such key" in capsys.readouterr().err
    a, b = moejax.load(str(tmp_path / "a")), moejax.load(str(tmp_path / "b"))
    assert a.fingerprint == b.fingerprint and a.params["embed"].dtype == np.dtype("bfloat16")
    assert json.load(open(tmp_path / "a" / "config.json"))["num_hidden_layers"] == 1
    capsys.readouterr()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for bad, message in ((["nope", str(tmp_path / "x")], "unknown preset"),
                         ([*argv[:1], str(tmp_path / "a")], "already exists"),
                         ([*argv[:1], str(tmp_path / "mine"), "--overwrite"], "not a checkpoint folder"),
                         ([*argv[:1], str(tmp_path / "x"), "--layers", "99"], "--layers 99"),
                         ([*argv[:1], str(tmp_path / "x"), "--set", "oops"], "expected key=value")):
        assert rc.main(bad) != 0
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and err.count("\n") == 1, (bad, err)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "mine"]  # nothing half-written left behind


def test_streaming_writer_holds_no_tensor_whole(monkeypatch, tmp_path):
    """The chunked generator never produces more than CHUNK elements at once."""
    monkeypatch.setattr(rc, "CHUNK", 1000)
    sizes = []
    real = rc.tensor_chunks

    def spy(*args, **kw):
        for part in real(*args, **kw):
            sizes.append(part.size)
            yield part

    monkeypatch.setattr(rc, "tensor_chunks", spy)
    config = rc.with_overrides(rc.preset_config("olmoe-1b-7b"), 1, {**TINY_COMMON, **TINY["olmoe-1b-7b"]})
    rc.write_checkpoint(config, str(tmp_path / "m"))
    assert max(sizes) == 1000 and sum(sizes) == sum(int(np.prod(s)) for _, s, _ in rc.tensor_plan(config))


def test_longrope_factors_of_another_rotary_size_are_named():
    """phi-3.5-moe shrunk with --set head_dim=8 kept its 64 long/short factors: a numpy broadcast error."""
    with open(os.path.join(os.path.dirname(rc.__file__), "presets", "phi-3.5-moe.json")) as f:
        hf = json.load(f)
    from_hf(hf)
    with pytest.raises(UnsupportedModelError, match="short_factor has 64 values; the rotary dimension 8 needs 4"):
        from_hf({**hf, "head_dim": 8})


@pytest.mark.parametrize("name, inner", [("qwen3-30b-a3b", "q_norm"), ("olmoe-1b-7b", "k_norm"),
                                         ("moonlight-16b-a3b", "kv_a_layernorm"), ("phi-3.5-moe", None)])
def test_every_norm_is_one_and_its_bias_zero(name, inner):
    """Norm weights are written 1 (biases 0), the per-head q/k norms and MLA's latent norms included: drawn like the
    matrices (N(0, 0.02²)) they scaled q·k by ~4e-4 and left the attention of every random checkpoint nearly uniform."""
    plan = rc.tensor_plan(rc.with_overrides(rc.preset_config(name), 2))
    norms = {key: kind for key, _, kind in plan if ".norm." in key or key.endswith(("norm.weight", "norm.bias"))}
    assert norms and all(kind == ("scale" if key.endswith(".weight") else "shift") for key, kind in norms.items())
    assert inner is None or inner in {k.split(".")[-2] for k in norms}
    assert all(kind == "random" for key, _, kind in plan if key not in norms)
