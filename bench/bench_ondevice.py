"""The paper's on-device setting on this machine: a model larger than memory, decoded under a memory budget.

    python bench/bench_ondevice.py --model /work/scale/qwen --budget-gb 12 --sizes 8,4,2 \
        --routings original,cache-prior [--new-tokens 8] [--prompt-len 8] [--prefills batched,token] \
        [--overlaps on,off] \
        [--llama-cpp [--llama-cpp-prompt]] [--out bench/results/ondevice-qwen.json]

Each configuration runs ``python -m moejax.generate --offload --expert-store flash`` in a fresh process inside
a cgroup-v1 memory cgroup of ``--budget-gb`` (created and removed by ``bench/memlimit.py``; the page cache is
charged to it, so expert pages that do not fit really come from storage), after dropping the page cache.
Reported per run: load time, time to first token, decode tokens/s, expert bytes requested per decode token
(what the cache asked for), bytes actually read from storage per decode token (``/proc/self/io``
``read_bytes`` inside the process, decode phase only), peak RSS (rusage) against its bound
(non-expert weights + cache slots + KV cache + 1.5 GB), and the miss rate. ``--sizes 8,4,2`` means C = N/8,
N/4, N/2 per layer; ``--prefills batched,token`` runs each configuration with both ways of paging the prompt
(time to first token side by side); ``--overlaps on,off`` with and without computing a step's resident experts
while its misses are read (``generate --overlap``). ``--budget-gb 0`` runs without a budget. With ``--llama-cpp`` the same folder is
converted to a bf16 GGUF (once) and ``llama-bench`` runs under the same budget (``bench/llamacpp.py``;
skipped with a message when llama.cpp is not built). Needs root for the cgroup and for dropping caches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(HERE))

import memlimit  # noqa: E402
from moejax.models.config import from_hf  # noqa: E402

GiB = 1 << 30


def model_config(folder: str) -> dict:
    """The HF config of a Hugging Face folder (config.json) or a moejax one (moejax.json's hf_config)."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    with open(os.path.join(folder, "moejax.json")) as f:
        return json.load(f)["hf_config"]


def n_experts(cfg: dict) -> int:
    """The routed experts per MoE layer, as moejax reads the config (each family spells the count its own way)."""
    return from_hf(cfg).n_experts


def moejax_run(model: str, size: int, routing: str, budget: int | None, prompt: list[int], new_tokens: int,
               lam: float, dtype: str | None, timeout: float, temperature: float = 0.0, seed: int = 0,
               expert_dtype: str | None = None, weight_dtype: str | None = None, prefill: str = "batched",
               overlap: str = "on") -> dict:
    cmd = [sys.executable, "-m", "moejax.generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)),
           "--max-new-tokens", str(new_tokens), "--ignore-eos", "--offload", "--expert-store", "flash",
           "--cache-size", str(size), "--routing", routing, "--prefill", prefill, "--overlap", overlap, "--json"]
    if routing == "cache-prior":
        cmd += ["--lam", str(lam)]
    if dtype:
        cmd += ["--dtype", dtype]
    if temperature > 0:
        cmd += ["--temperature", str(temperature), "--seed", str(seed)]
    if expert_dtype:
        cmd += ["--expert-dtype", expert_dtype]
    if weight_dtype:
        cmd += ["--weight-dtype", weight_dtype]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    m = memlimit.run_measured(cmd, limit_bytes=budget, env=env, drop_caches=True, timeout=timeout)
    row = {"engine": "moejax", "routing": routing, "capacity": size, "budget_bytes": budget, "prefill": prefill,
           "overlap": overlap,
           "prompt_tokens": len(prompt),
           "expert_dtype": expert_dtype or "stored", "weight_dtype": weight_dtype or "stored",
           "returncode": m["returncode"], "wall_s": m["wall_s"], "peak_rss_bytes": m["peak_rss_bytes"],
           "process_read_bytes": m["read_bytes"], "cgroup_peak_bytes": m.get("cgroup_peak_bytes"),
           "oom_killed": m.get("oom_killed"), "command": " ".join(cmd)}
    if m["returncode"] != 0:
        row["error"] = (m["stderr"] or "").strip().splitlines()[-3:]
        return row
    out = json.loads(m["stdout"])
    s, off, cache = out["stats"], out["stats"]["offload"], out["stats"]["cache"]
    mem = off["device_memory"]
    bound = mem["non_expert_weights"] + mem["slots"] + mem["kv_cache"] + 1.5 * GiB
    row.update(
        load_s=s["load_time_s"], ttft_s=s["time_to_first_token_s"], compile_s=s["compile_time_s"],
        decode_tokens_per_s=s["tokens_per_s"], generated=s["generated_tokens"],
        expert_bytes_per_decode_token=off["bytes_per_decode_token"],
        storage_read_per_decode_token=off.get("storage_read_per_decode_token"),
        storage_read_prefill=off.get("storage_read_bytes_prefill"), expert_bytes_prefill=off["bytes_moved_prefill"],
        miss_rate=cache["miss_rate"], overlapped_steps=off.get("overlapped_steps"),
        non_expert_bytes=mem["non_expert_weights"], slot_bytes=mem["slots"],
        kv_bytes=mem["kv_cache"], rss_bound_bytes=bound, rss_within_bound=m["peak_rss_bytes"] <= bound,
        all_expert_bytes=mem["all_experts_on_host"])
    return row


def llama_run(model: str, gguf: str | None, budget: int | None, new_tokens: int, prompt_tokens: int = 0) -> dict:
    import llamacpp

    if llamacpp.find_llama_cpp() is None:
        return {"engine": "llama.cpp", "skipped": "llama.cpp is not built (see bench/llamacpp.py: "
                                                  "python bench/llamacpp.py --help)"}
    gguf = gguf or os.path.join(os.path.dirname(os.path.abspath(model)),
                                os.path.basename(os.path.abspath(model)) + ".bf16.gguf")
    llamacpp.ensure_tokenizer(model)
    llamacpp.convert_to_gguf(model, gguf)
    r = llamacpp.bench(gguf, threads=2, n_gen=new_tokens, n_prompt=prompt_tokens, limit_bytes=budget, drop_caches=True)
    return {"engine": "llama.cpp", "budget_bytes": budget, **r}


def fmt(row: dict) -> str:
    if row.get("skipped"):
        return f"{row['engine']:9s} skipped: {row['skipped']}"
    if row["engine"] == "llama.cpp":
        pp = row.get("pp_tokens_per_s")
        prompt = (f"prompt {row['n_prompt']} tokens at {pp:.2f} tok/s (= {row['n_prompt'] / pp:.1f} s)  "
                  if pp else "")
        return (f"llama.cpp  {prompt}decode {row.get('tg_tokens_per_s') or 0:.3f} tok/s  peak RSS "
                f"{(row.get('peak_rss_bytes') or 0) / GiB:.2f} GiB  storage read/token "
                f"{(row.get('read_bytes_after_load_per_token') or 0) / 1e6:.0f} MB (after the load's pass)")
    if row["returncode"] != 0:
        return (f"moejax {row['routing']:11s} C={row['capacity']:3d}  FAILED rc={row['returncode']} "
                f"oom={row.get('oom_killed')} {row.get('error')}")
    return (f"moejax {row['routing']:11s} C={row['capacity']:3d} {row.get('expert_dtype', 'stored'):6s} weights "
            f"{row.get('weight_dtype', 'stored'):6s} overlap {row.get('overlap', 'on'):3s} load {row['load_s']:.1f}s  "
            f"prefill {row['prefill']:7s} ttft "
            f"{row['ttft_s']:.1f}s ({row['prompt_tokens']} tokens; prompt pages {row['expert_bytes_prefill'] / 1e9:.2f} GB, "
            f"storage {(row['storage_read_prefill'] or 0) / 1e9:.2f} GB)  "
            f"decode {row['decode_tokens_per_s']:.3f} tok/s  miss {row['miss_rate']:.3f}  requested "
            f"{row['expert_bytes_per_decode_token'] / 1e6:.0f} MB/tok  storage "
            f"{(row['storage_read_per_decode_token'] or 0) / 1e6:.0f} MB/tok  peak RSS "
            f"{row['peak_rss_bytes'] / GiB:.2f} GiB (bound {row['rss_bound_bytes'] / GiB:.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face or moejax folder (e.g. a random checkpoint)")
    p.add_argument("--budget-gb", type=float, default=12.0, help="memory budget in GiB (0: none)")
    p.add_argument("--sizes", default="8,4,2", help="cache sizes as divisors of N (C = N/8, N/4, N/2)")
    p.add_argument("--routings", default="original,cache-prior")
    p.add_argument("--lam", type=float, default=0.5)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--dtype", default=None, help="compute dtype (default: the checkpoint's)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy; random weights decode greedily into repeats, "
                        "which flatters original routing's reuse)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expert-dtype", choices=("stored", "int8"), default=None,
                   help="int8: int8 device slots (each page quantised as it arrives: twice the experts per byte)")
    p.add_argument("--weight-dtype", choices=("stored", "int8"), default=None,
                   help="int8: every other matrix (attention, shared experts, LM head) int8 too, quantised on load")
    p.add_argument("--prefills", default="batched",
                   help="comma list of --prefill modes to run (batched: a layer at a time; token: token by token)")
    p.add_argument("--overlaps", default="on",
                   help="on,off: each configuration with and without computing while the misses are read")
    p.add_argument("--llama-cpp-prompt", action="store_true",
                   help="also time llama.cpp's prompt processing of --prompt-len tokens (llama-bench -p)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp on the same weights")
    p.add_argument("--gguf", default=None, help="the GGUF to use/write (default: beside the model folder)")
    p.add_argument("--out", default=None, help="write every row as JSON here")
    args = p.parse_args(argv)
    ok, why = memlimit.cgroup_v1_memory_available()
    budget = int(args.budget_gb * GiB) if args.budget_gb > 0 else None
    if budget and not ok:
        print(f"error: no memory budget possible here: {why}", file=sys.stderr)
        return 2
    n = n_experts(model_config(args.model))
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(args.prompt_len)]
    rows = []
    print(f"model {args.model}: N={n}, budget {args.budget_gb:g} GiB, {args.new_tokens} new tokens")
    for div in (int(x) for x in args.sizes.split(",")):
        for routing in args.routings.split(","):
            for prefill in args.prefills.split(","):
                for overlap in args.overlaps.split(","):
                    row = moejax_run(args.model, max(n // div, 1), routing, budget, prompt, args.new_tokens, args.lam,
                                     args.dtype, args.timeout, args.temperature, args.seed, args.expert_dtype,
                                     args.weight_dtype, prefill, overlap)
                    row["size"] = f"N/{div}"
                    rows.append(row)
                    print(fmt(row), flush=True)
    if args.llama_cpp:
        row = llama_run(args.model, args.gguf, budget, args.new_tokens, args.prompt_len if args.llama_cpp_prompt else 0)
        rows.append(row)
        print(fmt(row), flush=True)
    if args.out:
        from moejax.base import atomic  # imported late, like moejax itself here
        atomic.write_json(args.out, {"model": os.path.abspath(args.model), "budget_gb": args.budget_gb, "rows": rows,
                                     "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                          indent=1, sort_keys=False, make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
