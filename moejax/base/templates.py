"""Rendering an untrusted chat template with bounded time, memory and output.

Jinja's sandbox stops a template from touching what it should not, but not from looping: two nested
``range(100000)`` loops in a hub checkpoint's ``chat_template`` grew a server's memory by ~100 MB/s, outlived
the client's timeout, and the thread rendering it kept the process from exiting on SIGTERM. So templates run in
one long-lived child process (``_template_worker.py``, started on first use, ~0.1 s): its address space is
capped, its output is cut at ``max_chars``, and a render that is not done within ``timeout_s`` kills it (the next
render starts a fresh one). ``close()`` kills it at once, which also releases a thread waiting on it.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

from moejax.base.errors import Failure

#: seconds a render may take (a real chat template renders in milliseconds)
TIMEOUT_S = 5.0
#: characters a render may produce when the caller gives no bound
MAX_CHARS = 1 << 24
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_template_worker.py")


class TemplateSyntaxError(Failure):
    """The template is not valid Jinja (``line`` says where)."""

    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


class TemplateRefused(ValueError):
    """The template called ``raise_exception``: it refuses these variables (a request's fault, not the file's)."""


class TemplateTooLong(ValueError):
    """The rendered text would exceed ``max_chars`` (the caller's bound: e.g. what a context can hold)."""


class TemplateBudgetError(Failure):
    """The template ran out of time or memory, or failed: the template's fault, whatever the variables."""


class _Worker:
    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.closed = False

    def _start(self) -> subprocess.Popen:
        # its own session: a terminal's Ctrl-C goes to the command, which then ends the worker (close)
        return subprocess.Popen([sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.kill()

    def ask(self, request: dict, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        if not self.lock.acquire(timeout=max(timeout_s, 0.0) * 4):  # others' renders are bounded too
            raise TemplateBudgetError(f"the chat template renderer stayed busy for over {4 * timeout_s:g} s")
        try:
            if self.closed:
                raise TemplateBudgetError("the chat template renderer is shut down (the process is stopping)")
            if self.proc is None or self.proc.poll() is not None:
                self.kill()
                self.proc = self._start()
            proc = self.proc
            if self.closed:  # close() ran while the worker started: it found no process to end
                self.kill()
                raise TemplateBudgetError("the chat template renderer is shut down (the process is stopping)")
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
                proc.stdin.flush()
            except OSError:
                self.kill()
                raise TemplateBudgetError("the chat template renderer died before rendering") from None
            line = _read_line(proc.stdout, deadline, lambda: self.closed)
            if line is None:  # past the deadline, or the process died (closed, or killed by the system)
                timed_out = time.monotonic() >= deadline
                self.kill()
                if timed_out:
                    raise TemplateBudgetError(f"did not finish rendering within {timeout_s:g} s (an untrusted "
                                              "template may loop without end): refusing it")
                raise TemplateBudgetError("the chat template renderer ended while rendering"
                                          + (" (the process is stopping)" if self.closed else ""))
            return json.loads(line)
        finally:
            self.lock.release()


def _read_line(stream, deadline: float, stopped) -> bytes | None:
    """One line from ``stream`` before ``deadline`` (None if the time runs out, the stream ends or ``stopped()``)."""
    fd, buf = stream.fileno(), bytearray()
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or stopped():
            return None
        try:  # close() from another thread ends the worker and closes its pipes under us
            ready, _, _ = select.select([fd], [], [], min(left, 0.25))
            if not ready:
                continue
            part = os.read(fd, 1 << 20)
        except (OSError, ValueError):
            return None
        if not part:
            return None
        buf += part
    return bytes(buf)


_WORKER = _Worker()
atexit.register(_WORKER.close)


def render(template: str, variables: dict, max_chars: int = MAX_CHARS, timeout_s: float | None = None) -> str:
    """``template`` rendered with ``variables`` (JSON values) in the bounded child process.

    Raises ``TemplateSyntaxError``, ``TemplateRefused`` (``raise_exception``), ``TemplateTooLong`` or
    ``TemplateBudgetError`` (time, memory or any other failure of the template)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    reply = _WORKER.ask({"template": template, "variables": variables, "max_chars": int(max_chars)}, timeout_s)
    if "text" in reply:
        return reply["text"]
    if "syntax" in reply:
        raise TemplateSyntaxError(reply["syntax"], reply.get("line"))
    if "refused" in reply:
        raise TemplateRefused(reply["refused"])
    if "too_long" in reply:
        raise TemplateTooLong(f"the rendered text would be over {reply['too_long']:,} characters")
    if "memory" in reply:
        raise TemplateBudgetError(f"needed over {reply['memory'] >> 20} MiB of memory to render: refusing it")
    raise TemplateBudgetError(f"failed to render: {reply.get('error')}")


def close() -> None:
    """Stop the renderer now (a command that is stopping): a render in progress and later ones fail at once."""
    _WORKER.close()
