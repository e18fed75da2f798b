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
collectives (CPU processes on one machine or several then form one mesh).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
POINTS = "points"
EXPERTS = "experts"


def requested() -> bool:
    """True when the environment asks for a multi-process run (``JAX_COORDINATOR_ADDRESS`` is set)."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS"))


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join a multi-process JAX run (arguments, else the ``JAX_*`` variables; with neither, JAX's own
    detection of a TPU slice or a Slurm / Kubernetes job). Call before any computation.

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
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


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
