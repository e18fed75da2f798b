"""A full disk without root: a moejax command run where no file may grow past a size."""

from __future__ import annotations

import os
import subprocess
import sys


def run_module_with_file_limit(module: str, argv: list[str], limit_bytes: int,
                               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m module argv`` where no file may grow past ``limit_bytes``. CPython ignores SIGXFSZ, so a write
    past the limit fails with EFBIG (the limit is set in the child itself: a preexec_fn would run Python between
    fork and exec in this multithreaded process). Persistent compile caches are off: an entry over the limit
    would warn."""
    limits = f"({limit_bytes}, {limit_bytes})"
    limited = (f"import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, {limits}); "
               f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__')")
    env = {**os.environ, "MOEJAX_COMPILE_CACHE": "off"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-c", limited, *argv], capture_output=True, text=True, env=env,
                          timeout=timeout)
