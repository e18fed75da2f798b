"""What the benchmarks share: the repository's paths and the text they score by default."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKITEXT2_TEST = os.path.join(REPO, "tests", "data", "wikitext-2-raw-v1", "test.txt")


def score_the_shipped_wikitext() -> None:
    """A benchmark given no text scores the WikiText-2 test copy the repository ships (``tests/data``), in
    this process and the ones it starts; ``$MOEJAX_WIKITEXT`` set by the caller wins."""
    os.environ.setdefault("MOEJAX_WIKITEXT", WIKITEXT2_TEST)


def times(fn, repeats: int, warm: int = 1) -> list[float]:
    """Seconds of ``repeats`` calls of ``fn`` (its result waited for), after ``warm`` calls."""
    import time

    import jax  # here, not at the top: scripts that only start child processes never import JAX

    for _ in range(warm):
        jax.block_until_ready(fn())
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return out
