"""Real expert offloading: host-resident experts, device slots, paging, miss handling, prefetch.

On CPU the bytes really move (``jax.device_put`` from host-memory arrays into device slot buffers), but
their speed says nothing about a GPU; these tests check the logic: offload = simulation tokens, bytes
moved = loads × expert bytes, slot contents = what the cache state names, and the lossy miss modes
change only what they should.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import moejax
from support.commands import run_main
from support.hf_models import get_hf_model, get_moejax_model

from moejax.models import layout, weights
from moejax.models.gating import SoftmaxTopK
from moejax.experts import cache as cache_lib, router
from moejax.experts import cache_metrics
from moejax.runtime import expert_store, generate, host_paging, jit_paging, offload, simulate
from moejax.runtime import sampling as sampling_lib
from moejax.runtime.simulate import CacheConfig

PROMPT = np.array([5, 17, 33, 8, 61, 2, 44, 90], np.int32)
NEW = 6


def _model(name="qwen3_moe"):  # 8 experts, top-2, 2 layers, float32
    return get_moejax_model(name)


def _both(m, cc, routing="cache-prior", offload_cfg=offload.OffloadConfig(), **kw):
    ref = m.generate(PROMPT, NEW, routing=routing, cache=cc, stop_at_eos=False, **kw)
    off = m.generate(PROMPT, NEW, routing=routing, cache=cc, stop_at_eos=False, offload=offload_cfg, **kw)
    return ref, off


def prompt_pages(m, cc, routing, prompt=PROMPT) -> tuple[int, int]:
    """(experts a batched prefill of ``prompt`` pages, loads + prefetch loads the simulated cache makes for it),
    from the simulation: per layer, every expert the prompt uses or the cache holds after it must reach the
    device once, except one that stays in the slot it held before the prompt (or is evicted from it)."""
    state = m.router_state(routing, cc)
    sim = m.forward(prompt, routing=routing, cache=cc)
    before, after = np.asarray(state["cache"].slot), np.asarray(sim.state["cache"].slot)
    pages = 0
    for layer in range(m.cfg.n_moe_layers):
        used = sim.experts[layer]
        for e in set(used[used >= 0].tolist()) | set(np.nonzero(after[layer] >= 0)[0].tolist()):
            stays = before[layer, e] >= 0 and after[layer, e] in (-1, before[layer, e])
            pages += not stays
    return pages, sim.stats["loads"] + sim.stats["prefetch_loads"]


def check_pages(m, cc, routing, off) -> None:
    """The bytes an offloaded generation moved: the prompt's pages (batched) or loads (token by token), then
    exactly one expert per load of the decoding cache."""
    o, c = off.stats["offload"], off.stats["cache"]
    eb = o["expert_bytes"]
    pages, prompt_loads = prompt_pages(m, cc, routing)
    if o["prefill"] == "token":
        pages = prompt_loads
    assert o["bytes_moved_prefill"] == pages * eb
    assert o["bytes_moved"] - o["bytes_moved_prefill"] == (c["loads"] + c["prefetch_loads"] - prompt_loads) * eb
    assert pages <= prompt_loads  # a batched prompt never moves more than the token path


# LRU per layer and least-stale in one global pool in the main suite, the other evictions (LFU too) with -m slow:
# every eviction is the simulation's own code, tested against the reference simulator
@pytest.mark.parametrize("eviction,scope,size", [(e, "layer", "3") if e == "lru" else
                                                  pytest.param(e, "layer", "3", marks=pytest.mark.slow)
                                                  for e in ("lru", "lfu", "fld", "score", "least-stale")]
                         + [("least-stale", "global", "0.25")])
def test_offload_generates_the_simulation_tokens_for_every_eviction(eviction, scope, size):
    m = _model()
    cc = CacheConfig(size=size, scope=scope, eviction=eviction)
    ref, off = _both(m, cc)
    assert off.token_ids == ref.token_ids
    sim, real = ref.stats["cache"], off.stats["cache"]
    assert real["misses"] == sim["misses"] and real["loads"] == sim["loads"]
    o = off.stats["offload"]
    assert o["prefill"] == ("token" if scope == "global" else "batched")
    check_pages(m, cc, "cache-prior", off)
    np.testing.assert_array_equal(off.trace()["experts"], ref.trace()["experts"])


def test_token_prefill_pages_every_load():
    """``OffloadConfig(prefill="token")``: the prompt pages as decoding does, so the bytes moved for real are
    exactly loads × expert bytes."""
    m = _model()
    cc = CacheConfig(size="3")
    ref, off = _both(m, cc, offload_cfg=offload.OffloadConfig(prefill="token"))
    assert off.token_ids == ref.token_ids
    real, o = off.stats["cache"], off.stats["offload"]
    assert o["prefill"] == "token" and o["prefill_pages"] == 0
    assert o["bytes_moved"] == real["loads"] * o["expert_bytes"] == real["bytes_moved"]
    assert o["demand_loads"] == real["loads"]


def test_in_jit_paging_generates_the_simulation_tokens_and_bytes():
    m = _model()
    for cc in [CacheConfig(size="0.25", scope="global", eviction="lfu"),
               CacheConfig(size="3", prefetch=1.0, miss="substitute")]:
        ref, off = _both(m, cc, offload_cfg=offload.OffloadConfig(paging="jit"))
        assert off.token_ids == ref.token_ids, cc
        assert off.stats["offload"]["bytes_moved"] == (
            (off.stats["cache"]["loads"] + off.stats["cache"]["prefetch_loads"]) * off.stats["offload"]["expert_bytes"])
        assert off.stats["cache"]["misses"] == ref.stats["cache"]["misses"]


def test_in_jit_decode_never_copies_a_slot(tmp_path):
    """The decode program writes each page straight into its slot's buffers and passes every other slot
    through in place: no ``copy`` or ``select`` of a slot's matrix anywhere in the step (a whole-slot-set copy
    per step, from the roll-back of the router state after EOS, ran an H200 at 69 tokens/s against 863 with
    every weight on the device; ``decode.keep_when_done`` leaves the pager's slots out of it). The page is
    read from the host stacks by a dynamic index inside a loop whose trip count is the step's number of
    changes. Read from XLA's optimized HLO, in a subprocess."""
    m = _model()
    cfg = m.cfg
    dump = tmp_path / "hlo"
    code = ("import numpy as np, moejax; from moejax.runtime import offload; "
            "from moejax.runtime.simulate import CacheConfig; "
            f"m = moejax.load({m.path!r}); "
            "m.generate(np.arange(1, 5, dtype=np.int32), 4, routing='original', cache=CacheConfig(size='5'), "
            "offload=offload.OffloadConfig(paging='jit'), stop_at_eos=False)")
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    texts = [f.read_text() for f in dump.glob("*decode_chunk*after_optimizations.txt")]
    assert texts, sorted(os.listdir(dump))[:10]
    text = "\n".join(texts)
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    slot_shapes = {f"[{2 * f},{d}]", f"[{d},{f}]"}
    # copies of a transposed operand are the f32 expert products' own (the resident model's too), not paging
    ops = re.findall(r"= \w+(\[[0-9,]+\])\{[^}]*\} (copy|select)\((?!%transpose)", text)
    assert not [op for op in ops if op[0] in slot_shapes], ops
    # the pages come from the host stacks, one expert by a dynamic index
    assert re.search(rf"= \w+\[1,{2 * f},{d}\]\S* dynamic-slice\(", text), "no page read from the host stacks"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), slot=st.integers(-1, 3), expert=st.integers(0, 5),
       dtype=st.sampled_from(["float32", "bfloat16"]))
def test_a_page_writes_its_slot_and_nothing_else(seed, slot, expert, dtype):
    """``jit_paging.page_into``: expert ``expert`` of the host stacks lands in slot ``slot`` (in the slot's dtype),
    every other slot keeps its bytes, and a slot id that names no slot (-1: an unused pending entry) changes
    nothing."""
    rng = np.random.default_rng(seed)
    host = {"gate_up": jnp.asarray(rng.normal(size=(6, 10, 3)), jnp.float32),
            "down": jnp.asarray(rng.normal(size=(6, 3, 5)), jnp.float32)}
    slots = layout.ExpertList(tuple(jnp.asarray(rng.normal(size=(10, 3)), dtype) for _ in range(4)),
                              tuple(jnp.asarray(rng.normal(size=(3, 5)), dtype) for _ in range(4)))
    before = jax.tree.map(np.asarray, slots)
    after = jax.jit(jit_paging.page_into)(slots, host, jnp.int32(expert), jnp.int32(slot))
    for c in range(4):
        for got, old, k in ((after.gate_up[c], before.gate_up[c], "gate_up"), (after.down[c], before.down[c], "down")):
            want = np.asarray(host[k][expert].astype(dtype)) if c == slot else old
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("cc", [
    CacheConfig(size="5", prefetch=1.5),
    pytest.param(CacheConfig(size="6", prefetch_percentile=70.0), marks=pytest.mark.slow),
    pytest.param(CacheConfig(size="0.3", scope="global", prefetch=1.0, eviction="least-stale"), marks=pytest.mark.slow),
    pytest.param(CacheConfig(size="5", miss="drop"), marks=pytest.mark.slow),
    # substitute: test_substitute_replaces_low_misses... in the main suite, offloaded with GPT-OSS's biases below
    pytest.param(CacheConfig(size="5", miss="substitute"), marks=pytest.mark.slow),
    CacheConfig(size="5", miss="cascade", miss_rank=(1, 3), cascade_bits=(8, 4)),
], ids=["prefetch", "percentile", "global-prefetch", "drop", "substitute", "cascade"])
def test_offload_equals_simulation_with_prefetch_and_miss_handling(cc):
    m = _model("olmoe_clip")  # 16 experts, top-4: room for low-importance positions
    ref, off = _both(m, cc)
    assert off.token_ids == ref.token_ids
    for key in ("misses", "loads", "prefetch_loads", "dropped", "substituted", "int8_loads", "int4_loads",
                "prefetch_precision", "prefetch_recall", "bytes_moved"):
        assert off.stats["cache"][key] == ref.stats["cache"][key], key
    if cc.miss == "cascade":  # low-bit copies are paged per token: the prompt too
        assert off.stats["offload"]["prefill"] == "token"
        assert off.stats["offload"]["bytes_moved"] == off.stats["cache"]["bytes_moved"]
    else:
        check_pages(m, cc, "cache-prior", off)
    # the host waits for the device once per MoE layer step (its slot table carries over from the layer before),
    # plus once where a step starts from a state the host has not read (after the batched prompt, or the first)
    steps = NEW - 1 + (PROMPT.size if cc.miss == "cascade" else 0)
    assert off.stats["offload"]["host_reads"] == steps * m.cfg.n_moe_layers + 1


def test_slots_always_hold_what_the_cache_state_names():
    m = _model("olmoe_clip")
    for cc in [CacheConfig(size="5", prefetch=1.0), CacheConfig(size="0.3", scope="global", eviction="fld")]:
        state = m.router_state("cache-prior", cc)
        pager = host_paging.HostPager(m.params, m.cfg, state, offload.OffloadConfig())
        kv = jax.tree.map(lambda a: a, __import__("moejax.models.attention", fromlist=["init_kv"]).init_kv(m.cfg, 16))
        key = jax.random.PRNGKey(0)
        moe_ids = [i for i in range(m.cfg.num_layers) if m.cfg.moe_layers[i]]
        for pos, tok in enumerate(PROMPT.tolist()):
            _, _, kv, key = pager.step(tok, jnp.int32(pos), kv, key, sampling_lib.Sampling())
            slot = np.asarray(pager.state["cache"].slot)
            resident = np.asarray(pager.state["cache"].resident)
            np.testing.assert_array_equal(slot >= 0, resident)
            for layer, expert in zip(*np.nonzero(resident)):
                buf = pager.slots if cc.scope == "global" else pager.slots[layer]
                for k in ("gate", "up", "down"):
                    np.testing.assert_array_equal(
                        layout.CanonicalExpertView(buf, k).read_expert(int(slot[layer, expert])),
                        weights.expert_matrix(expert_store.expert_stacks(m.params["layers"][moe_ids[layer]]["moe"])[k],
                                              int(expert)))


def test_random_initial_cache_is_paged_in_before_the_first_token():
    m = _model()
    ref, off = _both(m, CacheConfig(size="4", init="random", seed=3))
    assert off.token_ids == ref.token_ids
    assert off.stats["cache"]["misses"] == ref.stats["cache"]["misses"]


def test_flash_store_reads_experts_from_a_mapped_file(tmp_path):
    m = _model()
    cc = CacheConfig(size="3")
    ref, off = _both(m, cc, offload_cfg=offload.OffloadConfig(store="flash", store_dir=str(tmp_path)))
    assert off.token_ids == ref.token_ids
    assert (tmp_path / "experts.safetensors").stat().st_size >= m.cfg.n_moe_layers * m.cfg.n_experts * \
        off.stats["offload"]["expert_bytes"]


def test_store_dir_never_overwrites_user_data_and_temp_store_is_removed(tmp_path):
    """--store-dir D never overwrites a D/experts.safetensors it did not write; the temporary store of a run
    without --store-dir is removed."""
    m = _model()
    precious = tmp_path / "experts.safetensors"
    precious.write_bytes(b"not an expert store")
    with pytest.raises(FileExistsError, match="not a moejax expert store"):
        expert_store.ExpertStore(m.params, m.cfg, "flash", store_dir=str(tmp_path))
    assert precious.read_bytes() == b"not an expert store"
    ours = tmp_path / "ours"
    expert_store.ExpertStore(m.params, m.cfg, "flash", store_dir=str(ours))
    expert_store.ExpertStore(m.params, m.cfg, "flash", store_dir=str(ours))  # an earlier store: replaced
    assert sorted(os.listdir(ours)) == ["experts.safetensors"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    store = expert_store.ExpertStore(m.params, m.cfg, "flash")
    folder = store._tmp
    assert os.path.isfile(os.path.join(folder, "experts.safetensors"))
    del store
    gc.collect()
    assert not os.path.exists(folder)
    code = ("import tempfile, moejax; from moejax.runtime import offload, simulate;"
            "m = moejax.load(%r);"
            "out = m.generate([1, 2, 3], 2, cache=simulate.CacheConfig(size='0.5'),"
            " offload=offload.OffloadConfig(store='flash')); print(len(out.token_ids))" % m.path)
    env = {**os.environ, "TMPDIR": str(tmp), "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert os.listdir(tmp) == []  # normal exit: nothing left in the temporary directory


def test_device_memory_is_slots_plus_dense_weights_never_the_whole_model():
    m = _model("olmoe_clip")
    cc = CacheConfig(size="4")
    out = m.generate(PROMPT, 4, routing="original", cache=cc, offload=offload.OffloadConfig())
    mem = out.stats["offload"]["device_memory"]
    eb = out.stats["offload"]["expert_bytes"]
    assert mem["slots"] == m.cfg.n_moe_layers * 4 * eb
    total = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(m.params))
    assert mem["non_expert_weights"] == total - mem["all_experts_on_host"]
    assert mem["prefill_staging"] == m.cfg.top_k * eb  # a batched prompt streams experts through K buffers
    assert mem["accounted_total"] == (mem["non_expert_weights"] + mem["slots"] + mem["kv_cache"] + mem["low_bit_staging"]
                                      + mem["prefill_staging"])
    assert mem["accounted_total"] < total


def test_cache_smaller_than_k_is_refused_in_offload_mode():
    m = _model("olmoe_clip")  # K = 4
    with pytest.raises(ValueError, match="at least K=4"):
        m.generate(PROMPT, 2, cache=CacheConfig(size="3"), offload=offload.OffloadConfig())
    with pytest.raises(ValueError, match="at least K=4"):
        m.generate(PROMPT, 2, cache=CacheConfig(size="3"), offload=offload.OffloadConfig(paging="jit"))


@pytest.mark.parametrize("prefill", offload.PREFILLS)
def test_teacher_forced_offload_forward_equals_simulation(prefill):
    m = _model()
    cc = CacheConfig(size="3", prefetch=1.0)
    sim = m.forward(PROMPT, routing="cache-prior", cache=cc)
    off = m.forward(PROMPT, routing="cache-prior", cache=cc, offload=offload.OffloadConfig(prefill=prefill))
    np.testing.assert_array_equal(off.experts, sim.experts)
    np.testing.assert_array_equal(off.hits, sim.hits)
    np.testing.assert_allclose(off.logits, sim.logits, atol=2e-5)
    assert off.stats["misses"] == sim.stats["misses"]
    pages = prompt_pages(m, cc, "cache-prior")[0] if prefill == "batched" else sim.stats["loads"] + sim.stats[
        "prefetch_loads"]
    assert off.stats["offload"]["bytes_moved"] == pages * off.stats["offload"]["expert_bytes"]


# ------------------------------------------------------------------------------------ miss handling units


def _handle(mode, experts, weights, cached, rank=(1,), bits=(8,), n=8, z=None):
    gating = SoftmaxTopK(n_experts=n, top_k=len(experts), normalize=False)
    z = jnp.asarray(-np.arange(n, dtype=np.float32)) if z is None else z  # original ranking 0, 1, 2, ...
    mask = jnp.zeros((n,), bool).at[jnp.asarray(cached, jnp.int32)].set(True)
    valid = jnp.ones((len(experts),), bool)
    return router.handle_misses(z, jnp.asarray(experts, jnp.int32), jnp.asarray(weights, jnp.float32), valid, mask,
                                cache_lib.MissConfig(mode, rank, bits), gating)


def test_drop_removes_only_low_importance_misses_and_rescales_the_rest():
    e, w, v, tier, counts = _handle("drop", [0, 1, 2, 3], [0.4, 0.3, 0.2, 0.1], cached=[1, 3])
    # position 0 (expert 0) misses but is high-importance; expert 2 at position 2 misses: dropped
    np.testing.assert_array_equal(e, [0, 1, -1, 3])
    np.testing.assert_array_equal(v, [True, True, False, True])
    np.testing.assert_allclose(w, np.array([0.4, 0.3, 0.0, 0.1]) * 1.0 / 0.8, rtol=1e-6)
    assert int(counts["dropped"]) == 1 and not np.asarray(tier).any()


def test_substitute_replaces_low_misses_by_best_ranked_cached_unchosen_experts():
    e, w, v, tier, counts = _handle("substitute", [0, 1, 2, 3], [0.4, 0.3, 0.2, 0.1], cached=[1, 6, 5])
    # misses at positions 2 (expert 2) and 3 (expert 3) -> cached unchosen by original rank: 5, then 6
    np.testing.assert_array_equal(e, [0, 1, 5, 6])
    np.testing.assert_allclose(w, [0.4, 0.3, 0.2, 0.1])
    assert int(counts["substituted"]) == 2
    # nothing cached to substitute with: the miss is fetched
    e, _, _, _, counts = _handle("substitute", [0, 1, 2, 3], [0.4, 0.3, 0.2, 0.1], cached=[1])
    np.testing.assert_array_equal(e, [0, 1, 2, 3])
    assert int(counts["substituted"]) == 0


def test_cascade_tiers_follow_the_rank_thresholds():
    _, _, _, tier, _ = _handle("cascade", [0, 1, 2, 3], [0.4, 0.3, 0.2, 0.1], cached=[], rank=(1, 3), bits=(8, 4))
    np.testing.assert_array_equal(tier, [0, 8, 8, 4])
    _, _, _, tier, _ = _handle("cascade", [0, 1, 2, 3], [0.4, 0.3, 0.2, 0.1], cached=[2], rank=(1, 3), bits=(8, 4))
    np.testing.assert_array_equal(tier, [0, 8, 0, 4])  # a hit is never served from a low-bit copy


def test_cascade_bytes_are_counted_at_the_low_bit_size():
    m = _model("olmoe_clip")
    cc = CacheConfig(size="4", miss="cascade", miss_rank=(2,), cascade_bits=(4,))
    out = m.forward(PROMPT, cache=cc, routing="original")
    s = out.stats
    low = simulate.lowbit_expert_bytes(m.cfg, 4, None)
    assert s["int4_loads"] > 0
    assert s["bytes_moved"] == s["loads"] * simulate.expert_bytes(m.params, m.cfg) + s["int4_loads"] * low
    assert low < simulate.expert_bytes(m.params, m.cfg) / 4  # fp32 -> int4 + bf16 scales


def test_miss_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown miss handling"):
        cache_lib.MissConfig("skip")
    with pytest.raises(ValueError, match="one bit width per rank"):
        cache_lib.MissConfig("cascade", (1, 2), (8,))
    with pytest.raises(ValueError, match="8 or 4"):
        cache_lib.MissConfig("cascade", (1,), (2,))
    with pytest.raises(ValueError, match="both"):
        cache_lib.PrefetchConfig(1.0, 50.0)
    with pytest.raises(ValueError, match="bandwidth"):
        offload.OffloadConfig(bandwidth_gbps=0)
    with pytest.raises(ValueError, match="host-driven"):
        offload.OffloadConfig(paging="jit", bandwidth_gbps=2.0)


# ------------------------------------------------------------------------------------ prefetch + link


def test_prefetch_precision_and_recall_counts():
    gating = SoftmaxTopK(n_experts=6, top_k=2, normalize=False)
    cs = cache_lib.init_cache(1, 6, 4, prefetcher=cache_lib.PrefetchConfig(overfetch=1.5))  # predicts 3
    rs = router.routing_lib.init_routing_state(1)
    policy = router.routing_lib.original()
    z = jnp.asarray([5.0, 4.0, 0.0, 0.0, 0.0, 0.0])  # chooses 0, 1
    z_pred = jnp.asarray([0.0, 5.0, 4.0, 3.0, 0.0, -1.0])  # predicts 1, 2, 3
    _, _, hits, cs, _ = router.router_step(z, cs, rs, policy, gating, 0, z_pred=z_pred)
    np.testing.assert_array_equal(hits, [False, True])  # expert 1 was prefetched
    s = cache_metrics.summarize(cs)
    assert s["prefetch_precision"] == pytest.approx(1 / 3) and s["prefetch_recall"] == pytest.approx(1 / 2)
    assert s["prefetch_loads"] == 3 and s["misses"] == 1


def test_emulated_link_is_a_sequential_queue():
    link = host_paging.Link(gbps=1.0, latency_us=10.0)
    done1 = link.schedule(1_000_000, now=0.0)  # 1 MB at 1 GB/s = 1 ms + 10 µs
    done2 = link.schedule(1_000_000, now=0.0)  # queued behind the first
    assert done1 == pytest.approx(0.00101) and done2 == pytest.approx(0.00202)
    assert link.schedule(500, now=1.0) == pytest.approx(1.0 + 10e-6 + 5e-7)
    assert link.bytes == 2_000_500 and link.transfers == 3


def test_emulated_bandwidth_slows_decoding_down():
    m = _model()
    cc = CacheConfig(size="3")
    fast = m.generate(PROMPT, 6, cache=cc, offload=offload.OffloadConfig(), stop_at_eos=False)
    slow = m.generate(PROMPT, 6, cache=cc, offload=offload.OffloadConfig(bandwidth_gbps=0.002), stop_at_eos=False)
    assert slow.token_ids == fast.token_ids
    o = slow.stats["offload"]
    # every byte took at least bytes / bandwidth on the emulated link
    assert o["transfer_s"] == pytest.approx(o["bytes_moved"] / 2e6, rel=1e-6)
    assert slow.stats["total_time_s"] >= o["bytes_moved"] / 2e6 * 0.9
    assert o["achieved_gbps"] == pytest.approx(0.002, rel=1e-6)
    # the time breakdown of the steps: the link's waits happen inside them, the routing syncs are a part
    for stats in (slow.stats, fast.stats):
        o = stats["offload"]
        assert 0 < o["sync_s"] < o["step_s"] <= stats["total_time_s"]
        assert 0 < o["page_s"] and o["sync_s"] + o["page_s"] <= o["step_s"]
        assert o["setup_s"] > 0  # the store and zeroed slots, timed apart from compile and generation
    # a prompt fed token by token pages inside the steps too: every wait on the link is step time
    tok = m.generate(PROMPT, 3, cache=cc, offload=offload.OffloadConfig(bandwidth_gbps=0.002, prefill="token"),
                     stop_at_eos=False).stats["offload"]
    assert tok["compute_wait_s"] > 0.01 and tok["step_s"] >= tok["page_s"] >= tok["compute_wait_s"]


def test_generate_cli_offload_json_and_errors(tmp_path, capsys):
    """``python -m moejax.generate --offload`` end to end (a child process), then a refused flag in process."""
    m = _model()
    cmd = [sys.executable, "-m", "moejax.generate", "--model", m.path, "--prompt-ids", "5,17,33", "--max-new-tokens",
           "5", "--offload", "--cache-size", "3", "--prefetch", "1", "--bandwidth-gbps", "25", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    o = res["stats"]["offload"]
    assert o["bandwidth_gbps"] == 25 and o["bytes_moved"] > 0 and "device_memory" in o
    assert res["stats"]["cache"]["prefetch_precision"] is not None
    bad = run_main(generate.main, capsys, *cmd[3:7], "--bandwidth-gbps", "2")
    assert bad.returncode == 2 and "need --offload" in bad.stderr


def test_kept_slots_continue_the_cache_across_calls_without_paging_it_again():
    """keep_slots (the server): a call continuing from the previous result's router state reuses its slots:
    the tokens stay the simulation's call after call, and each call moves only its own loads' bytes."""
    m = _model()
    cc = CacheConfig(size="3")
    for prefill in ("token", "batched"):  # token: bytes are exactly the loads; batched: never more
        sim_state = m.router_state("cache-prior", cc)
        off_state = m.router_state("cache-prior", cc)
        pagers, setups = set(), []
        for prompt in (PROMPT, PROMPT[:3], PROMPT[2:]):
            before = simulate.summarize(off_state, m.params, m.cfg)["loads"]
            ref = m.generate(prompt, NEW, state=sim_state, stop_at_eos=False, bucketed=True)
            off = m.generate(prompt, NEW, state=off_state, stop_at_eos=False, bucketed=True,
                             offload=offload.OffloadConfig(prefill=prefill), keep_slots=True)
            assert off.token_ids == ref.token_ids
            sim_state, off_state = ref.router_state, off.router_state
            o = off.stats["offload"]
            loads = off.stats["cache"]["loads"] - before
            if prefill == "token":
                assert o["bytes_moved"] == loads * o["expert_bytes"]
            else:
                assert o["bytes_moved"] <= loads * o["expert_bytes"] and o["bytes_moved"] % o["expert_bytes"] == 0
            pagers.add(id(m._stores[host_paging.KEPT_PAGER]))
            setups.append(o["setup_s"])
        assert len(pagers) == 1  # one pager, its slots carried on
        assert setups[0] > 0 and setups[1:] == [0.0, 0.0]  # its slots were made once, by the first call
    # a call that does not continue from it (a fresh state) pages from scratch and drops the kept pager
    m.generate(PROMPT, NEW, routing="cache-prior", cache=cc, offload=offload.OffloadConfig())
    assert host_paging.KEPT_PAGER not in m._stores


def test_host_pager_compiles_each_stage_once_while_the_cache_fills():
    """Pages arrive committed to the device (``device_put``) and jit keys its cache on committedness: slots,
    router state and KV cache start committed too, so filling the cache does not recompile the stages for each
    new mix of paged and unpaged slots (it did: 0.4–1.1 s per token for the first ~10 tokens at real shapes)."""
    m = moejax.load(get_hf_model("qwen2_moe").folder, offload="flash")
    cache = CacheConfig(size="0.75")  # a slot count no other test uses: these programs are new here
    before = host_paging._stage_a._cache_size(), host_paging._stage_b._cache_size()
    m.generate(PROMPT, max_new_tokens=12, stop_at_eos=False, cache=cache, routing="cache-prior")
    grown = host_paging._stage_a._cache_size() - before[0], host_paging._stage_b._cache_size() - before[1]
    assert grown[1] <= 1, grown  # one expert stage for this slot count (every MoE layer has the same structure)
    assert grown[0] <= 2, grown  # attention + router: with and without a prefetch prediction at most


# DeepSeek-V3's biases (sigmoid, group-limited) in the main suite; ERNIE-4.5's (softmax + biases) and in-jit paging
# with -m slow (CI time; test_trace replays ERNIE's biased routing in the main suite)
@pytest.mark.parametrize("name, paging", [("deepseek_v3", "host"),
                                          pytest.param("ernie4_5_moe", "host", marks=pytest.mark.slow),
                                          pytest.param("deepseek_v3", "jit", marks=pytest.mark.slow),
                                          pytest.param("ernie4_5_moe", "jit", marks=pytest.mark.slow)])
def test_selection_biases_route_every_offload_path_as_the_simulation(name, paging):
    """DeepSeek-V3's experts are chosen by score + a per-layer bias held in the routing state (ERNIE-4.5's by
    probability + bias): host paging (the batched prompt, prefetch of the next layer with its own bias,
    substitution by rank) and in-jit paging must choose what the simulation chooses."""
    m = _model(name)
    assert m.selection_biases is not None and np.abs(m.selection_biases).max() > 0.05
    cc = {"host": CacheConfig(size="5", prefetch=1.0, miss="substitute"), "jit": CacheConfig(size="4", prefetch=1.0)}[paging]
    ref, off = _both(m, cc, offload_cfg=offload.OffloadConfig(paging=paging))
    assert off.token_ids == ref.token_ids
    for key in ("misses", "loads", "prefetch_loads", "substituted", "prefetch_precision", "bytes_moved"):
        assert off.stats["cache"][key] == ref.stats["cache"][key], key


@pytest.mark.parametrize("cc, paging, prefill", [
    (CacheConfig(size="3", prefetch=1.0, miss="substitute"), "host", "batched"),
    # cascade offload is test_offload_equals_simulation_with_prefetch_and_miss_handling's, token prefill
    # test_token_prefill_pages_every_load's: with GPT-OSS's biases, -m slow (CI time)
    pytest.param(CacheConfig(size="3", miss="cascade", miss_rank=(1,), cascade_bits=(8,)), "host", "token",
                 marks=pytest.mark.slow),
], ids=["host-prefetch-substitute", "host-cascade"])
def test_gpt_oss_expert_biases_follow_the_real_experts_when_offloaded(cc, paging, prefill):
    """GPT-OSS's expert biases stay on the device (never paged) and are taken by the *real* expert a slot holds:
    a teacher-forced pass with real paging (a batched prompt through staging and slots, token by token with
    early and late experts, low-bit copies) gives the simulation's logits; biases taken by slot id would not."""
    m = _model("gpt_oss")
    toks = np.random.RandomState(3).randint(3, 96, size=24).astype(np.int32)
    ref = m.forward(toks, routing="cache-prior", cache=cc)
    off = m.forward(toks, routing="cache-prior", cache=cc,
                    offload=offload.OffloadConfig(paging=paging, prefill=prefill))
    np.testing.assert_array_equal(off.experts, ref.experts)
    np.testing.assert_allclose(off.logits, ref.logits, atol=2e-5)
    assert off.stats["misses"] == ref.stats["misses"] > 0


@pytest.mark.slow
def test_gpt_oss_in_jit_paging_generates_as_the_simulation():
    m = _model("gpt_oss")
    ref, off = _both(m, CacheConfig(size="3", prefetch=1.0), offload_cfg=offload.OffloadConfig(paging="jit"))
    assert off.token_ids == ref.token_ids
    assert off.stats["cache"]["misses"] == ref.stats["cache"]["misses"] > 0


def test_gpt_oss_pages_from_its_hub_files_as_from_memory():
    """GPT-OSS's hub files hold each expert's gate and up as alternate columns of one [D, 2F] block, stored
    [in, out]: a flash store reads the block once and turns it into the serving layout on the host (the pages
    equal the model loaded whole), and pages to the same tokens as a host store and the simulation."""
    from moejax.models import layout
    from moejax.runtime import expert_store

    m = moejax.load(get_hf_model("gpt_oss").folder, offload="flash")
    store = expert_store.ExpertStore(m.params, m.cfg, "flash")
    assert store.interleaved and store.reads_serving  # one read of the block, turned on the host
    whole = get_moejax_model("gpt_oss").params["layers"][1]["moe"]["experts"]  # loaded whole, serving layout
    for e in (0, 5, 7):
        gate_up, down = store.get(1, e, serving=True)
        np.testing.assert_array_equal(gate_up, np.asarray(layout.dense(whole.gate_up[e])))
        np.testing.assert_array_equal(down, np.asarray(layout.dense(whole.down[e])))
    cc = CacheConfig(size="3", prefetch=1.0)
    ref = m.generate(PROMPT, NEW, routing="cache-prior", cache=cc, stop_at_eos=False)
    for store in ("flash", "host"):
        off = m.generate(PROMPT, NEW, routing="cache-prior", cache=cc, stop_at_eos=False,
                         offload=offload.OffloadConfig(store=store))
        assert off.token_ids == ref.token_ids, store
        assert off.stats["offload"]["bytes_moved"] > 0


@pytest.mark.parametrize("d, f", [(3, 5), (300, 520)])  # within one tile, and across tile edges
def test_alternate_columns_turn_into_gate_rows_then_up_rows(d, f):
    from moejax.runtime import expert_store

    block = np.arange(d * 2 * f, dtype=np.float32).reshape(d, 2 * f)
    out = np.empty((2 * f, d), np.float32)
    expert_store._rows_of_alternate_columns(block, out)
    np.testing.assert_array_equal(out, np.concatenate([block[:, 0::2].T, block[:, 1::2].T]))
    turned = np.empty((2 * f, d), np.float32)
    expert_store._transposed_into(block, turned)
    np.testing.assert_array_equal(turned, block.T)
