"""Outputs never replace what the user had: a ``python -m moejax.*`` command that would write over an existing
file at a path the user named refuses up front (exit 2, one ``error:`` line naming the file, its bytes and
every other file unchanged, no work started) unless ``--overwrite``; commands without that flag (report,
train_prior's folder) refuse a file that is not their own; folder outputs (convert, random_checkpoint) never
replace a file, ``--overwrite`` or not. A figure path with an image suffix writes that one file only."""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from conftest import run_main

PRECIOUS = b"precious: the user's own file\n"

CLIS = {
    "generate": "moejax.runtime.generate", "trace": "moejax.experts.trace", "plots": "moejax.evaluation.heatmap",
    "report": "moejax.evaluation.report", "train_prior": "moejax.training.train_prior",
    "convert": "moejax.models.convert", "random_checkpoint": "moejax.testing.random_checkpoint",
}

#: a 2-layer qwen3_moe at toy sizes (as in test_bad_inputs): random_checkpoint writes it in a fraction of a second
TINY = {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 32, "head_dim": 8, "intermediate_size": 32,
        "moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1}


def _trace(tmp: Path) -> None:
    from moejax.experts import trace as trace_lib

    tr = trace_lib.synthetic_trace(24, 2, 8, 2, seed=0)
    trace_lib.save_trace(tmp / "t.npz", tr.experts, tr.weights, None, tr.n_experts, tr.gating)


def _results(tmp: Path) -> None:
    record = {"key": "k1", "study": "pareto", "task": "wikitext", "model": "m", "method": "forward", "ppl": 10.0,
              "miss_rate": 0.5, "routing": {"kind": "original"}, "cache": {"capacity": 2, "size": "2"}}
    (tmp / "r.jsonl").write_text(json.dumps(record) + "\n")


def _corpus(tmp: Path) -> None:
    (tmp / "corpus").mkdir()
    for s in range(2):
        with gzip.open(tmp / "corpus" / f"enwiki-2015-wikitext-style-{s:02d}.txt.gz", "wt", encoding="utf-8") as f:
            f.write(" \n = Article = \n \n The city was built in 1900 . \n")


@dataclasses.dataclass(frozen=True)
class Output:
    id: str
    cli: str
    argv: tuple[str, ...]  # {tmp}: the case's folder
    taken: tuple[str, ...]  # files there before the run (relative to {tmp}); the error names the first
    writes: tuple[str, ...] = ()  # what --overwrite writes (replacing ``taken``); () with ``overwrite`` False
    overwrite: bool | None = True  # False: refused with --overwrite too; None: the command has no --overwrite
    setup: Callable[[Path], None] | None = None
    work: tuple[tuple[str, str], ...] = ()  # (module, attribute): the work a refusal must not reach


G = ("--model", "default", "--prompt-ids", "1,2,3", "--max-new-tokens", "1")
H = ("heatmap", "{tmp}/t.npz", "--cache-size", "4", "--out")
GENERATE_WORK = (("moejax.runtime.api", "load"),)
HEATMAP_WORK = (("moejax.evaluation.heatmap", "check_heatmap"), ("moejax.evaluation.heatmap", "trace_heatmap"))
TP = ("--out", "{tmp}/priors", "--model", "default", "--corpus", "{tmp}/corpus", "--shards", "0", "--weights", "1")
RC = ("qwen3-30b-a3b", "{tmp}/rc", "--layers", "1", "--dtype", "float32", *[f"--set={k}={v}" for k, v in TINY.items()])

OUTPUTS = [
    Output("generate-trace-out", "generate", G + ("--trace-out", "{tmp}/t.npz"), ("t.npz",), ("t.npz",),
           work=GENERATE_WORK),
    Output("generate-trace-out-npz-appended", "generate", G + ("--trace-out", "{tmp}/t"), ("t.npz",), ("t.npz",),
           work=GENERATE_WORK),
    Output("trace-synth", "trace", ("synth", "{tmp}/s.npz", "--tokens", "8", "--layers", "1", "--experts", "4"),
           ("s.npz",), ("s.npz",), work=(("moejax.experts.trace", "synthetic_trace"),)),
    Output("plots-heatmap-png", "plots", H + ("{tmp}/fig.png",), ("fig.png",), ("fig.png",), setup=_trace,
           work=HEATMAP_WORK),
    Output("plots-heatmap-pdf", "plots", H + ("{tmp}/fig.pdf",), ("fig.pdf",), ("fig.pdf",), setup=_trace,
           work=HEATMAP_WORK),
    Output("plots-heatmap-stem-png", "plots", H + ("{tmp}/fig",), ("fig.png",), ("fig.png", "fig.svg"),
           setup=_trace, work=HEATMAP_WORK),
    Output("plots-heatmap-stem-svg", "plots", H + ("{tmp}/fig",), ("fig.svg",), ("fig.png", "fig.svg"),
           setup=_trace, work=HEATMAP_WORK),
    Output("report-out", "report", ("{tmp}/r.jsonl", "--no-figures", "--out", "{tmp}/REPORT.md"), ("REPORT.md",),
           overwrite=None, setup=_results, work=(("moejax.evaluation.report", "build_report"),)),
    Output("train-prior-record-json", "train_prior", TP, ("priors/record.json",), overwrite=None, setup=_corpus,
           work=GENERATE_WORK),
    Output("train-prior-record-npz", "train_prior", TP, ("priors/record.npz",), overwrite=None, setup=_corpus,
           work=GENERATE_WORK),
    Output("convert-dst", "convert", ("moejax-to-moejax", "default", "{tmp}/out"), ("out",), overwrite=False),
    Output("random-checkpoint-out", "random_checkpoint", RC, ("rc",), overwrite=False),
]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _run(case: Output, tmp: Path, capsys, *extra: str):
    main = importlib.import_module(CLIS[case.cli]).main
    return run_main(main, capsys, *(a.format(tmp=tmp) for a in case.argv), *extra)


def _refused(case: Output, ran, tmp: Path) -> None:
    lines = [ln for ln in ran.stderr.splitlines() if ln.strip()]
    named = tmp / case.taken[0]
    assert ran.returncode == 2, ran.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), ran.stderr
    assert str(named) in lines[0] or os.path.realpath(named) in lines[0], lines[0]
    assert "Traceback" not in ran.stderr and not ran.stdout.strip()


@pytest.mark.parametrize("case", OUTPUTS, ids=lambda c: c.id)
def test_an_existing_output_is_kept_unless_overwrite(case, tmp_path, capsys, monkeypatch):
    if case.setup is not None:
        case.setup(tmp_path)
    for rel in case.taken:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(PRECIOUS)
    before = _files(tmp_path)
    with monkeypatch.context() as m:  # refused before any work: a tripwire fails the test if reached
        for module, attr in case.work:
            m.setattr(importlib.import_module(module), attr, _tripwire)
        _refused(case, _run(case, tmp_path, capsys), tmp_path)
    assert _files(tmp_path) == before
    if case.overwrite is None:
        return
    ran = _run(case, tmp_path, capsys, "--overwrite")
    if not case.overwrite:
        _refused(case, ran, tmp_path)
        assert _files(tmp_path) == before
        return
    assert ran.returncode == 0, ran.stderr
    after = _files(tmp_path)
    assert set(after) == set(before) | set(case.writes)  # nothing it was not asked for
    assert all(after[rel] != PRECIOUS for rel in case.writes)
    assert {k: v for k, v in after.items() if k not in case.writes} == \
        {k: v for k, v in before.items() if k not in case.writes}


def _tripwire(*_, **__):
    raise AssertionError("the command started its work before refusing an existing output")


@pytest.mark.parametrize("out, written", [
    ("fig.png", ["fig.png"]), ("fig.svg", ["fig.svg"]), ("fig.pdf", ["fig.pdf"]), ("FIG.PNG", ["FIG.PNG"]),
    ("fig", ["fig.png", "fig.svg"]), ("fig.v2", ["fig.v2.png", "fig.v2.svg"]),
])
def test_a_figure_path_writes_exactly_what_it_names(out, written, tmp_path, capsys):
    from moejax.evaluation import heatmap

    _trace(tmp_path)
    (tmp_path / "figs").mkdir()
    ran = run_main(heatmap.main, capsys, "heatmap", tmp_path / "t.npz", "--cache-size", "4", "--out",
                   tmp_path / "figs" / out)
    assert ran.returncode == 0, ran.stderr
    assert sorted(os.listdir(tmp_path / "figs")) == sorted(written)
    assert ran.stdout.split() == [str(tmp_path / "figs" / name) for name in written]
    magic = {"png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF"}
    for name in written:
        assert (tmp_path / "figs" / name).read_bytes().startswith(magic[name.rsplit(".", 1)[1].lower()])


def test_trace_synth_overwrite_writes_a_trace_that_loads(tmp_path, capsys):
    """``--overwrite`` replaces the file with a whole trace (the atomic write is unchanged)."""
    from moejax.experts import trace as trace_lib

    out = tmp_path / "s.npz"
    out.write_bytes(PRECIOUS)
    ran = run_main(trace_lib.main, capsys, "synth", out, "--tokens", "8", "--layers", "1", "--experts", "4",
                   "--overwrite")
    assert ran.returncode == 0, ran.stderr
    tr = trace_lib.load_trace(out)
    assert tr.shape == (8, 1, 2) and int(np.max(tr.experts)) < 4
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]  # no temporary file left beside it
