"""The serving layout (``moejax.models.layout``): the fast paths compute what the canonical paths compute.

Checked here: the switched expert dispatch equals the dense reference (hypothesis over shapes, dropped
slots, chunk sizes, activations; f32 exactly, bf16 within rounding), under ``vmap`` (lanes folded into the
tokens) and ``jit``; every family's decode step, teacher-forced pass and greedy tokens equal the canonical
layout's; lazy placement equals converting an eager tree; layouts round-trip and share one fingerprint and
one checkpoint; a single row's product (decode's fused loop on the CPU) equals the same row's product
among others (f32, bf16, int8); and a bf16 decode step copies no weight matrix (no f32 upcast, no gathered
expert, no conversion hoisted out of the loop: the compiled program's temporary memory is below one expert
matrix and nothing outside a fusion writes an array of a weight matrix's shape).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moejax
from moejax.models import checkpoint, layout, model as M, quant, weights
from moejax.models import attention as attention_lib
from moejax.models import moe as moe_lib
from moejax.models.config import from_hf
from moejax.runtime import decode
from moejax.runtime import sampling as sampling_lib

from support.hf_models import FAMILIES, get_hf_model, get_moejax_model
from test_dispatch import _Act, _problem


def _as_list(p) -> layout.ExpertList:
    """The experts as loading holds them (stacked, where ``layout.stacks`` allows)."""
    return layout.expert_list(int(p["gate"].shape[0]), lambda e: weights.expert_out_in(p, e))


def _as_buffers(p) -> layout.ExpertList:
    """The experts one buffer each (as slots hold them)."""
    pairs = [weights.expert_out_in(p, e) for e in range(int(p["gate"].shape[0]))]
    return layout.ExpertList(*([jnp.asarray(m[i]) for m in pairs] for i in (0, 1)))


_dense = jax.jit(moe_lib.dense_routed_experts, static_argnums=1)
_switched = jax.jit(moe_lib.switched_routed_experts, static_argnums=(1, 5))

# (T, K, N, chunk rows): one token, two, a chunk of one row, chunks larger than any expert's run
SHAPES = [(1, 4, 16, None), (1, 1, 8, None), (2, 2, 16, None), (37, 2, 8, 1), (5, 3, 4, 32), (48, 4, 16, None),
          (17, 1, 8, 8)]


@pytest.mark.numerics
@settings(max_examples=14, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from(SHAPES), drop=st.sampled_from([0.0, 0.3, 1.0]),
       act=st.sampled_from(["silu", "gelu_pytorch_tanh"]), held=st.sampled_from([_as_list, _as_buffers]))
def test_switched_equals_dense(seed, shape, drop, act, held):
    T, K, N, rows = shape
    p, x, e, w = _problem(seed, T, K, N, drop=drop)
    want = _dense(p, _Act(act), x, e, w)
    got = _switched(held(p), _Act(act), x, e, w, rows)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    if drop == 1.0:
        assert not np.asarray(got).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_copied_small_experts_equal_the_per_expert_branches(monkeypatch, dtype):
    """The grouped loop runs experts up to ``COPY_EXPERT_MAX_BYTES`` on a copy with one shared computation
    (compiled once, not once per expert): the same bits as the per-expert ``lax.switch`` branches, and the
    compiled program holds 2 products where the branches hold 2 per expert."""
    assert not moe_lib.copies_experts(layout.ExpertList(  # an OLMoE-1B-7B expert (12.6 MB in bf16) keeps its branches
        (jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16),), (jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16),)))
    N = 16
    p, x, e, w = _problem(5, 40, 4, N, D=24, F=8, drop=0.2)
    el = _as_buffers(p)
    if dtype == "int8":
        el = jax.tree.map(layout.quantize_matrix, el, is_leaf=lambda a: isinstance(a, jax.Array))
    elif dtype == "bfloat16":
        el, x = jax.tree.map(lambda a: a.astype(jnp.bfloat16), el), x.astype(jnp.bfloat16)
    runs = {}
    for limit in (0, 1 << 30):
        monkeypatch.setattr(moe_lib, "COPY_EXPERT_MAX_BYTES", limit)
        assert moe_lib.copies_experts(el) == bool(limit)
        fn = jax.jit(lambda el, x, e, w: moe_lib.switched_routed_experts(el, _Act(), x, e, w))  # a fresh trace each
        compiled = fn.lower(el, x, e, w).compile()  # once: run and read
        runs[limit] = (np.asarray(compiled(el, x, e, w).astype(jnp.float32)), compiled.as_text().count(" dot("))
    (branched, branch_dots), (copied, copy_dots) = runs[0], runs[1 << 30]
    np.testing.assert_array_equal(copied.view(np.uint32), branched.view(np.uint32))
    assert (copy_dots, branch_dots) == (2, 2 * N)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1, 40])
def test_stacked_experts_equal_one_buffer_each_in_one_product_per_matrix(dtype, T):
    """Loading stacks plain experts (``layout.stacks``): indexed by the traced expert id inside the product,
    they give the bits of the per-expert ``lax.switch`` branches (decode) and copies (prompt), and the compiled
    program holds one product per matrix, not one per expert: it compiles in the time of one expert."""
    N = 16
    p, x, e, w = _problem(7, T, 4, N, D=24, F=8, drop=0.2)
    if dtype == "bfloat16":
        p, x = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p), x.astype(jnp.bfloat16)
    stacked, buffers = _as_list(p), _as_buffers(p)
    assert stacked.stacked and not buffers.stacked and stacked.n_experts == N
    runs = []
    for el in (stacked, buffers):
        fn = jax.jit(lambda el, x, e, w: moe_lib.switched_routed_experts(el, _Act(), x, e, w))
        compiled = fn.lower(el, x, e, w).compile()
        runs.append((np.asarray(compiled(el, x, e, w).astype(jnp.float32)), compiled.as_text().count(" dot(")))
    (got, stacked_dots), (want, buffer_dots) = runs
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert stacked_dots == 2 and buffer_dots == (2 * N if T == 1 else 2)


def test_only_plain_experts_are_stacked():
    """int8 experts (values and scales), experts wide enough for column blocks and experts of real models' size
    (an OLMoE-1B-7B expert: 12.6 MB) keep one buffer each."""
    assert layout.stacks(np.zeros((16, 8)), np.zeros((8, 8)))
    assert not layout.stacks(np.zeros((2048, 2048), np.float16), np.zeros((2048, 1024), np.float16))
    assert not layout.stacks(np.zeros((16, layout.ROW_DOT_MAX_IN + 1)), np.zeros((8, 8)))
    assert not layout.stacks(layout.quantize_matrix(jnp.ones((16, 8))), np.zeros((8, 8)))
    p, *_ = _problem(1, 1, 2, 4)
    int8 = layout.expert_list(4, lambda e: weights.expert_out_in(p, e), quantization=layout.Quantization(True))
    assert not int8.stacked and layout.is_int8(int8.gate_up[0])


@pytest.mark.numerics
@pytest.mark.parametrize("T", [1, 40])
def test_switched_bf16_is_within_rounding_of_f32(T):
    p, x, e, w = _problem(3, T, 4, 16, D=64, F=32, drop=0.1)
    want = np.asarray(_dense(p, _Act(), x, e, w))
    pb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    got = _switched(_as_list(pb), _Act(), x.astype(jnp.bfloat16), e, w, None)
    assert got.dtype == jnp.bfloat16
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.03 * scale)


@pytest.mark.numerics
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from([(1, 1), (3, 17), (64, 96), (130, 1024)]),
       dtype=st.sampled_from(["float32", "bfloat16", "int8"]))
def test_one_row_product_equals_the_same_row_among_others(seed, shape, dtype):
    """A single row's product (``row_dot`` on the CPU: the decode step's fused loop) equals that row's
    product computed among other rows (the matmul library), in float64 terms up to float32 summation
    order, for float32, bf16 and int8 weights; NaN in the row stays NaN."""
    out_dim, in_dim = shape
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=shape), jnp.float32)
    w = layout.quantize_matrix(w) if dtype == "int8" else w.astype(dtype)
    x = jnp.asarray(rng.normal(size=(5, in_dim)), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    product = jax.jit(layout.nt_dot)
    alone, among = np.asarray(product(x[:1], w)), np.asarray(product(x, w))[:1]
    if dtype == "int8":  # the library rounds the row's activations to int8 first: compare with float64
        deq = np.asarray(quant.dequantize(w), np.float64)
        exact = np.asarray(x[:1], np.float64) @ deq.T
        s_x = np.abs(np.asarray(x[:1])).max() / 127.0
        rounding = s_x / 2 * np.abs(deq).sum(axis=1) + 1e-5 * np.abs(exact) + 1e-30
        assert np.all(np.abs(among - exact) <= rounding)
        if jax.default_backend() == "cpu":  # row_dot: no activation rounding
            np.testing.assert_allclose(alone, exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
        else:  # elsewhere one row takes the library too (an H200 fails the exact check)
            assert np.all(np.abs(alone - exact) <= rounding)
    else:
        scale = np.abs(np.asarray(x[:1], np.float64)) @ np.abs(np.asarray(w, np.float64)).T
        assert np.all(np.abs(alone - among) <= 1e-6 * in_dim * scale + 1e-30)
    x_nan = x[:1].at[0, 0].set(jnp.nan)
    assert np.isnan(np.asarray(product(x_nan, w))).all()


@pytest.mark.parametrize("k", [layout.ROW_DOT_MAX_IN, layout.ROW_DOT_MAX_IN + 1, 3 * layout.ROW_DOT_MAX_IN])
def test_one_row_product_never_copies_the_matrix(k):
    """A row longer than XLA:CPU fuses into its matrix-vector loop would make it write a transposed float32
    copy of the matrix first (55 ms for DeepSeek-V2's dense down matrix): those rows go to the library."""
    w = jnp.zeros((8, k), jnp.bfloat16)
    program = jax.jit(layout.nt_dot).lower(jnp.zeros((1, k), jnp.bfloat16), w).compile()
    assert not materialised_matrices(program, {"w": w})


def _dot_rows(program) -> set[int]:
    """Row counts of the dot products in a compiled program's text."""
    return {int(m) for m in re.findall(r"= f32\[(\d+),\d+\]\{1,0\} dot\(", program.as_text())}


@pytest.mark.parametrize("n", [10, 40, 64])
def test_bf16_rows_at_a_slow_count_are_padded_past_it_and_give_the_same_rows(n):
    """XLA:CPU's matmul library multiplies 40 or 64 rows (and the other ``SLOW_BF16_ROWS`` bands) by a bf16
    matrix of more than 1,024 columns at half its speed per row: ``nt_dot`` hands it the first fast count
    instead and cuts the result back. The rows are the exact products up to float32 summation; float32 and
    short rows are left as they are."""
    k = layout.SLOW_BF16_MIN_IN + 127
    rng = np.random.default_rng(n)
    w = jnp.asarray(rng.normal(size=(24, k)), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(n, k)), jnp.bfloat16)
    fast = layout.fast_rows(n, k, jnp.bfloat16)
    assert fast > n and all(not (lo <= fast <= hi) for lo, hi, _ in layout.SLOW_BF16_ROWS)
    program = jax.jit(layout.nt_dot).lower(x, w).compile()
    if jax.default_backend() == "cpu":
        assert _dot_rows(program) == {fast}
    got = np.asarray(program(x, w))
    assert got.shape == (n, 24)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    assert np.all(np.abs(got - exact) <= 1e-6 * k * scale)
    assert layout.fast_rows(n, k, jnp.float32) == n and layout.fast_rows(n, layout.SLOW_BF16_MIN_IN - 1, jnp.bfloat16) == n
    assert _dot_rows(jax.jit(layout.nt_dot).lower(x.astype(jnp.float32), w.astype(jnp.float32)).compile()) == {n}


@given(T=st.integers(2, 1 << 17), K=st.integers(1, 16), n=st.integers(2, 512))
def test_grouped_chunks_hold_an_experts_typical_count_in_few_fast_chunks(T, K, n):
    """The grouped loop's chunk size is one of ``GROUPED_BLOCKS`` (never a row count the library runs slowly),
    and an expert with the mean count plus two standard deviations needs at most ceil(need / 128) chunks:
    one chunk up to that, never many small ones."""
    b = moe_lib.grouped_block_rows(T, K, n)
    assert b in moe_lib.GROUPED_BLOCKS
    assert all(layout.fast_rows(b, 4096, jnp.bfloat16) == b for b in moe_lib.GROUPED_BLOCKS)
    mean = T * K / n
    need = mean + 2 * np.sqrt(mean)
    assert -(-need // b) <= -(-need // moe_lib.GROUPED_BLOCKS[-1])
    if need <= moe_lib.GROUPED_BLOCKS[-1]:
        assert b >= need - 1e-9 and (b == moe_lib.GROUPED_BLOCKS[0] or moe_lib.GROUPED_BLOCKS[moe_lib.GROUPED_BLOCKS.index(b) - 1] < need)


@pytest.mark.parametrize("T", [1, 6])
def test_switched_under_vmap_equals_each_lane(T):
    """A sweep maps routing over lanes with shared weights: lanes fold into the tokens (one T = lanes·T
    dispatch), and every lane gets what it gets alone."""
    p, x, _, _ = _problem(1, T, 3, 8)
    el = _as_list(p)
    lanes = [_problem(s, T, 3, 8)[2:] for s in range(4)]
    e = jnp.stack([a for a, _ in lanes])
    w = jnp.stack([b for _, b in lanes])
    mapped = jax.jit(jax.vmap(lambda e, w: moe_lib.switched_routed_experts(el, _Act(), x, e, w)))(e, w)
    for i in range(4):
        alone = _dense(p, _Act(), x, e[i], w[i])
        np.testing.assert_allclose(np.asarray(mapped[i]), np.asarray(alone), rtol=2e-5, atol=2e-5)


def test_a_mapped_step_runs_the_chosen_experts_only():
    """Under vmap the dispatch must not become a select over every expert (a mapped ``lax.switch`` is
    turned into running all branches and selecting: no ``cond`` would be left in the jaxpr). Stacked experts
    have no branches: one product per matrix, on the rows of the experts the lanes chose."""
    p, x, e, w = _problem(0, 1, 2, 8)
    for el in (_as_buffers(p), _as_list(p)):
        f = jax.vmap(lambda e, w: moe_lib.switched_routed_experts(el, _Act(), x, e, w))
        jaxpr = str(jax.make_jaxpr(f)(jnp.stack([e, e]), jnp.stack([w, w])))
        assert ("cond[" in jaxpr) if not el.stacked else (jaxpr.count("dot_general[") == 2 and "while[" in jaxpr)
    plain_vmap = jax.vmap(lambda e: jax.lax.switch(e[0, 0], [lambda: x] * 2))
    assert "cond[" not in str(jax.make_jaxpr(plain_vmap)(jnp.stack([e, e])))  # what the test would catch


# CI time (the whole suite must stay within CI's minutes): the main suite runs the families whose serving layouts differ
# most — MLA with shared experts and dense layers (DeepSeek-V2) or sparsemixer + longrope + biases (Phi-MoE), one
# per test, in the AVX2 numerics pass; q/k/v biases with a gated shared expert (Qwen1.5-MoE) and sinks + expert
# biases + interleaved experts (GPT-OSS) in the main pass — and every family runs with -m slow
LAYOUT_MAIN_SUITE = ("qwen2_moe", "gpt_oss")


def _families(numerics: str):
    """Every family: ``numerics`` in CI's AVX2 numerics pass (one of DeepSeek-V2 and Phi-MoE per test, for CI's
    time), ``LAYOUT_MAIN_SUITE`` in the main pass, the others with -m slow."""
    return [pytest.param(n, marks=pytest.mark.numerics) if n == numerics else n if n in LAYOUT_MAIN_SUITE
            else pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES]


@pytest.mark.parametrize("name", _families(numerics="deepseek_v2"))
def test_every_family_serving_equals_canonical(name):
    """Same model, two layouts: teacher-forced logits, a decode step with a KV cache, and greedy tokens."""
    mj = get_moejax_model(name)
    assert_serving_equals_canonical(mj.params, mj.cfg)


def assert_serving_equals_canonical(serving, cfg, new_tokens: int = 12, tol: float = 2e-5) -> dict:
    """Teacher-forced logits, a decode step with a KV cache and greedy tokens of a serving-layout tree equal
    its canonical layout's (float32 logits within ``tol``); returns the canonical tree."""
    canonical = layout.to_canonical(serving)
    assert layout.is_serving(serving) and not layout.is_serving(canonical)
    ids = jnp.asarray(np.random.default_rng(5).integers(3, cfg.vocab_size, size=21), jnp.int32)
    fwd = jax.jit(lambda p, t: M.forward(p, cfg, t).logits)
    np.testing.assert_allclose(np.asarray(fwd(serving, ids)), np.asarray(fwd(canonical, ids)), atol=tol, rtol=tol)

    def step(p):
        kv = attention_lib.init_kv(cfg, 32)
        out = M.forward(p, cfg, ids[:5], 0, kv)
        return M.forward(p, cfg, ids[5:6], 5, out.kv).logits

    np.testing.assert_allclose(np.asarray(jax.jit(step)(serving)), np.asarray(jax.jit(step)(canonical)),
                               atol=tol, rtol=tol)
    a = decode.generate(serving, cfg, [3, 5, 7], max_new_tokens=new_tokens, stop_at_eos=False).token_ids
    b = decode.generate(canonical, cfg, [3, 5, 7], max_new_tokens=new_tokens, stop_at_eos=False).token_ids
    assert a == b
    return canonical


def _bf16_errors(folder, arrangement, ids):
    """Max and mean |logits - f32 logits| of a bf16 load in ``arrangement``: a teacher-forced pass (the
    grouped path) and a decode step with a KV cache (the one-token path)."""
    ref = moejax.load(folder, layout=arrangement)
    low = moejax.load(folder, dtype="bfloat16", layout=arrangement)
    cfg = ref.cfg

    def both(params, dtype):
        full = M.forward(params, cfg, ids).logits
        kv = attention_lib.init_kv(cfg, 32, dtype)
        out = M.forward(params, cfg, ids[:7], 0, kv)
        step = M.forward(params, cfg, ids[7:8], 7, out.kv).logits
        return jnp.concatenate([full, step])

    run = jax.jit(both, static_argnums=1)
    d = np.abs(np.asarray(run(low.params, jnp.bfloat16)) - np.asarray(run(ref.params, jnp.float32)))
    return d.max(), d.mean()


@pytest.mark.parametrize("name", _families(numerics="phimoe"))
def test_bf16_serving_is_as_close_to_f32_as_the_canonical_path(name):
    """bf16 paths cannot agree bit for bit (other matmul kernels, other summation orders; greedy tokens of
    a tiny random model then part at near ties, now on one side, now on the other), so the property is
    accuracy: the serving layout's bf16 logits are as close to the f32 logits as the canonical bf16 ones."""
    folder = get_hf_model(name).folder
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 90, size=40), jnp.int32)
    s_max, s_mean = _bf16_errors(folder, "serving", ids)
    c_max, c_mean = _bf16_errors(folder, "canonical", ids)
    assert s_mean <= 1.5 * c_mean + 1e-3, (s_mean, c_mean)
    assert s_max <= 2.0 * c_max + 1e-2, (s_max, c_max)


@pytest.mark.parametrize("name", ["olmoe", "deepseek_v2"])
def test_lazy_serving_placement_equals_converting_eager_params(name, tmp_path):
    """Placed straight from the files (HF [out, in] bytes as stored; the moejax format transposed) =
    the canonical tree converted afterwards."""
    hf = get_hf_model(name).folder
    mj = str(tmp_path / "mj")
    checkpoint.convert_to_moejax(hf, mj)
    for folder in (hf, mj):
        lazy, _ = checkpoint.load_params(folder, arrangement="serving")
        eager = layout.to_serving(checkpoint.load_params(folder)[0])
        a, ta = jax.tree.flatten(lazy)
        b, tb = jax.tree.flatten(eager)
        assert ta == tb
        for x, y in zip(a, b):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layouts_round_trip_and_share_fingerprint_and_checkpoint(tmp_path):
    mj = get_moejax_model("qwen2_moe")
    canonical = layout.to_canonical(mj.params)
    back = layout.to_canonical(layout.to_serving(canonical))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), back, canonical)
    assert checkpoint.params_fingerprint(mj.params) == checkpoint.params_fingerprint(canonical)
    a = checkpoint.save_moejax(mj.params, mj.cfg, str(tmp_path / "a"))
    b = checkpoint.save_moejax(canonical, mj.cfg, str(tmp_path / "b"))
    assert open(f"{a}/params.safetensors", "rb").read() == open(f"{b}/params.safetensors", "rb").read()


def _big_expert_config() -> dict:
    """Experts much larger than every activation, so any copy of one shows in the temporary memory."""
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=128, hidden_size=64,
                intermediate_size=128, moe_intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)


def _random_params(cfg, dtype):
    rng = np.random.default_rng(0)
    shapes = checkpoint.param_shapes(cfg)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s) * 0.05, dtype), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def _decode_program(params, cfg):
    kv = attention_lib.init_kv(cfg, 32, jnp.bfloat16)
    state = decode.DecodeState(kv, jnp.int32(5), jnp.int32(3), jax.random.PRNGKey(0), None, jnp.bool_(False),
                               jnp.int32(30))
    return decode.decode_chunk.lower(params, cfg=cfg, state=state, router=None, sampling=sampling_lib.Sampling(),
                                     steps=4, eos=()).compile()


def materialised_matrices(program, params, dtypes=("f32",)) -> list[str]:
    """The instructions of a compiled program that write an array of a weight matrix's shape (either
    orientation) in one of ``dtypes``, outside fused computations: what XLA really allocates. (Inside a
    fusion a convert or transpose of a matrix is computed element by element as the fused loop reads it.)
    Routers are left out: their logits are float32 by design (``model.router_logits``), and they are small."""
    matrices = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                if np.ndim(leaf) == 2 and min(leaf.shape) > 1 and "router" not in jax.tree_util.keystr(path)]
    shapes = {f"{t}[{a},{b}]" for leaf in matrices for a, b in (leaf.shape, leaf.shape[::-1]) for t in dtypes}
    passing = {"parameter", "get-tuple-element", "tuple", "bitcast", "opt-barrier", "while", "conditional", "call"}
    hlo = program.as_text()
    fused = set(re.findall(r"fusion\(.*calls=(%[\w.\-]+)", hlo))
    found, inside_fusion = [], False
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            inside_fusion = line.split()[0] in fused
        elif not inside_fusion and (m := re.match(r"\s*(ROOT )?%\S+ = (\S+) ([\w-]+)\(", line)):
            shape, op = m.group(2), m.group(3)
            if op not in passing and any(shape.startswith(s + "{") for s in shapes):
                found.append(line.strip()[:160])
    return found


def test_bf16_decode_copies_no_weight_matrix():
    """The decode step reads every matrix in place in bf16: its temporary memory stays below one expert
    matrix (an f32 upcast or a gathered expert would be one at least), and no f32 array of any weight
    matrix's shape (experts, attention, LM head) is materialised. The canonical layout's program, which
    gathers the K experts, shows that the measure sees such copies."""
    cfg = from_hf(_big_expert_config())
    canonical = _random_params(cfg, jnp.bfloat16)
    one_expert = cfg.hidden_size * cfg.moe_intermediate_size * 2
    params = layout.to_serving(canonical)
    serving = _decode_program(params, cfg)
    assert serving.memory_analysis().temp_size_in_bytes < one_expert
    assert not materialised_matrices(serving, params)
    gathering = _decode_program(canonical, cfg)
    assert materialised_matrices(gathering, canonical)
    assert gathering.memory_analysis().temp_size_in_bytes > cfg.top_k * one_expert
