"""Host-driven offloaded decoding (``OffloadConfig(paging="host")``; works everywhere, CPU included).

The decode step is cut at each MoE layer into jitted stages: stage A (attention, router logits, router
step, the next layer's prefetch) → the host reads the slot changes, issues ``device_put`` of the missed
experts (and, asynchronously, of the prefetched ones, which overlap the expert compute) → stage B (experts
from the slots, residual). Transfers can be throttled to an emulated link (``bandwidth_gbps``,
``latency_us``: SpecMD appendix A.4), modelled as one sequential queue, so a phone's flash or a laptop's
PCIe link can be studied on any machine. Miss handling by cascade (low-bit experts) needs this path.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import seeds
from moejax.models import layout, model as model_lib, quant
from moejax.models import attention as attention_lib
from moejax.models import moe as moe_lib
from moejax.models import ops as ops_lib
from moejax.models.config import ModelConfig
from moejax.experts import routing as routing_lib
from moejax.experts.router import prefetch_step, router_step
from moejax.runtime import decode, prefill_paging
from moejax.runtime import sampling as sampling_lib
from moejax.runtime import expert_store as expert_store_lib
from moejax.runtime.expert_store import (EXPERT_KEYS, expert_list, expert_store, fill_slots, init_slots,
    slot_changes, split_params, tree_nbytes, write_slot)
from moejax.runtime.offload import OffloadConfig, check_capacity


# ------------------------------------------------------------------------------------------ emulated link


class Link:
    """Host→device transfers as one sequential queue; with ``gbps`` set each transfer takes
    latency + bytes / bandwidth on it (emulation), otherwise the real copy time is what it takes."""

    def __init__(self, gbps: float | None = None, latency_us: float = 0.0):
        self.gbps, self.latency = gbps, latency_us * 1e-6
        self.free_at = 0.0
        self.bytes = 0
        self.transfers = 0
        self.busy_s = 0.0  # time the link was busy (emulated), or measured issue→ready time (real)
        self.wait_s = 0.0  # time compute waited for transfers

    @property
    def emulated(self) -> bool:
        return self.gbps is not None or self.latency > 0

    def schedule(self, nbytes: int, now: float) -> float:
        """Queue a transfer issued at ``now``; returns when it completes (emulation) or ``now``."""
        self.bytes += int(nbytes)
        self.transfers += 1
        if not self.emulated:
            return now
        start = max(now, self.free_at)
        dur = self.latency + (nbytes / (self.gbps * 1e9) if self.gbps else 0.0)
        self.free_at = start + dur
        self.busy_s += dur
        return self.free_at

    def wait_until(self, t: float) -> None:
        now = time.perf_counter()
        if t > now:
            if t - now > 2e-3:
                time.sleep(t - now - 1e-3)
            while time.perf_counter() < t:
                pass
            self.wait_s += t - now


# ------------------------------------------------------------------------------------------ stages


@functools.partial(jax.jit, static_argnames=("cfg", "layer"), donate_argnames=("kv",))
def _stage_a(lp, next_lp, cfg: ModelConfig, layer: int, moe_index, x, pos, kv, state, prediction):
    """Attention + router step of one MoE layer, then the next MoE layer's prefetch (cache update only;
    the host starts its transfers right away). Event order = the simulation's: route(l), prefetch(l+1).
    ``moe_index`` is traced, so layers of one structure share one compiled stage."""
    x, kv = prefill_paging.attention(lp, cfg, layer, x, pos, kv)
    h = ops_lib.norm(x, lp["mlp_norm"], cfg)
    z = moe_lib.router_logits(lp["moe"], h)[0]
    cs, rs, policy = state["cache"], state["routing"], state["policy"]
    experts, weights, hits, tier, cs, rs = router_step(z, cs, rs, policy, cfg.gating, moe_index,
                                                       prediction=prediction, with_tier=True)
    # slots as this layer computes with them (a global-scope prefetch below may reuse one of them later)
    slot_ids = cs.slot[moe_index, jnp.maximum(experts, 0)]
    slot_mid = cs.slot
    next_prediction = None
    if next_lp is not None and cs.prefetcher.enabled:
        z_pred = moe_lib.router_logits(next_lp["moe"], ops_lib.norm(x, next_lp["mlp_norm"], cfg))[0]
        cs, next_prediction = prefetch_step(cs, moe_index + 1, z_pred, cfg.gating,
                                            routing_lib.layer_bias(rs, moe_index + 1))
    state = {**state, "cache": cs, "routing": rs}
    return x, h, kv, state, next_prediction, (experts, weights, hits, tier, slot_ids, slot_mid, z)


@functools.partial(jax.jit, static_argnames=("cfg", "tiers"))
def _stage_b(p, cfg: ModelConfig, x, h, slots, staging, experts, weights, tier, slot_ids, tiers: tuple):
    """Routed experts from the slot buffers (full precision) and the low-bit staging buffers, + residual."""
    full = (tier == 0) & (experts >= 0)
    y = moe_lib.routed_experts({**p, "experts": slots}, cfg, h, jnp.where(full, slot_ids, -1)[None],
                               jnp.where(full, weights, 0.0)[None], bias_ids=experts[None])
    return _low_bit_and_residual(p, cfg, x, h, y, staging, experts, weights, tier, tiers)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _stage_b_early(p, cfg: ModelConfig, h, slots, early_ids, experts):
    """The part of stage B no page of this step is needed for: the experts already resident (``early_ids``:
    their slots, -1 elsewhere; this step's misses never write them) and the shared experts. Dispatched before
    the host reads the misses, it computes while they are read (``OffloadConfig.overlap``)."""
    biases = moe_lib.expert_biases(p, early_ids[None], experts[None], slots.n_experts)
    rows = moe_lib.one_token_expert_rows(cfg.expert_act, slots, h, early_ids[None], biases)
    return rows, (moe_lib.shared_expert_parts(p, cfg, h) if "shared" in p else None)


@functools.partial(jax.jit, static_argnames=("cfg", "tiers"))
def _stage_b_late(p, cfg: ModelConfig, x, h, slots, staging, experts, weights, tier, slot_ids, early, rows,
                  shared, tiers: tuple):
    """Stage B after ``_stage_b_early``: the paged experts, then the sum in ``_stage_b``'s order (same result,
    bit for bit: tested)."""
    full = (tier == 0) & (experts >= 0)
    late = jnp.where(full & ~early, slot_ids, -1)[None]
    y = moe_lib.one_token_expert_sum(cfg.expert_act, slots, h, late, jnp.where(full, weights, 0.0)[None],
                                     early_rows=rows, early=early,
                                       biases=moe_lib.expert_biases(p, late, experts[None], slots.n_experts))
    return _low_bit_and_residual(p, cfg, x, h, y, staging, experts, weights, tier, tiers, shared)


def _low_bit_and_residual(p, cfg: ModelConfig, x, h, y, staging, experts, weights, tier, tiers: tuple,
                          shared=None):
    """Stage B's end: the low-bit experts (cascade), the shared experts (``shared``: computed already), residual."""
    for bits in tiers:
        sel = (tier == bits) & (experts >= 0)
        low = {k: quant.dequantize(staging[bits][k], h.dtype) for k in EXPERT_KEYS}
        low.update(moe_lib.expert_biases(p) or {})  # GPT-OSS's, by the real ids below
        y = y + moe_lib.routed_experts(low, cfg, h, jnp.where(sel, jnp.arange(tier.shape[0]), -1)[None],
                                       jnp.where(sel, weights, 0.0)[None], bias_ids=experts[None])
    if "shared" in p:  # the gate is applied here also when the rest came early: XLA fuses the product into the
        # sum (one rounding, not two: seen on float32 Qwen2-MoE), so it must be in this program either way
        y = y + moe_lib.combine_shared(*(moe_lib.shared_expert_parts(p, cfg, h) if shared is None else shared))
    return model_lib.residual(cfg, x, y)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits(params, cfg: ModelConfig, x):
    """Logits [T, V] (float32) of every row of hidden states x."""
    return model_lib.output_logits(params, cfg, ops_lib.norm(x, params["final_norm"], cfg))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head(params, cfg: ModelConfig, x, key, sampling, seen=None):
    """Sample the token after the last row of x (one split of the key, as ``decode.prefill``; ``seen``: the
    tokens so far, with a repetition penalty)."""
    logits = model_lib.output_logits(params, cfg, ops_lib.norm(x[-1:], params["final_norm"], cfg))
    key, sub = jax.random.split(key)
    return sampling_lib.sample(logits[0], sub, sampling, seen), logits[0], key


# ------------------------------------------------------------------------------------------ the pager


def storage_read_bytes() -> int | None:
    """Bytes this process has read from storage so far (Linux ``/proc/self/io`` ``read_bytes``: page-cache
    hits do not count), or None where the kernel does not say."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclasses.dataclass
class PagingStats:
    tokens: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0
    low_bit_loads: int = 0
    bytes_moved: int = 0
    prefill_pages: int = 0  # experts paged by batched prefills (each at most once per layer and piece)
    pages_in_place: int = 0  # pages read straight into their slot's memory (the rest: device_put + swap)
    overlapped_steps: int = 0  # MoE layer steps whose resident and shared experts computed while misses were read
    transfer_s: float = 0.0  # real: issue → ready of each demand batch (the host waits on it alone)
    timed_bytes: int = 0  # bytes of those batches
    step_s: float = 0.0  # wall time in ``step``: every decode token (and prompt token, when fed one by one)
    sync_s: float = 0.0  # of it, waiting for the device's routing results the host pages by
    page_s: float = 0.0  # of it, paging: reading pages, issuing their copies, waiting for them, writing slots
    host_reads: int = 0  # batches of device results the host waited for in ``step`` (one per MoE layer step)
    # making the store and the zeroed slots (first-touch faults: 1.0 s for 3.6 GB, 9.6 s for 14.5 GB at
    # Qwen3-30B-A3B shapes), reported apart as load and compile time are; 0 for a pager kept from an earlier call
    setup_s: float = 0.0


PAGE_MMAP_THRESHOLD = 1 << 20


@functools.lru_cache(maxsize=None)
def return_large_frees_to_the_os() -> bool:
    """Pin glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) at ``PAGE_MMAP_THRESHOLD``, once per
    process: every page moves an expert through transient buffers of several MB, and with glibc's default
    *dynamic* threshold each freed one raises the threshold, so later ones come from the heap and are never
    returned: measured on Qwen1.5-MoE shapes, +3.8 GB of resident memory over 320 pages (a 12 GiB budget
    overrun), flat with the threshold pinned. No effect where the C library is not glibc, or when the user
    set ``MALLOC_MMAP_THRESHOLD_`` already. Returns whether it was set."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is not None:
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, PAGE_MMAP_THRESHOLD))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


class HostPager:
    """Host-driven offloaded decoding (module docstring): states as explicit values, stages jitted."""

    def __init__(self, params: dict, cfg: ModelConfig, router_state: dict, offload: OffloadConfig,
                 stores: dict | None = None):
        t_setup = time.perf_counter()
        return_large_frees_to_the_os()
        cs = router_state["cache"]
        check_capacity(cfg, cs)
        self.cfg, self.offload = cfg, offload
        self.miss = cs.miss
        self.tiers = tuple(sorted(set(cs.miss.bits))) if cs.miss.mode == "cascade" else ()
        self.store = expert_store(params, cfg, offload.store, offload.store_dir, self.tiers, cs.miss.group_size, stores)
        self.device = self.store.device
        self.params = jax.device_put(split_params(params, cfg), self.device)
        self.dtype = params["embed"].dtype
        self.moe_ids = self.store.moe_ids
        self.link = Link(offload.bandwidth_gbps, offload.latency_us)
        self.stats = PagingStats()
        self._paging_clock = 0.0  # seconds in _issue and _complete, wherever called (step counts its share)
        self.global_scope = cs.scope == "global"
        slots = init_slots(cfg, cs, self.dtype, int8=offload.slot_dtype == "int8")
        self.slots = fill_slots(self.committed(slots), self.store, cs)
        # pages read from the files straight into the serving layout (no program): into slots of the stored dtype,
        # or 16-bit pages into int8 slots, quantised on the way (on the host when written in place)
        self.serving_pages = self.store.reads_serving and (offload.slot_dtype == "int8" or not self.store.int8)
        # ... and into the slots' own memory where that is host memory (CPU): the one copy a page needs
        self.in_place = (offload.page_writes == "auto" and self.serving_pages
                         and expert_store_lib.distinct_host_buffers(self.slots))
        # outputs of computations that read the slots (per MoE layer, the pool, the prefill staging) and may
        # still run: an in-place page waits for those of what it overwrites
        self._readers: dict = {}
        self.state = self.committed(router_state)
        k = cfg.top_k
        self.staging = {}
        for b in self.tiers:  # K low-bit experts per layer step, quantised layout
            one = self.store.get(0, 0, b)
            self.staging[b] = self.committed({name: jax.tree.map(lambda a: jnp.zeros((k, *a.shape), a.dtype), one[name])
                                              for name in EXPERT_KEYS})
        self._slot_mirror = None  # (the slot table as a device array, its host copy): ``_slot_table``
        self._moe_index = [jax.device_put(np.int32(j), self.device) for j in range(len(self.moe_ids))]
        self.split_stage_b = None  # True / False: every decode step's stage B split / one (the warm-up's steps)
        self._prefill_staging = None  # K buffers streamed experts pass through in a batched prefill (on first use)
        # one compiled stage per distinct layer structure (sliding window), not per layer
        self._rep = prefill_paging.layer_programs(cfg)
        self.stats.setup_s = time.perf_counter() - t_setup

    def committed(self, tree):
        """``tree``'s arrays committed to the pager's device. Pages arrive committed (``device_put``), and jit
        keys its cache on committedness: slots (or a KV cache, a router state) that start uncommitted would
        recompile the stages for every new mix of paged and not-yet-paged slots while the cache fills (seen:
        0.4–1.1 s extra per token for the first ~10 tokens at Qwen1.5-MoE shapes)."""
        return jax.tree.map(lambda a: jax.device_put(a, self.device) if isinstance(a, jax.Array) else a, tree)

    # ---- memory
    def device_bytes(self, kv) -> dict:
        slots = tree_nbytes(self.slots)
        staging = tree_nbytes(self.staging)
        acc = {"non_expert_weights": tree_nbytes(self.params), "slots": slots, "kv_cache": tree_nbytes(kv),
               "low_bit_staging": staging, "prefill_staging": tree_nbytes(self._prefill_staging)}
        acc["accounted_total"] = sum(acc.values())
        measured = None
        try:
            ms = self.device.memory_stats()
            if ms and "peak_bytes_in_use" in ms:
                measured = int(ms["peak_bytes_in_use"])
        except Exception:  # noqa: BLE001 - backends without memory stats (CPU)
            measured = None
        acc["measured_peak"] = measured
        acc["all_experts_on_host"] = self.store.nbytes
        return acc

    def summary(self, kv, tokens: int, seconds: float) -> dict:
        s, link = self.stats, self.link
        transfer_s = link.busy_s if link.emulated else s.transfer_s
        return {
            "paging": "host", "store": self.offload.store, "bandwidth_gbps": self.offload.bandwidth_gbps,
            "latency_us": self.offload.latency_us, "setup_s": s.setup_s, "expert_bytes": self.store.expert_bytes,
            "bytes_moved": s.bytes_moved, "bytes_per_token": s.bytes_moved / max(tokens, 1),
            "demand_loads": s.demand_loads, "prefetch_loads": s.prefetch_loads, "low_bit_loads": s.low_bit_loads,
            "prefill": "batched" if self.batched_prefill else "token", "prefill_pages": s.prefill_pages,
            "page_writes": self.offload.page_writes, "pages_in_place": s.pages_in_place,
            "overlap": self.offload.overlap, "overlapped_steps": s.overlapped_steps,
            "transfer_s": transfer_s, "compute_wait_s": link.wait_s,
            # where the steps' time goes: waiting for routing results, paging, the rest is host work
            "step_s": s.step_s, "sync_s": s.sync_s, "page_s": s.page_s, "host_reads": s.host_reads,
            # emulated: bytes over link busy time; real: demand batches' bytes over their issue→ready time
            "achieved_gbps": ((s.bytes_moved if link.emulated else s.timed_bytes) / transfer_s / 1e9
                              if transfer_s > 0 else None),
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "device_memory": self.device_bytes(kv),
        }

    def _on_host(self, *arrays) -> tuple:
        """Device results the host needs to page by, as numpy arrays, copied in one batch (every copy started
        before the first is waited for: one round trip, not one per array): the wait (the device finishing
        what was queued before them, and the copies) is counted in ``sync_s``."""
        t = time.perf_counter()
        out = tuple(jax.device_get(arrays))
        self.stats.sync_s += time.perf_counter() - t
        self.stats.host_reads += 1
        return out

    def _slot_table(self) -> np.ndarray:
        """The cache's slot table [moe_layers, N] on the host. A decode step's MoE layer starts from the table
        the previous layer step left (stage B and dense layers do not change the cache state), which the host
        read then: it is reused while the state holds that same array, so the host dispatches this layer's
        stage A without waiting for the previous layer's experts to finish. Otherwise (a new state: the first
        token, a prompt piece, a state set from outside) it is read now."""
        slot = self.state["cache"].slot
        if self._slot_mirror is not None and self._slot_mirror[0] is slot:
            return self._slot_mirror[1]
        table, = self._on_host(slot)
        return table

    # ---- paging
    def reading(self, key, output) -> None:
        """``output`` comes from a computation that reads the buffers under ``key`` (a MoE layer's slots, "pool",
        "staging"): no page is written into them in place until it is ready."""
        if self.in_place:
            self._readers[key] = [*self._running(key), output]

    def _running(self, key) -> list:
        """The outputs registered under ``key`` whose computation still runs. A finished or donated one is
        dropped: the list must not keep its buffer alive (a prompt piece's rows are [T·K, D] float32, 16 MiB
        per MoE layer at 512 tokens; held, they grew the memory of an offloaded prompt by ~0.75 GiB per
        1,024 tokens)."""
        # a donated output (a prefill round's rows) was consumed by a later reader, itself registered
        return [a for a in self._readers.get(key, []) if not a.is_deleted() and not a.is_ready()]

    def release_finished(self) -> None:
        """Drop every finished reader (``_running``), under every key."""
        for key in list(self._readers):
            running = self._running(key)
            if running:
                self._readers[key] = running
            else:
                del self._readers[key]

    def _idle(self, key) -> bool:
        """Whether every computation reading the buffers under ``key`` has finished (then they may be written
        in place). While one runs a page takes the copy path instead, into a new buffer swapped into the slot:
        the running computation keeps the old one, and the copy overlaps it rather than waiting for it (a
        batched prompt's staging rounds: waiting cost back the saved copies at 1,024 tokens)."""
        pending = self._running(key)
        if not pending:
            self._readers.pop(key, None)
            return True
        self._readers[key] = pending
        return False

    def _slot_key(self, moe_index: int, staging: bool = False):
        return "staging" if staging else "pool" if self.global_scope else moe_index

    def _buffers(self, moe_index: int, staging: bool = False) -> layout.ExpertList:
        if staging:
            return self._prefill_staging
        return self.slots if self.global_scope else self.slots[moe_index]

    def _issue(self, loads, bits=0, now=None, staging: bool = False):
        """Page each (moe_index, expert, slot) from the store: read into the slot's own memory (``in_place``, when
        nothing reading it runs: done when this returns), else ``device_put`` (``_complete`` swaps it in);
        returns (pages, done_time)."""
        t_call = time.perf_counter()
        now = t_call if now is None else now
        out, done = [], now
        for moe_index, expert, s in loads:
            if self.in_place and not bits and self._idle(self._slot_key(moe_index, staging)):
                self.store.get(moe_index, expert, serving=True,
                               out=expert_store_lib.slot_views(self._buffers(moe_index, staging), s))
                data = None
                self.stats.pages_in_place += 1
            else:
                data = jax.device_put(self.store.get(moe_index, expert, bits,
                                                     serving=self.serving_pages and not bits), self.store.target)
            done = self.link.schedule(self.store.nbytes_of(bits), now)
            self.stats.bytes_moved += self.store.nbytes_of(bits)
            out.append((moe_index, expert, s, data))
        self._paging_clock += time.perf_counter() - t_call
        return out, done

    def _complete(self, issued, done_time, t_issue, timed: bool = True, staging: bool = False):
        """Wait for a batch (emulated link time, or the real copies) and write it into the slots (``staging``:
        into the prefill staging buffers). ``timed``: the batch ran alone (demand loads: the host has just
        synchronised on the router step), so issue→ready is its transfer time; a prefetch batch overlaps
        compute and is not timed."""
        if not issued:
            return
        t_call = time.perf_counter()
        if self.link.emulated:
            self.link.wait_until(done_time)
        else:
            jax.block_until_ready([d for *_, d in issued if d is not None])
            if timed:
                self.stats.transfer_s += time.perf_counter() - t_issue
                self.stats.timed_bytes += sum(self.store.nbytes_of(0) for _ in issued)
        flip = self.store.flip
        for moe_index, _, s, data in issued:
            if data is None:  # read into the slot in place
                continue
            if staging:
                self._prefill_staging = write_slot(self._prefill_staging, data, s, flip)
            elif self.global_scope:
                self.slots = write_slot(self.slots, data, s, flip)
            else:
                self.slots[moe_index] = write_slot(self.slots[moe_index], data, s, flip)
        self._paging_clock += time.perf_counter() - t_call

    def _early(self, demand, experts: np.ndarray, tier: np.ndarray, slot_ids: np.ndarray, shared: bool):
        """Which of a decode step's K experts stage B computes before its misses are paged in (``[K]`` bool:
        resident at full precision, in a slot none of the ``demand`` pages writes), or None when the step
        runs as one stage B (``OffloadConfig.overlap`` off, no miss, or nothing to compute meanwhile)."""
        forced = self.split_stage_b
        if not self.offload.overlap or forced is False or (forced is None and not demand):
            return None
        written = [s for *_, s in demand]
        early = (experts >= 0) & (tier == 0) & ~np.isin(slot_ids, written)
        return early if forced or early.any() or shared else None

    # ---- batched prefill (``prefill_paging``)
    @property
    def batched_prefill(self) -> bool:
        """Whether prompts run a layer at a time (``OffloadConfig.prefill`` and the cache allow it)."""
        return (self.offload.prefill == "batched"
                and prefill_paging.batched_prefill_supported(self.state["cache"]) is None)

    @property
    def staging_size(self) -> int:
        return self.cfg.top_k

    def layer_program(self, i: int) -> int:
        """The layer whose compiled stages layer ``i`` shares (same structure: sliding window, MoE or not)."""
        return self._rep[i]

    def predicting_for(self, moe_index: int):
        """The parameters of the MoE layer after ``moe_index`` when the cache prefetches (its router predicts
        from this layer's state), else None (so every layer's stage is one program)."""
        nxt = moe_index + 1
        if not self.state["cache"].prefetcher.enabled or nxt >= len(self.moe_ids):
            return None
        return self.params["layers"][self.moe_ids[nxt]]

    def prefill_staging(self):
        """The staging buffers (``staging_size`` experts, the slots' dtype), made on first use."""
        if self._prefill_staging is None:
            self._prefill_staging = self.committed(expert_list(self.cfg, self.staging_size, self.dtype,
                                                               int8=self.offload.slot_dtype == "int8"))
            if self.in_place and not expert_store_lib.distinct_host_buffers((self.slots, self._prefill_staging)):
                self.in_place = False  # never seen: the runtime shared a buffer between two zeroed arrays
        return self._prefill_staging

    def round_experts(self, moe_index: int) -> layout.ExpertList:
        """What a prefill round computes with: the layer's C slots, then the staging buffers."""
        slots, staging = self.slots[moe_index], self.prefill_staging()
        return layout.ExpertList(slots.gate_up + staging.gate_up, slots.down + staging.down)

    def page_into_slots(self, moe_index: int, loads) -> None:
        """Page (expert, slot) pairs of one layer into its slots (the host waits for them)."""
        t_issue = time.perf_counter()
        issued, done = self._issue([(moe_index, e, s) for e, s in loads], now=t_issue)
        self._complete(issued, done, t_issue)

    def page_into_staging(self, moe_index: int, experts) -> None:
        """Page experts of one layer into staging buffers 0, 1, ... (the host waits for them)."""
        self.prefill_staging()
        t_issue = time.perf_counter()
        issued, done = self._issue([(moe_index, e, j) for j, e in enumerate(experts)], now=t_issue, staging=True)
        self._complete(issued, done, t_issue, staging=True)

    def prefill(self, prompt: np.ndarray, kv: list, key, sampling, bucketed: bool = False,
                record: list | None = None, all_logits: bool = False, seen=None):
        """The prompt (from position 0) in batched pieces (``prefill_paging.prefill_pieces``); returns (next
        token, its logits, kv, key) as ``step`` does for the last prompt token, or with ``all_logits`` (a
        teacher-forced pass) (logits [T, V] of every position, kv)."""
        x, start = None, 0
        # each piece's logits are copied into the result at once (kept as pieces and joined, a 1,024-token
        # pass held twice its [T, V] float32 logits: 1.2 GB at Qwen1.5-MoE's vocabulary)
        logits = np.empty((prompt.size, self.cfg.vocab_size), np.float32) if all_logits else None
        for n in prefill_paging.prefill_pieces(prompt.size, bucketed):
            x, kv = prefill_paging.run_piece(self, prompt[start:start + n], start, kv, record)
            if all_logits:
                logits[start:start + n] = np.asarray(_logits(self.params, self.cfg, x))
            start += n
        self.stats.tokens += int(prompt.size)
        if all_logits:
            return logits, kv
        nxt, last, key = _head(self.params, self.cfg, x, key, sampling, seen)
        return nxt, last, kv, key

    def compile_prefill(self, n_tokens: int, kv: list, key, sampling, bucketed: bool = False, seen=None) -> None:
        """Compile every program ``prefill`` runs for an ``n_tokens`` prompt, from shapes (nothing runs)."""
        for n in sorted(set(prefill_paging.prefill_pieces(n_tokens, bucketed))):
            prefill_paging.compile_piece(self, n, kv)
        last = prefill_paging.prefill_pieces(n_tokens, bucketed)[-1]
        x = jax.ShapeDtypeStruct((last, self.cfg.hidden_size), self.dtype,
                                 sharding=jax.sharding.SingleDeviceSharding(self.device))
        _head.lower(self.params, self.cfg, x, key, sampling, seen).compile()

    def step(self, token, pos, kv, key, sampling, record: list | None = None, seen=None):
        """One token through every layer with paging; returns (next token, logits, kv, key) (``seen``: the
        tokens so far, with a repetition penalty).
        ``record`` (a list) receives this token's block {experts, weights, hits, router_logits}, each
        [moe_layers, 1, ...] (``stack_records``)."""
        t_step, paging_before = time.perf_counter(), self._paging_clock
        cfg = self.cfg
        pos = np.int32(pos)  # host values, not eager device ops: each of those is a dispatch of its own
        layer_records = []
        x = prefill_paging.embed_tokens(self.params["embed"], self.cfg, np.asarray([token], np.int32))
        prediction = None
        pending = ([], 0.0, 0.0)  # prefetch batch for the next MoE layer: (issued, done, t_issue)
        moe_index = 0
        for i, lp in enumerate(self.params["layers"]):
            rep = self._rep[i]
            if not cfg.moe_layers[i]:
                x, kv[i] = prefill_paging.dense_layer(lp, cfg, rep, x, pos, kv[i])
                continue
            nxt = self.predicting_for(moe_index)
            before = self._slot_table()
            x, h, kv[i], self.state, prediction, routed = _stage_a(
                lp, nxt, cfg, rep, self._moe_index[moe_index], x, pos, kv[i], self.state, prediction)
            experts, weights, hits, tier, slot_ids, slot_mid, z = routed
            # everything the host reads of this layer step, in one batch (the record's parts only if recorded)
            mid, after, tier_np, experts_np, slot_ids_np, *recorded = self._on_host(
                slot_mid, self.state["cache"].slot, tier, experts, slot_ids,
                *((weights, hits, z) if record is not None else ()))
            self._slot_mirror = (self.state["cache"].slot, after)
            if record is not None:
                layer_records.append((experts_np, *recorded))
            demand = slot_changes(before, mid)  # this layer's misses: needed before its experts run
            ahead = slot_changes(mid, after)  # the next layer's prefetch: overlaps this layer's compute
            early = self._early(demand, experts_np, tier_np, slot_ids_np, "shared" in lp["moe"])
            if self.in_place or early is not None:  # prefetched pages still to be swapped in land first: a
                self._complete(*pending, timed=False)  # demand page written in place may reuse one of their
                pending = ([], 0.0, 0.0)  # slots (one pool); the early experts may be prefetched ones
            if early is not None:  # runs while the misses are read (their slots are none of these)
                rows, shared = _stage_b_early(lp["moe"], cfg, h, self._buffers(moe_index),
                                              np.where(early, slot_ids_np, -1).astype(np.int32), experts)
                self.stats.overlapped_steps += 1
            t_issue = time.perf_counter()
            issued, done = self._issue(demand, now=t_issue)
            self.stats.demand_loads += len(demand)
            low_issued = []
            if self.tiers and tier_np.any():
                e_np = experts_np
                for kpos in np.nonzero(tier_np)[0]:
                    b = int(tier_np[kpos])
                    data = jax.device_put(self.store.get(moe_index, int(e_np[kpos]), b), self.store.target)
                    done = max(done, self.link.schedule(self.store.nbytes_of(b), t_issue))
                    self.stats.bytes_moved += self.store.nbytes_of(b)
                    self.stats.low_bit_loads += 1
                    low_issued.append((b, int(kpos), data))
            # the previous layer's prefetch for this layer must be in place before its experts run
            self._complete(*pending, timed=False)
            self._complete(issued, done, t_issue)
            for b, kpos, data in low_issued:
                if not self.link.emulated:
                    jax.block_until_ready(data)
                self.staging[b] = {n: jax.tree.map(lambda buf, d: buf.at[kpos].set(d), self.staging[b][n], data[n])
                                   for n in EXPERT_KEYS}
            slots = self._buffers(moe_index)  # after the pages: a copied page replaced its slot's buffer
            if early is None:
                x = _stage_b(lp["moe"], cfg, x, h, slots, self.staging, experts, weights, tier, slot_ids,
                             self.tiers)
            else:
                x = _stage_b_late(lp["moe"], cfg, x, h, slots, self.staging, experts, weights, tier, slot_ids,
                                  early, rows, shared, self.tiers)
            self.reading(self._slot_key(moe_index), x)
            # prefetch transfers start now and overlap this layer's expert compute and the next attention
            # (in place, per-layer slots: the next layer's slots, which nothing running reads)
            t_pf = time.perf_counter()
            pf_issued, pf_done = self._issue(ahead, now=t_pf)
            self.stats.prefetch_loads += len(ahead)
            pending = (pf_issued, pf_done, t_pf)
            moe_index += 1
        self._complete(*pending, timed=False)
        nxt_token, logits, key = _head(self.params, cfg, x, key, sampling, seen)
        self.stats.tokens += 1
        self.stats.step_s += time.perf_counter() - t_step
        self.stats.page_s += self._paging_clock - paging_before
        if record is not None and layer_records:
            record.append({name: np.stack([r[j] for r in layer_records])[:, None]
                           for j, name in enumerate(RECORD_NAMES)})
        return nxt_token, logits, kv, key


def host_forward(params, cfg: ModelConfig, tokens, router_state: dict, offload: OffloadConfig,
                 stores: dict | None = None) -> dict:
    """Teacher-forced pass with real paging (evaluation with ``--offload``): batched a layer at a time as a
    prefill (``HostPager.prefill``), or token by token as decoding pages (``OffloadConfig.prefill="token"``,
    global caches, cascade). Returns logits [T, V], experts / weights / hits [L, T, K], the router state
    after the pass and the offload statistics."""
    tokens = np.asarray(tokens, np.int32)
    pager = HostPager(params, cfg, router_state, offload, stores)
    kv = pager.committed(attention_lib.init_kv(cfg, tokens.size, params["embed"].dtype))
    key = jax.random.PRNGKey(0)
    rec = []
    t0 = time.perf_counter()
    if pager.batched_prefill:
        logits, kv = pager.prefill(tokens, kv, key, sampling_lib.Sampling(), record=rec, all_logits=True)
    else:
        logits = np.empty((tokens.size, cfg.vocab_size), np.float32)  # filled row by row, never held twice
        for pos, tok in enumerate(tokens.tolist()):
            _, lg, kv, key = pager.step(tok, pos, kv, key, sampling_lib.Sampling(), record=rec)
            logits[pos] = np.asarray(lg)
    elapsed = time.perf_counter() - t0
    out = stack_records(rec)
    return {"logits": logits, **out, "router_state": pager.state,
            "offload": pager.summary(kv, tokens=tokens.size, seconds=elapsed)}


RECORD_NAMES = prefill_paging.RECORD_NAMES


def stack_records(rec: list) -> dict:
    """Record blocks (each {experts, weights, hits, router_logits} [moe_layers, t, ...]: a decode step's, or a
    batched prefill piece's) -> one of each over all their tokens, [moe_layers, T, ...]."""
    return {name: np.concatenate([r[name] for r in rec], axis=1) for name in RECORD_NAMES}


def host_generate(params, cfg: ModelConfig, prompt_ids, router_state: dict, offload: OffloadConfig, *,
                  max_new_tokens: int, sampling: sampling_lib.Sampling = sampling_lib.Sampling(), seed: int = 0,
                  stop_at_eos: bool = True, on_tokens: Callable[[list[int]], None] | None = None,
                  prefill_policy=None, warmup: bool = True, stores: dict | None = None,
                  stop: decode.Stop = decode.NO_STOP, bucketed: bool = False,
                  keep_slots: bool = False, on_cache=None) -> decode.GenerateResult:
    """Offloaded generation with host-driven paging; same sampling and key schedule as ``decode.generate``,
    so with the same policy the tokens are the simulation's. The prompt runs batched, a layer at a time
    (``HostPager.prefill``: each needed expert paged once per layer), or token by token where the cache or
    ``OffloadConfig.prefill="token"`` asks for it.
    ``bucketed``: a KV cache of ``decode.kv_bucket`` rows (the stages compile once per bucket).
    ``keep_slots`` (needs ``stores``): keep the pager, with its device slots, in ``stores`` after the call; a
    next call whose ``router_state["cache"]`` is the one this call returned continues with those slots instead
    of paging the resident experts in again (and without a warm-up: new shapes compile on first use) — what
    a server that carries one cache from request to request needs. Without it a kept pager is dropped."""
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    context = cfg.max_position_embeddings
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt.size > context:
        raise ValueError(f"the prompt has {prompt.size} tokens, longer than the context of {context}")
    if np.any(prompt < 0) or np.any(prompt >= cfg.vocab_size):
        raise ValueError(f"token ids must be in 0..{cfg.vocab_size - 1}")
    requested, max_new_tokens = max_new_tokens, decode.generation_budget(prompt.size, max_new_tokens, context)
    eos = tuple(cfg.eos_token_ids) if stop_at_eos else ()
    decode_policy = router_state["policy"]
    if prefill_policy is not None:
        router_state = {**router_state, "policy": prefill_policy}
    pager = _continuing_pager(stores, router_state, offload) if keep_slots else None
    if stores is not None and pager is None:
        stores.pop(KEPT_PAGER, None)  # its slots are freed before new ones are filled
    if pager is not None:
        warmup = False
        pager.state, pager.stats, pager.link = pager.committed(router_state), PagingStats(), Link(
            offload.bandwidth_gbps, offload.latency_us)
    else:
        pager = HostPager(params, cfg, router_state, offload, stores)
    dtype = params["embed"].dtype
    kv_rows = prompt.size + max_new_tokens + 1
    kv = pager.committed(attention_lib.init_kv(cfg, decode.kv_bucket(kv_rows) if bucketed else kv_rows, dtype))

    key = seeds.prng_key(seed)
    seen = pager.committed(sampling_lib.seen_tokens(sampling, cfg.vocab_size, prompt))
    t_compile = time.perf_counter()
    if warmup and pager.batched_prefill:  # the prompt's programs, from shapes
        pager.compile_prefill(prompt.size, kv, key, sampling, bucketed, seen)
    if warmup:  # compile every stage on throwaway copies of the states (no transfers counted)
        # the slots are not copied (that would double the largest buffer): afterwards whatever the saved
        # cache state names as resident is paged in again, so the slots hold exactly what it says
        saved = (pager.state, dataclasses.replace(pager.stats), pager.link.__dict__.copy(),
                 {b: dict(v) for b, v in pager.staging.items()})
        warm_kv = pager.committed(attention_lib.init_kv(cfg, kv[0][next(iter(kv[0]))].shape[0], dtype))
        link = pager.link
        pager.link = Link()
        # two steps: the second sees states that come out of jitted stages (what every later token sees)
        # (stage B split in the first and whole in the second: a step runs either, whatever it misses)
        warm_key = jax.random.PRNGKey(0)
        for pos in range(2):
            pager.split_stage_b = pos == 0
            _, _, warm_kv, warm_key = pager.step(int(prompt[0]), pos, warm_kv, warm_key, sampling, seen=seen)
        if decode_policy is not router_state["policy"]:
            pager.state = {**pager.state, "policy": decode_policy}
            for pos in range(2, 4):
                pager.split_stage_b = pos == 2
                _, _, warm_kv, warm_key = pager.step(int(prompt[0]), pos, warm_kv, warm_key, sampling, seen=seen)
        pager.split_stage_b = None
        del warm_kv  # a whole second KV cache: held to the end it cost 196 kB per position at Qwen1.5-MoE shapes
        jax.block_until_ready(pager.slots)
        pager.state, pager.stats, _, pager.staging = saved
        pager.slots = fill_slots(pager.slots, pager.store, pager.state["cache"])
        pager.link = link
    compile_time = time.perf_counter() - t_compile

    rec: list = []
    read0 = storage_read_bytes()
    t0 = time.perf_counter()

    def report():  # decode.generate's on_cache: the prompt's records, then token by token
        if on_cache is not None:
            decode.report_cache(on_cache, pager.state, {k: np.swapaxes(rec[-1][k], 0, 1) for k in ("experts", "hits")})

    if pager.batched_prefill:
        nxt, logits, kv, key_after = pager.prefill(prompt, kv, key, sampling, bucketed, record=rec, seen=seen)
        report()
    else:
        for pos, tok in enumerate(prompt.tolist()):
            nxt, logits, kv, key_after = pager.step(tok, pos, kv, key, sampling, record=rec, seen=seen)
            report()
    # decode.prefill splits the key once for the first token
    key = key_after
    first = int(nxt)
    seen = sampling_lib.see(seen, first)
    ttft = time.perf_counter() - t0
    moved_prefill = pager.stats.bytes_moved
    if prefill_policy is not None:
        pager.state = {**pager.state, "policy": decode_policy}
    tokens = [first] if max_new_tokens > 0 else []
    _, ended_by = stop.check(tokens, 0)
    if tokens and on_tokens:
        on_tokens(tokens[:])
    finished = not tokens or first in eos or ended_by is not None
    pos = prompt.size
    token = first
    read_decode = storage_read_bytes()
    t_decode = time.perf_counter()
    while not finished and len(tokens) < max_new_tokens:
        token_arr, _, kv, key = pager.step(token, pos, kv, key, sampling, record=rec, seen=seen)
        report()
        token = int(token_arr)
        seen = sampling_lib.see(seen, token)
        pos += 1
        tokens.append(token)
        _, ended_by = stop.check(tokens, len(tokens) - 1)  # one token per step: nothing to cut
        if on_tokens:
            on_tokens([token])
        if token in eos or ended_by is not None:
            finished = True
    total = time.perf_counter() - t0
    decode_time = time.perf_counter() - t_decode
    n_decode = max(len(tokens) - 1, 0)
    summary = pager.summary(kv, tokens=pager.stats.tokens, seconds=total)
    summary.pop("tokens_per_s")
    summary["bytes_moved_prefill"] = moved_prefill
    summary["bytes_per_decode_token"] = (pager.stats.bytes_moved - moved_prefill) / max(n_decode, 1)
    read_end = storage_read_bytes()
    if read0 is not None and read_end is not None:  # what really came from storage (page-cache misses)
        summary["storage_read_bytes_prefill"] = read_decode - read0
        summary["storage_read_per_decode_token"] = (read_end - read_decode) / max(n_decode, 1)
    stats = decode.generation_stats(int(prompt.size), tokens, ttft, total, decode_time, compile_time,
                                    decode.stop_reason(tokens, requested, eos, ended_by),
                                    int(prompt.size) + n_decode)
    stats["offload"] = summary
    out = stack_records(rec)
    decode.check_step(cfg, out["router_logits"], True, "the prompt or the generated tokens")
    # decode.GenerateResult.trace() layout: one prefill-like record over every fed token
    records = [{"experts": out["experts"], "weights": out["weights"], "logits": out["router_logits"],
                "hits": out["hits"]}]
    if keep_slots and stores is not None:
        stores[KEPT_PAGER] = pager
    return decode.GenerateResult(tokens, stats, records, pager.state)


KEPT_PAGER = "kept host pager"


def _continuing_pager(stores: dict | None, router_state: dict, offload: OffloadConfig):
    """The pager kept by the previous ``keep_slots`` call when ``router_state`` continues exactly from it
    (the same cache state object, so the slots hold what it says), else None."""
    pager = None if stores is None else stores.get(KEPT_PAGER)
    if pager is None or pager.offload != offload or pager.state["cache"] is not router_state["cache"]:
        return None
    return pager
