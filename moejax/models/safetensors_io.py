"""Minimal memory-mapped safetensors reader and writer (any dtype, bfloat16 included, no torch).

Reading memory-maps the file, so a tensor costs nothing until it is touched: the loader can check every
key and shape before reading a byte, and the offload path can later use the same mapping as a slow
"flash" tier. Nothing here ever unpickles.
"""

from __future__ import annotations

import json
import mmap
import os
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


class SafetensorsError(Failure):
    """A safetensors file is malformed."""


class SafetensorsFile:
    """Lazy view of one ``.safetensors`` file: ``keys()``, ``shape(k)``, ``dtype(k)``, ``get(k)``."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:  # checked before reading: a damaged length must not allocate 2**64 bytes
                raise SafetensorsError(f"{path}: header length {n} exceeds the file size ({size} bytes); "
                                       "not a safetensors file, or truncated")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:  # bad JSON or UTF-8, an integer of over 4300 digits
                raise SafetensorsError(f"{path}: unreadable safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: the safetensors header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        self.metadata = metadata if isinstance(metadata, dict) else {}
        self._offset = 8 + n
        data_size = size - self._offset
        for key, info in header.items():
            _check_entry(path, key, info, data_size)
        self._header = header
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
        0.07 GB/s with readahead off (bench/RESULTS.md). ``out``: a C-contiguous array of the view's shape and
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


def _check_entry(path: str, key: str, info, data_size: int) -> None:
    """One header entry: known dtype, a shape of non-negative ints, offsets inside the file that match it."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise SafetensorsError(f"{path}: tensor {key!r} has a malformed header entry")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise SafetensorsError(f"{path}: tensor {key!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise SafetensorsError(f"{path}: tensor {key!r} has invalid data_offsets {offsets!r}")
    if offsets[1] > data_size:
        raise SafetensorsError(f"{path}: tensor {key!r} ends at byte {offsets[1]} of the data, past the file's "
                               f"{data_size} (a truncated or damaged file)")
    if info["dtype"] in _DTYPES:
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
        if offsets[1] - offsets[0] != need:
            raise SafetensorsError(f"{path}: tensor {key!r} has {offsets[1] - offsets[0]} bytes, its shape "
                                   f"{tuple(shape)} needs {need}")


def write(path: str, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str] | None = None):
    """Write ``(key, array)`` pairs as one safetensors file (keys in the given order), atomically."""
    tensors = [(k, np.ascontiguousarray(v)) for k, v in tensors]
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for k, v in tensors:
        if v.dtype not in _NAMES:
            raise SafetensorsError(f"cannot write tensor {k!r} of dtype {v.dtype}")
        header[k] = {"dtype": _NAMES[v.dtype], "shape": list(v.shape), "data_offsets": [offset, offset + v.nbytes]}
        offset += v.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
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
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for key, dtype, shape in specs:
        dtype = np.dtype(dtype)
        if dtype not in _NAMES:
            raise SafetensorsError(f"cannot write tensor {key!r} of dtype {dtype}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[key] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
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
    return 8 + len(blob) + offset
