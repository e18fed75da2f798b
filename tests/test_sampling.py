"""Sampling as transformers does it (``sampling_lib.Sampling``): repetition penalty (greedy too), temperature, top-k,
top-p in that order, and the checkpoint's ``generation_config.json`` read as ``generate`` reads it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from support.hf_models import get_hf_model, get_moejax_model
from test_hf_parity import _informative_prompt

import moejax
from moejax import generate as generate_cli
from moejax.models.checkpoint import CheckpointError
from moejax.runtime import decode
from moejax.runtime import sampling as sampling_lib


def _hf_processed(logits: np.ndarray, seen: list[int], s: sampling_lib.Sampling) -> np.ndarray:
    """transformers' logits processors and warpers on one row, in ``generate``'s order."""
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    steps = [RepetitionPenaltyLogitsProcessor(s.repetition_penalty), TemperatureLogitsWarper(s.temperature)]
    steps += [TopKLogitsWarper(s.top_k)] if s.top_k else []
    steps += [TopPLogitsWarper(s.top_p)] if s.top_p < 1 else []
    ids = torch.as_tensor([seen], dtype=torch.long)
    return LogitsProcessorList(steps)(ids, torch.as_tensor(logits[None]))[0].numpy()


@pytest.mark.parametrize("sampling", [sampling_lib.Sampling(0.7, 0.8, 20, 1.05), sampling_lib.Sampling(1.0, 1.0, 5, 1.0),
                                      sampling_lib.Sampling(0.6, 0.95, 0, 1.3), sampling_lib.Sampling(1.5, 0.5, 50, 0.8)])
def test_the_distribution_sampled_is_transformers(sampling):
    rng = np.random.default_rng(0)
    for _ in range(5):
        logits = (rng.standard_normal(97) * 3).astype(np.float32)
        seen = sorted(set(rng.integers(0, 97, 12).tolist()))
        ours = np.asarray(sampling_lib.sampling_logits(jnp.asarray(logits), sampling,
                                                 sampling_lib.seen_tokens(sampling, 97, seen)))
        ref = _hf_processed(logits, seen, sampling)
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
        np.testing.assert_allclose(jax.nn.softmax(ours), torch.softmax(torch.as_tensor(ref), -1).numpy(), atol=1e-6)


# no subnormal logits: XLA:CPU flushes them to zero, so [7.7e-40, 0] is a tie to it and not to numpy (hypothesis
# found that pair; a logit that small is no real model's)
_ROWS = st.integers(1, 300).flatmap(lambda n: st.tuples(
    arrays(np.float32, n, elements=st.floats(-30, 30, width=32, allow_subnormal=False)),
    st.sampled_from([np.float32, jnp.bfloat16])))  # bfloat16-rounded rows tie often, as real logits do


@settings(max_examples=30, deadline=None)
@given(row=_ROWS, k=st.integers(1, 400))
@example(row=(np.array([-0.0, 0.0], np.float32), np.float32), k=1)  # -0 and +0 are one value, both stay
def test_top_k_found_without_sorting_is_the_sorted_kth_value(row, k):
    """The k-th largest value is searched a bit at a time (no sort of the vocabulary): it is the sort's."""
    values, dtype = row
    logits = np.asarray(jnp.asarray(values).astype(dtype).astype(np.float32))
    ours = np.asarray(sampling_lib.sampling_logits(jnp.asarray(logits), sampling_lib.Sampling(1.0, 1.0, k)))
    kth = np.sort(logits - logits.max())[-min(k, logits.size)]
    np.testing.assert_array_equal(np.isfinite(ours), logits - logits.max() >= kth)


@settings(max_examples=30, deadline=None)
@given(row=_ROWS, top_p=st.floats(1e-6, 1, exclude_max=True))
@example(row=(np.array([1.1754944e-38, 1.0, 0.0, 0.0], np.float32), np.float32), top_p=0.5)
def test_the_nucleus_found_without_sorting_is_the_sorted_one(row, top_p):
    """A token stays when the tokens more likely than it hold less than top_p of the mass (ties at the edge all
    stay): the sorted cumulative sum's rule, in float64 here; only tokens within float32's rounding of the
    edge may differ. "More likely" compares the float32 logits shifted to a maximum of 0, as the softmax sees
    them: 1.2e-38 and 0 are one value less 1 (hypothesis found that row: comparing the unshifted logits would
    call the first more likely, and the reference would drop the two zeros the sampler rightly keeps)."""
    values, dtype = row
    logits = np.asarray(jnp.asarray(values).astype(dtype).astype(np.float32))
    ours = np.isfinite(np.asarray(sampling_lib.sampling_logits(jnp.asarray(logits), sampling_lib.Sampling(1.0, top_p))))
    shifted = logits - logits.max()  # float32, as every softmax computes it
    probs = np.exp(np.float64(shifted))
    probs /= probs.sum()
    above = np.array([probs[shifted > x].sum() for x in shifted])  # the mass more likely than each token
    edge = np.abs(above - top_p) < 1e-5
    np.testing.assert_array_equal(ours[~edge], (above < top_p)[~edge])
    assert ours[np.argmax(logits)]


def test_sampled_tokens_stay_in_the_top_k_and_top_k_one_is_greedy():
    logits = jnp.asarray(np.random.default_rng(1).standard_normal(64).astype(np.float32))
    top = set(np.argsort(-np.asarray(logits))[:3].tolist())
    def draws(sampling, n):  # n keys in one program (each eager call took ~45 ms)
        keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n))
        return set(np.asarray(jax.vmap(lambda key: sampling_lib.sample(logits, key, sampling))(keys)).tolist())

    assert draws(sampling_lib.Sampling(5.0, 1.0, 3), 200) == top  # a high temperature reaches all three, never a fourth
    assert draws(sampling_lib.Sampling(5.0, 1.0, 1), 20) == {int(jnp.argmax(logits))}


@pytest.mark.parametrize("bad", [dict(top_k=-1), dict(top_k=2.5), dict(top_k=True), dict(repetition_penalty=0),
                                 dict(repetition_penalty=float("nan")), dict(repetition_penalty=float("inf"))])
def test_bad_sampling_values_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        sampling_lib.Sampling(**bad)


def test_greedy_with_a_repetition_penalty_matches_hf_generate():
    from transformers import GenerationConfig

    hm, mj = get_hf_model("qwen3_moe"), get_moejax_model("qwen3_moe")
    prompt, plain = _informative_prompt(hm.model)
    gc = GenerationConfig(do_sample=False, max_new_tokens=20, eos_token_id=[], pad_token_id=0,
                          repetition_penalty=1.5)
    with torch.no_grad():
        ref = hm.model.generate(torch.as_tensor([prompt]), generation_config=gc)[0, len(prompt):].tolist()
    assert ref != plain  # the penalty changes this continuation: the comparison means something
    got = mj.generate(prompt, max_new_tokens=20, stop_at_eos=False, repetition_penalty=1.5).token_ids
    assert got == ref


def test_offloaded_generation_samples_the_simulations_tokens():
    """The penalty's token set and top-k travel through both pagers: same tokens as the simulated cache."""
    m = get_moejax_model("qwen2_moe")
    kw = dict(max_new_tokens=12, stop_at_eos=False, temperature=0.9, top_k=5, repetition_penalty=1.3, seed=4,
              routing="cache-prior", cache=moejax.runtime.simulate.CacheConfig(size="0.5"))
    prompt = [5, 9, 5, 17, 3, 9]
    sim = m.generate(prompt, **kw).token_ids
    assert sim != m.generate(prompt, **{**kw, "repetition_penalty": 1.0}).token_ids
    for paging in ("host", "jit"):
        offload = moejax.runtime.offload.OffloadConfig(paging=paging)
        assert m.generate(prompt, offload=offload, **kw).token_ids == sim, paging


def test_sampling_defaults_read_generation_config_as_transformers():
    read = sampling_lib.sampling_defaults
    assert read({"do_sample": False, "temperature": 0.7}) == {}
    assert read({"do_sample": True}) == {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
    assert read({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}) \
        == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert read({"do_sample": True, "top_k": None})["top_k"] == 0
    assert read({"repetition_penalty": 1.1}) == {"repetition_penalty": 1.1}  # greedy, penalised
    for bad in ({"do_sample": True, "top_p": 0}, {"repetition_penalty": "1.1"}, {"do_sample": True, "top_k": -3}):
        with pytest.raises(ValueError):
            read(bad)


def _with_generation_config(tmp_path, config: dict) -> str:
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_damaged_sampling_setting_is_refused_at_load(tmp_path):
    with pytest.raises(CheckpointError, match=r"generation_config.json: top_p must be in"):
        moejax.load(_with_generation_config(tmp_path, {"do_sample": True, "top_p": 0}))


def test_generate_cli_starts_from_the_checkpoints_sampling(tmp_path, capsys):
    folder = _with_generation_config(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                                "repetition_penalty": 1.05})
    common = ["--model", folder, "--prompt-ids", "5,9,5,17", "--max-new-tokens", "8", "--json", "--ignore-eos"]

    def run(*extra):
        assert generate_cli.main([*common, *extra]) == 0
        out, err = capsys.readouterr()
        return json.loads(out), err

    auto, err = run()
    assert auto["stats"]["sampling"] == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                                         "from_generation_config": ["temperature", "top_p", "top_k",
                                                                    "repetition_penalty"]}
    assert "note: decoding with the checkpoint's generation_config.json" in err
    m = moejax.load(folder)
    assert auto["token_ids"] == m.generate([5, 9, 5, 17], max_new_tokens=8, stop_at_eos=False,
                                           **m.sampling_defaults).token_ids
    given, _ = run("--temperature", "0")  # greedy as asked; the penalty still comes from the file
    assert given["stats"]["sampling"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.05,
                                          "from_generation_config": ["repetition_penalty"]}
    off, err = run("--generation-config", "none")
    assert off["stats"]["sampling"]["from_generation_config"] == [] and "generation_config.json" not in err
    assert off["token_ids"] == m.generate([5, 9, 5, 17], max_new_tokens=8, stop_at_eos=False).token_ids


def test_one_compiled_program_serves_every_temperature_top_p_top_k_and_penalty():
    """The numbers are values of the program, not part of it: a server's requests each send their own, and each
    new temperature would otherwise compile the prompt and decode programs again (seconds; minutes at real
    shapes)."""
    m = get_moejax_model("qwen3_moe")
    prompt = [5, 9, 5, 17, 3, 9]
    first = m.generate(prompt, max_new_tokens=20, stop_at_eos=False, temperature=0.7, top_p=0.9, top_k=5,
                       repetition_penalty=1.1)
    again = m.generate(prompt, max_new_tokens=20, stop_at_eos=False, temperature=1.3, top_p=0.8, top_k=9,
                       repetition_penalty=1.4, seed=2)
    assert again.stats["compile_time_s"] < 0.5 < first.stats["compile_time_s"] or \
        again.stats["compile_time_s"] < first.stats["compile_time_s"] / 4
    assert again.token_ids != first.token_ids


SETTINGS = [dict(), dict(temperature=0.7, top_p=0.9, top_k=5, repetition_penalty=1.1), dict(temperature=1.2),
            dict(repetition_penalty=1.4), dict(temperature=0.9, top_k=3), dict(temperature=0.8, top_p=0.6)]


def test_steps_decided_at_run_time_give_the_fixed_steps_tokens():
    """``Sampling.decided_at_run_time`` (what a bucketed generation, the server's, uses): the same tokens as the
    steps fixed at compile time, for greedy and every sampled combination, penalty or not."""
    m = get_moejax_model("qwen3_moe")
    for setting in SETTINGS:
        fixed = sampling_lib.Sampling(**setting)
        run = lambda s: decode.generate(m.params, m.cfg, [5, 9, 5, 17], max_new_tokens=12, sampling=s,  # noqa: E731
                                        seed=3, stop_at_eos=False, bucketed=True).token_ids
        assert run(fixed.decided_at_run_time()) == run(fixed), setting


def test_a_bucketed_generation_compiles_once_for_every_sampling_setting():
    """The server's requests mix greedy and sampled decoding, top-k, top-p and penalties: after the first, none
    compiles (each new combination compiled the prompt and decode programs again)."""
    m = get_moejax_model("olmoe")
    prompt = [5, 9, 5, 17, 3, 9]
    first = m.generate(prompt, max_new_tokens=20, stop_at_eos=False, bucketed=True)
    later = [m.generate(prompt, max_new_tokens=20, stop_at_eos=False, bucketed=True, **s) for s in SETTINGS[1:]]
    assert all(r.stats["compile_time_s"] < 0.5 < first.stats["compile_time_s"] or
               r.stats["compile_time_s"] < first.stats["compile_time_s"] / 4 for r in later), \
        [r.stats["compile_time_s"] for r in later]
    assert len({tuple(r.token_ids) for r in [first, *later]}) > 2  # the settings did act
