"""Decode and prefill against llama.cpp on the same weights, with the memory-bandwidth roofline.

    python bench/bench_vs_llamacpp.py --model /work/scale/olmoe4 [--new-tokens 64] [--prompt-tokens 8] \
        [--prefill 256,1024] [--repeats 3] [--threads 2] [--profile] [--default] [--out bench/results/vs_llamacpp.json]

One run measures, on this machine and in this order:

1. the read bandwidth the roofline divides by: ``numpy`` sum over 1 GiB with one thread (the
   "single-stream" figure) and with ``--threads`` threads (what a 2-thread engine can draw);
2. moejax in a fresh process (``generate`` through the Python API, the model's stored dtype): load time,
   batch-1 greedy decode tokens/s (``--prompt-tokens`` prompt, ``--new-tokens`` new; the median of
   ``--repeats`` runs after one warm-up run, which also pays XLA's one-time kernel set-up), time to first
   token for each ``--prefill`` prompt length (after a warm-up of that length), weight bytes read per decode
   token (every non-expert matrix, the K routed experts of each MoE layer, the LM head, one embedding row)
   and peak RSS (the child's ``ru_maxrss``); with ``--profile`` also the per-token milliseconds of each part
   of a decode step (each part jitted alone on the real weights, the K experts drawn at random per call);
3. llama.cpp's ``llama-bench`` on a bf16 GGUF of the same folder (converted once, beside it): tg (decode)
   and pp (prompt) tokens/s with the same threads, and its peak RSS (skipped with a message when llama.cpp
   is not built: see ``bench/llamacpp.py``).

Printed: both engines side by side, moejax / llama.cpp ratios, and moejax's tokens/s against the roofline
(bytes per token / bandwidth). ``--default`` adds the embedded 14M default model (dispatch-bound, not
bandwidth-bound: tiny matrices), exported to a Hugging Face folder under ``--workdir`` for llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(HERE))

import memlimit  # noqa: E402

GiB = 1 << 30


# ------------------------------------------------------------------------------------------- bandwidth
def read_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a numpy sum over ``gib`` GiB of float32, split over ``threads`` threads (best of
    ``repeats``; numpy releases the GIL in the reduction)."""
    import numpy as np

    a = np.ones(int(gib * GiB) // 4, np.float32)
    parts = np.array_split(a, threads)
    for p in parts:
        p.sum()
    best = float("inf")
    for _ in range(repeats):
        ths = [threading.Thread(target=p.sum) for p in parts]
        t = time.perf_counter()
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


# ------------------------------------------------------------------------------------------- moejax side
def decode_bytes_per_token(params, cfg) -> dict:
    """Weight bytes one decode token reads, by part, as stored (int8 matrices: values + scales)."""
    import jax

    from moejax.models import layout
    from moejax.models import model as M

    def nbytes(t):
        return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(t))

    parts = {"attention": 0, "experts": 0, "shared_and_dense_mlp": 0, "routers_and_norms": 0}
    for i, lp in enumerate(params["layers"]):
        parts["attention"] += nbytes(lp["attn"])
        parts["routers_and_norms"] += nbytes(lp["attn_norm"]) + nbytes(lp["mlp_norm"])
        if cfg.moe_layers[i]:
            moe = lp["moe"]
            routed = moe["experts"] if "experts" in moe else {k: moe[k] for k in ("gate", "up", "down")}
            parts["experts"] += cfg.top_k * nbytes(routed) // cfg.n_experts
            parts["shared_and_dense_mlp"] += nbytes({k: v for k, v in moe.items() if k in ("shared", "shared_gate")})
            parts["routers_and_norms"] += nbytes(moe["router"])
        else:
            parts["shared_and_dense_mlp"] += nbytes(lp["mlp"])
    embed = params["embed"]
    head = M.lm_head(params, cfg) if layout.is_serving(params) else (embed if cfg.tie_word_embeddings
                                                                      else params["lm_head"])
    parts["lm_head"] = nbytes(head)
    parts["embedding_row"] = embed.shape[1] * embed.dtype.itemsize
    parts["total"] = sum(parts.values())
    return parts


def profile_decode_step(model, repeats: int = 30) -> dict:
    """Per-token ms of each part of a decode step, each jitted alone on the real weights (a part that is
    fast alone may still wait for memory when the whole step runs: the whole step is measured too)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from moejax.runtime import decode
    from moejax.runtime import sampling as sampling_lib
    from moejax.models import gating
    from moejax.models import attention as attention_lib, model as M, moe as moe_lib, ops as ops_lib

    cfg, P = model.cfg, model.params
    rng = np.random.default_rng(0)
    dt = P["embed"].dtype
    D, K, N = cfg.hidden_size, cfg.top_k, cfg.n_experts
    x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32) * 0.1).astype(dt)
    S = 128
    kv = attention_lib.init_kv(cfg, S, dt)
    pos = jnp.int32(S // 2)
    layers = P["layers"]
    moe_ids = [i for i in range(cfg.num_layers) if cfg.moe_layers[i]]

    def timed(f, make_args):
        j = jax.jit(f)
        for _ in range(3):
            jax.block_until_ready(j(*make_args()))
        ts = []
        for _ in range(repeats):
            args = make_args()
            t = time.perf_counter()
            jax.block_until_ready(j(*args))
            ts.append(time.perf_counter() - t)
        return float(np.median(ts)) * 1e3

    def attention(layers, x, kv, pos):
        positions = pos[None]
        cos, sin = attention_lib.rope_tables(cfg, positions)
        attend = attention_lib.mla_attention if cfg.mla else attention_lib.gqa_attention
        for i, lp in enumerate(layers):
            a, _ = attend(lp["attn"], cfg, i, ops_lib.norm(x, lp["attn_norm"], cfg), cos, sin, positions, kv[i], pos)
            x = x + a
        return x

    def routers(layers, x):
        out = []
        for i in moe_ids:
            z = moe_lib.router_logits(layers[i]["moe"], ops_lib.norm(x, layers[i]["mlp_norm"], cfg))
            out.append(gating.original_routing(cfg.gating, z))
        return out

    w = jnp.full((1, K), 1.0 / K, jnp.float32)

    def experts(layers, x, ids):
        for j, i in enumerate(moe_ids):
            x = x + moe_lib.routed_experts(layers[i]["moe"], cfg, x, ids[j], w)
        return x

    def other_mlps(layers, x):
        for i, lp in enumerate(layers):
            if not cfg.moe_layers[i]:
                x = x + ops_lib.dense_mlp(lp["mlp"], cfg, x)
            elif "shared" in lp["moe"]:
                x = x + moe_lib.shared_experts(lp["moe"], cfg, x)
        return x

    def head(P, x):
        logits = ops_lib.linear(ops_lib.norm(x, P["final_norm"], cfg), M.lm_head(P, cfg), P.get("lm_head_bias"))
        return sampling_lib.sample(logits[0].astype(jnp.float32), jax.random.PRNGKey(0), sampling_lib.Sampling())

    def embed(P, tok):
        return M.embed(P, tok)

    draw = lambda: [jnp.asarray(rng.choice(N, K, replace=False)[None].astype(np.int32)) for _ in moe_ids]  # noqa: E731
    # every expert once, so XLA's one-time per-kernel set-up is not timed
    warm = jax.jit(experts)
    for c in range(0, N, K):
        jax.block_until_ready(warm(layers, x, [jnp.asarray(((np.arange(K) + c) % N)[None], jnp.int32)] * len(moe_ids)))
    parts = {
        "embedding": timed(embed, lambda: (P, jnp.asarray([int(rng.integers(cfg.vocab_size))], jnp.int32))),
        "attention (norm, qkv, rope, KV write, attend, o)": timed(attention, lambda: (layers, x, kv, pos)),
        "router + top-k": timed(routers, lambda: (layers, x)),
        "routed experts (K of N)": timed(experts, lambda: (layers, x, draw())),
        "shared experts + dense MLPs": timed(other_mlps, lambda: (layers, x)),
        "LM head + sampling": timed(head, lambda: (P, x)),
    }
    # the whole step as decode runs it: a 16-step chunk of the scan, per token
    state = decode.DecodeState(attention_lib.init_kv(cfg, S, dt), jnp.int32(5), jnp.int32(3), jax.random.PRNGKey(0), None,
                               jnp.bool_(False), jnp.int32(S - 2))
    chunk = decode.decode_chunk.lower(P, cfg=cfg, state=state, router=None, sampling=sampling_lib.Sampling(), steps=16,
                                      eos=()).compile()
    ts = []
    for _ in range(6):
        st = decode.DecodeState(attention_lib.init_kv(cfg, S, dt), jnp.int32(5), jnp.int32(3), jax.random.PRNGKey(0), None,
                                jnp.bool_(False), jnp.int32(S - 2))
        t = time.perf_counter()
        jax.block_until_ready(chunk(P, state=st, sampling=sampling_lib.Sampling()))  # a pytree: an argument at call time
        ts.append(time.perf_counter() - t)
    step = float(np.median(ts[1:])) / 16 * 1e3
    parts["whole decode step (scan of 16)"] = step
    parts["loop, sampling state, records (step - parts)"] = step - sum(
        v for k, v in parts.items() if not k.startswith("whole"))
    return parts


def worker(args) -> int:
    """In the child process: load, warm up, time; print one JSON object."""
    import numpy as np

    import moejax

    t = time.perf_counter()
    m = moejax.load(args.model, dtype=args.dtype, weight_dtype=args.weight_dtype, expert_dtype=args.expert_dtype)
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, m.cfg.vocab_size, size=args.prompt_tokens).tolist()
    m.generate(prompt, max_new_tokens=args.new_tokens, stop_at_eos=False)  # warm-up: compile + kernel set-up
    rates = [m.generate(prompt, max_new_tokens=args.new_tokens, stop_at_eos=False).stats["tokens_per_s"]
             for _ in range(args.repeats)]
    ttft = {}
    for n in args.prefill:
        long_prompt = rng.integers(3, m.cfg.vocab_size, size=n).tolist()
        m.generate(long_prompt, max_new_tokens=1, stop_at_eos=False)
        ttft[str(n)] = float(np.median([m.generate(long_prompt, max_new_tokens=1, stop_at_eos=False)
                                        .stats["prefill_time_s"] for _ in range(args.repeats)]))
    out = {"load_s": load_s, "decode_tokens_per_s": float(np.median(rates)), "decode_runs": rates,
           "ttft_s": ttft, "bytes_per_token": decode_bytes_per_token(m.params, m.cfg),
           "dtype": str(m.params["embed"].dtype), "model": repr(m)}
    if args.profile:
        out["profile_ms"] = profile_decode_step(m)
    print(json.dumps(out))
    return 0


def run_moejax(model: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", model, "--new-tokens",
           str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens), "--repeats", str(args.repeats),
           "--prefill", ",".join(map(str, args.prefill))]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    for flag, value in (("--weight-dtype", args.weight_dtype), ("--expert-dtype", args.expert_dtype)):
        if value:
            cmd += [flag, value]
    if args.profile:
        cmd += ["--profile"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    r = memlimit.run_measured(cmd, env=env, drop_caches=False, timeout=args.timeout)
    if r["returncode"] != 0:
        return {"error": (r["stderr"] or "").strip().splitlines()[-5:], "returncode": r["returncode"]}
    out = json.loads(r["stdout"].strip().splitlines()[-1])
    out["peak_rss_bytes"] = r["peak_rss_bytes"]
    return out


# ------------------------------------------------------------------------------------------- llama.cpp
def run_llamacpp(hf_dir: str, args) -> dict:
    import llamacpp

    if llamacpp.find_llama_cpp() is None:
        return {"skipped": "llama.cpp is not built (python bench/llamacpp.py --help says how)"}
    llamacpp.ensure_tokenizer(hf_dir)
    conv = llamacpp.convert_to_gguf(hf_dir, outtype=args.gguf_type)
    tg = llamacpp.bench(conv["path"], threads=args.threads, n_gen=args.new_tokens, reps=args.repeats,
                        drop_caches=False, timeout=args.timeout)
    out = {"gguf_type": args.gguf_type, "gguf": conv["path"], "gguf_bytes": conv["bytes"], "tg_tokens_per_s": tg["tg_tokens_per_s"],
           "peak_rss_bytes": tg["peak_rss_bytes"], "cmd": tg["cmd_str"], "pp_tokens_per_s": {},
           "returncode": tg.get("returncode"), "stderr_tail": tg.get("stderr_tail")}
    for n in args.prefill:
        pp = llamacpp.bench(conv["path"], threads=args.threads, n_gen=0, n_prompt=n, reps=args.repeats,
                            drop_caches=False, timeout=args.timeout)
        out["pp_tokens_per_s"][str(n)] = pp["pp_tokens_per_s"]
    return out


# ------------------------------------------------------------------------------------------- report
def report(name: str, mj: dict, lc: dict, bw: dict) -> list[str]:
    lines = [f"== {name}"]
    if "error" in mj:
        return lines + [f"moejax FAILED: {mj['error']}"]
    b = mj["bytes_per_token"]["total"]
    lines.append(f"moejax: load {mj['load_s']:.1f} s, {mj['dtype']}, weight bytes per decode token "
                 f"{b / 1e9:.3f} GB, peak RSS {mj['peak_rss_bytes'] / GiB:.2f} GiB")
    dec = mj["decode_tokens_per_s"]
    for label, bps in bw.items():
        roof = bps / b
        lines.append(f"  roofline at {label} {bps / 1e9:.1f} GB/s: {roof:.1f} tok/s -> moejax at "
                     f"{dec / roof:.0%} ({dec * b / 1e9:.1f} GB/s)")
    if lc.get("skipped"):
        lines.append(f"llama.cpp skipped: {lc['skipped']}")
        lines.append(f"decode  moejax {dec:.2f} tok/s")
        for n, s in mj["ttft_s"].items():
            lines.append(f"TTFT {n:>5s}  moejax {s:.3f} s")
        return lines
    lc_dec = lc.get("tg_tokens_per_s") or 0.0
    if lc_dec > 0:
        lines.append(f"decode  moejax {dec:.2f} tok/s  llama.cpp {lc_dec:.2f} tok/s  ratio {dec / lc_dec:.2f}x   "
                     f"(llama.cpp peak RSS {lc['peak_rss_bytes'] / GiB:.2f} GiB)")
    else:  # llama-bench failed or printed no rate: say so (its JSON keeps the stderr tail)
        lines.append(f"decode  moejax {dec:.2f} tok/s  llama.cpp gave no decode rate (returncode "
                     f"{lc.get('returncode')}; see its stderr_tail in the JSON)")
    for n, s in mj["ttft_s"].items():
        pp = lc["pp_tokens_per_s"].get(n)
        lc_s = int(n) / pp if pp else float("nan")
        lines.append(f"TTFT {n:>5s}  moejax {s:.3f} s ({int(n) / s:.0f} tok/s)  llama.cpp {lc_s:.3f} s "
                     f"(pp {pp or 0:.0f} tok/s)  ratio {lc_s / s:.2f}x")
    if mj.get("profile_ms"):
        lines.append("decode step, per token (ms):")
        for k, v in mj["profile_ms"].items():
            lines.append(f"  {k:48s} {v:8.2f}")
    return lines


def export_default(workdir: str) -> str:
    """The embedded default model as a Hugging Face folder (for llama.cpp), made once under ``workdir``."""
    folder = os.path.join(workdir, "default-hf")
    if not os.path.isdir(folder):
        subprocess.run([sys.executable, "-m", "moejax.convert", "moejax-to-hf", "default", folder], check=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a Hugging Face folder (real shapes: moejax.testing.random_checkpoint)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--prefill", type=lambda s: [int(x) for x in s.split(",") if x and int(x) > 0], default=[256, 1024],
                    help="prompt lengths for time to first token (comma-separated; 0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads (XLA uses every core)")
    ap.add_argument("--dtype", default=None, help="moejax compute dtype (default: the stored one)")
    ap.add_argument("--weight-dtype", choices=("stored", "int8"), default=None,
                    help="moejax: every matrix as int8 (compare with --gguf-type q8_0)")
    ap.add_argument("--expert-dtype", choices=("stored", "int8"), default=None, help="moejax: the routed experts alone")
    ap.add_argument("--gguf-type", choices=("bf16", "q8_0", "f32"), default="bf16",
                    help="llama.cpp's weights: bf16 (default) or q8_0 (int8 blocks of 32, against --weight-dtype int8)")
    ap.add_argument("--profile", action="store_true", help="per-part milliseconds of a moejax decode step")
    ap.add_argument("--default", action="store_true", help="also the embedded default model")
    ap.add_argument("--workdir", default=None, help="where the default model's HF export goes (default: a "
                                                    "temporary folder, removed)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default="bench/results/vs_llamacpp.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.model and not args.default:
        ap.error("give --model FOLDER and/or --default")

    bw = {"1 thread": read_bandwidth(1), f"{args.threads} threads": read_bandwidth(args.threads)}
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                           "read_bandwidth_bytes_per_s": bw},
               "settings": {k: v for k, v in vars(args).items() if k != "worker"}, "models": {}}
    with open("/proc/cpuinfo") as f:
        results["machine"]["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                                         results["machine"]["cpu"])
    print(f"machine: {results['machine']['cpu']}, {os.cpu_count()} cores; numpy read bandwidth "
          + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bw.items()))
    tmp = None
    try:
        runs = []
        if args.model:
            runs.append((args.model, args.model))
        if args.default:
            workdir = args.workdir or (tmp := tempfile.mkdtemp(prefix="moejax-bench-"))
            runs.append(("default", export_default(workdir)))
        for name, hf_dir in runs:
            mj = run_moejax(name if name == "default" else hf_dir, args)
            lc = run_llamacpp(hf_dir, args)
            results["models"][name] = {"moejax": mj, "llama.cpp": lc}
            print("\n".join(report(name, mj, lc, bw)))
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        from moejax.base import atomic  # imported late, like moejax itself here
        atomic.write_json(args.out, results, indent=1, sort_keys=False, make_parents=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
