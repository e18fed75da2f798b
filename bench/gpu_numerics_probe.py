"""XLA:GPU's int8 product by row count, measured directly on the device (seconds, no model files).

The suite with the GPU visible, on an H200, failed ``test_every_family_int8_equals_its_dequantised_model`` for all
three families CI runs: the int8 model's greedy decode (prompt of 3 rows, then 1 row a step) disagreed with its
own teacher-forced argmax (40 and 8 rows) on 4-5 of 6 decisive tokens, while the forward matched the
dequantised float32 model, and the same test with every ``platform_dependent`` forced to its non-CPU branch
passes on the CPU. Suspected: XLA:GPU's int8 x int8 -> int32 product for few rows. This prints, for each
row count, the largest error of ``layout.int8_nt_dot`` against the exact (float64) product of the same
quantised rows and weights, which must be float32 rounding only (~1e-6 relative), and whether a row's product
depends on how many rows are beside it.

    python bench/gpu_numerics_probe.py            # anywhere; on the CPU one row takes row_dot (no rounding)
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from moejax.models import layout


def probe(rows_list=(1, 2, 3, 4, 5, 8, 16, 40), shapes=((64, 32), (96, 32), (40, 384), (2048, 2048))) -> list:
    out = []
    rng = np.random.default_rng(0)
    for n_out, k in shapes:
        w = layout.quantize_matrix(jnp.asarray(rng.normal(size=(n_out, k)), jnp.float32))
        deq = np.asarray(w.q, np.float64) * np.asarray(w.scale, np.float64)
        x_all = jnp.asarray(rng.normal(size=(max(rows_list), k)), jnp.float32)
        product = jax.jit(layout.int8_nt_dot)
        first = None
        for rows in rows_list:
            x = x_all[:rows]
            got = np.asarray(product(x, w), np.float64)
            xq, xs = (np.asarray(a, np.float64) for a in layout.quantize_rows(x))
            exact_rounded = (xq * xs) @ deq.T  # what the library computes: rounded rows, exact sums
            exact = np.asarray(x, np.float64) @ deq.T  # what row_dot computes: no activation rounding
            scale = np.abs(exact).max()
            row0 = got[0]
            first = row0 if first is None else first
            rec = {"out": n_out, "in": k, "rows": rows,
                   "err_vs_rounded_rows": float(np.abs(got - exact_rounded).max() / scale),
                   "err_vs_exact": float(np.abs(got - exact).max() / scale),
                   "row0_vs_row0_alone": float(np.abs(row0 - first).max() / scale)}
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


def main() -> int:
    print("backend", jax.default_backend(), jax.devices(), flush=True)
    res = probe()
    bad = [r for r in res if min(r["err_vs_rounded_rows"], r["err_vs_exact"]) > 1e-4]
    print(f"{len(bad)} of {len(res)} products off by more than float32 rounding"
          + ("" if not bad else ": " + ", ".join(f"{r['out']}x{r['in']} rows={r['rows']}" for r in bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
