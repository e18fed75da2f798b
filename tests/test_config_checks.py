"""Configs moejax cannot run, or would run wrong, are refused from the config alone: one line naming the field,
in milliseconds, before anything is allocated (``moejax.models.config``); and every float option of every command
refuses values that are not finite or that overflow float32 (``moejax.base.flags.finite_float``)."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import time

import pytest
from hypothesis import given, settings, strategies as st
from test_bad_inputs import CLIS

from moejax.base import flags
from moejax.models.config import UnsupportedModelError, from_hf
from moejax.testing import random_checkpoint as rc

TINY = {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 32, "head_dim": 8, "intermediate_size": 32,
        "moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1}
SMALL = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "bos_token_id": 0, "eos_token_id": 1}
BASES = {  # tiny cuts of real configs: (preset, layers, overrides)
    "qwen3": ("qwen3-30b-a3b", 2, TINY),
    "qwen2": ("qwen1.5-moe-a2.7b", 2, {**SMALL, "intermediate_size": 64, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 48, "num_key_value_heads": 4,
                                       "num_experts": 8, "num_experts_per_tok": 2}),
    "mixtral": ("mixtral-8x7b", 2, {**SMALL, "intermediate_size": 32, "num_key_value_heads": 2,
                                    "num_local_experts": 4}),
    "phimoe": ("phi-3.5-moe", 2, {**SMALL, "hidden_size": 256, "num_attention_heads": 2, "intermediate_size": 32,
                                  "num_key_value_heads": 1, "num_local_experts": 4,
                                  "max_position_embeddings": 131072}),
    "olmoe": ("olmoe-1b-7b", 2, {**SMALL, "intermediate_size": 32, "num_key_value_heads": 4, "num_experts": 8,
                                 "num_experts_per_tok": 2}),
    "granite": ("granite-3.0-1b-a400m", 2, {**SMALL, "intermediate_size": 32, "num_key_value_heads": 2,
                                            "num_local_experts": 8, "num_experts_per_tok": 2}),
    "deepseek_v2": ("deepseek-v2-lite", 2, {**SMALL, "intermediate_size": 64, "moe_intermediate_size": 32,
                                            "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                                            "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                                            "num_key_value_heads": 4}),
    "deepseek_v3": ("deepseek-v3", 4, {**SMALL, "intermediate_size": 64, "moe_intermediate_size": 32,
                                       "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 16,
                                       "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 16,
                                       "num_experts_per_tok": 4, "num_key_value_heads": 4}),
    "gpt_oss": ("gpt-oss-20b", 2, {**SMALL, "head_dim": 16, "intermediate_size": 64, "num_key_value_heads": 2,
                                   "num_local_experts": 4, "pad_token_id": 0}),
}


def base(name: str, **changes) -> dict:
    preset, layers, sets = BASES[name]
    return {**rc.with_overrides(rc.preset_config(preset), layers, sets, "float32"), **changes}


def refused(config: dict) -> str:
    """``from_hf``'s refusal of ``config``: one line, in well under a second."""
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedModelError) as e:
        from_hf(config)
    assert time.perf_counter() - t0 < 1.0
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name", sorted(BASES))
def test_the_tiny_bases_parse(name):
    from_hf(base(name))


# (case id, base, changes, what the error line names)
BAD_CONFIGS = [
    ("kv-heads-not-dividing-heads", "qwen3", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("kv-heads-above-heads", "qwen3", {"num_key_value_heads": 8}, "num_key_value_heads"),
    ("gpt-oss-sliding-window-zero", "gpt_oss", {"sliding_window": 0}, "sliding_window"),
    ("gpt-oss-sliding-window-null", "gpt_oss", {"sliding_window": None}, "sliding_window"),
    ("mixtral-sliding-window-zero", "mixtral", {"sliding_window": 0}, "sliding_window"),
    ("qwen3-sliding-window-zero", "qwen3", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
    ("sliding-window-past-int32", "mixtral", {"sliding_window": 2**40}, "sliding_window"),
    ("hidden-size-1e9-derived-head-dim", "mixtral", {"hidden_size": 10**9}, "hidden_size"),
    ("hidden-size-1e12", "qwen3", {"hidden_size": 10**12}, "hidden_size"),
    ("hidden-size-below-heads", "mixtral", {"hidden_size": 2}, "hidden_size"),
    ("head-dim-1e9", "qwen3", {"head_dim": 10**9}, "head_dim"),
    ("qk-rope-head-dim-1e9", "deepseek_v3", {"qk_rope_head_dim": 10**9}, "qk_rope_head_dim"),
    ("vocab-past-int32", "qwen3", {"vocab_size": 2**40}, "vocab_size"),
    ("positions-past-int32", "qwen3", {"max_position_embeddings": 10**12}, "max_position_embeddings"),
    ("expert-stack-beyond-2-40", "qwen3", {"num_experts": 1 << 16, "hidden_size": 1 << 14,
                                           "moe_intermediate_size": 1 << 14}, "moe_intermediate_size"),
    ("parameters-beyond-1e13", "qwen3", {"num_hidden_layers": 4096, "num_experts": 256, "hidden_size": 1 << 14,
                                         "moe_intermediate_size": 1 << 14}, "parameters"),
    ("rms-norm-eps-zero", "qwen3", {"rms_norm_eps": 0}, "rms_norm_eps"),
    ("rms-norm-eps-nan", "qwen3", {"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ("rms-norm-eps-huge", "qwen3", {"rms_norm_eps": 1e300}, "rms_norm_eps"),
    ("rope-theta-past-float32", "qwen3", {"rope_theta": 1e39}, "rope_theta"),
    ("rope-theta-huge-integer", "qwen3", {"rope_theta": 10**400}, "rope_theta"),
    ("rope-parameters-theta-negative", "qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
     "rope_theta"),
    ("yarn-rope-theta-one", "qwen3", {"rope_theta": 1, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}, "rope_theta"),
    ("yarn-factor-past-float32", "qwen3", {"rope_scaling": {
        "rope_type": "yarn", "factor": 1e300, "original_max_position_embeddings": 16}}, "factor"),
    ("longrope-original-one", "phimoe", {"rope_scaling": {
        "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 1, "short_factor": [1.0] * 64,
        "long_factor": [1.0] * 64, "short_mscale": 1.0, "long_mscale": 1.0}}, "original_max_position_embeddings"),
    ("longrope-factor-zero", "phimoe", {"rope_scaling": {
        "rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 4096,
        "short_factor": [0.0] * 64, "long_factor": [1.0] * 64, "short_mscale": 1.0, "long_mscale": 1.0}},
     "short_factor"),
    ("decoder-sparse-step-zero", "qwen3", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("max-window-layers-a-string", "qwen2", {"use_sliding_window": True, "sliding_window": 4,
                                             "max_window_layers": "all"}, "max_window_layers"),
    ("moe-layer-freq-a-string", "deepseek_v2", {"moe_layer_freq": "x"}, "moe_layer_freq"),
    ("moe-layer-freq-zero", "deepseek_v2", {"moe_layer_freq": 0}, "moe_layer_freq"),
    ("q-lora-rank-zero", "deepseek_v2", {"q_lora_rank": 0}, "q_lora_rank"),
    ("qk-rope-head-dim-odd", "deepseek_v2", {"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ("deepseek-v2-group-limited-without-groups", "deepseek_v2", {"topk_method": "group_limited_greedy",
                                                                 "n_group": None, "topk_group": None},
     "n_group"),
    ("deepseek-v2-routed-scaling-a-string", "deepseek_v2", {"routed_scaling_factor": "x"}, "routed_scaling_factor"),
    ("deepseek-v3-top-k-beyond-the-kept-groups", "deepseek_v3", {"n_group": 8, "topk_group": 1},
     "num_experts_per_tok"),
    ("deepseek-v3-routed-scaling-negative", "deepseek_v3", {"routed_scaling_factor": -2.5}, "routed_scaling_factor"),
    ("phimoe-jitter-nan", "phimoe", {"router_jitter_noise": float("nan")}, "router_jitter_noise"),
    ("olmoe-clip-qkv-negative", "olmoe", {"clip_qkv": -1}, "clip_qkv"),
    ("granite-multiplier-past-float32", "granite", {"embedding_multiplier": 1e39}, "embedding_multiplier"),
    ("gpt-oss-swiglu-limit-past-float32", "gpt_oss", {"swiglu_limit": 1e39}, "swiglu_limit"),
    ("bos-token-negative", "qwen3", {"bos_token_id": -1}, "bos_token_id"),
]


@pytest.mark.parametrize("family, changes, field", [pytest.param(b, c, f, id=i) for i, b, c, f in BAD_CONFIGS])
def test_a_config_that_cannot_run_is_refused_naming_its_field(family, changes, field):
    message = refused(base(family, **changes))
    assert field in message, message


# ------------------------------------------------------------------------------- end to end
def _last_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error:") and sum("error:" in ln for ln in lines) == 1, err
    assert "Traceback" not in err
    return lines[-1]


RC_TINY = ["qwen3-30b-a3b", "--layers", "1", *[f"--set={k}={v}" for k, v in TINY.items()]]


@pytest.mark.parametrize("argv, field", [
    (RC_TINY + ["--set", "num_key_value_heads=3"], "num_key_value_heads"),
    (RC_TINY + ["--set", "hidden_size=1000000000000"], "hidden_size"),
    (["mixtral-8x7b", "--set", "hidden_size=1000000000"], "hidden_size"),
    (["gpt-oss-20b", "--layers", "1", "--mxfp4", *[f"--set={k}={v}" for k, v in BASES["gpt_oss"][2].items()],
      "--set", "hidden_size=48"], "hidden_size"),
    (["gpt-oss-20b", "--layers", "1", "--mxfp4", *[f"--set={k}={v}" for k, v in BASES["gpt_oss"][2].items()],
      "--set", "intermediate_size=40"], "intermediate_size"),
], ids=["kv-heads", "hidden-size-1e12", "mixtral-hidden-size-1e9", "mxfp4-hidden-size", "mxfp4-intermediate-size"])
def test_random_checkpoint_refuses_a_config_it_would_write_wrong(tmp_path, capsys, argv, field):
    out = str(tmp_path / "out")
    t0 = time.perf_counter()
    assert rc.main([argv[0], out, *argv[1:]]) == 2
    assert time.perf_counter() - t0 < 1.0
    line = _last_error(capsys)
    assert field in line and ("--set" in line or "--mxfp4" in line), line
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("config-checks") / "tiny")
    return rc.write_checkpoint(rc.with_overrides(rc.preset_config("qwen3-30b-a3b"), 2, TINY, "float32"), folder,
                               dtype="float32", seed=1)


@pytest.mark.parametrize("changes, field", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"hidden_size": 10**12}, "hidden_size"),
    ({"rope_theta": 10**400}, "rope_theta"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
], ids=["kv-heads", "hidden-size", "rope-theta-huge-integer", "sliding-window-zero"])
def test_generate_refuses_a_folder_whose_config_cannot_run(tmp_path, capsys, tiny, changes, field):
    from moejax.runtime import generate

    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    t0 = time.perf_counter()
    assert generate.main(["--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "1"]) == 1
    assert time.perf_counter() - t0 < 1.0
    assert field in _last_error(capsys)


# ------------------------------------------------------------------------------- properties
@settings(max_examples=150, deadline=None)
@given(heads=st.integers(1, 64), kv=st.integers(1, 64))
def test_heads_parse_only_in_whole_groups_of_query_heads(heads, kv):
    config = base("qwen3", num_attention_heads=heads, num_key_value_heads=kv)
    if heads % kv:
        assert "num_key_value_heads" in refused(config)
    else:
        cfg = from_hf(config)
        assert (cfg.num_heads, cfg.num_kv_heads) == (heads, kv)


@settings(max_examples=150, deadline=None)
@given(hidden=st.integers(1, 10**15), heads=st.integers(1, 1 << 20))
def test_any_hidden_size_and_heads_parse_or_are_refused_at_once(hidden, heads):
    """Whatever the sizes, parsing is arithmetic on them: a head size in range, or a refusal naming the sizes."""
    config = base("mixtral", hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=1)
    t0 = time.perf_counter()
    try:
        cfg = from_hf(config)
    except UnsupportedModelError as e:
        assert "hidden_size" in str(e) or "head" in str(e) or "parameters" in str(e), str(e)
    else:
        assert 2 <= cfg.head_dim <= 1 << 16 and cfg.head_dim == hidden // heads
    assert time.perf_counter() - t0 < 1.0


@settings(max_examples=150, deadline=None)
@given(eps=st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10**400, 10**400))
def test_rms_norm_eps_parses_only_as_a_small_positive_number(eps):
    try:
        cfg = from_hf(base("qwen3", rms_norm_eps=eps))
    except UnsupportedModelError as e:
        assert "rms_norm_eps" in str(e)
    else:
        assert 0 < cfg.norm_eps < 1


# ------------------------------------------------------------------------------- float options
class _Parsed(BaseException):
    """Raised in place of parsing: carries the command's parser out of its ``main``."""


def _parsers(monkeypatch) -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, as its ``main`` builds it, subcommands included (name -> parser)."""
    from moejax.base import collector, errors, interrupts

    for module, name in ((interrupts, "exit_cleanly_on_signals"), (collector, "for_compiling"),
                         (errors, "plain_warnings")):
        monkeypatch.setattr(module, name, lambda *a, **k: None)

    def capture(self, *a, **k):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    found = {}
    for cli, module in CLIS.items():
        with pytest.raises(_Parsed) as e:
            importlib.import_module(module).main([])
        todo = [(cli, e.value.args[0])]
        while todo:
            name, parser = todo.pop()
            found[name] = parser
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
    return found


def _is_float_option(action: argparse.Action) -> bool:
    """Whether the option's values are floats: ``type=float``, a checked float type, or a type that makes a float
    (or floats) of '0.5'."""
    kind = action.type
    if kind is float or isinstance(kind, (flags.FloatRange, flags.FloatList)):
        return True
    if kind is None or kind is int or not callable(kind):
        return False
    try:
        value = kind("0.5")
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return isinstance(value, float) or (isinstance(value, tuple) and all(isinstance(v, float) for v in value))


def float_options(monkeypatch) -> list[tuple[str, str, argparse.Action]]:
    return [(cli, action.option_strings[0], action) for cli, parser in _parsers(monkeypatch).items()
            for action in parser._actions if action.option_strings and _is_float_option(action)]


OVERFLOWS = ("inf", "-inf", "nan", "1e300", "-1e300", "1e39")


def test_every_command_has_float_options_and_they_are_found(monkeypatch):
    found = {(cli, flag) for cli, flag, _ in float_options(monkeypatch)}
    assert {("generate", "--lam"), ("evaluate", "--delta"), ("train", "--lr"), ("train_prior", "--weights"),
            ("random_checkpoint", "--std")} <= found
    assert len(found) >= 30


def _float_option_params():
    """(command, flag) of every float option, resolved at collection from the same walk as the test uses."""
    mp = pytest.MonkeyPatch()
    try:
        names = sorted({(cli, flag) for cli, flag, _ in float_options(mp)})
    finally:
        mp.undo()
    for cli, flag in names:
        yield pytest.param(cli, flag, id=f"{cli} {flag}")


@pytest.mark.parametrize("cli, flag", list(_float_option_params()))
def test_a_float_option_refuses_what_is_not_finite_or_overflows(monkeypatch, cli, flag):
    """'inf', 'nan' and numbers past float32 ('1e300' became inf in JAX, after numpy overflow warnings) are
    refused by the option's type: argparse's one line naming the flag, exit 2."""
    action = next(a for c, f, a in float_options(monkeypatch) if (c, f) == (cli, flag))
    assert action.type is not float
    for text in OVERFLOWS:
        with pytest.raises((argparse.ArgumentTypeError, ValueError, TypeError)):
            action.type(text)


def test_a_float_type_names_its_range():
    t = flags.finite_float(0.0, 1.0, low_open=True)
    assert t("0.5") == 0.5 and t("1") == 1.0
    for text in ("0", "1.5", "nan", "inf", "1e300", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"\(0, 1\]|invalid number"):
            t(text)
    with pytest.raises(ValueError):
        flags.finite_float(0.0, 1e39)  # a range past float32 would let an overflow through
    assert flags.FloatList(flags.finite_float(0.0, 1.0))("0.1,,0.2") == (0.1, 0.2)
    assert flags.FloatList(flags.finite_float(0.0, 1.0), as_text=True)("0.1,0.2") == "0.1,0.2"
