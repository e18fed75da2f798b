"""Writing one file atomically: readers see the old file or the whole new one, never a part of it.

The bytes go to a temporary file beside the target, ``.<name>.tmp-<pid>-<random>``, which is renamed over the
target only when writing succeeded, after an ``fsync`` (and the folder's after the rename: a power cut leaves the
old file or the new one, not an empty one under the new name). An exception, Ctrl-C or a signal that
``interrupts`` turns into one removes the temporary file and leaves the old target as it was; after a SIGKILL, the
next write of the same target removes the dead process's temporary file (``tempfiles.remove_stale``), so a
killed run never leaves a multi-GB half-written copy behind for good. Every file moejax writes whole (JSON
records, safetensors shards, traces, plots, tokenizers, token files) goes through ``atomic_file``; every folder
written whole (checkpoints, learned priors) through ``atomic_dir`` (``checkpoint.atomic_folder`` adds what may be
replaced). Whether a command may replace a file the user named is ``check_output``'s decision, taken before the work.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import tempfile
from typing import IO, Any, Iterator

import numpy as np

from moejax.base import errors, interrupts, tempfiles


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", make_parents: bool = False) -> Iterator[IO]:
    """An open file (``"wb"`` or ``"w"``, UTF-8) that becomes ``path`` only when the block succeeds.

    A missing parent folder is an error (``FileNotFoundError``, like ``open``) unless ``make_parents``; the
    new file gets the permissions ``open`` would give it."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file writes a whole file: mode 'wb' or 'w', not {mode!r}")
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    made = _make_parents(parent) if make_parents else []
    prefix = f".{name}.tmp-"
    tmp = None
    try:
        tempfiles.remove_stale(prefix, parent)
        with interrupts.deferred():  # a signal between creating the file and owning it would leave it behind
            fd, tmp = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
        with os.fdopen(fd, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on the disk before the name points at them
        os.chmod(tmp, 0o666 & ~_umask())
        group = _GROUP.get()
        if group is None:
            os.replace(tmp, path)
            fsync_folder(parent)
        else:  # ``together``: renamed with the rest of the set, or removed with it
            group.append((tmp, path, made))
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        remove_empty_folders(made)
        raise naming(e, path) from (e if isinstance(e, OSError) else None)


#: the files written inside the innermost ``together`` block: (temporary file, target, folders made for it)
_GROUP: contextvars.ContextVar[list | None] = contextvars.ContextVar("moejax_atomic_group", default=None)


@contextlib.contextmanager
def together() -> Iterator[None]:
    """Every ``atomic_file`` written in this block (this thread) replaces its target only when the whole block
    succeeds, all of them at its end; if it fails, none does and their temporary files go. A set of files that
    belong together (a report and its figures) then changes as one: a disk that fills after some of them
    leaves the old set, not new figures beside an old report. A block inside another joins the outer one."""
    if _GROUP.get() is not None:
        yield
        return
    pending: list = []
    token = _GROUP.set(pending)
    try:
        yield
    except BaseException:
        _discard(pending)
        raise
    finally:
        _GROUP.reset(token)
    with interrupts.deferred():  # the renames run whole: no signal leaves half the set replaced
        for i, (tmp, path, _) in enumerate(pending):
            try:
                os.replace(tmp, path)
            except BaseException as e:
                _discard(pending[i:])
                raise naming(e, path) from (e if isinstance(e, OSError) else None)
    for folder in dict.fromkeys(os.path.dirname(path) for _, path, _ in pending):
        fsync_folder(folder)


def _discard(pending: list) -> None:
    """Remove the temporary files of a ``together`` set, then the folders made for them (latest first)."""
    for tmp, _, _ in pending:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    for _, _, made in reversed(pending):
        remove_empty_folders(made)


def naming(err: BaseException, path: str, temp: str | None = None) -> BaseException:
    """``err``, or where it is an ``OSError`` that names no file or a temporary one (a full disk fails a ``write``,
    which names nothing), the same error naming ``path``, the file the user asked for. A file inside the folder
    ``temp`` that ``atomic_dir`` fills is named where it will be: ``path`` plus the rest of its name."""
    if not isinstance(err, OSError) or err.errno is None:
        return err
    filename = os.fspath(err.filename) if err.filename else ""
    if filename and not any(_is_temp_name(part) for part in filename.split(os.sep)):
        return err
    named = os.fspath(path)
    if temp and filename.startswith(os.fspath(temp) + os.sep):
        named = os.path.join(named, os.path.relpath(filename, temp))
    return type(err)(err.errno, err.strerror or os.strerror(err.errno), named)


def _is_temp_name(name: str) -> bool:
    """Whether ``name`` is one of the temporary files or folders ``atomic_file`` and ``atomic_dir`` make."""
    return name.startswith(".") and (".tmp-" in name or ".old-" in name)


def check_creatable(path: str, flag: str) -> None:
    """Refuse, before any work, an output ``path`` that could not be made: its nearest existing folder must take a
    new entry (tried for real, so a read-only mount or an immutable folder is found: root passes ``os.access``).
    Raises ``OSError`` naming ``flag`` and ``path``. A full disk can still fail the write later."""
    parent = existing_ancestor(os.path.dirname(os.path.abspath(os.path.expanduser(path))))
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".moejax-probe-", dir=parent))
    except OSError as e:
        raise type(e)(e.errno, f"{flag} {path}: cannot be written in {parent} ({e.strerror})") from None


def check_output(path: str | os.PathLike, overwrite: bool, flag: str | None = None) -> None:
    """Refuse, before any work, an output file that would replace something: an existing file only with
    ``overwrite`` (``--overwrite``), never a folder, a device or a pipe (an atomic rename would swap the
    file in for ``/dev/null`` itself). ``flag`` names the option in the one-line error."""
    path = os.fspath(path)
    named = f"{flag} {path}" if flag else path
    if os.path.isdir(path):
        raise IsADirectoryError(f"{named} is a folder: give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise errors.UsageError(f"{named} exists and is not a regular file: refusing to replace it")
    if os.path.lexists(path) and not overwrite:
        raise errors.UsageError(f"{named} exists: refusing to replace it (pass --overwrite to replace it)")


def missing_folders(path: str) -> list[str]:
    """``path`` and the folders above it that do not exist yet, innermost first: what a run that makes them and
    then fails must remove again (``remove_empty_folders``)."""
    made, p = [], os.path.abspath(os.path.expanduser(os.fspath(path)))
    while p and not os.path.lexists(p) and os.path.dirname(p) != p:
        made.append(p)
        p = os.path.dirname(p)
    return made


def existing_ancestor(path: str) -> str:
    """``path`` if it exists, else the nearest folder above it that does (where a new ``path`` would be made:
    the disk its free space and permissions come from)."""
    made = missing_folders(path)
    return os.path.dirname(made[-1]) if made else os.path.abspath(os.path.expanduser(os.fspath(path)))


def remove_empty_folders(folders: list[str]) -> None:
    """Remove ``folders`` (innermost first) where they are empty: a folder that holds anything now stays."""
    for d in folders:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def _make_parents(folder: str) -> list[str]:
    """``os.makedirs(folder)``; the folders it made, innermost first, so that a write that fails removes them
    again (a failed conversion to ``new/a/b/out`` left ``new/a/b`` behind)."""
    made = missing_folders(folder)
    os.makedirs(folder, exist_ok=True)
    return made


def _umask() -> int:
    """The process's umask (read by setting it and setting it back: Python has no getter before 3.13)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_dir(target: str) -> Iterator[str]:
    """A new folder ``.<name>.tmp-<pid>-<random>`` beside ``target`` to fill; renamed to ``target`` (replacing
    what is there) only when the block succeeds, removed on any error. The old ``target`` is moved aside into
    ``.<name>.old-*`` first and removed after the swap: killed between the two renames, that folder holds the
    user's old data, so it is never removed automatically. Whether ``target`` may be replaced is the caller's
    decision. Folders of killed writers are removed by the next ``atomic_dir`` of the same target."""
    target = os.path.abspath(target)
    parent, name = os.path.split(target)
    made = _make_parents(parent)
    tmp = None
    try:
        with interrupts.deferred():  # a signal between making the folder and owning it would leave it behind
            tmp = tempfiles.make_temp_dir(f".{name}.tmp-", parent)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700: the finished folder gets a normal folder's mode
        yield tmp
        fsync_tree(tmp)  # the files are on the disk before the folder's name points at them
        with interrupts.deferred():  # the swap runs whole: no signal strands the old target half-moved
            if os.path.exists(target):
                old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
                try:
                    os.replace(target, os.path.join(old, "x"))
                except BaseException:  # the target stayed where it was: the empty aside folder goes
                    os.rmdir(old)
                    raise
                os.replace(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
        fsync_folder(parent)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_empty_folders(made)
        raise naming(e, target, tmp) from (e if isinstance(e, OSError) else None)


def fsync_folder(folder: str) -> None:
    """Flush ``folder``'s entries (a rename into it) to the disk: without it a power cut right after a rename
    can bring back the old name, or on some filesystems an empty file. Filesystems that cannot (some network
    mounts) are skipped."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flush every file and folder under ``folder`` to the disk (a folder filled by writers that do not
    ``fsync``, such as safetensors, before ``atomic_dir`` renames it into place)."""
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_folder(root)


def append_whole(f: IO, data: bytes, path: str, fsync: bool = True) -> None:
    """Append ``data`` at the end of the open file ``f`` (``path``) whole or not at all: written unbuffered (nothing
    is left in a buffer to land after a failure is undone) and, if the write fails (a full disk), the file is cut
    back to its old end and the error names ``path``."""
    f.flush()
    end = f.seek(0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(f.fileno(), view):]
        if fsync:
            os.fsync(f.fileno())
    except OSError as e:
        with contextlib.suppress(OSError):
            f.truncate(end)
        raise naming(e, path) from e


def json_text(obj: Any, indent: int | None = 2, sort_keys: bool = True) -> str:
    """The text ``write_json`` writes: ``obj`` as JSON with a trailing newline."""
    return json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n"


def write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2, sort_keys: bool = True,
               make_parents: bool = False) -> None:
    """``obj`` as JSON (``json_text``); an object JSON cannot hold fails before the target is touched."""
    text = json_text(obj, indent, sort_keys)
    with atomic_file(path, "w", make_parents) as f:
        f.write(text)


def write_text(path: str | os.PathLike, text: str, make_parents: bool = False) -> None:
    with atomic_file(path, "w", make_parents) as f:
        f.write(text)


def save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """``np.savez`` (uncompressed) to exactly ``path``: no ``.npz`` is appended to the name."""
    with atomic_file(path) as f:
        np.savez(f, **arrays)
