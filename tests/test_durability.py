"""A power cut right after a write: the new file's bytes are on the disk before its name points at them, and the
rename itself is flushed (``fsync`` of the file, then of its folder). Checked by recording what is flushed in
which order; a real power cut cannot be staged here."""

from __future__ import annotations

import os

import numpy as np
from safetensors.numpy import save_file

from moejax.base import atomic


def _recording(monkeypatch):
    """Every fsync and rename, in order, as ("fsync", path) / ("rename", src, dst)."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    return events


def test_a_file_is_flushed_before_it_is_renamed_and_its_folder_after(tmp_path, monkeypatch):
    events = _recording(monkeypatch)
    atomic.write_json(tmp_path / "r.json", {"a": 1})
    (_, tmp), (_, src, dst), folder = events
    assert tmp == src and dst == str(tmp_path / "r.json") and folder == ("fsync", str(tmp_path))
    assert (tmp_path / "r.json").read_text() == '{\n  "a": 1\n}\n'


def test_a_set_of_files_is_flushed_before_any_is_renamed(tmp_path, monkeypatch):
    events = _recording(monkeypatch)
    with atomic.together():
        atomic.write_text(tmp_path / "a.md", "a")
        atomic.write_text(tmp_path / "b.svg", "b")
    kinds = [e[0] for e in events]
    assert kinds == ["fsync", "fsync", "rename", "rename", "fsync"] and events[-1] == ("fsync", str(tmp_path))


def test_a_folder_is_flushed_file_by_file_before_it_is_renamed(tmp_path, monkeypatch):
    events = _recording(monkeypatch)
    target = tmp_path / "ckpt"
    with atomic.atomic_dir(str(target)) as tmp:
        save_file({"w": np.ones(3, np.float32)}, os.path.join(tmp, "model.safetensors"))  # safetensors: no fsync
        os.makedirs(os.path.join(tmp, "sub"))
        open(os.path.join(tmp, "sub", "x.txt"), "w").write("x")
    rename = next(i for i, e in enumerate(events) if e[0] == "rename")
    flushed = {e[1] for e in events[:rename]}
    assert {f"{tmp}/model.safetensors", f"{tmp}/sub/x.txt", f"{tmp}/sub", tmp} <= flushed
    assert events[rename][1:] == (tmp, str(target)) and events[-1] == ("fsync", str(tmp_path))
