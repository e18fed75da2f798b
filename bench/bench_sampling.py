"""What sampling costs a decoded token: tokens/s of each sampling setting against greedy decode, in one run.

    python bench/bench_sampling.py [--model default] [--new-tokens 128] [--repeats 3] [--reference]
        [--out bench/results/sampling.json]

Settings: greedy; temperature 0.8; + top-k 50; + top-p 0.9; top-k 50 + top-p 0.9; + repetition penalty 1.1.
The anchor is greedy decode of the same model in the same process (the sampled rows' ratio to it). With
``--reference`` every sampled setting is timed a second time with top-k and top-p computed by sorting the
vocabulary (the implementation before ``sampling_lib.largest_key_where``; its thresholds differ only on ties at the
nucleus' edge), so both stand side by side in one run. Compilation is excluded (reported apart).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp

import moejax
from moejax.base import atomic
from moejax.runtime import sampling as sampling_lib

SETTINGS = {
    "greedy": {},
    "temperature 0.8": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "+ penalty 1.1": dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1),
}


def sorted_sampling_logits(logits, sampling, seen=None):
    """The sorting implementation of ``sampling_lib.sampling_logits`` (the reference timed by ``--reference``)."""
    logits = sampling_lib.penalised_logits(logits, sampling, seen).astype(jnp.float32)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / jnp.asarray(sampling.temperature, jnp.float32)
    if sampling.steps.top_k:
        size = logits.shape[-1]
        kth = jnp.sort(logits)[size - jnp.clip(jnp.asarray(sampling.top_k, jnp.int32), 1, size)]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.steps.top_p:
        order = jnp.argsort(-logits)
        probs = jax.nn.softmax(logits[order])
        keep_sorted = (jnp.cumsum(probs) - probs < sampling.top_p).at[0].set(True)
        logits = jnp.where(jnp.zeros_like(keep_sorted).at[order].set(keep_sorted), logits, -jnp.inf)
    return logits


def time_setting(model, prompt, new_tokens: int, repeats: int, kwargs: dict) -> tuple[float, float]:
    """Best decode tokens/s of ``repeats`` runs (compile excluded) and the first run's compile seconds."""
    run = lambda: model.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, **kwargs)  # noqa: E731
    compile_s = run().stats["compile_time_s"]
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        res = run()
        best = max(best, new_tokens / (time.perf_counter() - t - res.stats["compile_time_s"]))
    return best, compile_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reference", action="store_true", help="also time top-k/top-p by sorting the vocabulary")
    ap.add_argument("--out", default="bench/results/sampling.json")
    args = ap.parse_args()
    model = moejax.load(args.model)
    prompt = list(range(5, 21))
    rows = []
    implementations = [("search", sampling_lib.sampling_logits)]
    implementations += [("sort", sorted_sampling_logits)] if args.reference else []
    greedy = None
    for name, kwargs in SETTINGS.items():
        for impl, fn in implementations if kwargs else implementations[:1]:
            sampling_lib.sampling_logits = fn  # read when the decode step is traced; the setting's programs are new
            try:
                tps, compile_s = time_setting(model, prompt, args.new_tokens, args.repeats, kwargs)
            finally:
                sampling_lib.sampling_logits = implementations[0][1]
            greedy = tps if greedy is None else greedy
            rows.append(dict(setting=name, implementation=impl if kwargs else "-", tokens_per_s=tps,
                             ratio_to_greedy=tps / greedy, compile_s=compile_s))
            print(f"{name:24s} {rows[-1]['implementation']:7s} {tps:8.1f} tok/s  {tps / greedy:5.2f}x greedy  "
                  f"(compile {compile_s:.1f} s)", flush=True)
            if args.reference and kwargs:
                jax.clear_caches()  # the next implementation traces afresh
    result = dict(benchmark="decode tokens/s by sampling setting (compile excluded)", model=args.model,
                  vocab_size=model.cfg.vocab_size, new_tokens=args.new_tokens, repeats=args.repeats,
                  machine=f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}", rows=rows)
    atomic.write_json(args.out, result, sort_keys=False, make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
