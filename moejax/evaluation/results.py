"""The JSONL results file of sweeps and studies: one record per line, appended atomically, read back with a
torn last line tolerated (never an unrelated file truncated). The record schema is ``moejax.evaluation.sweep``'s.

Appends are flushed and fsync'ed under an exclusive lock; in a multi-process run process 0 alone reads (and
broadcasts what it read) and writes (``moejax.base.distributed``).
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from moejax.base import distributed, errors


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
            import fcntl

            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except (ImportError, OSError):  # no flock here: appends are still whole lines
            pass
        _repair(f, path)
        f.seek(0, os.SEEK_END)
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
