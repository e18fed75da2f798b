"""The test session: its temporary folder, environment (no hub, one shared compilation cache, XLA's flags), the
tests' "default" model, fixtures, the order CI's workers take the files in, and reports. Helpers the tests
import live in ``tests/support``: the tiny Hugging Face models (``support.hf_models``), running a command in
process (``support.commands``), counting compilations (``support.programs``), the shipped data
(``support.shipped_data``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable

import pytest
from support import hf_models
from support.hf_models import HFModel, get_hf_model, get_moejax_model
from support.scheduling import heaviest_files_first
from support.shipped_data import CPU_DEFAULT_MODEL, cut_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no test reaches the Hugging Face hub or the user's hub cache: a hub id resolves offline, from a cache of the
# run's own (tests/test_hub.py serves the hub's answers from local files itself)
os.environ["HF_HUB_OFFLINE"] = "1"
# the WikiText-2 text a test scores when it names none is the copy the repository ships (``tests/data``), in every
# worker and CLI subprocess too: never a folder beside the checkout, never a download
os.environ["MOEJAX_WIKITEXT"] = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "wikitext-2-raw-v1",
                                             "test.txt")


def _run_folder() -> str:
    """The run's own temporary folder. The controlling process makes ``moejax-tests-*`` and removes it when it
    exits; xdist workers and CLI subprocesses inherit it (``MOEJAX_TESTS_TMP``) and put theirs inside, so a
    worker that dies without its clean-ups (xdist ends workers abruptly on an interrupt) leaves nothing."""
    outer = os.environ.get("MOEJAX_TESTS_TMP")
    if os.environ.get("PYTEST_XDIST_WORKER") and outer and os.path.isdir(outer):
        return tempfile.mkdtemp(prefix=f"{os.environ['PYTEST_XDIST_WORKER']}-", dir=outer)
    folder = tempfile.mkdtemp(prefix="moejax-tests-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ["MOEJAX_TESTS_TMP"] = folder
    return folder


_RUN_FOLDER = _run_folder()
hf_models.RUN_FOLDER.append(_RUN_FOLDER)
os.environ["HF_HUB_CACHE"] = os.path.join(_RUN_FOLDER, "hub-cache")
os.makedirs(os.environ["HF_HUB_CACHE"])


def _stop_on_sigterm(signum, frame) -> None:
    """A run stopped by SIGTERM (``timeout``, a cancelled CI job) stops as Ctrl-C does: pytest tears down and
    the ``atexit`` clean-up above runs, instead of the process dying with its temporary folder left behind."""
    raise KeyboardInterrupt(f"stopped by signal {signum}")


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _stop_on_sigterm)


def _share_compiled_programs() -> None:
    """One JAX persistent compilation cache for the whole test run: the xdist workers and every CLI
    subprocess inherit it, so a program that several tests compile (the default model's prefill and decode
    steps above all) is compiled once. Made by the controlling process inside the run's folder; a
    ``JAX_COMPILATION_CACHE_DIR`` set by the caller is used as it is."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_RUN_FOLDER, "jax-cache")
    os.makedirs(os.environ["JAX_COMPILATION_CACHE_DIR"])
    # programs that compile in under 0.3 s are not written (a write serialises and compresses the executable,
    # ~10 ms: 643 of them were 3 % of test_offload.py's time); the prefill and decode programs worth sharing are
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")


_share_compiled_programs()

# "default" in the tests (and in every CLI subprocess they start) is a cut of a small CPU-trained model
# (``support.shipped_data``)
def _test_default_model() -> str:
    """The cut (``cut_model``), made by the controlling process in the run's folder; workers and CLI subprocesses
    inherit ``MOEJAX_DEFAULT_MODEL``."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.path.isdir(os.environ.get("MOEJAX_DEFAULT_MODEL", "")):
        return os.environ["MOEJAX_DEFAULT_MODEL"]
    return cut_model(CPU_DEFAULT_MODEL, os.path.join(_RUN_FOLDER, "test-default-model"))


os.environ["MOEJAX_DEFAULT_MODEL"] = _test_default_model()


#: XLA:CPU's older loop emitters, which the suite compiles with (``_compile_quickly``)
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _compile_quickly() -> None:
    """Compile the tests' programs with XLA's LLVM backend at optimisation level 0 (a third less time for the
    suite, almost all of it compilation of tiny models) and XLA:CPU's older loop emitters instead of its fusion
    emitters (``--xla_cpu_use_fusion_emitters=false``: a quarter less on a compile-bound test, 25.0 -> 18.8 s),
    unless the caller's ``XLA_FLAGS`` choose a level. The tests check logic and path-to-path equality, which do
    not depend on either; the ``numerics`` tests run as users compile (XLA's defaults, level 3), in the first
    pass of ``.ci/run``, which names that level. XLA aborts on a flag it does not know, so the emitter flag is
    tried once in a child process first (a JAX without it keeps the default emitters)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" in flags:
        return
    flags = f"{flags} --xla_backend_optimization_level=0".strip()
    emitters = f"{flags} {OLDER_EMITTERS}"
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()"],
                           env={**os.environ, "XLA_FLAGS": emitters, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, timeout=120)
    os.environ["XLA_FLAGS"] = emitters if probe.returncode == 0 else flags


_compile_quickly()


def with_fusion_emitters(env: dict) -> dict:
    """``env`` without the suite's ``OLDER_EMITTERS``: XLA:CPU's default (fusion) emitters. The older ones compile the
    tiny models' many small programs faster, but a large program slower: the shipped model's decode program (8 layers
    x 64 expert branches) 13.3 against 10.4 s at level 0 (``test_generate_with_no_arguments``'s child, AMD EPYC,
    2 cores)."""
    return {**env, "XLA_FLAGS": " ".join(env.get("XLA_FLAGS", "").replace(OLDER_EMITTERS, "").split())}


def _float32_matmuls_on_gpus() -> None:
    """Where an NVIDIA GPU is visible, float32 matrix products default to TF32 (a 10-bit mantissa): the
    teacher-forced offload pass, token by token, then differed from the simulation's batched pass by 8e-4 in
    the logits on an H200 (tolerance 2e-5), with the same experts and hits. The tests compare float32 paths
    at float32 tolerances, so there they run at full float32 (``highest``), as on a CPU; a caller's
    ``JAX_DEFAULT_MATMUL_PRECISION`` is kept. No effect on CPU-only machines (CI)."""
    if os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
        # Run to run and compile to compile, the same numbers: the suite on an H200 saw one program
        # give logits 1 ulp apart for inputs that differ only where nothing reads them (atomics in XLA:GPU
        # reductions), and two loads of one model disagree by 1 ulp (kernels autotuned per compile); the
        # tests that compare such runs bit for bit hold on the CPU, where both are deterministic.
        flags = os.environ.get("XLA_FLAGS", "")
        for flag in ("--xla_gpu_deterministic_ops=true", "--xla_gpu_autotune_level=0"):
            if flag.split("=")[0] not in flags:
                flags = f"{flags} {flag}".strip()
        os.environ["XLA_FLAGS"] = flags


_float32_matmuls_on_gpus()

@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drop XLA executables after each test module. One pytest process compiles hundreds of programs;
    keeping them all alive has crashed XLA:CPU's compiler (a segfault late in the run)."""
    yield
    import gc

    import jax

    from moejax.runtime import decode

    decode.clear_programs()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def hf_model() -> Callable[[str], HFModel]:
    """``hf_model(name)`` -> HFModel (folder + torch model), built and saved once per session."""
    return get_hf_model


@pytest.fixture(scope="session")
def moejax_model() -> Callable[[str], Any]:
    """``moejax_model(name)`` -> ``moejax.Model`` loaded from the saved HF folder, once per session."""
    return get_moejax_model


# ------------------------------------------------------------------- order of the files (CI's scheduling)
def pytest_collection_modifyitems(config, items):
    """The heaviest files first (``FILE_SECONDS`` + ``QUICK_TEST_SECONDS`` a test), each file's tests in their own
    order. ``.ci/run`` gives the two xdist workers whole files (``--dist loadfile --no-loadscope-reorder``): a
    file's models, servers and compiled programs are then made by one worker instead of both (the main pass's CPU
    time: 1,900 s against 2,160 s), and handing out the long files first keeps the run from ending with one worker
    on a long file while the other waits."""
    heaviest_files_first(items)


def pytest_collection_finish(session):
    """The test processes collect cycles as the commands do (``collector.for_compiling``), in each xdist worker
    too: with the default thresholds, full collections of a worker's growing heap made the main pass 832-833 s
    instead of 766-807 s (``.ci/run``'s main pass, two back-to-back pairs, AMD EPYC, 2 cores).
    ``_free_compiled_programs`` still collects in full after every module."""
    from moejax.base import collector

    collector.for_compiling()


# ------------------------------------------------------------------- parity report (terminal summary)
PARITY_ERRORS: dict[str, dict[str, float]] = {}


def record_parity(family: str, what: str, err: float) -> None:
    """Remember the largest error seen per family and quantity; printed at the end of the run."""
    fam = PARITY_ERRORS.setdefault(family, {})
    fam[what] = max(fam.get(what, 0.0), float(err))


def pytest_terminal_summary(terminalreporter):
    if not PARITY_ERRORS:
        return
    terminalreporter.section("moejax vs Hugging Face: max abs error per family (fp32)")
    for family in sorted(PARITY_ERRORS):
        errs = PARITY_ERRORS[family]
        terminalreporter.write_line(f"{family:12s} " + "  ".join(f"{k}={v:.2e}" for k, v in sorted(errs.items())))


# ------------------------------------------------------------------- failures as they happen
FAILURE_LOG_ENV = "MOEJAX_TEST_FAILURE_LOG"


def pytest_runtest_logreport(report):
    """With ``MOEJAX_TEST_FAILURE_LOG=FILE``, append each failure's traceback to FILE the moment it is reported
    (pytest prints them only at the end of the run). A device call's time box kills the suite before that
    end: a partial run on an H200 cut off so left 74 failures and not one traceback. Runs in the process that
    collects the reports (xdist's controller), so one writer."""
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
