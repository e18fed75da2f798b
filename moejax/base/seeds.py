"""PRNG keys from 64-bit seeds.

Every ``--seed`` takes a 64-bit integer (``errors.seed_arg``), but without ``jax_enable_x64`` JAX keeps only a
seed's low 32 bits: seeds 5 and 5 + 2**32 drew the same numbers. ``prng_key`` folds the high 32 bits in, so
every 64-bit seed gives its own stream, and seeds in [0, 2**32) keep exactly the key ``jax.random.PRNGKey``
gave them (earlier results stay reproducible)."""

from __future__ import annotations

import jax

_LOW = 0xFFFFFFFF
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what every seed may be: a signed 64-bit integer


def check_seed(seed: int) -> int:
    """``seed`` when it fits 64 bits; a ValueError naming it otherwise (larger ones overflowed deep in JAX)."""
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed {seed} does not fit 64 bits")
    return seed


def prng_key(seed: int, typed: bool = False) -> jax.Array:
    """The key of ``seed``: a raw ``PRNGKey`` (``typed=False``) or a typed ``jax.random.key``."""
    seed = int(seed)
    key = (jax.random.key if typed else jax.random.PRNGKey)(seed & _LOW)
    high = (seed >> 32) & _LOW  # two's complement: a negative seed has all high bits set
    return jax.random.fold_in(key, high) if high else key
