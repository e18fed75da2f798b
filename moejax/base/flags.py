"""Command-line flags that were given, whatever their value.

Several options only mean something together with another (``--lam`` with ``--routing cache-prior``,
``--paging`` with ``--offload``, ``--cascade-bits`` with ``--miss cascade``), and any cache option alone turns
the cache simulation on. Comparing a value with its default cannot see ``--lam 0.5`` or ``--paging host``:
given at their default values they were silently ignored. Flags added with ``action=Given`` note themselves
on the namespace, and ``given`` reads that note (a namespace built in code, without it, falls back to
comparing with the default).

Float options take ``finite_float(low, high)`` (or ``FloatList`` for comma-separated numbers) as their type:
argparse's ``float`` takes 'inf', 'nan' and '1e300', which become inf or NaN deep in float32 arithmetic.
"""

from __future__ import annotations

import argparse

NOTE = "given_flags"  # the namespace attribute: the dests of the flags on the command line, in order


class Given(argparse.Action):
    """``store`` (type and choices applied as usual), also noting the flag as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, NOTE, tuple(getattr(namespace, NOTE, ())) + (self.dest,))


def given(args: argparse.Namespace, name: str, default=None) -> bool:
    """Whether flag ``name`` (its dest) was on the command line, or holds a value other than ``default``."""
    return name in getattr(args, NOTE, ()) or getattr(args, name, default) != default


#: float32's largest finite value: JAX computes in float32, where anything larger is inf
FLOAT32_MAX = 3.4028234663852886e38


class FloatRange:
    """argparse ``type`` of a float option: a finite number in ``[low, high]`` (an end exclusive where asked).
    ``float`` alone takes 'inf', 'nan' and '1e300' (inf once in float32); every float option of a command goes
    through one of these, so a bad value gets argparse's one-line error naming the flag (exit 2)."""

    def __init__(self, low: float, high: float, *, low_open: bool = False, high_open: bool = False):
        if not -FLOAT32_MAX <= low < high <= FLOAT32_MAX:
            raise ValueError(f"a float option's range must lie within float32's, got [{low}, {high}]")
        self.low, self.high, self.low_open, self.high_open = low, high, low_open, high_open
        self.__name__ = "float"  # argparse names the type in its messages

    def describe(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def contains(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below  # False for NaN

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be a finite number in {self.describe()}, got {text!r}")
        return value

    def __repr__(self) -> str:
        return f"FloatRange{self.describe()}"


def finite_float(low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX, **open_ends) -> FloatRange:
    """The argparse ``type`` of a float option taking values in ``[low, high]`` (``low_open`` / ``high_open``:
    that end excluded); the default range is float32's finite numbers."""
    return FloatRange(low, high, **open_ends)


class FloatList:
    """argparse ``type`` of comma-separated numbers (empty items skipped), each in ``range``
    (a ``FloatRange``): a tuple of floats, or the text itself with ``as_text`` (for code that parses the
    text again later)."""

    def __init__(self, range: FloatRange, as_text: bool = False):
        self.range, self.as_text = range, as_text
        self.__name__ = "float list"

    def __call__(self, text: str):
        items = [t for t in str(text).split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
        values = tuple(self.range(t) for t in items)
        return text if self.as_text else values

    def __repr__(self) -> str:
        return f"FloatList{self.range.describe()}"
