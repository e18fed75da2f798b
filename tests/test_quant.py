"""moejax.models.quant: int8 / int4 expert copies within a stated error of the originals, bytes at their real size."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moejax.models import layout, quant as Q

SLACK = 1 + 1e-6  # float32 rounding of w / s in the element-wise bound


def normal(seed, shape) -> jax.Array:
    """Standard normal float32 from numpy (jax.random.normal compiles once per shape: ~0.5 s each)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def expert_mlp(x, g, u, d):
    return (jax.nn.silu(x @ g) * (x @ u)) @ d


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def expanded_scale(qt: Q.QuantizedTensor) -> np.ndarray:
    """The stored scale of every element, as float64, in the logical shape."""
    s = np.asarray(qt.scale).astype(np.float64)
    ax = qt.ndim + qt.axis
    return np.repeat(s, qt.shape[ax] // s.shape[ax], axis=ax)


def assert_qt_equal(a: Q.QuantizedTensor, b: Q.QuantizedTensor):
    assert (a.bits, a.group_size, a.axis, a.dtype) == (b.bits, b.group_size, b.axis, b.dtype)
    np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
    np.testing.assert_array_equal(np.asarray(a.scale).astype(np.float32), np.asarray(b.scale).astype(np.float32))


# ------------------------------------------------------------------------------- element-wise bound
@st.composite
def quant_cases(draw):
    bits = draw(st.sampled_from([4, 8]))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    axis = draw(st.integers(-ndim, ndim - 1))
    grouped = draw(st.booleans())
    g = draw(st.sampled_from([1, 2, 4, 8]))
    ngroups = draw(st.integers(1, 4))
    shape[axis] = g * ngroups
    if bits == 4 and shape[-1] % 2:
        shape[-1] *= 2  # keeps g dividing the contraction axis when that is the last axis
    log_mag = draw(st.floats(-30, 30))
    scale_dtype = draw(st.sampled_from(["bfloat16", "float32"]))
    seed = draw(st.integers(0, 2**31 - 1))
    zero_frac = draw(st.sampled_from([0.0, 0.3, 1.0]))
    return bits, tuple(shape), axis, (g if grouped else None), log_mag, scale_dtype, seed, zero_frac


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quant_cases())
def test_elementwise_bound(case):
    """|w - deq(q(w))| <= s/2 for every element (s: its group's stored scale); all-zero groups give scale 0
    and dequantise to exactly 0; values stay in [-qmax, qmax]; huge and tiny magnitudes alike."""
    bits, shape, axis, group, log_mag, sdt, seed, zero_frac = case
    rng = np.random.default_rng(seed)
    # per-slice magnitudes spread over 6 decades on top of the drawn overall magnitude
    spread = 10.0 ** rng.uniform(-3, 3, size=shape[-1])
    w = rng.standard_normal(shape) * spread * 10.0**log_mag
    w = np.where(rng.uniform(size=shape[-1]) < zero_frac, 0.0, w).astype(np.float32)  # all-zero columns
    qt = Q.quantize(jnp.asarray(w), bits, group, axis=axis, scale_dtype=sdt)
    assert qt.shape == shape and qt.dtype == np.float32 and qt.axis < 0
    deq = np.asarray(Q.dequantize(qt, jnp.float32), np.float64)
    s = expanded_scale(qt)
    assert np.all(np.isfinite(deq)) and np.all(s >= 0)
    err = np.abs(w.astype(np.float64) - deq)
    assert np.all(err <= s / 2 * SLACK), float(np.max(err / np.where(s > 0, s, 1)))
    # zero groups: scale exactly 0 and exact 0 back; non-zero groups: s <= absmax/qmax * (1 + 2^-7)
    ax = len(shape) + qt.axis
    gl = shape[ax] if group is None else group
    gshape = shape[:ax] + (shape[ax] // gl, gl) + shape[ax + 1:]
    amax = np.max(np.abs(w.astype(np.float64).reshape(gshape)), axis=ax + 1)
    sg = np.asarray(qt.scale).astype(np.float64)
    assert np.all(sg[amax == 0] == 0)
    assert np.all(deq[w == 0] == 0)
    tol = 2.0**-7 if sdt == "bfloat16" else 1e-6
    assert np.all(sg <= amax / Q.qmax(bits) * (1 + tol) * SLACK)
    assert np.all(sg >= amax / Q.qmax(bits) / SLACK)
    q = np.asarray(Q.unpack_int4(qt.q) if bits == 4 else qt.q)
    assert q.dtype == np.int8 and q.shape == shape and np.abs(q).max(initial=0) <= Q.qmax(bits)


@pytest.mark.parametrize("mag", [1e25, 1e-24, 1.0])
@pytest.mark.parametrize("bits", [4, 8])
def test_extreme_and_mixed_magnitudes(mag, bits):
    """Columns 1e±10 apart in one tensor (and an all-zero one), at huge and tiny overall magnitude:
    the bound holds and nothing overflows."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((16, 6)) * np.array([1e-10, 1e10, 1.0, 0.0, 3e5, 1e-5]) * mag).astype(np.float32)
    for group in (None, 4):
        qt = Q.quantize(jnp.asarray(w), bits, group)
        deq = np.asarray(Q.dequantize(qt), np.float64)
        assert np.all(np.isfinite(deq))
        assert np.all(np.abs(w - deq) <= expanded_scale(qt) / 2 * SLACK)
        np.testing.assert_array_equal(deq[:, 3], 0.0)


# ---------------------------------------------------------------------------------------- int4 packing
def test_int4_pack_unpack_round_trip_all_values():
    vals = np.arange(-8, 8, dtype=np.int8)  # every nibble (quantisation itself uses -7..7)
    pairs = np.stack(np.meshgrid(vals, vals, indexing="ij"), -1).reshape(-1, 2)  # all 256 (lo, hi) pairs
    x = np.concatenate([pairs, pairs[::-1]], axis=-1).reshape(8, 32, 4)
    packed = Q.pack_int4(jnp.asarray(x))
    assert packed.dtype == jnp.uint8 and packed.shape == (8, 32, 2)
    np.testing.assert_array_equal(np.asarray(Q.unpack_int4(packed)), x)
    assert int(Q.pack_int4(jnp.asarray([[1, -2]], jnp.int8))[0, 0]) == 0xE1  # low nibble = element 0
    with pytest.raises(ValueError, match="even"):
        Q.pack_int4(jnp.zeros((2, 3), jnp.int8))


@pytest.mark.parametrize("bits", [4, 8])
def test_grid_values_are_exact(bits):
    """Every one of the 2·qmax+1 levels (15 for int4) on a column with a bf16-exact scale comes back exactly."""
    m = Q.qmax(bits)
    levels = np.arange(-m, m + 1, dtype=np.float32)
    w = np.stack([levels * 0.5, levels * -0.25], axis=1)  # [2m+1, 2]: absmax m·s -> scale s exactly
    qt = Q.quantize(jnp.asarray(w), bits)
    np.testing.assert_array_equal(np.asarray(qt.scale).astype(np.float32), [[0.5, 0.25]])
    np.testing.assert_array_equal(np.asarray(Q.dequantize(qt)), w)
    q = np.asarray(Q.unpack_int4(qt.q) if bits == 4 else qt.q)
    np.testing.assert_array_equal(q[:, 0], levels.astype(np.int8))


# ------------------------------------------------------------------------------- per-channel vs grouped
@pytest.mark.parametrize("bits", [4, 8])
def test_per_channel_vs_grouped(bits):
    w = normal(1, (3, 64, 32))
    pc, g16 = Q.quantize(w, bits), Q.quantize(w, bits, 16)
    assert pc.scale.shape == (3, 1, 32) and g16.scale.shape == (3, 4, 32)
    assert pc.group_size is None and g16.group_size == 16
    # one group spanning the whole axis is per-channel
    full = Q.quantize(w, bits, 64)
    np.testing.assert_array_equal(np.asarray(full.q), np.asarray(pc.q))
    np.testing.assert_array_equal(np.asarray(full.scale), np.asarray(pc.scale))
    # a group's absmax <= its column's: scales (and so the element-wise bound) never grow by grouping
    assert np.all(np.asarray(g16.scale, np.float32) <= np.asarray(pc.scale, np.float32))
    assert rel(Q.dequantize(g16), w) < rel(Q.dequantize(pc), w)


def test_contraction_axis_orientation():
    """Scales run along the contraction axis: x @ W with one scale per output column (axis -2)."""
    w = jnp.asarray(np.array([[1.0, 100.0], [-2.0, 50.0], [0.5, -200.0]], np.float32))  # [D=3, F=2]
    qt = Q.quantize(w, 8)
    np.testing.assert_allclose(np.asarray(qt.scale, np.float32)[0], [2.0 / 127, 200.0 / 127], rtol=2**-7)
    qt_rows = Q.quantize(w.T, 8, axis=-1)  # the same weight stored [F, D] and contracted over the last axis
    np.testing.assert_array_equal(np.asarray(Q.dequantize(qt_rows)), np.asarray(Q.dequantize(qt)).T)


# ---------------------------------------------------------------------------- take / jit / vmap
@pytest.mark.parametrize("bits,group", [(8, None), (4, 16)])
def test_take_equals_quantising_the_slice(bits, group):
    w = normal(2, (5, 32, 8))
    qt = Q.quantize(w, bits, group)
    for e in (0, 3, -1):
        assert_qt_equal(Q.take(qt, e), Q.quantize(w[e], bits, group))
        assert_qt_equal(qt[e], Q.quantize(w[e], bits, group))
    idx = jnp.asarray([4, 0, 4])
    assert_qt_equal(Q.take(qt, idx), Q.quantize(w[idx], bits, group))
    assert_qt_equal(Q.take(qt, slice(1, 3)), Q.quantize(w[1:3], bits, group))
    # traced index under jit: what an offloader pages
    page = jax.jit(lambda t, i: Q.dequantize(Q.take(t, i)))
    for e in range(5):
        np.testing.assert_array_equal(np.asarray(page(qt, jnp.int32(e))),
                                      np.asarray(Q.dequantize(Q.quantize(w[e], bits, group))))
    paged = jax.jit(Q.take)(qt, jnp.int32(2))
    assert isinstance(paged, Q.QuantizedTensor) and paged.shape == (32, 8)
    assert Q.nbytes(paged) * 5 == Q.nbytes(qt)


@pytest.mark.parametrize("bits,group,sdt", [(8, None, "bfloat16"), (4, 8, "bfloat16"), (4, None, "float32")])
def test_jit_equals_eager_and_vmap(bits, group, sdt):
    w = normal(3, (4, 16, 6)) * 0.02
    eager = Q.quantize(w, bits, group, scale_dtype=sdt)
    jitted = jax.jit(Q.quantize, static_argnums=(1, 2, 3, 4))(w, bits, group, -2, sdt)
    assert_qt_equal(jitted, eager)
    np.testing.assert_array_equal(np.asarray(jax.jit(Q.dequantize)(eager)), np.asarray(Q.dequantize(eager)))
    # vmap over the expert axis: quantising each expert = quantising the stack; dequantise per expert
    vq = jax.vmap(lambda x: Q.quantize(x, bits, group, scale_dtype=sdt))(w)
    assert_qt_equal(vq, eager)
    assert vq.shape == w.shape
    np.testing.assert_array_equal(np.asarray(jax.vmap(Q.dequantize)(eager)), np.asarray(Q.dequantize(eager)))
    np.testing.assert_array_equal(np.asarray(jax.vmap(lambda i: Q.dequantize(Q.take(eager, i)))(jnp.arange(4))),
                                  np.asarray(Q.dequantize(eager)))


def test_bf16_input():
    w = (normal(4, (2, 64, 16)) * 0.05).astype(jnp.bfloat16)
    for bits, group in ((8, None), (4, 16)):
        qt = Q.quantize(w, bits, group)
        assert qt.dtype == jnp.bfloat16
        out = Q.dequantize(qt)
        assert out.dtype == jnp.bfloat16 and out.shape == w.shape
        d32 = Q.dequantize(qt, jnp.float32)
        w64 = np.asarray(w.astype(jnp.float32), np.float64)
        assert np.all(np.abs(w64 - np.asarray(d32, np.float64)) <= expanded_scale(qt) / 2 * SLACK)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(d32.astype(jnp.bfloat16)))
        assert rel(d32, w64) < (0.01 if bits == 8 else 0.11)


def test_plain_arrays_pass_through():
    x = jnp.ones((2, 3), jnp.bfloat16)
    assert Q.dequantize(x) is x
    assert Q.dequantize(x, jnp.float32).dtype == jnp.float32
    assert Q.nbytes(x) == 12


# -------------------------------------------------------------------------------------------- bytes
def test_nbytes_hand_computed():
    w = jnp.zeros((4, 64, 32))
    # int4 grouped 32: q 4·64·32/2 = 4096 bytes; scales 4·(64/32)·32 = 256 bf16 = 512 bytes
    assert Q.nbytes(Q.quantize(w, 4, 32)) == 4096 + 512
    assert Q.quantize(w, 4, 32).nbytes == 4608
    assert Q.nbytes(Q.quantize(w, 4, 32, scale_dtype=jnp.float32)) == 4096 + 1024
    # int8 per-channel: q 8192 bytes; scales 4·1·32 bf16 = 256 bytes
    assert Q.nbytes(Q.quantize(w, 8)) == 8192 + 256
    assert Q.nbytes(w) == 4 * 64 * 32 * 4


def test_quantize_experts_and_expert_nbytes():
    seed = 5
    moe = {"router": jnp.ones((64, 4)), "gate": normal(seed, (4, 64, 32)),
           "up": normal(seed + 1, (4, 64, 32)), "down": normal(seed + 2, (4, 32, 64)),
           "shared": {"gate": jnp.ones((64, 8))}}
    qe = Q.quantize_experts(moe, 4, 32)
    assert set(qe) == set(moe) and qe["router"] is moe["router"] and qe["shared"] is moe["shared"]
    assert all(isinstance(qe[n], Q.QuantizedTensor) for n in Q.EXPERT_KEYS)
    assert qe["down"].scale.shape == (4, 1, 64)  # down [N, F, D] contracts over F=32: one group of 32
    # per expert: gate/up q 64·32/2 = 1024 + scales 2·32·2 = 128; down q 1024 + scales 1·64·2 = 128
    assert Q.expert_nbytes(qe) == 3 * (1024 + 128)
    assert Q.expert_nbytes(moe) == 3 * 64 * 32 * 4  # unquantised experts: float32 bytes
    assert Q.expert_nbytes(Q.quantize_experts(moe, 8)) == 3 * 64 * 32 + 2 * (32 + 32 + 64)
    # one quantised expert paged by take = the expert's share of the stack
    assert sum(Q.nbytes(Q.take(qe[n], 1)) for n in Q.EXPERT_KEYS) == Q.expert_nbytes(qe)


def test_default_model_expert_bytes():
    """Bytes per expert at the default model's expert shape (D=256, F=112), from shapes alone."""
    N, D, F = 32, 256, 112
    sds = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.bfloat16)
    shapes = {"gate": sds((N, D, F)), "up": sds((N, D, F)), "down": sds((N, F, D))}
    n = 3 * D * F
    assert Q.expert_nbytes(shapes) == 2 * n == 172032
    assert Q.expert_nbytes({k: jax.ShapeDtypeStruct(v.shape, jnp.float32) for k, v in shapes.items()}) == 344064
    got = {}
    for bits, group in ((8, None), (8, 16), (4, None), (4, 16)):
        qe = jax.eval_shape(functools.partial(Q.quantize_experts, bits=bits, group_size=group), shapes)
        got[(bits, group)] = Q.expert_nbytes(qe)
    assert got == {(8, None): 86976, (8, 16): 96768, (4, None): 43968, (4, 16): 53760}


# ----------------------------------------------------------------------------------- bad arguments
def test_bad_arguments_raise():
    w = jnp.zeros((2, 64, 32))
    for bits in (3, 16, 0):
        with pytest.raises(ValueError, match="bits must be 4 or 8"):
            Q.quantize(w, bits)
    with pytest.raises(ValueError, match="group_size 24 does not divide the contraction axis"):
        Q.quantize(w, 8, 24)
    for bad in (0, -4, 2.0):
        with pytest.raises(ValueError, match="group_size"):
            Q.quantize(w, 8, bad)
    with pytest.raises(ValueError, match="last axis, which must be even"):
        Q.quantize(jnp.zeros((64, 31)), 4)
    Q.quantize(jnp.zeros((64, 31)), 8)  # int8 does not pack: odd is fine
    with pytest.raises(ValueError, match="axis 3 out of range"):
        Q.quantize(w, 8, axis=3)
    with pytest.raises(ValueError, match="scale_dtype"):
        Q.quantize(w, 8, scale_dtype=jnp.float16)
    with pytest.raises(ValueError, match="floating"):
        Q.quantize(jnp.zeros((4, 4), jnp.int32), 8)
    with pytest.raises(ValueError, match="contraction axis"):
        Q.take(Q.quantize(jnp.zeros((8, 4)), 8), 0)  # axis 0 of a single matrix is the contraction axis
    with pytest.raises(ValueError, match="integer index"):
        Q.take(Q.quantize(w, 8), jnp.float32(1))
    moe = {"gate": jnp.zeros((2, 256, 112)), "up": jnp.zeros((2, 256, 112)), "down": jnp.zeros((2, 112, 256))}
    with pytest.raises(ValueError, match="'down'.*group_size 32 does not divide"):
        Q.quantize_experts(moe, 4, 32)  # F=112 is not a multiple of 32
    with pytest.raises(ValueError, match="lack the expert weights"):
        Q.quantize_experts({"gate": moe["gate"]}, 8)


# ----------------------------------------------------------------------- stated error vs originals
# (bits, group): (max weight rel. Frobenius error, max expert-output rel. error), Gaussian D=256, F=128,
# as stated in moejax/models/quant.py's docstring
GAUSSIAN_BOUNDS = {(8, None): (0.010, 0.015), (8, 32): (0.0075, 0.0125),
                   (4, None): (0.15, 0.25), (4, 32): (0.11, 0.19), (4, 16): (0.10, 0.17)}


@functools.partial(jax.jit, static_argnums=(4, 5))
def _errors(x, g, u, d, bits, group):
    """(max weight rel. Frobenius error over g/u/d, rel. error of the expert output per expert) for
    stacked experts g/u [N, D, F], d [N, F, D] and tokens x [T, D]."""
    f32 = [w.astype(jnp.float32) for w in (g, u, d)]
    dq = [Q.dequantize(Q.quantize(w, bits, group), jnp.float32) for w in (g, u, d)]
    fro = lambda a, axes: jnp.sqrt(jnp.sum(jnp.square(a), axis=axes))  # noqa: E731
    werr = jnp.max(jnp.stack([jnp.max(fro(a - b, (1, 2)) / fro(b, (1, 2))) for a, b in zip(dq, f32)]))
    mlp = jax.vmap(expert_mlp, (None, 0, 0, 0))
    y, yq = mlp(x, *f32), mlp(x, *dq)
    return werr, fro(yq - y, (1, 2)) / fro(y, (1, 2))


def test_gaussian_error_bounds():
    """Gaussian experts at D=256, F=128 (8 independent experts = seeds), 64 Gaussian tokens."""
    D, F, N = 256, 128, 8
    seed = 0
    g, u = normal(seed, (N, D, F)), normal(seed + 1, (N, D, F))
    d, x = normal(seed + 2, (N, F, D)), normal(seed + 3, (64, D))
    for (bits, group), (wb, ob) in GAUSSIAN_BOUNDS.items():
        werr, oerr = _errors(x, g, u, d, bits, group)
        assert float(werr) < wb, (bits, group, float(werr))
        assert float(jnp.max(oerr)) < ob, (bits, group, float(jnp.max(oerr)))


def test_default_model_experts_within_bounds():
    """The shipped default model's trained experts (all layers, all 32 experts) against their bf16 originals."""
    from moejax.models import assets, checkpoint

    if not os.path.isdir(assets.DEFAULT_MODEL_DIR):
        pytest.skip("default model not installed")
    params, cfg = checkpoint.load_params(assets.default_model_path())
    bounds = {(8, None): (0.01, 0.015), (4, None): (0.15, 0.21), (4, 16): (0.10, 0.15)}
    for li, lp in enumerate(params["layers"]):
        p = lp["moe"]
        x = normal(li, (32, cfg.hidden_size))
        for (bits, group), (wb, ob) in bounds.items():
            werr, oerr = _errors(x, p["gate"], p["up"], p["down"], bits, group)
            assert float(werr) < wb and float(jnp.max(oerr)) < ob, (li, bits, group, float(werr), float(jnp.max(oerr)))


@pytest.mark.parametrize("k", [100, 2048, 4096])
def test_a_nan_weight_gives_its_row_a_nan_scale(k):
    """XLA:CPU's max-reduction drops NaN from rows of 2,048 and more (the scale came out -inf)."""
    w = jnp.ones((2, k), jnp.float32).at[0, k - 1].set(jnp.nan)
    q = Q.quantize(w, 8, axis=-1, scale_dtype=jnp.float32)
    assert np.isnan(np.asarray(q.scale)[0]).all() and np.isfinite(np.asarray(q.scale)[1]).all()


@pytest.mark.parametrize("k", [100, 2048, 4095, 4096, 14336])
def test_a_nan_row_quantises_to_a_nan_scale(k):
    """XLA:CPU's max-reduction drops NaN from rows of 2,048 and more (-inf, or the largest finite value):
    without the separate check a NaN activation came out of an int8 product as ±inf or a number."""
    x = jnp.ones((2, k), jnp.float32).at[0, k - 1].set(jnp.nan)
    _, scale = jax.jit(layout.quantize_rows)(x)
    assert np.isnan(np.asarray(scale)[0, 0]) and np.isfinite(np.asarray(scale)[1, 0])


@pytest.mark.numerics
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 70), cols=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       magnitude=st.sampled_from([1e-30, 1e-3, 0.02, 1.0, 3e4]), dtype=st.sampled_from(["float32", "bfloat16"]),
       zero_rows=st.integers(0, 3))
def test_host_quantisation_gives_the_device_programs_bits(rows, cols, seed, magnitude, dtype, zero_rows):
    """``quantize_rows_into`` (numpy, on the host: what an int8 slot's page is quantised with in place) is
    ``layout.quantize_matrix`` bit for bit: values, scales, ties, all-zero rows, tiny and large magnitudes, both
    ISAs (the numerics pass runs under AVX2 too). The wide case covers more rows than one host block."""
    rng = np.random.default_rng(seed)
    for shape in ((rows, cols), (rows + Q.ROWS_PER_CHUNK, 2048)):
        w = (rng.standard_normal(shape) * magnitude).astype(jnp.dtype(dtype))
        w[: min(zero_rows, shape[0])] = 0
        w.flat[:: 7] = np.asarray(np.round(w.flat[:: 7].astype(np.float32) * 4) / 4, w.dtype)  # ties at .5 steps
        q, scale = np.full(shape, 99, np.int8), np.full((shape[0], 1), -1, np.float32)
        Q.quantize_rows_into(w, q, scale)
        ref = layout.quantize_matrix(jnp.asarray(w))
        np.testing.assert_array_equal(q, np.asarray(ref.q))
        np.testing.assert_array_equal(scale, np.asarray(ref.scale))
    with pytest.raises(ValueError, match="quantize_rows_into"):
        Q.quantize_rows_into(w, q[:-1], scale)
