"""The embedded default model: loads by name, generates with no arguments, fits the size budget, and
exports to a Hugging Face folder that transformers loads with the same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from moejax import api, assets, checkpoint, model, textproc

MAX_BYTES = 32 * 1024 * 1024


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@pytest.fixture(scope="module")
def default():
    return moejax.load("default")


def test_default_model_is_granular_and_small(default):
    cfg = default.cfg
    assert cfg.model_type == "qwen3_moe"
    assert cfg.n_experts >= 32 and 4 <= cfg.top_k <= 8
    assert default.tokenizer is not None and cfg.vocab_size >= 8000
    assert _folder_bytes(assets.DEFAULT_MODEL_DIR) <= MAX_BYTES
    assert textproc.is_wikitext_style(default.generation_config)


def test_default_model_uses_its_experts(default):
    ids = default.encode("The game was released in Japan in 2011 and sold well in its first week of sales .")
    out = default.forward(ids)
    assert np.isfinite(out.logits).all()
    for layer in range(default.cfg.n_moe_layers):  # routing is spread, no collapse onto a few experts
        assert len(np.unique(out.experts[layer])) > default.cfg.n_experts // 2


def test_teacher_forced_pass_does_not_depend_on_the_padding(default):
    """Reliability part 1. XLA:CPU's matmul library picks its kernel from the shape, so one token computed
    in passes of different lengths can round differently (on AVX2 a bf16 model's logits moved by 0.02
    between a 55- and a 64-token pass). api.forward therefore computes every pass at its bucket length
    (api.forward_length): within a bucket the real tokens are bit-identical whatever follows them, and a
    float32 copy shows the padding itself never reaches them (only kernel rounding, ~1e-6, differs)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(5, default.cfg.vocab_size, 64)
    assert api.forward_length(55, 1024) == api.forward_length(64, 1024) == 64
    short, full = default.forward(ids[:55]), default.forward(ids)
    np.testing.assert_array_equal(short.logits, full.logits[:55])
    np.testing.assert_array_equal(short.experts, full.experts[:, :55])
    f32 = api.Model(jax.tree.map(lambda x: x.astype(jnp.float32), default.params), default.cfg)
    unpadded = jax.jit(lambda p, t: model.forward(p, default.cfg, t).logits)(f32.params, ids[:55])
    np.testing.assert_allclose(f32.forward(ids[:55]).logits, unpadded, atol=1e-4, rtol=1e-4)


def test_generate_with_no_arguments():
    r = subprocess.run([sys.executable, "-m", "moejax.generate", "--max-new-tokens", "24"], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert len(words) >= 10 and r.stdout.startswith("The history of the")
    assert " @-@ " not in r.stdout  # WikiText spacing undone for display


def test_exports_to_hf_and_transformers_agrees(default, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = checkpoint.convert_moejax_to_hf(assets.DEFAULT_MODEL_DIR, str(tmp_path / "hf"))
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_moe"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = default.encode("In 1998 , the band released its second album")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = moejax.load(assets.DEFAULT_MODEL_DIR, dtype="float32").forward(ids).logits
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=1e-3)
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.95
