"""Matrices with rows longer than XLA:CPU's one-row loop takes (``layout.ColumnBlocks``): Mixtral's and
Phi-3.5-MoE's hidden size 4,096, Qwen1.5-MoE's shared expert, DeepSeek-V2's dense MLP.

Checked here: a blocked matrix multiplies like the matrix it stands for (one row and many; float32, bf16,
int8; NaN stays NaN) and gives it back whole; a one-row product with it runs in XLA:CPU's fused loops, one
per block, and writes no copy of the matrix, where the unblocked matrix goes to the library; and models
whose hidden or expert width passes the limit, loaded in the serving layout (blocked), compute what their
canonical layout computes (teacher-forced logits, a decode step, greedy tokens, offloaded decoding), keep
one fingerprint and one checkpoint, and decode without copying a weight matrix.
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
from moejax.models import checkpoint, layout, model as M, quant
from moejax.models import attention as attention_lib
from moejax.runtime import host_paging, offload
from moejax.runtime.simulate import CacheConfig
from moejax.testing import random_checkpoint

from support.hf_models import get_hf_model

import test_page_writes as page_writes
from test_layout import _decode_program, assert_serving_equals_canonical, materialised_matrices

LIMIT = layout.ROW_DOT_MAX_IN

# blocks are made on the CPU only: elsewhere one row goes to the matmul library, whole
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="column blocks are the CPU's layout (XLA:CPU's one-row loop)")


@pytest.mark.parametrize("k,widths", [(LIMIT, (LIMIT,)), (LIMIT + 1, (2048, 2048)), (4096, (2048, 2048)),
                                      (14336, (3584,) * 4), (10944, (3648,) * 3), (9001, (3001, 3000, 3000))])
def test_block_widths_are_the_fewest_under_the_limit(k, widths):
    assert layout.column_block_widths(k) == widths


def _matrix(rng, out_dim, k, dtype):
    w = jnp.asarray(rng.normal(size=(out_dim, k)), jnp.float32)
    return layout.quantize_matrix(w) if dtype == "int8" else w.astype(dtype)


@pytest.mark.numerics
@settings(max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.sampled_from([LIMIT + 1, 4096, 9001, 12288]),
       rows=st.sampled_from([1, 2, 7]), dtype=st.sampled_from(["float32", "bfloat16", "int8"]))
def test_blocked_product_is_the_product_of_the_whole_matrix(seed, k, rows, dtype):
    """One row (the CPU's fused loops, a block each) and more (the library, a block each): the product of
    the matrix the blocks stand for, within float32 summation order; int8 with more rows exactly the
    unblocked int8 product (int32 partial sums), one row without activation rounding."""
    rng = np.random.default_rng(seed)
    w = _matrix(rng, 6, k, dtype)
    blocked = layout.in_column_blocks(w)
    assert isinstance(blocked, layout.ColumnBlocks) and blocked.shape == (6, k) and blocked.dtype == w.dtype
    assert max(b.shape[1] for b in blocked.blocks) <= LIMIT
    np.testing.assert_array_equal(np.asarray(layout.dense(blocked)), np.asarray(layout.dense(w)))
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32)
    got = np.asarray(jax.jit(layout.nt_dot)(x, blocked))
    deq = np.asarray(layout.dense(w), np.float64)
    exact = np.asarray(x, np.float64) @ deq.T
    if dtype == "int8" and rows > 1:
        np.testing.assert_array_equal(got, np.asarray(jax.jit(layout.nt_dot)(x, w)))
    else:
        scale = np.abs(np.asarray(x, np.float64)) @ np.abs(deq).T
        assert np.all(np.abs(got - exact) <= 1e-6 * k * scale + 1e-30)
    nan = np.asarray(jax.jit(layout.nt_dot)(x.at[0, k - 1].set(jnp.nan), blocked))
    assert np.isnan(nan[0]).all()


def _products(program) -> tuple[int, int]:
    """(fused loops that compute a product, library products) of a compiled XLA:CPU program."""
    hlo = program.as_text()
    loops = len(re.findall(r"_dot_fusion[.\d]* = \S+ fusion\(.*kind=kLoop", hlo))
    return loops, len(re.findall(r"fusion\(.*kind=kCustom", hlo))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("k", [4096, 14336])
def test_one_row_with_blocks_runs_the_fused_loop_and_copies_nothing(k, dtype):
    """The unblocked matrix's one-row product goes to the library; the blocks' runs one fused
    loop per block (about twice the weights per second: docs/benchmarks.md#one-row-products) and, like the library, never writes a copy of the matrix."""
    if jax.default_backend() != "cpu":
        pytest.skip("the fused one-row loop is XLA:CPU's")
    w = _matrix(np.random.default_rng(0), 16, k, dtype)
    blocked = layout.in_column_blocks(w)
    row = jnp.zeros((1, k), jnp.float32 if dtype == "int8" else jnp.bfloat16)
    program = jax.jit(layout.nt_dot).lower(row, blocked).compile()
    assert _products(program) == (len(blocked.blocks), 0)
    whole = layout.dense(w)
    matrices = {"w": whole, "blocks": [layout.dense(b) for b in blocked.blocks]}
    assert not materialised_matrices(program, matrices, dtypes=("f32", "bf16", "s8"))
    loops, library = _products(jax.jit(layout.nt_dot).lower(row, w).compile())
    assert loops == 0 and library >= 1


def test_blocks_are_made_only_where_they_pay():
    """Rows within the limit stay whole; int4 or grouped int8 stays whole (the loop's one-scale-per-row form
    is what the blocks carry); so does anything not an array on the CPU."""
    rng = np.random.default_rng(0)
    assert not isinstance(layout.in_column_blocks(_matrix(rng, 4, LIMIT, "bfloat16")), layout.ColumnBlocks)
    wide = jnp.asarray(rng.normal(size=(4, 4096)), jnp.float32)
    assert not isinstance(layout.in_column_blocks(quant.quantize(wide, 4, axis=-1)), layout.ColumnBlocks)
    assert not isinstance(layout.in_column_blocks(np.asarray(wide)), layout.ColumnBlocks)
    assert layout.matrix_nbytes(layout.in_column_blocks(wide)) == layout.matrix_nbytes(wide)


# ------------------------------------------------------------------------------------------- models
WIDE = {
    # hidden 4,160: attention's q/k/v, every expert's gate_up and the LM head are blocked
    "hidden": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=4160,
                   moe_intermediate_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    # expert width 4,100: every expert's down and the shared expert's down are blocked
    "experts": dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64,
                    moe_intermediate_size=4100, shared_expert_intermediate_size=4100, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                    norm_topk_prob=False),
}
COMMON = dict(vocab_size=96, num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
_FOLDERS: dict = {}


def _wide_folder(which, tmp_path_factory) -> str:
    if which not in _FOLDERS:
        folder = str(tmp_path_factory.mktemp(f"wide-{which}") / "hf")
        random_checkpoint.write_checkpoint({**COMMON, **WIDE[which]}, folder, dtype="float32", seed=3, std=0.05)
        _FOLDERS[which] = folder
    return _FOLDERS[which]


def _blocked_matrices(params) -> set[str]:
    """Names of the serving tree's matrices held as ``ColumnBlocks``."""
    found = set()
    for lp in params["layers"]:
        for group in ("attn", "mlp"):
            found |= {k for k, v in lp.get(group, {}).items() if isinstance(getattr(v, "w", None), layout.ColumnBlocks)}
        moe = lp.get("moe", {})
        if isinstance(moe.get("shared"), dict):
            found |= {f"shared {k}" for k, v in moe["shared"].items()
                      if isinstance(getattr(v, "w", None), layout.ColumnBlocks)}
        experts = moe.get("experts")
        if isinstance(experts, layout.ExpertList):
            found |= {k for k in ("gate_up", "down") if all(isinstance(m, layout.ColumnBlocks) for m in getattr(experts, k))}
    if isinstance(getattr(params.get("lm_head"), "w", None), layout.ColumnBlocks):
        found.add("lm_head")
    return found


def _expected_blocks(which) -> set[str]:
    if which == "hidden":
        return {"q", "k", "v", "gate_up", "lm_head"}
    return {"down", "shared down"}


@pytest.mark.parametrize("which", sorted(WIDE))
def test_wide_models_compute_what_their_canonical_layout_computes(which, tmp_path_factory):
    folder = _wide_folder(which, tmp_path_factory)
    mj = moejax.load(folder)
    serving, cfg = mj.params, mj.cfg
    assert _blocked_matrices(serving) == _expected_blocks(which)
    # sums over 4,160 in column blocks round otherwise than one sum: measured against transformers in float64, the
    # serving layout is 2.3e-5 off and the canonical one 4.6e-5 (5.6e-5 apart), once random checkpoints' q/k norms
    # are 1 (drawn at random they make attention nearly uniform and hide it)
    canonical = assert_serving_equals_canonical(serving, cfg, new_tokens=10, tol=1e-4)
    assert checkpoint.params_fingerprint(serving) == checkpoint.params_fingerprint(canonical)
    saved = [checkpoint.save_moejax(p, cfg, str(tmp_path_factory.mktemp("save") / name))
             for name, p in (("serving", serving), ("canonical", canonical))]
    assert open(f"{saved[0]}/params.safetensors", "rb").read() == open(f"{saved[1]}/params.safetensors", "rb").read()


def _has_blocked_slots(pager) -> bool:
    """Every slot of every layer still holds column blocks where the layout has them (a page written whole
    would compute the same, and make the decode step's program a new one)."""
    layers = [pager.slots] if pager.global_scope else pager.slots
    return all(isinstance(m, layout.ColumnBlocks) for slots in layers
               for m in (slots.gate_up if slots.gate_up[0].shape[1] > LIMIT else slots.down))


@pytest.mark.parametrize("which,paging", [("hidden", "jit"), ("experts", "host")])
def test_wide_models_offload_from_memory_generates_the_simulation_tokens(which, paging, tmp_path_factory):
    """Offload from a model loaded whole (the host store reads the blocked experts back whole): in-jit paging
    into its stacked slots, host paging into blocked slots (pages cut by the program that writes them; pages
    from the files: the page-writes test below)."""
    mj = moejax.load(_wide_folder(which, tmp_path_factory))
    cc = CacheConfig(size="2")
    prompt = np.array([5, 17, 33, 8, 61], np.int32)
    ref = mj.generate(prompt, 5, routing="cache-prior", cache=cc, stop_at_eos=False)
    off = mj.generate(prompt, 5, routing="cache-prior", cache=cc, stop_at_eos=False,
                      offload=offload.OffloadConfig(paging=paging), keep_slots=True)
    assert off.token_ids == ref.token_ids
    if paging == "host":
        assert _has_blocked_slots(mj._stores[host_paging.KEPT_PAGER])


def test_wide_int8_model_blocks_its_int8_matrices(tmp_path_factory):
    """int8 weights (``weight_dtype="int8"``) are blocked too: a teacher-forced pass equals the unblocked
    int8 tree's exactly (int32 partial sums); a decode step equals the dequantised weights' in float32."""
    folder = _wide_folder("hidden", tmp_path_factory)
    m8 = moejax.load(folder, weight_dtype="int8")
    cfg = m8.cfg
    assert any(layout.is_int8(leaf) for leaf in jax.tree.leaves(
        m8.params, is_leaf=lambda x: isinstance(x, layout.ColumnBlocks)) if isinstance(leaf, layout.ColumnBlocks))
    whole = jax.tree.map(lambda x: _unblocked(x) if isinstance(x, layout.ColumnBlocks) else x, m8.params,
                         is_leaf=lambda x: isinstance(x, layout.ColumnBlocks))
    ids = jnp.asarray(np.random.default_rng(2).integers(3, cfg.vocab_size, size=9), jnp.int32)
    fwd = jax.jit(lambda p, t: M.forward(p, cfg, t).logits)
    np.testing.assert_array_equal(np.asarray(fwd(m8.params, ids)), np.asarray(fwd(whole, ids)))
    # one row: every product in float32 with the dequantised weights (no activation rounding)
    is_matrix = lambda x: isinstance(x, (layout.ColumnBlocks, quant.QuantizedTensor))  # noqa: E731
    dequantised = jax.tree.map(lambda x: layout.dense(x) if is_matrix(x) else x, m8.params, is_leaf=is_matrix)

    def steps(p):  # token by token: every product has one row
        kv, logits = attention_lib.init_kv(cfg, 32), []
        for t in range(6):
            out = M.forward(p, cfg, ids[t:t + 1], t, kv)
            kv, logits = out.kv, logits + [out.logits]
        return jnp.concatenate(logits)

    want = np.asarray(jax.jit(steps)(dequantised))
    np.testing.assert_allclose(np.asarray(jax.jit(steps)(m8.params)), want, atol=1e-4 * np.abs(want).max(), rtol=0)


def _unblocked(w: layout.ColumnBlocks):
    if layout.is_int8(w):
        return w.blocks[0].replace(q=jnp.concatenate([b.q for b in w.blocks], axis=1))
    return layout.dense(w)


def test_wide_bf16_decode_copies_no_weight_matrix(tmp_path_factory):
    """The decode step of a blocked bf16 model reads every block in place: no array of any weight matrix's
    shape (whole or a block) is written outside a fusion."""
    mj = moejax.load(_wide_folder("hidden", tmp_path_factory), dtype="bfloat16")
    program = _decode_program(mj.params, mj.cfg)
    blocks = [layout.dense(b) for w in jax.tree.leaves(mj.params, is_leaf=lambda x: isinstance(x, layout.ColumnBlocks))
              if isinstance(w, layout.ColumnBlocks) for b in w.blocks]
    assert blocks and not materialised_matrices(program, {"params": layout.to_canonical(mj.params), "b": blocks})


@pytest.mark.parametrize("which", sorted(WIDE))
def test_wide_models_page_into_blocked_slots_in_place_as_by_copy(which, tmp_path_factory):
    """Pages from the files into column-blocked slots: read into the slots' own memory (cut into the blocks on
    the host) equals device_put + a program that cuts them, and both give the tokens of the model in memory."""
    folder = _wide_folder(which, tmp_path_factory)
    cache = CacheConfig(size="2", prefetch=1.0)
    prompt = np.arange(3, 20, dtype=np.int32)
    copied, in_place = (page_writes._generate(folder, pw, cache, prompt=prompt, new=5) for pw in ("copy", "auto"))
    assert in_place[1].in_place and _has_blocked_slots(in_place[1]) and _has_blocked_slots(copied[1])
    page_writes._assert_same(copied, in_place)
    ref = moejax.load(folder).generate(prompt, 5, routing="cache-prior", cache=cache, stop_at_eos=False)
    assert ref.token_ids == in_place[0].token_ids


def test_wide_int8_slots_equal_the_int8_model_in_memory(tmp_path_factory):
    """int8 slots in column blocks: pages of a float folder quantised as they arrive (on the host, then cut into
    the blocks, when written in place; by a program on the copy path: the same bits) and pages of an int8 folder
    read in place give the tokens of the same model loaded whole with int8 experts."""
    folder = _wide_folder("hidden", tmp_path_factory)
    cache = CacheConfig(size="2")
    prompt = np.arange(3, 20, dtype=np.int32)
    ref = moejax.load(folder, expert_dtype="int8").generate(prompt, 5, routing="cache-prior", cache=cache,
                                                            stop_at_eos=False)
    m = moejax.load(folder, offload=offload.OffloadConfig(store="flash", slot_dtype="int8"))
    assert m.generate(prompt, 5, routing="cache-prior", cache=cache, stop_at_eos=False).token_ids == ref.token_ids
    copied, in_place = (page_writes._generate(folder, pw, cache, prompt=prompt, new=5, expert_dtype="int8")
                        for pw in ("copy", "auto"))
    assert in_place[1].in_place and _has_blocked_slots(in_place[1]) and layout.is_int8(in_place[1].slots[0].down[0])
    page_writes._assert_same(copied, in_place)
    assert in_place[0].token_ids == ref.token_ids
    dst = str(tmp_path_factory.mktemp("int8") / "mj")
    checkpoint.convert_to_moejax(folder, dst, expert_dtype="int8")
    copied, in_place = (page_writes._generate(dst, pw, cache, prompt=prompt, new=5) for pw in ("copy", "auto"))
    assert in_place[1].in_place and _has_blocked_slots(in_place[1])
    assert layout.is_int8(in_place[1].slots[0].gate_up[0])
    page_writes._assert_same(copied, in_place)
    assert in_place[0].token_ids == ref.token_ids


def test_the_memory_plan_counts_the_page_buffer_of_blocked_slots(monkeypatch, tmp_path_factory):
    """Pages read in place into blocked slots pass through one page buffer the store keeps: a flash-store plan
    for a wide model counts it in ``fixed`` (one slot's bytes); a narrow model's plan has none, unless its int8
    slots take the pages of a 16-bit folder (quantised on the host from that buffer)."""
    from test_cache_memory import _on_host

    _on_host(monkeypatch)
    wide = moejax.load(_wide_folder("hidden", tmp_path_factory), offload="flash")
    plan = wide.memory_plan(CacheConfig(), None, 64)
    assert plan["page_scratch"] == wide.cached_expert_bytes() > 0
    assert plan["fixed"] == plan["kv_cache"] + plan["staging"] + plan["page_scratch"] + plan["reserve"]
    narrow = moejax.load(get_hf_model("qwen3_moe").folder, offload="flash")
    assert narrow.memory_plan(CacheConfig(), None, 64)["page_scratch"] == 0
    # int8 slots of a float folder: every page passes through the buffer, in the stored dtype
    int8_slots = moejax.load(get_hf_model("qwen3_moe").folder, offload="flash", expert_dtype="int8")
    float_slot = narrow.cached_expert_bytes()
    assert int8_slots.cached_expert_bytes() < float_slot
    assert int8_slots.memory_plan(CacheConfig(), None, 64)["page_scratch"] == float_slot
