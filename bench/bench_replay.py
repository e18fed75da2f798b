"""Trace-replay throughput: per-layer LRU through moejax (jit: vmap over layers of a scan over tokens) vs
the plain-Python reference simulator (tests/support/reference_cache.py). Goal: >= 1M expert accesses/s.

    python bench/bench_replay.py [--tokens 20000 --layers 16 --top-k 8 --experts 64 --cache-size 0.5]
                                 [--out bench/results/replay.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from moejax.experts import trace  # noqa: E402
from moejax.experts import capacity as capacity_lib
from support.reference_cache import simulate  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--cache-size", default="0.5")
    p.add_argument("--eviction", default="lru", choices=["lru", "lfu"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reference-tokens", type=int, default=None,
                   help="tokens the Python reference replays (default: all; it is the slow side)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "replay.json"))
    args = p.parse_args()

    tr = trace.synthetic_trace(args.tokens, args.layers, args.experts, args.top_k, seed=0)
    accesses = args.tokens * args.layers * args.top_k
    capacity = capacity_lib.parse_capacity(args.cache_size, args.experts)

    start = time.perf_counter()
    first = trace.replay(tr, args.cache_size, "layer", args.eviction)
    compile_and_first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        stats = trace.replay(tr, args.cache_size, "layer", args.eviction)  # includes host->device + summarize
        times.append(time.perf_counter() - start)
    assert stats["misses"] == first["misses"]

    ref_tokens = args.reference_tokens or args.tokens
    start = time.perf_counter()
    ref = simulate(tr.experts[:ref_tokens].tolist(), capacity, "layer", args.eviction)
    ref_time = time.perf_counter() - start
    ref_accesses = ref_tokens * args.layers * args.top_k
    if ref_tokens == args.tokens:
        assert sum(ref["misses"]) == stats["misses"], "moejax and the reference disagree"

    jax_rate = accesses / min(times)
    ref_rate = ref_accesses / ref_time
    result = {
        "benchmark": "trace replay, per-layer scope",
        "eviction": args.eviction,
        "tokens": args.tokens, "layers": args.layers, "experts": args.experts, "top_k": args.top_k,
        "capacity_per_layer": capacity, "accesses": accesses, "miss_rate": stats["miss_rate"],
        "moejax_s_min": min(times), "moejax_s_median": statistics.median(times),
        "moejax_first_call_s": compile_and_first,
        "moejax_accesses_per_s": jax_rate,
        "reference_s": ref_time, "reference_accesses": ref_accesses, "reference_accesses_per_s": ref_rate,
        "speedup_vs_reference": jax_rate / ref_rate,
        "goal_accesses_per_s": 1e6, "goal_met": jax_rate >= 1e6,
        "jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "python": platform.python_version(),
    }
    print(f"moejax  {jax_rate / 1e6:8.2f} M accesses/s  (min {min(times):.3f} s, median "
          f"{statistics.median(times):.3f} s over {args.repeats}; first call incl. compile {compile_and_first:.2f} s)")
    print(f"python  {ref_rate / 1e6:8.2f} M accesses/s  ({ref_time:.2f} s for {ref_accesses} accesses)")
    print(f"ratio   {jax_rate / ref_rate:8.1f} x   miss rate {stats['miss_rate']:.4f}   goal >= 1M/s: "
          f"{'met' if jax_rate >= 1e6 else 'NOT met'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
