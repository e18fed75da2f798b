"""Batch-1 greedy decode tokens/s: moejax vs transformers on the same weights.

    python bench/bench_decode.py [--new-tokens 128] [--repeats 3] [--out bench/results/decode.json]

Builds a Qwen3-MoE-shaped random model (8 layers, 32 experts, top-4, d=256, ~31M parameters: the shape
NOTES-JAX measured transformers on), saves it once, loads it in both libraries, checks they generate the
same tokens, and times decode after a warm-up. moejax's figure excludes compilation (reported apart).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time



def build_model(folder: str, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
        tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(30.0)  # decisive routing, as a trained model has
    model.save_pretrained(folder)
    return model


def time_transformers(model, prompt, new_tokens, repeats):
    import torch

    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, **kwargs)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            out = model.generate(ids, **kwargs)
            times.append(time.perf_counter() - t)
    return out[0, len(prompt):].tolist(), times


def time_moejax(folder, prompt, new_tokens, repeats):
    import moejax

    model = moejax.load(folder)
    res = model.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False)  # warm-up + compile
    compile_s = res.stats["compile_time_s"]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        res = model.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False)
        times.append(time.perf_counter() - t - res.stats["compile_time_s"])
    return res.token_ids, times, compile_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the machine has 2 cores)")
    ap.add_argument("--out", default="bench/results/decode.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    prompt = [11, 42, 7, 99, 5, 300, 17, 8]
    with tempfile.TemporaryDirectory() as tmp:
        hf_model = build_model(tmp)
        hf_tokens, hf_times = time_transformers(hf_model, prompt, args.new_tokens, args.repeats)
        mj_tokens, mj_times, compile_s = time_moejax(tmp, prompt, args.new_tokens, args.repeats)
    same = hf_tokens == mj_tokens
    hf_tps = args.new_tokens / min(hf_times)
    mj_tps = args.new_tokens / min(mj_times)
    result = {
        "benchmark": "batch-1 greedy decode, Qwen3-MoE shape (8 layers, 32 experts, top-4, d=256), fp32",
        "new_tokens": args.new_tokens, "repeats": args.repeats,
        "transformers_tokens_per_s": hf_tps, "moejax_tokens_per_s": mj_tps,
        "ratio_moejax_over_transformers": mj_tps / hf_tps, "moejax_compile_s": compile_s,
        "identical_tokens": same, "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "transformers_times_s": hf_times, "moejax_times_s": mj_times,
    }
    print(f"transformers {hf_tps:8.1f} tokens/s | moejax {mj_tps:8.1f} tokens/s | ratio {mj_tps / hf_tps:5.2f}x "
          f"| identical tokens: {same} | moejax compile {compile_s:.1f} s")
    from moejax.base import atomic  # imported late, like moejax itself here
    atomic.write_json(args.out, result, sort_keys=False, make_parents=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
