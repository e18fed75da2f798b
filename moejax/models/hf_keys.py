"""Key mapping tables between Hugging Face hub checkpoints and the moejax parameter tree.

Every tensor of a supported checkpoint is described by one ``Entry``: its hub key, where it lives in the
moejax tree, whether it is a ``Linear`` weight (HF stores [out, in]; moejax [in, out]) and, for routed
experts, the expert index it occupies in the stacked ``[N, ...]`` array. The same table drives import,
export and every "missing / unexpected / mis-shaped key" error, so the two directions cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from moejax.models.config import ERNIE, GPT_OSS, GRANITE, HUNYUAN, MTP_LAYERS, SELECTION_BIASED, ModelConfig

# hub names of the three expert projections, per family: (gate, up, down)
_EXPERT_NAMES = {
    "mixtral": ("w1", "w3", "w2"),
    "phimoe": ("w1", "w3", "w2"),
}
_MOE_PREFIX = {"mixtral": "block_sparse_moe", "phimoe": "block_sparse_moe"}
_SHARED_NAME = {"qwen2_moe": "shared_expert", "deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts",
                "glm4_moe": "shared_experts", "dots1": "shared_experts", ERNIE: "shared_experts", HUNYUAN: "shared_mlp"}


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_key: str
    path: tuple  # path in the moejax tree, e.g. ("layers", 3, "moe", "gate")
    shape: tuple[int, ...]  # shape of this matrix as HF stores it (of one expert; of its rows where fused)
    transpose: bool = False  # Linear weight: HF [out, in] -> moejax [in, out]
    expert: int | None = None  # index in the stacked expert axis
    # Granite fuses matrices in the file: ``rows`` is where this one sits in the HF tensor's rows (gate rows,
    # then up rows of ``input_linear`` [2F, D]); ``stacked``: the HF tensor holds every expert, [N, rows, in]
    rows: tuple[int, int] | None = None
    stacked: bool = False
    lead_one: bool = False  # the HF tensor has a leading axis of 1 that moejax drops (ERNIE's [1, N] selection bias)
    # GPT-OSS interleaves matrices by column: this entry is ``tensor[..., start::step]`` of the HF tensor's last
    # axis (gate columns even, up columns odd in ``gate_up_proj`` [N, D, 2F] and its bias [N, 2F])
    columns: tuple[int, int] | None = None
    # GPT-OSS's MXFP4 release (``mxfp4``): an expert matrix is two tensors, ``*_blocks`` and ``*_scales`` (this entry
    # is the one ``mxfp4`` names), rows [out, in]; gate and up are rows ``start::step`` (``row_step``) of one
    mxfp4: str | None = None
    row_step: tuple[int, int] | None = None

    @property
    def param_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.shape)) if self.transpose else self.shape


def tensor_shape(pieces: list[Entry], n_experts: int) -> tuple[int, ...]:
    """The shape of the HF tensor that ``pieces`` (the entries sharing one ``hf_key``) make up together."""
    e = pieces[0]
    if e.lead_one:
        return (1, *e.shape)
    if e.columns is not None:
        return ((n_experts,) if e.stacked else ()) + (*e.shape[:-1], e.shape[-1] * e.columns[1])
    if e.row_step is not None:
        return (n_experts, e.shape[0] * e.row_step[1], *e.shape[1:])
    if e.rows is None and not e.stacked:
        return e.shape
    rows = max(p.rows[1] for p in pieces) if e.rows is not None else e.shape[0]
    return ((n_experts,) if e.stacked else ()) + (rows, *e.shape[1:])


def by_tensor(table: list[Entry]) -> dict[str, list[Entry]]:
    """The entries grouped by the HF tensor they live in (one entry per tensor except where the file fuses
    matrices), in the table's order, which is the file's: expert by expert, each one's rows top down."""
    out: dict[str, list[Entry]] = {}
    for e in table:
        out.setdefault(e.hf_key, []).append(e)
    return out


def piece_of(view, e: Entry):
    """The part of HF tensor ``view`` (an array or a lazy view of one) that entry ``e`` describes."""
    if e.stacked:
        view = view[e.expert]
    if e.lead_one:
        return view[0]
    if e.columns is not None:
        return view[..., e.columns[0]::e.columns[1]]
    if e.row_step is not None:
        return view[e.row_step[0]::e.row_step[1]]
    return view if e.rows is None else view[e.rows[0]:e.rows[1]]


def _linear(key: str, path: tuple, n_in: int, n_out: int, bias: bool = False) -> Iterator[Entry]:
    yield Entry(f"{key}.weight", path, (n_out, n_in), transpose=True)
    if bias:
        yield Entry(f"{key}.bias", path[:-1] + (path[-1] + "_bias",), (n_out,))


def _norm(key: str, path: tuple, dim: int, cfg: ModelConfig) -> Iterator[Entry]:
    yield Entry(f"{key}.weight", path + ("scale",), (dim,))
    if cfg.norm_type == "layer":
        yield Entry(f"{key}.bias", path + ("bias",), (dim,))


def _mlp(key: str, path: tuple, d: int, f: int, bias: bool) -> Iterator[Entry]:
    yield from _linear(f"{key}.gate_proj", path + ("gate",), d, f, bias)
    yield from _linear(f"{key}.up_proj", path + ("up",), d, f, bias)
    yield from _linear(f"{key}.down_proj", path + ("down",), f, d, bias)


def _attention(cfg: ModelConfig, pre: str, path: tuple) -> Iterator[Entry]:
    d, H = cfg.hidden_size, cfg.num_heads
    if cfg.mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        b = cfg.o_bias  # DeepSeek's attention_bias covers q_a, kv_a and o
        if cfg.q_lora_rank is None:
            yield from _linear(f"{pre}.q_proj", path + ("q",), d, H * qk)
        else:
            yield from _linear(f"{pre}.q_a_proj", path + ("q_a",), d, cfg.q_lora_rank, b)
            yield Entry(f"{pre}.q_a_layernorm.weight", path + ("q_a_norm",), (cfg.q_lora_rank,))
            yield from _linear(f"{pre}.q_b_proj", path + ("q_b",), cfg.q_lora_rank, H * qk)
        yield from _linear(f"{pre}.kv_a_proj_with_mqa", path + ("kv_a",), d,
                           cfg.kv_lora_rank + cfg.qk_rope_head_dim, b)
        yield Entry(f"{pre}.kv_a_layernorm.weight", path + ("kv_a_norm",), (cfg.kv_lora_rank,))
        yield from _linear(f"{pre}.kv_b_proj", path + ("kv_b",), cfg.kv_lora_rank,
                           H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        yield from _linear(f"{pre}.o_proj", path + ("o",), H * cfg.v_head_dim, d, b)
        return
    hd, Hk = cfg.head_dim, cfg.num_kv_heads
    yield from _linear(f"{pre}.q_proj", path + ("q",), d, H * hd, cfg.qkv_bias)
    yield from _linear(f"{pre}.k_proj", path + ("k",), d, Hk * hd, cfg.qkv_bias)
    yield from _linear(f"{pre}.v_proj", path + ("v",), d, Hk * hd, cfg.qkv_bias)
    yield from _linear(f"{pre}.o_proj", path + ("o",), H * hd, d, cfg.o_bias)
    if cfg.qk_norm == "head":
        yield Entry(f"{pre}.q_norm.weight", path + ("q_norm",), (hd,))
        yield Entry(f"{pre}.k_norm.weight", path + ("k_norm",), (hd,))
    elif cfg.qk_norm == "head_after_rope":  # Hunyuan's names
        yield Entry(f"{pre}.query_layernorm.weight", path + ("q_norm",), (hd,))
        yield Entry(f"{pre}.key_layernorm.weight", path + ("k_norm",), (hd,))
    elif cfg.qk_norm == "proj":
        yield Entry(f"{pre}.q_norm.weight", path + ("q_norm",), (H * hd,))
        yield Entry(f"{pre}.k_norm.weight", path + ("k_norm",), (Hk * hd,))
    if cfg.model_type == GPT_OSS:  # one learned sink logit per head
        yield Entry(f"{pre}.sinks", path + ("sinks",), (H,))


def _fused_mlp(key: str, path: tuple, d: int, f: int, expert: int | None = None) -> Iterator[Entry]:
    """Granite's MLP: ``input_linear`` [2F, D] (gate rows, then up rows) and ``output_linear`` [D, F]; per
    expert of ``[N, ...]`` tensors when ``expert`` is given."""
    stacked = expert is not None
    yield Entry(f"{key}.input_linear.weight", path + ("gate",), (f, d), True, expert, (0, f), stacked)
    yield Entry(f"{key}.input_linear.weight", path + ("up",), (f, d), True, expert, (f, 2 * f), stacked)
    yield Entry(f"{key}.output_linear.weight", path + ("down",), (d, f), True, expert, None, stacked)


def _granite_moe(cfg: ModelConfig, pre: str, path: tuple) -> Iterator[Entry]:
    d, f = cfg.hidden_size, cfg.moe_intermediate_size
    block = f"{pre}.block_sparse_moe"
    yield from _linear(f"{block}.router.layer", path + ("router",), d, cfg.n_experts)
    for e in range(cfg.n_experts):
        yield from _fused_mlp(block, path, d, f, e)
    if cfg.shared_intermediate_size:
        yield from _fused_mlp(f"{pre}.shared_mlp", path + ("shared",), d, cfg.shared_intermediate_size)


def _gpt_oss_moe(cfg: ModelConfig, pre: str, path: tuple, mxfp4: bool = False) -> Iterator[Entry]:
    """GPT-OSS's MLP: a router with a bias, and the experts as three stacked tensors stored [in, out] with biases:
    ``gate_up_proj`` [N, D, 2F] whose gate and up columns alternate, ``down_proj`` [N, F, D]. ``mxfp4``: the hub
    release's, each matrix as ``*_blocks`` [N, out, in / 32, 16] and ``*_scales`` [N, out, in / 32] (uint8), rows
    [out, in], gate and up the even and odd rows of ``gate_up_proj``."""
    d, f, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_experts
    block, ex = f"{pre}.mlp", f"{pre}.mlp.experts"
    yield from _linear(f"{block}.router", path + ("router",), d, n, bias=True)
    if mxfp4:
        yield from _mxfp4_experts(f"{ex}.gate_up_proj", ((path + ("gate",), (0, 2)), (path + ("up",), (1, 2))), f, d, n)
    else:
        for e in range(n):
            yield Entry(f"{ex}.gate_up_proj", path + ("gate",), (d, f), expert=e, stacked=True, columns=(0, 2))
            yield Entry(f"{ex}.gate_up_proj", path + ("up",), (d, f), expert=e, stacked=True, columns=(1, 2))
    yield Entry(f"{ex}.gate_up_proj_bias", path + ("gate_bias",), (n, f), columns=(0, 2))
    yield Entry(f"{ex}.gate_up_proj_bias", path + ("up_bias",), (n, f), columns=(1, 2))
    if mxfp4:
        yield from _mxfp4_experts(f"{ex}.down_proj", ((path + ("down",), None),), d, f, n)
    else:
        for e in range(n):
            yield Entry(f"{ex}.down_proj", path + ("down",), (f, d), expert=e, stacked=True)
    yield Entry(f"{ex}.down_proj_bias", path + ("down_bias",), (n, d))


MXFP4_PARTS = ("blocks", "scales")


def _mxfp4_experts(key: str, matrices, rows: int, n_in: int, n: int) -> Iterator[Entry]:
    """The entries of one MXFP4 expert tensor pair ``{key}_blocks`` [N, R, in / 32, 16] and ``{key}_scales``
    [N, R, in / 32]: ``matrices`` are (tree path, ``row_step``) of the matrices of ``rows`` rows it holds."""
    for part in MXFP4_PARTS:
        tail = (16,) if part == "blocks" else ()
        for e in range(n):
            for path, row_step in matrices:
                yield Entry(f"{key}_{part}", path, (rows, n_in // 32, *tail), expert=e, stacked=True, mxfp4=part,
                            row_step=row_step)


def is_mxfp4_release(keys, cfg: ModelConfig) -> bool:
    """Whether a checkpoint with these tensor names holds GPT-OSS's experts as MXFP4 (the hub's release)."""
    return cfg.model_type == GPT_OSS and any(k.endswith(".mlp.experts.gate_up_proj_blocks") for k in keys)


def _moe(cfg: ModelConfig, pre: str, path: tuple, mxfp4: bool = False) -> Iterator[Entry]:
    d, f, mt = cfg.hidden_size, cfg.moe_intermediate_size, cfg.model_type
    if mt in GRANITE:
        yield from _granite_moe(cfg, pre, path)
        return
    if mt == GPT_OSS:
        yield from _gpt_oss_moe(cfg, pre, path, mxfp4)
        return
    block = f"{pre}.{_MOE_PREFIX.get(mt, 'mlp')}"
    yield from _linear(f"{block}.gate.wg" if mt == HUNYUAN else f"{block}.gate", path + ("router",), d, cfg.n_experts)
    if mt in SELECTION_BIASED:  # the selection bias (float32 in the files and in moejax: weights.FLOAT32_PARAMS)
        yield Entry(f"{block}.gate.e_score_correction_bias", path + ("score_bias",), (cfg.n_experts,))
    elif mt == ERNIE:  # ERNIE-4.5's, [1, N] in the files (one "group" of experts)
        yield Entry(f"{block}.moe_statics.e_score_correction_bias", path + ("score_bias",), (cfg.n_experts,),
                    lead_one=True)
    gate, up, down = _EXPERT_NAMES.get(mt, ("gate_proj", "up_proj", "down_proj"))
    for e in range(cfg.n_experts):
        ex = f"{block}.experts.{e}"
        yield Entry(f"{ex}.{gate}.weight", path + ("gate",), (f, d), True, e)
        yield Entry(f"{ex}.{up}.weight", path + ("up",), (f, d), True, e)
        yield Entry(f"{ex}.{down}.weight", path + ("down",), (d, f), True, e)
    if cfg.shared_intermediate_size:
        yield from _mlp(f"{block}.{_SHARED_NAME[mt]}", path + ("shared",), d, cfg.shared_intermediate_size,
                        cfg.mlp_bias)
    if cfg.shared_expert_gate:
        yield from _linear(f"{block}.shared_expert_gate", path + ("shared_gate",), d, 1)


def entries(cfg: ModelConfig, mxfp4: bool = False) -> list[Entry]:
    """Every tensor a hub checkpoint of this configuration holds, in a stable order (``mxfp4``: GPT-OSS's
    release, its experts as MXFP4 blocks and scales)."""
    d, out = cfg.hidden_size, []
    out.append(Entry("model.embed_tokens.weight", ("embed",), (cfg.vocab_size, d)))
    for i in range(cfg.num_layers):
        pre, path = f"model.layers.{i}", ("layers", i)
        out += _norm(f"{pre}.input_layernorm", path + ("attn_norm",), d, cfg)
        out += _norm(f"{pre}.post_attention_layernorm", path + ("mlp_norm",), d, cfg)
        out += _attention(cfg, f"{pre}.self_attn", path + ("attn",))
        if cfg.moe_layers[i]:
            out += _moe(cfg, pre, path + ("moe",), mxfp4)
        else:
            out += _mlp(f"{pre}.mlp", path + ("mlp",), d, cfg.intermediate_size, cfg.mlp_bias)
    out += _norm("model.norm", ("final_norm",), d, cfg)
    if not cfg.tie_word_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head",), (cfg.vocab_size, d), transpose=True))
    if cfg.lm_head_bias:
        out.append(Entry("lm_head.bias", ("lm_head_bias",), (cfg.vocab_size,)))
    return out


# tensors some checkpoints carry that the model recomputes; safe to skip on import
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def ignored(key: str, cfg: ModelConfig) -> bool:
    """Tensors of a checkpoint that moejax does not use: recomputed ones (``IGNORED_SUFFIXES``) and the
    multi-token-prediction layers (a training and speculative-decoding head, which transformers skips too) of
    DeepSeek-V3 and GLM-4.5 (``model.layers.{L}...`` past the decoder's L layers) and ERNIE-4.5 (``mtp_*``)."""
    if key.endswith(IGNORED_SUFFIXES):
        return True
    if cfg.model_type == ERNIE:
        return any(part.startswith("mtp") for part in key.split("."))
    if cfg.model_type in MTP_LAYERS and key.startswith("model.layers."):
        layer = key.split(".")[2]
        return layer.isdigit() and int(layer) >= cfg.num_layers
    return False
