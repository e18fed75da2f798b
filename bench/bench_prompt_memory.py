"""What an offloaded generation's memory peaks at beyond what the fit check counts, by prompt length.

    python bench/bench_prompt_memory.py --model /big/qwen --prompts 8,512,1024,2048,4096 --cache-size 6

Each prompt length runs in a fresh process (``--one``): the model is loaded with its routed experts left in
the checkpoint (``offload="flash"``), the fit check's plan is taken, then ``model.generate`` runs the prompt
(batched, in pieces of ``prefill_paging.MAX_PIECE`` tokens) and ``--new-tokens`` decode steps while a thread
samples ``RssAnon`` of ``/proc/self/status`` every 20 ms. Printed per prompt:

- ``peak``: the highest anonymous memory seen (GiB);
- ``accounted``: non-expert weights + slots + KV cache + staging, as the run's ``stats["offload"]`` lists them;
- ``over``: peak − accounted, what ``offload.reserve_bytes`` must cover (the process's memory at the check,
  ``held``, is already outside the headroom the check measures, so it is margin on top);
- ``reserve``: ``offload.reserve_bytes(positions)`` for the run, and ``margin`` = reserve + held − over.

Anonymous memory is what a memory cgroup cannot reclaim (page cache it can), so a negative margin is an
OOM kill waiting for a budget that tight. docs/benchmarks.md#the-reserve has the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def one(model_path: str, prompt: int, cache_size: str, new_tokens: int) -> dict:
    """One measured run in this process (``--one``)."""
    import moejax
    from moejax.runtime import offload, simulate

    model = moejax.load(model_path, offload="flash")
    config = offload.OffloadConfig(store="flash")
    cache = simulate.CacheConfig(size=cache_size)
    positions = prompt + new_tokens
    model.memory_plan(model.resolve_cache(cache, config, positions), config, positions)
    held = _anon()
    peak, done = [held], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _anon())
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    ids = [3 + i % 1000 for i in range(prompt)]
    result = model.generate(ids, max_new_tokens=new_tokens, cache=cache, offload=config, stop_at_eos=False)
    done.set()
    thread.join()
    memory = result.stats["offload"]["device_memory"]
    accounted = sum(memory[k] for k in ("non_expert_weights", "slots", "kv_cache", "prefill_staging",
                                        "low_bit_staging"))
    reserve = offload.reserve_bytes(min(positions, model.cfg.max_position_embeddings), model.cfg.hidden_size)
    over, held_beyond = peak[0] - accounted, held - memory["non_expert_weights"]
    gib = 2**30
    return {"prompt": prompt, "peak": peak[0] / gib, "accounted": accounted / gib, "over": over / gib,
            "held": held_beyond / gib, "reserve": reserve / gib, "margin": (reserve + held_beyond - over) / gib,
            "ttft_s": result.stats["prefill_time_s"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a checkpoint folder (random real-shape weights will do)")
    p.add_argument("--prompts", default="8,512,1024,2048,4096", help="prompt lengths, comma-separated")
    p.add_argument("--cache-size", default="6")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child run
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.model, args.one, args.cache_size, args.new_tokens)))
        return 0
    print(f"{'prompt':>7} {'peak':>6} {'accounted':>9} {'over':>6} {'held':>6} {'reserve':>7} {'margin':>7} {'ttft s':>7}"
          "   (GiB of anonymous memory)")
    for prompt in (int(x) for x in args.prompts.split(",")):
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--cache-size", args.cache_size,
                              "--new-tokens", str(args.new_tokens), "--one", str(prompt)],
                             capture_output=True, text=True)
        if out.returncode != 0:
            print(f"{prompt:>7} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['prompt']:>7} {r['peak']:6.2f} {r['accounted']:9.2f} {r['over']:6.2f} {r['held']:6.2f} "
              f"{r['reserve']:7.2f} {r['margin']:7.2f} {r['ttft_s']:7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
