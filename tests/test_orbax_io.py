"""``moejax.base.orbax_io``: orbax saves and reads whose failures are one clean error (the commands' own tests
run real failures in child processes: tests/test_train.py, tests/test_prior.py)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

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


class _ReraisingThread(threading.Thread):
    """Like orbax's own threads: ``join`` re-raises the thread's failure."""

    def __init__(self, target):
        super().__init__(target=self._catching, args=(target,))
        self.failure = None

    def _catching(self, target):
        try:
            target()
        except Exception as e:  # noqa: BLE001
            self.failure = e

    def join(self, timeout=None):
        super().join(timeout)
        if self.failure is not None:
            raise self.failure


class _FailingCheckpointer:
    """A save whose background write fails after the caller has seen the failure, as a full disk does."""

    def save(self, path, tree):
        self.unfinished = path + ".orbax-checkpoint-tmp"
        os.makedirs(self.unfinished)

        def write():
            time.sleep(0.2)
            open(os.path.join(self.unfinished, "_sharding"), "w").write("late")
            raise ValueError("OUT_OF_RANGE: Failed writing: File too large")

        self.thread = _ReraisingThread(write)
        self.thread.start()

    def wait_until_finished(self):
        raise ValueError("OUT_OF_RANGE: Failed writing: File too large")

    def close(self):
        pass


def test_a_failed_save_waits_for_its_writers_and_leaves_no_unfinished_folder(tmp_path, monkeypatch):
    """Orbax's threads re-raise their failure from ``join``: the wait for them ended at the first one and the
    clean-up was skipped, leaving ``PATH.orbax-checkpoint-tmp`` behind in about 1 real failed save in 3."""
    import orbax.checkpoint as ocp

    monkeypatch.setattr(ocp, "StandardCheckpointer", _FailingCheckpointer)
    with pytest.raises(ValueError, match="File too large"):
        orbax_io.save(str(tmp_path / "step_2"), {"a": np.zeros(3)})
    assert os.listdir(tmp_path) == []
