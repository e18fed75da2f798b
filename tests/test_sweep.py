"""Sweeps: spec parsing, the JSONL results file, resume after an interruption, vmapped batches = the loop."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.scatter_bounds import out_of_range_scatters
from test_evaluate import TEXT, make_word_model

from moejax.models import checkpoint
from moejax.experts import routing
from moejax.runtime import api, simulate
from moejax.evaluation import perplexity, results as results_file, sweep, sweep_points

# ------------------------------------------------------------------------------------------ spec parsing


def test_parse_good_specs():
    lam = sweep_points.parse_sweep("lam=0:1:50")
    assert lam.name == "lam" and len(lam.values) == 50 and lam.values[0] == 0.0 and lam.values[-1] == 1.0
    np.testing.assert_allclose(np.diff(lam.values), 1 / 49)
    assert sweep_points.parse_sweep("max_rank=0:4").values == (0, 1, 2, 3, 4)
    assert sweep_points.parse_sweep("max-rank=4:32:8").values == (4, 8, 12, 16, 20, 24, 28, 32)
    assert sweep_points.parse_sweep("prune_h=2,3").values == (2, 3)
    assert sweep_points.parse_sweep("cache_size=1,2,4,8").values == ("1", "2", "4", "8")
    assert sweep_points.parse_sweep("cache_size=0.25, 0.5").values == ("0.25", "0.5")
    assert sweep_points.parse_sweep("cache_size=2:4").values == ("2", "3", "4")
    assert sweep_points.parse_sweep("cache_size=0.25:1:4").values == ("0.25", "0.5", "0.75", "1.0")
    assert sweep_points.parse_sweep("cumsum_p=0.9").values == (0.9,)
    assert sweep_points.parse_sweep("lam=0.3:0.3:1").values == (0.3,)
    grid = sweep_points.expand_grid([sweep_points.parse_sweep("cache_size=4,8"), sweep_points.parse_sweep("lam=0,1")])
    assert grid == [{"cache_size": "4", "lam": 0}, {"cache_size": "4", "lam": 1},
                    {"cache_size": "8", "lam": 0}, {"cache_size": "8", "lam": 1}]
    assert sweep_points.expand_grid([]) == [{}]


@pytest.mark.parametrize("spec, message", [
    ("lam", "expected NAME=VALUES"),
    ("speed=1,2", "unknown parameter 'speed'"),
    ("lam=", "no values"),
    ("lam=0:1", "needs a number of points"),
    ("lam=0:1:0", "number of points must be >= 1"),
    ("lam=0:1:2:3", "a range is a:b"),
    ("lam=0,x", "'x' is not a number"),
    ("lam=nan", "not finite"),
    ("lam=0.5,0.5", "repeated values"),
    ("lam=0,,1", "empty item"),
    ("max_rank=0:10:4", "are not integers"),
    ("max_rank=5:2", "empty range"),
    ("max_rank=1.5,2", "'1.5' is not an integer"),
    ("cache_size=0", "must be between 1"),
    ("cache_size=1.5", "must be in (0, 1]"),
    ("cache_size=big", "is not a count"),
])
def test_parse_bad_specs(spec, message):
    with pytest.raises(sweep_points.SweepError) as e:
        sweep_points.parse_sweep(spec)
    assert message in str(e.value) and spec.split("=")[0] in str(e.value)


def test_grid_and_kind_errors():
    with pytest.raises(sweep_points.SweepError, match="given twice"):
        sweep_points.expand_grid([sweep_points.parse_sweep("lam=0,1"), sweep_points.parse_sweep("lam=0.5")])
    assert sweep_points.infer_kind(None, ["lam"]) == "cache-prior"
    assert sweep_points.infer_kind(None, ["max_rank", "top_j"]) == "max-rank"
    assert sweep_points.infer_kind(None, ["cache_size"]) is None
    assert sweep_points.infer_kind("cumsum", ["top_j", "cache_size"]) == "cumsum"
    with pytest.raises(sweep_points.SweepError, match="lam applies to routing cache-prior, not --routing max-rank"):
        sweep_points.infer_kind("max-rank", ["lam"])
    with pytest.raises(sweep_points.SweepError, match="give --routing"):
        sweep_points.infer_kind(None, ["top_j"])
    with pytest.raises(sweep_points.SweepError, match="give --routing"):
        sweep_points.infer_kind(None, ["lam", "max_rank"])


def test_routing_record_is_canonical():
    a = sweep_points.routing_record("cache-prior", 4, lam=0.5, max_rank=7, prune_h=3)
    b = sweep_points.routing_record("cache-prior", 4, lam=0.5, top_j=2)
    assert a == b == {"kind": "cache-prior", "lam": 0.5, "top_j": 2, "max_rank": None, "cumsum_p": None,
                      "prune_h": None, "delta": None}
    assert sweep_points.routing_record("pruning", 4)["prune_h"] == 4
    assert sweep_points.routing_record("max-rank", 2)["top_j"] == 1
    assert sweep_points.routing_record("original", 4, drop_rank=2)["drop_rank"] == 2


# ------------------------------------------------------------------------------------------ results file


def _rec(key: str, **kw) -> dict:
    return {"key": key, "ppl": 1.5, **kw}


def test_results_file_torn_tail_and_errors(tmp_path):
    path = str(tmp_path / "sub" / "r.jsonl")
    assert results_file.load_results(path) == []
    results_file.append_result(path, _rec("a"))
    results_file.append_result(path, _rec("b", x=float("nan"), v=np.float32(2.5), n=np.int64(3), arr=np.arange(2)))
    with open(path, "ab") as f:
        f.write(b'{"key": "c", "ppl": 1.')  # a crash in the middle of a write
    assert [r["key"] for r in results_file.load_results(path)] == ["a", "b"]
    assert results_file.load_results(path)[1] == {"key": "b", "ppl": 1.5, "x": None, "v": 2.5, "n": 3, "arr": [0, 1]}
    results_file.append_result(path, _rec("d"))  # the torn line is cut off first
    lines = open(path).read().splitlines()
    assert [json.loads(x)["key"] for x in lines] == ["a", "b", "d"]
    with open(path, "ab") as f:
        f.write(b'{"key": "e"}')  # complete but unterminated: kept, newline added on the next append
    assert [r["key"] for r in results_file.load_results(path)] == ["a", "b", "d", "e"]
    results_file.append_result(path, _rec("f"))
    assert [r["key"] for r in results_file.load_results(path)] == ["a", "b", "d", "e", "f"]
    with open(path, "w") as f:
        f.write('{"key": "a"}\nnot json\n{"key": "b"}\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: not a moejax results file \(malformed line"):
        results_file.load_results(path)
    with open(path, "w") as f:
        f.write('{"key": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r":2: .*string 'key'"):
        results_file.load_results(path)


@pytest.mark.parametrize("content", [b'{"lr": 0.001}', b'{"lr": 0.001}\n{"warmup": 10}', b"plain text, no newline",
                                     b'{"key": "a", "ppl": 1.5}\n{"lr": 0.001}', b"[1, 2, 3]", b'{"k'])
def test_results_file_never_truncates_a_bystander(tmp_path, content):
    """Only a results file's torn record is repaired; an unrelated file whose last line
    lacks its newline (any json.dump output) is refused, byte for byte intact."""
    path = tmp_path / "settings.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a moejax results file"):
        results_file.append_result(str(path), _rec("x"))
    with pytest.raises(ValueError, match="not a moejax results file"):
        results_file.load_results(str(path))
    assert path.read_bytes() == content


# ------------------------------------------------------------------------------------------ evaluation


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return make_word_model(str(tmp_path_factory.mktemp("sweep") / "model"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "test.txt"
    path.write_text(TEXT * 3)
    return str(path)


CONTEXT, MAX_TOKENS = 16, 75  # 5 chunks of 15 tokens + BOS: one compiled program


def _points(lm, data, lams, size="4", scope="layer", eviction="lru"):
    out = []
    for lam in lams:
        policy = routing.make_policy("cache-prior", lm.cfg.top_k, lam=lam)
        cache = simulate.CacheConfig(size, scope, eviction)
        out.append(sweep_points.make_point(lm, lm.path, data=data, context=CONTEXT, max_tokens=MAX_TOKENS,
                                           routing=sweep_points.routing_record("cache-prior", lm.cfg.top_k, lam=lam),
                                           policy=policy, cache=cache, sweep={"lam": lam}))
    return out


def _runner(lm, results=None, batch_size=4):
    return sweep.Runner(lm, results=results, batch_size=batch_size, progress=False, load_text=perplexity.load_wikitext)


def _strip(rec):
    return {k: v for k, v in rec.items() if k not in ("time_s", "finished_at")}


def test_vmapped_batch_equals_the_loop(lm, data):
    """A batch mixing λ and capacities (both data) gives what perplexity.wikitext_perplexity gives per point."""
    text = perplexity.load_wikitext(data)
    pts = _points(lm, data, [0.0, 0.3, 1.0]) + _points(lm, data, [0.6], size="2") + _points(lm, data, [0.6], size="7")
    assert len({p.batch_group() for p in pts}) == 1
    recs = _runner(lm, batch_size=2).run(pts)  # batches of 2, the last one padded
    for p, rec in zip(pts, recs):
        ref = perplexity.wikitext_perplexity(lm, text, CONTEXT, MAX_TOKENS, p.policy, p.cache)
        assert rec["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
        assert rec["miss_rate"] == ref["miss_rate"]
        assert rec["metrics"]["cache"]["misses"] == ref["cache"]["misses"]
        assert rec["lifetime"] == pytest.approx(ref["lifetime"], rel=1e-9)
        np.testing.assert_allclose(rec["metrics"]["expert_usage"]["share"], ref["expert_usage"]["share"])
        for key in ("reuse", "reuse_any", "reuse_independent"):
            np.testing.assert_allclose(rec["metrics"]["expert_usage"][key], ref["expert_usage"][key], rtol=1e-12)
        assert rec["metrics"]["tokens"] == MAX_TOKENS and rec["metrics"]["chunks"] == 5
    assert recs[3]["miss_rate"] > recs[4]["miss_rate"]  # C = 2 misses more than C = 7
    # λ = 0 in the sweep engine is plain perplexity (original routing, no cache at all)
    plain = perplexity.wikitext_perplexity(lm, text, CONTEXT, MAX_TOKENS)
    assert recs[0]["ppl"] == pytest.approx(plain["ppl"], rel=1e-6)
    # global scope: the token-sequential path, batched as well
    glob = _points(lm, data, [0.0, 0.8], size="6", scope="global", eviction="least-stale")
    for p, rec in zip(glob, _runner(lm, batch_size=2).run(glob)):
        ref = perplexity.wikitext_perplexity(lm, text, CONTEXT, MAX_TOKENS, p.policy, p.cache)
        assert rec["ppl"] == pytest.approx(ref["ppl"], rel=1e-5)
        assert rec["miss_rate"] == ref["miss_rate"] and rec["collision_misses"] == ref["cache"]["collision_misses"]


def test_the_vmapped_pass_keeps_every_scatter_index_in_range(lm):
    """The sweep vmaps the cache and router state over points; XLA:GPU's deterministic scatter lands a
    dropped out-of-range index in the next point (tests/support/scatter_bounds.py), so none may occur."""
    ids = jnp.asarray(np.arange(1, 13, dtype=np.int32) % lm.cfg.vocab_size)
    cc = simulate.CacheConfig("0.5", "layer", "lru")
    states = [simulate.init_router_state(lm.cfg, routing.make_policy("cache-prior", lm.cfg.top_k, lam=lam), cc)
              for lam in (0.0, 0.5)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    assert out_of_range_scatters(lambda s: sweep.batched_pass(lm.params, lm.cfg, ids, s), stacked) == []


def test_resume_after_interruption(lm, data, tmp_path, monkeypatch):
    pts = _points(lm, data, [0.0, 0.25, 0.5, 0.75, 1.0])
    reference = [_strip(r) for r in _runner(lm, batch_size=2).run(pts)]
    results = str(tmp_path / "r.jsonl")
    real = sweep.run_forward_batch
    calls = []

    def dies_after_two(*args, **kw):
        if len(calls) == 1:  # the second batch (points 3 and 4) dies
            raise KeyboardInterrupt("killed")
        calls.append(args[5][0].record["sweep"])
        return real(*args, **kw)

    monkeypatch.setattr(sweep, "run_forward_batch", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        _runner(lm, results, batch_size=2).run(pts)
    assert [r["sweep"] for r in results_file.load_results(results)] == [{"lam": 0.0}, {"lam": 0.25}]
    with open(results, "ab") as f:  # and the crash tore a third line in half
        f.write(json.dumps(reference[2]).encode()[:57])
    assert len(results_file.load_results(results)) == 2

    def counting(*args, **kw):
        calls.append(args[5][0].record["sweep"])
        return real(*args, **kw)

    calls.clear()
    monkeypatch.setattr(sweep, "run_forward_batch", counting)
    runner = _runner(lm, results, batch_size=2)
    resumed = runner.run(pts)
    assert calls == [{"lam": 0.5}, {"lam": 1.0}] and runner.computed == 3  # batches [0.5, 0.75], [1.0]
    assert [_strip(r) for r in resumed] == reference
    assert [_strip(r) for r in results_file.load_results(results)] == reference  # torn line gone, order = completion
    calls.clear()
    again = _runner(lm, results, batch_size=2)
    assert [_strip(r) for r in again.run(pts)] == reference and calls == [] and again.computed == 0


def test_resume_recomputes_when_the_weights_at_the_path_changed(lm, data, tmp_path):
    """Records are keyed by the weights' content, not the --model path."""
    results = str(tmp_path / "w.jsonl")
    pts = _points(lm, data, [0.5])
    first = _runner(lm, results).run(pts)
    again = _runner(lm, results)
    assert again.run(_points(lm, data, [0.5])) == first and again.computed == 0
    changed = api.Model(jax.tree.map(lambda x: x * 1.01, lm.params), lm.cfg, lm.tokenizer, lm.path)
    assert changed.fingerprint != lm.fingerprint and changed.path == lm.path
    runner = _runner(changed, results)
    recs = runner.run(_points(changed, data, [0.5]))
    assert runner.computed == 1 and recs[0]["ppl"] != first[0]["ppl"]
    small = api.Model(jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1.0), lm.params), lm.cfg, lm.tokenizer,
                      lm.path, lm.generation_config)
    assert small.fingerprint != lm.fingerprint  # one changed element of a small leaf is seen
    big = np.zeros(3 << 20, np.float32)  # a large leaf is sampled (strided, and both ends in full)
    ends = big.copy()
    ends[-1] = 1.0
    assert checkpoint.params_fingerprint({"w": ends}) != checkpoint.params_fingerprint({"w": big})


def test_keys_follow_the_configuration_tokenizer_and_prior_at_a_path(lm, data, tmp_path):
    """The same weights at the same path with an edited config.json, tokenizer or generation settings, or a
    learned prior retrained at the same path, are other points (they were served the old records)."""
    same = api.Model(lm.params, lm.cfg, lm.tokenizer, lm.path, lm.generation_config)
    assert same.fingerprint == lm.fingerprint and lm.tokenizer is not None
    edited = [api.Model(lm.params, dataclasses.replace(lm.cfg, rope_scale=2.0), lm.tokenizer, lm.path,
                        lm.generation_config),
              api.Model(lm.params, lm.cfg, None, lm.path, lm.generation_config),
              api.Model(lm.params, lm.cfg, lm.tokenizer, lm.path, {**lm.generation_config, "eos_token_id": 7})]
    assert len({m.fingerprint for m in [lm, *edited]}) == 4
    prior = tmp_path / "w1"
    prior.mkdir()
    (prior / "prior.json").write_text("{}")

    def key():
        rec = sweep_points.routing_record("learned-prior", lm.cfg.top_k, prior=str(prior))
        return sweep_points.make_point(lm, lm.path, data=data, context=CONTEXT, max_tokens=MAX_TOKENS, routing=rec).key

    first = key()
    assert key() == first
    (prior / "prior.json").write_text('{"retrained": 1}')
    assert key() != first


def test_keys_follow_a_task_files_shots_and_the_default_wikitext(lm, tmp_path, monkeypatch):
    """gsm8k's train.jsonl beside a --data file, and the text $MOEJAX_WIKITEXT names when no --data is given,
    are read: a rerun after either changed was served the old record."""
    (tmp_path / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    (tmp_path / "train.jsonl").write_text('{"question": "2+2?", "answer": "#### 4"}\n')

    def key(task="gsm8k", data=str(tmp_path / "test.jsonl")):
        return sweep_points.make_point(lm, lm.path, task=task, data=data, limit=1, shots=1,
                                       max_new_tokens=2, method="task").key

    first = key()
    (tmp_path / "train.jsonl").write_text('{"question": "3+3?", "answer": "#### 6"}\n')
    assert key() != first
    (tmp_path / "a.txt").write_text("one text")
    (tmp_path / "b.txt").write_text("another text")
    monkeypatch.setenv("MOEJAX_WIKITEXT", str(tmp_path / "a.txt"))
    plain = key("wikitext", None)
    monkeypatch.setenv("MOEJAX_WIKITEXT", str(tmp_path / "b.txt"))
    assert key("wikitext", None) != plain


def test_batches_write_every_point_and_keys_identify_points(lm, data, tmp_path):
    results = str(tmp_path / "b.jsonl")
    pts = _points(lm, data, [0.0, 0.5, 1.0])
    assert len({p.key for p in pts}) == 3
    assert _points(lm, data, [0.5])[0].key == pts[1].key  # same settings, same key
    assert _points(lm, data, [0.5], size="0.5")[0].key == pts[1].key  # capacity 4 either way
    assert _points(lm, data, [0.5], size="3")[0].key != pts[1].key
    recs = _runner(lm, results, batch_size=2).run(pts + pts[:1])  # duplicates are evaluated once
    assert len(recs) == 3 and len(results_file.load_results(results)) == 3
    required = {"key", "study", "task", "model", "routing", "cache", "sweep", "ppl", "accuracy", "miss_rate",
                "lifetime", "lifetime_std", "bytes_per_token", "collision_misses", "prefetch_precision",
                "prefetch_recall", "metrics", "time_s", "finished_at"}
    for rec in results_file.load_results(results):
        assert required <= set(rec)
        assert rec["cache"] == {"size": "4", "capacity": 4, "scope": "layer", "eviction": "lru", "init": "empty",
                                "seed": None}
        assert rec["time_s"] > 0 and rec["finished_at"].endswith("+00:00")
        assert math.isfinite(rec["ppl"]) and rec["accuracy"] is None
    assert recs[0]["metrics"]["batch_size"] == 2 and set(recs[0]["metrics"]["miss_rate_first_tokens"]) == {"16", "64"}


@pytest.mark.skipif(not results_file.PointClaims.available(), reason="no open-file-description locks here")
def test_point_claims_between_runs(tmp_path):
    """Claims conflict between runs (two descriptions of the file), survive this run's own appends (which
    open and close the file), are dropped on release or close; new_records reads only what is new."""
    path = str(tmp_path / "r.jsonl")
    a, b = results_file.PointClaims(path), results_file.PointClaims(path)
    assert a.shared and b.shared
    assert a.claim(["x", "y"]) == ["x", "y"] and b.claim(["x", "y", "z"]) == ["z"]
    results_file.append_result(path, _rec("x"))  # a's run appends: its claims stay
    assert b.claim(["x"]) == [] and [r["key"] for r in b.new_records()] == ["x"] and b.new_records() == []
    a.release(["x"])
    assert b.claim(["x"]) == ["x"] and a.claim(["x", "z"]) == []
    results_file.append_result(path, _rec("w"))
    with open(path, "ab") as f:
        f.write(b'{"key": "torn')  # a torn tail is not read until whole
    assert [r["key"] for r in a.new_records()] == ["x", "w"] and a.new_records() == []
    a.close()
    assert b.claim(["y"]) == ["y"]  # a's claims ended with it
    b.close()
    empty = str(tmp_path / "sub" / "dir" / "new.jsonl")
    results_file.PointClaims(empty).close()  # a run that wrote nothing leaves no file or folder it made
    assert not (tmp_path / "sub").exists() and (tmp_path / "r.jsonl").exists()
    with pytest.raises(OSError, match="cannot write results file"):
        results_file.PointClaims(str(tmp_path / "r.jsonl" / "x.jsonl"))


@pytest.mark.skipif(not results_file.PointClaims.available(), reason="no open-file-description locks here")
@pytest.mark.parametrize("other_finishes", [True, False])
def test_runs_sharing_a_results_file_split_its_points(lm, data, tmp_path, other_finishes):
    """A point another run holds is not computed here: the runner computes the rest, then waits for that run
    and takes its record — or, when that run ends without one, computes the point itself."""
    import threading

    pts = _points(lm, data, [0.0, 0.5, 1.0])
    results = str(tmp_path / "shared.jsonl")
    other = results_file.PointClaims(results)
    assert other.claim([pts[1].key]) == [pts[1].key]
    runner = _runner(lm, results, batch_size=1)
    out = {}
    worker = threading.Thread(target=lambda: out.update(recs=runner.run(pts)))
    worker.start()
    deadline = time.monotonic() + 120
    while len(results_file.load_results(results)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.is_alive()  # the two free points are done; it waits for the held one
    assert {r["key"] for r in results_file.load_results(results)} == {pts[0].key, pts[2].key}
    theirs = dict(_rec(pts[1].key), sweep={"lam": 0.5}, by="the other run")
    if other_finishes:
        results_file.append_result(results, theirs)
    other.close()
    worker.join(120)
    assert not worker.is_alive()
    keys = [r["key"] for r in results_file.load_results(results)]
    assert sorted(keys) == sorted(p.key for p in pts)  # every point once
    assert [r["key"] for r in out["recs"]] == [p.key for p in pts]
    if other_finishes:
        assert runner.computed == 2 and runner.by_other_runs == 1 and out["recs"][1] == theirs
    else:
        assert runner.computed == 3 and runner.by_other_runs == 0 and out["recs"][1]["ppl"] > 1


def test_replay_of_the_original_trace_equals_the_forward_cache(lm, data, tmp_path):
    """LRU replay of the recorded original-routing trace = the forward pass with an LRU cache; Belady <= LRU."""
    def point(method, eviction):
        return sweep_points.make_point(lm, lm.path, data=data, context=CONTEXT, max_tokens=MAX_TOKENS, method=method,
                                       policy=routing.make_policy("original", 2) if method == "forward" else None,
                                       cache=simulate.CacheConfig("3", "layer", eviction))

    runner = sweep.Runner(lm, batch_size=2, progress=False, load_text=perplexity.load_wikitext,
                          trace_dir=str(tmp_path / "traces"))
    fwd, lru, belady = runner.run([point("forward", "lru"), point("replay", "lru"), point("replay", "belady")])
    assert lru["miss_rate"] == fwd["miss_rate"] and lru["lifetime"] == pytest.approx(fwd["lifetime"])
    assert lru["ppl"] == pytest.approx(fwd["ppl"], rel=1e-6)
    assert belady["miss_rate"] < lru["miss_rate"] and belady["ppl"] == lru["ppl"]
    assert len(list((tmp_path / "traces").glob("*.npz"))) == 1  # the trace is kept for the next run


def test_edited_data_is_a_new_point(lm, tmp_path):
    """A point's key follows the data's contents, not only its path (a rerun after editing the file must not
    report the old file's records)."""
    f = tmp_path / "t.txt"
    f.write_text(TEXT)
    first = _points(lm, str(f), [0.5])[0].key
    assert _points(lm, str(f), [0.5])[0].key == first
    f.write_text(TEXT + " more words .")
    assert _points(lm, str(f), [0.5])[0].key != first
    folder = tmp_path / "task"
    folder.mkdir()
    (folder / "a.jsonl").write_text("1\n")
    d1 = sweep_points.data_digest(str(folder))
    (folder / "a.jsonl").write_text("2\n")
    assert sweep_points.data_digest(str(folder)) != d1
