"""``moejax.base.typecheck``: what counts as an integer or a number given by a user (a bool never does)."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.base.typecheck import is_integer, is_number
from moejax.runtime import sampling as sampling_lib


@pytest.mark.parametrize("value, integer, number", [
    (3, True, True), (np.int64(3), True, True), (np.uint8(3), True, True), (-2, True, True),
    (2.5, False, True), (3.0, False, True), (np.float32(0.5), False, True), (float("nan"), False, True),
    (True, False, False), (False, False, False), (np.bool_(True), False, False),
    ("3", False, False), (None, False, False), (1 + 2j, False, False), ([3], False, False),
    (np.array(3), False, False),  # a 0-d array is not a scalar given by a user
])
def test_integers_and_numbers(value, integer, number):
    assert is_integer(value) is integer and is_number(value) is number


def test_a_bool_repetition_penalty_is_refused_not_taken_as_one():
    with pytest.raises(ValueError, match="repetition_penalty"):  # True was accepted as a penalty of 1
        sampling_lib.Sampling(0.7, repetition_penalty=True)
