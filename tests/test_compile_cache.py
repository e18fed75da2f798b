"""The commands keep their compiled programs between runs (``moejax.base.compile_cache``): a second run loads
them instead of compiling; the user can move the cache or turn it off, JAX's own setting wins, and a folder
that cannot be written never makes a command fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.hf_models import get_hf_model

from moejax.base import compile_cache


def _generate(tmp_path, **env_extra) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                                                                      "MOEJAX_COMPILE_CACHE"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), **env_extra)
    cmd = [sys.executable, "-m", "moejax.generate", "--model", get_hf_model("olmoe").folder, "--prompt-ids",
           "5,17,42", "--max-new-tokens", "4", "--ignore-eos", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return out, json.loads(out.stdout)


def _files(folder) -> set:
    return {os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs if not f.startswith(".")}


def test_a_second_run_compiles_nothing(tmp_path):
    folder = tmp_path / "xdg" / "moejax" / "xla" / compile_cache.machine_tag()
    _, first = _generate(tmp_path)
    written = _files(folder)
    assert any(f.endswith("-cache") for f in written), written  # the programs, in the default folder
    _, second = _generate(tmp_path)
    assert second["token_ids"] == first["token_ids"]
    assert _files(folder) == written  # every program came from the cache: nothing new was written


def _enable(tmp_path, **env_extra) -> str:
    """``compile_cache.enable()`` in a fresh process (JAX's settings are per process): the folder in use, as
    jax.config says after it, or "None"."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE",
                                                                      "MOEJAX_COMPILE_CACHE"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), **env_extra)
    code = ("from moejax.base import compile_cache; import jax; used = compile_cache.enable(); "
            "assert used == jax.config.jax_compilation_cache_dir, used; print(used)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_user_moves_or_turns_off_the_cache_and_an_unwritable_folder_is_skipped(tmp_path):
    default = str(tmp_path / "xdg" / "moejax" / "xla" / compile_cache.machine_tag())
    assert _enable(tmp_path) == default
    assert _enable(tmp_path, MOEJAX_COMPILE_CACHE="off") == "None"
    assert _enable(tmp_path, MOEJAX_COMPILE_CACHE=str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert os.path.isdir(tmp_path / "mine")
    assert _enable(tmp_path, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax")) == str(tmp_path / "jax")  # JAX's own
    (tmp_path / "a-file").write_text("not a folder")
    assert _enable(tmp_path, MOEJAX_COMPILE_CACHE=str(tmp_path / "a-file" / "cache")) == "None"
    assert (tmp_path / "a-file").read_text() == "not a folder"
    # a command with a folder it cannot use runs as without a cache
    _generate(tmp_path, MOEJAX_COMPILE_CACHE=str(tmp_path / "a-file" / "cache"))


def test_the_machine_tag_names_the_architecture():
    tag = compile_cache.machine_tag()
    assert tag == compile_cache.machine_tag() and len(tag.rsplit("-", 1)[1]) == 12
