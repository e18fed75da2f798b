"""A decode step computes while its misses are read (``OffloadConfig(overlap=True)``, the default): after the
router step, stage B is split in two. The experts already resident (in slots none of the step's pages write)
and the shared experts run first, dispatched before the host reads the misses, so they compute while the
pages are read or copied; the paged experts and the weighted sum follow. The sum must be the one-stage sum,
bit for bit: any difference in a hidden state would show in the next layer's router logits, compared here."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import moejax
from support.commands import run_main
from support.hf_models import get_hf_model
from moejax.runtime import generate, host_paging, offload
from moejax.runtime.simulate import CacheConfig

PROMPT = np.arange(3, 40, dtype=np.int32)


def _generate(name: str, overlap: bool, cache: CacheConfig, dtype=None, **offload_kw):
    m = moejax.load(get_hf_model(name).folder, dtype=dtype,
                    offload=offload.OffloadConfig(store="flash", overlap=overlap, **offload_kw))
    return m.generate(PROMPT, 10, routing="cache-prior", cache=cache, stop_at_eos=False)


@pytest.mark.numerics
@pytest.mark.parametrize("name,dtype,cache,kw", [
    ("qwen2_moe", jnp.bfloat16, CacheConfig(size="0.5", prefetch=1.0), {}),  # gated shared expert, prefetch
    pytest.param("deepseek_v2_lite", jnp.bfloat16, CacheConfig(size="0.5"), {},  # two shared experts, scaled
                 marks=pytest.mark.slow),  # CI time
    ("olmoe_clip", None, CacheConfig(size="0.3", scope="global"), {}),  # one pool; no shared expert
    pytest.param("olmoe_clip", None, CacheConfig(size="4", miss="cascade", miss_rank=(2,), cascade_bits=(4,)), {},
                 marks=pytest.mark.slow),  # low-bit copies
    ("qwen3_moe", None, CacheConfig(size="0.5"), {"page_writes": "copy", "bandwidth_gbps": 5.0}),  # device_put
])
def test_overlapped_decode_equals_one_stage_decode(name, dtype, cache, kw):
    one, split = _generate(name, False, cache, dtype, **kw), _generate(name, True, cache, dtype, **kw)
    assert one.token_ids == split.token_ids
    for k in ("experts", "weights", "hits", "logits"):  # router logits: every MoE layer's input, exactly
        np.testing.assert_array_equal(one.trace()[k], split.trace()[k], err_msg=k)
    a, b = one.stats["offload"], split.stats["offload"]
    for k in ("bytes_moved", "demand_loads", "prefetch_loads", "low_bit_loads"):
        assert a[k] == b[k], k
    assert a["overlapped_steps"] == 0 < b["overlapped_steps"]
    assert not a["overlap"] and b["overlap"]


def _pager(name: str, dtype):
    m = moejax.load(get_hf_model(name).folder, dtype=dtype)
    cache = CacheConfig(size="6")
    pager = host_paging.HostPager(m.params, m.cfg, m.router_state("original", cache), offload.OffloadConfig())
    return m.cfg, pager


_PAGERS: dict = {}


@pytest.mark.numerics
@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["qwen2_moe", "olmoe_clip", "gpt_oss"]), dtype=st.sampled_from(["float32", "bfloat16"]),
       data=st.data())
def test_split_stage_b_is_the_one_stage_b_bit_for_bit(name, dtype, data):
    """Any split of the K positions into early and late, any invalid positions, any weights (float32: the sum's
    own rounding shows; bfloat16: the dtype models decode in); GPT-OSS's expert biases by the real experts."""
    if (name, dtype) not in _PAGERS:
        _PAGERS[name, dtype] = _pager(name, jnp.dtype(dtype))
    cfg, pager = _PAGERS[name, dtype]
    K, C, D = cfg.top_k, pager.slots[0].n_experts, cfg.hidden_size
    seed = data.draw(st.integers(0, 2**31 - 1))
    early = np.array(data.draw(st.lists(st.booleans(), min_size=K, max_size=K)))
    valid = np.array(data.draw(st.lists(st.booleans(), min_size=K, max_size=K)))
    rng = np.random.default_rng(seed)
    slot_ids = jnp.asarray(rng.permutation(C)[:K], jnp.int32)
    experts = jnp.asarray(np.where(valid, rng.integers(0, cfg.n_experts, K), -1), jnp.int32)
    weights = jnp.asarray(rng.uniform(0, 1, K), jnp.float32)
    tier = jnp.zeros((K,), jnp.int32)
    x = jnp.asarray(rng.standard_normal((1, D)), dtype)
    h = jnp.asarray(rng.standard_normal((1, D)), dtype)
    layer = pager.params["layers"][pager.moe_ids[0]]["moe"]
    slots = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape) * 0.2, a.dtype), pager.slots[0])
    one = host_paging._stage_b(layer, cfg, x, h, slots, {}, experts, weights, tier, slot_ids, ())
    early_j = jnp.asarray(early & valid)
    rows, shared = host_paging._stage_b_early(layer, cfg, h, slots, jnp.where(early_j, slot_ids, -1), experts)
    split = host_paging._stage_b_late(layer, cfg, x, h, slots, {}, experts, weights, tier, slot_ids, early_j, rows,
                                      shared, ())
    np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), np.asarray(split.astype(jnp.float32)))


def test_the_warm_up_compiles_both_forms_of_stage_b():
    """A step splits stage B when it misses some of its experts, else runs it whole: the warm-up compiles both,
    whatever its own steps miss (here: all, then none, and no shared expert), so no decode step compiles
    (slot count 9: programs no other test compiles)."""
    m = moejax.load(get_hf_model("olmoe_clip").folder, offload="flash")
    stages = (host_paging._stage_b, host_paging._stage_b_early, host_paging._stage_b_late)
    before = [s._cache_size() for s in stages]
    cache = CacheConfig(size="9")
    m.generate(PROMPT, max_new_tokens=1, stop_at_eos=False, cache=cache, routing="cache-prior")
    compiled = [s._cache_size() - b for s, b in zip(stages, before)]
    assert compiled == [1, 1, 1], compiled
    out = m.generate(PROMPT[:5], max_new_tokens=12, stop_at_eos=False, cache=cache, routing="cache-prior")
    assert out.stats["offload"]["overlapped_steps"] > 0
    assert [s._cache_size() - b for s, b in zip(stages, before)] == compiled  # nothing new while decoding


def test_generate_cli_overlap_flag(capsys):
    """``--overlap`` on the command line (``generate.main`` in process: other tests run ``python -m`` itself)."""
    folder = get_hf_model("olmoe_clip").folder
    cmd = ["--model", folder, "--prompt-ids", "5,17,33,8,61", "--max-new-tokens", "6", "--ignore-eos", "--cache-size",
           "6", "--json"]
    runs = {}
    for flag in ("on", "off"):
        out = run_main(generate.main, capsys, *cmd, "--offload", "--overlap", flag)
        assert out.returncode == 0, out.stderr
        runs[flag] = json.loads(out.stdout)
    assert runs["on"]["token_ids"] == runs["off"]["token_ids"]
    assert runs["on"]["stats"]["offload"]["overlap"] and not runs["off"]["stats"]["offload"]["overlap"]
    assert runs["off"]["stats"]["offload"]["overlapped_steps"] == 0
    bad = run_main(generate.main, capsys, *cmd, "--overlap", "off")
    assert bad.returncode == 2 and "--overlap" in bad.stderr and "needs --offload" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = run_main(generate.main, capsys, *cmd, "--offload", "--paging", "jit", "--overlap", "on")
    assert bad.returncode == 2 and "in-jit paging" in bad.stderr and "Traceback" not in bad.stderr
