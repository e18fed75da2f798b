"""64-bit seeds (``moejax.base.seeds``): every seed its own stream; 32-bit seeds keep JAX's own keys."""

import jax
import numpy as np
from hypothesis import given, settings, strategies as st

from moejax.base.seeds import prng_key


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_seeds_below_2_to_32_keep_the_keys_jax_gave_them(seed):
    np.testing.assert_array_equal(prng_key(seed), jax.random.PRNGKey(seed))
    np.testing.assert_array_equal(jax.random.key_data(prng_key(seed, typed=True)),
                                  jax.random.key_data(jax.random.key(seed)))


@settings(max_examples=50, deadline=None)
@given(st.integers(-(2**63), 2**63 - 1), st.integers(1, 2**32 - 1))
def test_seeds_that_differ_only_above_bit_32_get_different_keys(seed, high):
    other = ((seed + (high << 32)) + 2**63) % 2**64 - 2**63  # same low 32 bits, other high bits
    assert not np.array_equal(prng_key(seed), prng_key(other))
