"""XLA facts the code has to work around, in one place."""

from __future__ import annotations

import jax


def materialised(x: jax.Array) -> jax.Array:
    """``x`` in a buffer of its own, which no consumer fusion can look through.

    XLA:CPU fuses a cheap producer into each consumer and computes it again for every element it reads, and
    an ``optimization_barrier`` with one user is dropped. Two uses of one value can then differ (LLVM
    contracts a multiply-add into an FMA in one loop and not in another), and a reshaped row is read through
    its old shape. A ``lax.cond`` result is always a buffer; its branches return ``x`` unchanged (``+ 0`` only
    keeps XLA from merging them; -0.0 becomes +0.0 on the NaN side, which never runs for a finite first
    element). About half a microsecond. Under ``vmap`` with ``x`` batched the condition becomes a select,
    which fuses: the vmapped cache-prior ranking (a λ sweep) fuses differently and showed no fault in the same
    check, before or after."""
    first = x.reshape(-1)[0]
    return jax.lax.cond(first == first, lambda v: v, lambda v: v + 0, x)
