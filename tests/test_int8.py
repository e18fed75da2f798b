"""int8 weights in the serving layout (``moejax.load(..., weight_dtype="int8" | expert_dtype="int8")``).

Checked here: the int8 product is within its stated bound of the product with the dequantised weights
(hypothesis over rows, shapes and magnitudes; the only extra error is the per-row rounding of the
activations), NaN activations stay NaN; every family's int8 model equals its dequantised float32 model up
to that rounding when both route alike; the load options put int8 exactly where they say, halve the
weight bytes and refuse what they cannot do; the int8 decode step reads every matrix in place (no
dequantised copy in the compiled program); offloaded int8 experts page into int8 slots with the tokens of
the int8 simulation; the command-line flags reach the model.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moejax
from moejax.models import checkpoint, layout, model as M, quant
from moejax.models.config import from_hf
from moejax.runtime import cli_options, decode, generate, offload, simulate

from support.hf_models import FAMILIES, get_hf_model
from test_layout import _big_expert_config, _decode_program, _random_params, materialised_matrices


@pytest.mark.numerics
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.sampled_from([1, 2, 3, 7, 64]),
       shape=st.sampled_from([(8, 16), (48, 32), (256, 96), (3, 1024)]),
       scale=st.sampled_from([1e-3, 0.05, 3.0]), zero_row=st.booleans())
def test_int8_product_is_within_the_activation_rounding_bound(seed, rows, shape, scale, zero_row):
    """|x·deq(w)ᵀ − int8_nt_dot(x, w)| ≤ s_x/2 · Σ_i |deq(w)_i| per output (s_x: the row's scale), plus float
    rounding of the scaled int32 result; an all-zero row gives exactly zero."""
    out_dim, in_dim = shape
    rng = np.random.default_rng(seed)
    w = layout.quantize_matrix(jnp.asarray(rng.normal(size=shape) * scale, jnp.float32))
    x = rng.normal(size=(rows, in_dim)).astype(np.float32) * rng.uniform(0.1, 10.0, size=(rows, 1)).astype(np.float32)
    if zero_row:
        x[0] = 0.0
    deq = np.asarray(quant.dequantize(w), np.float64)
    exact = x.astype(np.float64) @ deq.T
    got = np.asarray(jax.jit(layout.int8_nt_dot)(jnp.asarray(x), w), np.float64)
    s_x = np.abs(x).max(axis=1, keepdims=True) / 127.0
    bound = s_x / 2 * np.abs(deq).sum(axis=1)[None, :] + 1e-5 * np.abs(exact) + 1e-30
    assert np.all(np.abs(got - exact) <= bound), float(np.max(np.abs(got - exact) / bound))
    if zero_row:
        assert np.all(got[0] == 0.0)


def test_int8_product_keeps_nan_and_shapes():
    w = layout.quantize_matrix(jnp.ones((6, 4), jnp.bfloat16))
    assert w.q.dtype == jnp.int8 and w.scale.shape == (6, 1) and w.dtype == jnp.bfloat16
    x = jnp.asarray([[1.0, 2.0, jnp.nan, 0.0], [1.0, 1.0, 1.0, 1.0]])
    y = np.asarray(layout.nt_dot(x[None], w))
    assert y.shape == (1, 2, 6)
    assert np.isnan(y[0, 0]).all() and np.allclose(y[0, 1], 4.0, rtol=1e-2)
    assert layout.quantize_matrix(w) is w  # already int8: kept
    with pytest.raises(ValueError, match="one scale per output row"):
        layout.int8_nt_dot(x, quant.quantize(jnp.ones((6, 4)), 8, axis=-2))


def _replay(experts, weights):
    """A router hook that routes as a recorded pass did (both sides then compute the same experts)."""
    def hook(i, z, state):
        return experts[i], weights[i], state, {}
    return hook


@pytest.mark.parametrize("name", [n if n in ("phimoe", "qwen2_moe", "deepseek_v2") else
                                  pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES])
def test_every_family_int8_equals_its_dequantised_model(name):
    """The int8 model (every matrix) against its own weights dequantised to float32 in the canonical layout,
    routed alike: the logits differ by the activations' rounding alone (measured 0.8–2.0 % of the largest
    logit on these models; asserted 4 %). Its greedy decode equals its teacher-forced argmax chain. CI runs the
    three families with the most kinds of matrices (sparsemixer + biases, shared experts, MLA); ``-m slow``
    every family."""
    q = moejax.load(get_hf_model(name).folder, weight_dtype="int8")
    cfg = q.cfg
    ref = layout.to_canonical(q.params)
    ids = jnp.asarray(np.random.default_rng(1).integers(3, 90, size=40), jnp.int32)
    out = jax.jit(lambda p: M.forward(p, cfg, ids))(q.params)
    deq = jax.jit(lambda p: M.forward(p, cfg, ids, router=_replay(out.experts, out.weights)).logits)(ref)
    a, b = np.asarray(out.logits), np.asarray(deq)
    assert np.abs(a - b).max() <= 0.04 * np.abs(b).max(), np.abs(a - b).max() / np.abs(b).max()
    res = decode.generate(q.params, cfg, [3, 5, 7], max_new_tokens=6, stop_at_eos=False)
    chain = [3, 5, 7] + list(res.token_ids)
    logits = np.asarray(jax.jit(lambda p, t: M.forward(p, cfg, t).logits)(q.params, jnp.asarray(chain[:-1])))
    top2 = np.sort(logits[2:], axis=-1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > 1e-3  # an exact tie may break either way between the two paths
    assert (logits[2:].argmax(-1) == np.asarray(chain[3:]))[decisive].all()


def test_load_options_place_int8_where_they_say():
    folder = get_hf_model("qwen2_moe").folder  # shared experts, a dense MLP and attention: every kind of matrix
    full = moejax.load(folder)
    experts_only = moejax.load(folder, expert_dtype="int8")
    everything = moejax.load(folder, weight_dtype="int8")
    dense_only = moejax.load(folder, weight_dtype="int8", expert_dtype="stored")

    def kinds(params):
        out = {}
        for lp in params["layers"]:
            out.setdefault("attention", set()).update(layout.is_int8(m.w) for k, m in lp["attn"].items()
                                                       if isinstance(m, layout.OutIn))
            moe = lp.get("moe")
            if moe:
                el = moe["experts"]
                out.setdefault("experts", set()).update(layout.is_int8(w) for w in [*el.gate_up, *el.down])
                out.setdefault("shared", set()).update(layout.is_int8(m.w) for m in moe["shared"].values()
                                                       if isinstance(m, layout.OutIn))
        out["head"] = {layout.is_int8(M.lm_head(params, full.cfg).w)}
        return out

    assert kinds(full.params) == {"attention": {False}, "experts": {False}, "shared": {False}, "head": {False}}
    assert kinds(experts_only.params) == {"attention": {False}, "experts": {True}, "shared": {False}, "head": {False}}
    assert kinds(everything.params) == {"attention": {True}, "experts": {True}, "shared": {True}, "head": {True}}
    assert kinds(dense_only.params) == {"attention": {True}, "experts": {False}, "shared": {True}, "head": {True}}
    # the routers, norms and embedding keep their dtype; an expert's bytes (what a miss moves) are int8 + scales
    assert everything.params["embed"].dtype == full.params["embed"].dtype
    cfg = full.cfg
    f32_expert = simulate.expert_bytes(full.params, cfg)
    assert simulate.expert_bytes(everything.params, cfg) == f32_expert // 4 + 4 * (2 * cfg.moe_intermediate_size
                                                                                   + cfg.hidden_size)
    fingerprints = {m.fingerprint for m in (full, experts_only, everything, dense_only)}
    assert len(fingerprints) == 4  # sweep records of an int8 model never pass for the stored model's


def test_tied_head_gets_an_int8_copy_and_the_embedding_stays():
    m = moejax.load("default", weight_dtype="int8")
    assert m.cfg.tie_word_embeddings and layout.TIED_INT8_HEAD in m.params
    assert not layout.is_int8(m.params["embed"]) and layout.is_int8(M.lm_head(m.params, m.cfg).w)
    assert layout.TIED_INT8_HEAD not in layout.to_canonical(m.params)  # derived: never written to a checkpoint
    stored = moejax.load("default")
    ids = stored.encode("The history of the city")
    a, b = m.forward(ids).logits, stored.forward(ids).logits
    assert np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.99


def test_load_refuses_what_int8_cannot_do():
    folder = get_hf_model("olmoe").folder
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        moejax.load(folder, weight_dtype="int4")
    with pytest.raises(ValueError, match="layout='serving'"):
        moejax.load(folder, expert_dtype="int8", layout="canonical")
    with pytest.raises(ValueError, match="int8 slots .* are filled by the host pager"):
        moejax.load(folder, expert_dtype="int8", offload=offload.OffloadConfig(paging="jit"))
    m = moejax.load(folder, weight_dtype="int8")
    with pytest.raises(ValueError, match="already in the serving layout"):
        layout.to_serving(m.params, layout.Quantization(experts=True))


def test_int8_decode_reads_every_matrix_in_place():
    """No dequantised (bf16/f32) copy of any weight matrix in the compiled decode step: its temporary memory
    stays below one int8 expert matrix and nothing outside a fusion writes a matrix-shaped float array."""
    cfg = from_hf(_big_expert_config())
    params = layout.to_serving(_random_params(cfg, jnp.bfloat16), layout.Quantization(experts=True, matrices=True))
    program = _decode_program(params, cfg)
    one_int8_expert_matrix = cfg.hidden_size * cfg.moe_intermediate_size
    assert program.memory_analysis().temp_size_in_bytes < one_int8_expert_matrix
    assert not materialised_matrices(program, params, dtypes=("f32", "bf16"))


@pytest.mark.parametrize("store", ["flash", pytest.param("host", marks=pytest.mark.slow)])
def test_offloaded_int8_slots_generate_the_int8_simulation_tokens(store):
    """With offload the experts stay in the checkpoint's files; int8 experts mean int8 device slots, each page
    quantised on the device as it arrives: the tokens and misses of the in-memory int8 model's simulation,
    with slots of half the bytes."""
    folder = get_hf_model("qwen2_moe").folder
    cache = simulate.CacheConfig(size="0.5")
    ref = moejax.load(folder, expert_dtype="int8").generate([3, 5, 7], max_new_tokens=8, stop_at_eos=False,
                                                            routing="original", cache=cache)
    m = moejax.load(folder, expert_dtype="int8", offload=store)
    assert m.offload.slot_dtype == "int8"
    got = m.generate([3, 5, 7], max_new_tokens=8, stop_at_eos=False, routing="original", cache=cache)
    assert got.token_ids == ref.token_ids
    assert got.stats["cache"]["misses"] == ref.stats["cache"]["misses"]
    full = moejax.load(folder, offload=store).generate([3, 5, 7], max_new_tokens=2, stop_at_eos=False, cache=cache)
    slots_int8, slots_full = (r.stats["offload"]["device_memory"]["slots"] for r in (got, full))
    assert slots_int8 < 0.3 * slots_full  # f32 checkpoint: a quarter, plus the row scales
    # a call's own OffloadConfig keeps the model's int8 slots
    again = m.generate([3, 5, 7], max_new_tokens=2, stop_at_eos=False, cache=cache, offload=offload.OffloadConfig(store=store))
    assert again.stats["offload"]["device_memory"]["slots"] == slots_int8


def test_generate_command_takes_the_int8_flags(capsys):
    assert generate.main(["--prompt-ids", "5,17", "--max-new-tokens", "2", "--weight-dtype", "int8", "--offload",
                          "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    memory = out["stats"]["offload"]["device_memory"]
    assert len(out["token_ids"]) == 2 and memory["slots"] < memory["all_experts_on_host"]  # int8 slots: half
    args = generate.build_parser().parse_args(["--expert-dtype", "int8", "--weight-dtype", "stored"])
    assert cli_options.weight_kwargs(args) == {"weight_dtype": "stored", "expert_dtype": "int8"}
    assert cli_options.weight_label(args) == "+int8-experts"
    with pytest.raises(SystemExit) as e:
        generate.build_parser().parse_args(["--weight-dtype", "int4"])
    assert e.value.code == 2


# ------------------------------------------------------------------------------ int8 experts on storage


def _int8_folder(tmp_path, name="qwen2_moe"):
    src = get_hf_model(name).folder
    dst = str(tmp_path / f"{name}-int8")
    checkpoint.convert_to_moejax(src, dst, expert_dtype="int8")
    return src, dst


def test_int8_expert_folder_loads_the_bits_that_int8_loading_makes(tmp_path):
    """A folder written with int8 experts (format version 3) holds exactly ``layout.quantize_matrix`` of each
    expert: loaded (int8 by default) it is bit for bit the model ``expert_dtype="int8"`` makes from the
    full-precision folder, its expert tensors take a quarter of the float32 bytes (+ row scales), and the
    canonical layout reads the dequantised values."""
    src, dst = _int8_folder(tmp_path)
    meta = json.load(open(f"{dst}/moejax.json"))
    assert meta["version"] == 3 and meta["experts"] == "int8"
    ref = moejax.load(src, expert_dtype="int8")
    m = moejax.load(dst)
    for lp_ref, lp in zip(ref.params["layers"], m.params["layers"]):
        if "moe" in lp:
            for a, b in zip([*lp_ref["moe"]["experts"].gate_up, *lp_ref["moe"]["experts"].down],
                            [*lp["moe"]["experts"].gate_up, *lp["moe"]["experts"].down]):
                assert layout.is_int8(b) and b.dtype == a.dtype
                np.testing.assert_array_equal(np.asarray(a.q), np.asarray(b.q))
                np.testing.assert_array_equal(np.asarray(a.scale), np.asarray(b.scale))
    ids = [3, 5, 7, 11, 2, 9]
    np.testing.assert_array_equal(m.forward(ids).logits, ref.forward(ids).logits)
    # bytes: the experts as int8 + one float32 scale per output row
    cfg = m.cfg
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    files = checkpoint.safetensors_io.SafetensorsFile(f"{dst}/params.safetensors")
    q8 = [k for k in files.keys() if k.endswith(".q8")]
    assert len(q8) == 3 * cfg.n_moe_layers and not [k for k in files.keys() if k.endswith((".gate", ".up", ".down"))
                                                     and ".moe." in k and ".shared" not in k]
    assert simulate.expert_bytes(m.params, cfg) == 3 * d * f + 4 * (2 * f + d)
    canonical = moejax.load(dst, layout="canonical")
    gate = np.asarray(canonical.params["layers"][1]["moe"]["gate"][2])  # [D, F] = deq(q [F, D]).T
    gu = ref.params["layers"][1]["moe"]["experts"].gate_up[2]
    np.testing.assert_array_equal(gate, np.asarray(quant.dequantize(gu))[:f].T)
    assert moejax.load(dst, expert_dtype="stored").params["layers"][1]["moe"]["experts"].gate_up[0].q.dtype == jnp.int8


@pytest.mark.parametrize("store", ["flash", pytest.param("host", marks=pytest.mark.slow)])
def test_int8_expert_folder_pages_the_stored_int8_bytes(tmp_path, store):
    """Offloaded from an int8 folder: each page moves the stored int8 bytes + scales (a quarter of the float32
    expert here) straight into int8 slots, with the tokens and misses of the int8 simulation."""
    src, dst = _int8_folder(tmp_path)
    cache = simulate.CacheConfig(size="0.5")
    ref = moejax.load(src, expert_dtype="int8").generate([3, 5, 7], max_new_tokens=8, stop_at_eos=False,
                                                         routing="original", cache=cache)
    m = moejax.load(dst, offload=store)
    assert m.offload.slot_dtype == "int8"
    got = m.generate([3, 5, 7], max_new_tokens=8, stop_at_eos=False, routing="original", cache=cache)
    assert got.token_ids == ref.token_ids
    assert got.stats["cache"]["misses"] == ref.stats["cache"]["misses"]
    cfg = m.cfg
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    off = got.stats["offload"]
    assert off["expert_bytes"] == 3 * d * f + 4 * (2 * f + d)
    assert off["bytes_moved"] % off["expert_bytes"] == 0 and off["bytes_moved"] > 0
    assert simulate.expert_bytes(m.params, cfg) == off["expert_bytes"]  # what the cache statistics count per miss


def test_convert_writes_and_keeps_int8_experts(tmp_path, capsys):
    """``--expert-dtype int8`` on the command line; a moejax-to-moejax copy keeps them int8; moejax-to-hf
    dequantises; a damaged int8 folder is one clear error."""
    from moejax.models import convert

    src = get_hf_model("olmoe").folder
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    assert convert.main(["hf-to-moejax", src, a, "--expert-dtype", "int8"]) == 0
    assert convert.main(["moejax-to-moejax", a, b]) == 0
    assert json.load(open(f"{b}/moejax.json"))["experts"] == "int8"
    assert convert.main(["moejax-to-hf", b, c]) == 0
    ids = [4, 8, 15, 16, 23]
    np.testing.assert_allclose(moejax.load(c).forward(ids).logits, moejax.load(a, layout="canonical").forward(ids).logits,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(moejax.load(b).forward(ids).logits, moejax.load(a).forward(ids).logits)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # moejax-to-hf has no --expert-dtype: argparse's usage error
        convert.main(["moejax-to-hf", a, str(tmp_path / "d"), "--expert-dtype", "int8"])
    assert e.value.code == 2
    # damaged: the scales of one stack are gone
    from moejax.models import safetensors_io

    path = f"{b}/params.safetensors"
    f = safetensors_io.SafetensorsFile(path)
    kept = [(k, np.array(f.get(k))) for k in f.keys() if k != "layers.0.moe.up.scale"]
    del f
    safetensors_io.write(path, kept, {"format": "moejax"})
    with pytest.raises(checkpoint.CheckpointError, match=r"missing tensor 'layers.0.moe.up.scale'"):
        moejax.load(b)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_int8_scales_that_are_not_finite_are_a_damaged_file(tmp_path, value):
    """A NaN or infinite int8 scale makes its row NaN in any dtype: the folder is refused when it is opened (every
    scale is read, a few bytes a row), in one line naming the file and the tensor, with no numpy warning."""
    import warnings

    from moejax.models import safetensors_io

    _, dst = _int8_folder(tmp_path, "olmoe")
    path = f"{dst}/params.safetensors"
    f = safetensors_io.SafetensorsFile(path)
    start, _ = f.byte_range("layers.1.moe.down.scale")
    del f
    with open(path, "r+b") as out:
        out.seek(start + 4 * 3)
        out.write(np.float32(value).tobytes())
    message = rf"{path}: 1 of the int8 scales in tensor 'layers.1.moe.down.scale' are not finite"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kwargs in ({}, {"offload": "flash"}, {"layout": "canonical"}):
            with pytest.raises(checkpoint.CheckpointError, match=message):
                moejax.load(dst, **kwargs)
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.convert_moejax_to_hf(dst, str(tmp_path / "hf"))
