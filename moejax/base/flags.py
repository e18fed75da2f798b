"""Command-line flags that were given, whatever their value.

Several options only mean something together with another (``--lam`` with ``--routing cache-prior``,
``--paging`` with ``--offload``, ``--cascade-bits`` with ``--miss cascade``), and any cache option alone turns
the cache simulation on. Comparing a value with its default cannot see ``--lam 0.5`` or ``--paging host``:
given at their default values they were silently ignored. Flags added with ``action=Given`` note themselves
on the namespace, and ``given`` reads that note (a namespace built in code, without it, falls back to
comparing with the default).
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
