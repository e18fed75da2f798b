"""Temporary folders with names that say whose they are, so a killed run's leftovers are found and removed.

Clean exits, errors, Ctrl-C, SIGTERM and SIGHUP remove every temporary folder moejax makes (``interrupts``
turns the signals into exceptions). SIGKILL runs nothing; for that case each folder's name carries the
process id of its owner — ``<prefix><pid>-<random>`` — and the next call that makes a folder with the same
prefix in the same place removes those whose owner is no longer running.

Where: beside the output when there is one (``checkpoint.atomic_folder``); otherwise under
``MOEJAX_TMPDIR`` when it is set, else the system temporary folder (``temp_root``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

TMPDIR_ENV = "MOEJAX_TMPDIR"


def temp_root() -> str:
    """``$MOEJAX_TMPDIR`` (created if missing), else the system temporary folder."""
    root = os.environ.get(TMPDIR_ENV)
    if not root:
        return tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    return root


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def owner_pid(name: str, prefix: str) -> int | None:
    """The owner's pid in a folder name ``<prefix><pid>-<random>``, None if the name is not one of ours."""
    if not name.startswith(prefix):
        return None
    head = name[len(prefix):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def remove_stale(prefix: str, parent: str) -> list[str]:
    """Remove the folders and files ``<prefix><pid>-*`` in ``parent`` whose process has ended; return their
    paths (files: the temporary files of ``atomic.atomic_file``)."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = owner_pid(name, prefix)
        path = os.path.join(parent, name)
        if pid is None or pid == os.getpid() or _alive(pid):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isfile(path) or os.path.islink(path):
            with contextlib.suppress(OSError):
                os.remove(path)
        else:
            continue
        removed.append(path)
    return removed


def make_temp_dir(prefix: str, parent: str | None = None) -> str:
    """A new folder ``<parent>/<prefix><pid>-<random>`` (parent: ``temp_root()``), after removing the
    leftovers of ended processes with the same prefix there. The caller removes it when done."""
    parent = parent or temp_root()
    remove_stale(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
