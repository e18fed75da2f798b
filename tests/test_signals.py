"""SIGTERM and Ctrl-C in the middle of a command's work, as a user or a scheduler sends them: real processes,
real signals. A command ends with ``128 + signal`` within seconds, without a traceback or a crash in the
interpreter's teardown, and leaves no temporary file behind; a distributed worker waiting for its coordinator
says what it waits for, stops at a signal, and gives up after its timeout with one error line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

STUDY = ["--only", "pareto", "--max-tokens", "45", "--context", "16", "--points", "2", "--batch-size", "1",
         "--no-progress"]
#: seconds a stopped command may take to end (the watchdog's grace is 5 s; a clean exit takes well under 1 s)
PROMPT_S = 8.0


def _start(module: str, args: list[str], err_path, env: dict | None = None) -> subprocess.Popen:
    with open(err_path, "w") as err:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL, stderr=err,
                                env=env or dict(os.environ), text=True)


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a SIGTERM handler: the command's own (``interrupts``), installed once it starts."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def _wait_until(condition, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the command ended ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _stop(proc: subprocess.Popen, sig: int) -> tuple[int, float]:
    """Send ``sig``; the exit status and the seconds the process took to end."""
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        status = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"still running 60 s after {signal.Signals(sig).name}")
    return status, time.monotonic() - sent


def _assert_stopped(status: int, took: float, sig: int, err_path) -> None:
    err = open(err_path).read()
    assert status == 128 + sig, (status, err[-2000:])  # -11 or 139: a segmentation fault in the teardown
    assert took < PROMPT_S, (took, err[-2000:])
    assert "Traceback" not in err and "Segmentation fault" not in err and "Fatal Python error" not in err, err


def _temporaries(folder) -> list[str]:
    """Hidden or ``.tmp-`` names anywhere under ``folder`` (the temporary names ``atomic`` and ``tempfiles`` give)."""
    return sorted(os.path.relpath(os.path.join(top, n), folder) for top, dirs, files in os.walk(folder)
                  for n in dirs + files if n.startswith(".") or ".tmp-" in n)


def _lines(path) -> int:
    """The complete lines of a file being appended to (0 while it does not exist)."""
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def _records(path) -> int:
    """The records of a finished results file: each line one whole JSON record (else this fails)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len([json.loads(line) for line in f])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/<pid>/status")
@pytest.mark.parametrize("sig, when", [(signal.SIGTERM, "started"), (signal.SIGINT, "started"),
                                       (signal.SIGINT, "computing"), (signal.SIGTERM, "first record")],
                         ids=["SIGTERM-importing", "SIGINT-importing", "SIGINT-computing", "SIGTERM-after-a-record"])
def test_a_study_stopped_by_a_signal_ends_with_its_status(tmp_path, sig, when):
    """Delivered as soon as the command handles signals (``import moejax``, before JAX is imported), a few
    seconds later (compiling or computing its first points), and once it has appended a record: the same status
    every time, and the results file holds whole records only."""
    out = tmp_path / "studies"
    err_path = tmp_path / "stderr"
    proc = _start("moejax.studies", [*STUDY, "--out", str(out)], err_path)
    try:
        _wait_until(lambda: _catches_sigterm(proc.pid), proc, 120, "signal handlers")
        if when == "computing":
            time.sleep(3.0)
        elif when == "first record":
            _wait_until(lambda: _lines(out / "pareto.jsonl") >= 1, proc, 300, "first record")
        status, took = _stop(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_stopped(status, took, sig, err_path)
    assert _temporaries(out) == []
    assert _records(out / "pareto.jsonl") >= (when == "first record")
    assert not os.path.exists(out / "manifest.json")  # written only when a study finished


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(tmp_path, timeout_s: float, flag: bool = False):
    """``moejax.evaluate`` as process 1 of 2 of a run whose coordinator never starts; its timeout from the
    environment, or with ``flag`` from ``--coordinator-timeout``."""
    address = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") or k == "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu")
    if not flag:
        env["MOEJAX_COORDINATOR_TIMEOUT"] = str(timeout_s)
    err_path = tmp_path / "stderr"
    args = ["--max-tokens", "10", "--distributed", "--coordinator", address, "--num-processes", "2",
            "--process-id", "1"] + (["--coordinator-timeout", str(timeout_s)] if flag else [])
    return _start("moejax.evaluate", args, err_path, env), address, err_path


def test_a_worker_without_a_coordinator_gives_up_with_one_error_line(tmp_path):
    proc, address, err_path = _worker(tmp_path, 3, flag=True)
    try:
        _wait_until(lambda: "waiting up to" in open(err_path).read(), proc, 120, "the waiting line")
        waiting = time.monotonic()
        status = proc.wait(timeout=60)
        assert time.monotonic() - waiting < 3 + PROMPT_S
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = open(err_path).read()
    assert status == 1, err[-2000:]
    assert f"waiting up to 3 s for the coordinator at {address}" in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and address in errors[0], err
    assert "Check failure" not in err and "Traceback" not in err and "***" not in err, err


def test_a_worker_waiting_for_its_coordinator_stops_at_sigterm(tmp_path):
    proc, address, err_path = _worker(tmp_path, 120)
    try:
        _wait_until(lambda: "waiting up to" in open(err_path).read(), proc, 120, "the waiting line")
        status, took = _stop(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _assert_stopped(status, took, signal.SIGTERM, err_path)
    assert took < 5.0
    assert "error:" not in open(err_path).read()


_COMPILING = r"""
import jax, jax.numpy as jnp
from moejax.base import interrupts
interrupts.exit_cleanly_on_signals(own_process=True)

def chain(x):
    for i in range(1500):  # one program that takes XLA seconds to compile
        x = jnp.sin(x @ x) * (i % 7) + jnp.cos(x)
    return x

lowered = jax.jit(chain).lower(jnp.ones((64, 64)))
print("compiling", flush=True)
lowered.compile()
print("compiled", flush=True)
"""


def _sigterm_child(code: str, ready: str) -> tuple[int, float, str, str]:
    """Run ``code`` in a child, SIGTERM it half a second after it prints ``ready``: (status, seconds it took to
    end, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        assert proc.stdout.readline() == ready + "\n"
        time.sleep(0.5)
        status, took = _stop(proc, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
    return status, took, out, err


def test_a_signal_during_an_xla_compilation_ends_the_command_at_once():
    """XLA compiles on its own thread pool while the main thread waits, interruptibly: the interpreter's teardown
    then destroyed the JAX client under the running compilation (a segmentation fault once it finished)."""
    status, took, out, err = _sigterm_child(_COMPILING, "compiling")
    assert "compiled" not in out, "the compilation ended before the signal: make the program longer"
    assert status == 128 + signal.SIGTERM and took < 3.0, (status, took, err[-2000:])


_STUCK = r"""
import hashlib
from moejax.base import interrupts
interrupts.exit_cleanly_on_signals(own_process=True)
interrupts.GRACE_S = 1.0
print("ready", flush=True)
hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10 ** 9)  # one C call of minutes: no Python handler runs meanwhile
"""


def test_a_main_thread_stuck_in_a_c_call_still_ends_after_the_grace():
    status, took, _, err = _sigterm_child(_STUCK, "ready")
    assert status == 128 + signal.SIGTERM and took < 1.0 + 3.0, (status, took, err)
    assert "still busy after SIGTERM" in err and "pbkdf2" not in err and "Traceback" not in err


_IN_A_GC_CALLBACK = r"""
import gc, signal, sys, time
from moejax.base import interrupts
interrupts.exit_cleanly_on_signals(own_process=True)
sent = []

def send_inside_the_callback(phase, info):  # as JAX's own gc callback: the handler runs in here
    if phase == "start" and len(sent) < int(sys.argv[1]):
        sent.append(1)
        signal.raise_signal(signal.SIGTERM)
        sum(range(1000))  # bytecode: the pending handler runs inside the callback

gc.callbacks.append(send_inside_the_callback)
print("ready", flush=True)
for _ in range(100):
    gc.collect()
    time.sleep(0.01)
print("ran on", flush=True)
"""


@pytest.mark.parametrize("times", [1, 2])
def test_a_signal_whose_exit_a_gc_callback_drops_still_ends_the_command(times):
    """Python runs a handler wherever the main thread next looks for one, also inside a garbage-collector callback
    (JAX's runs often while it traces), where the exit it raises is printed and dropped: the command ran on to its
    end as if no signal had come. Delivered again, the exit ends it at once, quietly; also when the second
    delivery lands in a callback too."""
    proc = subprocess.run([sys.executable, "-c", _IN_A_GC_CALLBACK, str(times)], capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout == "ready\n" and proc.returncode == 128 + signal.SIGTERM, (proc.returncode, proc.stdout,
                                                                                  proc.stderr)
    assert "Exception ignored" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_moejax_command_is_known_from_the_interpreter_command_line():
    from moejax.base.interrupts import _runs_a_moejax_module

    assert _runs_a_moejax_module(["python", "-m", "moejax.studies", "--out", "x"])
    assert _runs_a_moejax_module(["python", "-u", "-mmoejax.generate"]) and _runs_a_moejax_module(["py", "-m", "moejax"])
    for other in (["python", "-m", "pytest", "-m", "moejax.x"], ["python", "-c", "import moejax"], ["python"],
                  ["python", "script.py", "-m", "moejax.x"], ["python", "-m", "moejaxish"]):
        assert not _runs_a_moejax_module(other), other


def test_the_coordinator_timeout_comes_from_the_argument_else_the_environment(monkeypatch):
    from moejax.base import distributed

    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.join_timeout() == distributed.JOIN_TIMEOUT_S
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "2.5")
    assert distributed.join_timeout() == 2.5 and distributed.join_timeout(7) == 7.0
    for bad in ("soon", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(distributed.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="seconds"):
            distributed.join_timeout()
