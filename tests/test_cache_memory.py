"""A cache sized in bytes ("--cache-size 6GiB"): the model turns it into the count of experts it holds —
the experts as held in memory for a simulation, device slots (int8 slots with their scales) when offloading —
and the run is the run of that count."""

from __future__ import annotations

import json

import pytest

import moejax
from moejax.runtime import generate, offload
from moejax.runtime.simulate import CacheConfig

from conftest import get_hf_model

PROMPT = [3, 5, 7, 11]


def _expected(m, budget: int, one: int) -> int:
    return min(m.cfg.n_experts, budget // (m.cfg.n_moe_layers * one))


def test_a_memory_size_runs_as_the_count_it_holds():
    m = moejax.load(get_hf_model("qwen2_moe").folder)
    one = m.cfg.expert_params * 4  # float32 checkpoint
    assert m.cached_expert_bytes() == one
    budget = 3 * m.cfg.n_moe_layers * one + one  # three per layer and a bit
    cc = CacheConfig(size=f"{budget}B")
    assert m.resolve_cache(cc).size == "3" == str(_expected(m, budget, one))
    assert m.cache_memory_bytes(cc) == 3 * m.cfg.n_moe_layers * one <= budget
    got = m.generate(PROMPT, 6, stop_at_eos=False, routing="original", cache=cc)
    ref = m.generate(PROMPT, 6, stop_at_eos=False, routing="original", cache=CacheConfig(size="3"))
    assert got.token_ids == ref.token_ids and got.stats["cache"]["misses"] == ref.stats["cache"]["misses"]
    fwd = m.forward(PROMPT, routing="original", cache=cc)
    assert fwd.stats["misses"] == m.forward(PROMPT, routing="original", cache=CacheConfig(size="3")).stats["misses"]
    glob = m.resolve_cache(CacheConfig(size=f"{5 * one}B", scope="global"))
    assert glob.size == "5"
    with pytest.raises(ValueError, match="less than one expert per MoE layer"):
        m.resolve_cache(CacheConfig(size=f"{one}B"))


@pytest.mark.parametrize("expert_dtype", [None, "int8"])
def test_offloaded_slots_fill_the_memory_size(expert_dtype):
    """The slots the pager allocates are the bytes the size allowed; int8 slots hold about four times the
    float32 checkpoint's experts in the same bytes."""
    folder = get_hf_model("qwen2_moe").folder
    m = moejax.load(folder, offload="flash", expert_dtype=expert_dtype)
    one = m.cached_expert_bytes()
    f32 = m.cfg.expert_params * 4
    assert one == f32 if expert_dtype is None else 0.25 * f32 < one < 0.3 * f32
    budget = int(2.5 * f32 * m.cfg.n_moe_layers)
    cc = CacheConfig(size=f"{budget}B")
    c = _expected(m, budget, one)
    assert c == 2 if expert_dtype is None else c >= 7  # 2.5 float32 experts per layer: 8 int8 ones (at most N = 8)
    out = m.generate(PROMPT, 4, stop_at_eos=False, cache=cc)
    slots = out.stats["offload"]["device_memory"]["slots"]
    assert slots == c * m.cfg.n_moe_layers * one == m.cache_memory_bytes(cc) <= budget
    # simulating the same model (loaded whole) counts the experts as held: the same count for int8
    whole = moejax.load(folder, expert_dtype=expert_dtype)
    assert whole.resolve_cache(cc).size == str(c)
    # a call's own offload settings count its slots
    assert m.resolve_cache(cc, offload.OffloadConfig(store="flash")).size == str(c)


def test_generate_command_takes_a_memory_size(capsys):
    assert generate.main(["--prompt-ids", "5,17", "--max-new-tokens", "2", "--cache-size", "2MB", "--json"]) == 0
    cache = json.loads(capsys.readouterr().out)["stats"]["cache"]
    assert cache["cache_size"] == "2MB" and 1 <= cache["capacity"]
    assert cache["cache_memory_bytes"] <= 2_000_000 < cache["cache_memory_bytes"] / cache["capacity"] * (cache["capacity"] + 1)
    assert generate.main(["--prompt-ids", "5,17", "--max-new-tokens", "2", "--cache-size", "2XB"]) != 0
    assert "unknown unit 'XB'" in capsys.readouterr().err
    assert generate.main(["--prompt-ids", "5,17", "--max-new-tokens", "2", "--cache-size", "100kB"]) != 0
    assert "give at least" in capsys.readouterr().err
