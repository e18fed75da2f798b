"""What a command's error means, and the exit status that says it.

Every ``python -m moejax.*`` command prints one line ``error: ...`` (no traceback) and exits with
  2  usage error: a flag value, name or combination the command cannot mean, or an output that already
     exists without ``--overwrite`` (argparse's own errors exit 2 too; an ``EEXIST`` from the operating
     system, e.g. a folder wanted where a file is, is a failure);
  1  failure: the command line was fine but something it reads, writes or computes is not — a missing,
     damaged or unsupported file, an unwritable output, non-finite numbers.
Errors about files derive from ``Failure``; any other ``ValueError`` is a usage error. This module is at
the bottom of the import graph so that every layer can raise these.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from moejax.base import seeds

USAGE, FAILURE = 2, 1


class Failure(ValueError):
    """The input was well formed but a file or a result is not (exit status 1). A ``ValueError`` so that
    callers catching bad values keep catching it."""


class UsageError(ValueError):
    """A request the command refuses as asked (exit status 2), also where it is about a file: replacing
    a folder that is not a checkpoint, a target that is the source. Checked before ``Failure``."""


HANDLED = (ValueError, OSError)  # what a command's main turns into one line and a status


def seed_arg(text: str) -> int:
    """argparse type of every ``--seed``: an integer that fits a 64-bit seed (larger ones overflowed deep in
    JAX with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: an integer") from None
    try:
        return seeds.check_seed(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def plain_warnings() -> None:
    """A command's warnings as one ``warning: ...`` line each on stderr (Python's format adds the category and
    the source line that raised it, which a user of the command line has no use for)."""
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: f"warning: {message}\n"


def print_result(text: str) -> int:
    """Print a command's result on stdout and return its exit status: 0, or ``FAILURE`` with one ``error:`` line
    when stdout cannot take it (a full disk, ``> /dev/full``, a closed pipe) instead of a traceback."""
    try:
        print(text, flush=True)
        return 0
    except OSError as e:
        return stdout_failed(e)


def stdout_failed(err: OSError) -> int:
    """Say (one ``error:`` line) that stdout could not take a result, and return ``FAILURE``; what the command
    wrote to files stays written."""
    try:  # interpreter exit flushes stdout again: point it somewhere that takes the rest
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
    except OSError:
        pass
    print(f"error: could not write the result to stdout: {err.strerror or err}", file=sys.stderr)
    return FAILURE


def excerpt(err: BaseException, limit: int = 300) -> str:
    """``err``'s text on one line, cut at ``limit`` characters (orbax's errors carry a whole tensorstore spec)."""
    return " ".join(str(err).split())[:limit]


def exit_status(err: BaseException) -> int:
    if isinstance(err, UsageError) or (isinstance(err, FileExistsError) and err.errno is None):
        return USAGE  # refused to replace an output (raised by moejax, no errno): pass --overwrite or another path
    if isinstance(err, (Failure, OSError)):
        return FAILURE
    return USAGE


def report_text(err: BaseException) -> str:
    """``err`` as one line that names its file."""
    text = " ".join(str(err).split("\n")) if str(err) else type(err).__name__
    if isinstance(err, OSError) and err.filename and str(err.filename) not in text:
        text = f"{err.filename}: {text}"
    return text


def report(err: BaseException, prefix: str = "") -> int:
    """Print ``error: <prefix><err>`` on stderr (one line) and return the exit status for ``err``."""
    print(f"error: {prefix}{report_text(err)}", file=sys.stderr)
    return exit_status(err)
