"""Orbax saves and restores whose failures are one clean error.

A damaged checkpoint (a truncated or missing data file) made orbax raise a bare ``Exception`` from tensorstore,
which no command turned into its one ``error:`` line: ``train --resume`` printed a 144-line traceback.
``restore`` raises ``errors.Failure`` naming the checkpoint instead.

Orbax writes a checkpoint from background threads (tensorstore's writes, a metadata thread) into
``PATH.orbax-checkpoint-tmp`` and renames it when complete. When a write fails, ``wait_until_finished`` raises
while some of those threads still run: removing the unfinished folder at once raced with them (a ``_sharding``
file written after the removal left the folder behind), and they printed hundreds of lines (ERROR log records
with tracebacks, asyncio's "Task exception was never retrieved", tensorstore's "Event loop is closed", Python's
"coroutine ... was never awaited" at exit; a failed read, orbax's abandoned coroutines with a whole tensorstore
spec each), some after the command's own one-line error. ``save`` and ``restore`` wait for the threads they
started and keep their noise out of the terminal; ``save`` removes orbax's unfinished folder; the caller reports
the failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from typing import Any, Iterator

from moejax.base import errors

THREADS_TIMEOUT_S = 30.0  # the most a failed save waits for its threads to end
QUIET_S = 0.5  # a failed save's unfinished folder must stay gone this long: tensorstore's own threads may still write
_NOISY_LOGGERS = ("absl", "asyncio")  # orbax logs through absl; its unfinished writes through asyncio


def save(path: str, tree: Any) -> None:
    """Write ``tree`` to ``path`` with orbax's ``StandardCheckpointer`` and wait until it is complete. On
    failure the exception propagates once every thread the save started has ended (at most
    ``THREADS_TIMEOUT_S``) and orbax's unfinished folder (``PATH.orbax-checkpoint-tmp*``) is gone."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    before = set(threading.enumerate())
    ckpt = ocp.StandardCheckpointer()
    try:
        with failure_quiet():
            try:
                ckpt.save(path, tree)
                ckpt.wait_until_finished()
            finally:
                ckpt.close()
    except BaseException:
        _join_new_threads(before, THREADS_TIMEOUT_S)
        _remove_unfinished(path, THREADS_TIMEOUT_S)
        raise


def _remove_unfinished(path: str, timeout_s: float) -> None:
    """Remove orbax's unfinished folders of ``path`` until none has come back for ``QUIET_S``: tensorstore writes
    from threads of its own, which no ``join`` waits for."""
    parent, name = os.path.split(path)
    deadline = time.monotonic() + timeout_s
    quiet_since = None
    while time.monotonic() < deadline:
        try:
            left = [n for n in os.listdir(parent) if n.startswith(name + ".orbax-checkpoint-tmp")]
        except FileNotFoundError:
            return
        if left:
            quiet_since = None
            for n in left:
                shutil.rmtree(os.path.join(parent, n), ignore_errors=True)
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= QUIET_S:
            return
        time.sleep(0.02)


def restore(path: str, target: Any = None) -> Any:
    """Read the checkpoint at ``path`` into the structure of ``target`` (``jax.ShapeDtypeStruct`` leaves), or,
    without one, into what its own metadata describes. Any failure to read it is an ``errors.Failure`` naming
    the folder (orbax raises many types, tensorstore a bare ``Exception``)."""
    import jax
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise errors.Failure(f"the checkpoint {path} is missing")
    before = set(threading.enumerate())
    ckpt = ocp.StandardCheckpointer()
    try:
        with failure_quiet(logging.WARNING):  # its warnings too ("Metadata file does not exist", ...)
            try:
                if target is None:
                    meta = ckpt.metadata(path)
                    tree = getattr(meta, "item_metadata", meta)
                    tree = getattr(tree, "tree", tree)
                    if tree is None:
                        raise ValueError("its metadata (_METADATA) is missing")
                    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), dict(tree))
                return ckpt.restore(path, target)
            finally:
                ckpt.close()
    except Exception as e:  # noqa: BLE001 - see the docstring
        _join_new_threads(before, THREADS_TIMEOUT_S)
        cause = e
        while cause.__cause__ is not None:  # tensorstore's own error names the array and the file
            cause = cause.__cause__
        text = str(cause).split(" See full TensorStore details")[0]  # the rest is a whole tensorstore spec
        raise errors.Failure(f"cannot read the checkpoint {path} (damaged or incomplete): {type(cause).__name__}: "
                             f"{errors.excerpt(text)}") from e


def _join_new_threads(before: set, timeout_s: float) -> None:
    """Wait for the threads started since ``before`` was taken. Orbax's threads re-raise their own failure from
    ``join`` (the save's failure, already on its way): that ended the wait early and skipped the clean-up
    after it, which left the unfinished folder behind in 1 failed save in 3."""
    deadline = time.monotonic() + timeout_s
    for thread in set(threading.enumerate()) - before:
        if thread is not threading.current_thread():
            with contextlib.suppress(Exception):
                thread.join(max(0.0, deadline - time.monotonic()))


class _DropFrom(logging.Filter):
    """Drops records from ``level`` up (a failed save's reports); lesser records pass."""

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


def _from_orbax(info) -> bool:
    """An unraisable exception of a failed save or read: tensorstore calling back into the event loop orbax
    closed, or one of orbax's abandoned coroutines collected with its error (printed with a whole tensorstore
    spec, some 2,000 lines)."""
    if isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == "Event loop is closed":
        return True
    code = getattr(info.object, "cr_code", None)
    if code is not None and "orbax" in code.co_filename:
        return True
    tb = info.exc_traceback
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _orbax_ignored(hook):
    def unraisable(info):
        if not _from_orbax(info):
            hook(info)
    return unraisable


_kept: dict = {}  # what a failed block left in place for the rest of the process: "filter", "hook"


@contextlib.contextmanager
def failure_quiet(level: int = logging.ERROR) -> Iterator[None]:
    """Orbax's and tensorstore's own reports of a failing save or read (log records from ``level`` up) are
    dropped during the block, and after a failure for the rest of the process (they keep arriving until exit;
    one such filter at a time, the widest); the caller reports the failure. A block that succeeds leaves
    logging as it was."""
    drop = _DropFrom(level)
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    hook = sys.unraisablehook
    sys.unraisablehook = _orbax_ignored(hook)
    failed = True
    try:
        yield
        failed = False
    finally:
        if failed:
            # the failed block's threads report on, and its unfinished writes are garbage-collected at exit
            # ("coroutine ... was never awaited")
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            kept = _kept.get("filter")
            keep, drop_now = (drop, kept) if kept is None or drop.level < kept.level else (kept, drop)
            _kept["filter"] = keep
            if "hook" in _kept:
                sys.unraisablehook = hook
            else:
                _kept["hook"] = sys.unraisablehook
        else:
            drop_now = drop
            sys.unraisablehook = hook
        if drop_now is not None:
            for logger in loggers:
                logger.removeFilter(drop_now)
