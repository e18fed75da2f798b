"""Attention over a KV cache in blocks of rows (the CPU's decode path) equals attention over the whole cache.

``attention._attend_cache_blocks`` / ``_attend_latent_blocks`` run on the CPU whenever a KV cache is read; the
whole-cache forms (``_attend_groups`` / ``_attend_latent``) run elsewhere and without a cache. Checked here:
the same output (hypothesis over cache length, block size, queries, position and sliding window), the
blocks skipped are exactly those no query sees (so rows past the last position are never read: NaN there
changes nothing), a long prompt at position 0 reads no cache row at all, and end to end, a model decoding
through many small blocks equals its full forward pass (as tests/test_hf_parity.py's incremental test does
with the real block sizes).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moejax.models import model as M
from moejax.models import attention as attention_lib

from support.hf_models import get_moejax_model

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
# the two blocked-attention equalities run eagerly, a cond per block (~1.3 s an example): fewer examples, for CI's
# time (the cases are derandomized, and the block-skipping rule itself has 25 below)
BLOCKED_SETTINGS = settings(SETTINGS, max_examples=6)


@dataclasses.dataclass(frozen=True)
class _Cfg:  # the two fields attention_mask / visible_key_blocks read
    sliding_windows: tuple[int, ...]


@st.composite
def cases(draw):
    """(cache rows, queries, last query position, sliding window, KV_BLOCK)."""
    rows = draw(st.integers(1, 40))
    T = draw(st.integers(1, min(rows, 5)))
    last = draw(st.integers(T - 1, rows - 1))
    window = draw(st.sampled_from([0, 1, 3, 7]))
    block = draw(st.integers(1, 12))
    return rows, T, last, window, block


def _queries_and_mask(rows, T, last, window):
    cfg = _Cfg((window,))
    positions = jnp.arange(last - T + 1, last + 1)
    mask = attention_lib.attention_mask(cfg, 0, positions, jnp.arange(rows))
    return cfg, positions, mask


def _blocked(monkeypatch, case):
    """``KV_BLOCK`` set to the case's; (rows, T, block, mask [T, rows], the cache's blocks)."""
    rows, T, last, window, block = case
    monkeypatch.setattr(attention_lib, "KV_BLOCK", block)
    cfg, positions, mask = _queries_and_mask(rows, T, last, window)
    return rows, T, block, mask, attention_lib.visible_key_blocks(cfg, 0, positions, rows)


@BLOCKED_SETTINGS
@given(case=cases(), dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_blocked_grouped_attention_equals_whole_cache(monkeypatch, case, dtype):
    rows, T, block, mask, blocks = _blocked(monkeypatch, case)
    H, Hk, hd = 4, 2, 8
    rng = np.random.default_rng(rows * 131 + T * 7 + block)
    q, k, v = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((T, H, hd), (rows, Hk, hd), (rows, Hk, hd)))
    got = np.asarray(attention_lib._attend_cache_blocks(q, k, v, mask, 0.3, blocks), np.float32)
    want = np.asarray(attention_lib._attend_groups(q, k, v, mask, 0.3), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2  # bf16: the blocked sum is rounded once, the whole one per dot
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    if dtype == jnp.bfloat16:  # as init_kv holds a bf16 cache: its bit patterns, read back exactly
        bits = [jax.lax.bitcast_convert_type(a, attention_lib.KV_BITS) for a in (k, v)]
        stored = np.asarray(attention_lib._attend_cache_blocks(q, *bits, mask, 0.3, blocks), np.float32)
        np.testing.assert_array_equal(stored, got)


@BLOCKED_SETTINGS
@given(case=cases())
def test_blocked_latent_attention_equals_whole_cache(monkeypatch, case):
    rows, T, block, mask, blocks = _blocked(monkeypatch, case)
    H, r, d = 3, 6, 4
    rng = np.random.default_rng(rows * 17 + T + block)
    q_latent, q_pe, latent, k_pe = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                                    for s in ((T, H, r), (T, H, d), (rows, r), (rows, d)))
    got = attention_lib._attend_latent_blocks(q_latent, q_pe, latent, k_pe, mask, 0.4, blocks)
    want = attention_lib._attend_latent(q_latent, q_pe, latent, k_pe, mask, 0.4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@SETTINGS
@given(case=cases())
def test_a_block_is_skipped_exactly_when_no_query_sees_a_key_in_it(monkeypatch, case):
    rows, T, block, mask, blocks = _blocked(monkeypatch, case)
    assert [(a, b) for a, b, _ in blocks] == [(a, min(a + block, rows)) for a in range(0, rows, block)]
    mask = np.asarray(mask)
    for a, b, seen in blocks:
        assert bool(seen) == bool(mask[:, a:b].any()), (a, b)


def test_rows_past_the_last_position_are_not_read(monkeypatch):
    """Blocks past the last query position are skipped, not masked: NaN there (a cache row never written)
    leaves the blocked result finite and equal to the whole-cache one on a clean cache, while the whole-cache
    form, which multiplies every row by its zero weight, turns NaN."""
    monkeypatch.setattr(attention_lib, "KV_BLOCK", 4)
    rows, T, last = 16, 1, 5
    cfg, positions, mask = _queries_and_mask(rows, T, last, 0)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((T, 2, 4), (rows, 1, 4), (rows, 1, 4)))
    poison = lambda a: a.at[8:].set(jnp.nan)  # rows 8..15: blocks [8, 12) and [12, 16), past position 5
    blocked = jax.jit(lambda q, k, v: attention_lib._attend_cache_blocks(q, k, v, mask, 0.5,
                                                             attention_lib.visible_key_blocks(cfg, 0, positions, rows)))
    got = np.asarray(blocked(q, poison(k), poison(v)))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np.asarray(attention_lib._attend_groups(q, k, v, mask, 0.5)), atol=1e-6)
    assert np.isnan(np.asarray(attention_lib._attend_groups(q, poison(k), poison(v), mask, 0.5))).all()


@pytest.mark.parametrize("name", ["mixtral_swa", pytest.param("qwen2_moe_sparse_step", marks=pytest.mark.slow),
                                  "deepseek_v2_group"])  # sliding window, MLA in CI; all with -m slow
def test_decode_through_many_blocks_equals_full_forward(monkeypatch, name):
    """A 12-row cache read in blocks of 2 (sliding windows of 4 and 5 skip blocks behind the window too;
    DeepSeek-V2 reads MLA's latent cache), pieces of more than ``ATTENTION_BLOCK`` = 2 tokens (the first at
    position 0 attends to itself alone, the second reads the cache), then token by token: the full forward's
    logits and experts."""
    monkeypatch.setattr(attention_lib, "KV_BLOCK", 2)
    monkeypatch.setattr(attention_lib, "ATTENTION_BLOCK", 2)
    mj = get_moejax_model(name)
    params, cfg, T = mj.params, mj.cfg, 12
    ids = jnp.asarray(np.random.default_rng(3).integers(3, cfg.vocab_size, size=T), jnp.int32)
    step = jax.jit(lambda p, ids, pos, kv: M.forward(p, cfg, ids, pos, kv))  # traced here, with the blocks above
    full = jax.jit(lambda p, ids: M.forward(p, cfg, ids))(params, ids)
    kv, logits, experts = attention_lib.init_kv(cfg, T), [], []
    for a, b in [(0, 5), (5, 8)] + [(t, t + 1) for t in range(8, T)]:
        out = step(params, ids[a:b], jnp.int32(a), kv)
        logits.append(out.logits), experts.append(out.experts)
        kv = out.kv
    np.testing.assert_allclose(np.concatenate(logits), np.asarray(full.logits), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(np.concatenate(experts, axis=1), np.asarray(full.experts))


def test_a_prompt_at_position_0_reads_no_cache_row(monkeypatch):
    """A prompt longer than ``ATTENTION_BLOCK`` written at position 0 attends to its own keys only: NaN in
    the cache's other rows changes nothing (the cached path would multiply them by zero weights: NaN)."""
    monkeypatch.setattr(attention_lib, "ATTENTION_BLOCK", 2)
    mj = get_moejax_model("qwen3_moe")
    params, cfg = mj.params, mj.cfg
    ids = jnp.asarray(np.random.default_rng(5).integers(3, cfg.vocab_size, size=6), jnp.int32)
    step = jax.jit(lambda p, ids, pos, kv: M.forward(p, cfg, ids, pos, kv))
    clean = step(params, ids, jnp.int32(0), attention_lib.init_kv(cfg, 10))
    poisoned = step(params, ids, jnp.int32(0), [jax.tree.map(lambda a: a.at[6:].set(jnp.nan), layer)
                                                for layer in attention_lib.init_kv(cfg, 10)])
    assert np.isfinite(np.asarray(poisoned.logits)).all()
    np.testing.assert_array_equal(np.asarray(poisoned.logits), np.asarray(clean.logits))
