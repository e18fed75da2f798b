"""Termination signals end a command the way an error does: clean-up code runs before the process exits.

Every writer in moejax builds its output under a temporary name and removes it when the block fails
(``checkpoint.atomic_folder``, ``safetensors_io.write_stream``, results files), and temporary folders are
removed at interpreter exit. Python runs none of that when SIGTERM or SIGHUP kill it with the default
action, so every command-line entry point calls ``exit_cleanly_on_signals()`` first: the signal becomes
``SystemExit(128 + signal)``, unwinding through those blocks. Ctrl-C (SIGINT) would raise
``KeyboardInterrupt``, which unwinds the same way but ends in a traceback: in a command it exits 130 quietly too.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit(signum, frame):  # noqa: ARG001 - the signal handler signature
    raise SystemExit(128 + signum)


def exit_cleanly_on_signals() -> None:
    """Make Ctrl-C, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread (a no-op
    elsewhere): the same unwinding as an error, and no traceback."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, *SIGNALS):
        signal.signal(sig, _exit)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP arriving inside the block take effect when it ends, delivered again to the
    handlers that were in place. For a step that makes something and takes charge of removing it (a
    temporary folder created, then guarded by a ``try``): a signal landing between the two would leave the
    thing behind. Python runs signal handlers in the main thread only, so elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, *SIGNALS):
        handler = signal.getsignal(sig)
        if handler is not None:  # None: a handler installed outside Python, left alone
            previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in caught:
            signal.raise_signal(sig)
