"""Tiny random Hugging Face MoE models built from a config, saved with ``save_pretrained``: the models the
parity, conversion and most engine tests run on.

``get_hf_model(name)`` builds the model described by ``HF_CONFIGS[name]`` once per session, with
``torch.manual_seed`` fixed and the router (gate) weights scaled by ``ROUTER_SCALE`` so routing is decisive
(random-init routers give near-uniform logits, and near ties would hide or fake differences). It returns the saved
folder and the (eval-mode, float32) torch model. Every config is tiny (hidden 32, 2-3 layers, vocab <= 128, 8-16
experts) so building all of them takes a few seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from typing import Any

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
RUN_FOLDER: list[str] = []  # the run's temporary folder (``conftest`` sets it): the models are saved inside
_HF: dict[str, HFModel] = {}
_MOEJAX: dict[str, Any] = {}


def _root() -> str:
    if not _ROOT:
        # a child process the tests start (no conftest there) saves inside the run's folder too, which the run removes
        folder = RUN_FOLDER[0] if RUN_FOLDER else os.environ.get("MOEJAX_TESTS_TMP")
        _ROOT.append(tempfile.mkdtemp(prefix="models-", dir=folder if folder and os.path.isdir(folder) else None))
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
