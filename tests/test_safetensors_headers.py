"""moejax's safetensors reader refuses exactly the files the ``safetensors`` library refuses.

Every damage below is written as a file and opened twice: with ``safetensors.safe_open`` (the Rust crate's
``SafeTensors::read_metadata``) and with ``safetensors_io.SafetensorsFile``. The library refuses it exactly when
moejax raises ``SafetensorsError`` (a ``Failure``, one line naming the file); the files both accept have the
same tensors, shapes and metadata. moejax's writers only make files the library opens, and a damaged header
stops ``generate`` (also offloading from the files) and ``convert`` with one error line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import load_file, save_file

from moejax.base.errors import Failure
from moejax.models import safetensors_io

# ------------------------------------------------------------------------------------------ files
A = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
B = {"dtype": "I8", "shape": [3], "data_offsets": [16, 19]}
C = {"dtype": "BF16", "shape": [2], "data_offsets": [19, 23]}
DATA = bytes(range(23))


def _file(header: bytes, data: bytes = DATA, n: int | None = None) -> bytes:
    """A safetensors file: the header's length (``n``, else its real one), the header, the data."""
    return struct.pack("<Q", len(header) if n is None else n) + header + data


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _tensors(data: bytes = DATA, **entries) -> bytes:
    """The three tensors a, b, c with ``entries`` replacing or adding some (None drops one)."""
    header = {"a": A, "b": B, "c": C, **entries}
    return _file(_json({k: v for k, v in header.items() if v is not None}), data)


def _one(entry_text: str, data: bytes = b"\0" * 4) -> bytes:
    """One tensor "t" whose header entry is ``entry_text`` verbatim (a float32 [1] at [0, 4] by default)."""
    return _file(b'{"t":' + entry_text.encode() + b"}", data)


T = '{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'


def _nested(depth: int) -> bytes:
    """Tensor "t" with an unknown field holding ``depth`` nested arrays (plus the two objects around it)."""
    return _one(T[:-1] + ',"x":' + "[" * depth + "]" * depth + "}")


def _padded_header(size: int) -> bytes:
    """A file whose header is ``{}`` and spaces, ``size`` bytes long (the crate's limit is 100,000,000)."""
    return _file(b"{}" + b" " * (size - 2), b"")


# (id, the library opens it, the file's bytes)
VALID = [
    ("three-tensors", lambda: _tensors()),
    ("entries-out-of-offset-order-but-contiguous", lambda: _file(_json({"c": C, "a": A, "b": B}))),
    ("no-tensors", lambda: _file(b"{}", b"")),
    ("metadata-only", lambda: _file(_json({"__metadata__": {"format": "pt"}}), b"")),
    ("metadata-null", lambda: _file(_json({"__metadata__": None, "a": A, "b": B, "c": C}))),
    ("metadata-key-named-twice-last-wins", lambda: _file(b'{"__metadata__":{"k":"1","k":"2"},' + _json(
        {"a": A, "b": B, "c": C})[1:])),
    ("header-led-by-whitespace", lambda: _file(b" \n\t" + _json({"a": A, "b": B, "c": C}))),
    ("header-padded-with-spaces", lambda: _file(_json({"a": A, "b": B, "c": C}) + b"    ")),
    ("zero-size-tensors-sharing-offsets", lambda: _tensors(z={"dtype": "F32", "shape": [0, 5], "data_offsets": [16, 16]},
                                                           y={"dtype": "U8", "shape": [0], "data_offsets": [23, 23]})),
    ("scalar", lambda: _one('{"dtype":"F32","shape":[],"data_offsets":[0,4]}')),
    ("unknown-fields-ignored", lambda: _one(T[:-1] + ',"x":{"a":1,"a":[-0,1e-400,-123456789012345678901234567890]}}')),
    ("entry-as-an-array", lambda: _one('["F32",[1],[0,4]]')),
    ("dtype-as-an-enum-object", lambda: _one('{"dtype":{"F32":null},"shape":[1],"data_offsets":[0,4]}')),
    ("escaped-field-names-and-dtype", lambda: _one('{"dtyp\\u0065":"F\\u0033\\u0032","shape":[1],"data_offsets":[0,4]}')),
    ("tensor-named-twice-last-wins", lambda: _file(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":'
                                                   + T.encode() + b"}", b"\0" * 4)),
    ("unicode-names", lambda: _file('{"é⚙":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'.encode(), b"\0" * 4)),
    ("dtypes-moejax-does-not-compute-with", lambda: _file(_json({
        "u16": {"dtype": "U16", "shape": [1], "data_offsets": [0, 2]},
        "u32": {"dtype": "U32", "shape": [1], "data_offsets": [2, 6]},
        "u64": {"dtype": "U64", "shape": [1], "data_offsets": [6, 14]},
        "c64": {"dtype": "C64", "shape": [1], "data_offsets": [14, 22]},
        "e8m0": {"dtype": "F8_E8M0", "shape": [1], "data_offsets": [22, 23]},
        "f4": {"dtype": "F4", "shape": [2, 2], "data_offsets": [23, 25]},
        "f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [25, 28]},
        "fnuz": {"dtype": "F8_E4M3FNUZ", "shape": [2], "data_offsets": [28, 30]}}), bytes(30))),
    ("zero-dimension-before-huge-ones", lambda: _one('{"dtype":"F32","shape":[0,4294967296,4294967296],'
                                                     '"data_offsets":[0,0]}', b"")),
    ("nesting-127-deep", lambda: _nested(125)),
    ("header-at-the-size-limit", lambda: _padded_header(100_000_000)),
]
INVALID = [
    # the byte ranges: sorted by offset they must tile the data, no overlap, no gap, each its shape's size
    ("overlap", lambda: _tensors(b={"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, c=None, data=DATA[:16])),
    ("two-tensors-on-the-same-bytes", lambda: _tensors(a2=A)),
    ("overlap-into-the-next-tensor", lambda: _tensors(b={"dtype": "I8", "shape": [4], "data_offsets": [16, 20]},
                                                      c={"dtype": "I8", "shape": [4], "data_offsets": [19, 23]})),
    ("gap", lambda: _tensors(b={"dtype": "I8", "shape": [2], "data_offsets": [17, 19]})),
    ("gap-at-the-start", lambda: _tensors(a={"dtype": "F32", "shape": [3], "data_offsets": [4, 16]})),
    ("trailing-bytes-after-the-last-tensor", lambda: _tensors(data=DATA + b"\0")),
    ("data-for-no-tensor", lambda: _file(b"{}", b"\0\0")),
    ("truncated-data", lambda: _tensors(data=DATA[:-1])),
    ("shape-does-not-match-its-bytes", lambda: _tensors(a={"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]})),
    ("dtype-does-not-match-its-bytes", lambda: _tensors(a={"dtype": "F64", "shape": [2, 2], "data_offsets": [0, 16]})),
    ("offsets-end-before-begin", lambda: _one('{"dtype":"F32","shape":[0],"data_offsets":[4,0]}', b"")),
    ("offsets-past-2-to-the-64", lambda: _one('{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551616,'
                                              '18446744073709551616]}', b"")),
    ("offsets-at-2-to-the-64-minus-1", lambda: _one('{"dtype":"U8","shape":[0],"data_offsets":[18446744073709551615,'
                                                    '18446744073709551615]}', b"")),
    ("element-count-overflows-64-bits", lambda: _one('{"dtype":"F32","shape":[4294967296,4294967296,0],'
                                                     '"data_offsets":[0,0]}', b"")),
    ("bit-count-overflows-64-bits", lambda: _one('{"dtype":"F32","shape":[2305843009213693952],'
                                                 '"data_offsets":[0,0]}', b"")),
    ("four-bit-tensor-ending-inside-a-byte", lambda: _one('{"dtype":"F4","shape":[3],"data_offsets":[0,2]}', b"\0\0")),
    # the entries' types
    ("negative-offset", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":[-1,4]}')),
    ("minus-zero-offset", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":[-0,4]}')),
    ("float-offset", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}')),
    ("exponent-offset", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":[0,4e0]}')),
    ("boolean-offset", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":[false,4]}')),
    ("three-offsets", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":[0,4,4]}')),
    ("offsets-as-an-object", lambda: _one('{"dtype":"F32","shape":[1],"data_offsets":{"0":0,"1":4}}')),
    ("negative-dimension", lambda: _one('{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}')),
    ("float-dimension", lambda: _one('{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}')),
    ("shape-null", lambda: _one('{"dtype":"F32","shape":null,"data_offsets":[0,4]}')),
    ("unknown-dtype", lambda: _one('{"dtype":"F33","shape":[1],"data_offsets":[0,4]}')),
    ("lower-case-dtype", lambda: _one('{"dtype":"f32","shape":[1],"data_offsets":[0,4]}')),
    ("dtype-enum-object-with-a-value", lambda: _one('{"dtype":{"F32":1},"shape":[1],"data_offsets":[0,4]}')),
    ("missing-field", lambda: _one('{"shape":[1],"data_offsets":[0,4]}')),
    ("field-named-twice", lambda: _one('{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}')),
    ("entry-null", lambda: _one("null", b"")),
    ("entry-a-string", lambda: _one('"F32"', b"")),
    ("entry-an-array-of-two", lambda: _one('["F32",[1]]')),
    ("earlier-entry-of-a-name-malformed", lambda: _file(b'{"t":{"dtype":"XX","shape":[1],"data_offsets":[0,4]},"t":'
                                                        + T.encode() + b"}", b"\0" * 4)),
    # __metadata__: null or an object of strings, once
    ("metadata-with-a-number", lambda: _file(_json({"__metadata__": {"format": 1}, "a": A, "b": B, "c": C}))),
    ("metadata-with-null", lambda: _file(_json({"__metadata__": {"format": None}, "a": A, "b": B, "c": C}))),
    ("metadata-a-list", lambda: _file(_json({"__metadata__": ["pt"], "a": A, "b": B, "c": C}))),
    ("metadata-twice", lambda: _file(b'{"__metadata__":{},"__metadata__":{},' + _json({"a": A, "b": B, "c": C})[1:])),
    # the header's JSON, as serde_json reads it
    ("header-not-json", lambda: _file(b"{not json}")),
    ("header-not-utf8", lambda: _file(b'{"\xe9":' + T.encode() + b"}", b"\0" * 4)),
    ("header-with-a-byte-order-mark", lambda: _file(b"\xef\xbb\xbf" + _json({"a": A, "b": B, "c": C}))),
    ("header-a-list", lambda: _file(b"[1, 2]", b"")),
    ("header-a-number", lambda: _file(b"1", b"")),
    ("header-empty", lambda: _file(b"", b"")),
    ("header-only-whitespace", lambda: _file(b"    ", b"")),
    ("nul-after-the-json", lambda: _file(_json({"a": A, "b": B, "c": C}) + b"\0")),
    ("form-feed-after-the-json", lambda: _file(_json({"a": A, "b": B, "c": C}) + b"\x0c")),
    ("control-character-in-a-name", lambda: _file(b'{"t\x01":' + T.encode() + b"}", b"\0" * 4)),
    ("nan-literal", lambda: _one(T[:-1] + ',"x":NaN}')),
    ("infinity-literal", lambda: _one(T[:-1] + ',"x":-Infinity}')),
    ("float-out-of-range", lambda: _one(T[:-1] + ',"x":1e400}')),
    ("integer-out-of-range", lambda: _one(T[:-1] + ',"x":' + "9" * 400 + "}")),
    ("lone-surrogate-escape", lambda: _one(T[:-1] + ',"x":"\\ud800"}')),
    ("nesting-128-deep", lambda: _nested(126)),
    ("nesting-thousands-deep", lambda: _nested(50_000)),
    # the length prefix
    ("empty-file", lambda: b""),
    ("shorter-than-the-length", lambda: b"\x02\0\0\0"),
    ("header-length-past-the-file", lambda: _file(_json({"a": A, "b": B, "c": C}), n=10_000)),
    ("header-length-2-to-the-64-minus-1", lambda: _file(b"{}", b"", n=2**64 - 1)),
    ("header-over-the-size-limit", lambda: _padded_header(100_000_001)),
]
CASES = [pytest.param(make, True, id=f"valid-{name}") for name, make in VALID] + \
        [pytest.param(make, False, id=name) for name, make in INVALID]


def _library(path: str):
    """What ``safetensors.safe_open`` makes of the file: (metadata, {key: shape}), or None when it refuses it."""
    try:
        with safetensors.safe_open(path, "np") as f:
            return f.metadata() or {}, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 - SafetensorError, and whatever else a refusal raises
        return None


def _moejax(path: str):
    """The same from moejax's reader, or its error message."""
    try:
        f = safetensors_io.SafetensorsFile(path)
    except safetensors_io.SafetensorsError as e:
        return str(e)
    return f.metadata, {k: f.shape(k) for k in f.keys()}


@pytest.mark.parametrize("make, valid", CASES)
def test_moejax_refuses_exactly_what_the_library_refuses(tmp_path, make, valid):
    path = str(tmp_path / "x.safetensors")
    with open(path, "wb") as f:
        f.write(make())
    ours, theirs = _moejax(path), _library(path)
    assert (theirs is not None) == valid, "the safetensors library changed its mind about this file"
    if valid:
        assert ours == theirs
    else:
        assert isinstance(ours, str), f"moejax opened a file the library refuses: {ours}"
        assert ours.startswith(path) and "\n" not in ours
    assert issubclass(safetensors_io.SafetensorsError, Failure)
    os.remove(path)  # two cases are 100 MB


def test_the_cases_are_many():
    assert len(VALID) >= 15 and len(INVALID) >= 40


def test_overlapping_tensors_are_named(tmp_path):
    raw = _tensors(b={"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}, c=None, data=DATA[:16])
    with pytest.raises(safetensors_io.SafetensorsError, match=r"tensor 'b' \(bytes 8..16\) overlaps tensor 'a'"):
        _open(raw, tmp_path / "1")
    with pytest.raises(safetensors_io.SafetensorsError, match=r"4 bytes at 0 of the data belong to no tensor"):
        _open(_tensors(a={"dtype": "F32", "shape": [3], "data_offsets": [4, 16]}), tmp_path / "2")
    with pytest.raises(safetensors_io.SafetensorsError, match=r"1 bytes after the last tensor"):
        _open(_tensors(data=DATA + b"\0"), tmp_path / "3")


def _open(raw: bytes, folder) -> safetensors_io.SafetensorsFile:
    """``raw`` written to ``folder``/x.safetensors (made here; the test's own tmp_path) and opened."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "x.safetensors")
    with open(path, "wb") as f:
        f.write(raw)
    return safetensors_io.SafetensorsFile(path)


def _blocked(signum, frame):
    raise TimeoutError("blocked: the named pipe was opened")


def test_files_that_are_not_regular_are_refused_without_being_opened(tmp_path):
    fifo = str(tmp_path / "pipe.safetensors")
    os.mkfifo(fifo)  # opening it to read would block: the alarm turns that into a failure
    previous = signal.signal(signal.SIGALRM, _blocked)
    signal.alarm(20)
    try:
        for path, kind in ((fifo, "a named pipe"), (str(tmp_path), "a directory"), ("/dev/zero", "a character device")):
            with pytest.raises(safetensors_io.SafetensorsError, match=f"is not a regular file \\({kind}"):
                safetensors_io.SafetensorsFile(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    link = tmp_path / "link.safetensors"
    link.symlink_to("/dev/zero")
    with pytest.raises(safetensors_io.SafetensorsError, match="a character device, a link to /dev/zero"):
        safetensors_io.SafetensorsFile(str(link))


# ------------------------------------------------------------------------------------------ writers
ARRAYS = {
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4), "bf16": np.linspace(-2, 2, 6).astype(ml_dtypes.bfloat16),
    "i64": np.arange(5, dtype=np.int64), "u8": np.arange(7, dtype=np.uint8), "bool": np.array([True, False, True]),
    "f8": np.ones(3, ml_dtypes.float8_e4m3fn), "empty": np.ones((2, 0), np.float16), "scalar": np.float64(3.5),
    "é": np.ones(1, np.int8),
}


def test_written_files_open_in_the_library_with_the_same_tensors(tmp_path):
    numpy_kinds = [k for k in ARRAYS if k not in ("bf16", "f8")]
    meta = {"format": "moejax", "note": "ünïcode"}
    whole = str(tmp_path / "whole.safetensors")
    safetensors_io.write(whole, ARRAYS.items(), meta)
    streamed = str(tmp_path / "streamed.safetensors")
    size = safetensors_io.write_stream(streamed, [(k, np.asarray(v).dtype, np.shape(v)) for k, v in ARRAYS.items()],
                                       lambda k: [ARRAYS[k]], meta)
    assert size == os.path.getsize(streamed)
    for path in (whole, streamed):
        assert _library(path) == (meta, {k: np.shape(v) for k, v in ARRAYS.items()})
        with safetensors.safe_open(path, "np") as f:
            for k in numpy_kinds:
                np.testing.assert_array_equal(f.get_tensor(k), ARRAYS[k])
        ours = safetensors_io.SafetensorsFile(path)
        for k, v in ARRAYS.items():
            assert ours.get(k).tobytes() == np.asarray(v).tobytes()
    reference = str(tmp_path / "reference.safetensors")  # and the library's file reads the same here
    save_file({k: np.asarray(ARRAYS[k]) for k in numpy_kinds}, reference, metadata=meta)
    back = safetensors_io.SafetensorsFile(reference)
    assert back.metadata == meta and sorted(back.keys()) == sorted(load_file(reference))


@pytest.mark.parametrize("tensors, meta, message", [
    ([("a", np.ones(2))], {"format": 1}, "__metadata__ must map strings to strings"),
    ([("a", np.ones(2)), ("a", np.ones(3))], None, "twice"),
    ([("__metadata__", np.ones(2))], None, "twice"),
    ([("\ud800", np.ones(2))], None, "surrogate"),
    ([("a", np.ones(2, ">f4"))], None, "cannot write tensor"),
])
def test_writers_refuse_a_header_the_library_would_refuse(tmp_path, tensors, meta, message):
    path = str(tmp_path / "x.safetensors")
    with pytest.raises(safetensors_io.SafetensorsError, match=message):
        safetensors_io.write(path, tensors, meta)
    specs = [(k, v.dtype, v.shape) for k, v in tensors]
    with pytest.raises(safetensors_io.SafetensorsError, match=message):
        safetensors_io.write_stream(path, specs, lambda k: [dict(tensors)[k]], meta)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------------ commands
TINY = {"vocab_size": 256, "max_position_embeddings": 64, "hidden_size": 32, "head_dim": 8, "intermediate_size": 32,
        "moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "bos_token_id": 0, "eos_token_id": 1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from moejax.testing import random_checkpoint as rc

    config = rc.with_overrides(rc.preset_config("qwen3-30b-a3b"), 2, TINY, "float32")
    return rc.write_checkpoint(config, str(tmp_path_factory.mktemp("headers") / "tiny"), dtype="float32", seed=1)


def _alias(path: str, first: str | None = None, second: str | None = None) -> None:
    """Point tensor ``second``'s data_offsets at ``first``'s first bytes (its size kept): by default the file's
    second tensor at its first."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    a, b = header[first or order[0]]["data_offsets"], header[second or order[1]]["data_offsets"]
    b[:] = [a[0], a[0] + b[1] - b[0]]
    new = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    assert _library(path) is None


def _aliased_hf(tiny: str, folder: str) -> str:
    """A copy of ``tiny`` whose first q_proj's bytes are the embedding's."""
    shutil.copytree(tiny, folder)
    path = os.path.join(folder, "model.safetensors")
    _alias(path, "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")
    return path


@pytest.mark.parametrize("extra", [(), ("--offload", "--expert-store", "flash")], ids=["whole", "flash-offload"])
def test_generate_refuses_a_file_whose_tensors_share_bytes(tiny, tmp_path, capsys, extra):
    from moejax import generate

    path = _aliased_hf(tiny, str(tmp_path / "model"))
    capsys.readouterr()
    rc = generate.main(["--model", str(tmp_path / "model"), "--prompt-ids", "1,2,3", "--max-new-tokens", "1", *extra])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 1 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"error: {path}: ") and "overlaps" in lines[0] and "q_proj" in lines[0]


def test_convert_does_not_carry_a_refused_file_into_its_output(tiny, tmp_path, capsys):
    from moejax.models import checkpoint, convert

    hf = _aliased_hf(tiny, str(tmp_path / "hf"))
    mj = checkpoint.convert_to_moejax(tiny, str(tmp_path / "mj"))
    _alias(os.path.join(mj, "params.safetensors"))
    capsys.readouterr()
    for command, src, path in (("hf-to-moejax", str(tmp_path / "hf"), hf),
                               ("moejax-to-moejax", mj, os.path.join(mj, "params.safetensors")),
                               ("moejax-to-hf", mj, os.path.join(mj, "params.safetensors"))):
        rc = convert.main([command, src, str(tmp_path / "out")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1 and err[0].startswith(f"error: {path}: ") and "overlaps" in err[0], err
        assert not (tmp_path / "out").exists()
