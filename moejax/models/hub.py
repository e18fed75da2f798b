"""Models named by their Hugging Face hub id (``allenai/OLMoE-1B-7B-0924``, ``org/name@revision``).

Every command's ``--model`` and ``moejax.load`` accept a hub id wherever they accept a folder: a name of the
form ``namespace/name`` (optionally ``@branch``, ``@tag`` or ``@commit``) that is not a path here. The files
are fetched with ``huggingface_hub`` into its usual cache (``$HF_HUB_CACHE``, ``$HF_HOME``; a token from
``hf auth login`` or ``$HF_TOKEN`` for gated models), and the model is read from the cached snapshot in place.
Only what moejax reads is fetched: the configuration, generation and tokenizer files, the model card and
licence files (a conversion carries them), and the safetensors weights the loader will use (``model.safetensors``, else the index and the shards it names) — never a
repository's pickled ``.bin`` copies, its original-format ``consolidated`` files or sub-folders. Before the
weights, the free space of the cache's disk is checked against what still has to come.

Offline (``HF_HUB_OFFLINE=1``, or the hub unreachable) the cached snapshot is used when it is complete.
A download is all or nothing for moejax: when it fails or is interrupted, the partial files it was writing
are removed (a resumable fetch of a very large model is ``hf download ID`` beforehand; moejax then finds it
in the cache).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys

from moejax.base import atomic
from moejax.base.memory import format_bytes
from moejax.models import checkpoint
from moejax.models.checkpoint import CARD_FILES, TOKENIZER_FILES, CheckpointError

#: the files of a repository's top level that moejax reads besides the weights (the model card and licence
#: files: a conversion carries them)
META_FILES = ("config.json", *TOKENIZER_FILES, *CARD_FILES, "model.safetensors.index.json")
# the hub's rules for a repository name: letters, digits, '-', '_', '.', at most 96 characters, no '--' or '..'
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID = re.compile(rf"({_NAME}/{_NAME})(?:@([A-Za-z0-9][A-Za-z0-9_./-]{{0,254}}))?")


def repo_of(model: str) -> tuple[str, str | None] | None:
    """``(repo id, revision or None)`` when ``model`` names a hub repository: ``namespace/name[@revision]``
    that is not a path here (an existing folder of that relative name is always the folder); else None."""
    if not isinstance(model, str) or os.path.exists(os.path.expanduser(model)):
        return None
    match = _REPO_ID.fullmatch(model)
    if match is None or "--" in match.group(1) or ".." in model:
        return None
    return match.group(1), match.group(2)


def snapshot_folder(model: str, needs: tuple[str, ...] = (), why: str = "") -> str:
    """The local folder of hub model ``model`` (``repo_of``), fetching what moejax reads if needed. ``needs``:
    top-level files the caller cannot do without (``why``), refused before anything is fetched when the
    repository lacks them (evaluate's tokenizer.json: a model's weights are gigabytes)."""
    hf = _library()
    repo, revision = repo_of(model)
    if hf.constants.is_offline_mode():
        return _cached(hf, model, repo, revision, "HF_HUB_OFFLINE is set")
    listed = [*META_FILES, "*.safetensors", *(f"*{p}" for p in checkpoint.PICKLE_SUFFIXES)]  # pickles: to refuse
    asked = _hub_call(hf, repo, revision, listed, dry_run=True)
    if "error" in asked:
        _refuse_hub_answer(hf, model, repo, revision, asked)
        return _cached(hf, model, repo, revision, f"the hub cannot be reached: {_first_line(asked['message'])}")
    top = {name: (size, fetch, path) for name, size, fetch, commit, path in asked["ok"] if "/" not in name}
    if "config.json" not in top:
        raise CheckpointError(f"the Hugging Face hub model {repo} has no config.json: not a model moejax can load")
    for name in needs:
        if name not in top:
            raise CheckpointError(f"{model} has no {name}: {why}")
    commit = asked["ok"][0][3]  # later calls ask for this commit: a moving branch cannot mix two
    meta = [name for name in META_FILES if name in top]
    folder = os.path.dirname(top["config.json"][2])
    if any(top[name][1] for name in meta):
        folder = _fetch(hf, repo, commit, meta)
    weights = weight_files(sorted(top), folder, repo)
    coming = [name for name in weights if top[name][1]]
    if not coming:
        return folder
    size = sum(top[name][0] or 0 for name in coming)
    _check_free_space(hf, repo, size)
    sys.stderr.write(f"note: downloading {repo}'s weights ({len(coming)} file{'s' * (len(coming) > 1)}, "
                     f"{format_bytes(size)}) from the Hugging Face hub into {hf.constants.HF_HUB_CACHE}\n")
    return _fetch(hf, repo, commit, meta + weights, bars=True)


def weight_files(names: list[str], folder: str, repo: str) -> list[str]:
    """The weight files the loader will read from a repository holding ``names`` (``checkpoint.weight_files``:
    its order and checks; ``folder`` holds the fetched index), all of which the repository must hold."""
    def read_index() -> str:
        path = os.path.join(folder, "model.safetensors.index.json")
        checkpoint.regular_file(path)  # never opened when it is not a file (a named pipe would block)
        with open(path, encoding="utf-8") as f:
            return f.read()

    weights, _ = checkpoint.weight_files(names, read_index, repo, source=repo)
    absent = [name for name in weights if name not in names]
    if absent:
        raise CheckpointError(f"{repo}/model.safetensors.index.json names shard {absent[0]}, which the repository "
                              "does not hold")
    return weights


#: what ``_hub_call`` runs in a child process: one ``snapshot_download``, its result or error as JSON on stdout
_CHILD = r"""
import json, sys
import huggingface_hub as hf
a = json.loads(sys.argv[1])
if not a["bars"]:
    from huggingface_hub.utils import disable_progress_bars
    disable_progress_bars()
try:
    out = hf.snapshot_download(a["repo"], revision=a["revision"], allow_patterns=a["patterns"], dry_run=a["dry_run"],
                               cache_dir=a["cache"], endpoint=a["endpoint"])
    if a["dry_run"]:
        out = [[i.filename, i.file_size, i.will_download, i.commit_hash, i.local_path] for i in out]
    result = {"ok": out}
except Exception as e:
    cause = e.__cause__ if isinstance(e, hf.errors.DryRunError) and e.__cause__ is not None else e
    result = {"error": type(cause).__name__, "kinds": [k.__name__ for k in type(cause).__mro__],
              "status": getattr(getattr(cause, "response", None), "status_code", None), "message": str(cause)}
sys.stdout.write(json.dumps(result))
"""


def _hub_call(hf, repo: str, revision: str | None, patterns: list[str], dry_run: bool = False,
              bars: bool = False) -> dict:
    """``snapshot_download(repo, revision, allow_patterns=patterns)`` in a child process: ``{"ok": folder}`` (a
    dry run: ``[[name, size, will download, commit, local path], ...]``) or ``{"error": ..., "kinds", "status", "message"}``.
    A child because ``huggingface_hub`` downloads in a pool of threads that the interpreter joins at exit:
    Ctrl-C or SIGTERM during a download would wait for it to end. The child is killed instead (it runs in its
    own session, so the terminal's Ctrl-C reaches only this process); with ``bars`` its progress bars go to
    our stderr."""
    arguments = {"repo": repo, "revision": revision, "patterns": patterns, "dry_run": dry_run, "bars": bars,
                 "cache": hf.constants.HF_HUB_CACHE, "endpoint": hf.constants.ENDPOINT}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(arguments)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, start_new_session=True)
    try:
        out, _ = child.communicate()
    except BaseException:
        child.kill()
        child.wait()
        raise
    try:
        return json.loads(out)
    except ValueError:
        raise CheckpointError(f"asking the Hugging Face hub for {repo} failed (the helper process exited with "
                              f"status {child.returncode})") from None


def _fetch(hf, repo: str, commit: str, names: list[str], bars: bool = False) -> str:
    """Download exactly ``names`` at ``commit`` into the cache; the partial files of a failed or interrupted
    download are removed (``huggingface_hub`` keeps them as ``blobs/*.incomplete`` to resume)."""
    blobs = os.path.join(hf.constants.HF_HUB_CACHE, hf.repo_folder_name(repo_id=repo, repo_type="model"), "blobs")
    before = _incomplete(blobs)
    answer = None
    try:
        answer = _hub_call(hf, repo, commit, [_pattern(n) for n in names], bars=bars)
    finally:
        if answer is None or "error" in answer:
            for path in _incomplete(blobs) - before:
                with contextlib.suppress(OSError):
                    os.remove(path)
    if "error" in answer:
        raise CheckpointError(f"downloading {repo} from the Hugging Face hub failed "
                              f"({_first_line(answer['message'])}); the partial files were removed")
    return answer["ok"]


def _cached(hf, model: str, repo: str, revision: str | None, reason: str) -> str:
    """The complete cached snapshot of ``repo`` when the hub cannot be asked (offline, unreachable)."""
    try:
        folder = hf.snapshot_download(repo, revision=revision, local_files_only=True,
                                      allow_patterns=list(META_FILES))
        weights = weight_files(sorted(os.listdir(folder)), folder, repo)
        return hf.snapshot_download(repo, revision=revision, local_files_only=True,
                                    allow_patterns=[*META_FILES, *(_pattern(n) for n in weights)])
    except (hf.errors.LocalEntryNotFoundError, hf.errors.IncompleteSnapshotError):
        raise CheckpointError(f"{model} is not a folder here, and the Hugging Face hub model {repo}"
                              + (f" at revision {revision}" if revision else "")
                              + f" is not (completely) in the cache {hf.constants.HF_HUB_CACHE} ({reason})") from None


def _refuse_hub_answer(hf, model: str, repo: str, revision: str | None, answer: dict) -> None:
    """A clear error for the hub's refusals (no such repository or revision, gated, private), which no cache
    can mend; other errors (offline, unreachable, the hub down) leave the cache to serve."""
    kinds = answer.get("kinds", [])
    if "GatedRepoError" in kinds:
        raise CheckpointError(f"the Hugging Face hub model {repo} is gated: accept its terms on "
                              f"{hf.constants.ENDPOINT}/{repo}, then log in (`hf auth login`) or set HF_TOKEN")
    if "RevisionNotFoundError" in kinds:
        raise CheckpointError(f"the Hugging Face hub model {repo} has no revision {revision!r}")
    if "RepositoryNotFoundError" in kinds or answer.get("status") in (401, 403):
        raise CheckpointError(f"{model} is not a folder here, and the Hugging Face hub has no model {repo} "
                              "you may read (a private one needs `hf auth login` or HF_TOKEN)")


def _check_free_space(hf, repo: str, needed: int) -> None:
    """Refuse a download that cannot fit on the cache's disk, before it starts."""
    free = shutil.disk_usage(atomic.existing_ancestor(hf.constants.HF_HUB_CACHE)).free
    if needed > free:
        raise CheckpointError(f"the Hugging Face hub model {repo} needs {format_bytes(needed)} more in "
                              f"{hf.constants.HF_HUB_CACHE}, which has {format_bytes(free)} free (set HF_HUB_CACHE "
                              "to a larger disk)")


def _library():
    """``huggingface_hub``, imported only when a hub id is used (it takes a tenth of a second to import)."""
    import types

    import huggingface_hub
    from huggingface_hub import constants, errors, file_download

    return types.SimpleNamespace(snapshot_download=huggingface_hub.snapshot_download, constants=constants,
                                 errors=errors, repo_folder_name=file_download.repo_folder_name)


def _incomplete(blobs: str) -> set[str]:
    try:
        return {os.path.join(blobs, n) for n in os.listdir(blobs) if n.endswith(".incomplete")}
    except OSError:
        return set()


def _pattern(name: str) -> str:
    """An ``allow_patterns`` entry matching exactly ``name`` (the patterns are ``fnmatch`` globs)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _first_line(error) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
