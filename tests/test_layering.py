"""The package's layering stays true (``moejax/__init__.py`` states it).

Every module of ``moejax`` is parsed (not imported) and each of its imports of a moejax module is checked:
no import from a higher layer (``base`` → ``models`` → ``experts`` → ``runtime`` → ``evaluation`` |
``training``; the last two never import each other; nothing imports the command shims, ``testing`` or
the package root), no cycle between modules, and no moejax import inside a function (an edge no reader sees
at the top of the file). The checker itself is tested on a made-up package, so it can fail.
"""

from __future__ import annotations

import ast
import os

import moejax

LAYERS = {"base": 0, "models": 1, "experts": 2, "runtime": 3, "evaluation": 4, "training": 4}
SIBLINGS_APART = {("evaluation", "training"), ("training", "evaluation")}
ROOT = os.path.dirname(os.path.abspath(moejax.__file__))


def module_files(root: str = ROOT, package: str = "moejax") -> dict[str, str]:
    """{dotted module name: path} of every .py file under ``root``."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, name), root)[:-3].replace(os.sep, ".")
                rel = rel[: -len(".__init__")] if rel.endswith("__init__") else rel
                out[f"{package}.{rel}" if rel != "__init__" else package] = os.path.join(folder, name)
    return out


def imports_of(source: str, modules: set[str], package: str = "moejax") -> list[tuple[str, int, bool]]:
    """(imported moejax module, line, inside a function) for every import of ``source``; ``from X import y``
    counts as importing ``X.y`` when that is a module, else ``X``."""
    found = []
    tree = ast.parse(source)
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and (node.module == package or
                                                                 node.module.startswith(package + ".")):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.append(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name == package or a.name.startswith(package + ".")]
        found += [(n, node.lineno, id(node) in inside) for n in names]
    return found


def layer_of(module: str) -> tuple[str, int] | None:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] in LAYERS:
        return parts[1], LAYERS[parts[1]]
    return None


def problems(files: dict[str, str], read=lambda p: open(p, encoding="utf-8").read()) -> list[str]:
    """Every breach of the layering in ``files`` ({module: path}), as readable lines."""
    modules = set(files)
    out, graph = [], {m: set() for m in modules}
    for module, path in files.items():
        here = layer_of(module)
        for target, line, in_function in imports_of(read(path), modules):
            where = f"{module} line {line}"
            if in_function:
                out.append(f"{where}: imports {target} inside a function")
            if target == "moejax" and module != "moejax" or target not in modules:
                if here is not None:
                    out.append(f"{where}: imports {target} (the package root or a non-module)")
                continue
            there = layer_of(target)
            if there is None:
                if here is not None:  # shims, testing, the root may be imported by nothing in the layers
                    out.append(f"{where}: imports {target}, which no layer may import")
                continue
            graph[module].add(target)
            if here is not None and (there[1] > here[1] or (here[0], there[0]) in SIBLINGS_APART):
                out.append(f"{where}: {here[0]} imports {target} from the higher layer {there[0]}")
    out += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (or a self-import)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                found.append(sorted(comp) + [sorted(comp)[0]])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_keeps_its_layers():
    files = module_files()
    assert {layer_of(m)[0] for m in files if layer_of(m)} == set(LAYERS)  # every layer has modules
    assert not problems(files), "\n".join(problems(files))


def test_the_checker_finds_upward_imports_cycles_and_hidden_imports():
    fake = {
        "moejax.base.a": "from moejax.models import b\n",  # upward
        "moejax.models.b": "from moejax.models import c\n",
        "moejax.models.c": "from moejax.models import b\n",  # cycle b <-> c
        "moejax.runtime.d": "def f():\n    from moejax.base import a\n",  # hidden
        "moejax.evaluation.e": "from moejax.training import f\n",  # sibling
        "moejax.training.f": "import numpy\n",
        "moejax.experts.g": "from moejax import generate\n",  # a shim
        "moejax.generate": "from moejax.runtime.d import f\n",
    }
    fake_files = {m: m for m in fake}
    found = problems(fake_files, read=lambda p: fake[p])
    text = "\n".join(found)
    assert "moejax.base.a line 1: base imports moejax.models.b from the higher layer models" in text
    assert "import cycle: moejax.models.b -> moejax.models.c -> moejax.models.b" in text
    assert "moejax.runtime.d line 2: imports moejax.base.a inside a function" in text
    assert "evaluation imports moejax.training.f from the higher layer training" in text
    assert "moejax.experts.g line 1: imports moejax.generate, which no layer may import" in text
    assert len(found) == 5, text
