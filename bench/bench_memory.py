"""Memory bounds of loading, offloading and converting a model, measured (peak RSS of a fresh process each).

    python bench/bench_memory.py --model /work/scale/olmoe [--convert-to /work/scale/olmoe-mj] [--out FILE]

Bounds checked (GB = 2**30 bytes here):

- ``moejax.load(path)`` (everything on the device; CPU: host memory)   ≤ model bytes + 1.5 GB (no second copy)
- ``generate --offload --expert-store host``                           ≤ all weights once + 1.5 GB
  (+ the cache slots on a CPU, where "device" memory is the same host memory)
- ``generate --offload --expert-store flash``                          ≤ non-expert + slots + KV + 1.5 GB
- ``python -m moejax.convert hf-to-moejax``                            ≤ largest stacked tensor + 1.5 GB

Each runs after dropping the page cache, without a memory budget (``bench/memlimit.py``; root needed for
dropping caches). The converted folder is removed again unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(HERE))

import memlimit  # noqa: E402

GiB = 1 << 30
SLACK = 1.5 * GiB


def sizes(model: str) -> dict:
    """Model bytes, routed-expert bytes and the largest stacked expert tensor, from the folder's headers."""
    from moejax.models import checkpoint, weights

    tree, cfg = checkpoint.open_params(model)
    leaves = weights.leaves(tree)
    stacks = [x for x in leaves if isinstance(x, weights.ExpertStack)]
    return {"model_bytes": sum(x.nbytes for x in leaves), "expert_bytes": sum(x.nbytes for x in stacks),
            "largest_stack_bytes": max(x.nbytes for x in stacks), "n_experts": cfg.n_experts}


def _cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def run(name: str, cmd: list[str], bound, timeout: float) -> dict:
    """One fresh measured process; ``bound``: bytes, or a function of the offload accounting (generate)."""
    m = memlimit.run_measured(cmd, drop_caches=True, timeout=timeout)
    row = {"case": name, "command": " ".join(cmd), "returncode": m["returncode"], "wall_s": m["wall_s"],
           "peak_rss_bytes": m["peak_rss_bytes"]}
    if m["returncode"] != 0:
        row["error"] = (m["stderr"] or "").strip().splitlines()[-3:]
    elif name.startswith("generate"):
        row["accounted"] = json.loads(m["stdout"])["stats"]["offload"]["device_memory"]
    if callable(bound):
        bound, row["bound_rule"] = bound(row.get("accounted")) if "accounted" in row else (float("nan"), "n/a")
    row["bound_bytes"] = bound
    row["within_bound"] = m["returncode"] == 0 and m["peak_rss_bytes"] <= bound
    print(f"{name:28s} peak RSS {row['peak_rss_bytes'] / GiB:6.2f} GiB  bound {bound / GiB:6.2f} GiB  "
          f"{'OK' if row['within_bound'] else 'OVER' if m['returncode'] == 0 else 'FAILED'}  ({m['wall_s']:.0f} s)"
          + (f"  [{row['bound_rule']}]" if "bound_rule" in row else ""), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--convert-to", default=None, help="where the conversion writes (default: skip it)")
    p.add_argument("--keep", action="store_true", help="keep the converted folder")
    p.add_argument("--cache-size", default="0.25")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    s = sizes(args.model)
    print(f"model {args.model}: {s['model_bytes'] / GiB:.2f} GiB, experts {s['expert_bytes'] / GiB:.2f} GiB, "
          f"largest stack {s['largest_stack_bytes'] / GiB:.3f} GiB")
    py = sys.executable
    gen = [py, "-m", "moejax.generate", "--model", args.model, "--prompt-ids", "11,12,13,14", "--max-new-tokens",
           "4", "--ignore-eos", "--offload", "--cache-size", args.cache_size, "--json"]
    rows = [run("load (no offload)", [py, "-c", f"import moejax; moejax.load({args.model!r})"],
                s["model_bytes"] + SLACK, args.timeout)]
    cpu = _cpu()

    def host_bound(acc):  # on a CPU the "device" slots live in the same host memory as the experts
        extra = acc["slots"] if cpu else 0
        return s["model_bytes"] + extra + SLACK, "all weights once" + (" + slots (CPU)" if cpu else "") + " + 1.5 GiB"

    def flash_bound(acc):
        return (acc["non_expert_weights"] + acc["slots"] + acc["kv_cache"] + SLACK,
                "non-expert + slots + KV + 1.5 GiB")

    host = run("generate --expert-store host", gen + ["--expert-store", "host"], host_bound, args.timeout)
    rows.append(host)
    flash = run("generate --expert-store flash", gen + ["--expert-store", "flash"], flash_bound, args.timeout)
    rows.append(flash)
    if args.convert_to:
        if os.path.exists(args.convert_to):
            print(f"error: {args.convert_to} exists", file=sys.stderr)
            return 2
        rows.append(run("convert hf-to-moejax", [py, "-m", "moejax.convert", "hf-to-moejax", args.model,
                                                 args.convert_to], s["largest_stack_bytes"] + SLACK, args.timeout))
        if not args.keep:
            shutil.rmtree(args.convert_to, ignore_errors=True)
    if args.out:
        from moejax.base import atomic  # imported late, like moejax itself here
        atomic.write_json(args.out, {"model": args.model, **s, "rows": rows,
                                     "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                          indent=1, sort_keys=False, make_parents=True)
    return 0 if all(r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
