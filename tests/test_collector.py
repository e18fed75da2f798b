"""The commands collect cycles less often (``moejax.base.collector``); the library leaves the interpreter's
collector as it was."""

from __future__ import annotations

import os
import subprocess
import sys

from moejax.base import collector

_PROBE = """
import gc, sys
gc.set_threshold(700, 10, 10)
import moejax
from moejax.runtime import generate
assert gc.get_threshold() == (700, 10, 10), gc.get_threshold()  # importing the library changed nothing
status = generate.main(["--model", sys.argv[1], "--max-new-tokens", "1"])
print(status, gc.get_threshold())
"""


def test_a_command_sets_the_thresholds_and_importing_the_library_does_not(tmp_path):
    r = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "no-such-model")], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu", "MOEJAX_COMPILE_CACHE": "off"})
    assert r.returncode == 0, r.stderr
    status, thresholds = r.stdout.strip().split(" ", 1)
    assert status != "0" and "no-such-model" in r.stderr  # the bad model is one error, after the setting
    assert thresholds == str(collector.THRESHOLDS)
