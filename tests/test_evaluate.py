"""WikiText perplexity: chunking, hand-checked NLL, per-word / per-byte figures, cache-aware routing."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from support.hf_models import VOCAB, get_hf_model

import moejax
from moejax.models import gating
from moejax.experts import routing
from moejax.runtime import offload, simulate
from moejax.evaluation import evaluate, perplexity, sweep

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


def make_word_model(folder: str, dtype=None):
    """The tiny Qwen3-MoE test model (8 experts, top-2, 2 layers) with a word tokenizer for TEXT and BOS 0."""
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    _word_tokenizer(folder, TEXT)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["bos_token_id"] = 0
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return moejax.load(folder, dtype)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return make_word_model(str(tmp_path_factory.mktemp("lm") / "model"))


def test_chunks_cover_every_token_once_with_bos():
    ids = np.arange(10, 33)
    chunks = perplexity.chunk_tokens(ids, context=8, bos=0)
    assert all(c[0] == 0 and len(c) <= 8 for c in chunks)
    np.testing.assert_array_equal(np.concatenate([c[1:] for c in chunks]), ids)
    no_bos = perplexity.chunk_tokens(ids, context=8, bos=None)
    np.testing.assert_array_equal(np.concatenate(no_bos), ids)
    with pytest.raises(ValueError, match="context"):
        perplexity.chunk_tokens(ids, context=1, bos=0)


def test_token_nll_by_hand():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]))
    ids = np.array([0, 1, 2])
    np.testing.assert_allclose(perplexity.token_nll(logits, ids), [-math.log(0.25), -math.log(0.1)])


def test_expert_usage_entropy_by_hand():
    usage = perplexity.expert_usage(np.array([[5, 5, 0, 0], [1, 1, 1, 1]]))
    np.testing.assert_allclose(usage["entropy_bits"], [1.0, 2.0])
    assert usage["dead_experts"] == 2 and usage["entropy_max_bits"] == 2.0
    np.testing.assert_allclose(usage["share"][0], [0.5, 0.5, 0, 0])


def test_consecutive_reuse_by_hand():
    # one layer, K = 2: token 1 keeps expert 3 of token 0; token 2 shares nothing; token 3 was pruned to one
    # expert (-1 = none), which token 2 also chose
    experts = np.array([[[3, 1], [3, 0], [2, 5], [5, -1]]])
    np.testing.assert_array_equal(perplexity.reuse_counts(experts), [[2, 5, 2, 3]])
    usage = perplexity.expert_usage(np.array([[1, 1, 1, 2, 0, 2]]), perplexity.reuse_counts(experts))
    assert usage["reuse"] == [pytest.approx(2 / 5)] and usage["reuse_any"] == [pytest.approx(2 / 3)]
    # independent routing with these shares: K' = 5/3 experts per token x sum of squared shares
    shares = np.array([1, 1, 1, 2, 0, 2]) / 7
    assert usage["reuse_independent"] == [pytest.approx(5 / 3 * (shares ** 2).sum())]
    assert perplexity.reuse_counts(experts[:, :1]).tolist() == [[0, 0, 0, 0]]  # one token: no pairs
    assert "reuse" not in perplexity.expert_usage(np.array([[1, 1]]), np.zeros((1, 4), np.int64))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 4), st.integers(0, 2 ** 31 - 1))
def test_consecutive_reuse_equals_a_loop_over_token_pairs(layers, tokens, k, seed):
    rng = np.random.default_rng(seed)
    n = k + 3
    experts = np.stack([np.stack([rng.permutation(n)[:k] for _ in range(tokens)]) for _ in range(layers)])
    experts[rng.random(experts.shape) < 0.2] = -1  # pruned choices
    want = np.zeros((layers, 4), np.int64)
    for layer in range(layers):
        for t in range(1, tokens):
            cur = {int(x) for x in experts[layer, t] if x >= 0}
            shared = len(cur & {int(x) for x in experts[layer, t - 1] if x >= 0})
            want[layer] += [shared, len(cur), shared > 0, 1]
    np.testing.assert_array_equal(perplexity.reuse_counts(experts), want)


def test_perplexity_matches_a_direct_computation(lm):
    res = perplexity.wikitext_perplexity(lm, TEXT, context=16)
    ids = np.asarray(lm.tokenizer.encode(TEXT, add_special_tokens=False))
    total, count = 0.0, 0
    for chunk in perplexity.chunk_tokens(ids, 16, 0):
        out = lm.forward(chunk)
        total += perplexity.token_nll(out.logits, chunk).sum()
        count += len(chunk) - 1
    assert res["predicted_tokens"] == count == len(ids)
    # the same sums on the CPU; on a GPU the batched pass and the chunk-by-chunk one are different programs,
    # whose products round differently (5.5e-9 apart on an H200)
    tol = 1e-9 if jax.default_backend() == "cpu" else 1e-6
    assert math.isclose(res["ppl"], math.exp(total / count), rel_tol=tol)
    assert math.isclose(res["ppl_word"], math.exp(total / len(TEXT.split())), rel_tol=tol)
    assert math.isclose(res["bits_per_byte"], total / math.log(2) / len(TEXT.encode()), rel_tol=tol)


def test_lambda_zero_equals_plain_perplexity_and_policies_report_misses(lm):
    plain = perplexity.wikitext_perplexity(lm, TEXT, context=16)
    cache = simulate.CacheConfig("0.5")
    zero = perplexity.wikitext_perplexity(lm, TEXT, 16, routing=routing.make_policy("cache-prior", 2, lam=0.0),
                                        cache=cache)
    assert zero["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)
    full = perplexity.wikitext_perplexity(lm, TEXT, 16, routing=routing.make_policy("cache-prior", 2, lam=1.0),
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
    assert bad.returncode == 1 and "missing.txt" in bad.stderr  # a missing input file: a failure


def _data(tmp_path, repeat: int = 1):
    path = tmp_path / "test.txt"
    path.write_text(TEXT * repeat)
    return str(path)


def test_cli_sweep_json_results_end_to_end(lm, tmp_path, capsys):
    """The command line (``python -m moejax.evaluate`` is ``main``; test_evaluate_cli runs it as a process): a
    3-point λ sweep printed as JSON lines and appended to a results file; the rerun computes nothing and
    prints the same records from the file."""
    results = tmp_path / "lam.jsonl"
    argv = ["--model", lm.path, "--data", _data(tmp_path), "--context", "16", "--max-tokens", "45",
            "--sweep", "lam=0:1:3", "--cache-size", "4", "--results", str(results), "--json"]
    assert evaluate.main(argv) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["sweep"] for p in printed] == [{"lam": 0.0}, {"lam": 0.5}, {"lam": 1.0}]
    for rec in printed:
        assert rec["routing"]["kind"] == "cache-prior" and rec["routing"]["top_j"] == 1  # K = 2 -> J = 1
        assert rec["cache"]["capacity"] == 4 and rec["cache"]["scope"] == "layer"
        assert rec["ppl"] > 1 and 0 <= rec["miss_rate"] <= 1 and rec["bytes_per_token"] > 0
        assert rec["metrics"]["tokens"] == 45 and rec["task"] == "wikitext"
    on_disk = open(results).read()
    assert [json.loads(x) for x in on_disk.splitlines()] == printed
    plain = perplexity.wikitext_perplexity(lm, TEXT, 16, 45)
    assert printed[0]["ppl"] == pytest.approx(plain["ppl"], rel=1e-5)  # λ = 0 is original routing
    assert printed[2]["miss_rate"] < printed[0]["miss_rate"]
    # rerun: nothing computed, the records come from the file, which is unchanged
    assert evaluate.main(argv) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == printed
    assert open(results).read() == on_disk


def test_a_results_file_the_disk_cannot_take_does_not_lose_the_computed_points(lm, tmp_path, capsys, monkeypatch):
    """A sweep (or a single point) whose record the results file cannot take does not lose the computed
    perplexities with the process: the run stops at that record, prints every record it has, then the error;
    the rerun computes only what is not in the file."""
    results = tmp_path / "lam.jsonl"
    argv = ["--model", lm.path, "--data", _data(tmp_path), "--context", "16", "--max-tokens", "45",
            "--sweep", "lam=0:1:3", "--cache-size", "4", "--results", str(results), "--json", "--batch-size", "3"]
    real, calls = sweep.results_file.append_result, []

    def full_after_one(path, rec):
        calls.append(rec["key"])
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(path, rec)

    monkeypatch.setattr(sweep.results_file, "append_result", full_after_one)
    assert evaluate.main(argv) == 1
    out, err = capsys.readouterr()
    printed = [json.loads(line) for line in out.splitlines()]
    assert [p["sweep"] for p in printed] == [{"lam": 0.0}, {"lam": 0.5}, {"lam": 1.0}]
    assert err.strip().splitlines()[-1] == (
        f"error: [Errno {errno.ENOSPC}] No space left on device: '{results}': the run stopped at the first record "
        "the results file could not take (2 point(s) computed and not in it); they are printed above")
    assert len(open(results).read().splitlines()) == 1
    monkeypatch.undo()
    assert evaluate.main(argv) == 0
    out, err = capsys.readouterr()
    again = [json.loads(line) for line in out.splitlines()]
    assert again[0] == printed[0] and f"2 point(s) computed, 1 already in {results}" in err
    assert [r["ppl"] for r in again] == pytest.approx([r["ppl"] for r in printed], rel=1e-5)


def test_cli_table_and_errors(lm, tmp_path, capsys):
    data = _data(tmp_path)
    base = ["--model", lm.path, "--data", data, "--context", "16", "--max-tokens", "30", "--no-progress"]
    assert evaluate.main(base + ["--routing", "max-rank", "--sweep", "max_rank=2:4", "--cache-size", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["kind", "max_rank", "ppl"] and len(out) == 4
    for argv, message in [
        (["--sweep", "lam=0:1"], "number of points"),
        (["--sweep", "lam=0:1:2", "--routing", "max-rank"], "applies to routing cache-prior"),
        (["--sweep", "cache_size=2,9"], "between 1 and N=8"),
        (["--sweep", "cumsum_p=0.5,1.5"], "'1.5' is not in [0, 1]"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--task", "mmlu", "--limit", "0"], "--limit must be >= 1"),
        (["--context", str(lm.cfg.max_position_embeddings + 1)], "longer than the model's"),
    ]:
        assert evaluate.main(base + argv) == 2, argv
        assert message in capsys.readouterr().err, argv


class _FakeTasks:
    """Stands in for ``moejax.evaluation.tasks``: records its calls, accuracy from λ so sweeps are visible."""

    TASKS = ("mmlu", "gsm8k", "truthfulqa", "nq_open")

    def __init__(self):
        self.calls = []

    def evaluate_task(self, model, task, data=None, *, limit=None, routing=None, cache=None, state=None, shots=None,
                      max_new_tokens=None, progress=False, **options):
        self.calls.append(dict(task=task, data=data, limit=limit, routing=routing, cache=cache, shots=shots,
                               max_new_tokens=max_new_tokens))
        lam = float(routing.lam) if routing is not None else 0.0
        out = {"task": task, "accuracy": 0.25 + lam / 10, "examples": limit}
        if cache is not None:
            out.update(miss_rate=0.5 - lam / 4, lifetime=3.0, bytes_per_token=100.0, cache={"collision_misses": 0})
        return out


def test_task_dispatch_single_and_sweep(lm, tmp_path, capsys, monkeypatch):
    fake = _FakeTasks()
    monkeypatch.setattr(evaluate, "tasks", fake)
    monkeypatch.setattr(sweep, "tasks", fake)
    assert evaluate.main(["--model", lm.path, "--task", "mmlu", "--limit", "3", "--shots", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["accuracy"] == 0.25 and fake.calls[-1]["cache"] is None and fake.calls[-1]["limit"] == 3
    assert fake.calls[-1]["shots"] == 1
    results = str(tmp_path / "gsm.jsonl")
    argv = ["--model", lm.path, "--task", "gsm8k", "--limit", "2", "--max-new-tokens", "8", "--sweep", "lam=0.5,1.0",
            "--cache-size", "4", "--results", results, "--json"]
    assert evaluate.main(argv) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["accuracy"] for r in recs] == [0.3, 0.35] and [r["miss_rate"] for r in recs] == [0.375, 0.25]
    assert all(r["task"] == "gsm8k" and r["method"] == "task" and r["collision_misses"] == 0 for r in recs)
    assert fake.calls[-1]["max_new_tokens"] == 8 and fake.calls[-1]["cache"].size == "4"
    n_calls = len(fake.calls)
    assert evaluate.main(argv) == 0  # resumed: nothing recomputed
    assert len(fake.calls) == n_calls


def test_merge_offload_sums_counters_and_recomputes_rates():
    chunks = [(10, {"paging": "host", "bytes_moved": 400, "demand_loads": 4, "transfer_s": 0.5, "tokens_per_s": 20.0,
                    "bytes_per_token": 40.0, "device_memory": 7}),
              (30, {"paging": "host", "bytes_moved": 200, "demand_loads": 2, "transfer_s": 0.25, "tokens_per_s": 60.0,
                    "bytes_per_token": 6.7, "device_memory": 9, "bytes_per_decode_token": 3.0})]
    m = offload.merge_summaries(chunks)
    assert m["bytes_moved"] == 600 and m["demand_loads"] == 6 and m["transfer_s"] == 0.75
    assert m["tokens"] == 40 and m["bytes_per_token"] == 15.0 and m["tokens_per_s"] == pytest.approx(40 / 1.0)
    assert m["device_memory"] == 9 and m["paging"] == "host" and m["chunks"] == 2
    assert "bytes_per_decode_token" not in m  # one call's rate, not the evaluation's


def test_perplexity_of_nothing_is_refused_not_perfect():
    """max_tokens=0 or an empty text scored 0 tokens as ppl 1.0; max_tokens=-5 silently dropped 5 tokens."""
    import moejax
    from moejax.evaluation.perplexity import wikitext_perplexity

    m = moejax.load("default")
    for kw in (dict(max_tokens=0), dict(max_tokens=-5), dict(max_tokens=2.5), dict(context=16.5)):
        with pytest.raises(ValueError, match="max_tokens|context"):
            wikitext_perplexity(m, "The city was built .", **{"context": 16, **kw})
    with pytest.raises(ValueError, match="nothing to predict"):
        wikitext_perplexity(m, "", context=16)


def test_a_perplexity_past_the_largest_float_is_an_error_naming_it():
    """A model whose mean NLL passes ~709 nats (random weights at a large std) made `math.exp` raise a bare
    OverflowError: a traceback from `evaluate`. It is a non-finite result: `NonFiniteError`, exit status 1."""
    counts = np.ones((1, 4))
    ok = perplexity.perplexity_result("a b c d", np.arange(8), 8, 1, 8 * 2.0, 8, counts)
    assert ok["ppl"] == pytest.approx(math.exp(2.0)) and ok["ppl_word"] == pytest.approx(math.exp(4.0))
    for nll_sum, per in ((8 * 800.0, "token"), (8 * 400.0, "word")):  # 4 words of 8 tokens: twice the NLL
        with pytest.raises(gating.NonFiniteError, match=f"perplexity per {per} overflows"):
            perplexity.perplexity_result("a b c d", np.arange(8), 8, 1, nll_sum, 8, counts)


def test_a_model_without_a_tokenizer_is_refused_before_it_is_loaded(tmp_path, capsys, monkeypatch):
    """evaluate and studies score text: a folder without tokenizer.json is named before any weight is read (the
    61 GB Qwen3-30B-A3B folder was loaded first: 3 s and 4.8 GB, then the error)."""
    from moejax.evaluation import studies
    from moejax.runtime import api

    folder = shutil.copytree(get_hf_model("qwen3_moe").folder, str(tmp_path / "m"))
    assert not os.path.exists(os.path.join(folder, "tokenizer.json"))
    monkeypatch.setattr(api, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert evaluate.main(["--model", folder, "--max-tokens", "16"]) == 1
    assert studies.main(["--model", folder, "--only", "pareto", "--out", str(tmp_path / "s")]) == 1
    err = capsys.readouterr().err
    assert err.count(f"{folder} has no tokenizer.json") == 2 and "Traceback" not in err
