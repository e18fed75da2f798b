"""Run a function's jaxpr op by op and record every scatter whose indices leave the operand.

Why: XLA:GPU's deterministic scatter (``--xla_gpu_deterministic_ops``) flattens a vmapped scatter's index
vectors, so an index the scatter was meant to drop as out of range lands in the next batch element (in the
suite on an H200 the per-layer cache replay, a vmap over layers, counted a wrong miss so). moejax's batched
state updates therefore keep every scatter index in range; this checks it on the CPU, where the rewrite
does not run and the fault cannot show.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.extend import core as jcore


def out_of_range_scatters(fn, *args) -> list[str]:
    """Evaluate ``fn(*args)`` through its jaxpr (scans unrolled, calls inlined) and return one line for each
    scatter that was given an index vector outside its operand (batching dimensions included)."""
    flat, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *xs: jax.tree.leaves(fn(*jax.tree.unflatten(tree, xs))))(*flat)
    bad: list[str] = []
    _run(closed.jaxpr, closed.consts, flat, bad)
    return bad


def _indices_out_of_range(eqn, operand, indices) -> int:
    dn = eqn.params["dimension_numbers"]
    idx = np.asarray(indices)
    vectors = idx.reshape(-1, idx.shape[-1])
    dims = list(dn.scatter_dims_to_operand_dims)
    if dn.operand_batching_dims:  # each batch element's own position, implicit in the index array's shape
        positions = np.indices(idx.shape[:-1]).reshape(idx.ndim - 1, -1).T
        vectors = np.concatenate([positions[:, list(dn.scatter_indices_batching_dims)], vectors], axis=1)
        dims = list(dn.operand_batching_dims) + dims
    window = np.ones(np.ndim(operand), np.int64)
    for d in range(np.ndim(operand)):
        if d not in dims:
            window[d] = np.shape(operand)[d]
    limit = np.array([np.shape(operand)[d] - window[d] + 1 for d in dims])
    return int((~((vectors >= 0) & (vectors < limit)).all(axis=1)).sum())


def _run(jaxpr, consts, args, bad: list[str]) -> list:
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "scan":
            body, n_consts, n_carry = eqn.params["jaxpr"], eqn.params["num_consts"], eqn.params["num_carry"]
            fixed, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
            ys = []
            for i in range(eqn.params["length"]):
                out = _run(body.jaxpr, body.consts, [*fixed, *carry, *(x[i] for x in xs)], bad)
                carry, y = out[:n_carry], out[n_carry:]
                ys.append(y)
            if eqn.params["reverse"]:
                raise NotImplementedError("reverse scan")
            outs = [*carry, *(np.stack([np.asarray(y[j]) for y in ys]) for j in range(len(eqn.outvars) - n_carry))]
        elif "jaxpr" in eqn.params and name not in ("while", "cond"):
            inner = eqn.params["jaxpr"]
            outs = _run(inner.jaxpr, inner.consts, ins, bad)
        else:
            if name.startswith("scatter"):
                n = _indices_out_of_range(eqn, ins[0], ins[1])
                if n:
                    bad.append(f"{name} into {np.shape(ins[0])}: {n} of {np.asarray(ins[1]).shape[:-1]} index "
                               "vectors out of range")
            outs = eqn.primitive.bind(*ins, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]
