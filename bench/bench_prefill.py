"""Time to first token of an offloaded model: the prompt batched a layer at a time vs token by token, against
the same model in memory and llama.cpp's prompt processing on the same weights.

    python bench/bench_prefill.py --model /work/scale/olmoe4 [--prompts 32,256,1024] [--token-max 256]
        [--cache-size 0.25] [--routing original] [--store flash] [--llama-cpp] [--out bench/results/prefill.json]

One process, page cache warm (each configuration runs once untimed first), so this is the compute side of a
prompt: what paging costs when the bytes are in memory. The storage-bound side (a model larger than memory
under a budget, cold reads) is ``bench_ondevice.py --prompt-len N --prefills batched,token``. Rows:

- ``offload batched``: ``--offload`` with ``OffloadConfig(prefill="batched")`` (each expert a layer's tokens use
  paged once, every token of the layer at once);
- ``offload token``: ``prefill="token"`` (as decoding pages: one token at a time, every miss), only up to
  ``--token-max`` prompt tokens (it is slow);
- ``in memory``: the model loaded whole, no cache (the fastest moejax prefill: the floor for the paths above);
- ``llama.cpp``: ``llama-bench -p N`` on a bf16 GGUF of the folder (``bench/llamacpp.py``; skipped with a message
  when llama.cpp is not built). Its time to first token is N / its prompt rate.

Printed: seconds to the first token, prompt tokens/s, expert bytes paged for the prompt, and the ratios
token/batched and batched/llama.cpp measured in this run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(HERE))


def prompt_ids(n: int, vocab: int) -> list[int]:
    return [(7 * i + 3) % min(vocab, 1000) + 10 for i in range(n)]


def timed_generate(model, ids, **kw) -> dict:
    model.generate(ids, max_new_tokens=1, stop_at_eos=False, **kw)  # warm: compile, page cache
    t = time.perf_counter()
    out = model.generate(ids, max_new_tokens=1, stop_at_eos=False, **kw)
    wall = time.perf_counter() - t
    s = out.stats
    row = {"ttft_s": s["prefill_time_s"], "compile_s": s["compile_time_s"], "wall_s": wall,
           "prompt_tokens_per_s": len(ids) / s["prefill_time_s"]}
    if "offload" in s:
        row["prompt_bytes_paged"] = s["offload"]["bytes_moved_prefill"]
        row["prompt_pages"] = s["offload"]["bytes_moved_prefill"] // s["offload"]["expert_bytes"]
        row["cache_loads"] = s["cache"]["loads"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", default="32,256,1024", help="prompt lengths")
    p.add_argument("--token-max", type=int, default=256, help="longest prompt to run token by token too")
    p.add_argument("--cache-size", default="0.25")
    p.add_argument("--routing", default="original")
    p.add_argument("--store", choices=("flash", "host"), default="flash")
    p.add_argument("--no-memory", action="store_true", help="skip the in-memory row (a model larger than memory)")
    p.add_argument("--llama-cpp", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import moejax
    from moejax.runtime import offload, simulate

    lengths = [int(x) for x in args.prompts.split(",")]
    cache = simulate.CacheConfig(size=args.cache_size)
    rows = []

    def report(row):
        rows.append(row)
        extra = (f"  paged {row['prompt_bytes_paged'] / 1e9:.2f} GB ({row['prompt_pages']} experts; the cache "
                 f"loaded {row['cache_loads']})" if "prompt_bytes_paged" in row else "")
        print(f"{row['engine']:18s} prompt {row['prompt']:5d}  ttft {row['ttft_s']:8.3f} s  "
              f"{row['prompt_tokens_per_s']:8.1f} tok/s{extra}", flush=True)

    model = moejax.load(args.model, offload=args.store)
    print(f"model {args.model}: {model!r}, cache {args.cache_size} of N, routing {args.routing}, store {args.store}")
    for n in lengths:
        ids = prompt_ids(n, model.cfg.vocab_size)
        for mode in ("batched", "token"):
            if mode == "token" and n > args.token_max:
                continue
            r = timed_generate(model, ids, routing=args.routing, cache=cache,
                               offload=offload.OffloadConfig(store=args.store, prefill=mode))
            report({"engine": f"offload {mode}", "prompt": n, **r})
    del model
    if not args.no_memory:
        whole = moejax.load(args.model)
        for n in lengths:
            report({"engine": "in memory", "prompt": n, **timed_generate(whole, prompt_ids(n, whole.cfg.vocab_size))})
        del whole
    if args.llama_cpp:
        import llamacpp

        if llamacpp.find_llama_cpp() is None:
            print("llama.cpp skipped: not built (python bench/llamacpp.py --help says how)")
        else:
            llamacpp.ensure_tokenizer(args.model)
            gguf = llamacpp.default_gguf_path(args.model)
            llamacpp.convert_to_gguf(args.model, gguf)
            for n in lengths:
                r = llamacpp.bench(gguf, threads=2, n_gen=0, n_prompt=n, reps=3, drop_caches=False)
                pp = r["pp_tokens_per_s"]
                report({"engine": "llama.cpp", "prompt": n, "ttft_s": n / pp, "prompt_tokens_per_s": pp})
    print("\nratios (same run):")
    by = {(r["engine"], r["prompt"]): r["ttft_s"] for r in rows}
    for n in lengths:
        b = by.get(("offload batched", n))
        parts = []
        if ("offload token", n) in by:
            parts.append(f"token/batched {by[('offload token', n)] / b:.2f}x")
        if ("in memory", n) in by:
            parts.append(f"batched/in-memory {b / by[('in memory', n)]:.2f}x")
        if ("llama.cpp", n) in by:
            parts.append(f"batched/llama.cpp {b / by[('llama.cpp', n)]:.2f}x (TTFT; < 1 = faster)")
        print(f"  prompt {n:5d}: " + ", ".join(parts))
    if args.out:
        from moejax.base import atomic

        atomic.write_json(args.out, {"model": os.path.abspath(args.model), "cache_size": args.cache_size,
                                     "routing": args.routing, "store": args.store, "rows": rows,
                                     "time": time.strftime("%Y-%m-%d %H:%M:%S")},
                          indent=1, sort_keys=False, make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
