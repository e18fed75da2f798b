"""Train the learned cache prior (paper appendix E; ``moejax.experts.prior``) with optax.

    python -m moejax.train_prior --out PRIORS [--model default] [--cache-size 0.5] [--weights 0.1,0.3,1,3]
        [--shards 0] [--tokens 65536] [--context 1024] [--steps 1500] [--batch 512] [--resume]

1. Record. The model reads training text — documents of the corpus shard(s) ``--shards`` (``moejax.training.data``;
   the last shard, 07, is the held-out validation split and is refused; WikiText is never used) —
   tokenised with the model's tokenizer, every document preceded by BOS as in training, cut into chunks of
   ``--context`` tokens. It runs with ORIGINAL routing and a per-layer LRU cache of ``--cache-size`` carried
   across chunks (as the evaluation does), and for every token and MoE layer the (router logits z, cache
   bitmask m before routing) pair is kept. The bitmasks are obtained by replaying the router step on the
   recorded logits from the same cache state; the replay's experts are checked against the forward pass.
2. Train. Per weight w, from the same zero-output initialisation (b = 0: original routing), AdamW on

       q = softmax(z + b(m, z)),  p = softmax(z),  T = top-K of z (the architecture's own ranking)
       L_cache = Σ_{i ∈ C \\ T} (1 − q_i)² + Σ_{i ∈ T \\ C} q_i²      (appendix E: in-cache-not-top-K
                                                                     experts pulled towards 1, top-K-not-
                                                                     in-cache experts towards 0)
       L = KL(p ‖ q) + w · L_cache                                   (KL keeps the original distribution)

   averaged over tokens and layers. The paper states the two pushes on the softmax outputs but no formula;
   squared error to 1 / 0 is the literal reading, and the KL term is what makes w a trade-off (w → 0
   gives b → 0, original routing; large w gives cache-driven routing). The last ``--holdout`` fraction of
   the recorded tokens is not trained on and gives the reported held-out losses.
3. Save. One checkpoint folder per weight, ``OUT/w<weight>`` (orbax params + ``prior.json`` sidecar with the
   MLP architecture, N, layers, cache size, weight, steps and losses), written atomically. ``--resume``
   reuses a matching recording (``OUT/record.npz``) and skips weights whose checkpoint already matches.

Use a checkpoint with ``--routing learned-prior --prior OUT/w1`` (generate, evaluate) or
``routing.make_policy("learned-prior", K, prior=prior.load_prior("OUT/w1"))``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from moejax.base import atomic, collector, commands, errors, flags, interrupts, seeds
from moejax.experts import cache as cache_lib, prior as prior_lib, router as router_lib, routing as routing_lib
from moejax.experts.trace import json_safe
from moejax.runtime import api, simulate
from moejax.training import data

RECORD_FILE = "record.npz"
RECORD_META = "record.json"


# ------------------------------------------------------------------------------------------- record


def training_tokens(model: api.Model, shard_paths: list[str], n_tokens: int) -> np.ndarray:
    """The first ``n_tokens`` tokens of the shards' documents, each document preceded by BOS (as trained)."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer.json: recording training text needs one")
    parts, total = [], 0
    for path in shard_paths:
        for doc in data.iter_documents(path):
            ids = model.tokenizer.encode(doc, add_special_tokens=True)
            if not ids or ids[0] != model.cfg.bos_token_id:
                ids = [model.cfg.bos_token_id] + list(ids)
            parts.append(np.asarray(ids, np.int32))
            total += len(ids)
            if total >= n_tokens:
                return np.concatenate(parts)[:n_tokens]
    raise ValueError(f"the shards {[os.path.basename(p) for p in shard_paths]} hold only {total} tokens, "
                     f"fewer than --tokens {n_tokens}")


@functools.partial(jax.jit, static_argnames=("gating",))
def replay_masks(z: jax.Array, cache_state, routing_state, policy, gating):
    """Route z [T, L, N] through a per-layer cache exactly as ``router.route_layers_parallel`` does, and
    return the cache bitmask each step saw before routing, m [T, L, N], and the experts chosen [T, L, K]."""
    split_cs = cache_lib.split_layers(cache_state)
    split_rs = jax.tree.map(lambda a: a[:, None], routing_state)
    split = routing_lib.split_policy_layers(policy)

    def one_layer(z_l, cs, rs, per_layer):
        pol = policy.replace(**per_layer)

        def step(carry, z_t):
            cs, rs = carry
            mask = cache_lib.resident_mask(cs, 0)
            experts, _, _, cs, rs = router_lib.router_step(z_t, cs, rs, pol, gating, 0)
            return (cs, rs), (mask, experts)

        return lax.scan(step, (cs, rs), z_l)[1]

    return jax.vmap(one_layer, in_axes=(1, 0, 0, 0), out_axes=1)(z, split_cs, split_rs, split)


def record(model: api.Model, ids: np.ndarray, context: int, cache: simulate.CacheConfig, policy=None,
           progress: bool = False) -> dict:
    """(logits z [T, L, N] f32, bitmask m [T, L, N] bool) for every token of ``ids`` (module docstring, 1)."""
    if cache.scope != "layer":
        raise ValueError("the learned prior is recorded with a per-layer cache (the paper's setting)")
    policy = policy or routing_lib.original()
    state = model.router_state(policy, cache)
    zs, ms = [], []
    chunks = [ids[i:i + context] for i in range(0, len(ids), context)]
    chunks = [c for c in chunks if len(c) > 0]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc="record", unit="tok", file=sys.stderr)
    for chunk in chunks:
        out = model.forward(chunk, state=state)
        z = np.asarray(out.router_logits, np.float32).transpose(1, 0, 2)  # [T, L, N]
        masks, experts = replay_masks(jnp.asarray(z), state["cache"], state["routing"], policy,
                                      gating=model.cfg.gating)
        if not np.array_equal(np.asarray(experts), out.experts.transpose(1, 0, 2)):
            raise RuntimeError("replaying the router on the recorded logits did not reproduce the forward "
                               "pass's experts; the recorded cache masks would be wrong")
        zs.append(z)
        ms.append(np.asarray(masks, bool))
        state = out.state
        if bar:
            bar.update(len(chunk))
    if bar:
        bar.close()
    stats = simulate.summarize(state, model.params, model.cfg)
    return {"z": np.concatenate(zs), "m": np.concatenate(ms), "miss_rate": float(stats["miss_rate"])}


# -------------------------------------------------------------------------------------------- train


def targets(z: jax.Array, m: jax.Array, gating, bias=None) -> tuple[jax.Array, jax.Array]:
    """(up, down) [..., N]: cached but not in the original top-K / in the top-K but not cached (``bias``: the
    model's selection biases [L, N], for the gatings that have them)."""
    k = gating.top_k
    ranking = gating.ranking(z, bias)
    top = jnp.any(jnp.arange(z.shape[-1]) == ranking[..., :k, None], axis=-2)
    return m & ~top, top & ~m


def loss_terms(params: dict, z: jax.Array, up: jax.Array, down: jax.Array, m: jax.Array) -> dict:
    """Mean over tokens and layers of KL(p‖q) and L_cache (module docstring, 2); z etc. [B, L, N]."""
    b = prior_lib.bias_all_layers(params, z, m)
    logp = jax.nn.log_softmax(z, -1)
    logq = jax.nn.log_softmax(z + b, -1)
    q = jnp.exp(logq)
    kl = jnp.sum(jnp.exp(logp) * (logp - logq), -1)
    cache_term = jnp.sum(jnp.where(up, (1.0 - q) ** 2, 0.0) + jnp.where(down, q ** 2, 0.0), -1)
    return {"kl": kl.mean(), "cache": cache_term.mean()}


def total_loss(params, weight, z, up, down, m):
    t = loss_terms(params, z, up, down, m)
    return t["kl"] + weight * t["cache"], t


@functools.lru_cache(maxsize=16)
def make_optimizer(lr: float, steps: int, weight_decay: float):
    """AdamW with warm-up and cosine decay; cached, so equal settings share one compiled training step."""
    warmup = max(1, min(100, steps // 10))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=weight_decay))


@functools.partial(jax.jit, static_argnames=("opt", "n_steps", "batch"))
def train_chunk(params, opt_state, key, weight, z, up, down, m, opt, n_steps: int, batch: int):
    """``n_steps`` AdamW steps on random minibatches of ``batch`` tokens (all layers each)."""

    def step(carry, k):
        params, opt_state = carry
        idx = jax.random.randint(k, (batch,), 0, z.shape[0])
        (loss, _), grads = jax.value_and_grad(total_loss, has_aux=True)(params, weight, z[idx], up[idx],
                                                                         down[idx], m[idx])
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    (params, opt_state), losses = lax.scan(step, (params, opt_state), jax.random.split(key, n_steps))
    return params, opt_state, losses


@jax.jit
def _eval_batch(params, weight, z, up, down, m):
    loss, t = total_loss(params, weight, z, up, down, m)
    return {"loss": loss, **t}


def evaluate_loss(params, weight, z, up, down, m, batch: int = 4096) -> dict:
    """Mean loss terms over a whole (held-out) set, in batches."""
    sums, n = {}, 0
    for s in range(0, z.shape[0], batch):
        out = _eval_batch(params, jnp.float32(weight), z[s:s + batch], up[s:s + batch], down[s:s + batch],
                          m[s:s + batch])
        w = min(batch, z.shape[0] - s)
        for k, v in out.items():
            sums[k] = sums.get(k, 0.0) + float(v) * w
        n += w
    return {k: v / max(n, 1) for k, v in sums.items()}


@functools.partial(jax.jit, static_argnames=("gating",))
def _static_choice(params, z, m, gating, bias=None):
    """Top-K of z + b against the recorded (fixed) cache masks: share cached, share changed vs original."""
    b = prior_lib.bias_all_layers(params, z, m)
    zb = jnp.where(jnp.isfinite(z), z + b, z)
    k = gating.top_k
    n = z.shape[-1]
    top_new = jnp.any(jnp.arange(n) == gating.ranking(zb, bias)[..., :k, None], axis=-2)
    top_old = jnp.any(jnp.arange(n) == gating.ranking(z, bias)[..., :k, None], axis=-2)
    return (jnp.sum(top_new & m) / jnp.sum(top_new), jnp.sum(top_old & m) / jnp.sum(top_old),
            jnp.sum(top_new & ~top_old) / jnp.sum(top_old))


def train_one(init: dict, weight: float, z, up, down, m, *, steps: int, batch: int, lr: float,
              weight_decay: float, seed: int, log=print) -> tuple[dict, list[float]]:
    """Train one prior from ``init``; returns (params, mean training loss per logged block)."""
    opt = make_optimizer(lr, steps, weight_decay)
    params, opt_state = init, opt.init(init)
    key = seeds.prng_key(seed, typed=True)
    block = max(1, min(250, steps))
    curve, done = [], 0
    while done < steps:
        n = min(block, steps - done)
        key, sub = jax.random.split(key)
        params, opt_state, losses = train_chunk(params, opt_state, sub, jnp.float32(weight), z, up, down, m,
                                                opt=opt, n_steps=n, batch=batch)
        done += n
        curve.append(float(jnp.mean(losses)))
        log(f"  w={weight:g} step {done}/{steps} train loss {curve[-1]:.5f}")
    return params, curve


# ------------------------------------------------------------------------------------------------ CLI


def weight_name(weight: float) -> str:
    return f"w{weight:g}"


def _record_key(args, model: api.Model, shard_paths: list[str], capacity: int) -> dict:
    return {"model": model.path, "shards": [os.path.basename(p) for p in shard_paths], "tokens": args.tokens,
            "context": args.context, "cache_size": args.cache_size, "capacity": capacity,
            "eviction": args.eviction, "routing": "original"}


def _train_key(args, weight: float, record_key: dict) -> dict:
    return {"weight": weight, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "weight_decay": args.weight_decay, "hidden": args.hidden, "seed": args.seed,
            "holdout": args.holdout, "record": record_key}


def _load_record(out: str, key: dict):
    """The recorded routing of an earlier run with the same ``key`` (None: none, or another key). A damaged
    record is only a cache of work: it is reported on stderr and recorded again, never a traceback."""
    meta_path, path = os.path.join(out, RECORD_META), os.path.join(out, RECORD_FILE)
    if not (os.path.isfile(meta_path) and os.path.isfile(path)):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or meta.get("key") != key:
            return None
        with np.load(path, allow_pickle=False) as f:
            rec = {"z": np.asarray(f["z"]), "m": np.asarray(f["m"]), "miss_rate": float(meta["miss_rate"])}
        if rec["z"].shape != rec["m"].shape or rec["z"].ndim != 3 or list(rec["z"].shape) != meta.get("shape"):
            raise ValueError(f"arrays of shapes {rec['z'].shape} and {rec['m'].shape} do not match")
        return rec
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        print(f"note: {path}: damaged routing record ignored, recording again ({type(e).__name__}: "
              f"{(str(e).splitlines() or [''])[0][:200]})", file=sys.stderr)
        return None


RECORD_META_KEYS = frozenset(("key", "miss_rate", "seconds", "shape"))  # what ``_save_record`` writes
RECORD_ARRAYS = frozenset(("z.npy", "m.npy"))


def _is_own_meta(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "key" in meta and set(meta) <= RECORD_META_KEYS


def _is_own_arrays(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            return set(z.namelist()) == RECORD_ARRAYS
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return False


def check_record_files(out: str) -> None:
    """Refuse, before the work, an ``OUT/record.json`` or ``OUT/record.npz`` that is not this command's
    recording: re-recording replaces both. A damaged ``record.npz`` beside its own ``record.json`` is still
    ours (``_load_record`` records it again)."""
    meta_path, path = os.path.join(out, RECORD_META), os.path.join(out, RECORD_FILE)
    own_meta = os.path.isfile(meta_path) and _is_own_meta(meta_path)
    for p, own in ((meta_path, own_meta), (path, own_meta or _is_own_arrays(path))):
        if os.path.lexists(p) and not (own and os.path.isfile(p) and not os.path.islink(p)):
            raise errors.UsageError(f"--out {out}: {p} exists and is not a train_prior recording: refusing to "
                                    "replace it (move it away or choose another --out)")


def _save_record(out: str, key: dict, rec: dict, seconds: float) -> None:
    atomic.save_npz(os.path.join(out, RECORD_FILE), z=rec["z"], m=rec["m"])
    atomic.write_json(os.path.join(out, RECORD_META),
                      {"key": key, "miss_rate": rec["miss_rate"], "seconds": seconds, "shape": list(rec["z"].shape)})


def parse_weights(text: str) -> list[float]:
    try:
        weights = [float(w) for w in text.split(",") if w.strip()]
    except ValueError as e:
        raise ValueError(f"--weights must be comma-separated numbers, got {text!r}") from e
    if not weights or any(not np.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"--weights must be finite and >= 0, got {text!r}")
    twice = sorted({w for w in weights if weights.count(w) > 1})
    if twice:  # one checkpoint per weight: a second one would only train the same prior again
        raise errors.UsageError(f"--weights {text!r} names {', '.join(f'{w:g}' for w in twice)} twice")
    return weights


def parse_shards(text: str, corpus_dir: str) -> list[str]:
    train_paths, val_path = data.split_shards(corpus_dir)
    out = []
    for part in text.split(","):
        try:
            i = int(part)
        except ValueError as e:
            raise ValueError(f"--shards must be comma-separated shard numbers, got {text!r}") from e
        if i == len(train_paths):
            raise ValueError(f"shard {i:02d} ({os.path.basename(val_path)}) is the held-out validation split")
        if not 0 <= i < len(train_paths):
            raise ValueError(f"shard {i} does not exist (training shards are 0..{len(train_paths) - 1})")
        if train_paths[i] in out:
            raise ValueError(f"--shards names shard {i} twice")
        out.append(train_paths[i])
    return out


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values the recording or training cannot run with (NaN included)."""
    for name in ("tokens", "context", "steps", "batch", "hidden"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0.0 <= args.holdout < 1.0:
        raise ValueError(f"--holdout must be in [0, 1), got {args.holdout}")
    if not (np.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a finite number > 0, got {args.lr}")
    if not (np.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise ValueError(f"--weight-decay must be a finite number >= 0, got {args.weight_decay}")
    if os.path.lexists(args.out) and not os.path.isdir(args.out):
        raise errors.UsageError(f"--out {args.out} exists and is not a folder")


def run(args: argparse.Namespace, log=print) -> dict:
    weights = parse_weights(args.weights)
    check_args(args)
    shard_paths = parse_shards(args.shards, data.corpus_folder(args.corpus, "--corpus"))
    for weight in weights:  # before the work: a folder in the way is refused, not found after an hour
        prior_lib.check_replaceable(os.path.join(args.out, weight_name(weight)))
    check_record_files(args.out)
    model = api.load(args.model)
    cfg = model.cfg
    cache = model.resolve_cache(simulate.CacheConfig(str(args.cache_size), "layer", args.eviction), False)
    capacity = cache.capacity(cfg)
    os.makedirs(args.out, exist_ok=True)

    rkey = _record_key(args, model, shard_paths, capacity)
    rec = _load_record(args.out, rkey) if args.resume else None
    record_seconds = 0.0
    if rec is None:
        t0 = time.perf_counter()
        ids = training_tokens(model, shard_paths, args.tokens)
        log(f"recording {len(ids)} tokens of {', '.join(os.path.basename(p) for p in shard_paths)} with "
            f"original routing, LRU cache {capacity}/{cfg.n_experts} per layer ...")
        rec = record(model, ids, args.context, cache, progress=args.progress)
        record_seconds = time.perf_counter() - t0
        _save_record(args.out, rkey, rec, record_seconds)
        log(f"recorded z, m {rec['z'].shape} in {record_seconds:.1f} s (LRU miss rate {rec['miss_rate']:.4f})")
    else:
        log(f"reusing the recording in {args.out} ({rec['z'].shape[0]} tokens)")

    n_tok = rec["z"].shape[0]
    n_train = max(1, int(round(n_tok * (1.0 - args.holdout))))
    z_all = jnp.asarray(rec["z"])
    m_all = jnp.asarray(rec["m"])
    bias = model.selection_biases
    up_all, down_all = jax.jit(targets, static_argnames=("gating",))(z_all, m_all, gating=cfg.gating, bias=bias)
    tr = (z_all[:n_train], up_all[:n_train], down_all[:n_train], m_all[:n_train])
    ho = (z_all[n_train:], up_all[n_train:], down_all[n_train:], m_all[n_train:]) if n_train < n_tok else tr

    init = prior_lib.init_params(seeds.prng_key(args.seed, typed=True), cfg.n_moe_layers, cfg.n_experts, args.hidden)
    results = []
    for weight in weights:
        path = os.path.join(args.out, weight_name(weight))
        tkey = _train_key(args, weight, rkey)
        if args.resume and os.path.isdir(path):
            try:
                meta = prior_lib.read_sidecar(path)
            except prior_lib.PriorError:
                meta = {}
            if meta.get("train_key") == tkey:
                log(f"{path}: already trained with these settings, skipped (--resume)")
                results.append({"weight": weight, "path": path, "skipped": True, **meta.get("loss", {})})
                continue
        before = {"train": evaluate_loss(init, weight, *tr), "holdout": evaluate_loss(init, weight, *ho)}
        t0 = time.perf_counter()
        params, curve = train_one(init, weight, *tr, steps=args.steps, batch=args.batch, lr=args.lr,
                                  weight_decay=args.weight_decay, seed=args.seed + 1, log=log)
        params = jax.block_until_ready(params)
        seconds = time.perf_counter() - t0
        after = {"train": evaluate_loss(params, weight, *tr), "holdout": evaluate_loss(params, weight, *ho)}
        share_new, share_old, changed = (float(x) for x in _static_choice(params, ho[0], ho[3], gating=cfg.gating,
                                                                                 bias=bias))
        meta = {
            "model": model.path, "top_k": cfg.top_k, "n_experts": cfg.n_experts, "n_layers": cfg.n_moe_layers,
            "cache": {"size": str(args.cache_size), "capacity": capacity, "eviction": args.eviction,
                      "scope": "layer"},
            "weight": weight, "steps": args.steps, "batch": args.batch, "lr": args.lr,
            "weight_decay": args.weight_decay, "seed": args.seed, "optimizer": "adamw (warmup-cosine, clip 1.0)",
            "loss_formula": "KL(softmax(z) || softmax(z+b)) + weight * [sum_{cached, not top-K} (1-q)^2 + "
                            "sum_{top-K, not cached} q^2], q = softmax(z+b)",
            "data": {"shards": rkey["shards"], "tokens": n_tok, "train_tokens": n_train,
                     "holdout_tokens": n_tok - n_train, "context": args.context,
                     "recorded_routing": "original", "recorded_lru_miss_rate": rec["miss_rate"]},
            "loss": {"before": before, "after": after, "final": after["train"]["loss"],
                     "final_holdout": after["holdout"]["loss"], "curve": curve},
            "holdout_static": {"top_k_cached_share_prior": share_new, "top_k_cached_share_original": share_old,
                               "top_k_changed_share": changed},
            "train_seconds": seconds, "record_seconds": record_seconds, "train_key": tkey,
        }
        prior_lib.save_prior(path, params, meta)
        log(f"{path}: loss {before['train']['loss']:.5f} -> {after['train']['loss']:.5f} (held-out "
            f"{before['holdout']['loss']:.5f} -> {after['holdout']['loss']:.5f}; KL {after['holdout']['kl']:.5f}, "
            f"cache term {before['holdout']['cache']:.4f} -> {after['holdout']['cache']:.4f}); static top-K "
            f"cached {share_old:.3f} -> {share_new:.3f}; {seconds:.1f} s")
        results.append({"weight": weight, "path": path, "seconds": seconds, "before": before, "after": after,
                        "holdout_static": meta["holdout_static"]})
    return {"out": os.path.abspath(args.out), "record_seconds": record_seconds, "tokens": n_tok,
            "priors": results}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("train-prior"), description=__doc__,
                                formatter_class=commands.HelpFormatter)
    p.add_argument("--out", required=True, help="folder for the recording and one checkpoint per weight")
    p.add_argument("--model", default=api.DEFAULT_MODEL_NAME)
    p.add_argument("--weights", type=flags.FloatList(flags.finite_float(0.0, 1e6), as_text=True),
                   default="0.1,0.3,1,3", help="comma-separated trade-off weights w")
    p.add_argument("--corpus", default=None, help="corpus folder (moejax.training.data layout; default: "
                   "$MOEJAX_DATA/corpus)")
    p.add_argument("--resume", action="store_true",
                   help="reuse a matching recording and skip weights whose checkpoint already matches")
    p.add_argument("--json", action="store_true", help="print one JSON summary at the end")
    p.add_argument("--progress", action="store_true", help="progress bar while recording")
    g1 = p.add_argument_group("the cache the routing is recorded under")
    g1.add_argument("--cache-size", default="0.5", help="LRU capacity per layer: a count, a fraction of N or a memory size ('400MB')")
    g1.add_argument("--eviction", choices=cache_lib.ONLINE_EVICTIONS, default="lru")
    g2 = p.add_argument_group("what is recorded")
    g2.add_argument("--shards", default="0", help="training shard numbers, comma-separated (07 is held out)")
    g2.add_argument("--tokens", type=int, default=65536, help="training-text tokens to record")
    g2.add_argument("--context", type=int, default=1024, help="chunk length of the recording passes")
    g2.add_argument("--holdout", type=flags.finite_float(0.0, 1.0, high_open=True),
                    default=0.1, help="last fraction of recorded tokens kept out")
    g3 = p.add_argument_group("training the prior")
    g3.add_argument("--steps", type=int, default=1500)
    g3.add_argument("--batch", type=int, default=512, help="tokens per step (each with all its MoE layers)")
    g3.add_argument("--lr", type=flags.finite_float(0.0, 10.0, low_open=True), default=3e-3)
    g3.add_argument("--weight-decay", type=flags.finite_float(0.0, 100.0), default=1e-4)
    g3.add_argument("--hidden", type=int, default=64, help="hidden units of each layer's MLP")
    g3.add_argument("--seed", type=errors.seed_arg, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    collector.for_compiling()

    args = build_parser().parse_args(argv)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    made = atomic.missing_folders(args.out)
    try:
        res = run(args, log=log)
    except errors.HANDLED as e:
        atomic.remove_empty_folders(made)
        return errors.report(e)
    except BaseException:
        atomic.remove_empty_folders(made)
        raise
    return errors.print_result(json.dumps(json_safe(res))) if args.json else 0


if __name__ == "__main__":
    sys.exit(main())
