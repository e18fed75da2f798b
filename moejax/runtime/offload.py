"""Real expert offloading: experts in host memory, a fixed number of device slots, bytes moved for real.

The device holds the non-expert weights, the KV cache and, per MoE layer (or in one global pool), the
``C`` slot buffers the expert cache names (``CacheState.slot``); every routed expert lives in host memory
(``pinned_host`` arrays, or a memory-mapped safetensors file as a slower "flash" tier). The router step is
the simulation's (``router.router_step``), so the same policy makes the same decisions; the offloader only
moves the bytes those decisions imply: after a step, every (layer, expert) whose slot changed is copied
from host memory into that slot. Where the experts live and how a page is written into its slot is
``expert_store``; this module is what the two paging paths share (``OffloadConfig.paging``):

``host`` (``host_paging``; works everywhere, CPU included): the decode step is cut at each MoE layer into
  jitted stages, the host issues the ``device_put`` of each step's misses (and, asynchronously, of the
  prefetched experts), optionally throttled to an emulated link (SpecMD appendix A.4).
``jit`` (``jit_paging``): the whole decode loop stays one ``lax.scan`` (``decode.generate``); the router
  hook pages inside jit from host-memory arrays under ``lax.cond``.

Both give exactly the tokens of simulation mode for the same policy (tests). Statistics: tokens/s, time
to first token, bytes moved per token, achieved transfer GB/s, per-layer hit rates, prefetch
precision/recall, device memory (measured where the backend reports it, accounted otherwise: non-expert
weights + slots × expert bytes + KV cache + low-bit staging).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from moejax.models.config import ModelConfig
from moejax.experts import cache as cache_lib
from moejax.runtime.expert_store import STORES
from moejax.runtime.prefill_paging import MAX_PIECE, PREFILLS

PAGINGS = ("host", "jit")
PAGE_WRITES = ("auto", "copy")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """How experts are offloaded. ``bandwidth_gbps`` None = as fast as the machine moves them."""

    paging: str = "host"  # host | jit
    store: str = "host"  # host (pinned_host memory) | flash (memory-mapped file)
    bandwidth_gbps: float | None = None
    latency_us: float = 0.0
    store_dir: str | None = None  # where the flash tier's file goes (default: a temporary folder)
    slot_dtype: str = "stored"  # "int8": the device slots hold int8 experts (quantised as they are paged in)
    prefill: str = "batched"  # batched: a prompt a layer at a time, each needed expert paged once | token
    # auto: pages read from the files straight into the slots' own memory where it is host memory (CPU) and
    # the files hold the slots' layout (expert_store.host_view); copy: always device_put + a write program
    page_writes: str = "auto"
    # a decode step's resident and shared experts compute while its misses are read (same result, bit for bit)
    overlap: bool = True

    def __post_init__(self):
        if self.paging not in PAGINGS:
            raise ValueError(f"unknown paging {self.paging!r}; expected one of {PAGINGS}")
        if self.store not in STORES:
            raise ValueError(f"unknown expert store {self.store!r}; expected one of {STORES}")
        if self.bandwidth_gbps is not None and not 1e-6 <= self.bandwidth_gbps < float("inf"):
            raise ValueError(f"emulated bandwidth must be a finite number >= 1e-6 GB/s (1 kB/s), got {self.bandwidth_gbps}")
        if not 0 <= self.latency_us <= 1e9:
            raise ValueError(f"transfer latency must be in [0, 1e9] µs, got {self.latency_us}")
        if self.paging == "jit" and (self.bandwidth_gbps is not None or self.latency_us):
            raise ValueError("bandwidth emulation needs host-driven paging (paging='host'): in-jit transfers "
                             "cannot be throttled from the host")
        if self.paging == "jit" and self.store == "flash":
            raise ValueError("in-jit paging reads host-memory arrays; the flash tier needs paging='host'")
        if self.prefill not in PREFILLS:
            raise ValueError(f"unknown prefill {self.prefill!r}; expected one of {PREFILLS}")
        if self.page_writes not in PAGE_WRITES:
            raise ValueError(f"unknown page_writes {self.page_writes!r}; expected one of {PAGE_WRITES}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be True or False, got {self.overlap!r}")
        if self.slot_dtype not in ("stored", "int8"):
            raise ValueError(f"slot_dtype must be 'stored' or 'int8', got {self.slot_dtype!r}")
        if self.slot_dtype == "int8" and self.paging == "jit":
            raise ValueError("int8 slots (--weight-dtype / --expert-dtype int8, or experts stored int8) are filled "
                             "by the host pager (--paging host, paging='host'); in-jit paging keeps the stored dtype")


#: what an offloaded run's memory peaks at beyond its weights, slots, KV cache and staging buffers, held back
#: by ``--cache-size auto`` and the fit check (docs/benchmarks.md#the-reserve, Qwen1.5-MoE shapes, peak anonymous
#: memory over the accounted bytes): the runtime and compiling the stage programs, ~0.52 GiB with an 8-token
#: prompt; a batched prompt piece's activations (``prefill_paging.MAX_PIECE`` tokens), +0.5 GiB at 512 tokens;
#: then little per position (0.96–1.19 GiB from 2,048 to 4,096). Each term is rounded up; what the process
#: already holds when the check runs (0.12–0.78 GiB measured) is margin on top.
RESERVE_BASE = 9 << 26  # 0.5625 GiB
RESERVE_PER_PIECE_TOKEN = (9 << 26) // 512  # 0.5625 GiB for a whole 512-token piece
RESERVE_PER_LATER_TOKEN = (1 << 30) // (20 * 1024)  # 0.05 GiB per 1,024 positions past the first piece
#: positions a KV cache is sized for when the call does not say (``Model.router_state`` alone)
DEFAULT_FIT_POSITIONS = 4096


def reserve_bytes(positions: int, hidden_size: int = 2048, runtime: bool = True) -> int:
    """``RESERVE_*`` for a run of ``positions`` (prompt + new tokens, a bound on the prompt's length), with
    the runtime's part (``RESERVE_BASE``) or, ``runtime=False``, the prompt's alone; the piece's activations
    scale with the hidden size (measured at 2,048)."""
    piece = min(positions, MAX_PIECE) * RESERVE_PER_PIECE_TOKEN * max(1.0, hidden_size / 2048)
    return int(RESERVE_BASE * runtime + piece + max(positions - MAX_PIECE, 0) * RESERVE_PER_LATER_TOKEN)


def slots_that_fit(headroom: int, fixed: int, slot_set_bytes: int, limit: int) -> int:
    """Slots per set (``slot_set_bytes``: one slot in every layer, or one in the pool) that ``headroom`` bytes
    hold after ``fixed`` ones, at most ``limit``; 0 when none do."""
    return int(max(0, min(limit, (headroom - fixed) // slot_set_bytes)))


def check_capacity(cfg: ModelConfig, cache_state: cache_lib.CacheState) -> None:
    """The device must hold the K experts of one token to compute it."""
    check_cache(cfg, int(cache_state.capacity), cache_state.eviction)


def check_cache(cfg: ModelConfig, capacity: int, eviction: str) -> None:
    """``check_capacity`` from a cache's capacity and eviction, before any state is made (the command line
    checks before it prints the prompt)."""
    if capacity < cfg.top_k:
        raise ValueError(f"offload needs a cache of at least K={cfg.top_k} experts (one token's experts must "
                         f"all be on the device), got capacity {capacity}")
    if eviction in cache_lib.OFFLINE_EVICTIONS:
        raise ValueError(f"{eviction} is an offline oracle over a recorded trace; it cannot drive real offloading")


# Counters and times of one call's summary that add up over calls; the per-call rates that cannot be
# recombined from a summary (per decode token, achieved GB/s) are dropped, tokens/s and bytes/token recomputed.
OFFLOAD_ADDITIVE = ("bytes_moved", "demand_loads", "prefetch_loads", "low_bit_loads", "transfer_s", "compute_wait_s",
                    "step_s", "sync_s", "page_s", "host_reads", "prefill_pages", "pages_in_place", "overlapped_steps",
                    "setup_s", "bytes_moved_prefill", "storage_read_bytes_prefill")
OFFLOAD_PER_CALL_RATES = ("bytes_per_token", "achieved_gbps", "tokens_per_s", "bytes_per_decode_token",
                          "storage_read_per_decode_token")


def merge_summaries(calls: list[tuple[int, dict]]) -> dict[str, Any]:
    """One offload summary over the calls of an evaluation (WikiText chunks, task prompts and generations),
    each ``(tokens it fed, its stats["offload"])``: counters and times summed, bytes and tokens per second
    recomputed over all tokens, everything else (configuration, device memory) from the last call."""
    tokens = sum(n for n, _ in calls)
    out = {k: v for k, v in calls[-1][1].items() if k not in OFFLOAD_PER_CALL_RATES}
    for key in OFFLOAD_ADDITIVE:
        if any(key in c for _, c in calls):
            out[key] = sum(c.get(key) or 0 for _, c in calls)
    seconds = [n / c["tokens_per_s"] for n, c in calls if c.get("tokens_per_s")]
    out.update(tokens=tokens, chunks=len(calls), bytes_per_token=out.get("bytes_moved", 0) / max(tokens, 1),
               tokens_per_s=tokens / sum(seconds) if len(seconds) == len(calls) and sum(seconds) > 0 else None)
    return out
