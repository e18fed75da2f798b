"""Runs sharing one results file: one ``evaluate --sweep`` alone vs R copies of it started together.

    python bench/bench_shared_results.py [--model default] [--runs 2] [--points 8] [--max-tokens 4096]
        [--context 1024] [--out bench/results/shared_results.json]

Each run is a real ``python -m moejax.evaluate`` process over the same cache-prior λ sweep (``--points``
values of λ in [0, 1], C = N/2, LRU). Printed: the wall time of the run alone; of the R runs together (first
start to last exit); how many points each computed and how many it took from the others (its stderr
line); whether the shared file holds every point exactly once; and whether every record (perplexity, miss
rate) equals the lone run's. Exit status 1 if a point was computed twice or a record differs.

On a machine with one accelerator per run the R runs should take about 1/R of the lone run; on a CPU the
runs share its cores, and the figure to read is the work: R runs compute the sweep once, not R times.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(HERE))

COUNTS = re.compile(r"(\d+) point\(s\) computed(?:, (\d+) by another run sharing it)?, (\d+) already in")


def command(args, results: str) -> list[str]:
    return [sys.executable, "-m", "moejax.evaluate", "--model", args.model, "--routing", "cache-prior",
            "--sweep", f"lam=0:1:{args.points}", "--cache-size", "0.5", "--max-tokens", str(args.max_tokens),
            "--context", str(args.context), "--batch-size", "1", "--results", results, "--no-progress"]


def launch(args, results: str, n: int) -> tuple[float, list[dict]]:
    """Start ``n`` runs on one results file together; (wall seconds, each run's counts)."""
    start = time.perf_counter()
    procs = [subprocess.Popen(command(args, results), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    runs = []
    for p in procs:
        err = p.communicate()[1]
        if p.returncode != 0:
            raise SystemExit(f"a run failed ({p.returncode}):\n{err[-2000:]}")
        m = COUNTS.search(err)
        runs.append({"computed": int(m.group(1)), "from_other_runs": int(m.group(2) or 0),
                     "already_there": int(m.group(3))})
    return time.perf_counter() - start, runs


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--points", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "shared_results.json"))
    args = ap.parse_args(argv)
    from moejax.base import atomic

    with tempfile.TemporaryDirectory(prefix="shared-results-") as tmp:
        alone_path, shared_path = os.path.join(tmp, "alone.jsonl"), os.path.join(tmp, "shared.jsonl")
        alone_s, alone = launch(args, alone_path, 1)
        print(f"1 run alone: {alone_s:.1f} s, {alone[0]['computed']} points computed")
        shared_s, runs = launch(args, shared_path, args.runs)
        for i, r in enumerate(runs):
            print(f"run {i}: computed {r['computed']}, took {r['from_other_runs']} from the other run(s)")
        print(f"{args.runs} runs together: {shared_s:.1f} s ({shared_s / alone_s:.2f}x the lone run's time)")
        keys = [r["key"] for r in records(shared_path)]
        by_key = {r["key"]: r for r in records(alone_path)}
        once = len(keys) == len(set(keys)) == args.points and sum(r["computed"] for r in runs) == args.points
        same = all({k: r[k] for k in ("ppl", "miss_rate")} == {k: by_key[r["key"]][k] for k in ("ppl", "miss_rate")}
                   for r in records(shared_path))
        print(f"every point computed once: {once}; records equal to the lone run's: {same}")
    result = {"model": args.model, "points": args.points, "max_tokens": args.max_tokens, "context": args.context,
              "alone_s": alone_s, "runs": args.runs, "together_s": shared_s, "per_run": runs,
              "every_point_once": once, "records_equal": same}
    atomic.write_json(args.out, result, make_parents=True)
    print(f"wrote {args.out}")
    return 0 if once and same else 1


if __name__ == "__main__":
    sys.exit(main())
