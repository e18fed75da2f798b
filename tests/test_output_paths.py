"""Outputs never replace what the user had: a ``python -m moejax.*`` command that would write over an existing
file at a path the user named refuses up front (exit 2, one ``error:`` line naming the file, its bytes and
every other file unchanged, no work started) unless ``--overwrite``; commands without that flag (train_prior's
folder) refuse a file that is not their own; folder outputs (convert, random_checkpoint) never replace a file,
``--overwrite`` or not. A figure path with an image suffix writes that one file only."""

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

from support.commands import run_main

PRECIOUS = b"precious: the user's own file\n"

CLIS = {
    "generate": "moejax.runtime.generate", "trace": "moejax.experts.trace_command", "plots": "moejax.evaluation.heatmap",
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
           ("REPORT.md",), setup=_results, work=(("moejax.evaluation.report", "build_report"),)),
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
    from moejax.experts import trace as trace_lib, trace_command

    out = tmp_path / "s.npz"
    out.write_bytes(PRECIOUS)
    ran = run_main(trace_command.main, capsys, "synth", out, "--tokens", "8", "--layers", "1", "--experts", "4",
                   "--overwrite")
    assert ran.returncode == 0, ran.stderr
    tr = trace_lib.load_trace(out)
    assert tr.shape == (8, 1, 2) and int(np.max(tr.experts)) < 4
    assert sorted(os.listdir(tmp_path)) == ["s.npz"]  # no temporary file left beside it


# ------------------------------------------------------------- files a command names itself: report figures, train
# A report writes its figures under fixed names (pareto.png, heatmap_layer0.svg, ...) into --figures DIR: a file of
# such a name is replaced only when an earlier report wrote it (its mark), or with --overwrite. train --resume
# continues a run, and a folder that holds none (only the user's metrics.jsonl) is refused untouched.

def _results_and_trace(tmp: Path) -> None:
    _results(tmp)
    _trace(tmp)


RF = ("{tmp}/r.jsonl", "--out", "{tmp}/REPORT.md", "--figures", "{tmp}/figs", "--trace", "{tmp}/t.npz",
      "--trace-cache-size", "4")
REPORT_WRITES = ("REPORT.md", "figs/pareto.png", "figs/pareto.svg", "figs/heatmap_layer0.png",
                 "figs/heatmap_layer0.svg")
REPORT_FIGURE_WORK = (("moejax.evaluation.plots", "save_figure"), ("moejax.evaluation.heatmap", "trace_heatmap"))
FIGURE_OUTPUTS = [
    Output(f"report-figures-{name.replace('.', '-')}", "report", RF, (f"figs/{name}",), REPORT_WRITES,
           setup=_results_and_trace, work=REPORT_FIGURE_WORK)
    for name in ("pareto.png", "pareto.svg", "heatmap_layer0.svg")
]


@pytest.mark.parametrize("case", FIGURE_OUTPUTS, ids=lambda c: c.id)
def test_a_users_file_named_like_a_report_figure_is_kept_unless_overwrite(case, tmp_path, capsys, monkeypatch):
    test_an_existing_output_is_kept_unless_overwrite(case, tmp_path, capsys, monkeypatch)


def test_a_report_rerun_into_its_figure_folder_replaces_its_own_figures(tmp_path, capsys):
    from moejax.evaluation import plots, report

    _results_and_trace(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in RF]
    assert run_main(report.main, capsys, *argv).returncode == 0
    figs = tmp_path / "figs"
    assert all(plots.figure_mark(tmp_path / rel) == report.FIGURE_MARK for rel in REPORT_WRITES[1:])
    first = _files(figs)
    record = json.loads((tmp_path / "r.jsonl").read_text())
    (tmp_path / "r.jsonl").write_text(json.dumps({**record, "ppl": 12.0, "miss_rate": 0.25}) + "\n")
    ran = run_main(report.main, capsys, *argv)  # no --overwrite: the files are the report's own
    assert ran.returncode == 0, ran.stderr
    second = _files(figs)
    assert second.keys() == first.keys() and second["pareto.png"] != first["pareto.png"]


def test_a_figure_another_command_wrote_is_not_taken_for_a_reports(tmp_path, capsys):
    """Only a report's figures carry its mark: a heat map the user asked ``moejax.plots`` for is the user's."""
    from moejax.evaluation import heatmap, plots, report

    _results_and_trace(tmp_path)
    ran = run_main(heatmap.main, capsys, "heatmap", tmp_path / "t.npz", "--cache-size", "4", "--out",
                   tmp_path / "figs" / "pareto")
    assert ran.returncode == 0, ran.stderr
    assert plots.figure_mark(tmp_path / "figs" / "pareto.png") is None
    before = _files(tmp_path)
    ran = run_main(report.main, capsys, *(a.format(tmp=tmp_path) for a in RF))
    assert ran.returncode == 2 and str(tmp_path / "figs" / "pareto.png") in ran.stderr
    assert _files(tmp_path) == before


TRAIN_WORK = (("moejax.training.data", "TokenData"), ("moejax.training.data", "split_shards"))


@pytest.mark.parametrize("flags", [("--resume",), ("--overwrite",), ()], ids=lambda f: "-".join(f) or "plain")
@pytest.mark.parametrize("taken", [("metrics.jsonl",), ("metrics.jsonl", "checkpoints/step_1/state.bin")],
                         ids=["metrics", "metrics-and-checkpoints"])
def test_train_refuses_a_folder_without_a_run_and_keeps_its_files(taken, flags, tmp_path, capsys, monkeypatch):
    """A folder with the user's own metrics.jsonl (and a checkpoints/ of another tool) holds no run of train's:
    --resume there emptied metrics.jsonl (no checkpoint: no step kept), --overwrite deleted both."""
    from moejax.training import train

    out = tmp_path / "run"
    for rel in taken:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(PRECIOUS)
    before = _files(tmp_path)
    for module, attr in TRAIN_WORK:
        monkeypatch.setattr(importlib.import_module(module), attr, _tripwire)
    ran = run_main(train.main, capsys, "--out", out, *flags)
    lines = [ln for ln in ran.stderr.splitlines() if ln.strip()]
    assert ran.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), ran.stderr
    assert str(out) in lines[0] and "holds no training run" in lines[0]
    assert _files(tmp_path) == before
