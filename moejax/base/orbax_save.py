"""Saving a pytree with orbax so that a failed save (a full disk) is one clean failure.

Orbax writes a checkpoint from background threads (tensorstore's writes, a metadata thread) into
``PATH.orbax-checkpoint-tmp`` and renames it when complete. When a write fails, ``wait_until_finished`` raises
while some of those threads still run: removing the unfinished folder at once raced with them (a ``_sharding``
file written after the removal left the folder behind), and they printed hundreds of lines (ERROR log records
with tracebacks, asyncio's "Task exception was never retrieved", tensorstore's "Event loop is closed", Python's
"coroutine ... was never awaited" at exit), some after the command's own one-line error. ``save`` waits for the threads the save started, and keeps their
noise out of the terminal; the caller removes what is left and reports the failure in one line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import warnings
from typing import Any, Iterator

THREADS_TIMEOUT_S = 30.0  # the most a failed save waits for its threads to end
_NOISY_LOGGERS = ("absl", "asyncio")  # orbax logs through absl; its unfinished writes through asyncio


def save(path: str, tree: Any) -> None:
    """Write ``tree`` to ``path`` with orbax's ``StandardCheckpointer`` and wait until it is complete. On
    failure the exception propagates once every thread the save started has ended (at most
    ``THREADS_TIMEOUT_S``), so that nothing writes into the unfinished folder any more."""
    import orbax.checkpoint as ocp

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
        raise


def _join_new_threads(before: set, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in set(threading.enumerate()) - before:
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


class _DropErrors(logging.Filter):
    """Drops ERROR records (a failed save's reports); lesser records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _closed_loop_ignored(hook):
    def unraisable(info):  # tensorstore calling back into the event loop orbax closed when the save failed
        if not (isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == "Event loop is closed"):
            hook(info)
    return unraisable


@contextlib.contextmanager
def failure_quiet() -> Iterator[None]:
    """Orbax's and tensorstore's own reports of a failing save are dropped during the block, and after a
    failure for the rest of the process (they keep arriving until exit); the caller reports the failure. A
    block that succeeds leaves logging as it was."""
    drop = _DropErrors()
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    hook = sys.unraisablehook
    sys.unraisablehook = _closed_loop_ignored(hook)
    try:
        yield
    except BaseException:
        # the filters stay: the failed save's threads report on until the process ends, and its unfinished
        # writes are garbage-collected at exit ("coroutine ... was never awaited")
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
        raise
    else:
        for logger in loggers:
            logger.removeFilter(drop)
        sys.unraisablehook = hook
