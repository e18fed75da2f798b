"""Bad inputs and faults against every ``python -m moejax.*`` command (reliability contract, ``moejax.base.errors``).

Each case runs one command's ``main(argv)`` in process (two cases run the real module as a subprocess) on
a bad flag value, a damaged or missing file, or an output it cannot write, and checks the contract:

* exit status 2 for a usage error (a flag value, name or combination the command cannot mean, an output
  that already exists or that ``--overwrite`` refuses to replace; argparse's own exit 2 counts), 1 for a
  failure (a missing, damaged or unsupported file, an unwritable output);
* stderr ends in ONE line ``error: ...`` that names the offending flag or file (a parameter named in
  words, e.g. "temperature must be >= 0", counts), and holds no traceback;
* nothing the user had changes: every file in the case's folder (and the shared tiny checkpoint) keeps
  its bytes and mtime, and no file or folder is left behind there or in ``TMPDIR``;
* no bad input reaches the expensive work: the compute entry points (decode, forward passes, training,
  the prior's recording) are replaced by tripwires, so a value that should have been refused up front
  fails fast here instead of running.

A case that breaks the contract goes into ``BUGS`` (a strict xfail, "BUG: what happens instead"): fix the
code, then remove the entry.

Cases already covered elsewhere are not repeated here (results files that are not ours, convert
--overwrite onto the source or an unrelated folder, train --export/--out reuse, --store-dir, NaN router
logits, sweep resume after a weights change, untrusted safetensors headers, damaged orbax params, corrupt
train_prior records, --trace-out into a missing folder, --cache-size 0 / 2.0 / 99999, --max-new-tokens
past the context, evaluate --context past the positions, signals).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from support.shipped_data import CUT_EXPERTS

USAGE, FAILURE = 2, 1

CLIS = {
    "generate": "moejax.generate", "evaluate": "moejax.evaluate", "convert": "moejax.convert",
    "trace": "moejax.trace", "studies": "moejax.studies", "train": "moejax.train",
    "train_prior": "moejax.train_prior", "report": "moejax.report", "plots": "moejax.plots",
    "random_checkpoint": "moejax.testing.random_checkpoint",
}

# Compute entry points: a bad input must be refused before any of these runs (module, attribute path).
TRIPWIRES = (
    ("moejax.runtime.decode", "init_kv"),  # generation: after the prompt checks, before compiling
    ("moejax.models.attention", "init_kv"),  # offloaded generation and forward passes
    ("moejax.runtime.api", "_forward_original"),  # teacher-forced passes (evaluate)
    ("moejax.runtime.simulate", "forward_with_cache"),
    ("moejax.runtime.simulate", "sweep_forward"),
    ("moejax.runtime.host_paging", "host_forward"),
    ("moejax.evaluation.sweep", "Runner._evaluate"),  # sweeps and studies: after planning, before the first point
    ("moejax.training.recipe", "compiled_steps"),  # training: before compiling the step
    ("moejax.training.train_prior", "training_tokens"),  # the prior: before recording
)

TINY_SETTINGS = {  # a 2-layer qwen3_moe at toy sizes: loads in a fraction of a second
    "vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 32, "head_dim": 8, "intermediate_size": 32,
    "moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1,
}


class ReachedWork(BaseException):
    """Raised by a tripwire: the command accepted the input and started the real work."""


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> str:
    """One tiny random HF checkpoint per session (never modified: cases that damage a model copy it)."""
    import matplotlib  # noqa: F401 - imported before any case points TMPDIR at its folder (a config dir may go there)

    from moejax.testing import random_checkpoint as rc

    folder = str(tmp_path_factory.mktemp("bad-inputs") / "tiny")
    config = rc.with_overrides(rc.preset_config("qwen3-30b-a3b"), 2, TINY_SETTINGS, "float32")
    rc.write_checkpoint(config, folder, dtype="float32", seed=1)
    return folder


def _snapshot(*roots: Path) -> dict:
    """Every file (bytes and mtime) and folder under ``roots``."""
    snap = {}
    for root in roots:
        for d, dirs, files in os.walk(root):
            snap[d] = "dir"
            for name in files:
                path = os.path.join(d, name)
                st = os.lstat(path)
                if os.path.islink(path):
                    snap[path] = ("link", os.readlink(path))
                    continue
                with open(path, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
                snap[path] = (st.st_size, st.st_mtime_ns, digest)
    return snap


def _diff(before: dict, after: dict) -> list[str]:
    problems = [f"left behind: {p}" for p in sorted(set(after) - set(before))]
    problems += [f"removed: {p}" for p in sorted(set(before) - set(after))]
    problems += [f"modified: {p}" for p in sorted(set(before) & set(after)) if before[p] != after[p]]
    return problems


def _trip(*_, **__):
    raise ReachedWork()


def _invoke(cli: str, argv: list[str]) -> tuple[object, str, str]:
    """``main(argv)`` of a command, as the interpreter would run it: (exit status, stdout, stderr)."""
    mod = importlib.import_module(CLIS[cli])
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = mod.main(argv)
        except SystemExit as e:
            rc = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except ReachedWork:
            rc = "ran"
        except Exception:  # noqa: BLE001 - an uncaught exception is a traceback and exit 1
            traceback.print_exc()
            rc = 1
    return rc, out.getvalue(), err.getvalue()


def _run_process(cli: str, argv: list[str], env: dict) -> tuple[object, str, str]:
    try:
        p = subprocess.run([sys.executable, "-m", CLIS[cli], *argv], capture_output=True, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        return "hang", "", ""
    return p.returncode, p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")


# ------------------------------------------------------------------------------------------ set-ups
def _write(rel: str, content: str | bytes) -> Callable:
    def setup(tmp: Path, tiny: str) -> None:
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return setup


def _mkdir(rel: str) -> Callable:
    return lambda tmp, tiny: (tmp / rel).mkdir(parents=True, exist_ok=True)


def _both(*setups: Callable) -> Callable:
    def setup(tmp: Path, tiny: str) -> None:
        for s in setups:
            s(tmp, tiny)
    return setup


def _model(edit: Callable[[Path], None] | None = None, rel: str = "model", src: str | None = None) -> Callable:
    """A copy of the tiny checkpoint (or ``src``: "default") at ``tmp/rel``, then ``edit(folder)``."""
    def setup(tmp: Path, tiny: str) -> None:
        if src == "default":
            from moejax.models import assets

            shutil.copytree(assets.default_model_path(), tmp / rel)
        else:
            shutil.copytree(tiny, tmp / rel)
        if edit is not None:
            edit(tmp / rel)
    return setup


def _int8_folder(edit: Callable[[Path], None] | None = None, rel: str = "q8") -> Callable:
    """The tiny checkpoint converted to a moejax folder with int8 experts (format version 3), then ``edit``."""
    def setup(tmp: Path, tiny: str) -> None:
        from moejax.models import checkpoint

        checkpoint.convert_to_moejax(tiny, str(tmp / rel), expert_dtype="int8")
        if edit is not None:
            edit(tmp / rel)
    return setup


def _q8_as_uint8(h: dict) -> None:
    h["layers.0.moe.gate.q8"]["dtype"] = "U8"  # same bytes, unsigned: not what int8 experts are


def _drop_params_tensor(key: str) -> Callable[[Path], None]:
    def fn(folder: Path) -> None:
        from safetensors.numpy import load_file, save_file

        path = str(folder / "params.safetensors")
        tensors = load_file(path)
        tensors.pop(key)
        save_file(tensors, path, metadata={"format": "moejax"})
    return fn


def _config(**changes) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        for k, v in changes.items():
            if v is _DROP:
                cfg.pop(k)
            else:
                cfg[k] = v
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


_DROP = object()


def _config_text(text: str) -> Callable[[Path], None]:
    return lambda folder: (folder / "config.json").write_text(text)


def _header(edit: Callable[[dict], None], name: str = "model.safetensors") -> Callable[[Path], None]:
    """Rewrite the safetensors header of the model file ``name`` (same data bytes)."""
    def fn(folder: Path) -> None:
        path = folder / name
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        edit(header)
        new = json.dumps(header).encode()
        new += b" " * (-len(new) % 8)
        path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return fn


def _first_expert_key(header: dict) -> str:
    return sorted(k for k in header if ".experts." in k and k.endswith("gate_proj.weight"))[0]


def _set_dtype(dtype: str) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h[_first_expert_key(h)]["dtype"] = dtype
    return edit


def _reshape_embed(h: dict) -> None:
    e = h["model.embed_tokens.weight"]
    e["shape"] = [e["shape"][1], e["shape"][0]]  # same bytes, transposed shape: 32 x 256 for 256 x 32


def _tensors(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def fn(folder: Path) -> None:
        from safetensors.numpy import load_file, save_file

        path = str(folder / "model.safetensors")
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path)
    return fn


def _drop_tensor(t: dict) -> None:
    t.pop("model.layers.1.self_attn.o_proj.weight")


def _trace(rel: str = "t.npz", tokens: int = 24, **override) -> Callable:
    def setup(tmp: Path, tiny: str) -> None:
        from moejax.experts import trace as trace_lib

        tr = trace_lib.synthetic_trace(tokens, 2, 8, 2, seed=0, with_logits=True)
        arrays = {"experts": tr.experts, "weights": tr.weights, "logits": tr.logits,
                  "n_experts": np.int64(8), "gating": np.asarray(json.dumps(tr.gating))}
        for k, v in override.items():
            if v is None:
                arrays.pop(k)
            else:
                arrays[k] = v(arrays[k]) if callable(v) else v
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp / rel, "wb") as f:
            np.savez(f, **arrays)
    return setup


def _corpus(rel: str = "corpus", shards: int = 2) -> Callable:
    def setup(tmp: Path, tiny: str) -> None:
        folder = tmp / rel
        folder.mkdir(parents=True, exist_ok=True)
        for s in range(shards):
            with gzip.open(folder / f"enwiki-2015-wikitext-style-{s:02d}.txt.gz", "wt", encoding="utf-8") as f:
                for d in range(4):
                    f.write(f" \n = Article {s} {d} = \n \n The city was built in 1900 , with 1 @,@ 200 people . \n")
    return setup


_RECORD = {"key": "k1", "study": "pareto", "task": "wikitext", "model": "m", "method": "forward", "ppl": 10.0,
           "miss_rate": 0.5, "routing": {"kind": "original"}, "cache": {"capacity": 2, "size": "2"}}
_RESULTS = _write("r.jsonl", json.dumps(_RECORD) + "\n")


# ------------------------------------------------------------------------------------------ cases
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    cli: str
    argv: tuple[str, ...]  # {tmp}: the case's folder, {tiny}: the shared tiny checkpoint
    status: int  # USAGE (2) or FAILURE (1)
    names: tuple[str, ...]  # the error line must contain one of these (a flag or a path)
    setup: Callable | None = None
    bug: str | None = None  # today's behaviour, when it breaks the contract
    process: bool = False  # run ``python -m`` for real (argv bytes, exit status and traceback as a user sees them)
    tripwires: bool = True  # False: the value is only refused while tracing the model, which is cheap here


def _make_big(folder: Path) -> None:
    """A float32 checkpoint whose weights overflow float16."""
    from moejax.testing import random_checkpoint

    random_checkpoint.main(["qwen3-30b-a3b", str(folder), "--layers", "1", "--dtype", "float32", "--std", "1e5",
                            *[f"--set={k}={v}" for k, v in TINY_SETTINGS.items()]])


def _mmlu_without_one_dev(folder: Path, tiny: str) -> None:
    """Two subjects whose questions alternate; the second one's dev file (its shots) is missing."""
    for split in ("test", "dev"):
        (folder / "mmlu" / split).mkdir(parents=True)
    for subject in ("anatomy", "zoology"):
        (folder / "mmlu" / "test" / f"{subject}_test.csv").write_text("What is it?,a,b,c,d,A\n" * 3)
    (folder / "mmlu" / "dev" / "anatomy_dev.csv").write_text("What was it?,a,b,c,d,B\n")


def G(*extra: str, model: str = "{tiny}") -> tuple[str, ...]:
    """generate on the tiny model, one new token."""
    return ("--model", model, "--prompt-ids", "1,2,3", "--max-new-tokens", "1", *extra)


def E(*extra: str) -> tuple[str, ...]:
    """evaluate on the default model (it has a tokenizer) over a small text file."""
    return ("--model", "default", "--data", "{tmp}/text.txt", "--context", "16", "--max-tokens", "8",
            "--no-progress", *extra)


TEXT = _write("text.txt", "The history of the city began in 1900 . It was built by the river .\n")
BYSTANDER = _write("mine/notes.txt", "precious")
R = ("{tmp}/r.jsonl", "--no-figures", "--out", "{tmp}/REPORT.md")
RT = ("{tmp}/r.jsonl", "--out", "{tmp}/REPORT.md", "--figures", "{tmp}/figs")  # with figures: --trace needs them
H = ("heatmap", "{tmp}/t.npz", "--cache-size", "4", "--out", "{tmp}/fig")
TP = ("--out", "{tmp}/priors", "--model", "default", "--corpus", "{tmp}/corpus", "--shards", "0")
TR = ("--out", "{tmp}/run", "--config", "tiny", "--data-dir", "{tmp}/data", "--corpus-dir", "{tmp}/corpus")
RC = ("qwen3-30b-a3b", "{tmp}/rc", "--layers", "1", *[f"--set={k}={v}" for k, v in TINY_SETTINGS.items()])

CASES = [
    # ----------------------------------------------------------------------------- generate: flags
    Case("generate-prompt-ids-negative", "generate", G()[:2] + ("--prompt-ids=-1,2",) + G()[4:], USAGE,
         ("--prompt-ids", "-1")),
    Case("generate-prompt-id-equal-to-vocab", "generate", G()[:3] + ("5,256",) + G()[4:], USAGE, ("256",)),
    Case("generate-prompt-ids-float", "generate", G()[:3] + ("1.5,2",) + G()[4:], USAGE, ("--prompt-ids",)),
    Case("generate-temperature-negative", "generate", G("--temperature", "-1"), USAGE,
         ("--temperature", "temperature")),
    Case("generate-temperature-nan", "generate", G("--temperature", "nan"), USAGE, ("--temperature", "temperature")),
    Case("generate-top-k-negative", "generate", G("--temperature", "1", "--top-k", "-2"), USAGE, ("--top-k", "top_k")),
    Case("generate-repetition-penalty-zero", "generate", G("--repetition-penalty", "0"), USAGE,
         ("--repetition-penalty", "repetition_penalty")),
    Case("generate-repetition-penalty-nan", "generate", G("--repetition-penalty", "nan"), USAGE,
         ("--repetition-penalty", "repetition_penalty")),
    Case("generate-generation-config-top-p-zero", "generate", G(model="{tmp}/model"), FAILURE,
         ("generation_config.json",),
         _model(lambda f: (f / "generation_config.json").write_text('{"do_sample": true, "top_p": 0}'))),
    Case("generate-top-p-zero", "generate", G("--temperature", "1", "--top-p", "0"), USAGE, ("--top-p", "top_p")),
    Case("generate-top-p-above-one", "generate", G("--temperature", "1", "--top-p", "1.5"), USAGE,
         ("--top-p", "top_p")),
    Case("generate-seed-not-int", "generate", G("--seed", "abc"), USAGE, ("--seed",)),
    Case("generate-dtype-unknown", "generate", G("--dtype", "int8"), USAGE, ("--dtype",)),
    Case("generate-cache-size-not-a-number", "generate", G("--cache-size", "abc"), USAGE, ("--cache-size", "abc")),
    Case("generate-cache-size-negative-fraction", "generate", G("--cache-size", "-0.5"), USAGE,
         ("--cache-size", "-0.5")),
    Case("generate-lam-nan", "generate", G("--routing", "cache-prior", "--lam", "nan"), USAGE,
         ("--lam", "lambda", "λ")),
    Case("generate-top-j-above-k", "generate", G("--routing", "cache-prior", "--top-j", "3"), USAGE,
         ("--top-j", "top-J")),
    Case("generate-max-rank-negative", "generate", G("--routing", "max-rank", "--max-rank", "-1"), USAGE,
         ("--max-rank", "max-rank M")),
    Case("generate-prune-h-zero", "generate", G("--routing", "pruning", "--prune-h", "0"), USAGE,
         ("--prune-h", "prune_h", "h=0")),
    Case("generate-cumsum-p-above-one", "generate", G("--routing", "cumsum", "--cumsum-p", "1.5"), USAGE,
         ("--cumsum-p", "cumsum")),
    Case("generate-lam-without-cache-prior", "generate", G("--lam", "0.3"), USAGE, ("--lam",)),
    Case("generate-offload-below-k-before-the-prompt-is-printed", "generate",
         ("--model", "default", "--prompt", "The city", "--max-new-tokens", "1", "--offload", "--cache-size", "1"),
         USAGE, ("K=",), tripwires=False),  # sizing the cache reads the KV cache's shapes (init_kv)
    Case("generate-prompt-past-the-context-without-a-note", "generate",
         G()[:3] + (",".join(["5"] * 70),) + G()[4:], USAGE, ("70 tokens",)),
    # flags given at their default values: compared with the default, they were silently ignored
    Case("generate-default-lam-without-cache-prior", "generate", G("--lam", "0.5"), USAGE, ("--lam",)),
    Case("generate-default-lam-with-original", "generate", G("--routing", "original", "--lam", "0.5"), USAGE,
         ("--lam",)),
    Case("generate-default-paging-without-offload", "generate", G("--paging", "host"), USAGE, ("--paging",)),
    Case("generate-default-cascade-bits-without-cascade", "generate", G("--cascade-bits", "8"), USAGE,
         ("--cascade-bits",)),
    Case("generate-store-dir-on-the-command-line", "generate", G("--offload", "--store-dir", "{tmp}/s"), USAGE,
         ("--store-dir",)),
    Case("trace-replay-default-lam-without-routing", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--lam",
                                                               "0.5"), USAGE, ("--lam",), _trace()),
    Case("generate-max-rank-with-cache-prior", "generate", G("--routing", "cache-prior", "--max-rank", "1"), USAGE,
         ("--max-rank",)),
    Case("generate-paging-without-offload", "generate", G("--paging", "jit"), USAGE, ("--paging",)),
    Case("generate-expert-store-without-offload", "generate", G("--expert-store", "flash"), USAGE,
         ("--expert-store",)),
    Case("generate-prompt-ids-empty-entry", "generate", G()[:3] + ("1,,2",) + G()[4:], USAGE, ("--prompt-ids",)),
    Case("generate-miss-rank-past-k", "generate", G("--miss", "drop", "--miss-rank", "5"), USAGE, ("miss rank",)),
    Case("generate-chat-with-prompt-ids", "generate", G("--chat"), USAGE, ("--chat",)),
    Case("generate-seed-beyond-64-bits", "generate", G("--seed", str(2**64)), USAGE, ("--seed",)),
    Case("generate-latency-infinite", "generate", G("--offload", "--latency-us", "inf"), USAGE, ("latency",)),
    Case("generate-bandwidth-vanishing", "generate", G("--offload", "--bandwidth-gbps", "1e-300"), USAGE,
         ("bandwidth",)),
    Case("generate-trace-out-a-device", "generate", G("--trace-out", "/dev/null"), USAGE, ("/dev/null",)),
    Case("generate-trace-out-in-proc", "generate", G("--trace-out", "/proc/t.npz"), USAGE, ("/proc/t.npz",)),
    Case("generate-trace-out-empty", "generate", G("--trace-out", ""), USAGE, ("--trace-out",)),
    Case("generate-trace-out-npz-is-a-folder", "generate", G("--trace-out", "{tmp}/dd"), USAGE, ("{tmp}/dd.npz",),
         _both(_mkdir("dd.npz"), _write("dd.npz/notes.txt", "mine"))),
    Case("generate-delta-negative", "generate", G("--routing", "cache-prior", "--delta", "-1"), USAGE,
         ("--delta", "delta")),
    Case("generate-delta-nan", "generate", G("--routing", "cache-prior", "--delta", "nan"), USAGE,
         ("--delta", "delta")),
    Case("generate-cascade-bits-without-cascade", "generate", G("--cascade-bits", "4"), USAGE, ("--cascade-bits",)),
    Case("generate-miss-rank-with-fetch", "generate", G("--miss-rank", "0"), USAGE, ("--miss-rank",)),
    Case("generate-cache-seed-without-random-init", "generate", G("--cache-seed", "3"), USAGE, ("--cache-seed",)),
    Case("generate-miss-rank-not-int", "generate", G("--miss", "drop", "--miss-rank", "x"), USAGE, ("--miss-rank",)),
    Case("generate-cascade-bits-3", "generate", G("--miss", "cascade", "--cascade-bits", "3"), USAGE,
         ("--cascade-bits", "cascade bit")),
    Case("generate-quant-group-zero", "generate", G("--miss", "cascade", "--quant-group", "0"), USAGE,
         ("--quant-group", "group_size"), tripwires=False),
    Case("generate-prefetch-negative", "generate", G("--prefetch", "-1"), USAGE, ("--prefetch", "prefetch overfetch")),
    Case("generate-prefetch-percentile-150", "generate", G("--prefetch-percentile", "150"), USAGE,
         ("--prefetch-percentile", "prefetch percentile")),
    Case("generate-offload-cache-below-k", "generate", G("--offload", "--cache-size", "1"), USAGE,
         ("--cache-size", "K=2")),
    Case("generate-bandwidth-zero", "generate", G("--offload", "--bandwidth-gbps", "0"), USAGE,
         ("--bandwidth-gbps", "bandwidth")),
    Case("generate-latency-negative", "generate", G("--offload", "--latency-us", "-5"), USAGE,
         ("--latency-us", "latency")),
    Case("generate-prefill-without-offload", "generate", G("--prefill", "token"), USAGE, ("--prefill", "--offload")),
    Case("generate-prefill-batched-in-jit", "generate", G("--offload", "--paging", "jit", "--prefill", "batched"),
         USAGE, ("--prefill batched", "--paging host")),
    Case("generate-trace-out-is-a-folder", "generate", G("--trace-out", "{tmp}/mine"), USAGE,
         ("--trace-out",), BYSTANDER),
    Case("generate-prior-without-learned-prior", "generate", G("--prior", "{tmp}/mine"), USAGE,
         ("--prior", "learned-prior"), BYSTANDER),
    # ----------------------------------------------------------------------------- generate: model files
    Case("generate-model-is-a-file", "generate", G(model="{tmp}/mine/notes.txt"), FAILURE,
         ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("generate-model-empty-folder", "generate", G(model="{tmp}/mine"), FAILURE, ("{tmp}/mine",), BYSTANDER),
    Case("generate-config-not-json", "generate", G(model="{tmp}/model"), FAILURE, ("{tmp}/model",),
         _model(_config_text("{not json"))),
    Case("generate-config-yarn-original-length-zero", "generate", G(model="{tmp}/model"), FAILURE,
         ("original_max_position_embeddings",), _model(_config(rope_scaling={
             "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}))),
    Case("generate-config-linear-rope-factor-string", "generate", G(model="{tmp}/model"), FAILURE, ("factor",),
         _model(_config(rope_scaling={"rope_type": "linear", "factor": "2"}))),
    Case("generate-config-bool-as-string", "generate", G(model="{tmp}/model"), FAILURE, ("norm_topk_prob",),
         _model(_config(norm_topk_prob="false"))),
    Case("generate-config-mlp-only-layers-string", "generate", G(model="{tmp}/model"), FAILURE, ("mlp_only_layers",),
         _model(_config(mlp_only_layers="0"))),
    Case("generate-generation-config-huge-integer", "generate", G(model="{tmp}/model"), FAILURE,
         ("generation_config.json",), _model(lambda f: (f / "generation_config.json").write_text(
             '{"eos_token_id": ' + "1" * 5000 + "}"))),
    Case("generate-config-is-a-list", "generate", G(model="{tmp}/model"), FAILURE, ("{tmp}/model",),
         _model(_config_text("[1, 2, 3]"))),
    Case("generate-config-not-utf8", "generate", G(model="{tmp}/model"), FAILURE, ("{tmp}/model",),
         _model(lambda f: (f / "config.json").write_bytes(b'{"model_type": "qwen3_moe\xff"}'))),
    Case("generate-config-no-model-type", "generate", G(model="{tmp}/model"), FAILURE, ("model_type",),
         _model(_config(model_type=_DROP))),
    Case("generate-config-negative-hidden-size", "generate", G(model="{tmp}/model"), FAILURE, ("hidden_size",),
         _model(_config(hidden_size=-32))),
    Case("generate-config-zero-experts", "generate", G(model="{tmp}/model"), FAILURE, ("num_experts",),
         _model(_config(num_experts=0))),
    Case("generate-config-rope-theta-zero", "generate", G(model="{tmp}/model"), FAILURE, ("rope_theta",),
         _model(_config(rope_theta=0))),
    Case("generate-config-sliding-window-negative", "generate", G(model="{tmp}/model"), FAILURE, ("sliding_window",),
         _model(_config(sliding_window=-4))),
    Case("generate-config-a-billion-experts", "generate", G(model="{tmp}/model"), FAILURE, ("number of experts",),
         _model(_config(num_experts=10**9))),
    Case("generate-config-ten-million-layers", "generate", G(model="{tmp}/model"), FAILURE, ("num_hidden_layers",),
         _model(_config(num_hidden_layers=10**7))),
    Case("generate-config-top-k-above-experts", "generate", G(model="{tmp}/model"), FAILURE,
         ("num_experts_per_tok",), _model(_config(num_experts_per_tok=9))),
    Case("generate-config-size-is-a-string", "generate", G(model="{tmp}/model"), FAILURE, ("hidden_size",),
         _model(_config(hidden_size="32"))),
    Case("generate-config-without-weights", "generate", G(model="{tmp}/model"), FAILURE, ("{tmp}/model",),
         _model(lambda f: (f / "model.safetensors").unlink())),
    Case("generate-weights-empty-file", "generate", G(model="{tmp}/model"), FAILURE, ("model.safetensors",),
         _model(lambda f: (f / "model.safetensors").write_bytes(b""))),
    Case("generate-weights-unknown-dtype", "generate", G(model="{tmp}/model"), FAILURE, ("F33", "model.safetensors"),
         _model(_header(_set_dtype("F33")))),
    Case("generate-weights-integer-dtype", "generate", G(model="{tmp}/model"), FAILURE,
         ("I32", "int32", "model.safetensors"), _model(_header(_set_dtype("I32")))),
    Case("generate-weights-wrong-shape", "generate", G(model="{tmp}/model"), FAILURE, ("embed_tokens",),
         _model(_header(_reshape_embed))),
    Case("generate-weights-missing-tensor", "generate", G(model="{tmp}/model"), FAILURE, ("o_proj",),
         _model(_tensors(_drop_tensor))),
    Case("generate-generation-config-huge-eos", "generate", G(model="{tmp}/model"), FAILURE, ("eos_token_id",),
         _model(lambda f: (f / "generation_config.json").write_text('{"eos_token_id": 99999999999999999999999}'))),
    Case("generate-generation-config-eos-a-string", "generate", G(model="{tmp}/model"), FAILURE, ("eos_token_id",),
         _model(lambda f: (f / "generation_config.json").write_text('{"eos_token_id": "x"}'))),
    Case("generate-config-rope-scaling-a-string", "generate", G(model="{tmp}/model"), FAILURE, ("rope_scaling",),
         _model(_config(rope_scaling="yarn"))),
    Case("generate-hub-id-not-cached-offline", "generate", G(model="no-such-org/no-such-model"), FAILURE,
         ("no-such-org/no-such-model",)),
    Case("evaluate-hub-id-not-cached-offline", "evaluate", ("--model", "no-such-org/moe@v2", "--task", "wikitext",
                                                            "--max-tokens", "8"), FAILURE, ("no-such-org/moe",)),
    Case("generate-generation-config-not-json", "generate", G(model="{tmp}/model"), FAILURE,
         ("generation_config.json",), _model(lambda f: (f / "generation_config.json").write_text("{oops"))),
    Case("generate-tokenizer-json-damaged", "generate", ("--model", "{tmp}/model", "--prompt", "hello"), FAILURE,
         ("tokenizer.json",), _model(lambda f: (f / "tokenizer.json").write_text("{oops"))),
    Case("generate-chat-template-broken", "generate", ("--model", "{tmp}/model", "--prompt", "hi", "--chat",
                                                        "--max-new-tokens", "1"), FAILURE,
         ("tokenizer_config.json", "chat template"), _model(lambda f: (f / "tokenizer_config.json").write_text(
             json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }"})), src="default")),
    Case("generate-prompt-not-utf8", "generate", ("--model", "default", "--prompt", "caf\udce9", "--max-new-tokens",
                                                   "1", "--json"), USAGE,
         ("--prompt", "UTF-8"), process=True),
    # ----------------------------------------------------------------------------- evaluate
    Case("evaluate-data-empty-file", "evaluate", E(), FAILURE, ("{tmp}/text.txt",), _write("text.txt", "")),
    Case("evaluate-flag-and-sweep-of-one-parameter", "evaluate", E("--lam", "0.5", "--sweep", "lam=0.9"), USAGE,
         ("--lam",), TEXT),
    Case("evaluate-truthfulqa-choices-not-a-list", "evaluate",
         ("--task", "truthfulqa", "--data", "{tmp}/tq.json", "--no-progress"), FAILURE, ("{tmp}/tq.json",),
         _write("tq.json", '[{"question": "Is it?", "mc1_targets": {"choices": 5, "labels": [1]}, '
                           '"mc2_targets": {"yes": 1, "no": 0}}]')),
    Case("evaluate-data-whitespace-only", "evaluate", E(), FAILURE, ("{tmp}/text.txt",),
         _write("text.txt", " \n\n \t\n")),
    Case("evaluate-data-not-utf8", "evaluate", E(), FAILURE, ("{tmp}/text.txt",),
         _write("text.txt", b"\xff\xfe\x00binary\x80\x81" * 20)),
    Case("evaluate-data-is-a-folder", "evaluate", E()[:3] + ("{tmp}/mine",) + E()[4:], FAILURE, ("{tmp}/mine",),
         BYSTANDER),
    Case("evaluate-gsm8k-data-not-utf8", "evaluate", ("--model", "default", "--task", "gsm8k", "--data",
                                                      "{tmp}/gsm.jsonl", "--limit", "1", "--shots", "0"), FAILURE,
         ("{tmp}/gsm.jsonl",), _write("gsm.jsonl", b'{"question": "\xff\xfe", "answer": "#### 1"}\n')),
    Case("evaluate-context-1", "evaluate", E("--context", "1"), USAGE, ("--context",), TEXT),
    Case("evaluate-batch-size-zero", "evaluate", E("--batch-size", "0"), USAGE, ("--batch-size",), TEXT),
    Case("evaluate-shots-negative", "evaluate", ("--model", "default", "--task", "mmlu", "--shots", "-1"), USAGE,
         ("--shots",)),
    Case("evaluate-sweep-a-billion-points", "evaluate", E("--sweep", "lam=0:1:1000000000"), USAGE, ("--sweep",), TEXT),
    Case("evaluate-sweep-a-billion-ranks", "evaluate", E("--sweep", "max_rank=1:1000000000"), USAGE, ("--sweep",),
         TEXT),
    Case("evaluate-sweep-grid-too-big", "evaluate", E("--sweep", "lam=0:1:1000", "--sweep", "top_j=0:1",
                                                      "--sweep", "cache_size=1:100"), USAGE, ("--sweep",), TEXT),
    Case("studies-points-a-hundred-million", "studies", ("--points", "100000000", "--out", "{tmp}/s"), USAGE,
         ("--points",)),
    Case("evaluate-coordinator-without-port", "evaluate", E("--distributed", "--coordinator", "nohost",
                                                            "--num-processes", "1", "--process-id", "0"), USAGE,
         ("coordinator",), TEXT),
    Case("evaluate-results-is-a-device", "evaluate", E("--results", "/dev/full"), FAILURE, ("/dev/full",), TEXT),
    Case("evaluate-task-data-is-a-device", "evaluate", ("--model", "default", "--task", "mmlu", "--data", "/dev/zero",
                                                        "--limit", "1"), FAILURE, ("/dev/zero",)),
    Case("evaluate-results-is-a-folder", "evaluate", E("--results", "{tmp}/mine"), FAILURE, ("{tmp}/mine",),
         _both(TEXT, BYSTANDER)),
    Case("evaluate-data-a-device", "evaluate", E()[:3] + ("/dev/null",) + E()[4:], FAILURE, ("/dev/null",)),
    Case("evaluate-sweep-unknown-parameter", "evaluate", E("--sweep", "foo=1,2"), USAGE, ("foo",), TEXT),
    # 2 experts, twice: as a count and as a share of the tests' default model's N
    Case("evaluate-sweep-one-point-twice", "evaluate", E("--sweep", f"cache_size=2,{2 / CUT_EXPERTS}"), USAGE,
         ("--sweep",), TEXT),
    Case("evaluate-sweep-without-values", "evaluate", E("--sweep", "lam="), USAGE, ("lam=",), TEXT),
    Case("evaluate-mmlu-data-empty-folder", "evaluate", ("--model", "default", "--task", "mmlu", "--data",
                                                          "{tmp}/mine", "--limit", "1"), FAILURE, ("{tmp}/mine",),
         BYSTANDER),
    Case("evaluate-model-is-a-file", "evaluate", ("--model", "{tmp}/mine/notes.txt", "--max-tokens", "8"), FAILURE,
         ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("evaluate-mmlu-with-context", "evaluate", ("--model", "default", "--task", "mmlu", "--context", "64"), USAGE,
         ("--context",)),
    Case("evaluate-mmlu-with-max-new-tokens", "evaluate", ("--model", "default", "--task", "mmlu",
                                                           "--max-new-tokens", "8"), USAGE, ("--max-new-tokens",)),
    Case("evaluate-wikitext-with-limit", "evaluate", E("--limit", "3"), USAGE, ("--limit",), TEXT),
    Case("evaluate-wikitext-with-shots", "evaluate", E("--shots", "2"), USAGE, ("--shots",), TEXT),
    Case("evaluate-batch-size-without-sweep", "evaluate", E("--batch-size", "4"), USAGE, ("--batch-size",), TEXT),
    Case("evaluate-study-without-sweep", "evaluate", E("--study", "mine"), USAGE, ("--study",), TEXT),
    # ----------------------------------------------------------------------------- trace
    Case("trace-replay-huge-expert-id", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2"), FAILURE, ("N=",),
         _trace(n_experts=None, logits=None, experts=lambda e: np.where(e == e.max(), 2**31 - 1, e))),
    Case("trace-replay-huge-n-experts", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2"), FAILURE, ("N=",),
         _trace(n_experts=np.int64(10**12), logits=None)),
    Case("trace-replay-empty-file", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2"), FAILURE,
         ("{tmp}/t.npz",), _write("t.npz", b"")),
    Case("trace-replay-text-file", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2"), FAILURE,
         ("{tmp}/t.npz",), _write("t.npz", "experts: 1 2 3\n"), process=True),
    Case("trace-replay-a-folder", "trace", ("replay", "{tmp}/mine", "--cache-size", "2"), FAILURE, ("{tmp}/mine",),
         BYSTANDER),
    Case("trace-replay-npy-not-npz", "trace", ("replay", "{tmp}/t.npy", "--cache-size", "2"), FAILURE,
         ("{tmp}/t.npy",), lambda tmp, tiny: np.save(tmp / "t.npy", np.zeros((4, 2, 2), np.int32))),
    Case("trace-replay-truncated-npz", "trace", ("replay", "{tmp}/cut.npz", "--cache-size", "2"), FAILURE,
         ("{tmp}/cut.npz",), _both(_trace(), lambda tmp, tiny: (tmp / "cut.npz").write_bytes(
             (tmp / "t.npz").read_bytes()[:-300]))),
    Case("trace-replay-expert-id-below-minus-one", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2"), FAILURE,
         ("'experts'",), _trace(experts=lambda e: np.where(e == 0, -5, e))),
    Case("trace-replay-zero-tokens", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2"), FAILURE,
         ("'experts'",), _trace(experts=np.zeros((0, 2, 2), np.int32), weights=None, logits=None)),
    Case("trace-replay-nan-logits-rerouted", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--routing",
                                                       "cache-prior"), FAILURE, ("'logits'",),
         _trace(logits=lambda z: np.where(z > 1, np.nan, z).astype(np.float32))),
    Case("trace-replay-gating-not-an-object", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--routing",
                                                        "cache-prior"), FAILURE, ("'gating'",),
         _trace(gating=np.asarray("[1, 2]"))),
    Case("trace-replay-gating-top-k-above-experts", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2",
                                                              "--routing", "cache-prior"), FAILURE, ("'gating'",),
         _trace(gating=np.asarray(json.dumps({"kind": "softmax", "top_k": 99})))),
    Case("trace-replay-gating-n-experts-differs", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2",
                                                            "--routing", "cache-prior"), FAILURE, ("'gating'",),
         _trace(gating=np.asarray(json.dumps({"kind": "softmax", "top_k": 2, "n_experts": 16})))),
    Case("trace-replay-cache-size-not-a-number", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "abc"), USAGE,
         ("abc", "cache size"), _trace()),
    Case("trace-replay-routing-needs-logits", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--routing",
                                                        "cache-prior"), FAILURE, ("'logits'",), _trace(logits=None)),
    Case("trace-replay-top-k-above-experts", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--routing",
                                                       "original", "--gating", "softmax", "--top-k", "99"), USAGE,
         ("--top-k", "top_k", "top-k"), _trace()),
    Case("trace-replay-top-k-without-gating", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--routing",
                                                        "original", "--top-k", "3"), USAGE, ("--top-k", "--gating"),
         _trace()),
    Case("trace-replay-expert-bytes-negative", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2",
                                                         "--expert-bytes", "-1"), USAGE, ("--expert-bytes",), _trace()),
    Case("trace-synth-zero-tokens", "trace", ("synth", "{tmp}/s.npz", "--tokens", "0"), USAGE,
         ("--tokens", "'experts'")),
    Case("trace-synth-zero-experts", "trace", ("synth", "{tmp}/s.npz", "--experts", "0"), USAGE, ("--experts",)),
    Case("trace-synth-top-k-above-experts", "trace", ("synth", "{tmp}/s.npz", "--experts", "4", "--top-k", "5"),
         USAGE, ("--top-k",)),
    Case("trace-synth-tokens-huge", "trace", ("synth", "{tmp}/s.npz", "--tokens", "10000000000"), USAGE,
         ("--tokens",)),
    Case("generate-prompt-ids-underscore", "generate", G()[:3] + ("1_0",) + G()[4:], USAGE, ("--prompt-ids",)),
    Case("trace-synth-rho-above-one", "trace", ("synth", "{tmp}/s.npz", "--rho", "2"), USAGE, ("--rho",)),
    Case("trace-synth-into-missing-folder", "trace", ("synth", "{tmp}/nope/s.npz",), FAILURE, ("{tmp}/nope",)),
    Case("trace-synth-onto-a-folder", "trace", ("synth", "{tmp}/dir.npz",), FAILURE, ("{tmp}/dir.npz",),
         _both(_mkdir("dir.npz"), _write("dir.npz/notes.txt", "mine"))),
    # ----------------------------------------------------------------------------- plots heatmap
    Case("plots-heatmap-garbage-trace", "plots", H, FAILURE, ("{tmp}/t.npz",), _write("t.npz", b"PK\x03\x04garbage")),
    Case("plots-heatmap-out-under-a-file", "plots", H[:-1] + ("{tmp}/mine/notes.txt/fig",), FAILURE,
         ("{tmp}/mine/notes.txt",), _both(_trace(), BYSTANDER)),
    Case("plots-heatmap-seed-without-random-init", "plots", H[:-2] + ("--seed", "3") + H[-2:], USAGE, ("--seed",),
         _trace()),
    Case("plots-heatmap-out-empty", "plots", H[:-1] + ("",), USAGE, ("--out",), _trace()),
    Case("plots-heatmap-out-a-folder", "plots", H[:-1] + ("{tmp}/mine/",), USAGE, ("--out",), _both(_trace(), BYSTANDER)),
    Case("plots-heatmap-max-tokens-zero", "plots", H + ("--max-tokens", "0"), USAGE,
         ("--max-tokens", "max_tokens"), _trace()),
    Case("plots-heatmap-start-past-the-end", "plots", H + ("--start", "500"), USAGE,
         ("--start", "start 500"), _trace()),
    Case("plots-heatmap-layer-negative", "plots", H + ("--layer", "-1"), USAGE, ("--layer", "layer -1"), _trace()),
    Case("plots-heatmap-labels-mismatch", "plots", H + ("--label", "a", "--label", "b"), USAGE, ("--label", "labels"),
         _trace()),
    Case("plots-heatmap-cache-size-not-a-number", "plots", H[:2] + ("--cache-size", "abc") + H[4:], USAGE,
         ("abc", "cache size"), _trace()),
    Case("report-results-is-a-device", "report", ("/dev/zero",) + R[1:], FAILURE, ("/dev/zero",)),
    # ----------------------------------------------------------------------------- report
    Case("report-results-empty-file", "report", R, FAILURE, ("{tmp}/r.jsonl",), _write("r.jsonl", "")),
    Case("report-results-ppl-below-one", "report", R, FAILURE, ("{tmp}/r.jsonl",),
         _write("r.jsonl", json.dumps({**_RECORD, "ppl": -5.0}) + "\n")),
    Case("report-results-miss-rate-700-percent", "report", R, FAILURE, ("{tmp}/r.jsonl",),
         _write("r.jsonl", json.dumps({**_RECORD, "miss_rate": 7.0}) + "\n")),
    Case("report-results-is-a-folder", "report", ("{tmp}/mine",) + R[1:], FAILURE, ("{tmp}/mine",), BYSTANDER),
    Case("report-results-not-utf8", "report", R, FAILURE,
         ("{tmp}/r.jsonl",), _write("r.jsonl", b"\xff\xfe\x00\x01" * 8)),
    Case("report-out-is-a-folder", "report", R[:-1] + ("{tmp}/mine",), FAILURE, ("{tmp}/mine",),
         _both(_RESULTS, BYSTANDER)),
    Case("report-out-under-a-file", "report", R[:-1] + ("{tmp}/mine/notes.txt/REPORT.md",), FAILURE,
         ("{tmp}/mine/notes.txt",), _both(_RESULTS, BYSTANDER)),
    Case("report-out-is-its-own-input", "report", R[:-1] + ("{tmp}/r.jsonl",), USAGE, ("{tmp}/r.jsonl",), _RESULTS),
    Case("report-out-is-another-file", "report", R[:-1] + ("{tmp}/mine/notes.txt",), USAGE,
         ("{tmp}/mine/notes.txt",), _both(_RESULTS, BYSTANDER)),
    Case("report-figures-is-a-file", "report", ("{tmp}/r.jsonl", "--out", "{tmp}/REPORT.md", "--figures",
                                                "{tmp}/mine/notes.txt"), USAGE, ("{tmp}/mine/notes.txt",),
         _both(_RESULTS, BYSTANDER)),
    Case("report-trace-missing", "report", RT + ("--trace", "{tmp}/nope.npz"), FAILURE, ("{tmp}/nope.npz",), _RESULTS),
    Case("report-trace-cache-size-not-a-number", "report", RT + ("--trace", "{tmp}/t.npz", "--trace-cache-size", "abc"),
         USAGE, ("abc", "--trace-cache-size"), _both(_RESULTS, _trace())),
    Case("report-trace-tokens-zero", "report", RT + ("--trace", "{tmp}/t.npz", "--trace-tokens", "0"), USAGE,
         ("--trace-tokens",), _both(_RESULTS, _trace())),
    Case("report-trace-layer-out-of-range", "report", RT + ("--trace", "{tmp}/t.npz", "--trace-layer", "9"), USAGE,
         ("--trace-layer", "layer 9"), _both(_RESULTS, _trace())),
    # ----------------------------------------------------------------------------- studies
    Case("studies-manifest-not-json", "studies", ("--only", "sensitivity", "--out", "{tmp}/s"), FAILURE,
         ("{tmp}/s/manifest.json",), _write("s/manifest.json", "{not json")),
    Case("studies-manifest-someone-elses", "studies", ("--only", "sensitivity", "--out", "{tmp}/s"), FAILURE,
         ("{tmp}/s/manifest.json",), _write("s/manifest.json", '{"owner": "alice", "studies": [1]}')),
    Case("studies-only-unknown", "studies", ("--only", "bogus", "--out", "{tmp}/s"), USAGE, ("bogus",)),
    Case("studies-mmlu-limit-zero", "studies", ("--only", "tasks", "--mmlu-limit", "0", "--out", "{tmp}/s"), USAGE,
         ("--mmlu-limit",)),
    Case("studies-gsm8k-limit-negative", "studies", ("--gsm8k-limit", "-1", "--out", "{tmp}/s"), USAGE,
         ("--gsm8k-limit",)),
    Case("studies-points-zero", "studies", ("--points", "0", "--out", "{tmp}/s"), USAGE, ("--points",)),
    Case("studies-evictions-unknown", "studies", ("--evictions", "lru,nope", "--out", "{tmp}/s"), USAGE,
         ("--evictions",)),
    Case("studies-only-empty", "studies", ("--only", "", "--out", "{tmp}/s"), USAGE, ("--only",)),
    Case("studies-limit-of-an-excluded-study", "studies", ("--only", "pareto", "--mmlu-limit", "5", "--out",
                                                          "{tmp}/s"), USAGE, ("--mmlu-limit",)),
    Case("studies-evictions-of-an-excluded-study", "studies", ("--only", "tasks", "--evictions", "lru", "--out",
                                                              "{tmp}/s"), USAGE, ("--evictions",)),
    Case("studies-context-1", "studies", ("--context", "1", "--out", "{tmp}/s"), USAGE, ("--context",)),
    Case("studies-batch-size-zero", "studies", ("--batch-size", "0", "--only", "pareto", "--model", "default",
                                                "--out", "{tmp}/s", "--data", "{tmp}/text.txt"), USAGE,
         ("--batch-size",), TEXT),
    Case("studies-model-missing", "studies", ("--model", "{tmp}/nope", "--out", "{tmp}/s"), FAILURE, ("{tmp}/nope",)),
    Case("studies-model-without-tokenizer", "studies", ("--model", "{tiny}", "--only", "pareto", "--out", "{tmp}/s"),
         FAILURE, ("tokenizer.json",)),
    Case("evaluate-model-without-tokenizer", "evaluate", ("--model", "{tiny}", "--max-tokens", "16"), FAILURE,
         ("tokenizer.json",)),
    Case("evaluate-mmlu-dev-file-missing", "evaluate", ("--model", "default", "--task", "mmlu", "--data", "{tmp}/mmlu",
                                                        "--shots", "1"), FAILURE, ("dev",), _mmlu_without_one_dev),
    Case("studies-out-is-a-file", "studies", ("--model", "{tiny}", "--only", "pareto", "--out",
                                              "{tmp}/mine/notes.txt"), USAGE, ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("studies-data-missing", "studies", ("--model", "default", "--only", "pareto", "--out", "{tmp}/s", "--data",
                                             "{tmp}/nope.txt"), FAILURE, ("{tmp}/nope.txt",), tripwires=False),
    # ----------------------------------------------------------------------------- train
    Case("train-steps-zero", "train", TR + ("--steps", "0"), USAGE, ("--steps",)),
    Case("train-config-unknown", "train", TR + ("--config", "huge"), USAGE, ("--config",)),
    Case("train-lr-negative", "train", TR + ("--lr", "-1"), USAGE, ("--lr",), _corpus()),
    Case("train-batch-zero", "train", TR + ("--batch", "0"), USAGE, ("--batch",), _corpus()),
    Case("train-seq-len-zero", "train", TR + ("--seq-len", "0"), USAGE, ("--seq-len",), _corpus()),
    Case("train-steps-auto-without-budget", "train", TR + ("--steps", "auto"), USAGE, ("--time-budget-min",),
         _corpus()),
    Case("train-warmup-past-the-steps", "train", TR + ("--steps", "10"), USAGE, ("--warmup",), _corpus()),
    Case("train-min-lr-ratio-above-one", "train", TR + ("--min-lr-ratio", "2"), USAGE, ("--min-lr-ratio",),
         _corpus()),
    Case("train-aux-coef-start-without-decay", "train", TR + ("--aux-coef-start", "1.0"), USAGE,
         ("--aux-coef-start",), _corpus()),
    Case("train-aux-decay-without-start", "train", TR + ("--aux-decay-steps", "50"), USAGE, ("--aux-coef-start",),
         _corpus()),
    Case("train-offset-decay-without-coef", "train", TR + ("--offset-decay-steps", "50"), USAGE, ("--offset-coef",),
         _corpus()),
    Case("train-offset-decay-negative", "train", TR + ("--offset-coef", "1", "--offset-decay-steps", "-5"), USAGE,
         ("--offset-decay-steps",), _corpus()),
    Case("train-corpus-empty-folder", "train", TR, FAILURE, ("{tmp}/corpus",), _mkdir("corpus")),
    Case("train-out-is-a-file", "train", ("--out", "{tmp}/mine/notes.txt") + TR[2:], USAGE,
         ("{tmp}/mine/notes.txt",), _both(BYSTANDER, _corpus())),
    Case("train-export-without-a-run", "train", ("--out", "{tmp}/mine", "--export", "{tmp}/exported"), FAILURE,
         ("{tmp}/mine",), BYSTANDER),
    Case("train-resume-run-json-garbage", "train", TR + ("--resume",), FAILURE, ("run.json",),
         _both(_corpus(), _write("run/run.json", "{garbage"))),
    # ----------------------------------------------------------------------------- train_prior
    Case("train-prior-weights-not-numbers", "train_prior", TP + ("--weights", "a,b"), USAGE, ("--weights",), _corpus()),
    Case("train-prior-weights-twice", "train_prior", TP + ("--weights", "0.5,1,0.5"), USAGE, ("--weights",),
         _corpus()),
    Case("train-prior-out-holds-a-folder-named-like-a-prior", "train_prior", TP + ("--weights", "1"), USAGE,
         ("{tmp}/priors/w1",), _both(_corpus(), _write("priors/w1/notes.txt", "precious"))),
    Case("train-prior-holdout-above-one", "train_prior", TP + ("--holdout", "1.5"), USAGE, ("--holdout",), _corpus()),
    Case("train-prior-shards-twice", "train_prior", TP[:-1] + ("0,0",), USAGE, ("--shards",), _corpus()),
    Case("train-prior-shards-not-numbers", "train_prior", TP[:-1] + ("x",), USAGE, ("--shards",), _corpus()),
    Case("train-prior-shard-missing", "train_prior", TP[:-1] + ("5",), USAGE, ("shard 5",), _corpus()),
    Case("train-prior-cache-size-zero", "train_prior", TP + ("--cache-size", "0"), USAGE,
         ("--cache-size", "cache size"),
         _corpus()),
    Case("train-prior-lr-negative", "train_prior", TP + ("--lr", "-1"), USAGE, ("--lr",), _corpus()),
    Case("train-prior-too-few-tokens-leaves-no-folder", "train_prior",
         ("--out", "{tmp}/pr/sub/deeper") + TP[2:] + ("--tokens", "99999999"), USAGE, ("tokens",), _corpus(),
         tripwires=False),  # refused once the corpus is tokenised (cheap here): the case is the folders
    Case("train-prior-corpus-missing", "train_prior", TP, FAILURE, ("{tmp}/corpus",)),
    Case("train-prior-model-missing", "train_prior", TP[:2] + ("--model", "{tmp}/nope") + TP[4:], FAILURE,
         ("{tmp}/nope",), _corpus()),
    Case("train-prior-out-is-a-file", "train_prior", ("--out", "{tmp}/mine/notes.txt") + TP[2:], USAGE,
         ("{tmp}/mine/notes.txt",), _both(BYSTANDER, _corpus())),
    # ----------------------------------------------------------------------------- convert
    Case("convert-src-index-not-json", "convert", ("hf-to-moejax", "{tmp}/model", "{tmp}/out"), FAILURE,
         ("model.safetensors.index.json",),
         _model(lambda f: ((f / "model.safetensors").rename(f / "model-00001-of-00001.safetensors"),
                           (f / "model.safetensors.index.json").write_text("{garbage")))),
    Case("convert-dst-is-a-file", "convert", ("hf-to-moejax", "{tiny}", "{tmp}/mine/notes.txt"), USAGE,
         ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("convert-dst-is-a-file-overwrite", "convert", ("hf-to-moejax", "{tiny}", "{tmp}/mine/notes.txt",
                                                        "--overwrite"), USAGE, ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("convert-dst-under-a-file", "convert", ("hf-to-moejax", "{tiny}", "{tmp}/mine/notes.txt/out"), FAILURE,
         ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("convert-src-is-a-file", "convert", ("hf-to-moejax", "{tmp}/mine/notes.txt", "{tmp}/out"), FAILURE,
         ("{tmp}/mine/notes.txt",), BYSTANDER),
    Case("convert-src-config-not-json", "convert", ("hf-to-moejax", "{tmp}/model", "{tmp}/out"), FAILURE,
         ("{tmp}/model",), _model(_config_text("{not json"))),
    Case("convert-src-weights-unknown-dtype", "convert", ("hf-to-moejax", "{tmp}/model", "{tmp}/out"), FAILURE,
         ("F33", "model.safetensors"), _model(_header(_set_dtype("F33")))),
    Case("convert-moejax-json-garbage", "convert", ("moejax-to-hf", "{tmp}/mj", "{tmp}/out"), FAILURE,
         ("moejax.json",), _model(lambda f: (f / "moejax.json").write_text("{garbage"), rel="mj")),
    Case("convert-float16-overflows", "convert", ("hf-to-moejax", "{tmp}/big", "{tmp}/out", "--dtype", "float16"),
         FAILURE, ("--dtype", "float16"), lambda tmp, tiny: _make_big(tmp / "big")),
    Case("convert-float16-overflows-into-new-folders", "convert",
         ("hf-to-moejax", "{tmp}/big", "{tmp}/new/a/out", "--dtype", "float16"), FAILURE, ("--dtype", "float16"),
         lambda tmp, tiny: _make_big(tmp / "big")),  # the folders made for the output go again
    Case("convert-expert-dtype-unknown", "convert", ("hf-to-moejax", "{tiny}", "{tmp}/out", "--expert-dtype", "int4"),
         USAGE, ("--expert-dtype",)),
    Case("convert-moejax-to-moejax-from-hf", "convert", ("moejax-to-moejax", "{tmp}/model", "{tmp}/out"), FAILURE,
         ("{tmp}/model",), _model()),
    Case("convert-moejax-to-moejax-onto-its-source", "convert", ("moejax-to-moejax", "{tmp}/q8", "{tmp}/q8",
                                                                 "--expert-dtype", "int8", "--overwrite"), USAGE,
         ("{tmp}/q8",), _int8_folder()),
    Case("generate-int8-folder-q8-unsigned", "generate", G(model="{tmp}/q8"), FAILURE, ("layers.0.moe.gate.q8",),
         _int8_folder(_header(_q8_as_uint8, "params.safetensors"))),
    Case("generate-int8-folder-scale-missing", "generate", G(model="{tmp}/q8"), FAILURE, ("layers.1.moe.down.scale",),
         _int8_folder(_drop_params_tensor("layers.1.moe.down.scale"))),
    Case("generate-int8-folder-flag-offload-jit", "generate", G("--offload", "--paging", "jit", model="{tmp}/q8"),
         USAGE, ("--paging", "paging"), _int8_folder()),
    # ----------------------------------------------------------------------------- random_checkpoint
    Case("random-checkpoint-layers-zero", "random_checkpoint", RC[:2] + ("--layers", "0") + RC[4:], USAGE,
         ("--layers",)),
    Case("random-checkpoint-layers-negative", "random_checkpoint", RC[:2] + ("--layers", "-1") + RC[4:], USAGE,
         ("--layers",)),
    Case("random-checkpoint-set-negative-size", "random_checkpoint", RC + ("--set", "hidden_size=-32"), USAGE,
         ("hidden_size",)),
    Case("random-checkpoint-set-size-not-a-number", "random_checkpoint", RC + ("--set", "hidden_size=big"), USAGE,
         ("hidden_size",)),
    Case("random-checkpoint-std-negative", "random_checkpoint", RC + ("--std", "-1"), USAGE, ("--std",)),
    Case("random-checkpoint-std-overflows", "random_checkpoint", RC + ("--std", "1e39"), USAGE, ("--std",)),
    Case("random-checkpoint-std-nan", "random_checkpoint", RC + ("--std", "nan"), USAGE, ("--std",)),
    Case("random-checkpoint-seed-negative", "random_checkpoint", RC + ("--seed", "-1"), USAGE, ("--seed",)),
    Case("random-checkpoint-preset-file-not-json", "random_checkpoint", ("{tmp}/cfg.json",) + RC[1:], FAILURE,
         ("{tmp}/cfg.json",), _write("cfg.json", "{not json")),
    Case("random-checkpoint-shard-gb-nan", "random_checkpoint", RC + ("--shard-gb", "nan"), USAGE, ("--shard-gb",)),
]

# outputs that exist: refused before any work unless --overwrite; files a command does not own, never
CASES += [
    Case("generate-trace-out-exists", "generate", G("--trace-out", "{tmp}/t.npz"), USAGE, ("{tmp}/t.npz",),
         _write("t.npz", "precious")),
    Case("generate-trace-out-exists-npz-appended", "generate", G("--trace-out", "{tmp}/t"), USAGE, ("{tmp}/t.npz",),
         _write("t.npz", "precious")),
    Case("generate-overwrite-without-trace-out", "generate", G("--overwrite"), USAGE, ("--overwrite",)),
    Case("trace-synth-out-exists", "trace", ("synth", "{tmp}/s.npz"), USAGE, ("{tmp}/s.npz",),
         _write("s.npz", "precious")),
    Case("trace-synth-out-exists-npz-appended", "trace", ("synth", "{tmp}/s"), USAGE, ("{tmp}/s.npz",),
         _write("s.npz", "precious")),
    Case("trace-synth-out-names-no-file", "trace", ("synth", "{tmp}/mine/"), USAGE, ("OUT",), BYSTANDER),
    Case("plots-heatmap-out-png-exists", "plots", H[:-1] + ("{tmp}/fig.png",), USAGE, ("{tmp}/fig.png",),
         _both(_trace(), _write("fig.png", "precious"))),
    Case("plots-heatmap-out-pdf-exists", "plots", H[:-1] + ("{tmp}/fig.pdf",), USAGE, ("{tmp}/fig.pdf",),
         _both(_trace(), _write("fig.pdf", "precious"))),
    Case("plots-heatmap-stem-svg-exists", "plots", H, USAGE, ("{tmp}/fig.svg",),
         _both(_trace(), _write("fig.svg", "precious"))),
    Case("plots-heatmap-out-png-a-folder", "plots", H[:-1] + ("{tmp}/dir.png",), FAILURE, ("{tmp}/dir.png",),
         _both(_trace(), _mkdir("dir.png"), _write("dir.png/notes.txt", "mine"))),
    Case("train-prior-record-json-someone-elses", "train_prior", TP, USAGE, ("{tmp}/priors/record.json",),
         _both(_corpus(), _write("priors/record.json", '{"owner": "alice"}'))),
    Case("train-prior-record-npz-someone-elses", "train_prior", TP, USAGE, ("{tmp}/priors/record.npz",),
         _both(_corpus(), _write("priors/record.npz", "precious"))),
    Case("studies-results-someone-elses", "studies", ("--only", "sensitivity", "--model", "default", "--out",
                                                      "{tmp}/s", "--data", "{tmp}/text.txt"), FAILURE,
         ("{tmp}/s/sensitivity.jsonl",), _both(TEXT, _write("s/sensitivity.jsonl", "my notes\n"))),
    Case("studies-delta-calibration-someone-elses", "studies", ("--only", "delta", "--model", "default", "--out",
                                                                "{tmp}/s", "--data", "{tmp}/text.txt"), FAILURE,
         ("{tmp}/s/traces/delta_calibration.json",), _both(TEXT, _write("s/traces/delta_calibration.json", "[1]"))),
]

# damaged weight files
OSS_SETTINGS = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 32, "num_local_experts": 8,
                "num_experts_per_tok": 2, "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
                "sliding_window": 4, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1}


def _replace_file(name: str, make: Callable[[str], None]) -> Callable[[Path], None]:
    """The model folder's ``name`` removed and made again by ``make(path)`` (a link, a folder)."""
    def fn(folder: Path) -> None:
        (folder / name).unlink()
        make(str(folder / name))
    return fn


def _link_to_dev_zero(path: str) -> None:
    os.symlink("/dev/zero", path)


def _as_one_shard(folder: Path) -> None:
    """model.safetensors as the one shard its index names (the hub's sharded layout)."""
    from moejax.models import safetensors_io

    shard = "model-00001-of-00001.safetensors"
    keys = safetensors_io.SafetensorsFile(str(folder / "model.safetensors")).keys()
    (folder / "model.safetensors").rename(folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in keys}}))


def _poke(name: str, key: str, value: bytes) -> Callable[[Path], None]:
    """Tensor ``key``'s first bytes in the file ``name`` overwritten with ``value``, in place."""
    def fn(folder: Path) -> None:
        from moejax.models import safetensors_io

        start, _ = safetensors_io.SafetensorsFile(str(folder / name)).byte_range(key)
        with open(folder / name, "r+b") as f:
            f.seek(start)
            f.write(value)
    return fn


def _mxfp4_model(edit: Callable[[Path], None], rel: str = "oss") -> Callable:
    """A tiny GPT-OSS in the hub release's MXFP4 form at ``tmp/rel``, then ``edit(folder)``."""
    def setup(tmp: Path, tiny: str) -> None:
        from moejax.testing import random_checkpoint as rc

        config = rc.with_overrides(rc.preset_config("gpt-oss-20b"), 2, OSS_SETTINGS, "float32")
        rc.write_checkpoint(config, str(tmp / rel), dtype="float32", seed=2, std=0.3, mxfp4=True)
        edit(tmp / rel)
    return setup


NAN32, INF32 = struct.pack("<f", float("nan")), struct.pack("<f", float("-inf"))
MX_SCALES = "model.layers.0.mlp.experts.gate_up_proj_scales"
NOT_REGULAR = "model.safetensors is not a regular file"

CASES += [
    Case("generate-weights-a-link-to-dev-zero", "generate", G(model="{tmp}/model"), FAILURE, (NOT_REGULAR,),
         _model(_replace_file("model.safetensors", _link_to_dev_zero))),
    Case("generate-weights-a-folder", "generate", G(model="{tmp}/model"), FAILURE, (NOT_REGULAR,),
         _model(_replace_file("model.safetensors", os.mkdir))),
    Case("generate-shard-a-link-to-dev-zero", "generate", G(model="{tmp}/model"), FAILURE,
         ("model-00001-of-00001.safetensors is not a regular file",),
         _model(lambda f: (_as_one_shard(f),
                           _replace_file("model-00001-of-00001.safetensors", _link_to_dev_zero)(f)))),
    Case("generate-index-a-folder", "generate", G(model="{tmp}/model"), FAILURE,
         ("model.safetensors.index.json is not a regular file",),
         _model(lambda f: (_as_one_shard(f), _replace_file("model.safetensors.index.json", os.mkdir)(f)))),
    Case("generate-config-a-link-to-dev-zero", "generate", G(model="{tmp}/model"), FAILURE,
         ("config.json is not a regular file",), _model(_replace_file("config.json", _link_to_dev_zero))),
    Case("convert-weights-a-link-to-dev-zero", "convert", ("hf-to-moejax", "{tmp}/model", "{tmp}/out"), FAILURE,
         (NOT_REGULAR,), _model(_replace_file("model.safetensors", _link_to_dev_zero))),
    Case("generate-int8-scale-nan", "generate", G(model="{tmp}/q8"), FAILURE, ("'layers.0.moe.gate.scale'",),
         _int8_folder(_poke("params.safetensors", "layers.0.moe.gate.scale", NAN32))),
    Case("generate-offload-int8-scale-inf", "generate", G("--offload", "--expert-store", "flash", model="{tmp}/q8"),
         FAILURE, ("'layers.1.moe.down.scale'",),
         _int8_folder(_poke("params.safetensors", "layers.1.moe.down.scale", INF32))),
    Case("convert-int8-scale-nan", "convert", ("moejax-to-hf", "{tmp}/q8", "{tmp}/out"), FAILURE,
         ("'layers.0.moe.up.scale'",), _int8_folder(_poke("params.safetensors", "layers.0.moe.up.scale", NAN32))),
    Case("generate-mxfp4-scale-nan", "generate", G(model="{tmp}/oss"), FAILURE, (f"'{MX_SCALES}'",),
         _mxfp4_model(_poke("model.safetensors", MX_SCALES, b"\xff"))),
    Case("convert-mxfp4-scale-nan", "convert", ("hf-to-moejax", "{tmp}/oss", "{tmp}/out"), FAILURE,
         (f"'{MX_SCALES}'",), _mxfp4_model(_poke("model.safetensors", MX_SCALES, b"\xff"))),
    Case("convert-mxfp4-scale-nan-to-int8", "convert", ("hf-to-moejax", "{tmp}/oss", "{tmp}/out", "--expert-dtype",
                                                        "int8"), FAILURE, (f"'{MX_SCALES}'",),
         _mxfp4_model(_poke("model.safetensors", MX_SCALES, b"\xff"))),
]

# configs and numbers: a config.json no model of it can run (refused from its integers, before any allocation), and
# float options past their range or float32's (argparse's one line naming the flag)
RC_OSS = ("gpt-oss-20b", "{tmp}/rc", "--layers", "1", "--mxfp4",
       *[f"--set={k}={v}" for k, v in {"vocab_size": 256, "hidden_size": 64, "head_dim": 16, "intermediate_size": 64,
                                       "num_attention_heads": 4, "num_key_value_heads": 2,
                                       "num_local_experts": 4}.items()])
CASES += [
    Case("generate-config-kv-heads-not-dividing-heads", "generate", G(model="{tmp}/model"), FAILURE,
         ("num_key_value_heads",), _model(_config(num_key_value_heads=3))),
    Case("generate-config-hidden-size-1e12", "generate", G(model="{tmp}/model"), FAILURE, ("hidden_size",),
         _model(_config(hidden_size=10**12))),
    Case("generate-config-rope-theta-huge-integer", "generate", G(model="{tmp}/model"), FAILURE, ("rope_theta",),
         _model(_config(rope_theta=10**400))),
    Case("generate-config-rms-norm-eps-zero", "generate", G(model="{tmp}/model"), FAILURE, ("rms_norm_eps",),
         _model(_config(rms_norm_eps=0))),
    Case("generate-config-sliding-window-zero", "generate", G(model="{tmp}/model"), FAILURE, ("sliding_window",),
         _model(_config(use_sliding_window=True, sliding_window=0))),
    Case("generate-config-decoder-sparse-step-zero", "generate", G(model="{tmp}/model"), FAILURE,
         ("decoder_sparse_step",), _model(_config(decoder_sparse_step=0))),
    Case("generate-lam-overflows", "generate", G("--routing", "cache-prior", "--lam", "1e300"), USAGE, ("--lam",)),
    Case("generate-lam-overflows-negative", "generate", G("--routing", "cache-prior", "--lam=-1e300"), USAGE,
         ("--lam",)),
    Case("generate-delta-overflows", "generate", G("--routing", "cache-prior", "--delta", "1,1e300"), USAGE,
         ("--delta",)),
    Case("generate-cumsum-p-infinite", "generate", G("--routing", "cumsum", "--cumsum-p", "inf"), USAGE,
         ("--cumsum-p",)),
    Case("generate-prefetch-overflows", "generate", G("--prefetch", "1e300"), USAGE, ("--prefetch",)),
    Case("generate-bandwidth-overflows", "generate", G("--offload", "--bandwidth-gbps", "1e300"), USAGE,
         ("--bandwidth-gbps",)),
    Case("generate-max-rank-past-int32", "generate", G("--routing", "max-rank", "--max-rank", "9" * 23), USAGE,
         ("max-rank M",)),
    Case("generate-temperature-overflows", "generate", G("--temperature", "1e300"), USAGE, ("--temperature",)),
    Case("evaluate-sweep-lam-range-overflows", "evaluate", E("--sweep", "lam=0:1e300:3"), USAGE, ("--sweep",), TEXT),
    Case("evaluate-sweep-lam-list-overflows", "evaluate", E("--sweep", "lam=0.5,1e300"), USAGE, ("--sweep",), TEXT),
    Case("random-checkpoint-set-kv-heads-not-dividing-heads", "random_checkpoint",
         RC + ("--set", "num_key_value_heads=3"), USAGE, ("num_key_value_heads",)),
    Case("random-checkpoint-set-hidden-size-1e12", "random_checkpoint", RC + ("--set", "hidden_size=1000000000000"),
         USAGE, ("hidden_size",)),
    Case("random-checkpoint-shard-gb-overflows", "random_checkpoint", RC + ("--shard-gb", "1e300"), USAGE,
         ("--shard-gb",)),
    Case("random-checkpoint-mxfp4-hidden-size-not-blocks-of-32", "random_checkpoint",
         RC_OSS + ("--set", "hidden_size=48"), USAGE, ("hidden_size",)),
    Case("train-lr-overflows", "train", TR + ("--lr", "1e300"), USAGE, ("--lr",), _corpus()),
    Case("train-ckpt-minutes-overflows", "train", TR + ("--ckpt-minutes", "1e308"), USAGE, ("--ckpt-minutes",),
         _corpus()),
    Case("train-prior-weights-overflow", "train_prior", TP + ("--weights", "1,1e300"), USAGE, ("--weights",),
         _corpus()),
    Case("trace-replay-lam-overflows", "trace", ("replay", "{tmp}/t.npz", "--cache-size", "2", "--routing",
                                                 "cache-prior", "--lam", "1e300"), USAGE, ("--lam",), _trace()),
]

# case id -> what it does instead, for a case that breaks the contract (a strict xfail until the code keeps it)
BUGS: dict[str, str] = {
}


def _params():
    for case in CASES:
        reason = BUGS.get(case.id) or case.bug
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        yield pytest.param(case, id=case.id, marks=marks)


def check(case: Case, tmp: Path, tiny: str, monkeypatch) -> list[str]:
    """Run one case and return its contract violations (empty: the case behaves)."""
    fmt = lambda s: s.format(tmp=tmp, tiny=tiny)  # noqa: E731
    tmpdir = tmp / "TMPDIR"
    tmpdir.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        case.setup(tmp, tiny)
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setenv("MOEJAX_TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    before = _snapshot(tmp, Path(tiny))
    argv = [fmt(a) for a in case.argv]
    if case.process:
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        rc, out, err = _run_process(case.cli, argv, env)
    else:
        if case.tripwires and not os.environ.get("MOEJAX_PROBE_NO_TRIPWIRES"):
            for module, attr in TRIPWIRES:
                target = importlib.import_module(module)
                *owners, name = attr.split(".")
                for o in owners:
                    target = getattr(target, o)
                monkeypatch.setattr(target, name, _trip)
        rc, out, err = _invoke(case.cli, argv)
    after = _snapshot(tmp, Path(tiny))
    problems = []
    if rc == "ran":
        problems.append("accepted the input and started the real work (a tripwire fired)")
    elif rc == "hang":
        problems.append("no exit within 120 s")
    elif rc != case.status:
        problems.append(f"exit status {rc}, expected {case.status}")
    if "Traceback" in err:
        problems.append("traceback on stderr")
    if rc in (USAGE, FAILURE) and out.strip():
        problems.append(f"printed to stdout before the error: {out.strip()[:80]!r}")
    if rc in (USAGE, FAILURE) and any(ln.startswith("note:") for ln in err.splitlines()):
        problems.append(f"a note before the error: {err.strip()[:160]!r}")  # about a run that does not happen
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error:" in ln]
    if rc not in ("ran", "hang", 0):
        if not lines or "error:" not in lines[-1]:
            problems.append("stderr does not end in an 'error: ...' line")
        elif len(errors) != 1:
            problems.append(f"{len(errors)} error lines, expected one")
        elif not any(fmt(n) in lines[-1] for n in case.names):
            problems.append(f"the error line names none of {[fmt(n) for n in case.names]}")
    problems += _diff(before, after)
    check.last = {"rc": rc, "stderr": err, "stdout": out, "argv": argv}
    return problems


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input(case, tmp_path, tiny, monkeypatch):
    problems = check(case, tmp_path, tiny, monkeypatch)
    last = check.last
    tail = "\n".join(last["stderr"].strip().splitlines()[-6:])
    head = f"{case.cli} {' '.join(last['argv'])}\n  "
    message = head + "\n  ".join(problems) + f"\n--- stderr tail:\n{tail}"
    # argv may hold lone surrogates (a non-UTF-8 prompt): pytest-xdist cannot send those to the controller
    assert not problems, message.encode("utf-8", "backslashreplace").decode("utf-8")


def test_case_ids_are_unique_and_numerous():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 55
    assert set(BUGS) <= set(ids)
