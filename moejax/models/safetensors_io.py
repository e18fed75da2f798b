"""Minimal memory-mapped safetensors reader and writer (any dtype, bfloat16 included, no torch).

Reading memory-maps the file, so a tensor costs nothing until it is touched: the loader can check every
key and shape before reading a byte, and the offload path can later use the same mapping as a slow
"flash" tier. Nothing here ever unpickles.

The header is checked as the ``safetensors`` library checks it (the Rust crate's ``SafeTensors::read_metadata``,
its ``HashMetadata`` deserialisation and ``Metadata::validate``), so a file loads here exactly when
``safetensors.safe_open`` would open it: a header of at most 100,000,000 bytes, UTF-8 JSON as ``serde_json``
reads it, an object whose ``__metadata__`` maps strings to strings, every tensor a known dtype, a shape and
``data_offsets`` of 64-bit unsigned integers, and the tensors' byte ranges, sorted, tiling the data from its
first byte to the file's last with no gap and no overlap, each exactly its shape's size. The writers check
the header they make the same way.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import stat
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

from moejax.base import atomic
from moejax.base.errors import Failure

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
#: every dtype the safetensors crate knows (``Dtype``), with its size in bits: a file may hold any of them
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
MAX_HEADER = 100_000_000  # the crate's MAX_HEADER_SIZE: a longer header is refused
_USIZE_MAX = 2**64 - 1  # shapes and offsets are Rust usize (64-bit)
_JSON_DEPTH = 127  # serde_json's recursion limit: arrays and objects nested deeper are refused
_FIELDS = ("dtype", "shape", "data_offsets")


class SafetensorsError(Failure):
    """A safetensors file is malformed."""


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: ``keys()``, ``shape(k)``, ``dtype(k)``, ``get(k)``."""

    def __init__(self, path: str):
        self.path = path
        size = _regular_size(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:  # checked before reading: a damaged length must not allocate 2**64 bytes
                raise SafetensorsError(f"{path}: header length {n} exceeds the file size ({size} bytes); "
                                       "not a safetensors file, or truncated")
            if n > MAX_HEADER:
                raise SafetensorsError(f"{path}: header length {n} exceeds the safetensors limit of "
                                       f"{MAX_HEADER:,} bytes")
            raw = f.read(n)
        self._offset = 8 + n
        self.metadata, self._header = parse_header(raw, size - self._offset, path)
        self._map = None  # the file's read-only memory map (MAP_SHARED): pages come from the page cache
        self._mmap = None
        if size > self._offset:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._mmap = np.frombuffer(self._map, np.uint8)

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._header[key]["shape"])

    def dtype(self, key: str) -> np.dtype:
        name = self._header[key]["dtype"]
        if name not in _DTYPES:
            raise SafetensorsError(f"{self.path}: tensor {key!r} has unsupported dtype {name}")
        return np.dtype(_DTYPES[name])

    def get(self, key: str) -> np.ndarray:
        """The tensor as a read-only numpy view into the mapped file."""
        info = self._header[key]
        start, end = info["data_offsets"]
        dtype, shape = self.dtype(key), tuple(info["shape"])
        if end - start != int(np.prod(shape)) * dtype.itemsize:
            raise SafetensorsError(f"{self.path}: tensor {key!r} byte range does not match shape {shape}")
        if end == start:
            return np.zeros(shape, dtype)
        raw = self._mmap[self._offset + start : self._offset + end]
        return raw.view(dtype).reshape(shape)

    def byte_range(self, key: str) -> tuple[int, int]:
        """Where tensor ``key``'s bytes lie in the file (absolute offsets)."""
        start, end = self._header[key]["data_offsets"]
        return self._offset + start, self._offset + end

    def key_of(self, view: np.ndarray) -> str | None:
        """The tensor whose bytes hold the first element of ``view`` (a view from ``get``), for errors about it."""
        start, _ = self._range(view, align=False)
        for key, info in self._header.items():
            begin, end = info["data_offsets"]
            if self._offset + begin <= start < self._offset + end:
                return key
        return None

    def _range(self, view: np.ndarray, align: bool = True) -> tuple[int, int]:
        """The file byte range of ``view`` (from its first element to its last: a strided view, GPT-OSS's gate or
        up columns, spans the other's bytes too): rounded out to whole pages (``align``), else exact."""
        start = view.__array_interface__["data"][0] - self._mmap.__array_interface__["data"][0]
        span = _span(view)
        if not 0 <= start <= len(self._map) - span:
            raise ValueError(f"{self.path}: an array that is not a view of this file")
        if not align:
            return start, start + span
        page = mmap.PAGESIZE
        return start // page * page, min(-(-(start + span) // page) * page, len(self._map))

    def read(self, view: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A private copy of ``view`` (a contiguous view from ``get``), read with ``os.preadv``: a few large
        reads of exactly its bytes, from the page cache or storage, with no page of the mapping touched. For
        pages read once and copied on (offloaded experts) this is several times faster than faulting the
        mapping in: measured 3.0 GB/s cold against 1.2 GB/s for the mapping with ``MADV_WILLNEED`` up front and
        0.07 GB/s with readahead off (docs/benchmarks.md#reading-pages-from-storage). ``out``: a C-contiguous array of the view's shape and
        dtype to read into (e.g. one half of a larger buffer) instead of a new one. A strided view (GPT-OSS's
        interleaved gate and up columns) reads the bytes it spans and keeps its own elements."""
        if view.size and not view.flags.c_contiguous:
            start, end = self._range(view, align=False)
            spanned = self.read(self._mmap[start:end]).view(view.dtype)
            picked = np.lib.stride_tricks.as_strided(spanned, view.shape, view.strides, writeable=False)
            if out is None:
                return np.array(picked)
            if out.shape != view.shape or out.dtype != view.dtype:
                raise ValueError(f"read into {out.dtype}{list(out.shape)}: the tensor is {view.dtype}{list(view.shape)}")
            np.copyto(out, picked)
            return out
        if out is None:
            out = np.empty(view.shape, view.dtype)
        elif out.shape != view.shape or out.dtype != view.dtype or not out.flags.c_contiguous:
            raise ValueError(f"read into {out.dtype}{list(out.shape)} (contiguous: {out.flags.c_contiguous}): "
                             f"the tensor is {view.dtype}{list(view.shape)}")
        if view.nbytes == 0:
            return out
        start, _ = self._range(view, align=False)
        buf = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):  # no readahead past the range: the next bytes are another expert
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            done = 0
            while done < len(buf):  # preadv may return fewer bytes than asked
                n = os.preadv(fd, [buf[done:]], start + done)
                if n <= 0:
                    raise SafetensorsError(f"{self.path}: the file ended while reading {view.nbytes} bytes at "
                                           f"{start} (truncated since it was opened?)")
                done += n
        finally:
            os.close(fd)
        return out

    def release(self, view: np.ndarray) -> None:
        """Drop the mapped pages under ``view`` (a contiguous view from ``get``) from this process's memory.

        The data stays in the page cache (reclaimable) and is read again on the next touch, so paging an
        expert out of a mapped checkpoint does not grow the resident set by the bytes it touched."""
        if self._map is None or view.size == 0:
            return
        lo, hi = self._range(view)
        self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _span(view: np.ndarray) -> int:
    """Bytes from ``view``'s first element to the end of its last (its nbytes when contiguous; strides >= 0)."""
    if view.size == 0:
        return 0
    return sum((n - 1) * s for n, s in zip(view.shape, view.strides)) + view.itemsize


def _regular_size(path: str) -> int:
    """The size of ``path`` after checking it is a regular file (stat, never open: a FIFO would block the read,
    a device such as /dev/zero reads forever, a directory cannot be mapped)."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise SafetensorsError(f"{path} is not a regular file ({file_kind(path, st.st_mode)}): not a safetensors "
                               "file")
    return st.st_size


def file_kind(path: str, mode: int) -> str:
    """What the non-regular file ``path`` (``mode``: its stat's) is, in words, and where its link leads."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    kind = next((word for test, word in kinds if test(mode)), "not a plain file")
    return f"{kind}, a link to {os.path.realpath(path)}" if os.path.islink(path) else kind


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # the only way to a lone surrogate in UTF-8 text


class _Pairs(list):
    """A JSON object as its (key, value) pairs in order, duplicates kept: the crate refuses some duplicates."""


class _Refused(ValueError):
    """JSON that Python reads but ``serde_json`` refuses."""


def _json_int(text: str):
    """An integer as ``serde_json`` reads it: "-0" is a float, and one that overflows a double is refused."""
    if len(text) < 19:  # every such integer is a finite double
        return int(text) if text != "-0" else -0.0
    if len(text.lstrip("-")) > 310:  # more digits than any finite double (and past Python's 4300-digit limit)
        raise _Refused(f"number out of range ({text[:20]}...)")
    value = int(text)
    try:
        float(value)
    except OverflowError:
        raise _Refused(f"number out of range ({text[:20]}...)") from None
    return value


def _json_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise _Refused(f"number out of range ({text})")
    return value


def _json_constant(text: str):
    raise _Refused(f"{text} is not JSON")


def _check_tree(value, depth: int = 0) -> None:
    """What ``serde_json`` refuses beyond Python's ``json`` in ``value`` (inside ``depth`` arrays or objects):
    nesting deeper than 127, lone surrogates (\\ud800)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _Refused(f"a string holds a lone UTF-16 surrogate escape: {value[:40]!r}") from None
    elif isinstance(value, list):
        if depth >= _JSON_DEPTH:
            raise _Refused(f"arrays or objects nested more than {_JSON_DEPTH} deep")
        for item in value:
            for part in (item if isinstance(value, _Pairs) else (item,)):
                _check_tree(part, depth + 1)


def _read_json(raw: bytes):
    """The header's JSON as ``serde_json`` reads it (objects as ``_Pairs``), or ValueError."""
    text = raw.decode("utf-8")  # strict: the crate's from_utf8 refuses what this refuses
    try:
        value = json.loads(text, object_pairs_hook=_Pairs, parse_int=_json_int, parse_float=_json_float,
                           parse_constant=_json_constant)
    except RecursionError:
        raise _Refused(f"arrays or objects nested more than {_JSON_DEPTH} deep") from None
    if _SURROGATE_ESCAPE.search(text):  # rare: then every string is looked at (else only unknown fields, for depth)
        _check_tree(value)
    return value


def _is_usize(x) -> bool:
    return type(x) is int and 0 <= x <= _USIZE_MAX  # not bool, not a float such as 4.0 or -0.0


def _dtype_name(value) -> str | None:
    """A dtype as serde reads the enum: its name, or an object {name: null}."""
    if isinstance(value, _Pairs):
        if len(value) != 1 or value[0][1] is not None:
            return None
        value = value[0][0]
    return value if isinstance(value, str) and value in DTYPE_BITS else None


def _tensor_info(where: str, key: str, value) -> dict:
    """One tensor's entry (an object with dtype, shape, data_offsets; or serde's array form of the struct)."""
    if isinstance(value, _Pairs):
        fields: dict = {}
        for name, item in value:
            if name in _FIELDS:
                if name in fields:
                    raise SafetensorsError(f"{where}: tensor {key!r} has two {name!r} fields")
                fields[name] = item
            else:  # ignored, as serde ignores unknown fields, but parsed by its rules
                _check_tree(item, 2)
        if len(fields) != len(_FIELDS):
            missing = [name for name in _FIELDS if name not in fields]
            raise SafetensorsError(f"{where}: tensor {key!r} has a malformed header entry (no {missing[0]!r})")
        dtype, shape, offsets = (fields[name] for name in _FIELDS)
    elif type(value) is list and len(value) == len(_FIELDS):
        dtype, shape, offsets = value
    else:
        raise SafetensorsError(f"{where}: tensor {key!r} has a malformed header entry")
    name = _dtype_name(dtype)
    if name is None:
        raise SafetensorsError(f"{where}: tensor {key!r} has unknown dtype {_short(dtype)}")
    if type(shape) is not list or not all(map(_is_usize, shape)):
        raise SafetensorsError(f"{where}: tensor {key!r} has an invalid shape {_short(shape)}")
    if type(offsets) is not list or len(offsets) != 2 or not all(map(_is_usize, offsets)):
        raise SafetensorsError(f"{where}: tensor {key!r} has invalid data_offsets {_short(offsets)}")
    return {"dtype": name, "shape": list(shape), "data_offsets": list(offsets)}


def _short(value) -> str:
    """A header value for an error message, as JSON, cut at 60 characters."""
    text = json.dumps(_plain(value), ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(value):
    if isinstance(value, _Pairs):
        return {k: _plain(v) for k, v in value}
    return [_plain(v) for v in value] if isinstance(value, list) else value


def _metadata(where: str, value) -> dict[str, str]:
    """``__metadata__``: null or an object of strings (later duplicates win, as in the crate)."""
    if value is None:
        return {}
    if not isinstance(value, _Pairs) or not all(isinstance(v, str) for _, v in value):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings, got {_short(value)}")
    return dict(value)


def _entries(where: str, pairs: _Pairs) -> tuple[dict[str, str], dict[str, dict]]:
    """The header object's metadata and tensors; a tensor named twice is its last entry, as in the crate."""
    metadata, tensors, seen = {}, {}, False
    for key, value in pairs:
        if key == "__metadata__":
            if seen:
                raise SafetensorsError(f"{where}: the header has two __metadata__ entries")
            metadata, seen = _metadata(where, value), True
        else:
            tensors[key] = _tensor_info(where, key, value)
    return metadata, tensors


def tensor_nbytes(shape, dtype: str) -> int | None:
    """Bytes of a ``dtype`` tensor of ``shape`` as the crate computes them (element count then bits, left to
    right in 64 bits): None when that overflows or ends inside a byte (4- and 6-bit dtypes)."""
    count = 1
    for d in shape:
        count *= d
        if count > _USIZE_MAX:
            return None
    bits = count * DTYPE_BITS[dtype]
    return bits // 8 if bits <= _USIZE_MAX and bits % 8 == 0 else None


def _check_sizes(where: str, tensors: dict[str, dict], data_size: int) -> None:
    """Each tensor's byte range: ordered, inside the data, exactly its shape's size."""
    for key, info in tensors.items():
        (begin, end), shape = info["data_offsets"], info["shape"]
        if begin > end:
            raise SafetensorsError(f"{where}: tensor {key!r} has invalid data_offsets {[begin, end]} (begins after "
                                   "it ends)")
        if end > data_size:
            raise SafetensorsError(f"{where}: tensor {key!r} ends at byte {end} of the data, past the file's "
                                   f"{data_size} (a truncated or damaged file)")
        need = tensor_nbytes(shape, info["dtype"])
        if need is None:
            raise SafetensorsError(f"{where}: tensor {key!r} of shape {tuple(shape)} and dtype {info['dtype']} has "
                                   "no whole number of bytes below 2**64")
        if end - begin != need:
            raise SafetensorsError(f"{where}: tensor {key!r} has {end - begin} bytes, its shape {tuple(shape)} "
                                   f"needs {need}")


def _check_tiling(where: str, tensors: dict[str, dict], data_size: int) -> None:
    """The byte ranges sorted by offset cover the data from 0 to its end, no gap and no overlap (the crate's
    ``Metadata::validate`` and its check that the last one ends where the file does)."""
    at, previous = 0, None
    for begin, end, key in sorted((*info["data_offsets"], key) for key, info in tensors.items()):
        if begin < at:
            raise SafetensorsError(f"{where}: tensor {key!r} (bytes {begin}..{end}) overlaps tensor {previous!r} "
                                   f"(which ends at {at}): two tensors share bytes")
        if begin > at:
            raise SafetensorsError(f"{where}: {begin - at} bytes at {at} of the data belong to no tensor (before "
                                   f"tensor {key!r})")
        at, previous = end, key
    if at != data_size:
        raise SafetensorsError(f"{where}: {data_size - at} bytes after the last tensor belong to no tensor (the "
                               "header does not cover the file)")


def parse_header(raw: bytes, data_size: int, where: str) -> tuple[dict[str, str], dict[str, dict]]:
    """The metadata and tensor entries (``{"dtype", "shape", "data_offsets"}``) of a safetensors header ``raw``
    (the bytes after the length) followed by ``data_size`` bytes of data, checked as the safetensors library
    checks them; ``SafetensorsError`` naming ``where`` otherwise."""
    if len(raw) > MAX_HEADER:
        raise SafetensorsError(f"{where}: header length {len(raw)} exceeds the safetensors limit of "
                               f"{MAX_HEADER:,} bytes")
    try:
        header = _read_json(raw)
        if not isinstance(header, _Pairs):
            raise SafetensorsError(f"{where}: the safetensors header is not a JSON object")
        metadata, tensors = _entries(where, header)
    except SafetensorsError:
        raise
    except ValueError as e:  # not UTF-8, not JSON, or JSON serde_json refuses (also in an unknown field)
        raise SafetensorsError(f"{where}: unreadable safetensors header ({_first_line(e)})") from None
    _check_sizes(where, tensors, data_size)
    _check_tiling(where, tensors, data_size)
    return metadata, tensors


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return (text.splitlines() or [type(error).__name__])[0][:200]


def _header_blob(specs: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict[str, str] | None,
                 where: str) -> tuple[bytes, dict]:
    """The header of a file holding ``specs`` (key, dtype, shape) in order, padded to 8 bytes, and its entries;
    checked as a reader checks it, so nothing is written that the safetensors library would refuse."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for key, dtype, shape in specs:
        if key in header:
            raise SafetensorsError(f"{where}: cannot write tensor {key!r} twice (or as __metadata__)")
        if dtype not in _NAMES:
            raise SafetensorsError(f"cannot write tensor {key!r} of dtype {dtype}")
        shape = [int(d) for d in shape]  # numpy integers too
        nbytes = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    try:
        blob = json.dumps(header, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:  # a key or a metadata value JSON cannot hold
        raise SafetensorsError(f"{where}: cannot write this header ({e})") from None
    blob += b" " * (-len(blob) % 8)
    parse_header(blob, offset, where)
    return blob, header


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None):
    """Write ``(key, array)`` pairs as one safetensors file (keys in the given order), atomically."""
    tensors = [(k, np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in tensors]  # a 0-d array stays 0-d
    blob, _ = _header_blob([(k, v.dtype, v.shape) for k, v in tensors], metadata, path)
    with atomic.atomic_file(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, v in tensors:
            f.write(v.tobytes())


def write_stream(path: str, specs: list[tuple[str, np.dtype, tuple[int, ...]]], chunks,
                 metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file tensor by tensor without holding any of them whole: ``specs`` gives each
    tensor's key, dtype and shape (the header comes first), ``chunks(key)`` yields its data as arrays in
    order. Written atomically like ``write``; returns the file's size."""
    specs = [(key, np.dtype(dtype), tuple(shape)) for key, dtype, shape in specs]
    blob, header = _header_blob(specs, metadata, path)
    with atomic.atomic_file(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dtype, _ in specs:
            want = header[key]["data_offsets"][1] - header[key]["data_offsets"][0]
            done = 0
            for part in chunks(key):
                part = np.ascontiguousarray(part, dtype=dtype)
                if part.dtype.kind == "f" or part.dtype.name == "bfloat16":
                    # a value beyond a narrow dtype's range becomes inf: garbage weights written as success
                    if not np.isfinite(part.astype(np.float32, copy=False)).all():
                        raise SafetensorsError(f"tensor {key!r} holds inf or NaN as {dtype}: a value beyond its "
                                               "range? (convert: keep a wider --dtype)")
                f.write(part.tobytes())
                done += part.nbytes
            if done != want:
                raise SafetensorsError(f"tensor {key!r}: got {done} bytes, its shape needs {want}")
    return 8 + len(blob) + sum(d.itemsize * math.prod(shape) for _, d, shape in specs)
