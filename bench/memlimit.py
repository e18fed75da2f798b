"""Run a command under a memory budget (cgroup v1) and measure it: wall time, peak RSS, storage reads.

Library (pure stdlib, importable by the other bench scripts)::

    from memlimit import run_measured          # with bench/ on sys.path
    r = run_measured(["python", "x.py"], limit_bytes=12 << 30, drop_caches=True)

Command line (prints one JSON object on stdout)::

    python bench/memlimit.py --limit-gb 12 [--drop-caches] [--timeout S] [--no-capture] -- CMD ARGS...

How it works: with a limit, a fresh cgroup-v1 memory cgroup ``/sys/fs/cgroup/memory/moejax-bench-<pid>-<n>``
is created with ``memory.limit_in_bytes`` set (memsw is left alone; there is no swap here). The command is
started by a tiny single-threaded reaper (``python -I -S``, see ``_REAPER``): it forks, the child writes its
own pid to the cgroup's ``cgroup.procs``, starts a new session and exec-s the command, so nothing of the
command ever runs outside the budget (its children follow it); the reaper stays outside (never the OOM
victim), times the command, reaps it with ``os.wait4`` for its rusage and enforces ``timeout``. Page cache
of files the command reads (including ``mmap``-ed checkpoints) is charged to the cgroup, so a mapped file
larger than the budget really streams from storage. The caller reads the cgroup's peak and OOM count and
always removes the cgroup (killing whatever is still inside: only processes this call started can be
there), also on KeyboardInterrupt / SIGTERM / timeout; if the caller is SIGKILL-ed, PR_SET_PDEATHSIG takes
the reaper and the command down and the next call removes the stale cgroup (``cleanup_stale_cgroups``).
Needs root and the cgroup-v1 memory controller for a limit (RuntimeError otherwise) and root for
``drop_caches``; without either it runs anywhere.

Why a reaper rather than a plain fork from the caller: Linux carries the RSS high-water mark of the forked
copy of the caller into the child's ``ru_maxrss`` (measured here: a caller holding 2 GiB made ``true``
report 2 GiB), and a caller that has loaded JAX is big and multi-threaded (a ``preexec_fn`` is unsafe
there). Through the reaper the floor of ``peak_rss_bytes`` is the reaper's own ~8 MiB.

Caveat on budgets and the page cache: pages already in the page cache (read earlier by another process,
charged to another cgroup) are not charged to a new cgroup, so a warm file "fits" whatever the limit, and
reads served from the cache are not storage reads. Use ``drop_caches=True`` for a cold, honest run.

Fields of the result:
  returncode         command's exit status, negative signal number when killed (as ``subprocess``)
  wall_s             seconds from the reaper's fork to the reaping of the command (excludes the reaper's
                     start, ~20 ms, more right after a cache drop)
  peak_rss_bytes     ``ru_maxrss * 1024`` of the command (max over it and its reaped descendants; floor
                     ~8 MiB, see above); resident memory: resident pages of mapped files count, page cache
                     that is not mapped does not
  read_bytes         ``ru_inblock * 512``: bytes the command (all its threads, reaped descendants) caused to
                     be read from storage, page faults on mmap-ed files and readahead included; reads served
                     from the page cache do not count
  major_faults       ``ru_majflt`` (page faults that needed I/O)
  user_s, sys_s      CPU seconds of the command
  cgroup_peak_bytes  ``memory.max_usage_in_bytes`` of the cgroup (anon + page cache charged to it), or None
  cgroup_failcnt     times the cgroup's usage hit the limit (reclaim, not necessarily OOM), or None
  oom_killed         True when the kernel OOM killer fired in the cgroup (``oom_kill`` of
                     ``memory.oom_control``; on kernels without it: killed by SIGKILL and failcnt > 0)
  timed_out          True when ``timeout`` ran out and the command was killed
  limit_bytes, cgroup, cmd, stdout, stderr (text; None when not captured)
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

CGROUP_ROOT = os.environ.get("MOEJAX_CGROUP_MEMORY_ROOT", "/sys/fs/cgroup/memory")
CGROUP_PREFIX = "moejax-bench-"
_counter = itertools.count()


# --------------------------------------------------------------------------------------- cgroup helpers

def cgroup_v1_memory_available() -> tuple[bool, str]:
    """(ok, reason): whether a cgroup-v1 memory cgroup can be created here."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "memory limits need root (cgroup v1 memory controller); running as a non-root user"
    if not os.path.isfile(os.path.join(CGROUP_ROOT, "memory.limit_in_bytes")):
        return False, (f"cgroup v1 memory controller not mounted at {CGROUP_ROOT} "
                       "(no memory.limit_in_bytes there; cgroup v2-only systems are not supported)")
    if not os.access(CGROUP_ROOT, os.W_OK):
        return False, f"{CGROUP_ROOT} is not writable (read-only cgroup mount?)"
    return True, ""


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _read_int(path: str) -> int | None:
    s = _read(path)
    try:
        return int(s.strip()) if s is not None else None
    except ValueError:
        return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _cgroup_pids(cg: str) -> list[int]:
    s = _read(os.path.join(cg, "cgroup.procs")) or ""
    return [int(x) for x in s.split()]


def _oom_kills(cg: str) -> int | None:
    s = _read(os.path.join(cg, "memory.oom_control"))
    if s is None:
        return None
    for line in s.splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return None


def _remove_cgroup(cg: str, timeout: float = 10.0) -> None:
    """Kill what is left inside (only processes this module put there), then rmdir, retrying while busy."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in _cgroup_pids(cg):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(cg)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.EAGAIN) or time.monotonic() > deadline:
                raise RuntimeError(f"could not remove cgroup {cg}: {e}") from e
            time.sleep(0.05)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale_cgroups() -> list[str]:
    """Remove ``moejax-bench-<pid>-<n>`` cgroups left behind by a parent that died (e.g. SIGKILL-ed).

    Only cgroups whose creating pid no longer exists are touched. Returns the paths removed."""
    removed = []
    try:
        names = os.listdir(CGROUP_ROOT)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(CGROUP_PREFIX):
            continue
        try:
            owner = int(name[len(CGROUP_PREFIX):].split("-")[0])
        except ValueError:
            continue
        if owner == os.getpid() or _pid_alive(owner):
            continue
        cg = os.path.join(CGROUP_ROOT, name)
        try:
            _remove_cgroup(cg)
            removed.append(cg)
        except RuntimeError:
            pass
    return removed


def drop_page_cache() -> None:
    """sync, then ``echo 3 > /proc/sys/vm/drop_caches`` (root)."""
    os.sync()
    try:
        _write("/proc/sys/vm/drop_caches", "3")
    except OSError as e:
        raise RuntimeError(f"cannot drop the page cache (/proc/sys/vm/drop_caches needs root): {e}") from e


# --------------------------------------------------------------------------------------------- runner

# Runs as ``python -I -S -c _REAPER INFO_FD PROCS_PATH TIMEOUT CMD...``; reports JSON lines on INFO_FD:
# {"pid": N} once the command started (or {"error": ...}), then the result. See the module doc.
_REAPER = r"""
import os, sys, json, signal, time
info = int(sys.argv[1]); procs = sys.argv[2]; timeout = float(sys.argv[3]); cmd = sys.argv[4:]
os.set_inheritable(info, False)
def say(d):
    os.write(info, (json.dumps(d) + "\n").encode())
try:  # die with the caller (best effort; PR_SET_PDEATHSIG = 1)
    import ctypes; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
except Exception:
    pass
r, w = os.pipe2(os.O_CLOEXEC)
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.close(r)
        try:
            import ctypes; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except Exception:
            pass
        if procs:
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        os.setsid()
        os.execvp(cmd[0], cmd)
    except BaseException as e:
        try:
            os.write(w, ("%s: %s" % (type(e).__name__, e)).encode())
        finally:
            os._exit(127)
os.close(w)
err = b""
while True:
    b = os.read(r, 4096)
    if not b:
        break
    err += b
os.close(r)
if err:
    os.wait4(pid, 0)
    say({"error": err.decode(errors="replace")})
    sys.exit(127)
say({"pid": pid})
timed_out = []
def kill_all():
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if procs:
        try:
            for p in open(procs).read().split():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except OSError:
                    pass
        except OSError:
            pass
def on_alarm(signum, frame):
    timed_out.append(1)
    kill_all()
def on_term(signum, frame):
    kill_all()
signal.signal(signal.SIGALRM, on_alarm)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, on_term)
if timeout > 0:
    signal.setitimer(signal.ITIMER_REAL, timeout)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
signal.setitimer(signal.ITIMER_REAL, 0)
try:
    os.killpg(pid, signal.SIGKILL)  # leftovers of the command's session (it has exited)
except OSError:
    pass
say({"status": status, "wall_s": wall, "maxrss": ru.ru_maxrss, "inblock": ru.ru_inblock,
     "majflt": ru.ru_majflt, "utime": ru.ru_utime, "stime": ru.ru_stime, "timed_out": bool(timed_out)})
"""


def run_measured(cmd: list[str], limit_bytes: int | None = None, env=None, cwd=None,
                 drop_caches: bool = False, timeout: float | None = None, *,
                 capture: bool = True, stdout=None, stderr=None, cgroup: bool | None = None) -> dict:
    """Run ``cmd`` (optionally under a memory cgroup of ``limit_bytes``) and measure it. See module doc.

    capture: collect stdout/stderr as text into the result (default). With capture=False, ``stdout`` and
    ``stderr`` (file objects / fds / None = inherit) are handed to the command as they are.
    cgroup: run inside a fresh cgroup even without a limit (to get cgroup_peak_bytes); default: only when
    limit_bytes is given.
    """
    cmd = [os.fspath(c) if isinstance(c, os.PathLike) else str(c) for c in cmd]
    if not cmd:
        raise ValueError("run_measured: empty command")
    use_cgroup = (limit_bytes is not None) if cgroup is None else bool(cgroup)
    if use_cgroup:
        ok, why = cgroup_v1_memory_available()
        if not ok:
            raise RuntimeError(f"run_measured: cannot apply a memory limit: {why}")
    if drop_caches and os.geteuid() != 0:
        raise RuntimeError("run_measured: drop_caches=True needs root")
    if limit_bytes is not None and int(limit_bytes) <= 0:
        raise ValueError(f"limit_bytes must be positive, got {limit_bytes}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")

    cg = None
    proc = None
    reaped = False
    readers: list[threading.Thread] = []
    out_chunks: list[bytes] = []
    err_chunks: list[bytes] = []
    info_chunks: list[bytes] = []
    info_r = info_w = None
    old_term = None
    in_main = threading.current_thread() is threading.main_thread()

    def on_term(signum, frame):  # SIGTERM while the command runs: unwind through the cleanup below
        raise SystemExit(128 + signum)

    def info_lines() -> list[dict]:
        out = []
        for line in b"".join(info_chunks).decode(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def command_pid() -> int | None:
        for d in info_lines():
            if "pid" in d:
                return d["pid"]
        return None

    try:
        if use_cgroup:
            cleanup_stale_cgroups()
            cg = os.path.join(CGROUP_ROOT, f"{CGROUP_PREFIX}{os.getpid()}-{next(_counter)}")
            os.mkdir(cg)
            if limit_bytes is not None:
                _write(os.path.join(cg, "memory.limit_in_bytes"), str(int(limit_bytes)))
        if drop_caches:
            drop_page_cache()
        if in_main:
            old_term = signal.signal(signal.SIGTERM, on_term)

        info_r, info_w = os.pipe()
        so, se = (subprocess.PIPE, subprocess.PIPE) if capture else (stdout, stderr)
        reaper = [sys.executable, "-I", "-S", "-c", _REAPER, str(info_w),
                  os.path.join(cg, "cgroup.procs") if cg else "", str(timeout or 0)] + cmd
        proc = subprocess.Popen(reaper, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                                pass_fds=(info_w,))
        os.close(info_w)
        info_w = None

        def pump(fd_or_stream, sink):
            if isinstance(fd_or_stream, int):
                while True:
                    b = os.read(fd_or_stream, 1 << 16)
                    if not b:
                        break
                    sink.append(b)
                os.close(fd_or_stream)
            else:
                for chunk in iter(lambda: fd_or_stream.read(1 << 16), b""):
                    sink.append(chunk)
                fd_or_stream.close()
        readers = [threading.Thread(target=pump, args=(info_r, info_chunks), daemon=True)]
        info_r = None
        if capture:
            readers += [threading.Thread(target=pump, args=(proc.stdout, out_chunks), daemon=True),
                        threading.Thread(target=pump, args=(proc.stderr, err_chunks), daemon=True)]
        for t in readers:
            t.start()

        _, status, _ = os.wait4(proc.pid, 0)
        reaped = True
        proc.returncode = os.waitstatus_to_exitcode(status)
        if cg is not None:  # whatever the command left behind (e.g. a daemon holding our pipes)
            for pid in _cgroup_pids(cg):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for t in readers:
            t.join()

        lines = info_lines()
        errs = [d["error"] for d in lines if "error" in d]
        if errs:
            raise RuntimeError(f"run_measured: could not start {cmd[0]!r}"
                               + (f" inside {cg}" if cg else "") + f": {errs[0]}")
        res = [d for d in lines if "status" in d]
        if not res:
            raise RuntimeError(f"run_measured: the reaper exited ({proc.returncode}) without a result; "
                               "stderr: " + b"".join(err_chunks).decode(errors="replace")[-2000:])
        res = res[0]
        rc = os.waitstatus_to_exitcode(res["status"])
        cg_peak = cg_fail = oom_n = None
        if cg is not None:
            cg_peak = _read_int(os.path.join(cg, "memory.max_usage_in_bytes"))
            cg_fail = _read_int(os.path.join(cg, "memory.failcnt"))
            oom_n = _oom_kills(cg)
        if oom_n is not None:
            oom = oom_n > 0
        else:
            oom = cg is not None and rc == -signal.SIGKILL and bool(cg_fail) and not res["timed_out"]
        return {
            "returncode": rc,
            "wall_s": res["wall_s"],
            "peak_rss_bytes": res["maxrss"] * 1024,
            "read_bytes": res["inblock"] * 512,
            "major_faults": res["majflt"],
            "user_s": res["utime"],
            "sys_s": res["stime"],
            "cgroup_peak_bytes": cg_peak,
            "cgroup_failcnt": cg_fail,
            "oom_killed": oom,
            "timed_out": res["timed_out"],
            "limit_bytes": None if limit_bytes is None else int(limit_bytes),
            "cgroup": cg,
            "cmd": cmd,
            "stdout": b"".join(out_chunks).decode(errors="replace") if capture else None,
            "stderr": b"".join(err_chunks).decode(errors="replace") if capture else None,
        }
    finally:
        try:
            for fd in (info_r, info_w):
                if fd is not None:
                    os.close(fd)
            if proc is not None and not reaped:
                cpid = command_pid()
                if cpid is not None:
                    try:
                        os.killpg(cpid, signal.SIGKILL)
                    except OSError:
                        pass
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    os.wait4(proc.pid, 0)
                except ChildProcessError:
                    pass
                proc.returncode = -signal.SIGKILL
            if cg is not None:
                _remove_cgroup(cg)
            for t in readers:
                t.join(timeout=5)
        finally:
            if old_term is not None:
                signal.signal(signal.SIGTERM, old_term)


def gib(n: int | float | None) -> float | None:
    return None if n is None else n / 2**30


# ------------------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        i = argv.index("--")
        own, cmd = argv[:i], argv[i + 1:]
    else:
        own, cmd = [], argv
    p = argparse.ArgumentParser(description="Run CMD under a cgroup-v1 memory limit and print measurements "
                                            "as JSON.", usage="%(prog)s [--limit-gb G] [options] -- CMD ...")
    p.add_argument("--limit-gb", type=float, default=None, help="memory limit in GiB (default: none)")
    p.add_argument("--drop-caches", action="store_true", help="sync and drop the page cache before the start")
    p.add_argument("--timeout", type=float, default=None, help="kill the command after this many seconds")
    p.add_argument("--cgroup", action="store_true", help="use a cgroup even without a limit (for its peak)")
    p.add_argument("--no-capture", action="store_true",
                   help="let the command's stdout/stderr through to this script's stderr instead of the JSON")
    args = p.parse_args(own)
    if not cmd:
        p.error("no command given (put it after --)")
    limit = None if args.limit_gb is None else int(args.limit_gb * 2**30)
    try:
        r = run_measured(cmd, limit_bytes=limit, drop_caches=args.drop_caches, timeout=args.timeout,
                         capture=not args.no_capture, stdout=sys.stderr, stderr=sys.stderr,
                         cgroup=True if args.cgroup else None)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"memlimit: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r, indent=2))
    rc = r["returncode"]
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
