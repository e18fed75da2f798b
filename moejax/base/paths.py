"""Where things are: the package, and the local copies of the datasets a user may point moejax at.

Nothing outside the package is assumed. A command's data comes from its own option (``--data``,
``--corpus-dir``, ``--calibration-text``), else from the folder the ``MOEJAX_DATA`` environment variable
names (laid out as ``wikitext-2-raw-v1/test.txt``, ``mmlu/``, ``gsm8k/``, ``truthfulqa/``, ``nq_open/``,
``corpus/``), else from the Hugging Face ``datasets`` library (``pip install 'moejax[data]'``), else a
one-line error naming those ways."""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../moejax
ASSETS_DIR = os.path.join(PACKAGE_DIR, "assets")
DATA_ENV = "MOEJAX_DATA"
WIKITEXT_ENV = "MOEJAX_WIKITEXT"
WIKITEXT2_TEST_IN_DATA = os.path.join("wikitext-2-raw-v1", "test.txt")
DATA_EXTRA = "pip install 'moejax[data]'"


def data_dir() -> str | None:
    """The folder ``$MOEJAX_DATA`` names (user-expanded), or None when it is unset or empty."""
    value = os.environ.get(DATA_ENV, "").strip()
    return os.path.abspath(os.path.expanduser(value)) if value else None


def in_data_dir(*parts: str) -> str | None:
    """``$MOEJAX_DATA/parts...``, or None when ``$MOEJAX_DATA`` is unset."""
    root = data_dir()
    return os.path.join(root, *parts) if root else None


def wikitext_test() -> str | None:
    """The WikiText-2 test file scored when no ``--data`` is given: ``$MOEJAX_WIKITEXT``, else
    ``$MOEJAX_DATA/wikitext-2-raw-v1/test.txt``, else None (the HF ``datasets`` copy)."""
    value = os.environ.get(WIKITEXT_ENV, "").strip()
    return os.path.expanduser(value) if value else in_data_dir(WIKITEXT2_TEST_IN_DATA)


def corpus_dir() -> str | None:
    """The training corpus folder when no ``--corpus-dir`` is given: ``$MOEJAX_DATA/corpus``, else None."""
    return in_data_dir("corpus")
