"""Termination signals end a command the way an error does: clean-up code runs before the process exits.

Every writer in moejax builds its output under a temporary name and removes it when the block fails
(``checkpoint.atomic_folder``, ``safetensors_io.write_stream``, results files), and temporary folders are
removed at interpreter exit. Python runs none of that when SIGTERM or SIGHUP kill it with the default
action, so every command-line entry point calls ``exit_cleanly_on_signals()`` first: the signal becomes
``SystemExit(128 + signal)``, unwinding through those blocks. Ctrl-C (SIGINT) would raise
``KeyboardInterrupt``, which unwinds the same way but ends in a traceback: in a command it exits 130 quietly too.

After that clean-up (``finally`` blocks, then the ``atexit`` functions registered since), a command stopped by a
signal ends with ``os._exit`` instead of the interpreter's teardown (a command: the process's main module is a
moejax one; a program that calls a command's ``main`` itself, such as a test run, keeps its own exit). A signal
can land while XLA compiles on its own thread pool (the main thread's wait for it is interruptible, the
compilation is not): the teardown's garbage collection then destroyed the JAX client, whose destructor waited
for that compilation and whose worker, finishing it, called into the destroyed client (a segmentation fault,
tens of seconds after the signal). JAX's own exit functions, registered before, are skipped for the same reason.

A signal also starts a watchdog (``signal.set_wakeup_fd``: it wakes even while the main thread is inside a C++
call that does not return to Python). If the handler has not run ``GRACE_S`` seconds later, or the clean-up has
not ended ``CLEANUP_S`` seconds later, it says where the main thread is and exits with the signal's status (a
clean-up still going at ``GRACE_S`` is said on stderr too). A temporary file left by that exit carries the
process id in its name, and the next write of the same output removes it (``tempfiles.remove_stale``).

Python runs a signal handler wherever the main thread next checks for one, which can be inside a garbage-collector
callback or a finalizer (JAX registers a gc callback that runs often while it traces). An exception raised there
is "ignored": printed and dropped, and the command would run on as if the signal never came. The
``sys.unraisablehook`` installed with the handlers recognises that exception and delivers the signal again, to
land in ordinary code.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: seconds the main thread has to take a signal (run its handler), and to finish the clean-up it starts
GRACE_S, CLEANUP_S = 5.0, 30.0
#: seconds before a signal whose exit was dropped (see the module docstring) is delivered again
REDELIVER_S = 0.01
#: JAX's exit functions: they clear the backends, which waits for (and races with) a compilation in flight
_JAX_EXIT_FUNCTIONS = (("jax._src.api", "clean_up"), ("jax._src.dispatch", "wait_for_tokens"))

_stopping: list[int] = []  # the signal that is ending this process, once one has
_owner: list[bool] = []  # [True] once a command that owns this process has installed the handlers
_watchdog_sockets: list[socket.socket] = []  # kept open for the life of the process
_previous_unraisable_hook: list = []  # the hook ``_redeliver_dropped_exit`` replaced, once it has
_redelivering: list[bool] = []  # [True] while ``_redeliver_dropped_exit`` runs


def _exit(signum, frame):  # noqa: ARG001 - the signal handler signature
    if not _owner:
        raise SystemExit(128 + signum)
    if _redelivering:  # inside the hook that delivers the signal again: an exit raised here would be dropped too
        return
    if _stopping:  # already unwinding: a second exception would cut the clean-up short
        return
    _stopping.append(signum)
    _forget_jax_exit_functions()
    if not threading.main_thread().is_alive():  # the interpreter is already shutting down
        hard_exit(128 + signum)
    raise SystemExit(128 + signum)


def exit_cleanly_on_signals(own_process: bool | None = None) -> None:
    """Make Ctrl-C, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main thread (a no-op
    elsewhere): the same unwinding as an error, and no traceback. Where the command owns the process
    (``own_process``, by default: its main module is a moejax one), the process then ends without the
    interpreter's teardown, and in bounded time whatever the main thread is doing (the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, *SIGNALS):
        signal.signal(sig, _exit)
    if not _previous_unraisable_hook:
        _previous_unraisable_hook.append(sys.unraisablehook)
        sys.unraisablehook = _redeliver_dropped_exit
    if not _owner and (is_a_command() if own_process is None else own_process):
        _owner.append(True)
        atexit.register(_end_after_signal)
        _start_watchdog()


def _redeliver_dropped_exit(unraisable) -> None:
    """``sys.unraisablehook``: the exit a signal raised inside a gc callback or a finalizer was dropped there;
    deliver the signal again (quietly) so that its handler runs in code that lets the exit propagate."""
    value = unraisable.exc_value
    signum = _signal_of(value)
    if signum is None or threading.current_thread() is not threading.main_thread():
        _previous_unraisable_hook[0](unraisable)
        return
    _redelivering.append(True)  # a delivery due now (an earlier one's) must not raise in here: this one follows
    try:
        _stopping.clear()  # the exit this signal started never unwound: let the handler start it again
        # from another thread, once this hook and the callback have returned (delivered in here, it would be
        # dropped as well)
        threading.Thread(target=_deliver_later, args=(signum,), name="moejax-signal-again", daemon=True).start()
    finally:
        _redelivering.clear()


def _deliver_later(signum: int) -> None:
    time.sleep(REDELIVER_S)
    _thread.interrupt_main(signum)


def _signal_of(exception) -> int | None:
    """The signal an exception stands for: ``KeyboardInterrupt`` (SIGINT), or the ``SystemExit(128 + signal)``
    that ``_exit`` raised for the signal ending this process; else None."""
    if isinstance(exception, KeyboardInterrupt):
        return int(signal.SIGINT)
    code = exception.code if isinstance(exception, SystemExit) else None
    return _stopping[0] if _stopping and code == 128 + _stopping[0] else None


def is_a_command() -> bool:
    """Whether this process runs a moejax command: ``python -m moejax...``, ``moejax`` or a ``moejax-*`` script.
    Known from the start: ``sys.orig_argv`` names the module before ``runpy`` has imported the package to run it."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return (getattr(spec, "name", None) or "").startswith("moejax.") or script == "moejax" \
        or script.startswith("moejax-") or _runs_a_moejax_module(getattr(sys, "orig_argv", []))


def _runs_a_moejax_module(argv: list[str]) -> bool:
    """Whether an interpreter command line runs ``-m moejax`` or ``-m moejax.<command>``."""
    for i, arg in enumerate(argv[1:], start=1):
        module = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else arg[2:] if arg.startswith("-m") else None
        if module is not None:
            return module == "moejax" or module.startswith("moejax.")
        if arg in ("-c", "-") or not arg.startswith("-"):  # a script, code or stdin runs, not a module
            return False
    return False


def _end_after_signal() -> None:
    """atexit: after a signal, end here, once the clean-up registered later has run (see the module docstring)."""
    if _stopping:
        hard_exit(128 + _stopping[0])


def _forget_jax_exit_functions() -> None:
    """Unregister JAX's exit functions where JAX was imported after ``exit_cleanly_on_signals`` (they would
    run before ``_end_after_signal``)."""
    for module, name in _JAX_EXIT_FUNCTIONS:
        function = getattr(sys.modules.get(module), name, None)
        if callable(function):
            atexit.unregister(function)


def hard_exit(status: int) -> None:
    """End the process now with ``status``: stdout and stderr flushed (for at most a second: a stuck writer
    must not hold the exit), the chat-template worker closed, no interpreter teardown."""
    templates = sys.modules.get("moejax.base.templates")
    if templates is not None:
        with contextlib.suppress(Exception):
            templates.close()
    flusher = threading.Thread(target=_flush_std_streams, name="moejax-exit-flush", daemon=True)
    flusher.start()
    flusher.join(1.0)
    os._exit(status)


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _start_watchdog() -> None:
    """A daemon thread woken by every signal through ``signal.set_wakeup_fd`` (left alone where another
    wakeup fd is in place, e.g. an asyncio loop's)."""
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        previous = None
    if previous != -1:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return
    _watchdog_sockets.extend((reader, writer))
    threading.Thread(target=_watch, args=(reader,), name="moejax-signal-watchdog", daemon=True).start()


def _watch(reader: socket.socket) -> None:
    exits = {int(s) for s in (signal.SIGINT, *SIGNALS)}
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        # a signal ``_exit`` takes: not one a ``deferred`` block holds back (it comes again), nor another handler's
        taken = [b for b in data if b in exits and signal.getsignal(b) is _exit]
        if taken:
            _bound_the_exit(taken[0])


def _bound_the_exit(signum: int) -> None:
    """The watchdog's part once a signal has come: the process ends within ``GRACE_S`` if the handler never runs
    (the main thread stays inside one C++ call), else within ``CLEANUP_S``, saying what it waits for. A main
    thread that ran on without ``_exit`` gave the signal to another handler: nothing to bound."""
    name, before = signal.Signals(signum).name, _main_position()
    time.sleep(GRACE_S)
    if not _stopping and _main_position() != before:
        return
    if _stopping:
        _say(f"moejax: cleaning up after {name}{_main_thread_at()}: exiting within "
             f"{CLEANUP_S - GRACE_S:g} s ...")
        time.sleep(CLEANUP_S - GRACE_S)
    _say(f"moejax: still busy after {name}{_main_thread_at()}: exiting without the rest of the clean-up")
    hard_exit(128 + signum)


def _main_position() -> tuple:
    """The main thread's innermost frame and instruction: unchanged while it waits inside a C call."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return (frame, frame.f_lasti) if frame is not None else (None, -1)


def _main_thread_at() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return ""
    return f" (the main thread is in {frame.f_code.co_name}, {os.path.basename(frame.f_code.co_filename)}:" \
        f"{frame.f_lineno})"


def _say(line: str) -> None:
    """One line on stderr, not through ``sys.stderr``, whose lock the main thread may hold."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode())


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
