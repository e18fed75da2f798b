"""Teacher-forced pass: moejax vs transformers on the same weights, on the CPU or a GPU.

    python bench/bench_teacher_forced.py [--chunks 8] [--context 1024] [--repeats 2] [--lam 0.5]
                                         [--cache-size 0.5] [--out bench/results/teacher_forced.json]
    python bench/bench_teacher_forced.py --model OLMOE_DIR --dtype bfloat16 --sweep-points 16   # OLMoE shapes, GPU

``--model default`` (the embedded default model: 8 layers, 64 experts, top-8; or the tests' smaller stand-in,
``--model tests/data/cpu-default-model``: 4 layers, 32 experts, top-4) is exported with ``moejax.convert moejax-to-hf``
into a temporary folder and loaded in ``transformers``; a Hugging Face folder (a random checkpoint of
``moejax.testing.random_checkpoint olmoe-1b-7b``, say) is loaded by both as it is. Both engines compute in
``--dtype``; with a GPU visible JAX uses it and torch runs on ``cuda`` (``--torch-device``). Both run the same
chunks: the first ``--chunks`` chunks of ``--context`` tokens of the WikiText-2 raw test text, cut exactly as
``moejax.evaluate`` cuts them ([BOS] + context-1 tokens); a model without a tokenizer gets seeded random
token ids instead (the speeds are what they measure; perplexities are the engines' agreement check only).
torch uses ``--threads`` intra-op threads and the process is pinned to that many CPUs; transformers runs
its experts with its own default implementation (5.x: ``grouped_mm``, the fastest on CPU here; ``--hf-experts``
picks another). Run it on a quiet machine: torch's OpenMP threads slow down 10× and more when another
process holds one of the cores, XLA's far less, which inflates the ratios.

1. Plain pass (goal ≥ 2×): moejax ``model.forward(ids).logits`` (jit-compiled) vs transformers
   ``model(ids).logits`` under ``torch.no_grad()``, original routing, no cache.
2. Cache-aware pass (goal ≥ 3×): cache-prior routing (λ = ``--lam``, top-J = the paper's default for K)
   with a per-layer LRU expert cache of ``--cache-size`` (fraction of N), simulated for every token:
   moejax's teacher-forced simulation path (``model.forward(ids, state=...)``, the layer-parallel route)
   vs transformers with a Python forward hook on each MoE router (``mlp.gate``) that re-routes its
   tokens one at a time with the same rule and keeps the layer's LRU cache in an ``OrderedDict`` — the
   hook researchers write today. As in ``moejax.evaluate``, the cache and the running Δ (mean logit range)
   carry across chunks; every timed repeat starts from an empty cache and Δ state.

3. ``--sweep-points N`` (goal ≥ 3×): an N-point λ sweep (λ evenly spaced over [0, 1], the same cache)
   as ONE vmapped moejax pass per chunk (``moejax.evaluation.sweep.batched_pass``, what ``moejax.sweep`` runs)
   vs N sequential cache-aware passes (2. above, once per λ); every point's perplexity and miss rate must
   agree between the two.

Times: each engine runs the whole set of chunks once to warm up (moejax compiles), then ``--repeats``
times; the minimum is reported as tokens/s (tokens = chunks × context, BOS included). Perplexity (mean
next-token NLL over the chunks) and, for the cache pass, miss rate are reported for both engines and must
agree: a loud warning is printed when they do not.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from collections import OrderedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py)

common.score_the_shipped_wikitext()

PPL_RTOL = {"float32": 1e-3, "bfloat16": 2e-2}  # perplexities of two engines must agree to this relative tolerance
MISS_ATOL = {"float32": 1e-3, "bfloat16": 2e-2}  # and miss rates to this absolute tolerance (bf16: a router
# logit rounded differently flips a near-tie, and the cache carries the flip on)


# ------------------------------------------------------------------------------------------ setup


def pin_cpus(threads: int) -> list[int]:
    """Restrict the process (JAX's thread pool included) to ``threads`` CPUs; returns the CPUs used."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > threads:
        cpus = cpus[:threads]
        os.sched_setaffinity(0, cpus)
    return cpus


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def wikitext_chunks(model, n_chunks: int, context: int) -> list[np.ndarray]:
    """The first ``n_chunks`` chunks of the WikiText-2 test text, as ``moejax.evaluate`` tokenises and cuts it."""
    from moejax.evaluation import perplexity

    text = perplexity.load_wikitext()
    ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)
    chunks = perplexity.chunk_tokens(ids, context, model.cfg.bos_token_id)[:n_chunks]
    if len(chunks) < n_chunks or len(chunks[-1]) != context:
        raise ValueError(f"WikiText-2 test has too few tokens for {n_chunks} full chunks of {context}")
    return chunks


def random_chunks(model, n_chunks: int, context: int, seed: int = 0) -> list[np.ndarray]:
    """Seeded random token ids cut like ``wikitext_chunks`` ([BOS] + context-1 tokens), for a model without a
    tokenizer (random checkpoints)."""
    rng = np.random.default_rng(seed)
    cfg = model.cfg
    body = rng.integers(0, cfg.vocab_size, size=(n_chunks, context - 1), dtype=np.int64).astype(np.int32)
    return [np.concatenate([[np.int32(cfg.bos_token_id or 0)], row]).astype(np.int32) for row in body]


def is_hf_folder(path: str) -> bool:
    from moejax.models import checkpoint

    return os.path.isfile(os.path.join(path, "config.json")) and not checkpoint.is_moejax_folder(path)


def load_transformers(folder: str, experts_implementation: str | None = None, dtype: str = "float32",
                      device: str = "cpu"):
    import torch
    import transformers

    options = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype),
                                                             **options).to(device).eval()


def mean_nll(logits: list[np.ndarray], chunks: list[np.ndarray]) -> float:
    from moejax.evaluation import perplexity

    nll = np.concatenate([perplexity.token_nll(z, c) for z, c in zip(logits, chunks)])
    return float(nll.mean())


_START = time.perf_counter()


def timed(run, repeats: int, label: str = "") -> tuple[float, list[float], object]:
    """Warm up with one run, then time ``repeats`` runs; (min seconds, all times, last run's result). Each
    finished run is logged to stderr with the time since start (on the H200 a call cut off by its time box
    said nothing of where its 190 s went)."""
    t = time.perf_counter()
    result = run()
    _log(f"{label}: warm-up run (compiles) {time.perf_counter() - t:.1f} s")
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - t)
        _log(f"{label}: {times[-1]:.2f} s")
    return min(times), times, result


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f} s] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ moejax


def moejax_plain(model, chunks):
    # Model.forward returns numpy arrays: the jit-compiled pass has finished (block_until_ready) on return
    return [model.forward(c).logits for c in chunks]


def moejax_cache(model, chunks, policy, cache_cfg, route_on_host=None):
    """Cache-aware teacher-forced pass; the router state (cache + running Δ) carries across chunks.
    ``route_on_host``: None lets moejax choose (the host CPU when the model is on an accelerator)."""
    state = model.router_state(policy, cache_cfg)
    logits, experts = [], []
    for c in chunks:
        out = model.forward(c, state=state, route_on_host=route_on_host)
        state = out.state
        logits.append(out.logits)
        experts.append(out.experts)  # [L, T, K]
    return logits, np.concatenate(experts, axis=1), out.stats


# ------------------------------------------------------------------------------------------ transformers


def transformers_logits(hf_model, chunks):
    import torch

    with torch.no_grad():  # .cpu() waits for the device: every chunk's logits are on the host when timed
        return [hf_model(torch.as_tensor(c, dtype=torch.long, device=hf_model.device)[None], use_cache=False)
                .logits[0].float().cpu().numpy() for c in chunks]


class CachePriorLRUHook:
    """Forward hook on one MoE router (``mlp.gate``: Qwen3-MoE's, OLMoE's ``...TopKRouter``, which return
    (router logits, top-k weights, top-k indices)): re-routes its tokens one
    by one with cache-prior and keeps the layer's LRU expert cache, counting misses.

    Per token (moejax.experts.routing / moejax.experts.router / moejax.experts.cache semantics, re-written in plain Python):
    fold the logit range max(z) - min(z) into the running mean Δ (the current token included, float32);
    z' = z + λ·Δ on the cached experts and the top-J of z; choose the first K of z' (ties: lower index);
    weigh them with the router's softmax of the ORIGINAL logits, renormalised over the K (summed in the
    original ranking's order); look them up highest weight first, then evict least recently used entries
    down to the capacity (this token's experts are the newest, the highest-weighted of them oldest).
    """

    def __init__(self, n_experts: int, top_k: int, capacity: int, lam: float, top_j: int, normalize: bool):
        self.n, self.k, self.capacity = n_experts, top_k, capacity
        self.lam, self.top_j, self.normalize = np.float32(lam), top_j, normalize
        self.reset()

    def reset(self):
        self.lru: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.resident = np.zeros(self.n, bool)
        self.delta_sum = np.float32(0.0)
        self.delta_count = np.float32(0.0)
        self.accesses = self.misses = 0
        self.seconds = 0.0  # time spent in this hook
        self.experts: list[np.ndarray] = []  # [T, K] per call, highest weight first

    def route(self, z: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.delta_sum = np.float32(self.delta_sum + (z.max() - z.min()))
        self.delta_count = np.float32(self.delta_count + 1)
        delta = np.float32(self.delta_sum / self.delta_count)
        ranking = np.argsort(-z, kind="stable")
        boosted = self.resident.copy()
        boosted[ranking[:self.top_j]] = True
        z_prior = np.where(boosted, z + self.lam * delta, z)
        chosen = np.argsort(-z_prior, kind="stable")[:self.k]
        rank_of = np.empty(self.n, np.int64)
        rank_of[ranking] = np.arange(self.n)
        chosen = chosen[np.argsort(rank_of[chosen], kind="stable")]
        w = probs[chosen]
        if self.normalize:
            w = w / w.sum()
        order = np.argsort(-w, kind="stable")
        chosen, w = chosen[order], w[order]
        for e in chosen.tolist():
            if self.resident[e]:
                self.lru.move_to_end(e)
            else:
                self.lru[e] = None
                self.resident[e] = True
                self.misses += 1
        while len(self.lru) > self.capacity:
            victim, _ = self.lru.popitem(last=False)
            self.resident[victim] = False
        self.accesses += self.k
        return chosen, w

    def __call__(self, module, inputs, output):
        import torch

        start = time.perf_counter()
        router_logits = output[0]
        z = router_logits.detach().float().cpu().numpy()
        probs = torch.softmax(router_logits.detach(), dim=-1, dtype=torch.float).cpu().numpy()
        experts = np.empty((z.shape[0], self.k), np.int64)
        weights = np.empty((z.shape[0], self.k), np.float32)
        for t in range(z.shape[0]):
            experts[t], weights[t] = self.route(z[t], probs[t])
        self.experts.append(experts)
        dev = router_logits.device
        out = router_logits, torch.from_numpy(weights).to(dev, router_logits.dtype), torch.from_numpy(experts).to(dev)
        self.seconds += time.perf_counter() - start
        return out


def install_hooks(hf_model, capacity: int, lam: float, top_j: int) -> list[CachePriorLRUHook]:
    """One hook per MoE layer (a decoder layer whose ``mlp`` has a ``gate`` router and ``experts``)."""
    cfg = hf_model.config
    hooks = []
    for layer in hf_model.model.layers:
        if not (hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")):
            continue
        hook = CachePriorLRUHook(cfg.num_experts, cfg.num_experts_per_tok, capacity, lam, top_j,
                                 bool(getattr(cfg, "norm_topk_prob", False)))
        layer.mlp.gate.register_forward_hook(hook)
        hooks.append(hook)
    if not hooks:
        raise SystemExit(f"error: no MoE router to hook in {type(hf_model).__name__} (expected mlp.gate and mlp.experts)")
    return hooks


def transformers_cache(hf_model, hooks, chunks):
    """Cache-aware pass through the hooks; their state carries across chunks, reset once per run."""
    for h in hooks:
        h.reset()
    logits = transformers_logits(hf_model, chunks)
    experts = np.stack([np.concatenate(h.experts) for h in hooks])  # [L, T_total, K]
    misses, accesses = sum(h.misses for h in hooks), sum(h.accesses for h in hooks)
    return logits, experts, {"misses": misses, "accesses": accesses, "miss_rate": misses / accesses,
                             "hook_s": sum(h.seconds for h in hooks)}


# ------------------------------------------------------------------------------------------ λ sweep


def sweep_sequential(model, chunks, policies, cache_cfg) -> list[tuple[float, float]]:
    """One cache-aware pass per λ (``moejax_cache``): [(mean NLL, miss rate)] per point."""
    out = []
    for policy in policies:
        logits, _, stats = moejax_cache(model, chunks, policy, cache_cfg)
        out.append((mean_nll(logits, chunks), float(stats["miss_rate"])))
    return out


def sweep_vmapped(model, chunks, policies, cache_cfg) -> list[tuple[float, float]]:
    """Every λ in ONE vmapped pass per chunk (``sweep.batched_pass``; states stacked, carried across chunks)."""
    import jax
    import jax.numpy as jnp

    from moejax.evaluation import sweep
    from moejax.runtime import simulate

    states = [simulate.init_router_state(model.cfg, p, cache_cfg, model.selection_biases) for p in policies]
    stacked = jax.device_put(jax.tree.map(lambda *xs: jnp.stack(xs), *states), jax.devices()[0])
    nll_sum = np.zeros(len(policies))
    misses = np.zeros(len(policies))
    accesses = np.zeros(len(policies))
    n = 0
    for c in chunks:
        nll, experts, _, hits, stacked = sweep.batched_pass(model.params, model.cfg, jnp.asarray(c), stacked)
        nll, experts, hits = jax.device_get((nll, experts, hits))
        nll_sum += nll.astype(np.float64).sum(axis=1)
        n += nll.shape[1]
        used = experts >= 0
        misses += (used & ~hits).sum(axis=(1, 2, 3))
        accesses += used.sum(axis=(1, 2, 3))
    return [(float(nll_sum[b] / n), float(misses[b] / accesses[b])) for b in range(len(policies))]


# ------------------------------------------------------------------------------------------ report


def compare(name: str, mj: dict, hf: dict, dtype: str = "float32") -> dict:
    """Ratios and agreement of one pass; warns loudly when the perplexities (or miss rates) disagree."""
    out = {"moejax": mj, "transformers": hf, "ratio_moejax_over_transformers": mj["tokens_per_s"] / hf["tokens_per_s"]}
    rel = abs(mj["ppl"] - hf["ppl"]) / hf["ppl"]
    out["ppl_rel_diff"] = rel
    problems = []
    if not rel <= PPL_RTOL[dtype]:
        problems.append(f"perplexity moejax {mj['ppl']:.6f} vs transformers {hf['ppl']:.6f} (rel diff {rel:.2e})")
    if "miss_rate" in mj:
        diff = abs(mj["miss_rate"] - hf["miss_rate"])
        out["miss_rate_abs_diff"] = diff
        if not diff <= MISS_ATOL[dtype]:
            problems.append(f"miss rate moejax {mj['miss_rate']:.6f} vs transformers {hf['miss_rate']:.6f}")
    out["agree"] = not problems
    for p in problems:
        print(f"!!!!!!!! WARNING: {name} pass: {p} — the engines do NOT compute the same thing !!!!!!!!",
              file=sys.stderr)
    return out


def set_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (layer, token) routing steps where both engines chose the same expert set."""
    return float(np.mean(np.all(np.sort(a, -1) == np.sort(b, -1), -1)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="'default', a moejax folder or a Hugging Face folder")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both engines compute in it")
    ap.add_argument("--torch-device", default="auto", help="'auto' (cuda when torch sees a GPU), 'cpu' or 'cuda'")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024, help="chunk length in tokens, BOS included")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lam", type=float, default=0.5, help="cache-prior λ")
    ap.add_argument("--top-j", type=int, default=None, help="cache-prior top-J (default: moejax.experts.routing.default_top_j)")
    ap.add_argument("--cache-size", default="0.5", help="per-layer LRU capacity: fraction of N ('0.5') or count")
    ap.add_argument("--sweep-points", type=int, default=0, help="also time an N-point λ sweep, vmapped vs N passes")
    ap.add_argument("--skip-plain", action="store_true", help="skip pass 1 (plain) and its transformers run")
    ap.add_argument("--route-on", choices=("auto", "host", "device"), default="auto",
                    help="where moejax's cache pass runs each layer's routing scan (auto: the host CPU when the "
                         "model is on an accelerator)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads and CPUs the process may use")
    ap.add_argument("--hf-experts", choices=("eager", "grouped_mm", "batched_mm"), default=None,
                    help="transformers experts implementation (default: transformers' own, grouped_mm)")
    ap.add_argument("--out", default="bench/results/teacher_forced.json")
    args = ap.parse_args()
    if args.sweep_points < 0 or args.sweep_points == 1:
        ap.error("--sweep-points must be 0 (no sweep) or at least 2")
    cpus = pin_cpus(args.threads)

    import jax
    import torch
    import transformers

    import moejax
    from moejax.experts import capacity as capacity_lib
    from moejax.models import convert
    from moejax.experts import routing
    from moejax.runtime import simulate

    torch.set_num_threads(args.threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.torch_device == "auto" else args.torch_device
    model = moejax.load(args.model, dtype=args.dtype)
    _log(f"loaded {args.model} on {jax.default_backend()}; torch on {device}")
    cfg = model.cfg
    try:
        chunks, tokens_from = wikitext_chunks(model, args.chunks, args.context), "WikiText-2 test"
    except (AttributeError, TypeError, ValueError, OSError) as e:  # no tokenizer (random checkpoint), no text
        print(f"note: random token ids ({type(e).__name__}: {e})", file=sys.stderr)
        chunks, tokens_from = random_chunks(model, args.chunks, args.context), "random ids (seed 0)"
    n_tokens = sum(len(c) for c in chunks)
    top_j = routing.default_top_j(cfg.top_k) if args.top_j is None else args.top_j
    policy = routing.make_policy("cache-prior", cfg.top_k, lam=args.lam, top_j=top_j)
    cache_cfg = simulate.CacheConfig(str(args.cache_size), "layer", "lru")
    capacity = capacity_lib.parse_capacity(str(args.cache_size), cfg.n_experts)

    if is_hf_folder(args.model):
        hf_model = load_transformers(args.model, args.hf_experts, args.dtype, device)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = convert.convert("moejax-to-hf", args.model, os.path.join(tmp, "hf"), dtype=args.dtype)
            hf_model = load_transformers(hf_dir, args.hf_experts, args.dtype, device)

    _log("transformers model ready")

    def figures(seconds, times, logits, extra=None):
        nll = mean_nll(logits, chunks)
        return {"seconds": seconds, "times_s": times, "tokens_per_s": n_tokens / seconds, "nll_per_token": nll,
                "ppl": math.exp(nll), **(extra or {})}

    # 1. plain pass
    plain = None
    if not args.skip_plain:
        t, ts, mj_logits = timed(lambda: moejax_plain(model, chunks), args.repeats, "moejax plain")
        mj_plain = figures(t, ts, mj_logits)
        t, ts, hf_logits = timed(lambda: transformers_logits(hf_model, chunks), args.repeats,
                                  "transformers plain")
        hf_plain = figures(t, ts, hf_logits)
        plain = compare("plain", mj_plain, hf_plain, args.dtype)
        plain["max_abs_logit_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(mj_logits, hf_logits))
        del mj_logits, hf_logits

    # 2. cache-prior + LRU pass
    route_on_host = {"auto": None, "host": True, "device": False}[args.route_on]
    t, ts, (mj_logits, mj_chosen, stats) = timed(lambda: moejax_cache(model, chunks, policy, cache_cfg, route_on_host),
                                                 args.repeats, "moejax cache pass")
    mj_cache = figures(t, ts, mj_logits, {"miss_rate": stats["miss_rate"], "misses": stats["misses"],
                                          "accesses": stats["accesses"]})
    hooks = install_hooks(hf_model, capacity, args.lam, top_j)
    t, ts, (hf_logits, hf_chosen, hf_stats) = timed(lambda: transformers_cache(hf_model, hooks, chunks),
                                                    args.repeats, "transformers + hook")
    hf_cache = figures(t, ts, hf_logits, hf_stats)
    cached = compare("cache-prior + LRU", mj_cache, hf_cache, args.dtype)
    cached["max_abs_logit_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(mj_logits, hf_logits))
    cached["same_expert_sets"] = set_agreement(mj_chosen, hf_chosen)
    del mj_logits, hf_logits

    # 3. λ sweep: one vmapped pass vs one pass per point
    swept = None
    if args.sweep_points:
        lams = np.linspace(0.0, 1.0, args.sweep_points).tolist()
        policies = [routing.make_policy("cache-prior", cfg.top_k, lam=lam, top_j=top_j) for lam in lams]
        t_seq, ts_seq, seq = timed(lambda: sweep_sequential(model, chunks, policies, cache_cfg), args.repeats,
                                    "sweep, passes")
        t_vm, ts_vm, vm = timed(lambda: sweep_vmapped(model, chunks, policies, cache_cfg), args.repeats,
                                 "sweep, vmapped")
        ppl_diff = max(abs(math.exp(a[0]) - math.exp(b[0])) / math.exp(a[0]) for a, b in zip(seq, vm))
        miss_diff = max(abs(a[1] - b[1]) for a, b in zip(seq, vm))
        swept = {"points": args.sweep_points, "lams": lams, "sequential_s": t_seq, "sequential_times_s": ts_seq,
                 "vmapped_s": t_vm, "vmapped_times_s": ts_vm, "ratio_vmapped_over_sequential": t_seq / t_vm,
                 "point_tokens_per_s_sequential": args.sweep_points * n_tokens / t_seq,
                 "point_tokens_per_s_vmapped": args.sweep_points * n_tokens / t_vm,
                 "ppl": [math.exp(nll) for nll, _ in vm], "miss_rate": [m for _, m in vm],
                 "max_ppl_rel_diff": ppl_diff, "max_miss_rate_abs_diff": miss_diff,
                 "agree": bool(ppl_diff <= PPL_RTOL[args.dtype] and miss_diff <= MISS_ATOL[args.dtype])}
        if not swept["agree"]:
            print(f"!!!!!!!! WARNING: the vmapped sweep and the sequential passes differ (ppl rel {ppl_diff:.2e}, "
                  f"miss rate {miss_diff:.2e}) !!!!!!!!", file=sys.stderr)

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    result = {
        "benchmark": f"teacher-forced pass, {args.model} ({cfg.model_type}, {cfg.num_layers} layers, {cfg.n_experts} "
                     f"experts, top-{cfg.top_k}), {args.dtype}, {tokens_from} chunks",
        "model": args.model, "dtype": args.dtype, "tokens_from": tokens_from,
        "chunks": args.chunks, "context": args.context, "tokens": n_tokens, "repeats": args.repeats,
        "routing": {"kind": "cache-prior", "lam": args.lam, "top_j": top_j, "route_on": args.route_on},
        "cache": {"size": str(args.cache_size), "capacity_per_layer": capacity, "scope": "layer", "eviction": "lru",
                  "carried_across_chunks": True},
        "plain": plain, "cache_prior_lru": cached, "lambda_sweep": swept,
        "goals": {"plain_ratio_ge_2": None if plain is None else plain["ratio_moejax_over_transformers"] >= 2.0,
                  "cache_ratio_ge_3": cached["ratio_moejax_over_transformers"] >= 3.0,
                  "sweep_ratio_ge_3": None if swept is None else swept["ratio_vmapped_over_sequential"] >= 3.0},
        "jax_devices": [str(d) for d in jax.devices()], "torch_device": device, "gpu": gpu,
        "cpu": cpu_model(), "cpus_used": cpus, "torch_threads": torch.get_num_threads(),
        "transformers_experts_implementation": getattr(hf_model.config, "_experts_implementation", None),
        "transformers_attn_implementation": getattr(hf_model.config, "_attn_implementation", None),
        "versions": {"python": platform.python_version(), "moejax": moejax.__version__, "jax": jax.__version__,
                     "jax_backend": jax.default_backend(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "numpy": np.__version__},
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "command": " ".join(["python", *sys.argv]),
    }
    print(f"teacher-forced, {args.chunks} x {args.context} tokens ({tokens_from}), {args.dtype}, jax on "
          f"{jax.devices()[0].platform}, torch on {device} ({args.threads} threads), transformers experts: "
          f"{result['transformers_experts_implementation']}")
    print(f"{'pass':<20} {'transformers tok/s':>19} {'moejax tok/s':>13} {'ratio':>7} {'ppl tf':>9} "
          f"{'ppl moejax':>10} {'miss tf':>8} {'miss mj':>8}")
    for name, r in (("plain", plain), ("cache-prior + LRU", cached)):
        if r is None:
            continue
        hf, mj = r["transformers"], r["moejax"]
        miss = (f"{hf['miss_rate']:8.4f} {mj['miss_rate']:8.4f}" if "miss_rate" in mj else f"{'-':>8} {'-':>8}")
        print(f"{name:<20} {hf['tokens_per_s']:19.1f} {mj['tokens_per_s']:13.1f} "
              f"{r['ratio_moejax_over_transformers']:6.2f}x {hf['ppl']:9.3f} {mj['ppl']:10.3f} {miss}")
    print(f"same expert sets (cache pass): {100 * cached['same_expert_sets']:.3f}% of routing steps | max |Δlogit| "
          + (f"plain {plain['max_abs_logit_diff']:.1e}, " if plain else "") + f"cache {cached['max_abs_logit_diff']:.1e}")
    if swept:
        print(f"λ sweep, {swept['points']} points: {swept['sequential_s']:.2f} s as {swept['points']} passes, "
              f"{swept['vmapped_s']:.2f} s vmapped: {swept['ratio_vmapped_over_sequential']:.2f}x "
              f"(points agree: {swept['agree']})")
    from moejax.base import atomic  # imported late, like moejax itself here
    atomic.write_json(args.out, result, sort_keys=False, make_parents=True)
    agree = (plain is None or plain["agree"]) and cached["agree"] and (swept is None or swept["agree"])
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
