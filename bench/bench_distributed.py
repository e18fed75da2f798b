"""Sweeps over devices and the communication of expert sharding — ``moejax.base.distributed``.

    python bench/bench_distributed.py [--devices 1,2,4] [--points 16] [--max-tokens 2046] [--out bench/results/distributed.json]

1. **Sweep scaling.** A ``--points``-point λ sweep (cache-prior, per-layer LRU at N/2) of the default model in
   float32 over the first ``--max-tokens`` WikiText-2 test tokens, on 1, 2, 4, ... devices made with
   ``XLA_FLAGS=--xla_force_host_platform_device_count`` (one fresh process per count; one point per device
   per pass). The sweep runs twice in the process; the second run is timed (the first compiles). On a CPU
   those "devices" share the machine's cores, so this shows the overhead and the scaling law, not a speed-up
   a real multi-device machine would give.
2. **Communication of expert sharding.** The default model's teacher-forced forward (float32) with its
   experts split over D devices (``moejax.load(..., shard="experts")``), compiled for T = 1 and T = 256
   tokens: the collectives in the optimised HLO and the bytes they reduce, per token and MoE layer, against
   what the scheme implies (one all-reduce of the layer's [T, d_model] float32 output: 4·d_model bytes per
   token, of which a ring moves 2(D−1)/D per device).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# the tree this script is in, last: the results are written with moejax's atomic writer at the end, and a moejax that
# only the workers' working directory provides would lose them
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py)

common.score_the_shipped_wikitext()

WORKER = r"""
import json, sys, time
import jax, jax.numpy as jnp
import numpy as np
import moejax
from moejax.base import distributed
from moejax.evaluation import perplexity, sweep, sweep_points
from moejax.experts import routing
from moejax.runtime import simulate
points, max_tokens = int(sys.argv[1]), int(sys.argv[2])
model = moejax.load("default", dtype=jnp.float32)
mesh = distributed.points_mesh()
grid = np.linspace(0, 1, points).tolist()
pts = [sweep_points.make_point(model, "default@float32", max_tokens=max_tokens, routing=sweep_points.routing_record("cache-prior", 4, lam=l),
                               policy=routing.make_policy("cache-prior", 4, lam=l), cache=simulate.CacheConfig(size="0.5"),
                               sweep={"lam": l}) for l in grid]
runner = sweep.Runner(model, batch_size=1, progress=False, load_text=perplexity.load_wikitext, mesh=mesh)
t0 = time.perf_counter(); first = runner.run(pts); t1 = time.perf_counter()
runner = sweep.Runner(model, batch_size=1, progress=False, load_text=perplexity.load_wikitext, mesh=mesh)
second = runner.run(pts); t2 = time.perf_counter()
out = {"devices": jax.device_count(), "points": points, "first_s": t1 - t0, "second_s": t2 - t1,
       "miss_rates": [r["miss_rate"] for r in second], "ppl": [r["ppl"] for r in second]}
print(json.dumps(out))
"""

HLO_WORKER = r"""
import json, re, sys
import jax, jax.numpy as jnp
import numpy as np
import moejax
from moejax.models import model as M
sh = moejax.load("default", dtype=jnp.float32, shard="experts", layout="canonical")
cfg = sh.cfg
out = {"devices": jax.device_count(), "d_model": cfg.hidden_size, "moe_layers": cfg.n_moe_layers, "by_tokens": {}}
for T in (1, 256):
    ids = jnp.zeros((T,), jnp.int32)
    hlo = jax.jit(lambda p, t: M.forward(p, cfg, t).logits).lower(sh.params, ids).compile().as_text()
    ops = {}
    for line in hlo.splitlines():
        m = re.search(r"=\s*\(?([a-z0-9]+)\[([\d,]*)\][^=]*?\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line)
        if not m:
            continue
        dtype, dims, op = m.group(1), m.group(2), m.group(3)
        size = int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * {"f32": 4, "bf16": 2, "s32": 4, "pred": 1}.get(dtype, 4)
        o = ops.setdefault(op, {"count": 0, "bytes": 0})
        o["count"] += 1
        o["bytes"] += size
    out["by_tokens"][str(T)] = ops
print(json.dumps(out))
"""


def run(code: str, args: list[str], devices: int, timeout: float) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        return {"devices": devices, "error": p.stderr.strip().splitlines()[-3:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="1,2,4")
    ap.add_argument("--points", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=2046)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench/results/distributed.json")
    args = ap.parse_args(argv)
    counts = [int(d) for d in args.devices.split(",")]
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    print(f"machine: {cpu}, {os.cpu_count()} cores")
    results = {"machine": cpu, "cores": os.cpu_count(), "settings": vars(args), "sweeps": [], "expert_sharding": []}
    base = None
    for d in counts:
        r = run(WORKER, [str(args.points), str(args.max_tokens)], d, args.timeout)
        results["sweeps"].append(r)
        if "error" in r:
            print(f"{d} device(s): FAILED {r['error']}")
            continue
        base = base or r
        same = r["miss_rates"] == base["miss_rates"] and r["ppl"] == base["ppl"]
        print(f"sweep, {d} device(s): {args.points} points in {r['second_s']:.1f} s = {args.points / r['second_s']:.2f} "
              f"points/s (first run, compiling: {r['first_s']:.1f} s); records equal to 1 device: {same}")
    for d in counts:
        if d == 1:
            continue
        r = run(HLO_WORKER, [], d, args.timeout)
        results["expert_sharding"].append(r)
        if "error" in r:
            print(f"expert sharding over {d}: FAILED {r['error']}")
            continue
        per_token_layer = 4 * r["d_model"]
        for T, ops in r["by_tokens"].items():
            desc = ", ".join(f"{o['count']} {op} ({o['bytes'] / 1024:.1f} KiB)" for op, o in ops.items()) or "none"
            ar = ops.get("all-reduce", {"bytes": 0})["bytes"]
            measured = ar / int(T) / r["moe_layers"]
            print(f"expert sharding over {d} devices, T = {T}: {desc}; all-reduced bytes per token and MoE layer "
                  f"{measured:.0f} (scheme: {per_token_layer}; a ring moves {2 * (d - 1) / d * per_token_layer:.0f} "
                  f"per device)")
    if args.out:
        from moejax.base import atomic  # the parent process never imports jax
        atomic.write_json(args.out, results, indent=1, sort_keys=False, make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
