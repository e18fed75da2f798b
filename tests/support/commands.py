"""Running a command's ``main`` in the test process, as ``subprocess.run`` would report it."""

from __future__ import annotations

import dataclasses
from typing import Callable

@dataclasses.dataclass
class Ran:
    """What a command line gave, as ``subprocess.run`` reports it (``returncode``, ``stdout``, ``stderr``)."""
    returncode: int
    stdout: str
    stderr: str


def run_main(main: Callable[[list[str]], int], capsys, *argv) -> Ran:
    """``main(argv)`` in this process, its exit status (argparse's ``SystemExit`` included) and what it printed.
    A CLI test runs ``python -m`` in a child process once per command, to check the entry point itself; the
    rest of its calls run here, where the programs the worker compiled already are reused (a child process
    imports JAX and compiles every program again: 2-4 s a call, 12 calls in ``test_trace``'s CLI test)."""
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return Ran(int(rc or 0), out.out, out.err)
