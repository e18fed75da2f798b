"""A full disk (ENOSPC) in the middle of a write: nothing the user had is lost or torn, nothing half-made is
left, the error names the file the user asked for, and a finished computation is not thrown away. The
disk is made full by making the write fail (a real small filesystem needs root and a mount; the probe
that found these cases used small tmpfs mounts)."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from moejax import generate as generate_cli
from moejax.base import atomic
from moejax.evaluation import results
from moejax.experts import trace as trace_lib
from moejax.testing import random_checkpoint

from support.file_limit import run_module_with_file_limit


def _full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_an_append_that_does_not_fit_leaves_the_results_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    results.append_result(str(path), {"key": "a", "ppl": 1.0})
    before = path.read_bytes()
    real = os.write
    calls = []

    def half_then_full(fd, data):  # part of the line goes in, then the disk is full
        calls.append(1)
        if len(calls) == 1:
            return real(fd, bytes(data)[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results.os, "write", half_then_full)
    with pytest.raises(OSError) as e:
        results.append_result(str(path), {"key": "b", "ppl": 2.0, "note": "x" * 500})
    assert path.read_bytes() == before and e.value.filename == str(path)


def test_a_failed_write_names_the_target_not_its_temporary_file(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(OSError) as e:
        with atomic.atomic_file(target, "w") as f:
            f.write("{")
            _full()
    assert e.value.filename == str(target) and e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []


def test_a_swap_that_fails_leaves_no_aside_folder(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "weights").write_text("old")
    real = os.replace

    def busy(src, dst):  # the target is a mount point, or immutable: it cannot be moved aside
        if os.fspath(src) == str(target):
            raise OSError(errno.EBUSY, "Device or resource busy", os.fspath(src))
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", busy)
    with pytest.raises(OSError) as e:
        with atomic.atomic_dir(str(target)) as tmp:
            open(os.path.join(tmp, "weights"), "w").write("new")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"] and (target / "weights").read_text() == "old"
    assert e.value.errno == errno.EBUSY


def test_a_trace_the_disk_cannot_take_does_not_lose_the_generation(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(trace_lib, "save_trace", _full)
    argv = ["--model", "default", "--prompt-ids", "5,9,5", "--max-new-tokens", "4", "--ignore-eos", "--json",
            "--trace-out", str(tmp_path / "t.npz")]
    assert generate_cli.main(argv) == 1
    out, err = capsys.readouterr()
    assert len(json.loads(out)["token_ids"]) == 4  # printed before the error, not lost
    assert err.strip().splitlines()[-1].startswith(
        "error: --trace-out: the generation was printed, its trace was not written: ")


def test_a_random_checkpoint_too_big_for_the_disk_is_refused_in_readable_units(tmp_path, monkeypatch):
    monkeypatch.setattr(random_checkpoint.shutil, "disk_usage", lambda p: type("U", (), {"free": 150_000})())
    config = random_checkpoint.with_overrides(random_checkpoint.preset_config("olmoe-1b-7b"), 2, random_checkpoint.parse_sets(
        ["hidden_size=64", "intermediate_size=64", "vocab_size=512", "num_experts=8"]))
    with pytest.raises(OSError, match=r": 150.0 kB free, the checkpoint needs [0-9.]+ [kM]B$"):
        random_checkpoint.write_checkpoint(config, str(tmp_path / "new" / "a" / "rc"))
    assert os.listdir(tmp_path) == []  # the folders it would have made are not left behind
    monkeypatch.setattr(random_checkpoint.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 40})())
    assert os.path.isfile(os.path.join(random_checkpoint.write_checkpoint(config, str(tmp_path / "ok")), "config.json"))
    np.testing.assert_equal(len(os.listdir(tmp_path)), 1)


class _FullStdout:
    """A stdout on a full disk (``> /dev/full``): every write fails."""

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


def test_a_result_that_stdout_cannot_take_is_one_error_line_after_the_files_are_written(tmp_path, monkeypatch,
                                                                                          capsys):
    """random_checkpoint, plots heatmap and evaluate printed a traceback (exit 1) when their closing lines could
    not be printed, though the files were written."""
    from moejax import evaluate, plots, trace

    trace_path = str(tmp_path / "t.npz")
    assert trace.main(["synth", trace_path, "--tokens", "300", "--logits"]) == 0
    runs = [(random_checkpoint.main, ["olmoe-1b-7b", str(tmp_path / "rc"), "--layers", "1", "--set", "hidden_size=32",
                                      "--set", "intermediate_size=32", "--set", "vocab_size=256",
                                      "--set", "num_experts=8"], tmp_path / "rc" / "config.json"),
            (plots.main, ["heatmap", trace_path, "--layer", "0", "--cache-size", "4", "--out", str(tmp_path / "hm")],
             tmp_path / "hm.png"),
            (evaluate.main, ["--model", "default", "--max-tokens", "64", "--context", "32"], None)]
    for main, argv, written in runs:
        capsys.readouterr()
        monkeypatch.setattr("sys.stdout", _FullStdout())
        assert main(argv) == 1, argv
        monkeypatch.undo()
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == "error: could not write the result to stdout: No space left on device", err
        assert "Traceback" not in "\n".join(err) and (written is None or written.is_file())


def test_a_figure_is_written_as_a_pair_or_not_at_all(tmp_path, monkeypatch):
    """plots heatmap on a disk with room for the PNG and not the SVG leaves neither a PNG alone nor a new PNG
    beside the old SVG: both are written before either replaces its target."""
    from moejax.evaluation import plots

    fig, axes = plots.new_figure()
    ax = axes[0, 0]
    ax.plot([0, 1], [1, 0])
    first = plots.save_figure(fig, tmp_path / "f")
    before = {p.name: p.read_bytes() for p in first}
    real = fig.savefig

    def svg_full(f, format, **k):
        if format == "svg":
            _full()
        return real(f, format=format, **k)

    ax.plot([0, 1], [0, 1])
    monkeypatch.setattr(fig, "savefig", svg_full)
    with pytest.raises(OSError):
        plots.save_figure(fig, tmp_path / "f")
    assert {p.name: p.read_bytes() for p in first} == before and sorted(os.listdir(tmp_path)) == ["f.png", "f.svg"]
    with pytest.raises(OSError):
        plots.save_figure(fig, tmp_path / "new" / "g")
    assert sorted(os.listdir(tmp_path)) == ["f.png", "f.svg"]


def test_a_report_and_its_figures_change_as_one_set(tmp_path, monkeypatch):
    """A disk that fills between two figures does not leave the report's figure set half replaced (new figures
    beside old ones and the old report): the report and its figures are renamed into place together, after all
    of them are written; a failure anywhere leaves the old set and no temporary file."""
    from matplotlib.figure import Figure

    from moejax.evaluation import report
    from test_plots import all_records, write_jsonl

    records = all_records()
    first = write_jsonl(tmp_path / "a.jsonl", records)
    second = write_jsonl(tmp_path / "b.jsonl", [{**r, "ppl": r["ppl"] * 1.1} if r.get("ppl") else r for r in records])
    rep = tmp_path / "rep"
    out, figs = rep / "REPORT.md", rep / "figs"
    argv = lambda res: [str(res), "--out", str(out), "--figures", str(figs)]  # noqa: E731
    real = Figure.savefig

    def full_at(n):
        calls = []

        def savefig(self, *a, **k):
            calls.append(1)
            if len(calls) == n:
                _full()
            return real(self, *a, **k)
        return savefig

    monkeypatch.setattr(Figure, "savefig", full_at(5))  # the third figure's PNG
    assert report.main(argv(first)) == 1
    assert not rep.exists()  # nothing was there: nothing is, not even the folders
    monkeypatch.undo()
    assert report.main(argv(first)) == 0
    files = lambda: {p.relative_to(rep): p.read_bytes() for p in rep.rglob("*") if p.is_file()}  # noqa: E731
    before = files()
    assert len(before) > 6
    monkeypatch.setattr(Figure, "savefig", full_at(6))
    assert report.main(argv(second)) == 1
    assert files() == before  # the old set, whole, and no temporary file
    monkeypatch.undo()
    assert report.main(argv(second)) == 0
    after = files()
    assert after.keys() == before.keys() and after[out.relative_to(rep)] != before[out.relative_to(rep)]
    assert sum(after[k] != before[k] for k in after) > 2  # figures changed too: the check above means something


def test_a_file_that_fails_inside_a_new_folder_is_named_where_it_would_be(tmp_path):
    """A folder is filled under a temporary name and renamed when whole; a write in it that fails is named where
    it would be, not as ``.out.tmp-PID-xxxx/model.safetensors``, a path the user never asked for and gone by the
    time they read it."""
    target = tmp_path / "out"
    with pytest.raises(OSError) as e:
        with atomic.atomic_dir(str(target)) as tmp:
            os.makedirs(os.path.join(tmp, "sub"))
            raise OSError(errno.EFBIG, "File too large", os.path.join(tmp, "sub", "model.safetensors"))
    assert e.value.filename == str(target / "sub" / "model.safetensors") and e.value.errno == errno.EFBIG
    assert os.listdir(tmp_path) == []


def test_a_conversion_the_disk_cannot_take_names_its_output_and_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "out"
    proc = run_module_with_file_limit("moejax.convert", ["moejax-to-hf", "default", str(out)], 16 * 1024)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: [Errno {errno.EFBIG}] File too large: '{out}/"), \
        proc.stderr[-2000:]
    assert ".tmp-" not in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []
