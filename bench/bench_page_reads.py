"""How fast can expert pages come out of a checkpoint's files? The read strategies a flash store could use,
on the routed experts of a few layers, page cache dropped first, optionally under a memory budget.

    python bench/bench_page_reads.py --model /work/scale/qwen [--layers 0:4] [--budget-gb 1.5]
        [--modes mmap-random,mmap-willneed,mmap,pread,pread-random,direct]

Each mode runs in a fresh process (``bench/memlimit.py``: its own cgroup when ``--budget-gb`` is given) and
copies every expert tensor of the layers into a private host buffer, one after another, as paging does:

- ``mmap-random``: the mapping with readahead off (``MADV_RANDOM``), faulted in by the copy;
- ``mmap-willneed``: the same, each tensor asked for with ``MADV_WILLNEED`` just before its copy and dropped
  (``MADV_DONTNEED``) after it (moejax's flash store before ``SafetensorsFile.read``);
- ``mmap``: the mapping with the kernel's default readahead;
- ``pread``: ``os.preadv`` of exactly the tensor's bytes into a new buffer;
- ``pread-random``: the same with readahead off (``POSIX_FADV_RANDOM``: what ``SafetensorsFile.read`` does, so
  it reads no byte of the next expert);
- ``direct``: ``O_DIRECT`` reads of the page-aligned range (no page cache at all).

Prints GB/s and the bytes the process read from storage (``/proc/self/io``). Needs root (dropping caches).
"""

from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = ("mmap-random", "mmap-willneed", "mmap", "pread", "pread-random", "direct")


def expert_ranges(folder: str, layers: range) -> list[tuple[str, int, int]]:
    """(file, offset, size) of every routed-expert tensor of ``layers`` in a Hugging Face folder."""
    from moejax.models.safetensors_io import SafetensorsFile

    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        f = SafetensorsFile(path)
        for key in f.keys():
            if any(f"layers.{i}." in key for i in layers) and ".experts." in key:
                start, end = f.byte_range(key)
                out.append((path, start, end - start))
    return sorted(out, key=lambda r: (r[0], r[1]))


def read_all(mode: str, ranges) -> dict:
    import numpy as np

    fds, maps, total = {}, {}, 0
    t0 = time.perf_counter()
    for path, off, size in ranges:
        if mode.startswith("pread") or mode == "direct":
            direct = mode == "direct"
            if (path, direct) not in fds:
                fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
                if mode == "pread-random":
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                fds[path, direct] = fd
            fd = fds[path, direct]
            if direct:  # O_DIRECT wants page-aligned offsets, lengths and memory
                lo, hi = off - off % 4096, -(-(off + size) // 4096) * 4096
                raw = mmap.mmap(-1, hi - lo)
                os.preadv(fd, [raw], lo)
                np.frombuffer(raw, np.uint8, size, off - lo).copy()
                raw.close()
            else:
                os.preadv(fd, [np.empty(size, np.uint8)], off)
        else:
            if path not in maps:
                with open(path, "rb") as f:
                    maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if mode != "mmap":
                    maps[path].madvise(mmap.MADV_RANDOM)
            m = maps[path]
            lo = off - off % mmap.PAGESIZE
            if mode == "mmap-willneed":
                m.madvise(mmap.MADV_WILLNEED, lo, size + off - lo)
            np.frombuffer(m, np.uint8, size, off).copy()
            if mode == "mmap-willneed":
                m.madvise(mmap.MADV_DONTNEED, lo, size + off - lo)
        total += size
    seconds = time.perf_counter() - t0
    with open("/proc/self/io") as f:
        io = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return {"mode": mode, "bytes": total, "seconds": seconds, "gb_per_s": total / seconds / 1e9,
            "storage_read_bytes": io["read_bytes"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face folder (hub layout)")
    p.add_argument("--layers", default="0:4", help="first:last (exclusive) decoder layers")
    p.add_argument("--budget-gb", type=float, default=0.0, help="memory budget of each run in GiB (0: none)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child run: this mode only, JSON out
    args = p.parse_args(argv)
    a, b = (int(x) for x in args.layers.split(":"))
    ranges = expert_ranges(args.model, range(a, b))
    if not ranges:
        print(f"error: no routed-expert tensors of layers {args.layers} in {args.model}", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(read_all(args.one, ranges)))
        return 0
    import memlimit

    budget = int(args.budget_gb * (1 << 30)) or None
    for mode in args.modes.split(","):
        if mode not in MODES:
            print(f"error: unknown mode {mode!r}; expected some of {', '.join(MODES)}", file=sys.stderr)
            return 2
        cmd = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--layers", args.layers, "--one", mode]
        r = memlimit.run_measured(cmd, limit_bytes=budget, drop_caches=True)
        if r["returncode"] != 0:
            print(f"{mode:14s} failed: {(r['stderr'] or '').strip().splitlines()[-1:]}")
            continue
        row = json.loads(r["stdout"])
        print(f"{mode:14s} {row['bytes'] / 1e9:.2f} GB in {row['seconds']:.2f} s = {row['gb_per_s']:.2f} GB/s, "
              f"read from storage {row['storage_read_bytes'] / 1e9:.2f} GB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
