"""Sparse expert dispatch: the sorted-block path computes exactly what the dense reference computes.

``dense_routed_experts`` runs every expert on every token (the simple reference); ``sorted_routed_experts``
runs each expert on its own tokens only; ``routed_experts`` picks between them (and the gather path for one
token) by shape. Checked here: equality over random shapes, dropped (-1) slots, fp32 and bf16, under
``vmap`` over routing policies and in ``jit``; every family's forward pass through the sorted path equals
Hugging Face's logits; and the dispatcher really takes the sparse path for long inputs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.models import layout, model as M
from moejax.models import moe as moe_lib
from moejax.models.model import forward as model_forward
from moejax.models.model import original_router

from support.hf_models import FAMILIES, VOCAB, get_hf_model, get_moejax_model
from test_hf_parity import hf_forward


@dataclasses.dataclass(frozen=True)
class _Act:
    hidden_act: str = "silu"

    @property
    def expert_act(self) -> str:  # ModelConfig's: the experts' activation (GPT-OSS's is a clamped SwiGLU)
        return self.hidden_act


def _problem(seed, T, K, N, D=16, F=8, drop=0.2, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    p = {k: jnp.asarray(rng.normal(size=s) * 0.5, dtype) for k, s in
         (("gate", (N, D, F)), ("up", (N, D, F)), ("down", (N, F, D)))}
    x = jnp.asarray(rng.normal(size=(T, D)), dtype)
    e = np.stack([rng.choice(N, K, replace=False) for _ in range(T)]).astype(np.int32)
    e[rng.random((T, K)) < drop] = -1
    w = np.where(e >= 0, rng.random((T, K)), 0).astype(np.float32)
    return p, x, jnp.asarray(e), jnp.asarray(w)


# (T, K, N, block rows): a long and a short input, K = 1, blocks of one row, blocks larger than any run
SHAPES = [(48, 4, 16, None), (37, 2, 8, 1), (5, 3, 4, 32), (17, 1, 8, 8), (2, 2, 16, None)]
_dense = jax.jit(moe_lib.dense_routed_experts, static_argnums=1)
_sorted = jax.jit(moe_lib.sorted_routed_experts, static_argnums=(1, 5))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from(SHAPES), drop=st.sampled_from([0.0, 0.3, 1.0]),
       act=st.sampled_from(["silu", "gelu_pytorch_tanh"]))
def test_sorted_equals_dense(seed, shape, drop, act):
    T, K, N, block = shape
    p, x, e, w = _problem(seed, T, K, N, drop=drop)
    want = _dense(p, _Act(act), x, e, w)
    got = _sorted(p, _Act(act), x, e, w, block)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    if drop == 1.0:
        assert not np.asarray(got).any()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), T=st.integers(2, 70), chunk=st.sampled_from([1, 8, 16, 64]))
def test_dense_in_chunks_equals_dense(seed, T, chunk):
    """Off the CPU long inputs run the dense path in chunks of tokens (padded): the same rows (up to float32
    rounding: a product's blocking depends on its row count)."""
    p, x, e, w = _problem(seed, T, 3, 8, drop=0.3)
    want = _dense(p, _Act(), x, e, w)
    got = jax.jit(moe_lib.dense_routed_experts, static_argnums=(1, 5))(p, _Act(), x, e, w, chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_dense_chunks_bound_the_intermediate():
    assert moe_lib.dense_chunk_rows(64, 1024) == 1024  # OLMoE: [1024, 64, 1024] float32 = 256 MiB
    assert moe_lib.dense_chunk_rows(8, 14336) == 512  # Mixtral
    assert moe_lib.dense_chunk_rows(160, 1536) == 256 and moe_lib.dense_chunk_rows(4, 8) == 4096 and moe_lib.dense_chunk_rows(
        2048, 8192) == 64
    for n, f in ((64, 1024), (128, 768), (8, 14336), (160, 1536)):
        assert moe_lib.dense_chunk_rows(n, f) * n * f * 4 <= 1 << 28


def test_sorted_equals_dense_bf16_within_rounding():
    p, x, e, w = _problem(1, 40, 4, 16, dtype=jnp.bfloat16)
    want = _dense(p, _Act(), x, e, w).astype(jnp.float32)
    got = _sorted(p, _Act(), x, e, w, None).astype(jnp.float32)
    assert got.dtype == want.dtype
    scale = float(jnp.abs(want).max())
    assert float(jnp.abs(got - want).max()) <= 2 ** -7 * scale  # a few bf16 ulps of the largest output


def test_sorted_under_vmap_over_policies_and_jit():
    """A batch of routing decisions (as a vmapped λ sweep makes) = each decision alone."""
    p, x, _, _ = _problem(2, 24, 2, 8)
    batch = [_problem(10 + i, 24, 2, 8, drop=0.25 * i)[2:] for i in range(4)]
    es, ws = jnp.stack([b[0] for b in batch]), jnp.stack([b[1] for b in batch])
    run = jax.jit(jax.vmap(lambda e, w: moe_lib.sorted_routed_experts(p, _Act(), x, e, w)))
    got = run(es, ws)
    for i, (e, w) in enumerate(batch):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(moe_lib.dense_routed_experts(p, _Act(), x, e, w)),
                                   rtol=2e-5, atol=2e-5)


def test_vmap_folds_lanes_into_tokens_and_equals_each_lane_alone():
    """Per-lane tokens and routing (a sweep after its first layer), shared weights: the batching rule folds
    the lanes into one dispatch; nested vmaps fold both axes; weights that differ per lane fall back to
    mapping the plain function. All equal the dense reference lane by lane."""
    p, _, _, _ = _problem(4, 24, 2, 8)
    probs = [[_problem(20 + 3 * i + j, 24, 2, 8, drop=0.2)[1:] for j in range(2)] for i in range(3)]
    xs = jnp.stack([jnp.stack([q[0] for q in row]) for row in probs])  # [3, 2, T, D]
    es = jnp.stack([jnp.stack([q[1] for q in row]) for row in probs])
    ws = jnp.stack([jnp.stack([q[2] for q in row]) for row in probs])
    want = np.stack([np.stack([np.asarray(moe_lib.dense_routed_experts(p, _Act(), *q)) for q in row]) for row in probs])
    one = jax.jit(jax.vmap(lambda x, e, w: moe_lib.sorted_routed_experts(p, _Act(), x, e, w)))
    np.testing.assert_allclose(np.asarray(one(xs[0], es[0], ws[0])), want[0], rtol=2e-5, atol=2e-5)
    nested = jax.jit(jax.vmap(jax.vmap(lambda x, e, w: moe_lib.sorted_routed_experts(p, _Act(), x, e, w))))
    np.testing.assert_allclose(np.asarray(nested(xs, es, ws)), want, rtol=2e-5, atol=2e-5)
    jaxpr = str(jax.make_jaxpr(one)(xs[0], es[0], ws[0]))
    assert "f32[48,16]" in jaxpr  # the rule ran: one dispatch over the 2·T = 48 tokens of both lanes
    scaled = jnp.stack([jnp.full((), 1.0), jnp.full((), 0.5)])
    per_lane_weights = jax.vmap(lambda s, x, e, w: moe_lib.sorted_routed_experts(
        jax.tree.map(lambda a: a * s, p), _Act(), x, e, w))(scaled, xs[0], es[0], ws[0])
    np.testing.assert_allclose(np.asarray(per_lane_weights[1]), np.asarray(moe_lib.dense_routed_experts(
        jax.tree.map(lambda a: a * 0.5, p), _Act(), xs[0, 1], es[0, 1], ws[0, 1])), rtol=2e-5, atol=2e-5)


def test_gradients_through_the_sorted_path_under_vmap_equal_the_dense_path():
    """Training differentiates a vmapped forward: the folding rule must not break reverse mode."""
    p, _, _, _ = _problem(5, 20, 2, 8)
    probs = [_problem(40 + i, 20, 2, 8, drop=0.2)[1:] for i in range(3)]
    xs, es, ws = (jnp.stack([q[i] for q in probs]) for i in range(3))

    def loss(fn):
        return lambda p, xs, ws: jnp.sum(jax.vmap(lambda x, e, w: fn(p, _Act(), x, e, w))(xs, es, ws) ** 2)

    got = jax.jit(jax.grad(loss(moe_lib.sorted_routed_experts), argnums=(0, 1, 2)))(p, xs, ws)
    want = jax.grad(loss(moe_lib.dense_routed_experts), argnums=(0, 1, 2))(p, xs, ws)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_dispatcher_picks_the_sparse_path_for_long_inputs_unless_n_is_at_most_2k():
    loops = ("scan", "while")  # the sorted path's loop over blocks
    jaxpr = lambda p, x, e, w: str(jax.make_jaxpr(lambda x, e, w: moe_lib.routed_experts(p, _Act(), x, e, w))(x, e, w))  # noqa: E731
    p, x, e, w = _problem(3, 256, 4, 32, D=8, F=4)
    assert any(op in jaxpr(p, x, e, w) for op in loops)
    np.testing.assert_allclose(np.asarray(moe_lib.routed_experts(p, _Act(), x, e, w)),
                               np.asarray(moe_lib.dense_routed_experts(p, _Act(), x, e, w)), rtol=2e-5, atol=2e-5)
    assert not any(op in jaxpr(p, x[:moe_lib.SORTED_MIN_TOKENS - 1], e[:moe_lib.SORTED_MIN_TOKENS - 1], w[:moe_lib.SORTED_MIN_TOKENS - 1])
                   for op in loops)
    p, x, e, w = _problem(3, 256, 2, 4, D=8, F=4)
    assert not any(op in jaxpr(p, x, e, w) for op in loops)


def _forced_router(cfg, path: str, params):
    """The architecture's routing, with the routed experts computed by one given path in small blocks
    (the hook's ``compute`` attribute is the model's documented extension point): the canonical layout's
    sorted blocks, or the serving layout's grouped chunks."""
    hook = original_router(cfg, M.selection_biases(params, cfg))

    def compute(moe_index, p, cfg, h, experts, weights, record, state):
        if path == "sorted":
            return moe_lib.sorted_routed_experts(p, cfg, h, experts, weights, block_rows=4), state
        return moe_lib.switched_routed_experts(p["experts"], cfg, h, experts, weights, block_rows=4,
                                         biases=moe_lib.expert_biases(p)), state

    hook.compute = compute
    return hook


@pytest.mark.parametrize("path", ["sorted", "grouped"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_through_the_sparse_paths_matches_hf(name, path):
    hm, mj = get_hf_model(name), get_moejax_model(name)
    params = layout.to_canonical(mj.params) if path == "sorted" else mj.params
    ids = np.random.default_rng(7).integers(3, VOCAB, size=24).astype(np.int32)
    ref = hf_forward(hm.model, ids)
    run = jax.jit(lambda params, ids: model_forward(params, mj.cfg, ids, router=_forced_router(mj.cfg, path, params)).logits)
    got = np.asarray(run(params, jnp.asarray(ids)))
    np.testing.assert_allclose(got, ref.logits, atol=1e-4, rtol=1e-4)
