"""``moejax.base.orbax_io``: orbax saves and reads whose failures are one clean error (the commands' own tests
run real failures in child processes: tests/test_train.py, tests/test_prior.py)."""

from __future__ import annotations

import logging
import os
import sys

import numpy as np
import pytest

from moejax.base import errors, orbax_io


def test_a_saved_tree_reads_back_with_and_without_a_target(tmp_path):
    tree = {"a": np.arange(10, dtype=np.float32), "b": {"c": np.ones((2, 3), np.int32)}}
    orbax_io.save(str(tmp_path / "ok"), tree)
    for got in (orbax_io.restore(str(tmp_path / "ok")), orbax_io.restore(str(tmp_path / "ok"), tree)):
        np.testing.assert_array_equal(got["a"], tree["a"])
        np.testing.assert_array_equal(got["b"]["c"], tree["b"]["c"])


def test_a_missing_or_incomplete_checkpoint_is_a_failure_naming_it(tmp_path):
    with pytest.raises(errors.Failure, match=f"the checkpoint {tmp_path / 'none'} is missing"):
        orbax_io.restore(str(tmp_path / "none"))
    orbax_io.save(str(tmp_path / "ok"), {"a": np.arange(4, dtype=np.float32)})
    for name in ("_METADATA", "_CHECKPOINT_METADATA"):
        os.remove(tmp_path / "ok" / name)
    with pytest.raises(errors.Failure, match=r"cannot read the checkpoint .*ok \(damaged or incomplete\): "
                                             r"ValueError: its metadata \(_METADATA\) is missing"):
        orbax_io.restore(str(tmp_path / "ok"))


def test_quieting_ends_with_a_block_that_succeeds_and_stays_after_one_that_fails():
    absl = logging.getLogger("absl")
    filters, hook = list(absl.filters), sys.unraisablehook
    with orbax_io.failure_quiet():
        assert len(absl.filters) == len(filters) + 1 and sys.unraisablehook is not hook
    assert absl.filters == filters and sys.unraisablehook is hook
    for _ in range(3):  # failures in a row leave one filter, not one each
        with pytest.raises(ValueError), orbax_io.failure_quiet():
            raise ValueError("disk full")
    kept = orbax_io._kept["filter"]
    assert kept in absl.filters and len(absl.filters) <= len(filters) + 1
    assert not kept.filter(logging.LogRecord("absl", logging.ERROR, "", 0, "x", (), None))
    assert kept.filter(logging.LogRecord("absl", logging.INFO, "", 0, "x", (), None))
