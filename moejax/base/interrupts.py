"""Termination signals end a command the way an error does: clean-up code runs before the process exits.

Every writer in moejax builds its output under a temporary name and removes it when the block fails
(``checkpoint.atomic_folder``, ``safetensors_io.write_stream``, results files), and temporary folders are
removed at interpreter exit. Python runs none of that when SIGTERM or SIGHUP kill it with the default
action, so every command-line entry point calls ``exit_cleanly_on_signals()`` first: the signal becomes
``SystemExit(128 + signal)``, unwinding through those blocks. Ctrl-C (SIGINT) already raises
``KeyboardInterrupt``, which unwinds the same way.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit(signum, frame):  # noqa: ARG001 - the signal handler signature
    raise SystemExit(128 + signum)


def exit_cleanly_on_signals() -> None:
    """Make SIGTERM / SIGHUP raise ``SystemExit`` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _exit)
