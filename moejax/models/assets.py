"""The embedded default model: where it lives inside the package, and the name every command knows it by."""

from __future__ import annotations

import os

from moejax.base import paths
from moejax.models import hub
from moejax.models.checkpoint import CheckpointError

DEFAULT_MODEL_NAME = "default"
DEFAULT_MODEL_DIR = os.path.join(paths.ASSETS_DIR, "default-model")
# names the folder that "default" stands for instead of the embedded model, in every command of the
# environment that sets it (the test suite points it at the embedded model's small CPU-trained predecessor)
DEFAULT_MODEL_ENV = "MOEJAX_DEFAULT_MODEL"


def default_model_path() -> str:
    override = os.environ.get(DEFAULT_MODEL_ENV)
    if override:
        if not os.path.isdir(override):
            raise CheckpointError(f"{DEFAULT_MODEL_ENV}={override} is not a folder: it names the checkpoint folder "
                                  "that 'default' stands for (unset it for the embedded model)")
        return override
    if not os.path.isdir(DEFAULT_MODEL_DIR):
        raise CheckpointError(
            "the embedded default model is not in this installation (moejax/assets/default-model); "
            "pass --model PATH to a moejax or Hugging Face checkpoint folder")
    return DEFAULT_MODEL_DIR


def resolve_model_path(path: str, needs: tuple[str, ...] = (), why: str = "") -> str:
    """The folder of a model argument: ``"default"`` is the embedded default model, a Hugging Face hub id
    (``org/name[@revision]`` that is not a path here) its cached snapshot (``hub``; ``needs``/``why``: files a
    repository must hold, checked before its weights are fetched), anything else a path."""
    if path == DEFAULT_MODEL_NAME:
        return default_model_path()
    return hub.snapshot_folder(path, needs, why) if hub.repo_of(path) else path
