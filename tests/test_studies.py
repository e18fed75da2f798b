"""The studies runner on a tiny budget, and the sensitivity study's router hooks."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_evaluate import TEXT, _FakeTasks, make_word_model

from moejax.base import errors
from moejax.models import gating
from moejax.experts import routing
from moejax.runtime import simulate
from moejax.evaluation import perplexity, results as results_file, studies, sweep, sweep_points


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return make_word_model(str(tmp_path_factory.mktemp("studies") / "model"), jnp.float32)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "test.txt"
    path.write_text(TEXT * 2)
    return str(path)


# ------------------------------------------------------------------------------------------ hooks

G = gating.SoftmaxTopK(16, 4, normalize=True)


def _z(t=32, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), (t, 16)) * 2.0


@functools.partial(jax.jit, static_argnums=(0, 1))
def _call(hook, layer, z, state):
    """The hook as the model calls it: traced under jit (one program per hook and layer, shared by every k)."""
    return hook(layer, z, state)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_random_replace_hook_replaces_exactly_the_rank_k_expert(k):
    hook = studies.RankHook(G, n_layers=3, mode="random", seed=7)
    z = _z()
    top = np.asarray(G.ranking(z))[:, :4]
    experts, weights, state, rec = _call(hook, 1, z, hook.init_state(k))
    experts, weights = np.asarray(experts), np.asarray(weights)
    assert int(state["pos"]) == 0 and rec == {}  # the counter advances after the LAST MoE layer only
    want = np.asarray(G.weights(z, jnp.asarray(experts)))  # the gating of the new set, from the original logits
    np.testing.assert_allclose(weights, want, rtol=1e-6)
    assert np.all(np.diff(weights, axis=-1) <= 0)  # highest weight first
    for t in range(z.shape[0]):
        kept = set(top[t]) - {top[t, k - 1]}
        new = set(experts[t]) - kept
        assert kept <= set(experts[t]) and len(new) == 1 and len(set(experts[t])) == 4
        assert new.pop() not in set(top[t])  # a random expert from outside the original top-K
    again = np.asarray(_call(hook, 1, z, hook.init_state(k))[0])
    np.testing.assert_array_equal(again, experts)  # reproducible
    other_layer = np.asarray(_call(hook, 0, z, hook.init_state(k))[0])
    other_seed = np.asarray(_call(studies.RankHook(G, 3, "random", seed=8), 1, z, hook.init_state(k))[0])
    assert (other_layer != experts).any() and (other_seed != experts).any()


def test_random_draw_depends_on_position_not_on_chunking():
    hook = studies.RankHook(G, n_layers=3, mode="random", seed=7)
    z = _z()
    whole = np.asarray(_call(hook, 0, z, hook.init_state(2))[0])
    state = hook.init_state(2)
    parts = []
    for lo, hi in ((0, 16), (16, 32)):
        parts.append(np.asarray(_call(hook, 0, z[lo:hi], state)[0]))
        _, _, state, _ = _call(hook, 2, z[lo:hi], state)  # the last MoE layer moves the position on
        assert int(state["pos"]) == hi
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_drop_hook_keeps_ranks_below_k():
    hook = studies.RankHook(G, n_layers=1, mode="drop")
    z = _z()
    top = np.asarray(G.ranking(z))[:, :4]
    for k in (1, 2, 4):
        experts, weights, _, _ = _call(hook, 0, z, hook.init_state(k))
        experts, weights = np.asarray(experts), np.asarray(weights)
        assert (experts[:, k - 1:] == -1).all() and (weights[:, k - 1:] == 0).all()
        for t in range(z.shape[0]):
            assert set(experts[t, :k - 1]) == set(top[t, :k - 1])
        if k > 1:
            np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)  # renormalised over the kept ones
    with pytest.raises(ValueError, match="rank k must be in 1..K=4"):
        hook.init_state(5)
    with pytest.raises(ValueError, match="mode"):
        studies.RankHook(G, 1, mode="swap")


def test_drop_hook_through_the_model_equals_the_pruning_policy(lm, data):
    """Dropping ranks >= 2 with the hook = pruning(h=2) (same experts, same weights) in perplexity."""
    text = perplexity.load_wikitext(data)
    inp = sweep.wikitext_input(lm, text, 16, 60)
    hook = studies.RankHook(lm.cfg.gating, lm.cfg.n_moe_layers, "drop")
    p = sweep_points.make_point(lm, lm.path, data=data, context=16, max_tokens=60, hook=hook, hook_state=hook.init_state(2))
    res, _ = sweep.run_forward_single(lm, inp.chunks, inp.text, inp.ids, 16, p)
    pruned = perplexity.wikitext_perplexity(lm, text, 16, 60, routing.make_policy("pruning", 2, prune_h=2),
                                          simulate.CacheConfig("4"))
    assert res["ppl"] == pytest.approx(pruned["ppl"], rel=1e-5)
    assert res["expert_usage"]["share"] == pruned["expert_usage"]["share"]


# ------------------------------------------------------------------------------------------ the runner


def _lines(path):
    with open(path) as f:
        return f.read()


CALIBRATION_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "corpus",
                                "enwiki-2015-wikitext-style-07.txt.gz")


def _run(lm, data, out, only, *extra):
    calibration = ("--calibration-text", CALIBRATION_TEXT) if "delta" in only.split(",") else ()
    argv = ["--model", lm.path, "--data", data, "--max-tokens", "45", "--context", "16", "--points", "2",
            "--batch-size", "1", "--out", out, "--no-progress", "--only", only, *calibration, *extra]
    assert studies.main(argv) == 0
    return argv


def test_studies_runner_on_a_tiny_budget(lm, data, tmp_path, capsys):
    out = str(tmp_path / "studies")
    argv = _run(lm, data, out, "pareto,lifetimes,init,delta,cache_size")
    printed = capsys.readouterr().out
    assert "== pareto" in printed and "== cache_size" in printed
    names = ("pareto", "lifetimes", "init", "delta", "cache_size")
    files = {name: results_file.load_results(os.path.join(out, f"{name}.jsonl")) for name in names}
    k, n = lm.cfg.top_k, lm.cfg.n_experts  # 2, 8
    pareto = files["pareto"]
    assert all(r["study"] == "pareto" and r["model"] == sweep_points.model_label(lm.path) + "@float32" for r in pareto)
    per_size = 1 + (k - 1) + len(studies.max_rank_values(k, n)) + 2 + 2 + 2
    assert len(pareto) == 2 * per_size
    by = {(r["routing"]["kind"], r["method"], r["cache"]["eviction"], r["cache"]["capacity"],
           str(r["routing"]["lam"])): r for r in pareto}
    for c in (4, 2):
        lru, belady = by[("original", "replay", "lru", c, "None")], by[("original", "replay", "belady", c, "None")]
        orig = by[("original", "forward", "lru", c, "None")]
        assert belady["miss_rate"] <= lru["miss_rate"] == orig["miss_rate"]
        assert belady["ppl"] == pytest.approx(orig["ppl"], rel=1e-5)
        assert by[("cache-prior", "forward", "lru", c, "0.0")]["ppl"] == pytest.approx(orig["ppl"], rel=1e-5)
        assert by[("cache-prior", "forward", "lru", c, "1.0")]["miss_rate"] < orig["miss_rate"]
    # M = K keeps the top-K set: it is original routing
    mr_k = [r for r in pareto if r["routing"]["kind"] == "max-rank" and r["routing"]["max_rank"] == k]
    assert all(r["ppl"] == pytest.approx(by[("original", "forward", "lru", r["cache"]["capacity"], "None")]["ppl"],
                                         rel=1e-5) for r in mr_k) and len(mr_k) == 2
    # reused points: the same key as in pareto, copied rather than recomputed
    pareto_keys = {r["key"] for r in pareto}
    assert files["lifetimes"][0]["key"] in pareto_keys and files["lifetimes"][0]["metrics"]["reused_from"] == "pareto"
    life = files["lifetimes"]
    assert len(life) == 3 and life[2]["routing"]["lam"] == 0.5  # 2 grid points: no front to find a knee on
    assert life[1]["method"] == "replay" and life[1]["cache"]["eviction"] == "belady"
    assert life[1]["miss_rate"] <= life[0]["miss_rate"] and life[1]["ppl"] == pytest.approx(life[0]["ppl"], rel=1e-5)
    init = {(r["cache"]["init"], r["routing"]["lam"]): r for r in files["init"]}
    assert len(init) == 6 and init[("random", None)]["ppl"] == pytest.approx(init[("empty", None)]["ppl"])
    assert init[("random", None)]["cache"]["seed"] == 0
    # a random start holds half the experts: fewer misses over the first tokens than filling an empty cache
    assert init[("empty", None)]["metrics"]["miss_rate_first_tokens"]["16"] > \
        init[("random", None)]["metrics"]["miss_rate_first_tokens"]["16"]
    delta = files["delta"]
    fixed = [r for r in delta if r["routing"]["delta"] is not None]
    assert len(delta) == 4 and len(fixed) == 2
    calib = fixed[0]["metrics"]["delta_calibration"]
    # Δavg is per layer: the calibrated Δ is each layer's own mean range, not one mean over the layers
    assert fixed[0]["routing"]["delta"] == [round(d, 6) for d in calib["per_layer"]] and calib["tokens"] == 45
    assert len(calib["per_layer"]) == lm.cfg.n_moe_layers and min(calib["per_layer"]) > 0
    assert "enwiki-2015-wikitext-style-07" in calib["source"]
    cs = files["cache_size"]
    sel = [r for r in cs if r["method"] == "selection"]
    assert len(sel) == 3 * n  # every size 1..8, three bounds
    for r in sel:
        assert r["ppl"] <= r["metrics"]["ppl_original"] * (1 + r["sweep"]["ppl_bound"]) + 1e-9
        assert r["miss_rate"] <= r["metrics"]["lru_miss_rate"]
    full = [r for r in cs if r["cache"]["capacity"] == n and r["method"] == "replay"]
    assert len(full) == 2 and full[0]["miss_rate"] == full[1]["miss_rate"]  # C = N: compulsory misses only
    # a rerun computes nothing and leaves every file as it was
    before = {name: _lines(os.path.join(out, f"{name}.jsonl")) for name in files}
    assert studies.main(argv) == 0
    assert {name: _lines(os.path.join(out, f"{name}.jsonl")) for name in files} == before
    assert os.path.exists(os.path.join(out, "manifest.json"))


@pytest.mark.slow
def test_sensitivity_and_eviction_studies(lm, data, tmp_path):
    """The two studies with programs of their own (hooks; global replays, prefetch passes); slow because
    of the compilations."""
    out = str(tmp_path / "studies")
    _run(lm, data, out, "pareto,sensitivity,eviction", "--evictions", "lru,least-stale,belady")
    k = lm.cfg.top_k
    pareto_keys = {r["key"] for r in results_file.load_results(os.path.join(out, "pareto.jsonl"))}
    sens = results_file.load_results(os.path.join(out, "sensitivity.jsonl"))
    assert len(sens) == 1 + 2 * k and all(r["cache"] is None and r["miss_rate"] is None for r in sens)
    base = sens[0]["ppl"]
    drop1 = [r for r in sens if r["routing"].get("drop_rank") == 1][0]
    assert drop1["ppl"] > base  # no routed expert at all
    random1 = [r for r in sens if r["routing"].get("random_rank") == 1][0]
    assert random1["ppl"] > base and random1["routing"]["seed"] == 0 and random1["routing"]["kind"] == "original"
    records = results_file.load_results(os.path.join(out, "eviction.jsonl"))
    ev = [r for r in records if r["method"] == "replay"]
    assert len(ev) == len(studies.GLOBAL_SIZES) * 3
    assert all(r["cache"]["scope"] == "global" and r["collision_misses"] is not None for r in ev)
    for size in studies.GLOBAL_SIZES:
        rows = {r["cache"]["eviction"]: r for r in ev if r["sweep"]["cache_size"] == size}
        assert rows["belady"]["miss_rate"] == min(r["miss_rate"] for r in rows.values())
    pf = {(r["sweep"]["prefetch"], r["cache"]["capacity"]): r for r in records if r["method"] == "forward"}
    assert len(pf) == 6 and pf[("off", 4)]["prefetch_precision"] is None and pf[("off", 4)]["key"] in pareto_keys
    for c in (4, 2):
        assert 0 < pf[("top-K", c)]["prefetch_precision"] <= 1 and 0 < pf[("p80", c)]["prefetch_recall"] <= 1
        assert pf[("top-K", c)]["cache"]["prefetch"] == 1.0 and pf[("p80", c)]["cache"]["prefetch_percentile"] == 80
        assert pf[("top-K", c)]["ppl"] == pytest.approx(pf[("off", c)]["ppl"], rel=1e-5)  # prefetch is lossless
        assert pf[("top-K", c)]["bytes_per_token"] > 0


def test_tasks_study(lm, data, tmp_path, capsys, monkeypatch):
    out = str(tmp_path / "studies")
    argv = ["--model", lm.path, "--out", out, "--only", "tasks", "--mmlu-limit", "3", "--gsm8k-limit", "2",
            "--no-progress"]
    fake = _FakeTasks()
    monkeypatch.setattr(sweep, "tasks", fake)
    assert studies.main(argv) == 0
    recs = results_file.load_results(os.path.join(out, "tasks.jsonl"))
    assert [(r["task"], r["routing"]["lam"]) for r in recs] == [
        ("mmlu", 0.0), ("mmlu", 0.3), ("mmlu", 0.5), ("mmlu", 0.9),
        ("gsm8k", 0.0), ("gsm8k", 0.3), ("gsm8k", 0.5), ("gsm8k", 0.9)]
    assert "original routing" in recs[0]["metrics"]["note"] and recs[0]["accuracy"] == 0.25
    assert [c["limit"] for c in fake.calls] == [3] * 4 + [2] * 4
    assert all(c["cache"].size == "4" for c in fake.calls)
    assert recs[1]["accuracy"] == pytest.approx(0.28) and recs[1]["miss_rate"] == pytest.approx(0.425)


def test_knee_of_a_front_is_the_point_farthest_below_its_chord():
    miss = [0.50, 0.30, 0.20, 0.15, 0.10]
    assert studies.knee_index(miss, [100, 101, 103, 110, 140]) == 2
    assert studies.knee_index(miss[:2], [100, 101]) == 1  # too short for a knee: the middle
    assert studies.knee_index([0.3, 0.3, 0.3], [1, 2, 3]) == 1  # flat in miss rate: the middle
    # a front already bending the other way (every trade worse than the chord) has its knee at an end
    assert studies.knee_index(miss, [100, 130, 137, 139, 140]) in (0, 4)


def test_the_paper_protocol_fills_the_unset_flags_and_explicit_flags_win():
    def args(*argv):
        a = studies.build_parser().parse_args(list(argv))
        studies.apply_protocol(a)
        return a.points, a.max_tokens, a.lifetimes_max_tokens, a.cache_sizes

    assert args() == (11, 8184, None, "default")
    assert args("--protocol", "paper") == (50, 65 * 1023, 0, "all")  # 65,536 rounded up to whole chunks of 1023
    assert args("--protocol", "paper", "--context", "257") == (50, 256 * 256, 0, "all")
    assert args("--protocol", "paper", "--points", "7", "--max-tokens", "2046", "--cache-sizes", "4,8") == (7, 2046, 0, "4,8")
    assert studies.cache_sizes("all", 4) == [1, 2, 3, 4] and studies.cache_sizes("8, 2,8", 32) == [2, 8]
    assert studies.cache_sizes("default", 32) == [1, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32]
    for bad, message in (("0,4", "every size must be in 1..N"), ("40", "every size must be in 1..N"),
                         ("x", "takes 'default', 'all'")):
        with pytest.raises(ValueError, match=message):
            studies.cache_sizes(bad, 32)
    assert studies.main(["--cache-sizes", "3,x", "--out", "/nonexistent/never"]) == 2
    a = studies.build_parser().parse_args(["--evictions", "lfu,lru,lfu", "--only", "eviction"])
    assert studies.check_args(a)[1] == ("lfu", "lru")  # a policy given twice runs once, as a size does


def test_the_manifest_reader_takes_the_shipped_manifests_and_refuses_others(tmp_path):
    """The studies merge their settings into ``--out/manifest.json``: the ones this repository ships (and an older
    layout's keys) are read; a damaged or foreign file is a ``Failure`` naming it, never rewritten."""
    root = os.path.join(os.path.dirname(__file__), "..", "results")
    for name in ("studies", "studies-quick-default"):
        assert "studies" in studies.read_manifest(os.path.join(root, name, "manifest.json"))
    assert studies.read_manifest(str(tmp_path / "none.json")) == {}
    for i, text in enumerate(['{"points": 11, "seconds": 3}', '{not json', '[1, 2]', '{"owner": "alice"}',
                              '{"studies": [1]}', '{"studies": {"pareto": 3}}']):
        path = tmp_path / f"m{i}.json"
        path.write_text(text)
        if i == 0:
            assert studies.read_manifest(str(path)) == {"points": 11, "seconds": 3}
            continue
        with pytest.raises(errors.Failure, match=str(path)):
            studies.read_manifest(str(path))
