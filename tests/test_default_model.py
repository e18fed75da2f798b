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
from moejax.base import textproc
from moejax.models import assets, checkpoint
from moejax.runtime import api
from moejax.evaluation.tasks import common

from conftest import with_fusion_emitters

MAX_BYTES = 96 * 1024 * 1024  # under PyPI's default 100 MB file limit, with the package around it


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@pytest.fixture(scope="module", autouse=True)
def shipped_default():
    """Here "default" is the shipped model: conftest points MOEJAX_DEFAULT_MODEL at its small predecessor for
    the rest of the suite (this module's CLI subprocesses inherit the environment without it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(assets.DEFAULT_MODEL_ENV, raising=False)
        yield


@pytest.fixture(scope="module")
def default(shipped_default):
    return moejax.load("default")


def test_moejax_default_model_names_what_default_stands_for(tmp_path, monkeypatch):
    assert assets.resolve_model_path("default") == assets.DEFAULT_MODEL_DIR
    small = os.path.join(os.path.dirname(__file__), "data", "cpu-default-model")
    monkeypatch.setenv(assets.DEFAULT_MODEL_ENV, small)
    assert assets.resolve_model_path("default") == small and moejax.load("default").cfg.n_experts == 32
    monkeypatch.setenv(assets.DEFAULT_MODEL_ENV, str(tmp_path / "missing"))
    with pytest.raises(checkpoint.CheckpointError, match="MOEJAX_DEFAULT_MODEL=.*is not a folder"):
        moejax.load("default")
    r = subprocess.run([sys.executable, "-m", "moejax.generate", "--max-new-tokens", "2"], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode != 0 and "MOEJAX_DEFAULT_MODEL" in r.stderr and "Traceback" not in r.stderr


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


@pytest.mark.numerics
def test_right_padding_never_reaches_the_real_tokens(default):
    """A causal pass right-padded (common.Stream pads to a multiple of 64) leaves the
    real tokens' logits as they are up to kernel rounding: checked on a float32 copy of the default model,
    where rounding is ~1e-6. (In bf16, XLA:CPU's shape-dependent matmul kernels round 1 ulp differently and
    near-tied top-k choices can flip, so padded and unpadded bf16 passes are close, not equal.)"""
    rng = np.random.default_rng(0)
    ids = rng.integers(5, default.cfg.vocab_size, 55)
    f32 = api.Model(jax.tree.map(lambda x: x.astype(jnp.float32), default.params), default.cfg)
    padded = np.zeros(64, int)
    padded[:55] = ids
    np.testing.assert_allclose(f32.forward(padded).logits[:55], f32.forward(ids).logits, atol=1e-4, rtol=1e-4)
    assert common.padded_length(55, 1024, default.cfg.rope_long_after) == 64
    assert common.padded_length(3990, 8192, 4000) == 4000  # longrope: never across the long-factor switch
    assert common.padded_length(4010, 8192, 4000) == 4032 and common.padded_length(1000, 1000, 10**9) == 1000


def test_generate_with_no_arguments():
    r = subprocess.run([sys.executable, "-m", "moejax.generate", "--max-new-tokens", "24"], capture_output=True,
                       text=True, timeout=600, env=with_fusion_emitters(dict(os.environ, JAX_PLATFORMS="cpu")))
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


def _bench(name: str):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_side_by_side_bench_summarises_fronts_and_goals():
    """bench/bench_default_model.py (the default model's side-by-side): per method, the lowest miss rate within each
    perplexity bound of original routing at C = N/2, the Pareto-optimal points, and the goals."""
    bench = _bench("bench_default_model")

    def rec(kind, miss, ppl, capacity=16, method="forward", eviction="lru"):
        return {"routing": {"kind": kind}, "method": method, "miss_rate": miss, "ppl": ppl,
                "cache": {"capacity": capacity, "eviction": eviction}}

    records = [rec("original", 0.44, 100.0), rec("original", 0.7, 100.0, capacity=8),
               rec("original", 0.21, 100.0, method="replay", eviction="belady"),
               rec("cache-prior", 0.44, 100.0), rec("cache-prior", 0.30, 100.9), rec("cache-prior", 0.20, 104.0),
               rec("cache-prior", 0.25, 106.0),  # dominated by (0.20, 104.0)
               rec("max-rank", 0.35, 100.5), rec("max-rank", 0.33, 112.0), rec("max-rank", 0.05, 50.0, capacity=8)]
    s = bench.front_summary(records, 16)
    assert s["original"] == {"ppl": 100.0, "miss_rate": 0.44} and s["belady_miss_rate"] == 0.21
    cp = s["methods"]["cache-prior"]
    assert cp["lowest_miss_within"] == {"+1%": 0.30, "+5%": 0.20, "+10%": 0.20}
    assert cp["front"] == [[0.20, 104.0], [0.30, 100.9], [0.44, 100.0]] and cp["points"] == 4
    assert s["methods"]["max-rank"]["lowest_miss_within"] == {"+1%": 0.35, "+5%": 0.35, "+10%": 0.35}
    assert "cumsum" not in s["methods"]
    with pytest.raises(Exception, match="no original-routing pass at C = 4"):
        bench.front_summary(records, 4)
    quality = {"ppl_word": 150.0, "normalized_entropy": [0.85, 0.97], "dead_experts": 0}
    assert bench.goals(quality) == {"word_ppl": True, "entropy": True, "no_dead_expert": True}
    assert bench.goals(dict(quality, ppl_word=150.1, normalized_entropy=[0.99], dead_experts=1)) == {
        "word_ppl": False, "entropy": False, "no_dead_expert": False}
