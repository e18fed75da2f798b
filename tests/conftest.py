"""Shared fixtures: tiny random Hugging Face MoE models built from a config, saved with ``save_pretrained``.

``hf_model(name)`` builds the model described by ``HF_CONFIGS[name]`` once per session, with
``torch.manual_seed`` fixed and the router (gate) weights scaled by ``ROUTER_SCALE`` so routing is decisive
(random-init routers give near-uniform logits, and near ties would hide or fake differences). It returns
the saved folder and the (eval-mode, float32) torch model.

Every config is tiny (hidden 32, 2-3 layers, vocab <= 128, 8-16 experts) so building all of them takes a
few seconds; the parity and conversion tests share them.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import copy
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no test reaches the Hugging Face hub or the user's hub cache: a hub id resolves offline, from a cache of the
# run's own (tests/test_hub.py serves the hub's answers from local files itself)
os.environ["HF_HUB_OFFLINE"] = "1"


def _run_folder() -> str:
    """The run's own temporary folder. The controlling process makes ``moejax-tests-*`` and removes it when it
    exits; xdist workers and CLI subprocesses inherit it (``MOEJAX_TESTS_TMP``) and put theirs inside, so a
    worker that dies without its clean-ups (xdist ends workers abruptly on an interrupt) leaves nothing."""
    outer = os.environ.get("MOEJAX_TESTS_TMP")
    if os.environ.get("PYTEST_XDIST_WORKER") and outer and os.path.isdir(outer):
        return tempfile.mkdtemp(prefix=f"{os.environ['PYTEST_XDIST_WORKER']}-", dir=outer)
    folder = tempfile.mkdtemp(prefix="moejax-tests-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ["MOEJAX_TESTS_TMP"] = folder
    return folder


_RUN_FOLDER = _run_folder()
os.environ["HF_HUB_CACHE"] = os.path.join(_RUN_FOLDER, "hub-cache")
os.makedirs(os.environ["HF_HUB_CACHE"])


def _stop_on_sigterm(signum, frame) -> None:
    """A run stopped by SIGTERM (``timeout``, a cancelled CI job) stops as Ctrl-C does: pytest tears down and
    the ``atexit`` clean-up above runs, instead of the process dying with its temporary folder left behind."""
    raise KeyboardInterrupt(f"stopped by signal {signum}")


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _stop_on_sigterm)


def _share_compiled_programs() -> None:
    """One JAX persistent compilation cache for the whole test run: the xdist workers and every CLI
    subprocess inherit it, so a program that several tests compile (the default model's prefill and decode
    steps above all) is compiled once. Made by the controlling process inside the run's folder; a
    ``JAX_COMPILATION_CACHE_DIR`` set by the caller is used as it is."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_RUN_FOLDER, "jax-cache")
    os.makedirs(os.environ["JAX_COMPILATION_CACHE_DIR"])
    # programs that compile in under 0.3 s are not written (a write serialises and compresses the executable,
    # ~10 ms: 643 of them were 3 % of test_offload.py's time); the prefill and decode programs worth sharing are
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")


_share_compiled_programs()

# "default" in the tests (and in every CLI subprocess they start) is a cut of the embedded model's CPU-trained
# predecessor (``tests/data/cpu-default-model``: 4 layers, 32 experts top-4, 28 MB): its first and last layers and
# the first 16 experts of each (``cut_model``, 10 MB, made once per run by the controlling process). The shipped
# default (8 layers, 64 experts top-8) made the suite twice as long, and the predecessor's decode program held 128
# expert branches (4.6 s to compile at level 0, 1.4 s for the cut's 32); tests/test_default_model.py checks the
# shipped one itself, and the predecessor stays as it is for the figures measured on it.
CPU_DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu-default-model")
WIKITEXT2_TEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "wikitext-2-raw-v1", "test.txt")
CUT_LAYERS, CUT_EXPERTS = (0, 3), 16


def cut_model(src: str, dst: str, layers=CUT_LAYERS, n_experts: int = CUT_EXPERTS) -> str:
    """A moejax folder of ``src``'s ``layers`` (renumbered from 0) with the first ``n_experts`` routed experts of
    each (the router's columns cut to match): the stored tensors sliced as they are (``safetensors_io``), no
    model loaded, so the controlling process makes it before its workers start."""
    import json

    from moejax.models import safetensors_io

    stored = safetensors_io.SafetensorsFile(os.path.join(src, "params.safetensors"))

    def cut(key: str):
        parts, x = key.split("."), stored.get(key)
        if parts[0] == "layers":
            if int(parts[1]) not in layers:
                return None
            parts[1] = str(layers.index(int(parts[1])))
            if parts[2] == "moe":
                x = x[:, :n_experts] if parts[3] == "router" else x[:n_experts]
        return ".".join(parts), x

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("params.safetensors", "moejax.json"))
    safetensors_io.write(os.path.join(dst, "params.safetensors"), filter(None, map(cut, stored.keys())),
                         stored.metadata)
    with open(os.path.join(src, "moejax.json")) as f:
        meta = json.load(f)
    meta["hf_config"].update(num_hidden_layers=len(layers), num_experts=n_experts)
    with open(os.path.join(dst, "moejax.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return dst


def _test_default_model() -> str:
    """The cut (``cut_model``), made by the controlling process in the run's folder; workers and CLI subprocesses
    inherit ``MOEJAX_DEFAULT_MODEL``."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(os.environ.get("MOEJAX_DEFAULT_MODEL", "")):
        return os.environ["MOEJAX_DEFAULT_MODEL"]
    return cut_model(CPU_DEFAULT_MODEL, os.path.join(_RUN_FOLDER, "test-default-model"))


os.environ["MOEJAX_DEFAULT_MODEL"] = _test_default_model()


#: XLA:CPU's older loop emitters, which the suite compiles with (``_compile_quickly``)
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _compile_quickly() -> None:
    """Compile the tests' programs with XLA's LLVM backend at optimisation level 0 (a third less time for the
    suite, almost all of it compilation of tiny models) and XLA:CPU's older loop emitters instead of its fusion
    emitters (``--xla_cpu_use_fusion_emitters=false``: a quarter less on a compile-bound test, 25.0 -> 18.8 s),
    unless the caller's ``XLA_FLAGS`` choose a level. The tests check logic and path-to-path equality, which do
    not depend on either; the ``numerics`` tests run as users compile (XLA's defaults, level 3), in the first
    pass of ``.ci/run``, which names that level. XLA aborts on a flag it does not know, so the emitter flag is
    tried once in a child process first (a JAX without it keeps the default emitters)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags:
        return
    flags = f"{flags} --xla_backend_optimization_level=0".strip()
    emitters = f"{flags} {OLDER_EMITTERS}"
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"],
                           env={**os.environ, "XLA_FLAGS": emitters, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, timeout=120)
    os.environ["XLA_FLAGS"] = emitters if probe.returncode == 0 else flags


_compile_quickly()


def with_fusion_emitters(env: dict) -> dict:
    """``env`` without the suite's ``OLDER_EMITTERS``: XLA:CPU's default (fusion) emitters. The older ones compile the
    tiny models' many small programs faster, but a large program slower: the shipped model's decode program (8 layers
    x 64 expert branches) 13.3 against 10.4 s at level 0 (``test_generate_with_no_arguments``'s child, AMD EPYC,
    2 cores)."""
    return {**env, "XLA_FLAGS": " ".join(env.get("XLA_FLAGS", "").replace(OLDER_EMITTERS, "").split())}


def _float32_matmuls_on_gpus() -> None:
    """Where an NVIDIA GPU is visible, float32 matrix products default to TF32 (a 10-bit mantissa): the
    teacher-forced offload pass, token by token, then differed from the simulation's batched pass by 8e-4 in
    the logits on an H200 (tolerance 2e-5), with the same experts and hits. The tests compare float32 paths
    at float32 tolerances, so there they run at full float32 (``highest``), as on a CPU; a caller's
    ``JAX_DEFAULT_MATMUL_PRECISION`` is kept. No effect on CPU-only machines (CI)."""
    if os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
        # Run to run and compile to compile, the same numbers: the suite on an H200 saw one program
        # give logits 1 ulp apart for inputs that differ only where nothing reads them (atomics in XLA:GPU
        # reductions), and two loads of one model disagree by 1 ulp (kernels autotuned per compile); the
        # tests that compare such runs bit for bit hold on the CPU, where both are deterministic.
        flags = os.environ.get("XLA_FLAGS", "")
        for flag in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0"):
            if flag.split("=")[0] not in flags:
                flags = f"{flags} {flag}".strip()
        os.environ["XLA_FLAGS"] = flags


_float32_matmuls_on_gpus()

ROUTER_SCALE = 12.0
VOCAB = 96

_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.05,
)


def _cfg(**kw) -> dict[str, Any]:
    out = dict(_BASE)
    out.update(kw)
    return out


def _deepseek(**kw) -> dict[str, Any]:
    base = dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                routed_scaling_factor=1.0, topk_method="greedy", norm_topk_prob=False)
    base.update(kw)
    return _cfg(**base)


def _deepseek_v3(**kw) -> dict[str, Any]:
    base = dict(num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
                kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                n_group=4, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True)
    base.update(kw)
    return _cfg(**base)


_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                 short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.0, 4.0, 8.0],
                 short_mscale=1.15, long_mscale=1.4)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
             original_max_position_embeddings=64, beta_fast=32, beta_slow=1)


_GRANITE = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125, logits_scaling=6.0)


@dataclasses.dataclass(frozen=True)
class HFSpec:
    model_type: str
    config: dict[str, Any]
    # DeepSeek moe_layer_freq: HF 5.x ignores it, so the dense layers are swapped in by hand before saving
    dense_layers: tuple[int, ...] = ()
    note: str = ""
    router_scale: float = ROUTER_SCALE


HF_CONFIGS: dict[str, HFSpec] = {
    # ---------------------------------------------------------------- Mixtral
    "mixtral": HFSpec("mixtral", _cfg(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "mixtral_swa": HFSpec("mixtral", _cfg(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2,
                                          sliding_window=4, num_hidden_layers=3, tie_word_embeddings=True,
                                          initializer_range=0.15),
                          note="sliding window 4, tied embeddings", router_scale=4.0),
    # ---------------------------------------------------------------- Phi-3.5-MoE
    "phimoe": HFSpec("phimoe", _cfg(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "phimoe_longrope": HFSpec("phimoe", _cfg(intermediate_size=48, num_local_experts=16, num_experts_per_tok=2,
                                             attention_bias=True, lm_head_bias=True, max_position_embeddings=64,
                                             rope_parameters=_LONGROPE),
                              note="attention/lm_head bias, longrope (short/long mscale switch at 16)"),
    # ---------------------------------------------------------------- Qwen1.5-MoE
    "qwen2_moe": HFSpec("qwen2_moe", _cfg(intermediate_size=48, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=24, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=False)),
    "qwen2_moe_sparse_step": HFSpec("qwen2_moe", _cfg(num_hidden_layers=3, intermediate_size=48,
                                                      moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                      num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                                                      decoder_sparse_step=2, mlp_only_layers=[]),
                                    note="norm_topk_prob, decoder_sparse_step=2"),
    "qwen2_moe_mlp_only": HFSpec("qwen2_moe", _cfg(num_hidden_layers=3, intermediate_size=48,
                                                   moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                                   num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                                   mlp_only_layers=[1]),
                                 note="mlp_only_layers=[1]"),
    "qwen2_moe_swa": HFSpec("qwen2_moe", _cfg(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=24, num_experts=8,
                                              num_experts_per_tok=2, use_sliding_window=True, sliding_window=4,
                                              max_window_layers=2),
                            note="sliding window 4 on layer 0 only (odd layers below max_window_layers)"),
    # ---------------------------------------------------------------- Qwen3-MoE
    "qwen3_moe": HFSpec("qwen3_moe", _cfg(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)),
    "qwen3_moe_mlp_only": HFSpec("qwen3_moe", _cfg(num_hidden_layers=3, intermediate_size=48,
                                                   moe_intermediate_size=16, num_experts=16,
                                                   num_experts_per_tok=4, norm_topk_prob=False,
                                                   mlp_only_layers=[0], tie_word_embeddings=True,
                                                   initializer_range=0.15),
                                 router_scale=4.0,
                                 note="norm_topk_prob False, mlp_only_layers=[0], tied embeddings"),
    "qwen3_moe_swa": HFSpec("qwen3_moe", _cfg(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                                              num_experts_per_tok=2, head_dim=8, use_sliding_window=True,
                                              sliding_window=5),
                            note="sliding window 5 on every layer"),
    # ---------------------------------------------------------------- OLMoE
    "olmoe": HFSpec("olmoe", _cfg(intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                  norm_topk_prob=False)),
    "olmoe_clip": HFSpec("olmoe", _cfg(intermediate_size=16, num_experts=16, num_experts_per_tok=4,
                                       norm_topk_prob=True, clip_qkv=0.3, initializer_range=0.2),
                         note="clip_qkv=0.3 (clips), norm_topk_prob", router_scale=3.0),
    # ---------------------------------------------------------------- DeepSeek-V2
    "deepseek_v2": HFSpec("deepseek_v2", _deepseek()),
    "deepseek_v2_lite": HFSpec("deepseek_v2", _deepseek(routed_scaling_factor=2.5, n_shared_experts=2,
                                                        rope_parameters=_YARN, max_position_embeddings=256),
                               note="q_lora_rank None, yarn, routed_scaling_factor 2.5, 2 shared"),
    "deepseek_v2_group": HFSpec("deepseek_v2", _deepseek(q_lora_rank=24, n_routed_experts=16,
                                                         num_experts_per_tok=3, topk_method="group_limited_greedy",
                                                         n_group=4, topk_group=2, routed_scaling_factor=1.5,
                                                         rope_parameters=_YARN, max_position_embeddings=256),
                                note="q_lora_rank 24, group_limited_greedy 4 groups / top 2, yarn"),
    "deepseek_v2_bias": HFSpec("deepseek_v2", _deepseek(q_lora_rank=16, attention_bias=True, mlp_bias=True),
                               note="attention_bias (q_a, kv_a, o) and mlp_bias (dense and shared experts)"),
    "deepseek_v2_freq2": HFSpec("deepseek_v2", _deepseek(first_k_dense_replace=0, moe_layer_freq=2,
                                                         q_lora_rank=24),
                                dense_layers=(1,), note="moe_layer_freq=2 (layer 1 dense, swapped in by hand)"),
    "deepseek_v2_norm": HFSpec("deepseek_v2", _deepseek(norm_topk_prob=True, routed_scaling_factor=3.0,
                                                        num_experts_per_tok=3),
                               note="norm_topk_prob (HF 5.x ignores it: not comparable to HF as saved)"),
    # ---------------------------------------------------------------- DeepSeek-V3 (selection biases set at random)
    "deepseek_v3": HFSpec("deepseek_v3", _deepseek_v3(),
                          note="noaux_tc: sigmoid + selection bias, 4 groups / top 2, interleaved rope"),
    "deepseek_v3_flat": HFSpec("deepseek_v3", _deepseek_v3(q_lora_rank=24, n_routed_experts=16, num_experts_per_tok=4,
                                                           n_group=1, topk_group=1, norm_topk_prob=False,
                                                           routed_scaling_factor=2.5, rope_interleave=False,
                                                           rope_parameters=_YARN, max_position_embeddings=256),
                               note="one group, top-4 of 16 unnormalised x 2.5, q_lora_rank 24, rotate-half yarn"),
    # ---------------------------------------------------------------- GLM-4.5 (V3's routing, GQA, partial rotary)
    "glm4_moe": HFSpec("glm4_moe", _cfg(num_hidden_layers=3, head_dim=16, intermediate_size=48, moe_intermediate_size=16,
                                        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                                        norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                        partial_rotary_factor=0.5),
                       note="qk norm, qkv bias, half the head rotated, 2 groups / top 1, selection biases"),
    "glm4_moe_full": HFSpec("glm4_moe", _cfg(intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16,
                                             num_experts_per_tok=4, n_shared_experts=0, first_k_dense_replace=0,
                                             norm_topk_prob=False, partial_rotary_factor=1.0, tie_word_embeddings=True,
                                             initializer_range=0.15),
                            note="every layer MoE, no shared expert, whole head rotated, unnormalised, tied",
                            router_scale=4.0),
    # ---------------------------------------------------------------- Granite MoE (multipliers unlike 1 and 1/sqrt(d))
    # tied: with Granite's own ×12 embeddings a tiny random model's tied head repeats the last token (greedy tests
    # need varied continuations), so this one multiplies by 0.5 and 2 instead
    "granitemoe": HFSpec("granitemoe", _cfg(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                                            **{**_GRANITE, "embedding_multiplier": 0.5, "residual_multiplier": 2.0},
                                            tie_word_embeddings=True, initializer_range=0.2),
                         note="embedding/residual/attention multipliers, logits_scaling, tied embeddings",
                         router_scale=3.0),
    "granitemoe_bias": HFSpec("granitemoe", _cfg(num_hidden_layers=3, intermediate_size=16, num_local_experts=16,
                                                 num_experts_per_tok=4, attention_bias=True, **_GRANITE),
                              note="attention_bias, top-4 of 16"),
    "granitemoeshared": HFSpec("granitemoeshared", _cfg(intermediate_size=16, num_local_experts=8,
                                                        num_experts_per_tok=2, shared_intermediate_size=24,
                                                        **_GRANITE),
                               note="shared MLP (fused input_linear)"),
    "granitemoeshared_none": HFSpec("granitemoeshared", _cfg(intermediate_size=16, num_local_experts=8,
                                                             num_experts_per_tok=3, shared_intermediate_size=0,
                                                             **_GRANITE),
                                    note="shared_intermediate_size 0 (no shared MLP), top-3"),
    # ---------------------------------------------------------------- dots.llm1 (V3's routing, Qwen3's attention)
    "dots1": HFSpec("dots1", _cfg(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                  topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True),
                    note="per-head qk norm, attention bias, first layer dense, 2 groups / top 1, selection biases"),
    "dots1_swa": HFSpec("dots1", _cfg(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                      n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=2,
                                      first_k_dense_replace=0, sliding_window=4, max_window_layers=1),
                        note="sliding window 4 from layer 1 (max_window_layers), every layer MoE, 2 shared, "
                             "unnormalised (dots1's default)"),
    # ---------------------------------------------------------------- Hunyuan-A13B (q/k norm after rope, NTK-alpha rope)
    "hunyuan_v1_moe": HFSpec("hunyuan_v1_moe", _cfg(head_dim=8, intermediate_size=16, num_experts=8, moe_topk=2, attention_bias=True,
                                                    rope_parameters=dict(rope_type="dynamic", alpha=1000.0, factor=1.0,
                                                                         rope_theta=10000.0)),
                             note="NTK-alpha rope (alpha 1000), q/k norm after rope, attention bias, shared MLP"),
    "hunyuan_v1_moe_lists": HFSpec("hunyuan_v1_moe", _cfg(num_hidden_layers=3, head_dim=8, intermediate_size=16,
                                                          num_experts=16, moe_topk=[3, 3, 3], tie_word_embeddings=True,
                                                          initializer_range=0.15),
                                   note="moe_topk as a per-layer list (top-3 of 16), default rope, tied"),
    # ---------------------------------------------------------------- ERNIE-4.5 (softmax + selection biases on probs)
    "ernie4_5_moe": HFSpec("ernie4_5_moe", _cfg(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16,
                                                moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                                                moe_layer_start_index=1, use_bias=True, tie_word_embeddings=False),
                           note="first layer dense, a shared expert, biases everywhere (lm_head too)"),
    "ernie4_5_moe_interval": HFSpec("ernie4_5_moe", _cfg(num_hidden_layers=4, intermediate_size=48,
                                                         moe_intermediate_size=16, moe_num_experts=16, moe_k=3,
                                                         moe_num_shared_experts=0, moe_layer_start_index=0,
                                                         moe_layer_end_index=2, moe_layer_interval=2,
                                                         moe_norm_min=0.6, initializer_range=0.15),
                                    note="MoE every 2nd layer up to layer 2, no shared expert, top-3 of 16 with "
                                         "norm_min 0.6 (clamps most sums), tied (ERNIE's default), no biases",
                                    router_scale=1.0),
    # ---------------------------------------------------------------- GPT-OSS (sinks, biased experts, clamped SwiGLU)
    "gpt_oss": HFSpec("gpt_oss", _cfg(num_hidden_layers=3, head_dim=8, intermediate_size=16, num_local_experts=8,
                                      num_experts_per_tok=2, sliding_window=4, initializer_range=0.15,
                                      swiglu_limit=0.2),
                      note="attention sinks, sliding window 4 on even layers, yarn rope (the default), router "
                           "and expert biases, SwiGLU clamped at 0.2 (clamps often)", router_scale=1.0),
    "gpt_oss_plain": HFSpec("gpt_oss", _cfg(head_dim=8, intermediate_size=24, num_local_experts=16,
                                            num_experts_per_tok=4, sliding_window=64, layer_types=[
                                                "full_attention", "full_attention"], attention_bias=False,
                                            tie_word_embeddings=True, swiglu_alpha=1.0, initializer_range=0.15,
                                            rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
                            note="no attention bias, full attention, default rope, top-4 of 16, tied, alpha 1"),
}

FAMILIES = ("mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
            "dots1", "granitemoe", "granitemoeshared", "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss")


def _config_class(model_type: str):
    import transformers

    return {
        "mixtral": transformers.MixtralConfig, "phimoe": transformers.PhimoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
        "olmoe": transformers.OlmoeConfig, "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config, "glm4_moe": transformers.Glm4MoeConfig,
        "dots1": transformers.Dots1Config,
        "granitemoe": transformers.GraniteMoeConfig, "granitemoeshared": transformers.GraniteMoeSharedConfig,
        "ernie4_5_moe": transformers.Ernie4_5_MoeConfig, "hunyuan_v1_moe": transformers.HunYuanMoEV1Config,
        "gpt_oss": transformers.GptOssConfig,
    }[model_type]


def router_modules(model) -> list:
    """The routers (gates) of a HF MoE model, in layer order (Hunyuan's is a ``...Gate`` holding ``wg``)."""
    return [m for _, m in model.named_modules() if type(m).__name__.lower().endswith(("topkrouter", "moev1gate"))]


def build_hf_model(spec: HFSpec, seed: int = 0, router_scale: float | None = None):
    """A tiny random HF model for ``spec`` (float32, eval mode, eager attention), routers scaled."""
    import torch
    import transformers

    config = _config_class(spec.model_type)(**copy.deepcopy(spec.config))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    if spec.dense_layers:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

        for i in spec.dense_layers:
            model.model.layers[i].mlp = DeepseekV2MLP(config)
            for p in model.model.layers[i].mlp.parameters():
                torch.nn.init.normal_(p, std=config.initializer_range)
    with torch.no_grad():
        routers = router_modules(model)
        assert routers, f"no router modules found in {type(model).__name__}"
        for r in routers:
            getattr(r, "wg", r).weight.mul_(spec.router_scale if router_scale is None else router_scale)
            if hasattr(r, "e_score_correction_bias"):  # a buffer, zero at init: a bias that changes choices
                r.e_score_correction_bias.copy_(0.3 * torch.randn_like(r.e_score_correction_bias))
            if hasattr(r, "moe_statics"):  # ERNIE-4.5's, added to probabilities (1/N on average)
                bias = r.moe_statics.e_score_correction_bias
                bias.copy_(0.5 / r.num_experts * torch.randn_like(bias))
        # random init leaves some weights (norms, biases) at trivial values: perturb them so a mapping that
        # swaps or drops them cannot pass
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith((".bias", "_proj_bias")):  # GPT-OSS's expert biases are "..._proj_bias"
                p.add_(0.05 * torch.randn_like(p))
            elif name.endswith(".sinks"):  # GPT-OSS's, N(0, 0.02²) at init: large enough to take a share
                p.add_(torch.randn_like(p))
    model.eval()
    return model


@dataclasses.dataclass
class HFModel:
    name: str
    spec: HFSpec
    folder: str
    model: Any  # the torch model

    @property
    def model_type(self) -> str:
        return self.spec.model_type


# Module-level caches (not only fixtures) so that unittest-style chex.TestCase classes can share them.
_ROOT: list[str] = []
_HF: dict[str, HFModel] = {}
_MOEJAX: dict[str, Any] = {}


def _root() -> str:
    if not _ROOT:
        _ROOT.append(tempfile.mkdtemp(prefix="models-", dir=_RUN_FOLDER))
    return _ROOT[0]


def get_hf_model(name: str) -> HFModel:
    """The HF model ``name`` of ``HF_CONFIGS``, built and saved with ``save_pretrained`` once per session."""
    if name not in _HF:
        spec = HF_CONFIGS[name]
        model = build_hf_model(spec)
        folder = os.path.join(_root(), name)
        model.save_pretrained(folder)
        _HF[name] = HFModel(name, spec, folder, model)
    return _HF[name]


def get_moejax_model(name: str):
    """``moejax.load`` of the saved HF folder ``name`` (float32), once per session."""
    if name not in _MOEJAX:
        import moejax

        _MOEJAX[name] = moejax.load(get_hf_model(name).folder)
    return _MOEJAX[name]


@contextlib.contextmanager
def compile_events():
    """A list that receives the function name of every XLA backend compilation inside the block (JAX's
    ``/jax/core/compile/backend_compile_duration`` events): what a test of "compiles nothing" counts, rather than
    timing it."""
    import jax.monitoring

    names = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop XLA executables after each test module. One pytest process compiles hundreds of programs;
    keeping them all alive has crashed XLA:CPU's compiler (a segfault late in the run)."""
    yield
    import gc

    import jax

    from moejax.runtime import decode

    decode.clear_programs()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def hf_model() -> Callable[[str], HFModel]:
    """``hf_model(name)`` -> HFModel (folder + torch model), built and saved once per session."""
    return get_hf_model


@pytest.fixture(scope="session")
def moejax_model() -> Callable[[str], Any]:
    """``moejax_model(name)`` -> ``moejax.Model`` loaded from the saved HF folder, once per session."""
    return get_moejax_model


# ------------------------------------------------------------------- command lines in process
@dataclasses.dataclass
class Ran:
    """What a command line gave, as ``subprocess.run`` reports it (``returncode``, ``stdout``, ``stderr``)."""
    returncode: int
    stdout: str
    stderr: str


def run_main(main: Callable[[list[str]], int], capsys, *argv) -> Ran:
    """``main(argv)`` in this process, its exit status (argparse's ``SystemExit`` included) and what it printed.
    A CLI test runs ``python -m`` in a child process once per command, to check the entry point itself; the
    rest of its calls run here, where the programs the worker compiled already are reused (a child process
    imports JAX and compiles every program again: 2-4 s a call, 12 calls in ``test_trace``'s CLI test)."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return Ran(int(rc or 0), out.out, out.err)


# ------------------------------------------------------------------- order of the files (CI's scheduling)
#: Seconds each test file's slow tests took in CI's two passes together (CI's machine: AMD EPYC, 2 cores,
#: ``--durations``: tests of 2 s or more in the main pass, 1 s or more in the numerics pass), for the order below;
#: ``QUICK_TEST_SECONDS`` for each of its tests stands for the many quick ones. Refresh when a file's share
#: changes a lot.
FILE_SECONDS = {
    "test_hf_parity.py": 210, "test_offload.py": 171, "test_layout.py": 167, "test_simulate.py": 129,
    "test_generate.py": 95, "test_serve.py": 84, "test_column_blocks.py": 76, "test_prior.py": 67,
    "test_overlap.py": 67, "test_train.py": 64, "test_sampling.py": 63, "test_scale.py": 55,
    "test_default_model.py": 55, "test_distributed.py": 47, "test_int8.py": 45, "test_routing.py": 44,
    "test_attention.py": 41, "test_studies.py": 37, "test_tasks.py": 35, "test_hub.py": 30, "test_sweep.py": 24,
    "test_trace.py": 23, "test_compile_cache.py": 22, "test_full_disk.py": 21, "test_evaluate.py": 20,
    "test_convert.py": 20, "test_cache.py": 18, "test_cache_memory.py": 16, "test_plots.py": 15,
    "test_prefill_paging.py": 15, "test_quant.py": 14, "test_page_writes.py": 14, "test_dispatch.py": 13,
    "test_random_checkpoint.py": 12, "test_serve_access.py": 95, "test_signals.py": 45, "test_output_paths.py": 20,
    "test_safetensors_headers.py": 10, "test_templates.py": 5,
}


QUICK_TEST_SECONDS = 0.35


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (``FILE_SECONDS`` + ``QUICK_TEST_SECONDS`` a test), each file's tests in their own
    order. ``.ci/run`` gives the two xdist workers whole files (``--dist loadfile --no-loadscope-reorder``): a
    file's models, servers and compiled programs are then made by one worker instead of both (the main pass's CPU
    time: 1,900 s against 2,160 s), and handing out the long files first keeps the run from ending with one worker
    on a long file while the other waits."""
    tests = collections.Counter(item.path.name for item in items)
    items.sort(key=lambda item: -(FILE_SECONDS.get(item.path.name, 0) + QUICK_TEST_SECONDS * tests[item.path.name]))


def pytest_collection_finish(session):
    """The test processes collect cycles as the commands do (``collector.for_compiling``), in each xdist worker
    too: with the default thresholds, full collections of a worker's growing heap made the main pass 832-833 s
    instead of 766-807 s (``.ci/run``'s main pass, two back-to-back pairs, AMD EPYC, 2 cores).
    ``_free_compiled_programs`` still collects in full after every module."""
    from moejax.base import collector

    collector.for_compiling()


# ------------------------------------------------------------------- parity report (terminal summary)
PARITY_ERRORS: dict[str, dict[str, float]] = {}


def record_parity(family: str, what: str, err: float) -> None:
    """Remember the largest error seen per family and quantity; printed at the end of the run."""
    fam = PARITY_ERRORS.setdefault(family, {})
    fam[what] = max(fam.get(what, 0.0), float(err))


def pytest_terminal_summary(terminalreporter):
    if not PARITY_ERRORS:
        return
    terminalreporter.section("moejax vs Hugging Face: max abs error per family (fp32)")
    for family in sorted(PARITY_ERRORS):
        errs = PARITY_ERRORS[family]
        terminalreporter.write_line(f"{family:12s} " + "  ".join(f"{k}={v:.2e}" for k, v in sorted(errs.items())))


# ------------------------------------------------------------------- failures as they happen
FAILURE_LOG_ENV = "MOEJAX_TEST_FAILURE_LOG"


def pytest_runtest_logreport(report):
    """With ``MOEJAX_TEST_FAILURE_LOG=FILE``, append each failure's traceback to FILE the moment it is reported
    (pytest prints them only at the end of the run). A device call's time box kills the suite before that
    end: a partial run on an H200 cut off so left 74 failures and not one traceback. Runs in the process that
    collects the reports (xdist's controller), so one writer."""
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
