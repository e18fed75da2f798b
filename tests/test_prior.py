"""The learned cache prior: routing kind ``learned-prior``, its training, checkpoints and CLI.

Properties: a zero output layer is original routing bit for bit (router step and the model, both cache
scopes); the bias only re-ranks (weights from the original logits); jit = no-jit and vmap over a stack of
priors = loop; the layer-parallel router slices a per-layer prior to the TRUE layer (a prior that biases
only layer 1 changes only layer 1, on both paths, which agree); training lowers the loss on a fixed seed;
checkpoints round-trip and bad ones fail clearly; ``--routing learned-prior --prior PATH`` end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.shipped_data import WIKITEXT2_TEST
from support.train_fixtures import write_corpus
from hypothesis import given, settings
from hypothesis import strategies as st

import moejax
from moejax.models.gating import GroupLimited, SoftmaxTopK, SparseMixer, original_routing
from moejax.experts import cache, prior as prior_lib, router, routing
from moejax.runtime import generate, simulate
from moejax.evaluation import evaluate
from moejax.training import train_prior

GATINGS = {
    "softmax-norm": SoftmaxTopK(16, 4, True),
    "group-limited": GroupLimited(16, 4, False, 1.0, n_group=4, topk_group=2),
    "sparsemixer": SparseMixer(16, 2, 0.01),
}


H = 16  # hidden units of every model-level prior here: same shapes, so one compiled forward serves them all


@pytest.fixture(scope="module")
def model():
    """The default model in float32: the layer-parallel and token-sequential passes then agree exactly."""
    return moejax.load("default", dtype=jnp.float32)


def _tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(3, 8000, size=n).astype(np.int32)


def _random_prior(seed: int, n_layers: int, n_experts: int, scale: float = 1.0, hidden: int = 16) -> dict:
    p = prior_lib.init_params(jax.random.key(seed), n_layers, n_experts, hidden, zero_output=False)
    return {**p, "w2": p["w2"] * scale, "b2": jax.random.normal(jax.random.key(seed + 1), p["b2"].shape) * scale}


def _only_layer(p: dict, layer: int) -> dict:
    """The same prior with every layer's output zeroed except ``layer`` (b = 0 elsewhere)."""
    keep = (jnp.arange(p["w2"].shape[0]) == layer)
    return {**p, "w2": p["w2"] * keep[:, None, None], "b2": p["b2"] * keep[:, None]}


_choose = jax.jit(router.choose, static_argnames=("gating",))


# --------------------------------------------------------------------------------------- router step


@pytest.mark.parametrize("name", sorted(GATINGS))
@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_zero_output_layer_is_original_routing_bit_for_bit(name, seed):
    g = GATINGS[name]
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.standard_normal(16) * 3.0, jnp.float32)
    mask = jnp.asarray(rng.random(16) < 0.5)
    rs = routing.observe(routing.init_routing_state(2), 1, z)
    zero = prior_lib.init_params(jax.random.key(seed % 1000), 2, 16, 8)  # random first layer, zero output
    assert float(jnp.abs(zero["w1"]).sum()) > 0
    e0, w0, v0 = _choose(z, mask, rs, routing.original(), gating=g)
    e1, w1, v1 = _choose(z, mask, rs, routing.make_policy("learned-prior", g.top_k, prior=zero), gating=g,
                         layer=1)
    np.testing.assert_array_equal(e0, e1)
    np.testing.assert_array_equal(np.asarray(w0).view(np.uint32), np.asarray(w1).view(np.uint32))
    np.testing.assert_array_equal(v0, v1)
    # a non-zero prior re-ranks, but the weights stay the architecture's weights of the ORIGINAL logits
    big = _random_prior(seed % 1000, 2, 16, scale=5.0, hidden=8)
    e2, w2, v2 = _choose(z, mask, rs, routing.make_policy("learned-prior", g.top_k, prior=big), gating=g, layer=1)
    ranked = np.asarray(g.ranking(z))
    chosen = sorted(np.asarray(e2)[np.asarray(v2)].tolist(), key=lambda x: ranked.tolist().index(x))
    expected = g.weights(z, jnp.asarray(chosen, jnp.int32), jnp.ones(len(chosen), bool))
    got = dict(zip(np.asarray(e2).tolist(), np.asarray(w2).tolist()))
    for x, wx in zip(chosen, np.asarray(expected).tolist()):
        assert got[x] == pytest.approx(wx, rel=1e-6, abs=1e-7)
    # the ranking it uses is the order of z + b
    zb = prior_lib.biased_logits(big, 1, z, mask)
    assert set(np.asarray(e2).tolist()) == set(np.asarray(g.ranking(zb))[: g.top_k].tolist())


@pytest.mark.parametrize("scope", [pytest.param("layer", marks=pytest.mark.numerics), "global"])
def test_zero_prior_reproduces_original_routing_through_the_model(model, scope):
    """Layer scope (bit for bit the plain forward) in the numerics pass; global scope (token-sequential, compared
    up to rounding) in the main pass."""
    toks = _tokens(40, 1)
    cfg = simulate.CacheConfig("0.5" if scope == "layer" else "0.25", scope)
    zero = prior_lib.init_params(jax.random.key(3), model.cfg.n_moe_layers, model.cfg.n_experts, H)
    learned = model.forward(toks, routing=routing.make_policy("learned-prior", model.cfg.top_k, prior=zero),
                            cache=cfg)
    assert 0 < learned.stats["misses"] < learned.stats["accesses"]
    # every step chose exactly the architecture's own top-K of the logits it saw, with their own weights
    experts, weights = original_routing(model.cfg.gating, jnp.asarray(learned.router_logits))
    np.testing.assert_array_equal(learned.experts, experts)
    np.testing.assert_allclose(learned.weights, weights, rtol=1e-6, atol=0)
    if scope == "layer":  # same pass as the plain forward: bit for bit (global scope is token-sequential)
        plain = model.forward(toks)  # the architecture's own routing, no cache at all
        np.testing.assert_array_equal(plain.experts, learned.experts)
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(plain.weights.view(np.uint32), learned.weights.view(np.uint32))
        else:  # XLA:GPU fuses the two programs' softmaxes differently: 9 ulps apart on an H200
            np.testing.assert_allclose(plain.weights, learned.weights, rtol=1e-6, atol=0)
        np.testing.assert_allclose(plain.logits, learned.logits, atol=1e-5)


# ------------------------------------------------------------------------------ jit, vmap, layer slicing


def _synthetic(seed=2, t=16, n_layers=3, n=8):
    z = jax.random.normal(jax.random.key(seed), (t, n_layers, n)) * 3.0
    return z, cache.init_cache(n_layers, n, 3, "layer", "lru"), routing.init_routing_state(n_layers)


def test_policy_jits_and_vmaps_over_stacked_priors():
    g = SoftmaxTopK(8, 2, True)
    z, cs0, rs0 = _synthetic()
    pols = [routing.make_policy("learned-prior", 2, prior=_random_prior(s, 3, 8, scale=2.0)) for s in range(3)]
    # jit = no-jit for the policy's choice (the router step's pure core), token by token at every layer
    rs = routing.observe(rs0, 2, z[0, 2])
    mask = jnp.arange(8) % 3 == 0
    for t in range(4):
        eager = router.choose(z[t, 2], mask, rs, pols[0], g, 2)
        chex.assert_trees_all_equal(eager, _choose(z[t, 2], mask, rs, pols[0], gating=g, layer=2))
    par = jax.jit(router.route_layers_parallel, static_argnames=("gating",))
    stacked = routing.stack_policies(pols)
    batched = jax.jit(jax.vmap(lambda p: router.route_layers_parallel(z, cs0, rs0, p, g)))(stacked)
    outs = []
    for i, p in enumerate(pols):
        single = par(z, cs0, rs0, p, gating=g)
        for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(batched)):
            np.testing.assert_array_equal(a, b[i])
        outs.append(np.asarray(single[0]))
    assert not np.array_equal(outs[0], outs[1]), "different priors should route differently"


def test_prior_is_sliced_to_the_true_layer_in_both_router_paths():
    g = SoftmaxTopK(8, 2, True)
    z, cs0, rs0 = _synthetic(5)
    only1 = routing.make_policy("learned-prior", 2, prior=_only_layer(_random_prior(7, 3, 8, scale=4.0), 1))
    orig = jax.jit(router.route_layers_parallel, static_argnames=("gating",))(z, cs0, rs0, routing.original(), g)
    par = jax.jit(router.route_layers_parallel, static_argnames=("gating",))(z, cs0, rs0, only1, g)
    seq = jax.jit(router.route_sequence, static_argnames=("gating",))(z, cs0, rs0, only1, g)
    chex.assert_trees_all_equal(par, seq)
    e0, e1 = np.asarray(orig[0]), np.asarray(par[0])
    np.testing.assert_array_equal(e0[:, [0, 2]], e1[:, [0, 2]])
    assert (e0[:, 1] != e1[:, 1]).any()
    # one layer at a time, as the model's router hook calls it with the true layer index
    cs, rs = cs0, rs0
    route_tokens = jax.jit(router.route_tokens, static_argnames=("gating",))
    for layer in range(3):
        e, _, _, cs, rs = route_tokens(z[:, layer], layer, cs, rs, only1, gating=g)
        np.testing.assert_array_equal(e, e1[:, layer])


def test_prior_biasing_only_layer_one_changes_only_layer_one_in_the_model(model):
    toks = _tokens(40, 2)
    cfg = simulate.CacheConfig("0.5")
    p = _only_layer(_random_prior(11, model.cfg.n_moe_layers, model.cfg.n_experts, scale=3.0, hidden=H), 1)
    pol = routing.make_policy("learned-prior", model.cfg.top_k, prior=p)
    orig = model.forward(toks)  # original routing (no cache: the choice does not depend on it)
    par = model.forward(toks, routing=pol, cache=cfg)
    seq = model.forward(toks, routing=pol, cache=cfg, sequential=True)
    np.testing.assert_array_equal(par.experts, seq.experts)
    np.testing.assert_array_equal(par.hits, seq.hits)
    np.testing.assert_array_equal(par.experts[0], orig.experts[0])
    assert (par.experts[1] != orig.experts[1]).any()
    # every other layer routes its own (changed downstream) logits exactly as original routing would
    k = model.cfg.top_k
    for layer in (i for i in range(model.cfg.n_moe_layers) if i != 1):
        top = np.asarray(model.cfg.gating.ranking(jnp.asarray(par.router_logits[layer])))[:, :k]
        np.testing.assert_array_equal(np.sort(par.experts[layer], -1), np.sort(top, -1))


# ------------------------------------------------------------------------------------------ training


def test_training_reduces_the_loss_on_a_fixed_seed():
    rng = np.random.default_rng(0)
    g = SoftmaxTopK(8, 2, True)
    z = jnp.asarray(rng.standard_normal((512, 2, 8)) * 2.0, jnp.float32)
    m = jnp.asarray(rng.random((512, 2, 8)) < 0.5)
    up, down = train_prior.targets(z, m, g)
    assert not bool((up & down).any()) and bool(up.any()) and bool(down.any())
    init = prior_lib.init_params(jax.random.key(0), 2, 8, 16)
    before = train_prior.evaluate_loss(init, 1.0, z, up, down, m)
    assert before["kl"] == pytest.approx(0.0, abs=1e-6)  # zero output: q = p
    params, curve = train_prior.train_one(init, 1.0, z, up, down, m, steps=150, batch=128, lr=1e-2,
                                          weight_decay=0.0, seed=0, log=lambda *a: None)
    after = train_prior.evaluate_loss(params, 1.0, z, up, down, m)
    assert after["loss"] < before["loss"] - 0.05
    assert after["cache"] < before["cache"] and after["kl"] > 0
    # more weight on the cache term moves further from the original distribution
    strong, _ = train_prior.train_one(init, 10.0, z, up, down, m, steps=150, batch=128, lr=1e-2,
                                      weight_decay=0.0, seed=0, log=lambda *a: None)
    assert train_prior.evaluate_loss(strong, 1.0, z, up, down, m)["kl"] > after["kl"]


def test_train_prior_cli_records_trains_saves_and_resumes(model, tmp_path, capsys):
    L, N = model.cfg.n_moe_layers, model.cfg.n_experts
    out = tmp_path / "priors"
    write_corpus(str(tmp_path / "corpus"), n_shards=8)  # shard 07, the last, is the held-out one
    argv = ["--out", str(out), "--corpus", str(tmp_path / "corpus"), "--tokens", "128", "--context", "64",
            "--steps", "30", "--batch", "32", "--weights", "0.5", "--hidden", "8", "--lr", "1e-2", "--json"]
    assert train_prior.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    (entry,) = res["priors"]
    meta = prior_lib.read_sidecar(entry["path"])
    assert meta["arch"] == {"kind": "mlp2", "activation": "relu", "inputs": ["cache_mask", "logits_centred"],
                            "n_experts": N, "n_layers": L, "hidden": 8, "per_layer": True}
    assert meta["cache"]["capacity"] == N // 2 and meta["weight"] == 0.5 and meta["steps"] == 30
    assert meta["loss"]["after"]["train"]["loss"] < meta["loss"]["before"]["train"]["loss"]
    assert meta["data"]["shards"] == ["enwiki-2015-wikitext-style-00.txt.gz"]
    with np.load(out / "record.npz") as f:
        assert f["z"].shape == f["m"].shape == (128, L, N)
        occupancy = f["m"].sum(-1)
    assert occupancy[0].max() == 0 and occupancy.max() == N // 2  # empty at the start, then at capacity
    params = prior_lib.load_prior(entry["path"], n_layers=L, n_experts=N, top_k=model.cfg.top_k)
    assert prior_lib.shape_of(params) == (L, N, 8)
    assert train_prior.main(argv + ["--resume"]) == 0
    assert json.loads(capsys.readouterr().out)["priors"][0]["skipped"] is True
    # a damaged record is reported (one line, no traceback) and recorded again
    good = (out / "record.npz").read_bytes()
    (out / "record.npz").write_bytes(good[: len(good) // 2])
    assert train_prior.main(argv + ["--resume"]) == 0
    captured = capsys.readouterr()
    assert "damaged routing record ignored" in captured.err and "Traceback" not in captured.err
    with np.load(out / "record.npz") as f:
        assert f["z"].shape == (128, L, N)
    assert train_prior.main(["--out", str(out), "--corpus", str(tmp_path / "corpus"), "--shards", "7"]) == 2
    assert "held-out" in capsys.readouterr().err


# --------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_is_atomic(tmp_path):
    p = _random_prior(1, 4, 32, hidden=8)
    path = prior_lib.save_prior(str(tmp_path / "w1"), p, {"weight": 1.0, "top_k": 4})
    back = prior_lib.load_prior(path, n_layers=4, n_experts=32, top_k=4)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, p), jax.tree.map(np.asarray, back))
    p2 = _random_prior(2, 4, 32, hidden=8)
    prior_lib.save_prior(path, p2, {"weight": 2.0})  # replaces the folder as a whole
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, p2), jax.tree.map(np.asarray, prior_lib.load_prior(path)))
    assert prior_lib.read_sidecar(path)["weight"] == 2.0
    assert sorted(os.listdir(tmp_path)) == ["w1"]  # no temporary folders left behind
    with pytest.raises(prior_lib.PriorError, match="already exists"):
        prior_lib.save_prior(path, p2, overwrite=False)


def test_bad_checkpoints_and_mismatches_fail_clearly(model, tmp_path):
    with pytest.raises(prior_lib.PriorError, match="no learned-prior checkpoint"):
        prior_lib.load_prior(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(prior_lib.PriorError, match="prior.json is missing"):
        prior_lib.load_prior(str(tmp_path / "empty"))
    path = prior_lib.save_prior(str(tmp_path / "n16"), _random_prior(0, 4, 16, hidden=8), {"top_k": 4})
    with pytest.raises(prior_lib.PriorError, match="N=16 experts .* N=32"):
        prior_lib.load_prior(path, n_layers=4, n_experts=32)
    with pytest.raises(prior_lib.PriorError, match="4 MoE layers but the model has 6"):
        prior_lib.load_prior(path, n_layers=6)
    with pytest.raises(prior_lib.PriorError, match="top-4 .* top-2"):
        prior_lib.load_prior(path, top_k=2)
    # a prior for another N or layer count fails when the model routes with it, not silently
    L, N, K = model.cfg.n_moe_layers, model.cfg.n_experts, model.cfg.top_k
    wrong = routing.make_policy("learned-prior", K, prior=_random_prior(0, L, 2 * N, hidden=8))
    with pytest.raises(ValueError, match=f"N={2 * N} experts"):
        model.forward(_tokens(8), routing=wrong, cache=simulate.CacheConfig("0.5"))
    more = routing.make_policy("learned-prior", K, prior=_random_prior(0, L + 1, N, hidden=8))
    with pytest.raises(ValueError, match=f"{L + 1} MoE layers but the model has {L}"):
        model.forward(_tokens(8), routing=more, cache=simulate.CacheConfig("0.5"))
    # corrupted sidecar / params
    side = os.path.join(path, "prior.json")
    meta = json.load(open(side))
    json.dump({**meta, "arch": {**meta["arch"], "hidden": 9}}, open(side, "w"))
    with pytest.raises(prior_lib.PriorError, match="cannot restore|stored arrays have"):
        prior_lib.load_prior(path)
    json.dump({**meta, "format": "something-else"}, open(side, "w"))
    with pytest.raises(prior_lib.PriorError, match="not a moejax-learned-prior sidecar"):
        prior_lib.load_prior(path)
    with pytest.raises(ValueError, match="needs prior="):
        routing.make_policy("learned-prior", 4)
    with pytest.raises(ValueError, match="only apply to routing kind 'learned-prior'"):
        routing.make_policy("cache-prior", 4, lam=0.5, prior=_random_prior(0, 4, 32))
    with pytest.raises(prior_lib.PriorError, match="keys"):
        routing.make_policy("learned-prior", 4, prior={"w1": jnp.zeros((1, 2, 3))})


# ------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def zero_prior_path(tmp_path_factory, model):
    p = prior_lib.init_params(jax.random.key(0), model.cfg.n_moe_layers, model.cfg.n_experts, H)
    return prior_lib.save_prior(str(tmp_path_factory.mktemp("prior") / "zero"), p, {"top_k": model.cfg.top_k})


def test_evaluate_cli_with_learned_prior(zero_prior_path, tmp_path, capsys):
    data = tmp_path / "test.txt"
    data.write_text(open(WIKITEXT2_TEST, encoding="utf-8").read()[:4000])
    common = ["--model", "default", "--data", str(data), "--context", "64", "--max-tokens", "126",
              "--cache-size", "0.5", "--json"]
    assert evaluate.main(common + ["--routing", "learned-prior", "--prior", zero_prior_path]) == 0
    learned = json.loads(capsys.readouterr().out)
    assert evaluate.main(common + ["--routing", "original"]) == 0
    orig = json.loads(capsys.readouterr().out)
    assert learned["tokens"] == 126 and learned["chunks"] == 2 and 0 < learned["miss_rate"] < 1
    assert learned["ppl"] == orig["ppl"] and learned["miss_rate"] == orig["miss_rate"]  # zero prior = original
    assert evaluate.main(common + ["--routing", "learned-prior"]) == 2
    assert "--routing learned-prior needs --prior PATH" in capsys.readouterr().err
    assert evaluate.main(common + ["--routing", "learned-prior", "--prior", str(tmp_path / "nope")]) == 2
    assert "no learned-prior checkpoint" in capsys.readouterr().err


def test_generate_cli_with_learned_prior(zero_prior_path, model, tmp_path, capsys):
    argv = ["--model", "default", "--prompt", "The history of", "--max-new-tokens", "3", "--json"]
    assert generate.main(argv + ["--routing", "learned-prior", "--prior", zero_prior_path]) == 0
    learned = json.loads(capsys.readouterr().out)
    assert learned["stats"]["cache"]["routing"] == "learned-prior"
    assert learned["stats"]["cache"]["prior"] == zero_prior_path
    assert len(learned["token_ids"]) == 3 and learned["stats"]["cache"]["accesses"] > 0
    assert generate.main(argv + ["--prior", zero_prior_path]) == 2
    assert "--prior only applies to --routing learned-prior" in capsys.readouterr().err
    L, N = model.cfg.n_moe_layers, model.cfg.n_experts
    wrong = prior_lib.save_prior(str(tmp_path / "n2"), _random_prior(0, L, 2 * N, hidden=8), {"top_k": model.cfg.top_k})
    assert generate.main(argv + ["--routing", "learned-prior", "--prior", wrong]) == 2
    assert f"trained for N={2 * N} experts" in capsys.readouterr().err


def test_a_prior_save_that_really_fails_leaves_nothing_and_prints_one_error(tmp_path):
    """A prior whose save orbax really fails (a file-size limit in the child: writes past 64 KiB fail as on a
    full disk): the command-level error only, no orbax or tensorstore tracebacks, and neither the prior's
    folder nor any temporary folder left (orbax's threads are waited for before the folder is removed)."""
    child = ("import resource, jax; resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))\n"
             "from moejax.experts import prior\n"
             "p = prior.init_params(jax.random.key(0), 4, 64, hidden=256)\n"
             "try:\n"
             f"    prior.save_prior({str(tmp_path / 'w1')!r}, p)\n"
             "except ValueError as e:\n"
             "    print('error:', type(e).__name__, str(e)[:300])\n")
    env = {**os.environ, "MOEJAX_COMPILE_CACHE": "off"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=300)
    want = f"error: Failure could not write the prior {tmp_path / 'w1'}"
    assert proc.stdout.startswith(want), proc.stdout + proc.stderr
    assert not any(s in proc.stderr for s in ("Traceback", "ERROR", "never awaited")), proc.stderr
    assert os.listdir(tmp_path) == []
