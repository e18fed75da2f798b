"""Temporary folders: named after their owner, under MOEJAX_TMPDIR when set, and a
killed run's leftovers removed by the next run that makes one with the same prefix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from moejax.base import tempfiles


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # ended and reaped: no process has this id now (pids are not reused this fast)


def test_make_temp_dir_uses_moejax_tmpdir_and_removes_only_dead_owners(tmp_path, monkeypatch):
    root = tmp_path / "scratch"
    monkeypatch.setenv(tempfiles.TMPDIR_ENV, str(root))
    stale = root / f"moejax-x-{_dead_pid()}-abc"
    live = root / f"moejax-x-{os.getppid()}-def"  # the parent is running
    other = root / "moejax-x-notapid"
    unrelated = root / "user-data"
    for d in (stale, live, other, unrelated):
        d.mkdir(parents=True)
        (d / "f").write_text("keep?")
    made = tempfiles.make_temp_dir("moejax-x-")
    assert os.path.dirname(made) == str(root) and os.path.basename(made).startswith(f"moejax-x-{os.getpid()}-")
    assert not stale.exists() and live.exists() and other.exists() and unrelated.exists()
    monkeypatch.delenv(tempfiles.TMPDIR_ENV)
    assert tempfiles.temp_root() == __import__("tempfile").gettempdir()


# ------------------------------------------------------------------------ one file written atomically
def _leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if ".tmp-" in n)


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    from moejax.base import atomic

    target = tmp_path / "sub" / "result.json"
    with pytest.raises(FileNotFoundError):
        atomic.write_json(target, {"b": 1, "a": [1, 2]})  # a missing folder is the caller's error, like open()
    assert not target.parent.exists()
    atomic.write_json(target, {"b": 1, "a": [1, 2]}, make_parents=True)
    assert target.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    mask = os.umask(0o022)
    os.umask(mask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~mask  # what open() would give, not mkstemp's 0600
    with pytest.raises(TypeError):
        atomic.write_json(target, {"x": object()})  # cannot be JSON: fails before anything is written
    with pytest.raises(RuntimeError, match="half way"):
        with atomic.atomic_file(target, "w") as f:
            f.write('{"partial": ')
            raise RuntimeError("half way")
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_file(target) as f:
            f.write(b"x" * 1000)
            raise KeyboardInterrupt
    assert json.loads(target.read_text()) == {"a": [1, 2], "b": 1}  # the old file, whole
    assert _leftovers(target.parent) == []
    atomic.save_npz(tmp_path / "trace", a=np.arange(3))  # exactly this name: no ".npz" appended
    assert np.load(tmp_path / "trace")["a"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="mode"):
        with atomic.atomic_file(target, "a"):
            pass


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    """SIGKILL runs no clean-up: the half-written temporary file stays until the same target is written
    again, and a live writer's temporary file is never touched."""
    target = tmp_path / "shard.safetensors"
    target.write_bytes(b"old")
    code = ("import sys, time\nfrom moejax.base import atomic\n"
            "with atomic.atomic_file(sys.argv[1]) as f:\n"
            "    f.write(b'y' * 4096); f.flush(); print('writing', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        live = _leftovers(tmp_path)
        assert len(live) == 1 and live[0].startswith(f".shard.safetensors.tmp-{proc.pid}-")
    finally:
        proc.kill()
        proc.wait()
    assert target.read_bytes() == b"old" and len(_leftovers(tmp_path)) == 1  # killed: the copy is left...
    other = tmp_path / f".shard.safetensors.tmp-{os.getppid()}-abc"  # ...and a running writer's
    other.write_bytes(b"busy")
    from moejax.base import atomic

    atomic.write_text(target, "new")
    assert target.read_text() == "new"
    assert _leftovers(tmp_path) == [other.name]  # the dead writer's file is gone, the live one's kept


def test_atomic_dir_swaps_the_whole_folder_or_leaves_the_old_one(tmp_path):
    from moejax.base import atomic

    target = tmp_path / "prior"
    with atomic.atomic_dir(str(target)) as tmp:
        (tmp_path / os.path.basename(tmp) / "a").write_text("1")
        assert not target.exists()  # not before the block ends
    assert (target / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic.atomic_dir(str(target)) as tmp:
            (tmp_path / os.path.basename(tmp) / "b").write_text("2")
            raise RuntimeError("crash")
    assert sorted(os.listdir(target)) == ["a"] and os.listdir(tmp_path) == ["prior"]
    with atomic.atomic_dir(str(target)) as tmp:
        (tmp_path / os.path.basename(tmp) / "c").write_text("3")
    assert sorted(os.listdir(target)) == ["c"] and os.listdir(tmp_path) == ["prior"]  # old one gone, no leftovers


# ------------------------------------------------------------------------ a signal right after the mkdir

_SIGNAL_AT_CREATION = r"""
import os, signal, sys, tempfile
from moejax.base import atomic, interrupts, tempfiles
interrupts.exit_cleanly_on_signals()
made = tempfiles.make_temp_dir
mkstemp = tempfile.mkstemp

def make_then_signal(*a, **k):  # the signal lands once the folder exists, before anything owns it
    path = made(*a, **k)
    os.kill(os.getpid(), signal.SIGTERM)
    return path

def mkstemp_then_signal(*a, **k):
    out = mkstemp(*a, **k)
    os.kill(os.getpid(), signal.SIGTERM)
    return out

out = sys.argv[2]
if sys.argv[1] == "dir":
    tempfiles.make_temp_dir = make_then_signal
    with atomic.atomic_dir(os.path.join(out, "model")) as tmp:
        open(os.path.join(tmp, "w"), "w").write("x")
else:
    tempfile.mkstemp = mkstemp_then_signal
    atomic.write_text(os.path.join(out, "results.json"), "{}")
print("not interrupted")
"""


@pytest.mark.parametrize("what", ["dir", "file"])
def test_a_signal_right_after_the_temporary_is_made_leaves_nothing(tmp_path, what):
    """The window between creating a temporary and the ``try`` that removes it: a signal there would leave
    the folder behind (it shows as a flaky SIGTERM test under load); ``interrupts.deferred`` closes it."""
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", _SIGNAL_AT_CREATION, what, str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 128 + 15, done.stderr
    assert "not interrupted" not in done.stdout
    assert os.listdir(out) == []


def test_deferred_delivers_the_signal_when_the_block_ends():
    import signal

    from moejax.base import interrupts

    got = []
    previous = signal.signal(signal.SIGHUP, lambda s, f: got.append(s))
    try:
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            inside = list(got)
        assert inside == [] and got == [signal.SIGHUP]
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_atomic_dir_gives_the_folder_a_normal_mode(tmp_path):
    """mkdtemp makes 0700: converted checkpoints get the umask's mode instead, readable to other users."""
    from moejax.base import atomic

    old = os.umask(0o027)
    try:
        with atomic.atomic_dir(str(tmp_path / "ckpt")) as tmp:
            (tmp_path / os.path.basename(tmp) / "a").write_text("1")
    finally:
        os.umask(old)
    assert (os.stat(tmp_path / "ckpt").st_mode & 0o777) == 0o750


def test_ctrl_c_in_a_command_exits_130_without_a_traceback(tmp_path):
    code = ("import os, signal, time\nfrom moejax.base import interrupts\ninterrupts.exit_cleanly_on_signals()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\nfinally:\n    print('cleaned up')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and proc.stdout == "cleaned up\n" and proc.stderr == ""
