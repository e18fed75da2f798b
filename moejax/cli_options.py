"""Routing-policy and expert-cache command-line options, shared by generate, evaluate and trace."""

from __future__ import annotations

import argparse

from moejax import cache as cache_lib
from moejax import routing as routing_lib


def add_routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing policy (DESIGN §2)")
    g.add_argument("--routing", choices=routing_lib.KINDS, default=None,
                   help="expert ranking policy (default: original); any routing option turns the cache on")
    g.add_argument("--lam", type=float, default=0.5, help="cache-prior strength λ (default 0.5)")
    g.add_argument("--top-j", type=int, default=None, help="always keep the top-J (default 1 if K=2 else 2)")
    g.add_argument("--max-rank", type=int, default=None, help="max-rank M (default K)")
    g.add_argument("--cumsum-p", type=float, default=0.9, help="cumsum probability threshold p (default 0.9)")
    g.add_argument("--prune-h", type=int, default=None, help="pruning: keep ranks 1..h-1 (default K)")
    g.add_argument("--delta", type=float, default=None,
                   help="cache-prior: fixed calibrated Δ instead of the running mean of max(z)-min(z)")
    g.add_argument("--prior", default=None, metavar="PATH",
                   help="learned-prior: checkpoint folder written by `python -m moejax.train_prior`")
    c = p.add_argument_group("expert cache")
    c.add_argument("--cache-size", default=None,
                   help="capacity: a count ('6') or, with a decimal point, a fraction of N ('0.5'); "
                        "in global scope of all L·N experts (default 0.5 when a cache is on)")
    c.add_argument("--cache-scope", choices=cache_lib.SCOPES, default="layer")
    c.add_argument("--eviction", choices=[e for e in cache_lib.EVICTIONS if e != "belady"], default="lru",
                   help="eviction policy (Belady is an offline oracle: use `moejax.trace replay`)")
    c.add_argument("--cache-init", choices=cache_lib.INITS, default="empty")
    c.add_argument("--cache-seed", type=int, default=0, help="seed of --cache-init random")


def cache_requested(args: argparse.Namespace) -> bool:
    # a --prior without --routing still goes through policy_from_args, which rejects it (never silently ignored)
    return args.routing is not None or args.cache_size is not None or getattr(args, "prior", None) is not None


def policy_from_args(args: argparse.Namespace, top_k: int) -> routing_lib.RoutingPolicy:
    prior_path = getattr(args, "prior", None)
    params = None
    if args.routing == "learned-prior":
        if not prior_path:
            raise ValueError("--routing learned-prior needs --prior PATH (a checkpoint folder written by "
                             "`python -m moejax.train_prior`)")
        from moejax import prior as prior_lib

        params = prior_lib.load_prior(prior_path, top_k=top_k)  # N and layers are checked against the model
    elif prior_path:
        raise ValueError("--prior only applies to --routing learned-prior "
                         f"(got --routing {args.routing or 'original'})")
    return routing_lib.make_policy(args.routing or "original", top_k, lam=args.lam, top_j=args.top_j,
                                   max_rank=args.max_rank, cumsum_p=args.cumsum_p, prune_h=args.prune_h,
                                   delta=args.delta, prior=params)


def cache_from_args(args: argparse.Namespace):
    from moejax.simulate import CacheConfig

    return CacheConfig(size=str(args.cache_size or "0.5"), scope=args.cache_scope, eviction=args.eviction,
                       init=args.cache_init, seed=args.cache_seed)


def describe(args: argparse.Namespace) -> dict:
    """The routing/cache settings of a run, for tables and JSON."""
    return {"routing": args.routing or "original", "lam": args.lam, "top_j": args.top_j,
            "max_rank": args.max_rank, "cumsum_p": args.cumsum_p, "prune_h": args.prune_h, "delta": args.delta,
            "cache_size": args.cache_size or "0.5", "scope": args.cache_scope, "eviction": args.eviction,
            "cache_init": args.cache_init, "prior": getattr(args, "prior", None)}
