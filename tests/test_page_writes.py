"""Pages written in place (``OffloadConfig(page_writes="auto")``, the default): on the CPU a page is read from
the checkpoint's files straight into its device slot's own memory (``expert_store.host_view``), the one copy
a page needs, instead of ``device_put`` into a new buffer and a program that writes it into the slot. The
fast path must equal the copy path exactly — tokens, routing, bytes moved, what the slots hold — and never
write a slot while a computation that reads it may still run."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moejax
from support.hf_models import get_hf_model
from moejax.models import checkpoint, layout
from moejax.runtime import expert_store, host_paging, offload
from moejax.runtime.simulate import CacheConfig

# Pages go in place only into slots in host memory, the CPU backend's; on a GPU every page is a copy (what the
# offload tests cover there), and these tests, which count in-place pages, do not apply.
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="pages are written in place only into slots in host memory (the CPU backend)")

PROMPT = np.arange(3, 40, dtype=np.int32)


def _generate(folder: str, page_writes: str, cache: CacheConfig, prompt=PROMPT, new: int = 6, **load_kw):
    m = moejax.load(folder, offload=offload.OffloadConfig(store="flash", page_writes=page_writes), **load_kw)
    out = m.generate(prompt, new, routing="cache-prior", cache=cache, stop_at_eos=False, keep_slots=True)
    return out, m._stores[host_paging.KEPT_PAGER]


def _assert_same(a, b):
    (out_a, pager_a), (out_b, pager_b) = a, b
    assert out_a.token_ids == out_b.token_ids
    for k in ("experts", "weights", "hits"):
        np.testing.assert_array_equal(out_a.trace()[k], out_b.trace()[k])
    for k in ("bytes_moved", "bytes_moved_prefill", "demand_loads", "prefetch_loads", "prefill_pages"):
        assert out_a.stats["offload"][k] == out_b.stats["offload"][k], k
    np.testing.assert_array_equal(np.asarray(pager_a.state["cache"].slot), np.asarray(pager_b.state["cache"].slot))
    resident = np.asarray(pager_a.state["cache"].slot)
    global_scope = pager_a.global_scope
    for layer, expert in zip(*np.nonzero(resident >= 0)):  # every resident expert's slot holds the same bytes
        s = int(resident[layer, expert])
        slots_a = pager_a.slots if global_scope else pager_a.slots[layer]
        slots_b = pager_b.slots if global_scope else pager_b.slots[layer]
        for x, y in zip(jax.tree.leaves(slots_a.expert(s)), jax.tree.leaves(slots_b.expert(s))):
            assert bool(jnp.array_equal(x, y)), (layer, expert)


@pytest.mark.parametrize("name,cache", [
    ("olmoe_clip", CacheConfig(size="7", prefetch=1.0)),  # batched prompt in staging rounds, prefetch in place
    ("qwen3_moe", CacheConfig(size="0.5", scope="global", eviction="fld")),  # one pool: token-by-token prompt
    ("olmoe_clip", CacheConfig(size="0.3", scope="global", prefetch=2.0)),  # pool prefetch, evicted and re-paged
])
def test_in_place_pages_equal_copied_pages(name, cache):
    folder = get_hf_model(name).folder
    copied, in_place = _generate(folder, "copy", cache), _generate(folder, "auto", cache)
    assert not copied[1].in_place and in_place[1].in_place
    assert in_place[0].stats["offload"]["bytes_moved"] > 0
    assert copied[0].stats["offload"]["pages_in_place"] == 0 < in_place[0].stats["offload"]["pages_in_place"]
    _assert_same(copied, in_place)


def test_int8_folder_pages_in_place_equal_copied_pages(tmp_path):
    dst = str(tmp_path / "int8")
    checkpoint.convert_to_moejax(get_hf_model("qwen2_moe").folder, dst, expert_dtype="int8")
    cache = CacheConfig(size="0.5", prefetch=1.0)
    copied, in_place = _generate(dst, "copy", cache), _generate(dst, "auto", cache)
    assert in_place[1].in_place and layout.is_int8(in_place[1].slots[0].gate_up[0])
    _assert_same(copied, in_place)


@pytest.mark.parametrize("name,cache", [
    ("qwen2_moe", CacheConfig(size="0.5", prefetch=1.0)),  # shared experts, batched prompt, prefetch in place
    ("olmoe_clip", CacheConfig(size="0.3", scope="global")),  # one pool: pages evicted and quantised again
])
def test_int8_slots_of_a_16_bit_folder_quantise_pages_in_place_as_the_copy_path_does(name, cache):
    """``expert_dtype="int8"`` with the experts in a 16-bit folder: every page is quantised as it arrives. In place
    that is done on the host, into the slot's memory (``quant.quantize_rows_into``), on the copy path by a device
    program; the slots must hold the same bits and the tokens, routing and bytes be the same."""
    folder = get_hf_model(name).folder
    copied, in_place = (_generate(folder, pw, cache, expert_dtype="int8") for pw in ("copy", "auto"))
    assert not copied[1].in_place and in_place[1].in_place
    slots = in_place[1].slots if in_place[1].global_scope else in_place[1].slots[0]
    assert layout.is_int8(slots.gate_up[0])
    assert copied[0].stats["offload"]["pages_in_place"] == 0 < in_place[0].stats["offload"]["pages_in_place"]
    _assert_same(copied, in_place)


def test_teacher_forced_offload_in_place_equals_copy():
    folder = get_hf_model("olmoe_clip").folder
    for prefill in offload.PREFILLS:
        outs = [moejax.load(folder, offload=offload.OffloadConfig(store="flash", page_writes=pw, prefill=prefill))
                .forward(PROMPT, routing="cache-prior", cache=CacheConfig(size="7")) for pw in ("copy", "auto")]
        np.testing.assert_array_equal(outs[0].logits, outs[1].logits)
        assert outs[0].stats["offload"]["bytes_moved"] == outs[1].stats["offload"]["bytes_moved"] > 0


def test_a_slot_is_never_written_in_place_while_a_computation_reads_it():
    """While a reader of a layer's slots runs, its page takes the copy path (a new buffer swapped in; the
    reader keeps the old one); once the reader is done, the next page is written in place."""
    m = moejax.load(get_hf_model("qwen3_moe").folder, offload="flash")
    pager = host_paging.HostPager(m.params, m.cfg, m.router_state("original", CacheConfig(size="4")),
                                  offload.OffloadConfig(store="flash"), {})
    assert pager.in_place

    @jax.jit
    def slow(a):  # ~0.1-1 s on two cores: still running when the page is asked for
        return jax.lax.fori_loop(0, 40, lambda i, x: jnp.tanh(x @ a), a)

    running = slow(jnp.ones((768, 768), jnp.float32) / 768)
    pager.reading(0, running)
    writes = []  # (written in place, the reader done) per page
    real_get = pager.store.get

    def get(*args, out=None, **kw):
        writes.append((out is not None, running.is_ready()))
        return real_get(*args, out=out, **kw)

    pager.store.get = get
    old = pager.slots[0].expert(2)
    t0 = time.perf_counter()
    issued, done = pager._issue([(0, 5, 2)])
    pager._complete(issued, done, t0)
    assert writes == [(False, False)], writes  # the reader ran: copied, not written under it
    assert pager.slots[0].expert(2)[0] is not old[0]
    running.block_until_ready()
    issued, done = pager._issue([(0, 6, 3)])
    pager._complete(issued, done, t0)
    assert writes[1] == (True, True)  # nothing reads the slots now: in place
    store = expert_store.ExpertStore(m.params, m.cfg, "flash")
    for s, e in ((2, 5), (3, 6)):
        for x, y in zip(pager.slots[0].expert(s), store.get(0, e, serving=True)):
            np.testing.assert_array_equal(np.asarray(x), y)


def test_the_readers_list_does_not_keep_finished_outputs_alive():
    """The pager's list of computations reading the slots held every finished prompt piece's rows ([T·K, D]
    float32 per MoE layer) until that layer was paged again: ~0.75 GiB per 1,024 prompt tokens at Qwen1.5-MoE
    shapes (docs/benchmarks.md#the-reserve). A finished or donated output is dropped as soon as the list is
    looked at: on the next ``reading`` and by ``release_finished`` (after each layer of a prompt piece)."""
    import gc
    import weakref

    m = moejax.load(get_hf_model("qwen3_moe").folder, offload="flash")
    pager = host_paging.HostPager(m.params, m.cfg, m.router_state("original", CacheConfig(size="4")),
                                  offload.OffloadConfig(store="flash"), {})

    class Output:  # a stand-in with the jax.Array methods the list reads, and a weak reference to it
        def __init__(self, ready):
            self.ready = ready

        def is_ready(self):
            return self.ready

        def is_deleted(self):
            return False

    done, running = Output(True), Output(False)
    gone = weakref.ref(done)
    pager.reading(0, done)
    pager.reading("staging", running)
    pager.reading(0, Output(False))  # the finished one is dropped here
    assert [o.ready for o in pager._readers[0]] == [False]
    del done
    gc.collect()
    assert gone() is None  # nothing keeps it alive
    running.ready = True
    pager._readers[0][0].ready = True
    pager.release_finished()
    assert pager._readers == {}


def test_host_view_is_the_arrays_own_memory():
    a = jax.device_put(jnp.zeros((4, 6), jnp.bfloat16))
    view = expert_store.host_view(a)
    view[1, 2] = 3.0
    assert float(jnp.sum(a.astype(jnp.float32))) == 3.0  # a computation reads what was written
    assert expert_store.distinct_host_buffers([a, jnp.ones(3)]) and not expert_store.distinct_host_buffers([a, a])
    a.delete()
    assert expert_store.host_view(a) is None and expert_store.host_view(np.zeros(3)) is None


@pytest.mark.parametrize("seed", [0, 1])
def test_any_mix_of_in_place_and_copied_pages_gives_the_copied_result(monkeypatch, seed):
    """Which pages go in place depends on timing (``HostPager._idle``); with the choice made at random the
    result must still be the copy path's: a one-pool cache with prefetch, where a page swapped in late and a
    page written in place can meet in one slot."""
    folder = get_hf_model("olmoe_clip").folder
    cache = CacheConfig(size="0.3", scope="global", prefetch=2.0, eviction="lfu")  # demand evicts prefetched
    copied = _generate(folder, "copy", cache, new=10)
    rng = np.random.default_rng(seed)
    real_idle = host_paging.HostPager._idle
    monkeypatch.setattr(host_paging.HostPager, "_idle", lambda self, key: real_idle(self, key) and rng.random() < 0.5)
    mixed = _generate(folder, "auto", cache, new=10)
    o = mixed[0].stats["offload"]
    assert 0 < o["pages_in_place"] < o["bytes_moved"] // o["expert_bytes"]
    _assert_same(copied, mixed)
