"""How much more host memory this process may take before something kills it.

Two limits apply on Linux: the machine's (``MemAvailable`` of ``/proc/meminfo``: free memory plus what the
kernel can reclaim) and every memory cgroup the process is in (v1 ``memory.limit_in_bytes``, v2
``memory.max``, on the process's own cgroup and each ancestor: a phone-sized budget, a container). A cgroup's
headroom is its limit less what it holds that reclaim cannot take back: anonymous memory, shared memory and
mapped file pages (the programs' own code among them); unmapped page cache is reclaimable and not counted.
The smallest headroom wins. Nothing here allocates; a file that cannot be read means that limit is unknown.
"""

from __future__ import annotations

import os

CGROUP_ROOT = "/sys/fs/cgroup"
UNLIMITED = 1 << 60  # v1 writes "no limit" as a page-rounded 2**63 - 1


def format_bytes(n: int) -> str:
    """``n`` bytes for a message, in decimal units: "512 B", "3.4 kB", "12.6 MB", "1.25 GB"."""
    n = int(n)
    if abs(n) < 1000:
        return f"{n} B"
    for unit, size in (("kB", 1e3), ("MB", 1e6)):
        if abs(n) < 1000 * size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e9:.2f} GB"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str) -> dict[str, int]:
    text = _read(path) or ""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def meminfo_available(path: str = "/proc/meminfo", key: str = "MemAvailable") -> int | None:
    """``MemAvailable`` (or another ``key`` of ``/proc/meminfo``, e.g. ``SwapFree``) in bytes, or None."""
    for line in (_read(path) or "").splitlines():
        if line.startswith(key + ":"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                return int(parts[1]) * 1024
    return None


def _ancestors(folder: str, root: str) -> list[str]:
    """``folder`` and each parent up to (and including) ``root``."""
    out = []
    folder = os.path.normpath(folder)
    root = os.path.normpath(root)
    while folder.startswith(root):
        out.append(folder)
        if folder == root:
            break
        folder = os.path.dirname(folder)
    return out


def cgroup_headrooms(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> list[tuple[str, int, int]]:
    """``(folder, limit, headroom)`` of every memory cgroup with a limit that holds this process."""
    out = []
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if "memory" in controllers.split(","):  # v1
            base = os.path.join(root, "memory")
            for folder in _ancestors(os.path.join(base, rel.lstrip("/")), base):
                limit = _read(os.path.join(folder, "memory.limit_in_bytes"))
                if limit is None or not limit.isdigit() or int(limit) >= UNLIMITED:
                    continue
                st = _stat(os.path.join(folder, "memory.stat"))
                held = sum(st.get(k, 0) for k in ("total_rss", "total_shmem", "total_mapped_file"))
                out.append((folder, int(limit), int(limit) - held))
        elif controllers == "" and os.path.isfile(os.path.join(root, "cgroup.controllers")):  # v2, unified
            for folder in _ancestors(os.path.join(root, rel.lstrip("/")), root):
                limit = _read(os.path.join(folder, "memory.max"))
                if limit is None or not limit.isdigit():
                    continue  # "max" or no memory controller here
                st = _stat(os.path.join(folder, "memory.stat"))
                held = sum(st.get(k, 0) for k in ("anon", "shmem", "file_mapped"))
                out.append((folder, int(limit), int(limit) - held))
    return out


def headroom(swap: bool = False) -> tuple[int, str] | None:
    """The most host memory this process can still allocate — the smaller of the machine's available memory
    and every limiting cgroup's headroom — and which limit that is, in words; None when neither is known.
    ``swap``: the machine's free swap counts too (what a process can hold without being killed, however slowly;
    a plan for speed leaves it out)."""
    candidates = [(h, f"the memory cgroup {folder} (limit {limit / 2**30:.1f} GiB)")
                  for folder, limit, h in cgroup_headrooms()]
    machine = meminfo_available()
    if machine is not None:
        swap_free = (meminfo_available(key="SwapFree") or 0) if swap else 0
        candidates.append((machine + swap_free, "the machine's available memory" + (", free swap included"
                                                                                     if swap_free else "")))
    if not candidates:
        return None
    free, where = min(candidates)
    return max(0, free), where
