"""Trace format, validation, replay (against the reference simulator and re-routing) and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from support.commands import run_main
from moejax.experts import prior as prior_lib, routing, trace
from moejax.experts import trace_command
from support.reference_cache import simulate

T, L, K, N = 24, 3, 3, 8


@pytest.fixture(scope="module")
def synth():
    return trace.synthetic_trace(T, L, N, K, seed=0, with_logits=True)


def test_save_load_roundtrip(tmp_path, synth):
    path = tmp_path / "t.npz"
    trace.save_trace(path, synth.experts, synth.weights, synth.logits, synth.n_experts, synth.gating)
    back = trace.load_trace(path)
    np.testing.assert_array_equal(back.experts, synth.experts)
    np.testing.assert_array_equal(back.weights, synth.weights)
    np.testing.assert_array_equal(back.logits, synth.logits)
    assert back.n_experts == N and back.gating == synth.gating
    trace.save_trace(tmp_path / "min.npz", synth.experts)  # experts alone is a valid trace
    assert trace.load_trace(tmp_path / "min.npz").weights is None


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a.update(weights=a["weights"][..., :2]), "trace 'weights' has shape (24, 3, 2) but 'experts' is (24, 3, 3)"),
    (lambda a: a.update(logits=a["logits"][:5]), "trace 'logits' has shape (5, 3, 8) but 'experts' is (24, 3, 3)"),
    (lambda a: a.update(experts=a["experts"][0]), "trace 'experts' must be [T, L, K], got shape (3, 3)"),
    (lambda a: a.update(experts=a["experts"].astype(np.float32)), "trace 'experts' must be integer"),
    (lambda a: a.update(experts=np.where(a["experts"] == 0, 8, a["experts"])), "trace 'experts' ids must be in [-1, 7]"),
    (lambda a: a["experts"].__setitem__((1, 2, 1), a["experts"][1, 2, 0]), "trace 'experts' repeats an expert"),
    (lambda a: a.update(n_experts=np.int64(9)), "trace 'logits' has shape (24, 3, 8) but 'n_experts' is 9"),
    (lambda a: a.update(weights=np.full((24, 3, 3), np.nan, np.float32)), "trace 'weights' must be finite"),
    (lambda a: a.update(gating=np.asarray("{not json")), "trace 'gating' is not valid JSON"),
    (lambda a: a.update(extra=np.zeros(3)), "unknown arrays ['extra']"),
    (lambda a: a.update(score_bias=np.zeros((3, 7), np.float32)), "trace 'score_bias' has shape (3, 7); expected"),
    (lambda a: a.update(score_bias=np.full((3, 8), np.inf, np.float32)), "trace 'score_bias' must be finite"),
    (lambda a: a.pop("experts"), "has no 'experts' array"),
])
def test_malformed_trace_names_the_array(tmp_path, synth, mutate, message):
    arrays = {"experts": synth.experts.copy(), "weights": synth.weights, "logits": synth.logits,
              "n_experts": np.int64(N), "gating": np.asarray(json.dumps(synth.gating))}
    mutate(arrays)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(trace.TraceError) as err:
        trace.load_trace(path)
    assert message in str(err.value)


def test_next_use_indices():
    experts = np.asarray([[[0, 1]], [[1, -1]], [[0, 2]]], np.int32)  # T=3, L=1, K=2
    nu = trace.next_use_indices(experts, "layer")
    never = 2**31 - 1
    np.testing.assert_array_equal(nu[:, 0], [[2, 1], [never, never], [never, never]])
    experts2 = np.asarray([[[0], [0]], [[1], [0]]], np.int32)  # T=2, L=2: order (0,0) (0,1) (1,0) (1,1)
    np.testing.assert_array_equal(trace.next_use_indices(experts2, "global")[:, :, 0], [[never, 3], [never, never]])


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_replay_matches_reference(synth, scope):
    cap = "3" if scope == "layer" else "7"
    out = trace.replay(synth, cap, scope, "lru", expert_bytes=10)
    ref = simulate(synth.experts.tolist(), int(cap), scope, "lru")
    assert out["per_layer"]["misses"] == ref["misses"]
    assert out["misses"] == sum(ref["misses"]) and out["accesses"] == T * L * K
    assert out["miss_rate"] == pytest.approx(sum(ref["misses"]) / (T * L * K))
    assert out["bytes_moved"] == out["loads"] * 10


def test_rerouting_with_original_policy_reproduces_the_recorded_trace(synth):
    """The synthetic experts are the softmax top-K of its logits, so re-routing with 'original' must agree."""
    for scope, cap in (("layer", "3"), ("global", "7")):
        state, experts = trace.replay_state(synth, cap, scope, "lru", policy=routing.original())
        np.testing.assert_array_equal(experts, synth.experts)
        recorded, _ = trace.replay_state(synth, cap, scope, "lru")
        np.testing.assert_array_equal(state.stats.misses, recorded.stats.misses)
    prior = trace.replay(synth, "3", "layer", "lru", policy=routing.cache_prior(1.0, 1))
    assert prior["misses"] < trace.replay(synth, "3", "layer", "lru")["misses"]


def test_replay_errors(synth):
    no_logits = trace.validate_trace(synth.experts, synth.weights)
    with pytest.raises(trace.TraceError, match="'logits'"):
        trace.replay(no_logits, "3", policy=routing.original())
    with pytest.raises(trace.TraceError, match="'weights'"):
        trace.replay(trace.validate_trace(synth.experts), "3", eviction="score")
    with pytest.raises(ValueError, match="belady"):
        trace.replay(synth, "3", eviction="belady", policy=routing.original())


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "moejax.trace", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_cli_end_to_end(tmp_path, capsys):
    """``python -m moejax.trace`` in a child process for the first two commands, the rest in process."""
    path = tmp_path / "t.npz"
    made = _cli("synth", path, "--tokens", 40, "--layers", 2, "--experts", 8, "--top-k", 2, "--logits")
    assert made.returncode == 0, made.stderr
    out = _cli("replay", path, "--cache-size", "0.5", "--eviction", "belady", "--json")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    assert stats["accesses"] == 40 * 2 * 2 and stats["capacity"] == 4 and stats["eviction"] == "belady"
    assert len(stats["per_layer"]["miss_rate"]) == 2
    assert stats["miss_rate"] == pytest.approx(stats["misses"] / stats["accesses"])
    _main = lambda *args: run_main(trace_command.main, capsys, *args)  # noqa: E731
    rerouted = _main("replay", path, "--cache-size", 4, "--scope", "global", "--routing", "cache-prior", "--lam", 0.5,
                     "--json")
    assert rerouted.returncode == 0, rerouted.stderr
    assert json.loads(rerouted.stdout)["routing"] == "cache-prior"
    same = _main("replay", path, "--cache-size", 4, "--cache-scope", "global", "--routing", "cache-prior", "--lam", 0.5,
                 "--json")  # the spelling generate and evaluate use
    untimed = lambda r: {k: v for k, v in json.loads(r.stdout).items() if k != "seconds"}  # noqa: E731
    assert same.returncode == 0 and untimed(same) == untimed(rerouted) and untimed(same)["scope"] == "global"
    # the kind alone routes with the defaults of generate and evaluate (λ = 0.5, p = 0.9), not as original
    implicit = _main("replay", path, "--cache-size", 4, "--cache-scope", "global", "--routing", "cache-prior", "--json")
    assert implicit.returncode == 0 and untimed(implicit) == untimed(rerouted)
    plain = untimed(_main("replay", path, "--cache-size", 4, "--cache-scope", "global", "--json"))
    assert plain["misses"] != untimed(rerouted)["misses"]
    for kind, value in (("cumsum", "0.9"),):
        alone, given = (untimed(_main("replay", path, "--cache-size", 4, "--routing", kind, *extra, "--json"))
                        for extra in ([], ["--cumsum-p", value]))
        assert alone == given
    table = _main("replay", path, "--cache-size", 3)
    assert table.returncode == 0 and "miss_rate" in table.stdout and "layer" in table.stdout
    bad = _main("replay", path, "--cache-size", "9")
    assert bad.returncode == 2 and "between 1 and N=8" in bad.stderr
    np.savez(tmp_path / "bad.npz", experts=np.zeros((4, 2), np.int32))
    broken = _main("replay", tmp_path / "bad.npz", "--cache-size", 1)
    assert broken.returncode == 1 and "trace 'experts' must be [T, L, K]" in broken.stderr


def test_synth_names_the_file_it_wrote(tmp_path, capsys):
    """np.savez appends .npz: `trace synth s.txt` wrote s.txt.npz but said "wrote s.txt"."""
    assert trace_command.main(["synth", str(tmp_path / "s.txt"), "--tokens", "8", "--layers", "1", "--experts", "4",
                       "--top-k", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 's.txt.npz'}:")
    assert os.listdir(tmp_path) == ["s.txt.npz"]


def test_replay_reroutes_with_a_learned_prior(tmp_path, capsys):
    """``replay --routing learned-prior --prior PATH`` (listed in --help, and without --prior it could never
    run): a prior at its initialisation adds zero to the logits, so it routes exactly as original routing."""
    path = str(tmp_path / "t.npz")
    assert trace_command.main(["synth", path, "--tokens", "30", "--layers", "2", "--experts", "8", "--top-k", "2",
                       "--logits"]) == 0
    prior = str(tmp_path / "p")
    prior_lib.save_prior(prior, prior_lib.init_params(jax.random.key(0), 2, 8, 4), {"top_k": 2})
    capsys.readouterr()

    def replay(*extra):
        assert trace_command.main(["replay", path, "--cache-size", "4", "--json", *extra]) == 0
        return {k: v for k, v in json.loads(capsys.readouterr().out).items() if k not in ("seconds", "routing")}

    assert replay("--routing", "learned-prior", "--prior", prior) == replay("--routing", "original")
    assert trace_command.main(["replay", path, "--cache-size", "4", "--routing", "learned-prior"]) == 2
    assert "--prior" in capsys.readouterr().err
    assert trace_command.main(["replay", path, "--cache-size", "4", "--prior", prior]) == 2
    assert "--prior only applies" in capsys.readouterr().err


@pytest.mark.parametrize("name, kind", [("deepseek_v3", "sigmoid-group-limited"), ("ernie4_5_moe", "softmax-biased")])
def test_a_selection_biased_trace_carries_its_biases_and_replays_the_live_routing(tmp_path, name, kind):
    """DeepSeek-V3 chooses by sigmoid score + a per-layer bias that is a weight of the model (ERNIE-4.5 by softmax
    probability + bias): its traces store the biases (``score_bias``), and re-routing the recorded logits through
    the same cache and policy reproduces the live pass's experts and misses. Without the biases the same replay
    chooses differently (the test can fail)."""
    from support.hf_models import get_moejax_model

    from moejax.models import gating as gating_lib
    from moejax.runtime import simulate as simulate_lib

    m = get_moejax_model(name)
    toks = np.random.RandomState(3).randint(3, 96, size=32).astype(np.int32)
    policy = routing.make_policy("cache-prior", m.cfg.top_k, lam=0.5)
    live = m.forward(toks, routing=policy, cache=simulate_lib.CacheConfig("0.5", "layer", "lru"))
    swap = lambda a: np.swapaxes(np.asarray(a), 0, 1)  # noqa: E731  [L, T, ...] -> [T, L, ...]
    path = tmp_path / f"{name}.npz"
    trace.save_trace(path, swap(live.experts), swap(live.weights), swap(live.router_logits), m.cfg.n_experts,
                     gating_lib.spec(m.cfg.gating), m.selection_biases)
    tr = trace.load_trace(path)
    assert tr.gating["kind"] == kind and tr.score_bias.shape == (m.cfg.n_moe_layers, m.cfg.n_experts)
    state, experts = trace.replay_state(tr, "0.5", "layer", "lru", policy=policy)
    np.testing.assert_array_equal(experts, swap(live.experts))
    assert int(np.asarray(state.stats.misses).sum()) == live.stats["misses"]
    unbiased = trace.validate_trace(tr.experts, tr.weights, tr.logits, tr.n_experts, tr.gating)
    assert not np.array_equal(trace.replay_state(unbiased, "0.5", "layer", "lru", policy=policy)[1], experts)
