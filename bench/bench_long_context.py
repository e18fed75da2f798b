"""Decode speed against the length of what came before: where a long context's time goes.

    python bench/bench_long_context.py                              # attention-heavy random model, CPU
    python bench/bench_long_context.py --bucketed --lengths 16,4200 # the server's power-of-two KV cache
    python bench/bench_long_context.py --model default --lengths 16,256,960

Greedy decode of ``--new-tokens`` after prompts of each ``--lengths`` (best of ``--repeat``), reporting
tokens/s, ms a token, the time to the first token (the prompt's prefill), the KV cache held (``decode.kv_rows`` rows, as ``model.generate`` allocates, or its
``decode.kv_bucket`` with ``--bucketed``) and the rate at which it would have to be read if attention's time
were all reading it. The default model is a random bf16 decoder whose experts are tiny (d = 1024, 8 layers,
8 heads of 128, experts of F = 32), so that attention dominates. docs/benchmarks.md#long-contexts has the
figures: before the cache was held as bit patterns and read in blocks, XLA:CPU rewrote
each layer's whole bf16 cache to write one row and widened it whole to float32 to read it, every token.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moejax  # noqa: E402
from moejax.base import atomic  # noqa: E402
from moejax.models.config import ModelConfig  # noqa: E402
from moejax.models.attention import init_kv  # noqa: E402
from moejax.runtime import decode  # noqa: E402
from moejax.runtime.api import Model  # noqa: E402
from moejax.runtime.expert_store import tree_nbytes  # noqa: E402
from moejax.training import recipe  # noqa: E402


def attention_heavy_model(max_len: int = 8192) -> Model:
    """A random bf16 Qwen3-MoE decoder whose MoE layers cost little: attention and its cache dominate."""
    d, heads, layers = 1024, 8, 8
    hf = recipe.hf_config("small", vocab_size=512, max_len=max_len)
    hf.update(hidden_size=d, moe_intermediate_size=32, intermediate_size=128, num_experts=8, num_experts_per_tok=2,
              num_attention_heads=heads, num_key_value_heads=heads, head_dim=d // heads, num_hidden_layers=layers)
    cfg = ModelConfig.from_hf(hf)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), recipe.init_params(cfg, jax.random.PRNGKey(0)))
    return Model(params, cfg)


def kv_bytes(model: Model, rows: int) -> int:
    """The KV cache of ``rows`` positions, as the memory plan counts it (``init_kv``'s shapes)."""
    return tree_nbytes(jax.eval_shape(lambda: init_kv(model.cfg, rows, model.params["embed"].dtype)))


def measure(model: Model, lengths: list[int], new_tokens: int, repeat: int, bucketed: bool = False) -> list[dict]:
    rows = []
    for n in lengths:
        ids = (np.arange(1, n + 1, dtype=np.int64) * 7 % model.cfg.vocab_size).astype(np.int32)
        best, ttft = 0.0, float("inf")
        for _ in range(repeat):
            res = model.generate(ids, new_tokens, stop_at_eos=False, bucketed=bucketed)
            best, ttft = max(best, res.stats["tokens_per_s"]), min(ttft, res.stats["prefill_time_s"])
        rows_held = decode.kv_rows(n, new_tokens)
        cache = kv_bytes(model, decode.kv_bucket(rows_held) if bucketed else rows_held)
        rows.append({"prompt_tokens": n, "tokens_per_s": best, "ms_per_token": 1e3 / best, "kv_cache_bytes": cache,
                     "kv_read_gbps_if_all_time": cache * best / 1e9, "time_to_first_token_s": ttft})
        print(f"{n:6d}  {best:8.1f} tok/s  {1e3 / best:7.2f} ms  KV {cache / 1e6:7.1f} MB  "
              f"{cache * best / 1e9:6.2f} GB/s  first token {ttft:6.2f} s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model path or 'default' (default: the attention-heavy random model)")
    p.add_argument("--lengths", default="16,1024,4096,7000", help="prompt lengths, comma-separated")
    p.add_argument("--new-tokens", type=int, default=33,
                   help="tokens to generate (default 33: the first from the prefill, then two whole decode chunks)")
    p.add_argument("--bucketed", action="store_true",
                   help="KV cache rounded up to a power of two, as the server allocates it")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "long_context.json"))
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        p.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if not lengths or min(lengths) < 1 or args.new_tokens < 1 or args.repeat < 1:
        p.error("--lengths, --new-tokens and --repeat must be positive")
    model = moejax.load(args.model) if args.model else attention_heavy_model(max(8192, max(lengths) + args.new_tokens + 1))
    rows = measure(model, lengths, args.new_tokens, args.repeat, args.bucketed)
    atomic.write_json(args.out, {"machine": f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)",
                                 "backend": jax.default_backend(), "model": args.model or "attention-heavy random",
                                 "new_tokens": args.new_tokens, "bucketed": args.bucketed, "rows": rows,
                                 "command": "python bench/bench_long_context.py " + " ".join(argv or sys.argv[1:])})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
