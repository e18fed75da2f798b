"""Temporary folders (reliability part 3): named after their owner, under MOEJAX_TMPDIR when set, and a
killed run's leftovers removed by the next run that makes one with the same prefix."""

from __future__ import annotations

import os
import subprocess
import sys

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
