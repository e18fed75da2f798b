"""Where the embedded default model lives inside the package."""

from __future__ import annotations

import os

from moejax.checkpoint import CheckpointError

ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")
DEFAULT_MODEL_DIR = os.path.join(ASSETS_DIR, "default-model")


def default_model_path() -> str:
    if not os.path.isdir(DEFAULT_MODEL_DIR):
        raise CheckpointError(
            "the embedded default model is not in this installation (moejax/assets/default-model); "
            "pass --model PATH to a moejax or Hugging Face checkpoint folder")
    return DEFAULT_MODEL_DIR
