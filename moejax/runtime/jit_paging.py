"""In-jit offloaded decoding (``OffloadConfig(paging="jit")``).

The whole decode loop stays one ``lax.scan`` (``decode.generate``); the router hook (``JitPager``) pages
inside jit with ``lax.dynamic_index_in_dim`` on host-memory arrays + ``jax.device_put`` to device memory
under ``lax.cond`` (XLA does the transfer on GPU/TPU; on CPU the placement compiles to a plain copy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from moejax.models import model as model_lib, weights
from moejax.models.config import ModelConfig
from moejax.experts import routing as routing_lib
from moejax.experts.router import prefetch_step, router_step
from moejax.runtime import decode
from moejax.runtime.expert_store import (EXPERT_KEYS, ExpertStore, _host_sharding, expert_stacks, fill_slots,
    init_slots, split_params, tree_nbytes)
from moejax.runtime.offload import OffloadConfig, check_capacity


def host_memory_params(params: dict, cfg: ModelConfig) -> dict:
    """``params`` with each MoE layer's expert stacks moved to ``pinned_host`` memory (where the backend
    has it); everything else on the device. The in-jit pager slices one expert at a time from them."""
    device = jax.devices()[0]
    sharding = _host_sharding(device)
    layers = []
    for i, lp in enumerate(params["layers"]):
        if cfg.moe_layers[i]:
            stacks = expert_stacks(lp["moe"])
            moe = {k: v for k, v in lp["moe"].items() if k != "experts"}
            for k in EXPERT_KEYS:  # experts left in the files (or in a serving layout) are read a stack at a time
                stack = weights.to_host(stacks[k]) if weights.is_lazy(stacks[k]) else stacks[k]
                moe[k] = jax.device_put(stack, sharding) if sharding is not None else jnp.asarray(stack)
            lp = {**lp, "moe": moe}
        layers.append(lp)
    return {**params, "layers": layers}


def _to_device(x):
    try:
        return jax.device_put(x, jax.memory.Space.Device)
    except Exception:  # noqa: BLE001 - runtimes without memory spaces: already device memory
        return x


@dataclasses.dataclass(frozen=True)
class JitPager:
    """Router hook for ``model.forward`` that pages inside jit (offload ``paging="jit"``).

    State: the simulation's {"cache", "routing", "policy"} plus "slots" (the device slot buffers) and
    "pending" (this step's slot changes, [M] arrays, written by the hook's routing and paged by
    ``compute`` — which is where the expert stacks in host memory are reachable)."""

    gating: Any
    max_changes: int  # static bound on slot changes per router step (K + prefetch candidates)
    # the slot stacks are written in place every step; decode does not roll them back after EOS (see
    # decode.keep_when_done): they are rebuilt from the cache state at the next generate call
    no_rollback: tuple[str, ...] = ("slots",)

    @staticmethod
    def token_sequential(state: dict) -> bool:
        return True  # every token's experts must be in the slots when it is computed

    @staticmethod
    def wants_prediction(state: dict) -> bool:
        return state["cache"].prefetcher.enabled

    def __call__(self, moe_index: int, z: jax.Array, state: dict, z_pred: jax.Array | None = None):
        cs, rs, policy = state["cache"], state["routing"], state["policy"]
        if z.shape[0] != 1:
            raise ValueError("in-jit offload pages one token at a time (token-sequential forward)")
        # prefetch and route as two diffs, so an entry prefetched and then evicted by this very step's
        # routing still moves (as it would on a real link: the prefetch transfer was already issued)
        slot0 = cs.slot
        prediction = None
        if z_pred is not None and cs.prefetcher.enabled:
            cs, prediction = prefetch_step(cs, moe_index, z_pred[0], self.gating,
                                           routing_lib.layer_bias(rs, moe_index))
        slot1 = cs.slot
        e, w, h, tier, cs, rs = router_step(z[0], cs, rs, policy, self.gating, moe_index, prediction=prediction,
                                            with_tier=True)
        if cs.miss.mode == "cascade":
            raise ValueError("cascade miss handling needs host-driven paging (paging='host')")
        parts = []
        for before, after, size in ((slot0, slot1, self.max_changes - self.gating.top_k),
                                    (slot1, cs.slot, self.gating.top_k)):
            changed = (after >= 0) & (after != before)
            if size <= 0:
                continue
            rows, cols = jnp.nonzero(changed, size=size, fill_value=-1)
            parts.append((rows, cols, after[jnp.maximum(rows, 0), jnp.maximum(cols, 0)], changed.sum()))
        rows = jnp.concatenate([p[0] for p in parts]).astype(jnp.int32)
        cols = jnp.concatenate([p[1] for p in parts]).astype(jnp.int32)
        pending = {"row": rows, "expert": cols, "slot": jnp.concatenate([p[2] for p in parts]).astype(jnp.int32),
                   "valid": rows >= 0, "count": sum(p[3] for p in parts).astype(jnp.int32)}
        state = {**state, "cache": cs, "routing": rs, "pending": pending,
                 "moved": state["moved"] + pending["count"]}
        return e[None], w[None], state, {"hits": h[None]}

    def compute(self, moe_index, p, cfg, h, experts, weights, record, state):
        """Page this step's changes for this layer from host memory into the slots, then compute.
        Global scope: a prefetch can land in another layer's row; it is paged when that layer runs (its
        slot was assigned now; nothing reads it before then)."""
        pending = state["pending"]
        global_scope = state["cache"].scope == "global"
        slots = state["slots"] if global_scope else state["slots"][moe_index]
        host = {k: p[k] for k in EXPERT_KEYS}
        for j in range(self.max_changes):
            row, expert, s = pending["row"][j], pending["expert"][j], pending["slot"][j]
            # in global scope only rows of this layer can be paged from this layer's host stacks
            need = pending["valid"][j] & (row == moe_index)
            slots = jax.lax.platform_dependent(slots, host, need, expert, s, cpu=page_in_condition,
                                               default=page_one_expert)
        slot_ids = state["cache"].slot[moe_index, jnp.maximum(experts, 0)]
        y = model_lib.routed_experts({**p, **slots}, cfg, h, jnp.where(experts >= 0, slot_ids, -1), weights,
                                     bias_ids=experts)  # GPT-OSS's biases: of the real experts
        if global_scope:
            state = {**state, "slots": slots}
        else:
            new = list(state["slots"])
            new[moe_index] = slots
            state = {**state, "slots": new}
        return y, state


def _fetch(host: dict, expert, like: dict) -> dict:
    """One expert's matrices from the host stacks, on the device, in the slots' dtypes."""
    return {k: _to_device(jax.lax.dynamic_index_in_dim(host[k], expert, 0, keepdims=False)).astype(like[k].dtype)
            for k in EXPERT_KEYS}


def page_in_condition(slots: dict, host: dict, need, expert, s) -> dict:
    """The slot write inside the condition (the CPU's form): a hit writes nothing. Its pass-through branch
    copies the layer's slot stacks, but on XLA:CPU every bf16 slot write costs a float32 pass over the whole
    stack anyway, and this form was the fastest of four measured there (bench/RESULTS.md, "On the H200")."""
    def load(buf):
        data = _fetch(host, expert, buf)
        return {k: jax.lax.dynamic_update_index_in_dim(buf[k], data[k], s, 0) for k in EXPERT_KEYS}

    return jax.lax.cond(need, load, lambda buf: buf, slots)


def page_one_expert(slots: dict, host: dict, need, expert, s) -> dict:
    """Only one expert's matrices pass through the condition (the host's on a miss, the slot's own on a hit),
    and the slot is written in place every time. Where a slot write is in place (GPU), this moves one expert
    (12.6 MB at OLMoE shapes) instead of copying the layer's whole slot stacks through the condition's
    pass-through branch (403 MB at C = 32: 32 such copies a token would be ~2.7 ms of an H200's bandwidth,
    about what in-jit paging lost there against its roofline, session 13). Same slots as
    ``page_in_condition``: a hit rewrites the slot with its own content."""
    current = {k: jax.lax.dynamic_index_in_dim(slots[k], s, 0, keepdims=False) for k in EXPERT_KEYS}
    data = jax.lax.cond(need, lambda cur: _fetch(host, expert, cur), lambda cur: cur, current)
    return {k: jax.lax.dynamic_update_index_in_dim(slots[k], data[k], s, 0) for k in EXPERT_KEYS}


def jit_router_state(params, cfg: ModelConfig, router_state: dict) -> dict:
    """The in-jit pager's state: the simulation state + device slots (filled from the cache state)."""
    cs = router_state["cache"]
    check_capacity(cfg, cs)
    if cs.scope == "global" and cs.prefetcher.enabled:
        raise ValueError("in-jit paging of a global cache with prefetch is not supported (a prefetch lands "
                         "in another layer's row); use paging='host'")
    store = ExpertStore(params, cfg, "host")
    slots = fill_slots(init_slots(cfg, cs, params["embed"].dtype, stacked=True), store, cs)
    return {**router_state, "slots": slots, "moved": jnp.zeros((), jnp.int32),
            "pending": {"row": jnp.zeros((1,), jnp.int32), "expert": jnp.zeros((1,), jnp.int32),
                        "slot": jnp.zeros((1,), jnp.int32), "valid": jnp.zeros((1,), bool),
                        "count": jnp.zeros((), jnp.int32)}}


def jit_generate(params, cfg: ModelConfig, prompt_ids, router_state: dict, offload: OffloadConfig, *,
                 max_new_tokens: int, sampling: decode.Sampling = decode.Sampling(), seed: int = 0,
                 stop_at_eos: bool = True, on_tokens=None, prefill_policy=None,
                 stores: dict | None = None, stop: decode.Stop = decode.NO_STOP,
                 bucketed: bool = False, keep_slots: bool = False, on_cache=None) -> decode.GenerateResult:
    """Offloaded generation with in-jit paging: ``decode.generate`` with the ``JitPager`` hook (the slots
    live in the decode state and are rebuilt from the cache state each call: ``keep_slots`` is ignored)."""
    cs = router_state["cache"]
    k = cfg.top_k
    max_changes = k + cs.prefetcher.count(k, cfg.n_experts)
    pager = JitPager(cfg.gating, max_changes)
    check_capacity(cfg, cs)
    host_params = host_memory_params(params, cfg)
    state = jit_router_state(host_params, cfg, router_state)
    state["pending"] = jax.tree.map(
        lambda a: jnp.zeros((max_changes,), a.dtype) if a.ndim else a, state["pending"])
    result = decode.generate(host_params, cfg, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                             seed=seed, router=pager, router_state=state, stop_at_eos=stop_at_eos,
                             on_tokens=on_tokens, prefill_policy=prefill_policy, stop=stop, bucketed=bucketed,
                             on_cache=on_cache)
    final = result.router_state
    expert_bytes = cfg.expert_params * jnp.dtype(params["embed"].dtype).itemsize
    moved = int(final["moved"]) * expert_bytes
    n = result.stats["prompt_tokens"] + max(result.stats["generated_tokens"] - 1, 0)
    result.stats["offload"] = {
        "paging": "jit", "store": "host", "expert_bytes": expert_bytes, "bytes_moved": moved,
        "bytes_per_token": moved / max(n, 1),
        "device_memory": {"non_expert_weights": tree_nbytes(split_params(params, cfg)),
                          "slots": tree_nbytes(final["slots"]),
                          "accounted_total": tree_nbytes(split_params(params, cfg)) + tree_nbytes(final["slots"]),
                          "all_experts_on_host": expert_bytes * cfg.n_experts * cfg.n_moe_layers},
    }
    result.router_state = {k: v for k, v in final.items() if k in ("cache", "routing", "policy")}
    return result
