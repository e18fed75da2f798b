"""Offloaded decode with and without computing while the misses are read (``OffloadConfig.overlap``).

    python bench/bench_overlap.py --model /work/scale/qwen-int8 [--budget-gb 12] [--cache-size 15]
        [--routing original] [--weight-dtype int8] [--runs 6] [--new-tokens 32] [--bandwidth-gbps 1]
        [--out bench/results/overlap.json]

One process loads the model once (flash store) and alternates generations with ``overlap=False`` and ``True``
(the order flips every pair), each on a prompt of its own (random token ids), so that both see the same mix
of page-cache states: under a budget, what one run read stays cached for the next, and a repeated prompt would
read nothing. With ``--budget-gb`` the process runs inside a cgroup-v1 memory cgroup of that size after the
page cache is dropped (``bench/memlimit.py``; root). ``--bandwidth-gbps`` emulates the link instead
(``OffloadConfig.bandwidth_gbps``: each page takes bytes / bandwidth on one queue, as a GPU's copy engine
would, while the compute goes on). Printed: decode tokens/s per run, the storage bytes read per decode token,
the overlapped layer steps, and the medians with their ratio on/off. An untimed pair on one prompt first
compiles and checks that both settings give the same tokens (exit status 1 if not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(HERE))

GiB = 1 << 30


def run(args) -> dict:
    import numpy as np

    import moejax
    from moejax.runtime import offload
    from moejax.runtime.simulate import CacheConfig

    m = moejax.load(args.model, offload="flash", weight_dtype=args.weight_dtype)
    kw = dict(routing=args.routing, cache=CacheConfig(size=args.cache_size), stop_at_eos=False)
    if args.routing == "cache-prior":
        kw["lam"] = args.lam
    configs = {ov: offload.OffloadConfig(store="flash", overlap=ov, bandwidth_gbps=args.bandwidth_gbps)
               for ov in (False, True)}
    rng = np.random.default_rng(args.seed)
    check = rng.integers(10, min(m.cfg.vocab_size, 30000), args.prompt_len)  # untimed: compile, same tokens?
    same = len({tuple(m.generate(check, 8, offload=configs[ov], **kw).token_ids) for ov in (False, True)}) == 1
    rows = []
    for pair in range(args.runs):
        for ov in ((False, True) if pair % 2 == 0 else (True, False)):
            prompt = rng.integers(10, min(m.cfg.vocab_size, 30000), args.prompt_len)
            out = m.generate(prompt, args.new_tokens, offload=configs[ov], **kw)
            s, o = out.stats, out.stats["offload"]
            row = {"overlap": ov, "decode_tokens_per_s": s["tokens_per_s"], "ttft_s": s["time_to_first_token_s"],
                   "storage_read_per_decode_token": o.get("storage_read_per_decode_token"),
                   "expert_bytes_per_decode_token": o["bytes_per_decode_token"],
                   "overlapped_steps": o["overlapped_steps"], "miss_rate": s["cache"]["miss_rate"]}
            rows.append(row)
            print(f"overlap {'on ' if ov else 'off'}  decode {row['decode_tokens_per_s']:.2f} tok/s  storage "
                  f"{(row['storage_read_per_decode_token'] or 0) / 1e6:.0f} MB/tok  requested "
                  f"{row['expert_bytes_per_decode_token'] / 1e6:.0f} MB/tok  overlapped steps "
                  f"{row['overlapped_steps']}", flush=True)
    med = {ov: statistics.median(r["decode_tokens_per_s"] for r in rows if r["overlap"] == ov) for ov in (False, True)}
    print(f"median decode tok/s: off {med[False]:.2f}, on {med[True]:.2f} (on/off {med[True] / med[False]:.3f}); "
          f"same tokens with and without (an untimed prompt first): {same}")
    return {"rows": rows, "median_off": med[False], "median_on": med[True], "same_tokens": same}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--budget-gb", type=float, default=0.0, help="memory budget in GiB (0: none)")
    p.add_argument("--cache-size", default="0.25")
    p.add_argument("--routing", default="original")
    p.add_argument("--lam", type=float, default=0.5)
    p.add_argument("--weight-dtype", choices=("stored", "int8"), default=None)
    p.add_argument("--runs", type=int, default=6, help="pairs of generations (one with, one without overlap)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--bandwidth-gbps", type=float, default=None, help="emulate the link (GB/s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in the cgroup
    args = p.parse_args(argv)
    if args.budget_gb > 0 and not args.inside:
        import memlimit

        ok, why = memlimit.cgroup_v1_memory_available()
        if not ok:
            print(f"error: no memory budget possible here: {why}", file=sys.stderr)
            return 2
        argv = list(sys.argv[1:] if argv is None else argv)
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--inside"]
        r = memlimit.run_measured(cmd, limit_bytes=int(args.budget_gb * GiB), drop_caches=True, capture=False)
        return r["returncode"]
    result = run(args)
    if args.out:
        from moejax.base import atomic

        atomic.write_json(args.out, {"model": os.path.abspath(args.model), "budget_gb": args.budget_gb,
                                     "args": vars(args), **result, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                          indent=1, sort_keys=False, make_parents=True)
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
