"""Where things are: the package, the repository checkout and the data shared beside it (``../shared/data``)."""

from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../moejax
REPO_DIR = os.path.dirname(PACKAGE_DIR)
SHARED_DATA = os.path.normpath(os.path.join(REPO_DIR, "..", "shared", "data"))
WIKITEXT2_TEST = os.path.join(SHARED_DATA, "wikitext-2-raw-v1", "test.txt")
CORPUS_DIR = os.path.join(SHARED_DATA, "corpus")
ASSETS_DIR = os.path.join(PACKAGE_DIR, "assets")


def wikitext_test() -> str:
    """The WikiText-2 test file scored when no ``--data`` is given: ``$MOEJAX_WIKITEXT``, else the shared copy."""
    return os.environ.get("MOEJAX_WIKITEXT") or WIKITEXT2_TEST
