"""Python's cyclic garbage collector in processes that trace and compile JAX programs.

Tracing and lowering a program makes hundreds of thousands of short-lived Python objects. With the collector's
default first generation (700 allocations) a process that compiles runs thousands of collections, and as its heap
grows (models, compiled programs, torch in the tests) dozens of full ones at a few tenths of a second each. Measured
with a ``gc.callbacks`` hook (AMD EPYC, 2 cores): a cold ``python -m moejax.generate`` spent 0.60 s of its 19.5 s
collecting (0.04 s with ``THRESHOLDS``), one test process running test_offload.py and test_generate.py 10.3 s of
220 s (3.1 s). Most of those objects are freed by reference counting anyway; the collector only has to find
cycles, and finding them less often loses nothing. The commands call ``for_compiling`` (they own their process);
the library never changes the interpreter's settings by itself.
"""

from __future__ import annotations

import gc

#: (first generation, second, third): 50,000 allocations between young collections instead of 700
THRESHOLDS = (50_000, 20, 10)


def for_compiling() -> None:
    """Collect cycles less often (``THRESHOLDS``): for a process that traces and compiles many programs."""
    gc.set_threshold(*THRESHOLDS)
