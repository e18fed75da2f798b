"""The data the tests read from ``tests/data``, and the tests' "default" model: a cut of the CPU-trained
model shipped there (``cut_model``), made once per run by the controlling process (``conftest``).

"default" in the tests (and in every CLI subprocess they start) is that cut of ``tests/data/cpu-default-model``
(4 layers, 32 experts top-4, 28 MB): its first and last layers and the first 16 experts of each (10 MB). The
shipped default (8 layers, 64 experts top-8) made the suite twice as long, and the full CPU-trained model's decode
program held 128 expert branches (4.6 s to compile at level 0, 1.4 s for the cut's 32);
tests/test_default_model.py checks the shipped one itself.
"""

from __future__ import annotations

import json
import os
import shutil

CPU_DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "cpu-default-model")
WIKITEXT2_TEST = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "wikitext-2-raw-v1", "test.txt")
CUT_LAYERS, CUT_EXPERTS = (0, 3), 16


def cut_model(src: str, dst: str, layers=CUT_LAYERS, n_experts: int = CUT_EXPERTS) -> str:
    """A moejax folder of ``src``'s ``layers`` (renumbered from 0) with the first ``n_experts`` routed experts of
    each (the router's columns cut to match): the stored tensors sliced as they are (``safetensors_io``), no
    model loaded, so the controlling process makes it before its workers start. moejax is imported here, not
    at the top: ``conftest`` sets XLA's flags before anything imports JAX."""
    from moejax.models import safetensors_io

    stored = safetensors_io.SafetensorsFile(os.path.join(src, "params.safetensors"))

    def cut(key: str):
        parts, x = key.split("."), stored.get(key)
        if parts[0] == "layers":
            if int(parts[1]) not in layers:
                return None
            parts[1] = str(layers.index(int(parts[1])))
            if parts[2] == "moe":
                x = x[:, :n_experts] if parts[3] == "router" else x[:n_experts]
        return ".".join(parts), x

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("params.safetensors", "moejax.json"))
    safetensors_io.write(os.path.join(dst, "params.safetensors"), filter(None, map(cut, stored.keys())),
                         stored.metadata)
    with open(os.path.join(src, "moejax.json")) as f:
        meta = json.load(f)
    meta["hf_config"].update(num_hidden_layers=len(layers), num_experts=n_experts)
    with open(os.path.join(dst, "moejax.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return dst
