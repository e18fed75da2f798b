"""Cost of cache-aware routing in a teacher-forced pass.

    python bench/bench_routing.py [--tokens 512] [--points 16] [--out bench/results/routing.json]

1. Overhead: a teacher-forced pass with cache-prior routing + a per-layer LRU cache (the layer-parallel
   path) vs the plain pass with original routing and no cache. Goal: ≤ 10 %.
2. Sweep: a 16-point λ sweep as ONE vmapped pass vs 16 sequential passes. Goal: ≥ 3× faster. Measured
   on both exact paths: layer-parallel (teacher-forced, ``--tokens``) and token-sequential (what decode
   and global caches run, ``--seq-tokens``).

Model: the Qwen3-MoE shape of bench_decode (8 layers, 32 experts, top-4, d=256, random weights with
decisive routers). Times are the minimum over repeats after a compile-and-warm-up call.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np


def best_time(fn, repeats: int) -> float:
    from common import times  # bench/ is on sys.path once main() runs

    return min(times(fn, repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--seq-tokens", type=int, default=64, help="tokens for the token-sequential sweep")
    ap.add_argument("--points", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/routing.json")
    args = ap.parse_args()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import build_model

    import moejax
    from moejax.runtime import api, simulate
    from moejax.experts import routing

    with tempfile.TemporaryDirectory() as tmp:
        build_model(tmp)
        model = moejax.load(tmp)
    cfg, params = model.cfg, model.params
    toks = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, args.tokens), jnp.int32)
    cache = simulate.CacheConfig("0.5", "layer", "lru")
    state = model.router_state(routing.make_policy("cache-prior", cfg.top_k, lam=0.5), cache)
    router = simulate.CacheRouter(cfg.gating)

    t_plain = best_time(lambda: api._forward_original(params, cfg, toks).logits, args.repeats)
    t_cache = best_time(lambda: simulate.forward_layer_parallel(params, cfg, toks, router, state).logits,
                        args.repeats)

    lams = np.linspace(0.0, 1.0, args.points)
    policies = [routing.make_policy("cache-prior", cfg.top_k, lam=l) for l in lams]
    stacked = routing.stack_policies(policies)
    reps = max(1, args.repeats // 2)
    sweeps = {}
    for path, n_tok, run in (("layer-parallel", args.tokens, simulate.forward_layer_parallel),
                             ("token-sequential", args.seq_tokens, simulate.forward_token_sequential)):
        t_in = toks[:n_tok]
        t_loop = best_time(lambda: [run(params, cfg, t_in, router, {**state, "policy": p}).logits
                                    for p in policies], reps)
        t_vmap = best_time(lambda: simulate.sweep_forward(params, cfg, t_in, state, stacked,
                                                          sequential=path == "token-sequential")[0], reps)
        sweeps[path] = {"tokens": n_tok, "loop_s": t_loop, "vmap_s": t_vmap, "speedup": t_loop / t_vmap}
    result = {
        "model": "Qwen3-MoE shape: 8 layers, 32 experts, top-4, d=256, fp32", "tokens": args.tokens,
        "plain_pass_s": t_plain, "cache_prior_lru_pass_s": t_cache, "overhead": t_cache / t_plain - 1,
        "sweep_points": args.points, "sweeps": sweeps,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} {jax.default_backend()}",
    }
    print(f"teacher-forced pass, {args.tokens} tokens: plain {t_plain * 1e3:.1f} ms | cache-prior + LRU "
          f"{t_cache * 1e3:.1f} ms | overhead {100 * result['overhead']:+.1f}%")
    for path, r in sweeps.items():
        print(f"{args.points}-point λ sweep, {path}, {r['tokens']} tokens: loop {r['loop_s']:.2f} s | "
              f"one vmapped pass {r['vmap_s']:.2f} s | speed-up {r['speedup']:.2f}x")
    from moejax.base import atomic  # imported late, like moejax itself here
    atomic.write_json(args.out, result, sort_keys=False, make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
