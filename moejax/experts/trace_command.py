"""``moejax trace``: replay a routing trace through expert caches, or write a synthetic one (the trace format and
the replay itself: ``moejax.experts.trace``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

from moejax.base import atomic, collector, commands, errors, flags, interrupts
from moejax.models.config import MAX_EXPERTS
from moejax.experts import cache as cache_lib, prior as prior_lib, routing as routing_lib
from moejax.experts import trace as trace_lib

GATING_FLAGS = ("top_k", "normalize", "scale", "n_group", "topk_group", "jitter_eps")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_replay_args(args) -> None:
    """Refuse replay flag values and combinations before the trace is read."""
    if args.expert_bytes is not None and args.expert_bytes < 1:
        raise ValueError(f"--expert-bytes must be a positive byte count, got {args.expert_bytes}")
    given = [_flag(n) for n in GATING_FLAGS if getattr(args, n) is not None]
    if given and args.gating is None:
        raise ValueError(f"{' '.join(given)} given without --gating: name the re-routing gating with --gating "
                         "(" + ", ".join(trace_lib.GATING_KINDS) + ")")
    if args.gating is not None and args.routing is None:
        raise ValueError("--gating only applies to re-routing: pass --routing too")
    unread = routing_lib.unread_param(args.routing, {name: getattr(args, name) for name in routing_lib.PARAM_DEFAULTS},
                                      getattr(args, flags.NOTE, ()))
    if unread:  # a parameter the kind does not read would change nothing
        name, kinds = unread
        raise ValueError(f"{_flag(name)} only applies to --routing {' / '.join(kinds)} (got "
                         f"{'--routing ' + args.routing if args.routing else 'no --routing'})")
    if args.seed != 0 and args.cache_init != "random":
        raise ValueError("--seed only applies with --cache-init random")
    prior_lib.check_prior_flag(args.routing, args.prior)
    grouped = ("group-limited", "sigmoid-group-limited")
    for name, kinds in (("n_group", grouped), ("topk_group", grouped), ("jitter_eps", ("sparsemixer",))):
        if getattr(args, name) is not None and args.gating not in kinds:
            raise ValueError(f"{_flag(name)} only applies to --gating {' / '.join(kinds)}")
    for name in ("scale", "jitter_eps"):
        v = getattr(args, name)
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{_flag(name)} must be a finite number, got {v}")


def _check_gating_flags(args, n: int) -> None:
    """--top-k, --n-group and --topk-group against the trace's N experts."""
    if args.top_k is not None and not 1 <= args.top_k <= n:
        raise ValueError(f"--top-k {args.top_k} must be between 1 and the trace's {n} experts")
    if args.n_group is not None and (args.n_group < 1 or n % args.n_group):
        raise ValueError(f"--n-group {args.n_group} must be >= 1 and divide the trace's {n} experts")
    if args.topk_group is not None and args.topk_group < 1:
        raise ValueError(f"--topk-group must be >= 1, got {args.topk_group}")


def _gating_from_args(args, trace: trace_lib.Trace):
    if args.gating is None:
        return None
    _check_gating_flags(args, trace.n_experts)
    spec = dict(trace.gating or {})
    spec["kind"] = args.gating
    spec["top_k"] = args.top_k if args.top_k is not None else spec.get("top_k", trace.shape[2])
    if args.normalize is not None:
        spec["normalize"] = args.normalize
    for name in ("scale", "n_group", "topk_group", "jitter_eps"):
        if getattr(args, name) is not None:
            spec[name] = getattr(args, name)
    return trace_lib.gating_from_spec(spec, trace.n_experts)


def _check_synth_args(args) -> None:
    """Refuse synth sizes, --seed and --rho before any work."""
    for name in ("tokens", "layers", "experts"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 1 <= args.top_k <= args.experts:
        raise ValueError(f"--top-k {args.top_k} must be between 1 and --experts {args.experts}")
    if not -1.0 <= args.rho <= 1.0:
        raise ValueError(f"--rho must be a correlation in [-1, 1], got {args.rho}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    values = args.tokens * args.layers * (args.experts if args.logits else args.top_k)
    if args.experts > MAX_EXPERTS or values > MAX_SYNTH_VALUES:
        raise ValueError(f"--tokens {args.tokens} × --layers {args.layers} × {'--experts' if args.logits else '--top-k'}"
                         f" makes {values:,} values per array (at most {MAX_SYNTH_VALUES:,}; --experts at most "
                         f"{MAX_EXPERTS}): a smaller trace, or several")


#: the most values one synthetic trace array may hold (4 GiB as float32): beyond, memory runs out
MAX_SYNTH_VALUES = 1 << 30


def _synth(args) -> int:
    _check_synth_args(args)
    if os.path.basename(trace_lib.trace_path(args.out)) == ".npz":  # '' or 'dir/': a hidden '.npz' nobody asked for
        raise errors.UsageError(f"OUT {args.out!r} names no file")
    atomic.check_output(trace_lib.trace_path(args.out), args.overwrite, "OUT")
    tr = trace_lib.synthetic_trace(args.tokens, args.layers, args.experts, args.top_k, args.seed, args.rho, args.logits)
    trace_lib.save_trace(args.out, tr.experts, tr.weights, tr.logits, tr.n_experts, tr.gating, tr.score_bias)
    print(f"wrote {trace_lib.trace_path(args.out)}: experts {tr.shape}")  # np.savez naming: .npz appended
    return 0


def _replay(args, trace: trace_lib.Trace) -> dict:
    gating = _gating_from_args(args, trace)
    policy = None
    if args.routing is not None:
        k = gating.top_k if gating is not None else int((trace.gating or {}).get("top_k", trace.shape[2]))
        prior = None if not args.prior else prior_lib.load_prior(args.prior, n_layers=trace.shape[1],
                                                                  n_experts=trace.n_experts, top_k=k)
        policy = routing_lib.make_policy(args.routing, k, lam=args.lam, top_j=args.top_j,
                                         max_rank=args.max_rank, cumsum_p=args.cumsum_p,
                                         prune_h=args.prune_h, delta=args.delta, prior=prior)
    start = time.perf_counter()
    stats = trace_lib.replay(trace, args.cache_size, args.scope, args.eviction, policy=policy, gating=gating,
                   init=args.cache_init, seed=args.seed, expert_bytes=args.expert_bytes)
    stats["seconds"] = time.perf_counter() - start
    return stats


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    collector.for_compiling()
    parser = argparse.ArgumentParser(prog=commands.prog("trace"), description=__doc__.split("\n\n")[0],
                                     formatter_class=commands.HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay a trace through an expert cache")
    rp.add_argument("trace")
    rp.add_argument("--cache-size", required=True, help="count ('6'), fraction ('0.5') or percent ('5%%')")
    rp.add_argument("--cache-scope", "--scope", dest="scope", choices=cache_lib.SCOPES, default="layer",
                    help="as in generate/evaluate (--scope is the older spelling)")
    rp.add_argument("--eviction", choices=cache_lib.EVICTIONS, default="lru")
    rp.add_argument("--cache-init", choices=cache_lib.INITS, default="empty")
    rp.add_argument("--seed", type=errors.seed_arg, default=0)
    rp.add_argument("--expert-bytes", type=int, default=None,
                    help="bytes of one expert, for bytes moved (default: the trace's own record)")
    rp.add_argument("--routing", choices=routing_lib.KINDS, default=None,
                    help="re-route from the trace's logits with this policy (default: replay recorded experts)")
    d = routing_lib.PARAM_DEFAULTS  # as in generate and evaluate: replay used λ = 0 and p = 0 (original routing)
    rp.add_argument("--lam", action=flags.Given, type=routing_lib.PARAM_RANGES["lam"], default=d["lam"],
                    help="cache-prior strength λ (default 0.5)")
    rp.add_argument("--top-j", action=flags.Given, type=int, default=d["top_j"],
                    help="always keep the top-J (default 1 if K <= 2 else 2)")
    rp.add_argument("--max-rank", action=flags.Given, type=int, default=d["max_rank"],
                    help="max-rank M (default K)")
    rp.add_argument("--cumsum-p", action=flags.Given, type=routing_lib.PARAM_RANGES["cumsum_p"],
                    default=d["cumsum_p"],
                    help="cumsum threshold p (default 0.9)")
    rp.add_argument("--prune-h", action=flags.Given, type=int, default=d["prune_h"],
                    help="pruning: keep ranks 1..h-1 (default K)")
    rp.add_argument("--delta", action=flags.Given, type=routing_lib.delta_arg, default=d["delta"],
                    help="fixed Δ for cache-prior (default: running mean); comma-separated: one per MoE layer")
    rp.add_argument("--prior", default=None, metavar="PATH",
                    help="learned-prior: checkpoint folder written by `moejax train-prior` (default: none)")
    rp.add_argument("--gating", choices=trace_lib.GATING_KINDS, default=None,
                    help="gating for re-routing (default: the trace's stored 'gating'; sigmoid-group-limited "
                         "and softmax-biased rank with the trace's 'score_bias' where it has one)")
    stored = "(default: the trace's stored gating)"
    rp.add_argument("--top-k", type=int, default=None, help=f"re-routing: experts per token K {stored}")
    rp.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                    help=f"re-routing: renormalise the kept weights {stored}")
    rp.add_argument("--scale", type=flags.finite_float(-1e6, 1e6), default=None,
                    help=f"re-routing: routed-weight scale {stored}")
    rp.add_argument("--n-group", type=int, default=None, help=f"re-routing: expert groups {stored}")
    rp.add_argument("--topk-group", type=int, default=None, help=f"re-routing: groups kept per token {stored}")
    rp.add_argument("--jitter-eps", type=flags.finite_float(0.0, 1e6), default=None,
                    help=f"re-routing: SparseMixer's jitter ε {stored}")
    rp.add_argument("--json", action="store_true", help="print one JSON object")
    sp = sub.add_parser("synth", help="write a random trace with temporal locality")
    sp.add_argument("out", metavar="OUT", help="trace file (.npz appended unless the name ends so); an existing "
                                               "file is kept unless --overwrite")
    sp.add_argument("--tokens", type=int, default=256)
    sp.add_argument("--layers", type=int, default=4)
    sp.add_argument("--experts", type=int, default=16)
    sp.add_argument("--top-k", type=int, default=2)
    sp.add_argument("--rho", type=flags.finite_float(-1.0, 1.0), default=0.9)
    sp.add_argument("--seed", type=errors.seed_arg, default=0)
    sp.add_argument("--logits", action="store_true", help="also store the logits (enables re-routing)")
    sp.add_argument("--overwrite", action="store_true", help="replace an existing OUT file")
    args = parser.parse_args(argv)

    try:
        if args.command == "synth":
            return _synth(args)
        _check_replay_args(args)
        trace = trace_lib.load_trace(args.trace)
        try:
            stats = _replay(args, trace)
        except trace_lib.TraceError as err:
            raise trace_lib.TraceError(f"{args.trace}: {err}") from None
    except errors.HANDLED as err:
        return errors.report(err)
    return errors.print_result(json.dumps(trace_lib.json_safe(stats)) if args.json else trace_lib.format_table(stats))


if __name__ == "__main__":
    sys.exit(main())
