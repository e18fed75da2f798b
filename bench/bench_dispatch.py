"""Where the time of a multi-token pass goes, and which expert dispatch wins where.

    python bench/bench_dispatch.py [--repeats 5] [--olmoe] [--out bench/results/dispatch.json]

1. One MoE layer of the default model (N = 32, K = 4, D = 256, F = 112, fp32) for T = 2 … 1024 tokens:
   the dense path (every expert on every token), the sorted path (``sorted_routed_experts``: each expert
   on its own tokens), and which one ``routed_experts`` picks.
2. The default model's teacher-forced forward at T = 1024 by part: attention in one block vs in causal
   blocks of ``model.ATTENTION_BLOCK`` queries, the MoE layers dense vs sorted, the LM head.
3. With ``--olmoe``: one MoE layer at OLMoE-1B-7B shapes (N = 64, K = 8, D = 2048, F = 1024, random
   bf16 weights, T = 1024): rows computed by the sorted path / T·K (the FLOPs it spends over the active
   FLOPs) and achieved GFLOP/s.

Times are the minimum over ``--repeats`` after a compile-and-warm-up call.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import moejax
from moejax.base import atomic
from moejax.models import model as M
from moejax.models import attention as attention_lib
from moejax.models import moe as moe_lib


def best_ms(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def routed(cfg, lp, T, seed=0, dtype=jnp.float32):
    """Hidden states [T, D] and the layer's own top-K routing for them."""
    x = jax.random.normal(jax.random.PRNGKey(seed), (T, lp["gate"].shape[1]), dtype)
    z = moe_lib.router_logits(lp, x)
    w, e = jax.lax.top_k(jax.nn.softmax(z, -1), cfg.top_k)
    return x, e.astype(jnp.int32), (w / w.sum(-1, keepdims=True)).astype(jnp.float32)


def moe_layer_table(cfg, lp, repeats):
    rows = []
    dense = jax.jit(lambda p, x, e, w: moe_lib.dense_routed_experts(p, cfg, x, e, w))
    sorted_ = jax.jit(lambda p, x, e, w: moe_lib.sorted_routed_experts(p, cfg, x, e, w))
    for T in (2, 8, 32, 128, 256, 1024):
        x, e, w = routed(cfg, lp, T)
        d, s = best_ms(dense, lp, x, e, w, repeats=repeats), best_ms(sorted_, lp, x, e, w, repeats=repeats)
        picked = "sorted" if T >= moe_lib.SORTED_MIN_TOKENS and lp["gate"].shape[0] > 2 * cfg.top_k else "dense"
        rows.append({"T": T, "dense_ms": d, "sorted_ms": s, "block_rows": moe_lib.sorted_block_rows(T, cfg.top_k, cfg.n_experts),
                     "speedup": d / s, "picked": picked})
        print(f"T={T:5d}  dense {d:8.2f} ms  sorted {s:8.2f} ms  ({d / s:4.1f}x)  picked: {picked}", flush=True)
    return rows


def forward_parts(model, repeats):
    cfg, params = model.cfg, model.params
    ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, 1024), jnp.int32)
    out = {}

    def forward_ms():  # a new function each time: jax.jit caches traces per function object
        return best_ms(jax.jit(lambda p, i: M.forward(p, cfg, i).logits), params, ids, repeats=repeats)

    out["forward_ms"] = forward_ms()
    block, attention_lib.ATTENTION_BLOCK = attention_lib.ATTENTION_BLOCK, 1 << 30
    try:
        out["forward_one_attention_block_ms"] = forward_ms()
    finally:
        attention_lib.ATTENTION_BLOCK = block
    original = moe_lib.routed_experts
    moe_lib.routed_experts = moe_lib.dense_routed_experts
    try:
        out["forward_dense_experts_ms"] = forward_ms()
    finally:
        moe_lib.routed_experts = original
    x = jax.random.normal(jax.random.PRNGKey(1), (1024, cfg.hidden_size))
    out["lm_head_ms"] = best_ms(jax.jit(lambda e, x: x @ e.T), params["embed"], x, repeats=repeats)
    for k, v in out.items():
        print(f"{k:34s} {v:8.1f} ms", flush=True)
    out["forward_tokens_per_s"] = 1024 / out["forward_ms"] * 1e3
    print(f"teacher-forced forward, T = 1024: {out['forward_tokens_per_s']:.0f} tokens/s", flush=True)
    return out


def olmoe_layer(repeats):
    """One OLMoE-1B-7B MoE layer (random bf16 weights, routers scaled so routing is decisive)."""
    N, K, D, F, T = 64, 8, 2048, 1024, 1024
    rng = np.random.default_rng(0)
    lp = {"router": jnp.asarray(rng.normal(size=(D, N)) * 0.5, jnp.bfloat16)}
    for k, shape in (("gate", (N, D, F)), ("up", (N, D, F)), ("down", (N, F, D))):
        lp[k] = jnp.asarray(rng.normal(size=shape).astype(np.float32) * 0.02, jnp.bfloat16)

    class Cfg:
        hidden_act, top_k, n_experts = "silu", K, N

    x, e, w = routed(Cfg, lp, T, dtype=jnp.bfloat16)
    ms = best_ms(jax.jit(lambda p, x, e, w: moe_lib.sorted_routed_experts(p, Cfg, x, e, w)), lp, x, e, w, repeats=repeats)
    B = moe_lib.sorted_block_rows(T, K, N)
    counts = np.bincount(np.asarray(e).reshape(-1), minlength=N)
    rows = int((-(-counts // B) * B).sum())
    flops = 2 * 3 * D * F * rows
    out = {"T": T, "block_rows": B, "rows_over_active": rows / (T * K), "ms": ms,
           "achieved_gflop_s": flops / ms / 1e6, "active_gflop_s": 2 * 3 * D * F * T * K / ms / 1e6}
    print(f"OLMoE layer, T = {T}: {ms:.0f} ms, rows computed / active = {out['rows_over_active']:.3f}, "
          f"{out['achieved_gflop_s']:.1f} GFLOP/s ({out['active_gflop_s']:.1f} on active FLOPs)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--olmoe", action="store_true", help="also one MoE layer at OLMoE-1B-7B shapes (~1 GB bf16)")
    ap.add_argument("--out", default="bench/results/dispatch.json")
    args = ap.parse_args()
    model = moejax.load("default", dtype="float32")
    result = {"command": " ".join(sys.argv), "cpu": platform.processor() or platform.machine(),
              "jax": jax.__version__, "devices": str(jax.devices())}
    print("one MoE layer of the default model (fp32):")
    result["moe_layer"] = moe_layer_table(model.cfg, model.params["layers"][0]["moe"], args.repeats)
    print("default model forward, T = 1024 (fp32):")
    result["forward"] = forward_parts(model, args.repeats)
    if args.olmoe:
        result["olmoe_layer"] = olmoe_layer(args.repeats)
    atomic.write_json(args.out, result, indent=1, sort_keys=False, make_parents=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
