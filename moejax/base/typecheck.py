"""Whether a value given by a user (an argument, a JSON field, a config entry) is an integer or a number.

``bool`` is an ``int`` to Python, so ``isinstance(True, int)``: a ``True`` given for a count, a seed or a
temperature is a mistake to name, not 1. numpy's scalars count as what they hold; ``np.bool_`` does not."""

from __future__ import annotations

import numpy as np


def is_integer(value) -> bool:
    """An ``int`` or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number: ``int``, ``float`` or a numpy integer or float, not a bool (NaN and inf included: the
    caller decides whether they may be)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
