"""In-jit offloaded decoding (``OffloadConfig(paging="jit")``).

The whole decode loop stays one ``lax.scan`` (``decode.generate``): routing, the cache decision and the paging
all run inside the decode program, so a token whose experts are all resident costs what a resident token costs
plus the cache's bookkeeping. The router hook (``JitPager``) pages each change with ``lax.dynamic_index_in_dim``
on host-memory stacks + ``jax.device_put`` to device memory (XLA does the transfer on GPU/TPU; on the CPU it
is a plain copy), straight into the slot's own buffers, and computes with the slots exactly as the resident
model computes with its experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models import layout, weights
from moejax.models import moe as moe_lib
from moejax.models.config import ModelConfig
from moejax.experts import routing as routing_lib
from moejax.experts.router import prefetch_step, router_step
from moejax.runtime import decode
from moejax.runtime import sampling as sampling_lib
from moejax.runtime.expert_store import (EXPERT_KEYS, _host_sharding, expert_stacks, init_slots, split_params,
    tree_nbytes)
from moejax.runtime.offload import OffloadConfig, check_capacity


def host_expert_stacks(params: dict, cfg: ModelConfig, stores: dict | None = None) -> list[dict]:
    """Per MoE layer, every routed expert in the serving layout as two stacks in host memory (``pinned_host``
    where the backend has it; device memory on the CPU, which is the same memory): ``gate_up`` ``[N, 2F, D]``
    and ``down`` ``[N, D, F]``. A page is one dynamic index into them, written straight into its slot's own
    buffers. Made once per weights (kept in ``stores``, the model's store cache), read once from the files for
    experts left there."""
    key = ("jit-host", id(params))
    if stores is not None and key in stores:
        return stores[key]
    sharding = _host_sharding(jax.devices()[0])
    place = (lambda a: jax.device_put(a, sharding)) if sharding is not None else jnp.asarray  # noqa: E731
    out = []
    for i, lp in enumerate(params["layers"]):
        if cfg.moe_layers[i]:
            gate_up, down = _serving_stacks(lp["moe"])
            out.append({"gate_up": place(gate_up), "down": place(down)})
    if stores is not None:
        stores.clear()  # one host copy of the experts per model at a time
        stores[key] = out
    return out


def _serving_stacks(moe: dict) -> tuple[np.ndarray, np.ndarray]:
    """A MoE layer's experts as host stacks ``gate_up [N, 2F, D]``, ``down [N, D, F]`` (``host_expert_stacks``)."""
    held = moe.get("experts")
    if isinstance(held, layout.ExpertList):
        if layout.is_int8(held.gate_up[0]):
            raise ValueError("in-jit paging keeps the stored dtype; int8 experts page with paging='host'")
        return (np.stack([np.asarray(layout.dense(m)) for m in held.gate_up]),
                np.stack([np.asarray(layout.dense(m)) for m in held.down]))
    stacks = expert_stacks(moe)
    host = {k: np.asarray(weights.to_host(stacks[k]) if weights.is_lazy(stacks[k]) else stacks[k]) for k in EXPERT_KEYS}
    return (np.concatenate([np.swapaxes(host["gate"], 1, 2), np.swapaxes(host["up"], 1, 2)], axis=1),
            np.ascontiguousarray(np.swapaxes(host["down"], 1, 2)))


def _to_device(x):
    try:
        return jax.device_put(x, jax.memory.Space.Device)
    except Exception:  # noqa: BLE001 - runtimes without memory spaces: already device memory
        return x


@dataclasses.dataclass(frozen=True)
class JitPager:
    """Router hook for ``model.forward`` that pages inside jit (offload ``paging="jit"``).

    State: the simulation's {"cache", "routing", "policy"} plus "slots" (the device slots: a serving-layout
    ``ExpertList`` of C buffers per MoE layer, or one pool) and "pending" (this step's slot changes, [M] arrays,
    written by the hook's routing and paged by ``compute``, which gets the layer's host stacks)."""

    gating: Any
    max_changes: int  # static bound on slot changes per router step (K + prefetch candidates)
    # the slot buffers are written in place every step; decode does not roll them back after EOS (see
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
        """Page this step's changes for this layer from its host stacks into the slots, then compute with the
        slots as the resident model computes with its experts (``model.switched_routed_experts``: each slot read
        in place; same arithmetic, so the same result bit for bit). A step with no change runs no page at all
        (a loop of zero trips). Global scope: a prefetch can land in another layer's row; it is paged when that
        layer runs (its slot was assigned now; nothing reads it before then)."""
        pending = state["pending"]
        global_scope = state["cache"].scope == "global"
        slots = state["slots"] if global_scope else state["slots"][moe_index]
        # in global scope only rows of this layer can be paged from this layer's host stacks
        slots = page_changes(slots, p["paged"], pending, pending["valid"] & (pending["row"] == moe_index))
        slot_ids = state["cache"].slot[moe_index, jnp.maximum(experts, 0)]
        y = moe_lib.routed_experts({**p, "experts": slots}, cfg, h, jnp.where(experts >= 0, slot_ids, -1),
                                   weights, bias_ids=experts)  # GPT-OSS's biases: of the real experts
        if global_scope:
            state = {**state, "slots": slots}
        else:
            new = list(state["slots"])
            new[moe_index] = slots
            state = {**state, "slots": new}
        return y, state


def page_changes(slots: layout.ExpertList, host: dict, pending: dict, need) -> layout.ExpertList:
    """Write the pending changes flagged in ``need`` into the slots, one expert each, in a loop of as many
    trips as there are changes: a step whose experts are all resident pays nothing (bench/bench_fixed_costs.py,
    offload C=N rows)."""
    (order,) = jnp.nonzero(need, size=need.shape[0], fill_value=0)

    def one(j, buffers):
        i = order[j]
        return page_into(buffers, host, pending["expert"][i], pending["slot"][i])

    return jax.lax.fori_loop(0, need.sum(), one, slots)


def page_into(slots: layout.ExpertList, host: dict, expert, s) -> layout.ExpertList:
    """Expert ``expert`` of the host stacks written into slot ``s`` (any other value of ``s``: unchanged).

    One condition per slot, each over that slot's own buffers: the taken one reads the page from host memory
    straight into the slot, the others pass their buffers through, which XLA keeps in place. One ``lax.switch``
    over the slots instead passes every slot through every branch, and XLA copies them all (a 16-slot layer
    of 8 MB experts took 110 ms a page against 0.9 ms this way, XLA:CPU)."""
    gate_up, down = list(slots.gate_up), list(slots.down)
    for c in range(slots.n_experts):
        gate_up[c], down[c] = jax.lax.cond(s == c, lambda old: _page(host, expert, old), lambda old: old,
                                           (gate_up[c], down[c]))
    return layout.ExpertList(tuple(gate_up), tuple(down))


@jax.jit
def _page(host: dict, expert, old: tuple) -> tuple:
    """One expert's ``(gate_up, down)`` from the host stacks, on the device, shaped like the slot ``old``
    (its dtype, its column blocks). Behind ``jit`` so that the C conditions of every layer reuse one trace."""
    return tuple(layout.blocked_like(o, _to_device(jax.lax.dynamic_index_in_dim(host[k], expert, 0, keepdims=False))
                                     .astype(o.dtype))
                 for k, o in zip(("gate_up", "down"), old))


@jax.jit
def _fill_slot(slots: layout.ExpertList, host: dict, expert, s) -> layout.ExpertList:
    return page_into(slots, host, expert, s)


def device_params(params: dict, cfg: ModelConfig, host: list[dict]) -> dict:
    """``params`` without the routed experts, each MoE layer holding its host stacks as ``paged`` instead."""
    layers, j = [], 0
    for i, lp in enumerate(params["layers"]):
        if cfg.moe_layers[i]:
            moe = {k: v for k, v in lp["moe"].items() if k not in (*EXPERT_KEYS, "experts")}
            lp = {**lp, "moe": {**moe, "paged": host[j]}}
            j += 1
        layers.append(lp)
    return {**params, "layers": layers}


def jit_router_state(host: list[dict], cfg: ModelConfig, router_state: dict, dtype) -> dict:
    """The in-jit pager's state: the simulation state + device slots, filled with what the cache state says
    is resident (a random initial cache, a carried-over one)."""
    cs = router_state["cache"]
    check_capacity(cfg, cs)
    if cs.scope == "global" and cs.prefetcher.enabled:
        raise ValueError("in-jit paging of a global cache with prefetch is not supported (a prefetch lands "
                         "in another layer's row); use paging='host'")
    slots = init_slots(cfg, cs, dtype)
    slot = np.asarray(cs.slot)
    for layer, expert in zip(*np.nonzero(slot >= 0)):
        s = jnp.int32(slot[layer, expert])
        if cs.scope == "global":
            slots = _fill_slot(slots, host[layer], jnp.int32(expert), s)
        else:
            slots[layer] = _fill_slot(slots[layer], host[layer], jnp.int32(expert), s)
    return {**router_state, "slots": slots, "moved": jnp.zeros((), jnp.int32),
            "pending": {"row": jnp.zeros((1,), jnp.int32), "expert": jnp.zeros((1,), jnp.int32),
                        "slot": jnp.zeros((1,), jnp.int32), "valid": jnp.zeros((1,), bool),
                        "count": jnp.zeros((), jnp.int32)}}


def jit_generate(params, cfg: ModelConfig, prompt_ids, router_state: dict, offload: OffloadConfig, *,
                 max_new_tokens: int, sampling: sampling_lib.Sampling = sampling_lib.Sampling(), seed: int = 0,
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
    host = host_expert_stacks(params, cfg, stores)
    host_params = device_params(params, cfg, host)
    state = jit_router_state(host, cfg, router_state, params["embed"].dtype)
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
