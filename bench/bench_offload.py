"""Offloaded decoding benchmarks. Prints comparable ratios and writes JSON results.

CPU suite (any machine; SpecMD appendix A.4 emulation): the embedded default model with its experts in
host memory, host-driven paging through an emulated link of B GB/s. Tokens/s of LRU with original routing
vs cache-prior λ ∈ {0.1, 0.3, 0.5, 0.7, 0.9} at C = N/2 and N/4 (paper figure 8), and prefetch on vs off.

    python bench/bench_offload.py --suite cpu [--bandwidths 2,25,0.25] [--new-tokens 64]

GPU suite (needs a GPU; ``--small`` runs the same code on tiny shapes anywhere, as a smoke test):
  1. pinned host→device ``device_put`` bandwidth for expert-sized arrays (one expert, K experts, 256 MiB);
  2. a model with real-size expert shapes (OLMoE: D=2048, F=1024, N=64, K=8; random weights, routers
     scaled so routing is decisive): offloaded decode tokens/s vs the roofline
     1 / (bytes per token / measured bandwidth + compute time per token with every expert resident),
     achieved GB/s while paging vs the measured peak, in-jit vs host-driven paging.

    python bench/bench_offload.py --suite gpu [--layers 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import moejax  # noqa: E402
from moejax.base import atomic  # noqa: E402
from moejax.experts import routing
from moejax.runtime import expert_store
from moejax.runtime import offload  # noqa: E402
from moejax.runtime.simulate import CacheConfig  # noqa: E402

PROMPT = "The history of the city of Paris began in the Roman period, when"


def machine() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{getattr(dev, 'device_kind', '')} ({os.cpu_count()} cpus, {platform.processor() or platform.machine()})"


def run_point(model, ids, policy, cache: CacheConfig, off: offload.OffloadConfig, new_tokens: int, repeat: int):
    """Best of ``repeat`` runs (tokens/s is a max: noise on a shared machine only slows it down)."""
    best = None
    for _ in range(repeat):
        res = model.generate(ids, new_tokens, routing=policy, cache=cache, offload=off, stop_at_eos=False)
        if best is None or res.stats["tokens_per_s"] > best.stats["tokens_per_s"]:
            best = res
    s, o, c = best.stats, best.stats["offload"], best.stats["cache"]
    return {"tokens_per_s": s["tokens_per_s"], "ttft_s": s["time_to_first_token_s"], "miss_rate": c["miss_rate"],
            "bytes_per_token": o["bytes_per_token"], "transfer_s": o["transfer_s"], "total_s": s["total_time_s"],
            "prefetch_precision": c["prefetch_precision"], "prefetch_recall": c["prefetch_recall"],
            "tokens": best.token_ids[:8]}


def cpu_suite(args) -> dict:
    if args.model == "olmoe-shapes":  # real-size experts (12 MiB each in bf16), random weights
        model = real_size_model(args.layers, small=False)
        ids = (np.arange(1, 17, dtype=np.int32) * 7919) % model.cfg.vocab_size
    else:
        model = moejax.load(args.model)
        ids = model.encode(PROMPT)
    k = model.cfg.top_k
    lams = [float(x) for x in args.lams.split(",")]
    out = {"machine": machine(), "model": args.model, "new_tokens": args.new_tokens, "points": []}
    print(f"{'GB/s':>6} {'C':>4} {'policy':>18} {'tok/s':>8} {'ratio':>6} {'miss':>6} {'MiB/tok':>8} {'xfer%':>6}")
    for bw in [float(x) for x in args.bandwidths.split(",")]:
        off = offload.OffloadConfig(bandwidth_gbps=bw)
        for size in args.sizes.split(","):
            cache = CacheConfig(size=size)
            cap = cache.capacity(model.cfg)
            rows = [("original", routing.make_policy("original", k), cache)]
            rows += [(f"cache-prior {lam}", routing.make_policy("cache-prior", k, lam=lam), cache) for lam in lams]
            rows += [("original+prefetch", routing.make_policy("original", k), dataclasses.replace(cache, prefetch=1.0)),
                     ("cp 0.5+prefetch", routing.make_policy("cache-prior", k, lam=0.5),
                      dataclasses.replace(cache, prefetch=1.0))]
            # rounds over all policies (not repeats of one), so load that comes and goes hits every policy;
            # each keeps its best round
            best: dict = {}
            for _ in range(args.repeat):
                for name, policy, cc in rows:
                    r = run_point(model, ids, policy, cc, off, args.new_tokens, 1)
                    if name not in best or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                        best[name] = r
            base = None
            for name, policy, cc in rows:
                r = best[name]
                base = base or r["tokens_per_s"]
                r.update(bandwidth_gbps=bw, cache_size=size, capacity=cap, policy=name,
                         ratio_vs_lru_original=r["tokens_per_s"] / base)
                out["points"].append(r)
                print(f"{bw:6.2f} {cap:4d} {name:>18} {r['tokens_per_s']:8.1f} {r['ratio_vs_lru_original']:6.2f} "
                      f"{r['miss_rate']:6.3f} {r['bytes_per_token'] / 2**20:8.2f} "
                      f"{100 * r['transfer_s'] / r['total_s']:6.1f}", flush=True)
    return out


# ------------------------------------------------------------------------------------------ GPU suite


def measure_device_put(shapes: dict[str, tuple], dtype, repeat: int = 20) -> dict:
    """Pinned host → device bandwidth (GB/s, median) for each named list of array shapes."""
    dev = jax.devices()[0]
    host = expert_store._host_sharding(dev)
    target = jax.sharding.SingleDeviceSharding(dev, memory_kind="device") if host is not None else dev
    out = {}
    for name, shape_list in shapes.items():
        src = [np.random.standard_normal(s).astype(dtype) for s in shape_list]
        src = [jax.device_put(a, host) if host is not None else a for a in src]
        nbytes = sum(a.nbytes for a in src)
        times = []
        for i in range(repeat + 2):
            t0 = time.perf_counter()
            dst = [jax.device_put(a, target) for a in src]
            jax.block_until_ready(dst)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            del dst
        t = float(np.median(times))
        out[name] = {"bytes": int(nbytes), "median_s": t, "gbps": nbytes / t / 1e9, "pinned": host is not None}
    return out


def random_model(hf: dict, dtype=jnp.bfloat16):
    """A model of config.json ``hf`` with random weights made in memory (``recipe.init_params``) and decisive
    routers, as a trained router would give."""
    from moejax.training import recipe
    from moejax.runtime.api import Model
    from moejax.models.config import ModelConfig

    cfg = ModelConfig.from_hf(hf)
    params = recipe.init_params(cfg, jax.random.PRNGKey(0))
    for lp in params["layers"]:
        if "moe" in lp:
            lp["moe"]["router"] = lp["moe"]["router"] * 50.0
    return Model(jax.tree.map(lambda a: a.astype(dtype), params), cfg)


def real_size_model(layers: int, small: bool, dtype=jnp.bfloat16):
    """OLMoE expert shapes (D=2048, F=1024, N=64, K=8) on a Qwen3-MoE decoder, random weights."""
    from moejax.training import recipe

    d, f, n, k, heads = (2048, 1024, 64, 8, 16) if not small else (128, 64, 16, 4, 4)
    hf = recipe.hf_config("small", vocab_size=50304 if not small else 512, max_len=4096)
    hf.update(hidden_size=d, moe_intermediate_size=f, intermediate_size=4 * f, num_experts=n, num_experts_per_tok=k,
              num_attention_heads=heads, num_key_value_heads=heads, head_dim=d // heads, num_hidden_layers=layers,
              norm_topk_prob=False)
    return random_model(hf, dtype)


def preset_model(preset: str, layers: int, small: bool, dtype=jnp.bfloat16):
    """A model with a real model's config (``random_checkpoint``'s preset, cut to its first ``layers`` decoder
    layers; ``small``: tiny dimensions), random weights made in memory."""
    from moejax.testing import random_checkpoint

    hf = random_checkpoint.preset_config(preset)
    tiny = {}
    if small:
        tiny = dict(hidden_size=128, moe_intermediate_size=64, intermediate_size=128, vocab_size=512,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=32)
        if "shared_expert_intermediate_size" in hf:
            tiny["shared_expert_intermediate_size"] = 128
    return random_model(random_checkpoint.with_overrides(hf, layers, tiny), dtype)


# the GPU suite's models: OLMoE's expert shapes on a Qwen3-MoE decoder (the default), and
# Qwen1.5-MoE-A2.7B's own config (60 experts of F = 1408, top-4, a shared expert of 5632)
SHAPES = {"olmoe": lambda layers, small: real_size_model(layers, small),
          "qwen1.5": lambda layers, small: preset_model("qwen1.5-moe-a2.7b", layers, small)}
# routing + cache variants of the GPU suite: (routing policy, lambda, prefetch overfetch factor)
ROUTINGS = {"original": ("original", None, 0.0), "cache-prior": ("cache-prior", 0.5, 0.0),
            "prefetch": ("cache-prior", 0.5, 1.0)}


def gpu_suite(args) -> dict:
    small = args.small
    shapes = [x for x in args.shapes.split(",") if x]
    routings = [x for x in args.routings.split(",") if x]
    for name, chosen, known in (("shape", shapes, SHAPES), ("routing", routings, ROUTINGS)):
        bad = [x for x in chosen if x not in known]
        if bad:
            raise SystemExit(f"error: unknown {name} {', '.join(bad)}: expected {', '.join(known)}")
    result = {"machine": machine(), "models": {}}
    for shape in shapes:
        model = SHAPES[shape](args.layers, small)
        cfg = model.cfg
        d, f = cfg.hidden_size, cfg.moe_intermediate_size
        one = [(d, f), (d, f), (f, d)]  # one expert's matrices: the peak is measured per model's expert shape
        bw = measure_device_put({"one_expert": one, f"k{cfg.top_k}_experts": one * cfg.top_k,
                                 "128MiB": [(64, 2**20)] if not small else [(4, 2**16)]}, np.dtype("bfloat16"))
        result["models"][shape] = {"device_put": bw}
        gpu_runs(args, model, routings, max(v["gbps"] for v in bw.values()), result["models"][shape],
                 lambda: atomic.write_json(args.out, result, indent=1, sort_keys=False, make_parents=True))
        del model
    return result


def gpu_runs(args, model, routings: list[str], peak: float, result: dict, save) -> None:
    """Offloaded decode of one model: every paging x cache size x routing, against the roofline (``peak``:
    the measured host -> device GB/s), into ``result``; ``save()`` after each run, so that a run cut off by
    its time box (a device call) keeps the runs before it. A run the configuration refuses (a cache smaller
    than top-k) is recorded with its error and the grid goes on."""
    cfg = model.cfg
    ids = np.arange(1, 17, dtype=np.int32) * 7 % cfg.vocab_size
    policy = routing.make_policy("original", cfg.top_k)
    new = args.new_tokens
    result |= {"model": {"type": cfg.model_type, "hidden": cfg.hidden_size, "moe_ff": cfg.moe_intermediate_size,
                        "experts": cfg.n_experts, "top_k": cfg.top_k, "layers": cfg.num_layers,
                        "expert_bytes": cfg.expert_params * 2},
              "peak_gbps": peak, "runs": {}}
    # compute time with every expert resident: a cache of N never misses after the first pass of each expert
    full = model.generate(ids, new, routing=policy, cache=CacheConfig(size=str(cfg.n_experts)), stop_at_eos=False,
                          offload=offload.OffloadConfig())
    warm = model.generate(ids, new, stop_at_eos=False)  # everything on the device, no cache: pure compute
    t_compute = 1.0 / warm.stats["tokens_per_s"]
    result["runs"]["all_on_device"] = {"tokens_per_s": warm.stats["tokens_per_s"]}
    result["runs"]["offload_cache_N"] = {"tokens_per_s": full.stats["tokens_per_s"]}
    for paging, size, rname in ((p, s, r) for p in args.pagings.split(",") for s in args.sizes.split(",")
                                for r in routings):
        kind, lam, overfetch = ROUTINGS[rname]
        policy = routing.make_policy(kind, cfg.top_k, **({} if lam is None else {"lam": lam}))
        cc = CacheConfig(size=size, prefetch=overfetch)
        try:
            res = model.generate(ids, new, routing=policy, cache=cc, stop_at_eos=False,
                                 offload=offload.OffloadConfig(paging=paging))
        except ValueError as e:  # e.g. a cache smaller than top-k on the small shapes
            result["runs"][f"{paging}_C{size}_{rname}"] = {"error": str(e)}
            print(cfg.model_type, paging, size, rname, "refused:", e, flush=True)
            continue
        o, s = res.stats["offload"], res.stats
        if "bytes_per_decode_token" in o:
            bpt = o["bytes_per_decode_token"]
        else:  # in-jit: the prompt's bytes from a 1-token run (same routing), subtracted
            pre = model.generate(ids, 1, routing=policy, cache=cc, stop_at_eos=False,
                                 offload=offload.OffloadConfig(paging=paging)).stats["offload"]["bytes_moved"]
            bpt = (o["bytes_moved"] - pre) / max(s["generated_tokens"] - 1, 1)
        roofline = 1.0 / (bpt / (peak * 1e9) + t_compute)
        run = result["runs"][f"{paging}_C{size}_{rname}"] = {
            "tokens_per_s": s["tokens_per_s"], "ttft_s": s["time_to_first_token_s"],
            "miss_rate": res.stats["cache"]["miss_rate"], "bytes_per_token": bpt,
            "roofline_tokens_per_s": roofline, "fraction_of_roofline": s["tokens_per_s"] / roofline,
            "achieved_gbps": o.get("achieved_gbps"),
            "achieved_fraction_of_peak": (o["achieved_gbps"] / peak) if o.get("achieved_gbps") else None,
            "device_memory": o.get("device_memory")}
        if "step_s" in o:  # host paging: where a decode token's time goes (ms)
            n = max(s["generated_tokens"], 1)
            run["ms_per_token"] = {
                "step": 1e3 * o["step_s"] / n, "waiting_for_routing": 1e3 * o["sync_s"] / n,
                "paging": 1e3 * o["page_s"] / n,
                "rest_on_host": 1e3 * (o["step_s"] - o["sync_s"] - o["page_s"]) / n,
                "host_reads": o["host_reads"] / n}  # device round trips a token (one per MoE layer)
        print(cfg.model_type, paging, size, rname, json.dumps(run, default=str)[:400], flush=True)
        if "ms_per_token" in run:
            print("   ms per token:", json.dumps({k: round(v, 3) for k, v in run["ms_per_token"].items()}))
        save()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--model", default="default", help="a model path, 'default', or 'olmoe-shapes' (random "
                   "weights with OLMoE's expert shapes, --layers decoder layers)")
    p.add_argument("--bandwidths", default="2,25,0.25", help="emulated GB/s (cpu suite)")
    p.add_argument("--sizes", default="0.5,0.25", help="cache sizes (fractions of N)")
    p.add_argument("--shapes", default="olmoe", help=f"gpu suite: models, of {', '.join(SHAPES)}")
    p.add_argument("--routings", default="original", help=f"gpu suite: routing + cache variants, of {', '.join(ROUTINGS)} "
                   "(cache-prior: lambda 0.5; prefetch: that + prefetch with overfetch 1)")
    p.add_argument("--pagings", default="host,jit", help="gpu suite: host, jit or both")
    p.add_argument("--lams", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the real-size (olmoe-shapes) model")
    p.add_argument("--small", action="store_true", help="gpu suite on tiny shapes (smoke test anywhere)")
    p.add_argument("--out", default=None, help="results JSON path (default bench/results/offload_<suite>.json)")
    args = p.parse_args(argv)
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"offload_{args.suite}{'_small' if args.small else ''}.json")
    t0 = time.perf_counter()
    res = cpu_suite(args) if args.suite == "cpu" else gpu_suite(args)
    res["wall_s"] = time.perf_counter() - t0
    res["command"] = " ".join(["python bench/bench_offload.py", *(argv if argv is not None else sys.argv[1:])])
    atomic.write_json(args.out, res, indent=1, sort_keys=False, make_parents=True)
    print(f"wrote {args.out} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
