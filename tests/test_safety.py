"""Loading stays safe: no moejax module unpickles, evaluates code, or trusts remote
code on a path a user's file reaches, and chat templates render only in jinja2's sandbox.

Two checks: a static scan of every moejax source file (so a new ``pickle.load`` or ``np.load`` without
``allow_pickle=False`` fails here the day it is written), and a run of the loading paths with the unpicklers
replaced by tripwires, next to a planted pickle file.
"""

from __future__ import annotations

import ast
import os
import pickle
import shutil

import numpy as np
import pytest
from support.hf_models import get_hf_model

import moejax

PACKAGE = os.path.dirname(os.path.abspath(moejax.__file__))
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _sources():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PACKAGE), ast.parse(f.read(), path)


def _dotted(node) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _findings(tree) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            kwargs = {k.arg: k.value for k in node.keywords}
            if isinstance(node.func, ast.Name) and name in UNSAFE_BUILTINS:
                found.append(f"{name}(...)")
            if name.endswith("torch.load") or name.endswith("yaml.load") or name.endswith("yaml.unsafe_load"):
                found.append(f"{name}(...)")
            if name in ("np.load", "numpy.load"):
                flag = kwargs.get("allow_pickle")
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    found.append("np.load without allow_pickle=False")
            if "trust_remote_code" in kwargs:
                found.append("trust_remote_code=")
            if name.split(".")[-1] == "Environment" and "jinja2" in name:
                found.append("jinja2.Environment (unsandboxed)")
    return found


def test_no_module_unpickles_evaluates_or_trusts_remote_code():
    found = {path: f for path, tree in _sources() if (f := _findings(tree))}
    assert not found, found


def test_the_scan_catches_what_it_looks_for():
    bad = ast.parse("import pickle\nimport numpy as np\nx = np.load('a')\neval('1')\n"
                    "from transformers import AutoModel\nAutoModel.from_pretrained('p', trust_remote_code=True)\n")
    assert sorted(_findings(bad)) == sorted(["import pickle", "np.load without allow_pickle=False", "eval(...)",
                                             "trust_remote_code="])
    assert not _findings(ast.parse("import numpy as np\nnp.load('a', allow_pickle=False)\nf.lower().compile()\n"))


class _Tripwire(Exception):
    pass


def test_loading_paths_never_unpickle_even_next_to_a_pickle(tmp_path, monkeypatch):
    """A model folder with a planted ``pytorch_model.bin`` beside its safetensors, a trace next to a
    pickled object: every loader runs with the unpicklers replaced by tripwires."""
    folder = str(tmp_path / "model")
    shutil.copytree(get_hf_model("qwen3_moe").folder, folder)
    with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
        pickle.dump({"boom": 1}, f)

    def tripwire(*args, **kwargs):
        raise _Tripwire("something unpickled")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, tripwire)
    m = moejax.load(folder)
    m.forward([1, 2, 3])
    from moejax.experts import trace

    path = str(tmp_path / "t.npz")
    np.savez(path, experts=np.zeros((4, 2, 2), np.int32), weights=np.array([{"a": 1}], dtype=object))
    with pytest.raises((trace.TraceError, ValueError), match="(?i)pickle|object"):  # refused, not unpickled
        trace.load_trace(path)
