"""Experts held stacked vs one buffer each: what the holding costs in compile time and decode speed.

    python bench/bench_stacked_experts.py [--models default,DIR] [--new-tokens 64] [--rounds 2]

Loading holds a layer's experts stacked when each is at most ``layout.STACK_EXPERT_MAX_BYTES`` (``layout.stacks``).
For each model, fresh child processes (an empty compilation cache each) alternate the two holdings, ``--rounds``
times: load time, the first ``generate`` (compiling its programs), the best of 3 decode runs (8-token prompt,
``--new-tokens`` greedy tokens), and a 512-token teacher-forced forward (first call and best of 3). "buffers"
forces one buffer per expert (``layout.stacks`` answering False), "stacked" forces the stack whatever the size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
held, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
from moejax.models import layout
layout.stacks = (lambda *a: held == "stacked")
import jax, numpy as np, moejax

def best(fn, runs=3):
    times = []
    for _ in range(runs):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)

t = time.perf_counter(); m = moejax.load(path); load = time.perf_counter() - t
ids = np.arange(1, 9)
gen = lambda: m.generate(ids, max_new_tokens=n, stop_at_eos=False)
t = time.perf_counter(); gen(); first = time.perf_counter() - t
decode = best(gen)
tf_ids = np.random.default_rng(0).integers(0, m.cfg.vocab_size, 512)
fwd = lambda: jax.block_until_ready(m.forward(tf_ids).logits)
t = time.perf_counter(); fwd(); fwd_first = time.perf_counter() - t
print(json.dumps(dict(held=held, load_s=load, first_generate_s=first, decode_tok_s=n / decode,
                      forward_first_s=fwd_first, forward_tok_s=512 / best(fwd))))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default", help="comma-separated: default and/or checkpoint folders")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for model in args.models.split(","):
        rows = []
        for r in range(args.rounds):
            for held in (("stacked", "buffers") if r % 2 == 0 else ("buffers", "stacked")):
                with tempfile.TemporaryDirectory(prefix="moejax-bench-cache-") as cache:
                    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
                    env["MOEJAX_COMPILE_CACHE"] = cache
                    out = subprocess.run([sys.executable, "-c", CHILD, held, model, str(args.new_tokens)], env=env,
                                         capture_output=True, text=True, check=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
        print(f"\n== {model}: stacked vs one buffer per expert ({args.rounds} rounds, alternating)")
        print(f"{'held':8s} {'load s':>7s} {'1st generate s':>15s} {'decode tok/s':>13s} {'fwd 1st s':>10s} "
              f"{'fwd tok/s':>10s}")
        for row in rows:
            print(f"{row['held']:8s} {row['load_s']:7.2f} {row['first_generate_s']:15.2f} {row['decode_tok_s']:13.1f} "
                  f"{row['forward_first_s']:10.2f} {row['forward_tok_s']:10.1f}")


if __name__ == "__main__":
    main()
