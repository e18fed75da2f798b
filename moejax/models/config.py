"""One model configuration for every supported family, parsed from a Hugging Face ``config.json``.

The original HF dict is kept verbatim (``hf``) so that export writes back exactly what came in; everything
the model code needs is derived from it here, once, in one place. ``ModelConfig`` is frozen and hashable so
it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from moejax.base.errors import Failure
from moejax.base.flags import FLOAT32_MAX
from moejax.base.typecheck import is_integer, is_number
from moejax.models.gating import (BiasedSoftmaxTopK, Gating, GroupLimited, SigmoidGroupLimited, SoftmaxTopK,
                                  SparseMixer)

SUPPORTED_MODEL_TYPES = ("mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                         "glm4_moe", "dots1", "granitemoe", "granitemoeshared", "ernie4_5_moe", "hunyuan_v1_moe",
                         "gpt_oss")
DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention, shared experts, first_k_dense_replace
#: DeepSeek-V3's routing (sigmoid + per-layer selection biases, noaux_tc), shared experts and dense first layers
#: (GLM-4.5 and dots.llm1 with grouped-query attention)
SELECTION_BIASED = ("deepseek_v3", "glm4_moe", "dots1")
#: checkpoints that may carry multi-token-prediction layers past the last decoder layer (skipped on import)
MTP_LAYERS = ("deepseek_v3", "glm4_moe")
GRANITE = ("granitemoe", "granitemoeshared")
#: ERNIE-4.5: softmax routing with per-layer selection biases added to the probabilities it chooses by (stored
#: [1, N] as ``mlp.moe_statics.e_score_correction_bias``), shared experts, (even, odd) rope pairs, ``use_bias``
ERNIE = "ernie4_5_moe"
#: Hunyuan-A13B: every layer MoE with a shared MLP (both ``intermediate_size`` wide, as transformers builds them),
#: float32 router (``mlp.gate.wg``), per-head q/k norm applied after rope, NTK-alpha rope
HUNYUAN = "hunyuan_v1_moe"
#: GPT-OSS: attention sinks (a learned logit per head in every softmax's denominator), a router with a bias (softmax
#: over the top-k logits), experts with biases and a clamped SwiGLU (``(clamp(up) + 1) · g · σ(α g)``, g clamped
#: above) whose gate and up columns alternate in ``gate_up_proj`` [N, D, 2F], stored [in, out]
GPT_OSS = "gpt_oss"

_DEFAULT_THETA = {"mixtral": 1e6, "phimoe": 1e6, ERNIE: 5e5, GPT_OSS: 150000.0}
#: transformers' rope for a GPT-OSS config.json that names none (``GptOssConfig``)
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


class UnsupportedModelError(Failure):
    """The folder holds a model moejax cannot run."""


def _finite32(v: Any) -> bool:
    """A number float32 holds: not NaN, not inf, not a JSON integer too large for any float (``math.isfinite``
    raises ``OverflowError`` on those)."""
    return is_number(v) and abs(v) <= FLOAT32_MAX


def _real(key: str, v: Any, *, above: float | None = None, at_least: float | None = None,
          below: float | None = None) -> float:
    """A float field of config.json, refused (naming ``key``) unless a number float32 holds within the bounds."""
    ok = (_finite32(v) and (above is None or v > above) and (at_least is None or v >= at_least)
          and (below is None or v < below))
    if not ok:
        bounds = [f"{op} {b:g}" for op, b in ((">", above), (">=", at_least), ("<", below)) if b is not None]
        past = " (past float32's range)" if is_number(v) and not _finite32(v) and v == v else ""
        raise UnsupportedModelError(f"config.json: {key} must be a finite number{' ' if bounds else ''}"
                                    f"{' and '.join(bounds)}, got {v!r}{past}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_type: str  # "rms" | "layer" (Phi-MoE's LayerNorm with bias)
    norm_eps: float
    qkv_bias: bool
    o_bias: bool
    qk_norm: str  # "none" | "head" (Qwen3: per head) | "proj" (OLMoE: over the whole projection) | "head_after_rope"
    clip_qkv: float | None
    sliding_windows: tuple[int, ...]  # per layer; 0 = full causal attention
    # rotary embedding: inverse frequencies and cos/sin scale, precomputed from the HF rope parameters
    rope_inv_freq: tuple[float, ...]
    rope_scale: float
    rope_interleaved: bool  # DeepSeek and ERNIE-4.5 apply rope to (even, odd) pairs; the others rotate halves
    rope_long_scale: float  # Phi-MoE longrope: cos/sin scale once a call reaches past rope_long_after
    rope_long_after: int
    attn_scale: float  # softmax scaling of q·k
    # multi-head latent attention (DeepSeek-V2)
    mla: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # feed-forward
    hidden_act: str
    intermediate_size: int  # dense (non-MoE) layers
    mlp_bias: bool
    moe_layers: tuple[bool, ...]
    n_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_intermediate_size: int  # 0 = no shared expert
    shared_expert_gate: bool  # Qwen-MoE's sigmoid gate on the shared expert
    gating: Gating
    tie_word_embeddings: bool
    lm_head_bias: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Granite's multipliers (1 everywhere else): embeddings × embedding_multiplier, each block's output ×
    # residual_multiplier before it joins the residual stream, logits ÷ logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # GPT-OSS's clamped SwiGLU (``swiglu_limit`` None: the plain act(gate) · up); its sinks and router / expert
    # biases are parameters (``hf_keys``), computed where the tree holds them
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    hf_json: str = dataclasses.field(repr=False, compare=False, default="{}")

    @property
    def hf(self) -> dict[str, Any]:
        """The original Hugging Face config dict."""
        return json.loads(self.hf_json)

    @property
    def n_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.moe_layers) if m)

    def check_context(self, context: int, what: str = "context") -> None:
        """Refuse a window longer than the positions the model was built for (its outputs there are not
        what it was trained to give, and nothing would say so)."""
        if context > self.max_position_embeddings:
            raise ValueError(f"{what} {context} is longer than the model's {self.max_position_embeddings} "
                             "positions (max_position_embeddings)")

    @property
    def expert_act(self) -> str | tuple:
        """The routed experts' gated activation as a hashable static value: ``hidden_act`` (act(gate) · up), or
        ``("clamped_swiglu", limit, alpha)`` for GPT-OSS (``model.glu``)."""
        return self.hidden_act if self.swiglu_limit is None else ("clamped_swiglu", self.swiglu_limit,
                                                                  self.swiglu_alpha)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        return from_hf(hf)


def _rope_parameters(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """HF 5.x writes ``rope_parameters``; older checkpoints ``rope_theta`` + ``rope_scaling``."""
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise UnsupportedModelError(f"config.json: {key} must be an object, got {hf[key]!r}")
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or ({} if params or model_type != GPT_OSS else _GPT_OSS_ROPE)
    for k, v in scaling.items():
        params.setdefault(k, v)
    params.setdefault("rope_theta", hf.get("rope_theta", _DEFAULT_THETA.get(model_type, 1e4)))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# rope parameters a rope type reads, checked up front: a zero or a string otherwise fails deep inside the frequency
# formulas with a bare "math domain error" or "division by zero". (required, > 0) and (optional, >= 0: 0 = default)
_ROPE_NUMBERS = {"linear": (("factor",), ()),
                 "longrope": (("original_max_position_embeddings",), ("factor", "attention_factor")),
                 "yarn": (("original_max_position_embeddings",),
                          ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"))}


def _check_rope_parameters(rp: dict[str, Any]) -> None:
    _real("rope_theta", rp["rope_theta"], above=0)  # also where rope_parameters holds it
    for name in ("short_factor", "long_factor"):  # each divides a frequency
        if name in rp and (not isinstance(rp[name], list) or not all(_finite32(f) and f > 0 for f in rp[name])):
            raise UnsupportedModelError(f"config.json: rope_scaling {name} must be a list of finite numbers > 0, "
                                        f"got {rp[name]!r}")
    required, optional = _ROPE_NUMBERS.get(rp["rope_type"], ((), ()))
    for k in (*required, *optional):
        v = rp.get(k)
        if v is None and k in optional:
            continue
        positive = k in required or k in ("factor", "attention_factor")
        if not _finite32(v) or v < 0 or (positive and v == 0):
            raise UnsupportedModelError(f"config.json: rope_scaling of type {rp['rope_type']} needs {k} to be a "
                                        f"finite number {'>' if positive else '>='} 0, got {v!r}")
    # yarn's correction divides by log(rope_theta), longrope's attention factor by log(original length)
    for kind, k, v in (("yarn", "rope_theta", rp["rope_theta"]),
                       ("longrope", "original_max_position_embeddings", rp.get("original_max_position_embeddings"))):
        if rp["rope_type"] == kind and v == 1:
            raise UnsupportedModelError(f"config.json: rope_scaling of type {kind} needs {k} other than 1 (its "
                                        "formula divides by the logarithm)")


def _rope_frequencies(rp: dict[str, Any], dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies and cos/sin scale, mirroring transformers' ``modeling_rope_utils``."""
    _check_rope_parameters(rp)
    base = float(rp["rope_theta"])
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    kind = rp["rope_type"]
    if kind == "default":
        return 1.0 / (base**exponents), 1.0
    if kind == "linear":
        return 1.0 / (base**exponents) / float(rp["factor"]), 1.0
    if kind == "longrope":
        original = rp["original_max_position_embeddings"]
        factor = rp.get("factor") or max_pos / original
        attention_factor = rp.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        for name in ("short_factor", "long_factor"):  # one factor per rotated pair (a shrunk head_dim kept them)
            if name in rp and np.shape(rp[name]) != (dim // 2,):
                raise UnsupportedModelError(f"config.json: rope_scaling {name} has {np.size(rp[name])} values; "
                                            f"the rotary dimension {dim} needs {dim // 2} (one per rotated pair)")
        short = np.asarray(rp["short_factor"], np.float32)
        return 1.0 / (short * base**exponents), float(attention_factor)
    if kind == "yarn":
        factor = rp.get("factor") or max_pos / rp["original_max_position_embeddings"]
        original = rp["original_max_position_embeddings"]
        attention_factor = rp.get("attention_factor")
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        if attention_factor is None:
            if mscale and mscale_all:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
            else:
                attention_factor = _yarn_mscale(factor)
        beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rp.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        pos_freqs = base ** (np.arange(0, dim, 2).astype(np.float32) / dim)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
        return inv.astype(np.float32), float(attention_factor)
    raise UnsupportedModelError(
        f"rope type {kind!r} is not supported (supported: default, linear, longrope, yarn)"
    )


def _moe_layer_pattern(hf: dict[str, Any], mt: str, n_layers: int) -> tuple[bool, ...]:
    if mt in ("mixtral", "phimoe", "olmoe", HUNYUAN, GPT_OSS, *GRANITE):
        return (True,) * n_layers
    if mt in ("qwen2_moe", "qwen3_moe"):
        step = hf.get("decoder_sparse_step", 1) or 1
        only_mlp = set(hf.get("mlp_only_layers") or [])
        n = hf.get("num_experts", hf.get("num_local_experts", 0))
        return tuple(i not in only_mlp and n > 0 and (i + 1) % step == 0 for i in range(n_layers))
    if mt == ERNIE:  # transformers' rule: every interval-th layer from start to end (-1: the last)
        start, end, step = (_count(hf, k, d, low) for k, d, low in (("moe_layer_start_index", 1, 0),
                                                                     ("moe_layer_end_index", -1, -1),
                                                                     ("moe_layer_interval", 1, 1)))
        end = n_layers - 1 if end == -1 else end
        return tuple((i + 1) % step == 0 and start <= i <= end for i in range(n_layers))
    # DeepSeek-V2/V3, GLM-4.5: the reference DeepSeek-V2 rule (HF 5.x drops moe_layer_freq; it defaults to 1)
    first_dense = hf.get("first_k_dense_replace", _NOAUX_DEFAULTS.get(mt, {}).get("first_k_dense_replace", 0)) or 0
    freq = hf.get("moe_layer_freq", 1) or 1
    return tuple(i >= first_dense and i % freq == 0 for i in range(n_layers))


def _sliding_windows(hf: dict[str, Any], mt: str, n_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full causal attention). A layer the family's rule makes sliding needs a
    window of at least one position: 0 or null would run it as full attention, where transformers masks every key
    (0) or refuses the config (null)."""
    sliding, window = _sliding_layers(hf, mt, n_layers), hf.get("sliding_window")
    if any(sliding) and not (is_integer(window) and window >= 1):
        raise UnsupportedModelError(f"config.json: sliding_window must be an integer >= 1 where layers attend "
                                    f"through a sliding window (layer {sliding.index(True)} does), got {window!r}")
    return tuple(int(window) if s else 0 for s in sliding)


def _sliding_layers(hf: dict[str, Any], mt: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers attend through a sliding window, by each family's rule in transformers."""
    window = hf.get("sliding_window")
    if mt in ("qwen2_moe", "qwen3_moe"):
        # Qwen3-MoE drops a null window (full attention everywhere); Qwen2-MoE keeps its sliding layers
        if not hf.get("use_sliding_window", False) or (mt == "qwen3_moe" and window is None):
            return (False,) * n_layers
        types = hf.get("layer_types")
        if mt == "qwen2_moe" and types is None:
            max_window = _count(hf, "max_window_layers", 28, 0)
            types = ["sliding_attention" if (i + 1) % 2 and i < max_window else "full_attention"
                     for i in range(n_layers)]
        return (True,) * n_layers if types is None else _layer_types(types, n_layers)
    if mt in ("mixtral", "phimoe"):
        return (window is not None,) * n_layers
    if mt == "dots1":  # Qwen3's attention: sliding where layer_types says (default: from max_window_layers on)
        types = hf.get("layer_types")
        if types is None:
            first = _count(hf, "max_window_layers", n_layers, 0)
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n_layers)]
        return _layer_types(types, n_layers)
    if mt == GPT_OSS:  # transformers' default: sliding on even layers, full on odd ones
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                          for i in range(n_layers)]
        return _layer_types(types, n_layers)
    return (False,) * n_layers


def _layer_types(types: Any, n_layers: int) -> tuple[bool, ...]:
    """Which layers ``layer_types`` makes sliding, the list checked: sliding_attention or full_attention for
    every layer."""
    if (not isinstance(types, list) or len(types) != n_layers
            or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise UnsupportedModelError(f"config.json: layer_types must list sliding_attention or full_attention for each "
                                    f"of the {n_layers} layers, got {types!r}")
    return tuple(t == "sliding_attention" for t in types)


def from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Parse a Hugging Face config dict; raise ``UnsupportedModelError`` naming what is wrong."""
    mt = hf.get("model_type")
    if mt == "hunyuan":  # Hunyuan-A13B's first upload, written for its own modelling code (auto_map)
        raise UnsupportedModelError(
            "model_type 'hunyuan' is the remote-code spelling of Hunyuan-A13B; transformers and moejax run it as "
            "'hunyuan_v1_moe' (the hub's updated config.json says so): fetch the current files, or set model_type "
            "to hunyuan_v1_moe")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {mt!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    parsed = _hunyuan_fields(hf) if mt == HUNYUAN else hf
    _check_sizes(parsed)
    try:
        cfg = _from_hf(parsed, mt)
    except KeyError as e:
        raise UnsupportedModelError(f"config.json of a {mt} model lacks the key {e.args[0]!r}") from e
    if parsed is not hf:
        cfg = dataclasses.replace(cfg, hf_json=json.dumps(hf, sort_keys=True))  # export writes back what came in
    if not 1 <= cfg.gating.top_k <= cfg.gating.n_experts:
        raise UnsupportedModelError(f"config.json: num_experts_per_tok={cfg.gating.top_k} must be in "
                                    f"[1, {cfg.gating.n_experts}] (the number of routed experts)")
    _check_model(cfg)
    return cfg


def _check_model(cfg: ModelConfig) -> None:
    """What only the parsed sizes together say: grouped-query heads, and weights a machine can hold (integer
    arithmetic: milliseconds whatever the config says)."""
    if not cfg.mla and cfg.num_heads % cfg.num_kv_heads:  # latent attention makes a key and value per query head
        raise UnsupportedModelError(f"config.json: num_attention_heads {cfg.num_heads} is not a multiple of "
                                    f"num_key_value_heads {cfg.num_kv_heads} (each key/value head serves a whole "
                                    "group of query heads)")
    total = 0
    for what, elements, count in _weight_matrices(cfg):
        if elements > MAX_TENSOR_ELEMENTS:
            raise UnsupportedModelError(f"config.json: {what} holds {elements:.3g} elements, more than any model "
                                        f"(at most 2**40 in one tensor): a damaged config?")
        total += elements * count
    if total > MAX_PARAMS:
        raise UnsupportedModelError(f"config.json: the model would hold {total:.3g} parameters (hidden_size "
                                    f"{cfg.hidden_size}, {cfg.num_layers} layers, {cfg.n_experts} experts), more "
                                    f"than any model (at most {MAX_PARAMS:.0e}): a damaged config?")


def _weight_matrices(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(what, elements, how many) of the model's weight matrices, counted from the config alone (the routed
    experts of a layer as the one stack moejax holds them in; biases and norms left out)."""
    d, h, layers = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    moe = cfg.n_moe_layers
    out = [("embed_tokens (vocab_size × hidden_size)", cfg.vocab_size * d, 1 if cfg.tie_word_embeddings else 2)]
    if cfg.mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            out.append(("q_proj (num_attention_heads × (qk_nope_head_dim + qk_rope_head_dim) × hidden_size)",
                        h * qk * d, layers))
        else:
            out += [("q_a_proj (q_lora_rank × hidden_size)", cfg.q_lora_rank * d, layers),
                    ("q_b_proj (num_attention_heads × qk head × q_lora_rank)", h * qk * cfg.q_lora_rank, layers)]
        out += [("kv_a_proj ((kv_lora_rank + qk_rope_head_dim) × hidden_size)",
                 (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * d, layers),
                ("kv_b_proj (num_attention_heads × (qk_nope_head_dim + v_head_dim) × kv_lora_rank)",
                 h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank, layers),
                ("o_proj (hidden_size × num_attention_heads × v_head_dim)", d * h * cfg.v_head_dim, layers)]
    else:
        out += [("q_proj (num_attention_heads × head_dim × hidden_size)", h * cfg.head_dim * d, 2 * layers),
                ("k_proj (num_key_value_heads × head_dim × hidden_size)", cfg.num_kv_heads * cfg.head_dim * d,
                 2 * layers)]
    return out + [
        ("a dense MLP matrix (intermediate_size × hidden_size)", cfg.intermediate_size * d, 3 * (layers - moe)),
        ("a routed expert stack (experts × moe_intermediate_size × hidden_size)",
         cfg.n_experts * cfg.moe_intermediate_size * d, 3 * moe),
        ("a shared expert matrix (its intermediate size × hidden_size)", cfg.shared_intermediate_size * d, 3 * moe),
        ("the router (experts × hidden_size)", cfg.n_experts * d, moe)]


# sizes and counts: where present they must be positive integers (0 allowed where a family uses it to switch
# a part off), so that a damaged config.json is blamed, not the first tensor whose shape it gets wrong
_POSITIVE_INT_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
                      "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                      "n_routed_experts", "num_experts_per_tok", "moe_num_experts", "moe_k", "moe_topk",
                      "max_position_embeddings", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank",
                      # null for no query compression; 0 would build a rank-0 query (every query zero)
                      "q_lora_rank",
                      # every N-th layer is MoE: 0 divides by zero in transformers
                      "decoder_sparse_step", "moe_layer_freq")
_NON_NEGATIVE_INT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                          "shared_intermediate_size", "max_window_layers")
#: head sizes far beyond any released model (256-576): the rotary frequencies are built from them when the config is
#: parsed, so one from a damaged config.json must be refused before that
MAX_HEAD_DIM = 1 << 16
_HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
#: token ids and positions are int32 in the model
MAX_INDEX = 2**31 - 1
_INDEX_KEYS = ("vocab_size", "max_position_embeddings", "sliding_window")


# switches read with ``bool()``: a string such as "false" would silently mean true
_BOOL_KEYS = ("norm_topk_prob", "use_sliding_window", "qkv_bias", "attention_bias", "mlp_bias", "tie_word_embeddings",
              "lm_head_bias", "use_qk_norm", "use_bias")


#: counts far beyond any released model (DeepSeek-V3: 61 layers of 256 experts): a damaged config.json, which
#: would otherwise make loading build a table of layers × experts tensor names until memory runs out
MAX_LAYERS, MAX_EXPERTS, MAX_EXPERT_TENSORS = 4096, 1 << 16, 1 << 20
#: weights far beyond any released model (DeepSeek-V3: 6.7e11 parameters, its largest expert stack 3.8e9 elements):
#: a model no machine holds, refused from the config's integers before anything is allocated
MAX_TENSOR_ELEMENTS, MAX_PARAMS = 1 << 40, 10**13


def eos_token_ids_of(value, where: str) -> tuple[int, ...]:
    """``eos_token_id`` (an id, a list of ids or null) as a tuple of token ids, checked: ``where`` names the file."""
    ids = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
    for i in ids:
        if not is_integer(i) or not 0 <= i < 2**31:
            raise UnsupportedModelError(f"{where}: eos_token_id must be token ids in 0..2**31-1, got {value!r}")
    return ids


def _check_sizes(hf: dict[str, Any]) -> None:
    for keys, low in ((_POSITIVE_INT_KEYS, 1), (_NON_NEGATIVE_INT_KEYS, 0)):
        for k in keys:
            v = hf.get(k)
            if v is not None and (not is_integer(v) or v < low):
                raise UnsupportedModelError(f"config.json: {k} must be an integer >= {low}, got {v!r}")
    for keys, limit, why in ((_HEAD_DIM_KEYS, MAX_HEAD_DIM, "implausible for a head"),
                             (_INDEX_KEYS, MAX_INDEX, "past int32 token ids and positions")):
        for k in keys:
            if is_integer(hf.get(k)) and hf[k] > limit:
                raise UnsupportedModelError(f"config.json: {k} = {hf[k]} is {why} (at most {limit}): a damaged "
                                            "config?")
    if hf.get("rope_theta") is not None:
        _real("rope_theta", hf["rope_theta"], above=0)
    if hf.get("rms_norm_eps") is not None:  # 0 divides an all-zero hidden state by zero
        _real("rms_norm_eps", hf["rms_norm_eps"], above=0, below=1)
    bos = hf.get("bos_token_id")
    if bos is not None and (not is_integer(bos) or not 0 <= bos <= MAX_INDEX):
        raise UnsupportedModelError(f"config.json: bos_token_id must be a token id (an integer >= 0) or null, got "
                                    f"{bos!r}")
    window = hf.get("sliding_window")
    if window is not None and (not is_integer(window) or window < 0):
        raise UnsupportedModelError(f"config.json: sliding_window must be an integer >= 0 or null, got {window!r}")
    for k in _BOOL_KEYS:
        if hf.get(k) is not None and not isinstance(hf[k], bool):
            raise UnsupportedModelError(f"config.json: {k} must be true or false, got {hf[k]!r}")
    only = hf.get("mlp_only_layers")
    if only is not None and (not isinstance(only, list)
                             or any(not is_integer(i) or i < 0 for i in only)):
        raise UnsupportedModelError(f"config.json: mlp_only_layers must be a list of layer indices, got {only!r}")
    layers = hf.get("num_hidden_layers") or 1
    experts = max(hf.get(k) or 1 for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"))
    for k, v, limit in (("num_hidden_layers", layers, MAX_LAYERS), ("the number of experts", experts, MAX_EXPERTS),
                        ("layers × experts", layers * experts, MAX_EXPERT_TENSORS)):
        if v > limit:
            raise UnsupportedModelError(f"config.json: {k} = {v} is implausible (at most {limit}): a damaged config?")


def _check_unquantised(hf: dict[str, Any], mt: str) -> None:
    """Quantised hub checkpoints (DeepSeek-V3's fp8 blocks with ``weight_scale_inv``) hold weights moejax does not
    read: refuse them by name rather than fail on the first fp8 tensor. GPT-OSS's MXFP4 release is read
    (``checkpoint.hf_tree``: its experts decoded as they are read)."""
    q = hf.get("quantization_config")
    if q is not None:
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        if method == "mxfp4" and mt == GPT_OSS:  # the hub release: its experts are decoded as they are read
            return
        how = ("transformers writes one: AutoModelForCausalLM.from_pretrained(ID, quantization_config="
               "Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(OUT); bf16 copies are on the hub too"
               if method == "mxfp4" else
               "for DeepSeek-V3's fp8 release, the reference repository's fp8_cast_bf16.py writes one")
        raise UnsupportedModelError(
            f"config.json: this {mt} checkpoint is quantised (quantization_config, quant_method {method!r}); moejax "
            f"reads floating-point weights: use a bf16 copy ({how}), then --weight-dtype/--expert-dtype int8 if it "
            "must be smaller")


#: transformers' defaults for what a config.json of these families may leave out
_NOAUX_DEFAULTS = {
    "deepseek_v3": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                    "norm_topk_prob": True},
    "glm4_moe": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
                 "norm_topk_prob": True},
    "dots1": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
              "norm_topk_prob": False},
}


def _noaux_gating(hf: dict[str, Any], mt: str, n_experts: int, top_k: int) -> SigmoidGroupLimited:
    """DeepSeek-V3's router (also GLM-4.5's and dots.llm1's): sigmoid scores with a selection bias (``noaux_tc``),
    group-limited."""
    method, scoring = hf.get("topk_method", "noaux_tc"), hf.get("scoring_func", "sigmoid")
    if method != "noaux_tc" or scoring != "sigmoid":
        raise UnsupportedModelError(f"{mt} topk_method {method!r} with scoring_func {scoring!r} is not "
                                    "supported (supported: noaux_tc with sigmoid, as transformers runs it)")
    default = _NOAUX_DEFAULTS[mt]
    n_group, topk_group = _groups(hf, n_experts, top_k, default)
    scale = _real("routed_scaling_factor", hf.get("routed_scaling_factor", default["routed_scaling_factor"]), above=0)
    normalize = bool(hf.get("norm_topk_prob", default["norm_topk_prob"])) and top_k > 1
    return SigmoidGroupLimited(n_experts, top_k, normalize, scale, n_group, topk_group)


def _groups(hf: dict[str, Any], n_experts: int, top_k: int, default: dict[str, int]) -> tuple[int, int]:
    """(n_group, topk_group) of group-limited routing: the groups split the experts evenly (at least 2 each), at
    most n_group of them are kept, and those hold at least the top_k experts chosen from them."""
    n_group, topk_group = (_count(hf, k, default.get(k), 1) for k in ("n_group", "topk_group"))
    if n_group is None or topk_group is None:  # DeepSeek-V2 has no defaults for them
        raise UnsupportedModelError(f"config.json: group-limited routing needs n_group and topk_group, got "
                                    f"{hf.get('n_group')!r} and {hf.get('topk_group')!r}")
    if n_experts % n_group or topk_group > n_group or (n_group > 1 and n_experts // n_group < 2):
        raise UnsupportedModelError(f"config.json: n_group {n_group} must divide the {n_experts} routed experts "
                                    f"into groups of at least 2, and topk_group {topk_group} be at most n_group")
    if top_k > topk_group * (n_experts // n_group):
        raise UnsupportedModelError(f"config.json: num_experts_per_tok {top_k} is more than the {topk_group} kept "
                                    f"groups (topk_group) of {n_experts // n_group} experts hold")
    return n_group, topk_group


def _head_dim(hidden_size: int, n_heads: int) -> int:
    """A head's size where config.json does not give one: hidden_size / num_attention_heads (as transformers
    takes it), checked here, before the rotary frequencies are built from it."""
    dim = hidden_size // n_heads
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise UnsupportedModelError(f"config.json: hidden_size {hidden_size} / num_attention_heads {n_heads} makes "
                                    f"heads of {dim} dimensions; a head has 1..{MAX_HEAD_DIM} (or give head_dim)")
    return dim


def _mla_rotary_dim(dim: int) -> int:
    """Multi-head latent attention's rotated part of a head (``qk_rope_head_dim``): pairs of dimensions."""
    if dim % 2:
        raise UnsupportedModelError(f"config.json: qk_rope_head_dim {dim} must be even (rotary embedding turns "
                                    "pairs of dimensions)")
    return dim


def _clip_qkv(hf: dict[str, Any]) -> float | None:
    """OLMoE's clamp of q, k and v to [-clip_qkv, clip_qkv]: null (none) or a finite number > 0."""
    v = hf.get("clip_qkv")
    return None if v is None else _real("clip_qkv", v, above=0)


def _rotary_dim(hf: dict[str, Any], rp: dict[str, Any], mt: str, head_dim: int) -> int:
    """The dimensions of a head that rotary embedding turns: all, or GLM-4.5's first ``partial_rotary_factor``
    (0.5 where its config leaves it out, as transformers assumes); the rest pass through unrotated."""
    factor = hf.get("partial_rotary_factor", rp.get("partial_rotary_factor"))
    if factor is None:
        factor = 0.5 if mt == "glm4_moe" else 1.0
    if not _finite32(factor) or not 0 < factor <= 1:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor must be in (0, 1], got {factor!r}")
    dim = int(head_dim * factor)
    if dim < 2 or dim % 2:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor {factor} turns {dim} of the {head_dim} "
                                    "dimensions of a head; rotary embedding needs an even number >= 2")
    return dim


def _count(hf: dict[str, Any], key: str, default: int, low: int) -> int:
    """An integer field >= ``low`` (``default`` where absent or null)."""
    v = hf.get(key)
    if v is None:
        return default
    if not is_integer(v) or v < low:
        raise UnsupportedModelError(f"config.json: {key} must be an integer >= {low}, got {v!r}")
    return int(v)


def _ernie_gating(hf: dict[str, Any], n_experts: int, top_k: int) -> BiasedSoftmaxTopK:
    """ERNIE-4.5's router (transformers' ``Ernie4_5_MoeTopKRouter``): weights normalised by max(sum, moe_norm_min)."""
    norm_min = hf.get("moe_norm_min", 1e-12)
    if norm_min is None:
        norm_min = 1e-12
    if not _finite32(norm_min) or norm_min < 0:
        raise UnsupportedModelError(f"config.json: moe_norm_min must be a finite number >= 0, got {norm_min!r}")
    return BiasedSoftmaxTopK(n_experts, top_k, True, norm_min=float(norm_min))


def _hunyuan_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan-A13B's config as the rest of the parser reads it: its per-layer lists (``num_experts``, ``moe_topk``,
    ``moe_intermediate_size``, ``num_shared_expert``) as one number where every layer has the same (moejax runs one
    expert count and one K), ``attention_head_dim`` as ``head_dim``; cross-layer attention (``use_cla``), which
    transformers' implementation does not run, refused."""
    if hf.get("use_cla"):
        raise UnsupportedModelError("config.json: use_cla (cross-layer KV sharing) is not supported; transformers' "
                                    "hunyuan_v1_moe does not run it either")
    out = dict(hf)
    for key in ("num_experts", "moe_topk", "moe_intermediate_size", "num_shared_expert"):
        v = hf.get(key)
        if isinstance(v, list):
            if not v or any(x != v[0] for x in v):
                raise UnsupportedModelError(f"config.json: {key} {v!r} differs between layers; moejax runs one value "
                                            "for every MoE layer")
            out[key] = v[0]
    # transformers builds the experts and the one shared MLP intermediate_size wide whatever these say: a file
    # that says otherwise holds tensors of other shapes, which loading would name less clearly
    if out.get("num_shared_expert") not in (None, 1):
        raise UnsupportedModelError(f"config.json: num_shared_expert {hf['num_shared_expert']!r}: transformers' "
                                    "hunyuan_v1_moe builds one shared MLP")
    if out.get("moe_intermediate_size") is not None and out.get("intermediate_size") is not None \
            and out["moe_intermediate_size"] != out["intermediate_size"]:
        raise UnsupportedModelError(f"config.json: moe_intermediate_size {out['moe_intermediate_size']!r} differs "
                                    f"from intermediate_size {out['intermediate_size']!r}; transformers' hunyuan_v1_moe "
                                    "builds the experts intermediate_size wide")
    if out.get("head_dim") is None and out.get("attention_head_dim") is not None:  # the release's spelling
        out["head_dim"] = out["attention_head_dim"]
    return out


def _ntk_alpha(rp: dict[str, Any], dim: int) -> dict[str, Any]:
    """Hunyuan's "dynamic" rope with a fixed ``alpha``: NTK scaling of the base, rope_theta · alpha^(d / (d − 2)),
    the same at every length (transformers' ``ntk_alpha``); without ``alpha`` it would depend on the length."""
    alpha = rp.get("alpha")
    if not _finite32(alpha) or alpha <= 0:
        raise UnsupportedModelError(f"config.json: rope of type dynamic needs a fixed alpha > 0 (NTK-alpha); got "
                                    f"alpha {alpha!r} (length-dependent dynamic scaling is not supported)")
    if dim <= 2:
        raise UnsupportedModelError(f"config.json: NTK-alpha rope needs a head dimension above 2, got {dim}")
    theta = float(rp["rope_theta"]) * float(alpha) ** (dim / (dim - 2))
    if theta > FLOAT32_MAX:
        raise UnsupportedModelError(f"config.json: NTK-alpha rope: rope_theta {rp['rope_theta']} × alpha {alpha}^"
                                    f"({dim}/{dim - 2}) = {theta:.3g} is past float32's range")
    return {**rp, "rope_type": "default", "rope_theta": theta}


def _swiglu(hf: dict[str, Any]) -> tuple[float, float]:
    """GPT-OSS's clamped SwiGLU: (swiglu_limit, swiglu_alpha), finite and > 0 (transformers' defaults 7.0, 1.702);
    its experts are SwiGLU whatever ``hidden_act`` says, so only "silu" is accepted there."""
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"config.json: gpt_oss experts apply a clamped SwiGLU; hidden_act "
                                    f"{hf['hidden_act']!r} is not what transformers runs (silu)")
    out = []
    for key, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        out.append(_real(key, hf.get(key, default), above=0))
    return out[0], out[1]


def _multiplier(hf: dict[str, Any], key: str) -> float:
    """One of Granite's scale factors: a finite number > 0 (HF's default 1 where absent or null)."""
    v = hf.get(key)
    return 1.0 if v is None else _real(key, v, above=0)


def _first(hf: dict[str, Any], *keys: str) -> Any:
    """The first of several spellings HF has used for one field (transformers' attribute maps)."""
    for k in keys:
        if hf.get(k) is not None:
            return hf[k]
    raise KeyError(keys[0])


def _from_hf(hf: dict[str, Any], mt: str) -> ModelConfig:
    d, n_heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    n_kv = hf.get("num_key_value_heads") or n_heads
    head_dim = hf.get("head_dim") or _head_dim(d, n_heads)
    mla = mt in DEEPSEEK
    _check_unquantised(hf, mt)
    rp = _rope_parameters(hf, mt)
    max_pos = hf.get("max_position_embeddings", {ERNIE: 131072, HUNYUAN: 2048, GPT_OSS: 131072}.get(mt, 4096))
    rope_dim = _mla_rotary_dim(hf["qk_rope_head_dim"]) if mla else _rotary_dim(hf, rp, mt, head_dim)
    if mt == HUNYUAN and rp["rope_type"] == "dynamic":
        rp = _ntk_alpha(rp, rope_dim)
    inv_freq, rope_scale = _rope_frequencies(rp, rope_dim, max_pos)
    long_scale, long_after = rope_scale, 2**31 - 1
    if mt == "phimoe" and rp["rope_type"] != "default":
        # HF Phi-MoE: short factors always; the cos/sin scale switches once a call passes the original length
        rope_scale, long_scale = (_real(f"rope_scaling {k}", rp[k], above=0) for k in ("short_mscale", "long_mscale"))
        long_after = int(rp["original_max_position_embeddings"])

    if mla:
        qk_head = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
        attn_scale = qk_head**-0.5
        if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
            m = _yarn_mscale(rp["factor"], rp["mscale_all_dim"])
            attn_scale *= m * m
    elif mt in GRANITE:
        attn_scale = _multiplier(hf, "attention_multiplier")  # replaces 1/sqrt(head_dim); HF's default is 1
    else:
        attn_scale = head_dim**-0.5

    if mt in ("mixtral", "phimoe", *GRANITE):
        n_experts, top_k = hf["num_local_experts"], hf.get("num_experts_per_tok", 2)
        moe_ff = hf["intermediate_size"]
    elif mt == GPT_OSS:  # transformers' defaults are gpt-oss-120b's: 128 experts, top-4, 2880 wide
        n_experts, top_k = hf.get("num_local_experts", 128), _first(hf, "num_experts_per_tok", "experts_per_token")
        moe_ff = hf.get("intermediate_size", 2880)
    elif mt in (*DEEPSEEK, *SELECTION_BIASED):
        n_experts, top_k = _first(hf, "n_routed_experts", "num_local_experts"), hf["num_experts_per_tok"]
        moe_ff = hf["moe_intermediate_size"]
    elif mt == HUNYUAN:  # experts as wide as the shared MLP: transformers builds both from intermediate_size
        n_experts, top_k = hf.get("num_experts", 1), hf.get("moe_topk", 1)
        moe_ff = hf["intermediate_size"]
    elif mt == ERNIE:  # transformers' defaults: 64 experts, top-6, 1536 wide
        n_experts, top_k = hf.get("moe_num_experts", 64), hf.get("moe_k", 6)
        moe_ff = hf.get("moe_intermediate_size", 1536)
    else:
        n_experts, top_k = _first(hf, "num_experts", "num_local_experts"), hf["num_experts_per_tok"]
        moe_ff = hf["moe_intermediate_size"] if mt != "olmoe" else hf["intermediate_size"]

    if mt == "phimoe":
        if top_k != 2:
            raise UnsupportedModelError(f"phimoe sparsemixer routing needs num_experts_per_tok=2, got {top_k}")
        jitter = _real("router_jitter_noise", hf.get("router_jitter_noise", 0.01), at_least=0)
        gating: Gating = SparseMixer(n_experts, top_k, jitter)
    elif mt in ("mixtral", HUNYUAN, GPT_OSS, *GRANITE):  # Granite and GPT-OSS: a softmax over the top-k logits, the same weights
        gating = SoftmaxTopK(n_experts, top_k, normalize=True)
    elif mt == "deepseek_v2":
        # reference DeepSeek-V2: renormalise (with +1e-20) when norm_topk_prob, else scale.
        normalize = bool(hf.get("norm_topk_prob")) and top_k > 1
        scale = 1.0 if normalize else _real("routed_scaling_factor", hf.get("routed_scaling_factor", 1.0), above=0)
        method = hf.get("topk_method", "greedy")
        if method == "group_limited_greedy":
            gating = GroupLimited(n_experts, top_k, normalize, scale, 1e-20 if normalize else 0.0,
                                  *_groups(hf, n_experts, top_k, {}))
        elif method == "greedy":
            gating = SoftmaxTopK(n_experts, top_k, normalize, scale, 1e-20 if normalize else 0.0)
        else:
            raise UnsupportedModelError(f"deepseek_v2 topk_method {method!r} is not supported "
                                        "(supported: greedy, group_limited_greedy)")
    elif mt in SELECTION_BIASED:
        gating = _noaux_gating(hf, mt, n_experts, top_k)
    elif mt == ERNIE:
        gating = _ernie_gating(hf, n_experts, top_k)
    else:
        gating = SoftmaxTopK(n_experts, top_k, normalize=bool(hf.get("norm_topk_prob", False)))

    shared = 0
    if mt == "qwen2_moe":
        shared = hf.get("shared_expert_intermediate_size", 0) or 0
    elif mt in (*DEEPSEEK, *SELECTION_BIASED):
        shared = (hf.get("n_shared_experts") or 0) * moe_ff
    elif mt == "granitemoeshared":
        shared = hf.get("shared_intermediate_size", 0) or 0
    elif mt == ERNIE:
        shared = _count(hf, "moe_num_shared_experts", 2, 0) * moe_ff
    elif mt == HUNYUAN:
        shared = moe_ff

    eos_ids = eos_token_ids_of(hf.get("eos_token_id"), "config.json")
    act = hf.get("hidden_act", "silu")
    swiglu_limit, swiglu_alpha = _swiglu(hf) if mt == GPT_OSS else (None, 1.702)
    if act not in ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"):
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported")
    return ModelConfig(
        model_type=mt,
        vocab_size=hf["vocab_size"],
        hidden_size=d,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        norm_type="layer" if mt == "phimoe" else "rms",
        norm_eps=float(hf.get("rms_norm_eps", 1e-5 if mt in ("phimoe", "olmoe", ERNIE, HUNYUAN, GPT_OSS) else 1e-6)),
        qkv_bias=(bool(hf.get("qkv_bias", True)) if mt == "qwen2_moe" else bool(hf.get("use_bias")) if mt == ERNIE
                  else bool(hf.get("attention_bias", mt == GPT_OSS))),
        o_bias=(False if mt in ("qwen2_moe", "glm4_moe") else bool(hf.get("use_bias")) if mt == ERNIE
                else bool(hf.get("attention_bias", mt == GPT_OSS))),
        qk_norm=("head" if mt in ("qwen3_moe", "dots1") or (mt == "glm4_moe" and hf.get("use_qk_norm")) else
                 "proj" if mt == "olmoe" else "head_after_rope" if mt == HUNYUAN else "none"),
        clip_qkv=_clip_qkv(hf) if mt == "olmoe" else None,
        sliding_windows=_sliding_windows(hf, mt, n_layers),
        rope_inv_freq=tuple(np.asarray(inv_freq, np.float64).tolist()),
        rope_scale=float(rope_scale),
        rope_interleaved=mt == ERNIE or mla and (mt == "deepseek_v2" or hf.get("rope_interleave", True) is not False),
        rope_long_scale=float(long_scale),
        rope_long_after=long_after,
        attn_scale=float(attn_scale),
        mla=mla,
        q_lora_rank=hf.get("q_lora_rank") if mla else None,
        kv_lora_rank=hf.get("kv_lora_rank", 0) if mla else 0,
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 0) if mla else 0,
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 0) if mla else 0,
        v_head_dim=hf.get("v_head_dim", 0) if mla else 0,
        hidden_act=act,
        intermediate_size=hf.get("intermediate_size", moe_ff),
        mlp_bias=bool(hf.get("mlp_bias", False)) if mla else bool(hf.get("use_bias")) if mt == ERNIE else False,
        moe_layers=_moe_layer_pattern(hf, mt, n_layers),
        n_experts=n_experts,
        top_k=top_k,
        moe_intermediate_size=moe_ff,
        shared_intermediate_size=shared,
        shared_expert_gate=mt == "qwen2_moe",
        gating=gating,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", mt == ERNIE)),  # ERNIE's config class ties by default
        lm_head_bias=(bool(hf.get("lm_head_bias", False)) if mt == "phimoe" else bool(hf.get("use_bias")) if mt == ERNIE
                      else False),
        max_position_embeddings=max_pos,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        embedding_multiplier=_multiplier(hf, "embedding_multiplier") if mt in GRANITE else 1.0,
        residual_multiplier=_multiplier(hf, "residual_multiplier") if mt in GRANITE else 1.0,
        logits_scaling=_multiplier(hf, "logits_scaling") if mt in GRANITE else 1.0,
        swiglu_limit=swiglu_limit,
        swiglu_alpha=swiglu_alpha,
        hf_json=json.dumps(hf, sort_keys=True),
    )
