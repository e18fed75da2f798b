"""`python -m moejax.generate`: output contract, streaming, chat template, sampling and every promised error."""

from __future__ import annotations

import json
import os
import shutil

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.commands import run_main
from support.hf_models import get_hf_model, get_moejax_model
from support.programs import compile_events
from test_evaluate import TEXT, _word_tokenizer

import moejax
from moejax.runtime import decode, generate
from moejax.runtime import sampling as sampling_lib

SUPPORTED = ("mixtral", "phimoe", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    r = run_main(generate.main, capsys, *argv)
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def tokenized_model(tmp_path_factory):
    """The tiny qwen3_moe checkpoint plus a word-level tokenizer, a chat template and WikiText style."""
    folder = str(tmp_path_factory.mktemp("gen") / "model")
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    _word_tokenizer(folder, TEXT + " user assistant : ")
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                                    "{% if add_generation_prompt %}assistant : {% endif %}"}, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "text_style": "wikitext"}, f)
    return folder


def test_json_output_contract(capsys):
    folder = get_hf_model("mixtral").folder
    rc, out, _ = _run(capsys, "--model", folder, "--prompt-ids", "5,17,42", "--max-new-tokens", "7",
                      "--ignore-eos", "--json")
    assert rc == 0
    res = json.loads(out)
    assert set(res) >= {"text", "token_ids", "stats"}
    assert len(res["token_ids"]) == 7
    for key in ("prompt_tokens", "generated_tokens", "time_to_first_token_s", "tokens_per_s"):
        assert key in res["stats"]
    assert res["stats"]["prompt_tokens"] == 3 and res["stats"]["generated_tokens"] == 7
    # greedy is the default and equals the API's greedy continuation
    ref = get_moejax_model("mixtral").generate([5, 17, 42], max_new_tokens=7, stop_at_eos=False)
    assert res["token_ids"] == ref.token_ids


def test_streamed_text_equals_final_text_and_spacing_is_undone(capsys, tokenized_model):
    rc, out, err = _run(capsys, "--model", tokenized_model, "--prompt", "The game began", "--max-new-tokens",
                        "12", "--ignore-eos")
    assert rc == 0, err
    rc, js, _ = _run(capsys, "--model", tokenized_model, "--prompt", "The game began", "--max-new-tokens", "12",
                     "--ignore-eos", "--json")
    res = json.loads(js)
    assert out.rstrip("\n").endswith(res["text"].strip())
    assert " ," not in res["text"] and " ." not in res["text"]  # WikiText spacing undone for display
    assert "tokens/s" in err


def test_chat_template_is_applied(capsys, tokenized_model):
    rc, out, err = _run(capsys, "--model", tokenized_model, "--prompt", "The game", "--chat", "--max-new-tokens",
                        "3", "--ignore-eos", "--json")
    assert rc == 0, err
    res = json.loads(out)
    from moejax.runtime.api import Tokenizer

    tok = Tokenizer(tokenized_model)
    assert res["prompt_ids"] == tok.encode("user : The game assistant : ", add_special_tokens=False)
    no_tokenizer = get_hf_model("mixtral").folder
    rc, _, err = _run(capsys, "--model", no_tokenizer, "--prompt", "hi", "--chat")
    assert rc == 2 and "tokenizer" in err
    # a tokenizer without a chat template (the default model): the plain template the server uses too
    rc, out, err = _run(capsys, "--prompt", "hi", "--chat", "--max-new-tokens", "1", "--json")
    assert rc == 0, err
    assert json.loads(out)["prompt_ids"] == moejax.load("default").encode("user: hi\nassistant:")


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(capsys):
    folder = get_hf_model("qwen3_moe").folder
    args = ["--model", folder, "--prompt-ids", "5,6,7", "--max-new-tokens", "10", "--ignore-eos", "--json"]
    runs = [json.loads(_run(capsys, *args, "--temperature", "1.5", "--seed", s)[1])["token_ids"]
            for s in ("1", "1", "2", str(1 + 2**32), "-1", str(2**32 - 1))]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[3] != runs[0] and runs[4] != runs[5]  # seeds that differ only above bit 32 differ too
    greedy = json.loads(_run(capsys, *args)[1])["token_ids"]
    nucleus = json.loads(_run(capsys, *args, "--temperature", "1.5", "--top-p", "1e-6", "--seed", "3")[1])
    assert nucleus["token_ids"] == greedy


@pytest.mark.parametrize("argv, message, status", [
    (["--model", "/nonexistent/model", "--prompt-ids", "1"], "does not exist", 1),  # a missing file: failure
    (["--prompt-ids", ""], "empty", 2),  # the rest: usage errors
    (["--prompt-ids", "1,x"], "comma-separated", 2),
    (["--prompt", "   "], "empty", 2),
    (["--prompt-ids", "1,2", "--max-new-tokens", "-1"], "max-new-tokens", 2),
    (["--prompt-ids", "99999"], "outside the vocabulary", 2),
])
def test_errors_are_one_line_with_their_status(capsys, argv, message, status):
    if "--model" not in argv:
        argv = ["--model", get_hf_model("qwen3_moe").folder, *argv]
        capsys.readouterr()  # building the shared checkpoint (first use in this worker) prints progress
    rc, _, err = _run(capsys, *argv)
    assert rc == status and err.startswith("error:") and message in err and err.count("\n") == 1


def test_prompt_longer_than_context(capsys, tmp_path):
    folder = str(tmp_path / "short")
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = 8
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    rc, _, err = _run(capsys, "--model", folder, "--prompt-ids", ",".join(["3"] * 9))
    assert rc == 2 and "longer than the context of 8" in err


def test_unsupported_model_type_lists_the_supported_ones(capsys, tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    rc, _, err = _run(capsys, "--model", str(folder), "--prompt-ids", "1")
    assert rc == 1 and "'llama'" in err  # a file the command cannot run: a failure, not a usage error
    assert all(t in err for t in SUPPORTED)


def test_text_prompt_without_tokenizer_is_refused(capsys):
    rc, _, err = _run(capsys, "--model", get_hf_model("olmoe").folder, "--prompt", "hello")
    assert rc == 2 and "--prompt-ids" in err


def test_generation_stops_at_eos():
    m = get_moejax_model("qwen3_moe")
    free = m.generate([5, 6, 7], max_new_tokens=12, stop_at_eos=False).token_ids
    eos = free[4]
    import dataclasses

    from moejax.runtime import decode

    cfg = dataclasses.replace(m.cfg, eos_token_ids=(eos,))
    stopped = decode.generate(m.params, cfg, [5, 6, 7], max_new_tokens=12).token_ids
    assert stopped == free[: free.index(eos) + 1]
    assert np.all(np.asarray(stopped[:-1]) != eos)


def test_prefill_routing_leaves_the_callers_state_usable():
    """The decode loop donates its state; with prefill_routing the decode policy must be a copy."""
    import moejax
    from moejax.experts import routing
    from moejax.runtime import simulate

    m = moejax.load(get_hf_model("qwen3_moe").folder)
    state = m.router_state("cache-prior", simulate.CacheConfig(size="0.5"))
    ids = [5, 17, 3, 42, 9]
    a = m.generate(ids, 20, state=state, prefill_routing="original")
    float(state["policy"].lam)  # raises if the caller's arrays were donated
    b = m.generate(ids, 20, state=state, prefill_routing="original")
    assert a.token_ids == b.token_ids
    trace = a.trace()
    # cache-prior λ = 0 routes as original bit for bit and shares the decode program compiled above
    ref = m.generate(ids, 20, routing=routing.make_policy("cache-prior", m.cfg.top_k, lam=0.0),
                     cache=simulate.CacheConfig(size="0.5")).trace()
    np.testing.assert_array_equal(trace["experts"][:len(ids)], ref["experts"][:len(ids)])  # prompt: original


@pytest.fixture(scope="module")
def nan_router_model(tmp_path_factory):
    """The tiny qwen3_moe checkpoint with layer 1's router weights damaged into NaN."""
    from safetensors.numpy import load_file, save_file

    folder = str(tmp_path_factory.mktemp("nan") / "model")
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.gate.weight"][:] = np.nan
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


def test_nan_routing_is_an_error_naming_the_layer_not_empty_text(capsys, nan_router_model):
    """NaN router logits are an error naming the layer, not ids like 496 and empty text with exit 0."""
    for extra in ([], ["--cache-size", "0.5", "--routing", "cache-prior"], ["--offload", "--cache-size", "0.5"]):
        rc, out, err = _run(capsys, "--model", nan_router_model, "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                            *extra)
        assert rc != 0 and err.startswith("error:") and err.count("\n") == 1, (extra, err)
        assert "MoE layer 1 (model layer 1)" in err and "NaN" in err and "Traceback" not in err
    import moejax
    from moejax.models import gating
    from moejax.runtime import simulate

    m = moejax.load(nan_router_model)
    with pytest.raises(gating.NonFiniteError, match="MoE layer 1"):
        m.forward([1, 2, 3])
    with pytest.raises(gating.NonFiniteError, match="MoE layer 1"):
        m.forward([1, 2, 3], cache=simulate.CacheConfig(size="0.5"))


def test_context_cap_is_said_and_bad_options_fail_before_any_output(capsys, tmp_path, tokenized_model):
    """A generation cut by the context says so (stderr and "stopped" in the JSON);
    bad options and an unwritable --trace-out fail before anything is printed or computed; the API refuses
    a negative budget."""
    import moejax

    folder = get_hf_model("qwen3_moe").folder  # 256 positions
    rc, out, err = _run(capsys, "--model", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", "300",
                        "--ignore-eos", "--json")
    res = json.loads(out)
    assert rc == 0 and res["stopped"] == "context_length" and len(res["token_ids"]) == 253
    assert "at most 253 new tokens (not 300)" in err
    rc, out, _ = _run(capsys, "--model", folder, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json")
    assert json.loads(out)["stopped"] in ("max_new_tokens", "eos")
    for argv, message in [(["--cache-size", "0"], "must be positive"), (["--cache-size", "2.0"], "(0, 1]"),
                          (["--trace-out", str(tmp_path / "missing" / "t.npz")], "does not exist"),
                          (["--trace-out", str(tmp_path)], "is a folder")]:
        rc, out, err = _run(capsys, "--model", tokenized_model, "--prompt", TEXT.split()[0], "--max-new-tokens", "2",
                            *argv)
        assert rc == 2 and out == "" and message in err and "Traceback" not in err, argv
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        moejax.load(folder).generate([1, 2, 3], -1)


# ------------------------------------------------------------------ stop strings, cancellation, buckets


def test_prompt_pieces_are_distinct_powers_of_two_that_add_up():
    from hypothesis import given, strategies as st

    from moejax.runtime import decode

    @given(st.integers(1, 5000))
    def check(n):
        pieces = decode.prompt_pieces(n)
        assert sum(pieces) == n and len(set(pieces)) == len(pieces) == bin(n).count("1")
        assert pieces == sorted(pieces, reverse=True) and all(p & (p - 1) == 0 for p in pieces)
        rows = decode.kv_bucket(n)
        assert rows >= max(n, decode.MIN_KV_BUCKET) and rows & (rows - 1) == 0 and rows < 2 * max(n, 64)

    check()


def _tokenized(folder):
    import moejax

    return moejax.load(folder)


def test_stop_string_ends_generation_at_the_token_that_completes_it(tokenized_model):
    from moejax.runtime import decode

    m = _tokenized(tokenized_model)
    prompt = m.encode("the cat sat on")
    full = m.generate(prompt, max_new_tokens=40, stop_at_eos=False)
    words = m.text(full.token_ids).split()
    assert len(words) > 20
    stop = " " + words[18]  # late enough to need a second decode chunk (chunks of 16)
    text = m.text(full.token_ids)
    r = m.generate(prompt, max_new_tokens=40, stop_at_eos=False, stop=[stop, "never-appears"])
    k = len(r.token_ids)
    assert r.stats["stopped"] == "stop" and r.token_ids == full.token_ids[:k]
    assert stop in m.text(r.token_ids) and stop not in m.text(r.token_ids[:-1])  # the shortest such run
    assert decode.cut_at_stops(m.text(r.token_ids), [stop]) == text[:text.find(stop)]
    assert r.stats["fed_tokens"] >= len(prompt) + k - 1  # the rest of the chunk ran (and the cache saw it)
    # a stop string in the very first token: one token, stopped there
    first = m.text(full.token_ids[:1]).strip()
    assert m.generate(prompt, max_new_tokens=40, stop=[first]).stats["stopped"] == "stop"
    # no stop string met: the usual reasons
    assert m.generate(prompt, max_new_tokens=5, stop_at_eos=False, stop=["zzz"]).stats["stopped"] == "max_new_tokens"


def test_stop_strings_with_a_simulated_cache_and_offload_give_the_same_tokens(tokenized_model):
    m = _tokenized(tokenized_model)
    prompt = m.encode("the cat sat on")
    full = m.generate(prompt, max_new_tokens=24, stop_at_eos=False)
    stop = " " + m.text(full.token_ids).split()[6]
    sim = m.generate(prompt, max_new_tokens=24, stop_at_eos=False, stop=[stop], routing="cache-prior",
                     cache=None)
    off = m.generate(prompt, max_new_tokens=24, stop_at_eos=False, stop=[stop], routing="cache-prior",
                     offload="host")
    assert sim.stats["stopped"] == off.stats["stopped"] == "stop" and sim.token_ids == off.token_ids
    assert off.stats["fed_tokens"] == len(prompt) + len(off.token_ids) - 1  # paged token by token: no overrun


def test_cancelled_generation_stops_at_the_next_chunk_and_keeps_its_cache_state(tokenized_model):
    m = _tokenized(tokenized_model)
    polls = []
    r = m.generate(m.encode("the cat"), max_new_tokens=100, stop_at_eos=False, routing="original",
                   cancelled=lambda: polls.append(1) or len(polls) >= 2)
    assert r.stats["stopped"] == "cancelled" and len(r.token_ids) == 1 + 16  # first token, then one chunk
    assert r.stats["cache"]["tokens"] == r.stats["fed_tokens"]


@pytest.mark.numerics
def test_bucketed_generation_equals_unbucketed(tokenized_model):
    """Prompt in power-of-two pieces + a power-of-two KV cache = one-piece prefill: same tokens, same routing
    trace, same cache statistics (with a cache simulated; 37 tokens = pieces of 32, 4 and 1). One case, with
    the cache: its programs are the plain ones plus the routing scan, and compiling a second set at XLA's
    level 3 doubled the suite's slowest numerics test (40 s) for no path the cached case does not take."""
    m = _tokenized(tokenized_model)
    prompt = (np.arange(37) * 7 + 3) % m.cfg.vocab_size
    kw = dict(max_new_tokens=20, stop_at_eos=False, temperature=0.8, seed=3, routing="cache-prior")
    a, b = m.generate(prompt, **kw), m.generate(prompt, bucketed=True, **kw)
    assert a.token_ids == b.token_ids
    ta, tb = a.trace(), b.trace()
    np.testing.assert_array_equal(ta["experts"], tb["experts"])
    np.testing.assert_allclose(ta["logits"], tb["logits"], atol=1e-4, rtol=1e-4)
    assert a.stats["cache"]["misses"] == b.stats["cache"]["misses"]


def test_a_repeated_request_reuses_its_compiled_programs_and_other_weights_run_them_correctly():
    """``decode.compiled_program`` keeps each prefill piece and decode chunk by signature: the same request again
    compiles nothing and calls the same executables, and a model with other weights of the same shapes runs them
    with its own weights (the tokens it gives with its programs made afresh)."""
    a = get_moejax_model("qwen3_moe")
    b = moejax.load(get_hf_model("qwen3_moe").folder)
    b.params = jax.tree.map(lambda x: x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, b.params)
    prompt, kw = np.arange(3, 40) % a.cfg.vocab_size, dict(max_new_tokens=12, stop_at_eos=False, bucketed=True)
    first = a.generate(prompt, **kw).token_ids
    with compile_events() as compiles:
        kept = dict(decode._PROGRAMS)
        assert a.generate(prompt, **kw).token_ids == first
        assert not compiles and dict(decode._PROGRAMS).keys() == kept.keys()
        reused = b.generate(prompt, **kw).token_ids
    assert not compiles  # b's weights have a's shapes: its requests ran a's programs
    decode.clear_programs()
    assert b.generate(prompt, **kw).token_ids == reused and reused != first


def test_a_generations_programs_compile_side_by_side_and_run_as_compiled_one_by_one(monkeypatch):
    """``decode.compiled_programs``: the prompt's pieces and the decode chunk are compiled each on a thread of its
    own (XLA compiles outside the interpreter lock), and the tokens are those of programs compiled one by one."""
    m = get_moejax_model("qwen3_moe")
    prompt, kw = np.arange(3, 40) % m.cfg.vocab_size, dict(max_new_tokens=20, stop_at_eos=False, bucketed=True)
    decode.clear_programs()
    threads = []
    listen = lambda name: threads.append((name, threading.current_thread().name))  # noqa: E731
    decode.COMPILE_LISTENERS.append(listen)
    try:
        together = m.generate(prompt, **kw).token_ids
    finally:
        decode.COMPILE_LISTENERS.remove(listen)
    assert len(threads) >= 3 and all(t.startswith("moejax-compile") for _, t in threads), threads
    assert {name for name, _ in threads} == {"prefill", "decode_chunk"}
    decode.clear_programs()
    monkeypatch.setattr(decode, "compiled_programs", lambda jobs, params, sig=None: [
        decode.compiled_program(fn, params, args, statics, sig) for fn, args, statics in jobs])
    assert m.generate(prompt, **kw).token_ids == together
    decode.clear_programs()


def test_a_prompt_compiles_once_per_prompt_bucket_whatever_the_generation_length():
    """Bucketed, a prompt runs on a KV cache of its own bucket, grown to the generation's after it: a longer
    generation from a prompt of the same bucket compiles its decode chunk (and the growth) but no prefill piece,
    and gives the tokens the unbucketed generation gives."""
    m = get_moejax_model("qwen3_moe")
    prompt = np.arange(5, 28) % m.cfg.vocab_size  # 23 tokens: pieces of 16, 4, 2, 1
    kw = dict(stop_at_eos=False, bucketed=True)
    short = m.generate(prompt, max_new_tokens=4, **kw).token_ids
    with compile_events() as compiles:
        long = m.generate(prompt, max_new_tokens=150, **kw).token_ids  # a KV bucket of 256 rows, not 64
    assert compiles and not [c for c in compiles if "prefill" in str(c)], compiles
    assert long[:4] == short
    assert long == m.generate(prompt, max_new_tokens=150, stop_at_eos=False).token_ids


def test_on_cache_reports_every_fed_token_and_the_state_as_it_goes(tokenized_model):
    """on_cache (the server's live view) sees every token's experts and hits, simulated or offloaded, and its
    last cache state is the result's."""
    m = _tokenized(tokenized_model)
    prompt = m.encode("the cat sat on")
    for offload in (None, "host"):
        seen, resident = [], []

        def on_cache(cache_state, experts, hits):
            seen.append((np.asarray(experts), np.asarray(hits)))
            resident.append(np.asarray(cache_state.resident))

        r = m.generate(prompt, max_new_tokens=20, stop_at_eos=False, routing="cache-prior", offload=offload,
                       on_cache=on_cache)
        experts = np.concatenate([e for e, _ in seen])
        hits = np.concatenate([h for _, h in seen])
        trace = r.trace()
        np.testing.assert_array_equal(experts, trace["experts"])
        np.testing.assert_array_equal(hits, trace["hits"])
        assert len(seen) >= (2 if offload is None else 1 + 19)  # prompt, then chunks (offloaded: tokens)
        np.testing.assert_array_equal(resident[-1], np.asarray(r.router_state["cache"].resident))
        assert int((~hits & (experts >= 0)).sum()) == r.stats["cache"]["misses"]


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 1e-45])
def test_a_vanishing_temperature_samples_the_greedy_token(temperature):
    """A subnormal temperature samples the greedy token: logits / T must not turn into inf / NaN and sample
    garbage (token 0, EOS)."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((1000,)) * 5, jnp.float32)
    for seed in range(5):
        for top_p in (1.0, 0.9):
            got = sampling_lib.sample(logits, jax.random.PRNGKey(seed), sampling_lib.Sampling(temperature, top_p))
            assert int(got) == int(jnp.argmax(logits))


def test_a_cache_flag_alone_turns_the_cache_on(capsys):
    """--eviction, --cache-scope, ... given alone turn the cache on, not a run without one (exit 0, no
    statistics)."""
    for flags, key, value in ((["--eviction", "lfu"], "eviction", "lfu"), (["--cache-scope", "global"], "scope", "global"),
                              (["--cache-init", "random"], "cache_init", "random"),
                              (["--eviction", "lru"], "eviction", "lru"),  # its default value: given all the same
                              (["--miss", "fetch"], "miss", "fetch")):
        assert generate.main(["--model", get_hf_model("qwen3_moe").folder, "--prompt-ids", "5,17",
                              "--max-new-tokens", "2", "--json", *flags]) == 0
        cache = json.loads(capsys.readouterr().out)["stats"]["cache"]
        assert cache[key] == value


def test_a_result_that_stdout_cannot_take_is_one_error_line():
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "moejax.generate", "--prompt-ids", "5,17", "--max-new-tokens", "1",
                               "--json"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr == "error: could not write the result to stdout: No space left on device\n"


def test_generate_names_a_bad_argument_instead_of_coercing_it():
    """Floats, bools, strings and ids past int32 are refused, not truncated or wrapped into other prompts; bad
    scalars are named, not failing deep inside (or running: seed=1.5 as 1); one stop string is not split into
    characters."""
    m = moejax.load(get_hf_model("qwen3_moe").folder)
    with pytest.raises(ValueError, match="floating type"):  # every weight cast to zeros, failing later
        moejax.load(get_hf_model("qwen3_moe").folder, dtype="int8")
    for prompt in ([1.7, 2.2], np.array([2**32 + 1, 2]), ["1", "2"], [True, False], "123", [[1, 2]], 5, []):
        with pytest.raises(ValueError, match="prompt_ids"):
            m.generate(prompt, max_new_tokens=2)
    for kw, name in ((dict(seed=1.5), "seed"), (dict(chunk=0), "chunk"), (dict(max_new_tokens="2"), "max_new_tokens"),
                     (dict(temperature="1"), "temperature"), (dict(on_tokens=5), "on_tokens")):
        with pytest.raises((TypeError, ValueError), match=name):
            m.generate([1, 2], **kw)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        m.generate([1, 2], stop="8")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m.forward(np.arange(m.cfg.max_position_embeddings + 1) % m.cfg.vocab_size)
    d = moejax.load("default")
    ids = d.encode("The history of the city")
    whole = d.generate(ids, max_new_tokens=20, stop_at_eos=False)
    one = d.generate(ids, max_new_tokens=20, stop_at_eos=False, stop="zzq.")  # not 'z', 'q', '.'
    assert one.token_ids == whole.token_ids and one.stats["stopped"] == "max_new_tokens"


def test_a_subnormal_top_p_keeps_the_most_likely_token():
    logits = jnp.asarray([0.1, 3.0, 0.2, -1.0])
    for top_p in (1e-40, 1e-45, 1e-30):
        for seed in range(3):
            got = sampling_lib.sample(logits, jax.random.PRNGKey(seed), sampling_lib.Sampling(1.0, top_p))
            assert int(got) == 1


def test_sampling_flags_under_greedy_decoding_are_noted_not_silently_dropped(capsys):
    """--top-p and --seed change nothing at --temperature 0: the run says so on stderr (exit 0, same tokens);
    with sampling the note is absent and the seed acts."""
    folder = get_hf_model("mixtral").folder
    base = ("--model", folder, "--prompt-ids", "5,17,42", "--max-new-tokens", "4", "--ignore-eos", "--json")
    rc, plain, err = _run(capsys, *base)
    assert rc == 0 and "note:" not in err
    rc, noted, err = _run(capsys, *base, "--top-p", "0.5", "--seed", "3")
    assert rc == 0 and "--top-p and --seed only act when sampling" in err
    assert json.loads(noted)["token_ids"] == json.loads(plain)["token_ids"]
    rc, sampled, err = _run(capsys, *base, "--temperature", "1.0", "--seed", "3")
    assert rc == 0 and "note:" not in err
    again = get_moejax_model("mixtral").generate([5, 17, 42], max_new_tokens=4, stop_at_eos=False, temperature=1.0,
                                                 seed=3)
    assert json.loads(sampled)["token_ids"] == again.token_ids


def test_routing_cache_and_state_arguments_of_the_wrong_kind_are_named():
    """routing=5, cache="4", a foreign state dict, cache= beside state=, and CacheConfig fields no model can
    run failed deep inside jit (AttributeError on a tracer, KeyError 'cache', max() of an empty tuple) or were
    silently ignored (cache= beside state=)."""
    from moejax.evaluation import tasks
    from moejax.runtime import simulate

    m = moejax.load(get_hf_model("qwen3_moe").folder)
    for call in (m.forward, lambda ids, **kw: m.generate(ids, max_new_tokens=2, **kw)):
        for kw, message in ((dict(routing=5), "routing must be a kind name"),
                            (dict(cache="4"), r"cache must be a simulate.CacheConfig \(e.g. CacheConfig\(size='4'\)\)"),
                            (dict(state={"cache": 1}), "state must be a router state"),
                            (dict(state=[1]), "state must be a router state")):
            with pytest.raises(TypeError, match=message):
                call([1, 2, 3], **kw)
        with pytest.raises(ValueError, match="cache= or state=, not both"):
            call([1, 2, 3], state=m.router_state(), cache=simulate.CacheConfig(size="2"))
    for kw, message in ((dict(miss="drop", miss_rank=()), "miss rank"), (dict(eviction="lru2"), "eviction 'lru2'"),
                        (dict(scope="model"), "scope"), (dict(init="full"), "init"), (dict(prefetch=-1.0), "prefetch"),
                        (dict(size=None), "size must be")):
        with pytest.raises((TypeError, ValueError), match=message):
            simulate.CacheConfig(**kw)
    d = moejax.load("default")
    folder = os.path.join(os.path.dirname(__file__), "data", "tasks", "mmlu")
    for kw, message in ((dict(limit=1.5), "limit must be an integer"), (dict(limit=True), "limit must be an integer"),
                        (dict(bogus=1), "option 'bogus', which Model.forward"),
                        (dict(state_=1), "option 'state_'"), (dict(stop="x"), "sets 'stop' itself")):
        with pytest.raises((TypeError, ValueError), match=message):
            tasks.evaluate_task(d, "mmlu", folder, shots=0, **kw)
    with pytest.raises(TypeError, match="option 'bogus', which Model.generate"):
        tasks.evaluate_task(d, "gsm8k", os.path.join(os.path.dirname(folder), "gsm8k"), shots=0, limit=1, bogus=1)


@pytest.mark.parametrize("temperature", [1e300, float("inf")])
def test_a_huge_temperature_samples_uniformly_without_overflow_warnings(temperature):
    """--temperature 1e300 printed two numpy overflow warnings (casts to float32); T → inf is uniform sampling."""
    import warnings

    logits = jnp.asarray([10.0, 0.0, -10.0, -1e4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [int(sampling_lib.sample(logits, jax.random.PRNGKey(s), sampling_lib.Sampling(temperature))) for s in range(200)]
    assert set(got) == {0, 1, 2, 3}  # every token, the least likely too


def test_api_arguments_that_failed_deep_inside_or_were_ignored_are_named():
    """Arguments a probe of the Python API tried: each would run silently wrong, or fail far from the argument,
    unless checked where it is given."""
    from moejax import offload, simulate

    m = moejax.load(get_hf_model("qwen3_moe").folder)
    d = moejax.load("default")  # other layers and N
    cc = simulate.CacheConfig("4")
    cases = [
        (lambda: moejax.load(None), TypeError, "path"),
        (lambda: moejax.load(m.path, dtype="float64"), ValueError, "float64"),  # loaded float32 without a word
        (lambda: moejax.load(m.path, shard="experts", devices=1.5), TypeError, "devices"),
        (lambda: m.forward([1, 2, 3], state=d.router_state("cache-prior", simulate.CacheConfig("2"))),
         ValueError, "another model's"),  # broadcast error 17 frames deep
        (lambda: m.forward([1, 2], state={"cache": 1, "routing": 2, "policy": 3}), TypeError, "state"),
        (lambda: m.forward([1, 2, 3], sequential="yes"), TypeError, "sequential"),
        (lambda: m.forward([1, 2, 3], cache=cc, offload=offload.OffloadConfig(paging="jit")), ValueError,
         "paging='jit'"),  # ran host paging and said so in its stats
        (lambda: m.generate([1, 2], 2, chunk=4, cache=cc, offload=offload.OffloadConfig()), ValueError, "chunk"),
        (lambda: m.memory_plan(cc, None), TypeError, "memory_plan"),
        (lambda: m.memory_plan(None, True), TypeError, "memory_plan"),
        (lambda: simulate.CacheConfig(init="random", seed=float("nan")), TypeError, "seed"),
        (lambda: simulate.CacheConfig(seed=1.5), TypeError, "seed"),  # ran as seed 1
        (lambda: simulate.CacheConfig(miss="drop", miss_rank=1), TypeError, "miss_rank"),
        (lambda: simulate.CacheConfig(miss="cascade", quant_group=0), ValueError, "quant_group"),
        (lambda: moejax.load(m.path, expert_dtype="int8").forward([1, 2, 3], cache=cc, offload=offload.OffloadConfig()),
         ValueError, "int8"),  # paged dequantised copies: bytes moved ≠ loads × the cache's expert bytes
    ]
    for call, kind, words in cases:
        with pytest.raises(kind, match=words):
            call()
    for messages in ("hello", [{"role": "user"}], [], [{"role": "user", "content": 5}]):
        with pytest.raises(TypeError, match="messages"):
            d.chat_ids(messages)
