"""Many devices and many hosts through JAX's own runtime (no scheduler or sockets of our own).

One process sees ``jax.devices()``: its own, or, after ``initialize`` (``jax.distributed.initialize``), every
device of every process. moejax uses them in two ways:

- **sharded sweeps** (``sweep.Runner(mesh=...)``): the points of a vmapped batch are laid along a mesh axis
  ``"points"``; each device runs the vmapped pass on its share of the stacked router states (``shard_map``),
  parameters replicated. A batch is padded with copies of its last point to a multiple of the devices,
  never cut. Every process runs the same program (SPMD); process 0 alone reads and writes results files,
  and what it read reaches the others by ``broadcast`` (so hosts need no shared file system).
- **expert-sharded models** (``layout.ExpertShards``, ``moejax.load(..., shard="experts")``): each MoE
  layer's expert stacks are split along the expert axis of a mesh ``"experts"``; every device computes its
  own experts' share of every token and the shares are summed (``psum``); everything else is replicated.

Multi-host set-up: ``initialize()`` reads the standard variables (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``) or takes them as arguments, and on CPU selects the gloo
collectives (CPU processes on one machine or several then form one mesh). Joining waits at most
``MOEJAX_COORDINATOR_TIMEOUT`` seconds (default ``JOIN_TIMEOUT_S``) for the coordinator and the other processes,
says so on stderr, and stops at Ctrl-C or SIGTERM (see ``_join``).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.base import errors, interrupts

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
TIMEOUT_ENV = "MOEJAX_COORDINATOR_TIMEOUT"
JOIN_TIMEOUT_S = 300.0  # jax.distributed.initialize's own default
#: seconds JAX's own timeout is set past ours: its expiry aborts the process with a C++ stack, ours ends it first
JAX_TIMEOUT_MARGIN_S = 30
POINTS = "points"
EXPERTS = "experts"


def requested() -> bool:
    """True when the environment asks for a multi-process run (``JAX_COORDINATOR_ADDRESS`` is set)."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def join_timeout(timeout: float | None = None) -> float:
    """``timeout``, else ``$MOEJAX_COORDINATOR_TIMEOUT``, else ``JOIN_TIMEOUT_S``: seconds to wait for the others."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if timeout is None and text:
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={text!r}: a number of seconds") from None
    timeout = JOIN_TIMEOUT_S if timeout is None else float(timeout)
    if not 0 < timeout < 1e7:  # also refuses nan and inf
        raise ValueError(f"the coordinator timeout must be a positive number of seconds, got {timeout}")
    return timeout


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout: float | None = None) -> None:
    """Join a multi-process JAX run (arguments, else the ``JAX_*`` variables; with neither, JAX's own
    detection of a TPU slice or a Slurm / Kubernetes job). Call before any computation. An explicit
    coordinator is waited for at most ``join_timeout(timeout)`` seconds (see ``_join``).

    CPU devices use gloo's cross-process collectives (set before the backend starts)."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    try:
        if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
            num_processes = int(os.environ["JAX_NUM_PROCESSES"])
        if process_id is None and os.environ.get("JAX_PROCESS_ID"):
            process_id = int(os.environ["JAX_PROCESS_ID"])
    except ValueError:
        raise ValueError("JAX_NUM_PROCESSES and JAX_PROCESS_ID must be integers") from None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's; GPUs/TPUs keep theirs
    if coordinator is None and num_processes is None and process_id is None:
        try:
            jax.distributed.initialize()  # a TPU slice, Slurm, ...: the cluster describes itself
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"--distributed found no cluster to join ({e}); give --coordinator HOST:PORT "
                             "--num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                             "JAX_PROCESS_ID)") from None
        return
    if coordinator is None:
        raise ValueError("a distributed run needs a coordinator address: --coordinator HOST:PORT or "
                         "JAX_COORDINATOR_ADDRESS (and JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"the coordinator address must be HOST:PORT, got {coordinator!r}")
    if num_processes is None or process_id is None:
        raise ValueError("a distributed run needs the number of processes and this one's id: --num-processes "
                         "and --process-id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
    if num_processes < 1:
        raise ValueError(f"the number of processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is not in 0..{num_processes - 1}")
    _join(coordinator, num_processes, process_id, join_timeout(timeout))


def _join(coordinator: str, num_processes: int, process_id: int, timeout: float) -> None:
    """``jax.distributed.initialize`` in a helper thread, waited for by this one. JAX's wait for the others is
    one C++ call: it holds its thread past Ctrl-C and SIGTERM (Python runs handlers between bytecodes), says
    nothing, and when its own timeout passes it aborts the process with a C++ stack. Here the wait is said on
    stderr, a signal ends the process at once with its status, and at ``timeout`` one ``error:`` line does."""
    what = "the coordinator" if process_id else f"the other {num_processes - 1} process(es) to join"
    if num_processes > 1:
        print(f"moejax: process {process_id} of {num_processes}: waiting up to {timeout:g} s for {what} at "
              f"{coordinator} (Ctrl-C stops) ...", file=sys.stderr, flush=True)
    done, failed = threading.Event(), []

    def run() -> None:
        try:
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                       initialization_timeout=math.ceil(timeout) + JAX_TIMEOUT_MARGIN_S)
        except Exception as e:  # noqa: BLE001 - handed to the waiting thread
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="moejax-join", daemon=True).start()
    # the exits below skip the interpreter's teardown: the helper thread is still inside JAX's C++ wait, which
    # cannot be cancelled and would abort the process (or crash the teardown) later
    deadline = time.monotonic() + timeout
    try:
        while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                error = errors.Failure(_timed_out(coordinator, num_processes, process_id, timeout))
                interrupts.hard_exit(errors.report(error))
    except (SystemExit, KeyboardInterrupt) as e:  # a signal (``interrupts``) or Ctrl-C during the wait
        interrupts.hard_exit(e.code if isinstance(e, SystemExit) and isinstance(e.code, int)
                             else 128 + signal.SIGINT)
    if failed:
        raise errors.Failure(f"could not join the run at {coordinator}: {errors.excerpt(failed[0])}") from None


def _timed_out(coordinator: str, num_processes: int, process_id: int, timeout: float) -> str:
    if process_id:
        return (f"no coordinator answered at {coordinator} within {timeout:g} s (process {process_id} of "
                f"{num_processes}): start process 0 there, check the address, or raise {TIMEOUT_ENV}")
    return (f"the other {num_processes - 1} process(es) did not all join the coordinator at {coordinator} within "
            f"{timeout:g} s (process 0 of {num_processes}): start them, or raise {TIMEOUT_ENV}")


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def is_leader() -> bool:
    """Process 0: the one that reads and writes results files and prints."""
    return jax.process_index() == 0


def local_device():
    """This process's first device (``jax.devices()[0]`` belongs to process 0 in a multi-process run)."""
    return jax.local_devices()[0]


def points_mesh(n_devices: int | None = None) -> Mesh | None:
    """A 1-D mesh ``("points",)`` over the first ``n_devices`` devices (default all, every process's);
    None when that is a single device (nothing to spread)."""
    devices = jax.devices()
    n = len(devices) if n_devices is None else int(n_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"--devices {n_devices}: this run has {len(devices)} device(s)")
    if is_multiprocess() and n != len(devices):
        raise ValueError("a multi-process run spreads a sweep over every device of every process: drop --devices")
    return Mesh(np.array(devices[:n]), (POINTS,)) if n > 1 else None


def experts_mesh(n_devices: int | None = None) -> Mesh:
    """A 1-D mesh ``("experts",)`` over the first ``n_devices`` devices (default all)."""
    devices = jax.devices()
    n = len(devices) if n_devices is None else int(n_devices)
    if not 1 <= n <= len(devices):
        raise ValueError(f"expert sharding over {n} devices: this run has {len(devices)}")
    return Mesh(np.array(devices[:n]), (EXPERTS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else int(mesh.devices.size)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def global_array(x, sharding: NamedSharding) -> jax.Array:
    """A global array of ``sharding`` from a value every process holds whole (numpy, or a local array):
    each device gets its slice; works across processes (no collective)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not is_multiprocess():
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) global array whole on this host, as numpy."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def broadcast(value):
    """Process 0's JSON-able ``value`` on every process (the identity in a single-process run).

    Every process must call it at the same point of the program (it is a collective)."""
    if not is_multiprocess():
        return value
    from jax.experimental import multihost_utils

    payload = json.dumps(value if is_leader() else None).encode("utf-8") if is_leader() else b""
    size = multihost_utils.broadcast_one_to_all(np.asarray(len(payload), np.int64))
    buf = np.zeros(int(size), np.uint8)
    if is_leader():
        buf[:] = np.frombuffer(payload, np.uint8)
    data = multihost_utils.broadcast_one_to_all(buf)
    return json.loads(bytes(np.asarray(data, np.uint8)).decode("utf-8"))
