"""Few-shot prompt fitting (``tasks.common.fit_prompt``) builds O(log k) prompts whatever the shot count asked:
one per count from ``shots`` down was quadratic (minutes before the first example of ``--shots 100000``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from moejax.evaluation.tasks.common import fit_prompt


class WordEncoder:
    """One token a word, BOS 0."""

    bos = 0

    def prompt(self, text: str) -> np.ndarray:
        return np.asarray([0] + [len(w) for w in text.split()], np.int32)


def counting(lengths: list[int]):
    """A prompt builder of shots of ``lengths`` words before a 3-word question, and the counts it was asked for."""
    asked: list[int] = []

    def build(k: int) -> str:
        asked.append(k)
        return " ".join(["shot"] * sum(lengths[:k]) + ["the", "question", "here"])

    return build, asked


def brute_force(lengths: list[int], shots: int, budget: int) -> int:
    fitting = [k for k in range(shots + 1) if 1 + sum(lengths[:k]) + 3 <= budget]
    return max(fitting) if fitting else -1


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=60, max_size=60), shots=st.integers(0, 60),
       budget=st.integers(2, 400))
def test_the_most_shots_that_fit_as_counting_down_finds_them(lengths, shots, budget):
    build, asked = counting(lengths)
    p = fit_prompt(WordEncoder(), build, shots, budget)
    want = brute_force(lengths, shots, budget)
    if want >= 0:
        assert (p.shots, p.truncated, len(p.ids)) == (want, False, 1 + sum(lengths[:want]) + 3)
    else:  # not even the question fits: 0-shot, cut from the left, BOS kept
        assert (p.shots, p.truncated, len(p.ids), p.ids[0]) == (0, True, budget, 0)
    assert len(asked) <= 2 * max(1, min(shots, budget)).bit_length() + 2


@pytest.mark.parametrize("shots", [100_000, 10**9])
def test_a_huge_shot_count_builds_a_few_small_prompts(shots):
    build, asked = counting([50] * 100_000)
    p = fit_prompt(WordEncoder(), build, shots, 1024)
    assert p.shots == 20 and not p.truncated  # 1 + 20 · 50 + 3 <= 1024
    assert len(asked) <= 12 and max(asked) <= 32  # never a prompt of thousands of shots
