"""Time a bf16 matrix product by its number of rows: where XLA:CPU's matmul library runs at half speed.

    python bench/bench_row_counts.py [--shape 2048,2048] [--rows 2:80] [--threads 1] [--out FILE.json]

For every row count M in ``--rows`` it times ``x [M, in] @ w.T`` for ``w [out, in]`` (``--shape out,in``) as
the library is handed it (``jax.lax.dot_general``, unpadded) and as ``moejax.models.layout.nt_dot`` hands it
(padded past the ``layout.SLOW_BF16_ROWS`` bands), best of ``--repeats``, and prints microseconds per row for
both, marking the counts ``nt_dot`` pads and the ratio. ``--threads 1`` pins the process to one core (the bands
are clearest there: two threads add noise); run it on a new CPU to see whether its bands are those the table
was measured with (AMD Zen 4). It also prints the grouped loop's chunk size (``model.grouped_block_rows``) for
a few prompt lengths of a top-8-of-64 model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def parse_rows(text: str) -> list[int]:
    lo, _, hi = text.partition(":")
    return list(range(int(lo), int(hi or lo) + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048,2048", help="out,in of the bf16 matrix")
    ap.add_argument("--rows", default="2:80", help="row counts, lo:hi")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="pin to this many cores (0: all)")
    ap.add_argument("--out", help="write the figures as JSON")
    args = ap.parse_args()
    if args.threads:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.threads]))

    import jax
    import jax.numpy as jnp

    from moejax.models import layout, model

    out_dim, in_dim = (int(v) for v in args.shape.split(","))
    w = jax.random.normal(jax.random.PRNGKey(0), (out_dim, in_dim)).astype(jnp.bfloat16)
    plain = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())),
                                                     preferred_element_type=jnp.float32))
    padded = jax.jit(layout.nt_dot)

    def best(f, x) -> float:
        jax.block_until_ready(f(x, w))
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(x, w))
            times.append(time.perf_counter() - t)
        return min(times)

    rows = []
    print(f"bf16 [{out_dim}, {in_dim}], {len(os.sched_getaffinity(0))} core(s), {platform.processor() or platform.machine()}")
    print(f"{'rows':>5} {'library µs/row':>15} {'nt_dot µs/row':>14}  padded to  ratio")
    for m in parse_rows(args.rows):
        x = jnp.ones((m, in_dim), jnp.bfloat16)
        t_plain, t_padded = best(plain, x), best(padded, x)
        to = layout.fast_rows(m, in_dim, jnp.bfloat16)
        rows.append({"rows": m, "library_s": t_plain, "nt_dot_s": t_padded, "padded_to": to})
        mark = f"{to:>9}  {t_plain / t_padded:5.2f}x" if to != m else ""
        print(f"{m:>5} {t_plain / m * 1e6:>15.1f} {t_padded / m * 1e6:>14.1f}  {mark}", flush=True)
    blocks = {T: model.grouped_block_rows(T, 8, 64) for T in (64, 256, 1024, 4096)}
    print("grouped loop chunk rows, top-8 of 64, by tokens:", blocks)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": [out_dim, in_dim], "cores": len(os.sched_getaffinity(0)), "rows": rows,
                       "grouped_block_rows": blocks}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
