"""A cache sized in bytes ("--cache-size 6GiB"): the model turns it into the count of experts it holds —
the experts as held in memory for a simulation, device slots (int8 slots with their scales) when offloading —
and the run is the run of that count."""

from __future__ import annotations

import json

import re

import pytest

import moejax
from moejax.base import memory
from moejax.models import checkpoint, weights
from moejax.runtime import api, generate, offload
from moejax.runtime.simulate import CacheConfig

from support.hf_models import get_hf_model

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


# ------------------------------------------------------------------ what the memory left holds (offload)


def _offloaded(store="flash"):
    return moejax.load(get_hf_model("qwen2_moe").folder, offload=store)


class _Host:
    """The device ``memory_plan`` reads when it is the host (the CPU backend): its platform only."""

    platform, device_kind = "cpu", "cpu"


def _on_host(monkeypatch):
    """The plan's device is the host, whatever the backend: these tests are about the host's memory (with a GPU
    visible the plan reads the GPU's allocator instead; the H200's suite failed them on that)."""
    monkeypatch.setattr(api.distributed, "local_device", lambda: _Host())


def _free(monkeypatch, nbytes, where="the memory cgroup /x (limit 1.0 GiB)"):
    """The host's free memory is ``nbytes`` (and the plan's device is the host)."""
    _on_host(monkeypatch)
    monkeypatch.setattr(api.host_memory, "headroom", lambda swap=False: (nbytes, where))


def test_auto_takes_the_most_slots_the_free_memory_holds(monkeypatch):
    _on_host(monkeypatch)
    m = _offloaded()
    plan = m.memory_plan(CacheConfig(), None, 64)
    assert plan["fixed"] == plan["kv_cache"] + plan["staging"] + plan["reserve"] and plan["host_store"] == 0
    assert plan["slot_set"] == m.cfg.n_moe_layers * m.cached_expert_bytes()
    _free(monkeypatch, plan["fixed"] + 5 * plan["slot_set"] + plan["slot_set"] // 2)
    cc = m.resolve_cache(CacheConfig(size="auto"), tokens=64)
    assert cc.size == "5" and cc.memory == "auto"
    out = m.generate(PROMPT, 60, stop_at_eos=False, cache=CacheConfig(size="auto"))
    assert out.stats["offload"]["device_memory"]["slots"] == 5 * plan["slot_set"]
    _free(monkeypatch, 10**15)
    assert m.resolve_cache(CacheConfig(size="auto")).size == str(m.cfg.n_experts)  # everything fits: all N
    glob = m.resolve_cache(CacheConfig(size="auto", scope="global"))
    assert glob.size == str(m.cfg.n_experts * m.cfg.n_moe_layers)
    in_memory = moejax.load(get_hf_model("qwen2_moe").folder)  # before the memory left is made too small for it
    _free(monkeypatch, plan["fixed"] + plan["slot_set"])  # one slot per layer: fewer than K = 2
    with pytest.raises(ValueError, match=r"the memory cgroup /x .* leaves .* slots for K=2 experts per layer need"):
        m.resolve_cache(CacheConfig(size="auto"), tokens=64)
    with pytest.raises(ValueError, match="sizes the device slots of an offloaded model"):
        in_memory.resolve_cache(CacheConfig(size="auto"))
    monkeypatch.setattr(api.host_memory, "headroom", lambda swap=False: None)
    with pytest.raises(ValueError, match="does not say"):
        m.resolve_cache(CacheConfig(size="auto"))
    assert m.resolve_cache(CacheConfig(size="8")).size == "8"  # unknown free memory: no check


def test_a_size_that_cannot_fit_is_refused_and_the_default_shrinks(monkeypatch, capsys):
    _on_host(monkeypatch)
    m = _offloaded()
    plan = m.memory_plan(CacheConfig(), None, 64)
    base = plan["reserve"] - plan["prompt_reserve"]  # the runtime's margin: auto and a default size keep it
    assert base == offload.RESERVE_BASE
    _free(monkeypatch, plan["fixed"] - base + 3 * plan["slot_set"])
    checked = m.resolve_cache(CacheConfig(size="3"), tokens=64)
    assert checked.size == "3" and checked.fit_checked  # slots, KV cache, staging and the prompt's reserve fit
    # ... but not the runtime's margin too: allowed (it ran under 12 GiB), with a note (it thrashed under 1.5 GiB)
    assert re.search(r"note: a cache of 3 experts per layer leaves 0 B of what .* leaves; --cache-size auto keeps "
                     r".* for the runtime and finds room for 0, fewer than K=2: under a small budget", capsys.readouterr().err)
    _free(monkeypatch, plan["fixed"] + 3 * plan["slot_set"])
    assert m.resolve_cache(CacheConfig(size="3"), tokens=64).size == "3" and "note" not in capsys.readouterr().err
    _free(monkeypatch, plan["fixed"] - base + 3 * plan["slot_set"])
    _free(monkeypatch, 0)  # later (slots allocated, say), a checked cache is not measured again
    assert m.resolve_cache(checked).size == "3" and m.cache_memory_bytes(checked) == 3 * plan["slot_set"]
    assert m.generate(PROMPT, 2, stop_at_eos=False, cache=checked).stats["cache"]["tokens"] == 5
    # the prompt's part of the reserve is kept for a size given (a long prompt without it was OOM-killed)
    _free(monkeypatch, plan["fixed"] - base + 3 * plan["slot_set"] - 1)
    with pytest.raises(ValueError, match=r"cache size '3' needs .* \(3 slots per layer of .*, the KV cache, staging "
                                         r"and a .* reserve for the prompt\), but .* leaves .*: sizes up to 2 pass this "
                                         r"check, which keeps no margin for the runtime; --cache-size auto keeps "
                                         r".* and finds room for 0, fewer than K=2"):
        m.resolve_cache(CacheConfig(size="3"), tokens=64)
    assert m.resolve_cache(CacheConfig(size="2"), tokens=64).size == "2"  # what the message says fits, fits
    _free(monkeypatch, plan["fixed"] - base + 2 * plan["slot_set"] - 1)
    with pytest.raises(ValueError, match=r"cache size '2' needs .*: not even K=2 fit"):
        m.resolve_cache(CacheConfig(size="2"), tokens=64)
    _free(monkeypatch, plan["fixed"] + 3 * plan["slot_set"] + plan["slot_set"] // 2)
    default = m.resolve_cache(CacheConfig(), tokens=64, shrink_to_fit=True)  # a default size keeps all of it
    assert default.size == "3" and "using 3 (--cache-size auto)" in capsys.readouterr().err
    monkeypatch.setattr(api.offload_lib, "reserve_bytes", lambda positions, hidden_size, runtime=True: 0)
    plan = m.memory_plan(CacheConfig(), None, 64)
    _free(monkeypatch, plan["fixed"] + 2 * plan["slot_set"] + plan["slot_set"] // 2)
    with pytest.raises(ValueError, match=r"cache size '3' needs .* \(3 slots per layer .*: --cache-size auto picks 2"):
        m.resolve_cache(CacheConfig(size="3"), tokens=64)
    with pytest.raises(ValueError, match=r"cache size '1MB' needs"):
        m.resolve_cache(CacheConfig(size="1MB"), tokens=64)  # 1 MB holds all 8 of these tiny experts
    default = m.resolve_cache(CacheConfig(), tokens=64, shrink_to_fit=True)  # N/2 = 4 does not fit
    assert default.size == "2" and "using 2 (--cache-size auto)" in capsys.readouterr().err
    got = m.generate(PROMPT, 60, stop_at_eos=False)  # the API's default cache shrinks the same way (64 positions)
    ref = m.generate(PROMPT, 60, stop_at_eos=False, cache=CacheConfig(size="2"))
    assert got.token_ids == ref.token_ids
    assert got.stats["offload"]["device_memory"]["slots"] == 2 * plan["slot_set"]


class _FakeAccelerator:
    """What ``memory_plan`` reads of an accelerator: its platform, kind and allocator statistics."""

    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_on_an_accelerator_the_free_memory_is_the_allocators(monkeypatch):
    """The accelerator branch of the fit check (no GPU here): headroom = bytes_limit - bytes_in_use; no host
    store counted (it lives in host memory, not the device's); a device that keeps no statistics is unchecked."""
    m = _offloaded("host")
    monkeypatch.setattr(api.offload_lib, "reserve_bytes", lambda positions, hidden_size, runtime=True: 0)  # tiny experts
    plan_cpu = m.memory_plan(CacheConfig(), None, 64)
    monkeypatch.setattr(api.host_memory, "headroom", lambda swap=False: pytest.fail("the host's memory was read"))
    gib = 1 << 30
    used = 3 * gib
    free = plan_cpu["kv_cache"] + plan_cpu["staging"] + plan_cpu["reserve"] + 5 * plan_cpu["slot_set"] + 7
    device = _FakeAccelerator({"bytes_limit": used + free, "bytes_in_use": used})
    monkeypatch.setattr(api.distributed, "local_device", lambda: device)
    plan = m.memory_plan(CacheConfig(), None, 64)
    assert plan["headroom"] == free and plan["host_store"] == 0
    assert plan["where"].startswith("NVIDIA H100 80GB HBM3 memory (") and plan["slot_set"] == plan_cpu["slot_set"]
    cc = m.resolve_cache(CacheConfig(size="auto"), tokens=64)
    assert cc.size == "5" and cc.memory == "auto" and cc.fit_checked
    with pytest.raises(ValueError, match=r"cache size '7' needs .* NVIDIA H100 80GB HBM3 memory .* auto picks 5"):
        m.resolve_cache(CacheConfig(size="7"), tokens=64)
    device.stats = {}  # some backends keep no allocator statistics
    assert m.memory_plan(CacheConfig(), None, 64) is None
    assert m.resolve_cache(CacheConfig(size="7"), tokens=64).fit_checked
    with pytest.raises(ValueError, match="does not say"):
        m.resolve_cache(CacheConfig(size="auto"), tokens=64)


def test_the_host_store_counts_its_copy_of_every_expert(monkeypatch):
    _on_host(monkeypatch)
    m = _offloaded("host")
    plan = m.memory_plan(CacheConfig(), None, 64)
    every = m.cfg.n_moe_layers * m.cfg.n_experts * m.cached_expert_bytes()
    assert plan["host_store"] == every and plan["fixed"] == plan["kv_cache"] + plan["staging"] + every + plan["reserve"]
    _free(monkeypatch, plan["fixed"] - plan["reserve"] + plan["prompt_reserve"] + 2 * plan["slot_set"] - every // 2)
    with pytest.raises(ValueError, match=r"host store's own copy of every expert needs .* of that \(--expert-store flash"):
        m.resolve_cache(CacheConfig(size="2"), tokens=64)


def test_generate_command_takes_auto(monkeypatch, capsys):
    _on_host(monkeypatch)
    base = ["--prompt-ids", "5,17", "--max-new-tokens", "2", "--json"]
    assert generate.main(base + ["--offload", "--expert-store", "flash", "--cache-size", "auto"]) == 0
    cache = json.loads(capsys.readouterr().out)["stats"]["cache"]
    assert cache["cache_size"] == "auto" and cache["capacity"] >= 1
    assert generate.main(base + ["--cache-size", "auto"]) != 0
    assert "offloaded model" in capsys.readouterr().err
    rest, largest = weights.placed_nbytes(checkpoint.open_params(api.resolve_model_path("default"))[0], "lazy",
                                          "serving")
    _free(monkeypatch, rest + largest)  # the other weights fit, the slots do not
    assert generate.main(base + ["--offload", "--cache-size", "4"]) != 0
    assert "cache size '4' needs" in capsys.readouterr().err
    _free(monkeypatch, 0)  # not even the other weights: refused at load, before a byte is read
    assert generate.main(base + ["--offload", "--cache-size", "4"]) == 1
    assert "the weights other than the routed experts need" in capsys.readouterr().err


# ------------------------------------------------------------------ memory limits (moejax.base.memory)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_headrooms_read_every_limiting_ancestor_v1_and_v2(tmp_path):
    root = tmp_path / "cg"
    # v1: the process's cgroup has no limit, its parent has 12 GiB; held = rss + shmem + mapped file
    _write(root / "memory/a/b/memory.limit_in_bytes", "9223372036854771712\n")
    _write(root / "memory/a/b/memory.stat", "total_rss 100\ntotal_cache 5000\n")
    _write(root / "memory/a/memory.limit_in_bytes", f"{12 << 30}\n")
    _write(root / "memory/a/memory.stat", "total_rss 1000\ntotal_shmem 10\ntotal_mapped_file 200\ntotal_cache 9999\n")
    _write(root / "memory/memory.limit_in_bytes", "9223372036854771712\n")
    _write(tmp_path / "cgroup-v1", "4:memory:/a/b\n3:cpu:/\n")
    assert memory.cgroup_headrooms(str(tmp_path / "cgroup-v1"), str(root)) == [
        (str(root / "memory/a"), 12 << 30, (12 << 30) - 1210)]
    # v2: memory.max "max" means none; the tightest ancestor is reported
    v2 = tmp_path / "v2"
    _write(v2 / "cgroup.controllers", "cpu memory\n")
    _write(v2 / "user/app/memory.max", "max\n")
    _write(v2 / "user/memory.max", f"{8 << 30}\n")
    _write(v2 / "user/memory.stat", "anon 300\nfile 7000\nfile_mapped 20\nshmem 5\n")
    _write(tmp_path / "cgroup-v2", "0::/user/app\n")
    assert memory.cgroup_headrooms(str(tmp_path / "cgroup-v2"), str(v2)) == [(str(v2 / "user"), 8 << 30, (8 << 30) - 325)]
    assert memory.cgroup_headrooms(str(tmp_path / "missing"), str(root)) == []


def test_headroom_is_the_tightest_limit(monkeypatch, tmp_path):
    _write(tmp_path / "meminfo", "MemTotal: 100 kB\nMemAvailable:    2048 kB\n")
    assert memory.meminfo_available(str(tmp_path / "meminfo")) == 2048 * 1024
    _write(tmp_path / "swap", "MemAvailable:    2048 kB\nSwapTotal: 9000 kB\nSwapFree:  1024 kB\n")
    assert memory.meminfo_available(str(tmp_path / "swap"), key="SwapFree") == 1024 * 1024
    monkeypatch.setattr(memory, "meminfo_available", lambda: 5 << 30)
    monkeypatch.setattr(memory, "cgroup_headrooms", lambda: [("/cg/a", 12 << 30, 3 << 30), ("/cg", 16 << 30, 4 << 30)])
    assert memory.headroom() == (3 << 30, "the memory cgroup /cg/a (limit 12.0 GiB)")
    monkeypatch.setattr(memory, "cgroup_headrooms", lambda: [])
    assert memory.headroom() == (5 << 30, "the machine's available memory")
    # what a load may hold without being killed counts free swap; a plan for speed does not
    monkeypatch.setattr(memory, "meminfo_available", lambda key="MemAvailable": {"MemAvailable": 5 << 30,
                                                                                 "SwapFree": 2 << 30}[key])
    assert memory.headroom() == (5 << 30, "the machine's available memory")
    assert memory.headroom(swap=True) == (7 << 30, "the machine's available memory, free swap included")
    monkeypatch.setattr(memory, "cgroup_headrooms", lambda: [("/cg/a", 12 << 30, 3 << 30)])
    assert memory.headroom(swap=True) == (3 << 30, "the memory cgroup /cg/a (limit 12.0 GiB)")
    monkeypatch.setattr(memory, "cgroup_headrooms", lambda: [])
    monkeypatch.setattr(memory, "meminfo_available", lambda key="MemAvailable": None)
    assert memory.headroom() is None
    assert [memory.format_bytes(n) for n in (512, 3400, 12_600_000, 1_250_000_000)] == [
        "512 B", "3.4 kB", "12.6 MB", "1.25 GB"]


def test_the_reserve_follows_the_prompt_a_run_may_have():
    """Measured at Qwen1.5-MoE shapes (docs/benchmarks.md#the-reserve): ~0.52 GiB of runtime at 8 tokens, a
    batched piece's activations up to 512 tokens, little per position after; the piece part grows with the
    hidden size. The old flat 1.5 GiB refused C = 4 under 6 GiB, which runs."""
    gib = 1 << 30
    r = offload.reserve_bytes
    assert 0.55 * gib < r(8) < 0.58 * gib and 1.1 * gib < r(512) < 1.15 * gib
    assert r(40) < r(512) < r(1024) < r(4096) < 1.3 * gib and r(4096) - r(2048) < 0.11 * gib
    assert r(512, hidden_size=4096) - r(512) == pytest.approx(r(512) - r(0), rel=1e-6)
    m = _offloaded()
    assert m.memory_plan(CacheConfig(), None, 64)["reserve"] == r(64, m.cfg.hidden_size)
    assert m.memory_plan(CacheConfig(), None, None)["reserve"] == r(min(offload.DEFAULT_FIT_POSITIONS,
                                                                        m.cfg.max_position_embeddings), m.cfg.hidden_size)


def test_a_teacher_forced_pass_counts_the_logits_it_returns(monkeypatch):
    """An offloaded forward returns float32 logits [T, V] (filled piece by piece: one piece's on top), and the
    plan counts them: uncounted, a 1,024-token pass under 8 GiB with auto at Qwen1.5-MoE shapes holds 1.2 GB of
    logits twice beyond its plan and is OOM-killed (``python bench/bench_prompt_memory.py``)."""
    _on_host(monkeypatch)
    m = _offloaded()
    bare = m.memory_plan(CacheConfig(), None, 64)
    plan = m.memory_plan(CacheConfig(), None, 64, logits_rows=64)
    assert bare["logits"] == 0 and plan["logits"] == (64 + 64) * m.cfg.vocab_size * 4
    assert plan["fixed"] == bare["fixed"] + plan["logits"]
    _free(monkeypatch, plan["fixed"] + 3 * bare["slot_set"] + bare["slot_set"] // 2)
    assert m.resolve_cache(CacheConfig(size="auto"), tokens=64, logits_rows=64).size == "3"
    assert int(m.resolve_cache(CacheConfig(size="auto"), tokens=64).size) > 3  # without the logits: more
    seen = []
    real_plan = api.Model.memory_plan
    monkeypatch.setattr(api.Model, "memory_plan", lambda self, *a, **k: seen.append(a[3:] or k) or real_plan(self, *a, **k))
    _free(monkeypatch, 10**15)
    out = m.forward(PROMPT, cache=CacheConfig(size="auto"))  # the forward asks for its own rows
    assert seen and seen[-1] in ((len(PROMPT),), {"logits_rows": len(PROMPT)}) and out.logits.shape[0] == len(PROMPT)
