"""WikiText perplexity: chunking, hand-checked NLL, per-word / per-byte figures, cache-aware routing."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import VOCAB, get_hf_model

import moejax
from moejax import evaluate, routing, simulate

TEXT = (" = Valkyria = \n\n The game began development in 2010 , carrying over a large portion of the work . "
        "It was released in January 2011 in Japan . \n\n The music was composed by Hitoshi Sakimoto , "
        "who had also worked on the previous games . \n\n")


def _word_tokenizer(folder: str, text: str) -> None:
    """A word-level tokenizer.json small enough for the tiny test vocabulary (ids < VOCAB)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    words = sorted(set(text.split()))
    vocab = {"<bos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(folder, "tokenizer.json"))


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lm") / "model")
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    _word_tokenizer(folder, TEXT)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["bos_token_id"] = 0
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return moejax.load(folder)


def test_chunks_cover_every_token_once_with_bos():
    ids = np.arange(10, 33)
    chunks = evaluate.chunk_tokens(ids, context=8, bos=0)
    assert all(c[0] == 0 and len(c) <= 8 for c in chunks)
    np.testing.assert_array_equal(np.concatenate([c[1:] for c in chunks]), ids)
    no_bos = evaluate.chunk_tokens(ids, context=8, bos=None)
    np.testing.assert_array_equal(np.concatenate(no_bos), ids)
    with pytest.raises(ValueError, match="context"):
        evaluate.chunk_tokens(ids, context=1, bos=0)


def test_token_nll_by_hand():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]))
    ids = np.array([0, 1, 2])
    np.testing.assert_allclose(evaluate.token_nll(logits, ids), [-math.log(0.25), -math.log(0.1)])


def test_expert_usage_entropy_by_hand():
    usage = evaluate.expert_usage(np.array([[5, 5, 0, 0], [1, 1, 1, 1]]))
    np.testing.assert_allclose(usage["entropy_bits"], [1.0, 2.0])
    assert usage["dead_experts"] == 2 and usage["entropy_max_bits"] == 2.0
    np.testing.assert_allclose(usage["share"][0], [0.5, 0.5, 0, 0])


def test_perplexity_matches_a_direct_computation(lm):
    res = evaluate.wikitext_perplexity(lm, TEXT, context=16)
    ids = np.asarray(lm.tokenizer.encode(TEXT, add_special_tokens=False))
    total, count = 0.0, 0
    for chunk in evaluate.chunk_tokens(ids, 16, 0):
        out = lm.forward(chunk)
        total += evaluate.token_nll(out.logits, chunk).sum()
        count += len(chunk) - 1
    assert res["predicted_tokens"] == count == len(ids)
    assert math.isclose(res["ppl"], math.exp(total / count), rel_tol=1e-9)
    assert math.isclose(res["ppl_word"], math.exp(total / len(TEXT.split())), rel_tol=1e-9)
    assert math.isclose(res["bits_per_byte"], total / math.log(2) / len(TEXT.encode()), rel_tol=1e-9)


def test_lambda_zero_equals_plain_perplexity_and_policies_report_misses(lm):
    plain = evaluate.wikitext_perplexity(lm, TEXT, context=16)
    cache = simulate.CacheConfig("0.5")
    zero = evaluate.wikitext_perplexity(lm, TEXT, 16, routing=routing.make_policy("cache-prior", 2, lam=0.0),
                                        cache=cache)
    assert zero["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)
    full = evaluate.wikitext_perplexity(lm, TEXT, 16, routing=routing.make_policy("cache-prior", 2, lam=1.0),
                                        cache=cache)
    assert full["miss_rate"] < zero["miss_rate"]
    for key in ("miss_rate", "lifetime", "bytes_per_token"):
        assert key in zero


def test_evaluate_cli(lm, tmp_path):
    data = tmp_path / "test.txt"
    data.write_text(TEXT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "moejax.evaluate", "--model", lm.path, "--data", str(data),
                        "--context", "16", "--cache-size", "4", "--json"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["ppl"] > 1 and 0 <= res["miss_rate"] <= 1
    bad = subprocess.run([sys.executable, "-m", "moejax.evaluate", "--model", lm.path, "--data",
                          str(tmp_path / "missing.txt")], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "missing.txt" in bad.stderr
