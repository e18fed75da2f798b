"""The JSONL results file of sweeps and studies: one record per line, appended atomically, read back with a
torn last line tolerated (never an unrelated file truncated). The record schema is ``moejax.evaluation.sweep``'s.

Appends are flushed and fsync'ed under an exclusive lock; in a multi-process run process 0 alone reads (and
broadcasts what it read) and writes (``moejax.base.distributed``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import numpy as np

try:
    import fcntl
except ImportError:  # not POSIX: appends are still whole lines, runs do not share points
    fcntl = None

from moejax.base import atomic, distributed, errors


def as_json(x):
    """numpy scalars/arrays -> Python, NaN/inf -> null (JSON has neither)."""
    if isinstance(x, dict):
        return {str(k): as_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [as_json(v) for v in x]
    if isinstance(x, np.ndarray):
        return as_json(x.tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else None
    return x


RECORD_PREFIX = b'{"key": '  # every record line starts so (json.dumps of a dict whose first key is "key")


def _parse_lines(path: str, data: bytes) -> tuple[list[dict], int]:
    """Records and the byte length of the file's valid prefix.

    An unterminated last line that does not parse is a write cut short by a crash, and is cut off, but
    only where the file is evidently a results file: the earlier lines are all records, and either there
    are some or the torn line starts like one. Anything else (an unrelated file, a settings.json without
    its final newline) raises ``ValueError`` instead of being truncated: never lose what the user had."""
    records, good_end, pos = [], 0, 0
    lines = data.split(b"\n")
    for i, raw in enumerate(lines):
        end = pos + len(raw) + (1 if i < len(lines) - 1 else 0)
        terminated = i < len(lines) - 1
        if raw.strip():
            complete = False  # a whole JSON value is never a torn record, whatever it holds
            try:
                rec = json.loads(raw.decode("utf-8"))
                complete = True
                if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
                    raise ValueError("not a JSON object with a string 'key'")
            except (ValueError, UnicodeDecodeError) as e:
                torn = not terminated and (bool(records) or raw.lstrip().startswith(RECORD_PREFIX))
                if torn and not complete:  # a write cut short by a crash: ignore it
                    return records, good_end
                what = "line" if terminated else "last line"
                raise errors.Failure(f"{path}:{i + 1}: not a moejax results file (malformed {what}: {e}); "
                                 "fix or remove that line, or choose another results path") from None
            records.append(rec)
        good_end = end
        pos = end
    return records, good_end


def load_results(path: str) -> list[dict]:
    """Every record of a JSONL results file, in file order ([] if the file does not exist). A truncated
    last line (crash mid-write) is ignored; a malformed complete line raises ``ValueError`` with file:line.
    In a multi-process run process 0 reads the file and every process gets its records (``distributed``)."""
    if distributed.is_multiprocess():
        got = distributed.broadcast(_read_or_error(path) if distributed.is_leader() else None)
        if "error" in got:
            raise ValueError(got["error"])
        return got["records"]
    return _read_results(path)


def check_results_path(path: str) -> None:
    """A results file is a regular file (or not there yet): a device or a pipe (``/dev/zero``) never ends."""
    if os.path.isdir(path):
        raise IsADirectoryError(f"results file {path} is a folder; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise OSError(f"results file {path} is not a regular file")


def _read_results(path: str) -> list[dict]:
    check_results_path(path)
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    return _parse_lines(path, data)[0]


def _read_or_error(path: str) -> dict:
    try:
        return {"records": _read_results(path)}
    except (ValueError, OSError) as e:
        return {"error": str(e)}


def _repair(f, path: str) -> None:
    """Cut a half-written last line off an open (r+b) results file; terminate a complete unterminated one."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        return
    f.seek(size - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    _, good_end = _parse_lines(path, f.read())
    if good_end >= size:  # the last line parses: it only lacks its newline
        f.seek(0, os.SEEK_END)
        f.write(b"\n")
    else:
        f.truncate(good_end)
    f.flush()


def append_result(path: str, record: dict) -> None:
    """Append one record as one line: repair a torn tail first, then write + flush + fsync (under an
    exclusive lock, so two processes appending to one file do not interleave). In a multi-process run only
    process 0 writes."""
    if not distributed.is_leader():  # a multi-process run: process 0 writes for all
        return
    line = json.dumps(as_json(record), allow_nan=False) + "\n"
    check_results_path(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            if fcntl is not None:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError:  # no flock here: appends are still whole lines
            pass
        _repair(f, path)
        atomic.append_whole(f, line.encode("utf-8"), path)  # a full disk leaves no torn line


# ------------------------------------------------------------------------------ runs that share one file

#: a point's claim is a lock on one byte at this offset + 40 bits of its key's hash: far past the end of any
#: real file (a lock on bytes that do not exist neither needs them nor changes the file)
_CLAIM_BASE = 1 << 62
# OFD locks take a 64-bit Linux ``struct flock`` (short, short, off_t, off_t, pid_t: "hhqqi4x")
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", None) if struct.calcsize("l") == 8 else None
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None)


class PointClaims:
    """Which points of a results file some run is computing right now, so that runs sharing one file
    (``evaluate --results r.jsonl`` started twice, one per GPU) split its points instead of each computing
    all of them.

    A claim is an open-file-description lock (Linux ``F_OFD_SETLK``: unlike ``lockf``'s, closing another
    descriptor of the file, as every append does, does not drop it) on one byte per point key, far past the
    file's end. The kernel drops a run's claims when it ends, however it ends, so the points of a run that
    died are taken over by whoever waits for them. Where OFD locks do not exist (not Linux) or the
    filesystem refuses them, nothing is shared: every run computes its own points, as before.

    ``new_records`` reads what other runs appended since the last call (records are whole lines: appends
    hold ``flock``)."""

    def __init__(self, path: str):
        self.path = path
        self._held: set[str] = set()
        self._end = 0
        existed = os.path.exists(path)
        self._made_folders = []  # deepest first: removed again with the file if this run writes nothing
        folder = os.path.dirname(os.path.abspath(path))
        while folder and not os.path.exists(folder) and folder != os.path.dirname(folder):
            self._made_folders.append(folder)
            folder = os.path.dirname(folder)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a+b")  # a write lock needs a descriptor open for writing
        except OSError as e:
            raise OSError(f"cannot write results file {path}: {e.strerror or e}") from None
        self._created = None if existed else os.fstat(self._file.fileno())
        self.shared = self.available()
        if self.shared:
            try:
                self._lock(_F_OFD_SETLK, fcntl.F_RDLCK, _CLAIM_BASE - 1)  # a probe: does this filesystem lock?
                self._lock(_F_OFD_SETLK, fcntl.F_UNLCK, _CLAIM_BASE - 1)
            except OSError:
                self.shared = False

    @staticmethod
    def available() -> bool:
        """Whether this system has the locks that let runs share points."""
        return _F_OFD_SETLK is not None

    @staticmethod
    def _byte(key: str) -> int:
        return _CLAIM_BASE + int(hashlib.sha256(key.encode()).hexdigest()[:10], 16)

    def _lock(self, cmd: int, kind: int, start: int) -> None:
        fcntl.fcntl(self._file.fileno(), cmd, struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0))

    def claim(self, keys: list[str]) -> list[str]:
        """The ``keys`` this run may compute now (claimed for it); the others are being computed elsewhere."""
        if not self.shared:
            return list(keys)
        mine = []
        for k in keys:
            if k not in self._held:
                try:
                    self._lock(_F_OFD_SETLK, fcntl.F_WRLCK, self._byte(k))
                except (BlockingIOError, PermissionError):  # EAGAIN / EACCES: another run holds it
                    continue
                self._held.add(k)
            mine.append(k)
        return mine

    def wait(self, keys: list[str]) -> None:
        """Claim ``keys``, waiting while other runs compute them (or until those runs end). Every run waits
        in one order (of the locked bytes), so two runs waiting for each other's points cannot deadlock."""
        for k in sorted(keys, key=self._byte):
            if self.shared and k not in self._held:
                self._lock(_F_OFD_SETLKW, fcntl.F_WRLCK, self._byte(k))
                self._held.add(k)

    def release(self, keys) -> None:
        for k in keys:
            if k in self._held:
                self._lock(_F_OFD_SETLK, fcntl.F_UNLCK, self._byte(k))
                self._held.discard(k)

    def new_records(self) -> list[dict]:
        """Records appended since the last call (every record on the first call); lines that do not parse
        are skipped here (reading the whole file reports them)."""
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:  # moved away meanwhile: the next append makes it again
            return []
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < self._end:  # a torn tail was cut off since: read again from the start
                self._end = 0
            f.seek(self._end)
            data = f.read(size - self._end)
        data = data[:data.rfind(b"\n") + 1]
        self._end += len(data)
        out = []
        for line in data.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("key"), str):
                out.append(rec)
        return out

    def close(self) -> None:
        """Drop every claim; remove the file if this run created it and nothing was written to it."""
        self._file.close()
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if self._created is not None and st.st_size == 0 and (st.st_ino, st.st_dev) == (
                self._created.st_ino, self._created.st_dev):
            os.unlink(self.path)
            for folder in self._made_folders:
                try:
                    os.rmdir(folder)
                except OSError:  # something else was put there meanwhile
                    break
