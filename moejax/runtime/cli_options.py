"""Routing-policy and expert-cache command-line options, shared by generate, evaluate and trace."""

from __future__ import annotations

import argparse

from moejax.base import distributed, errors, flags
from moejax.experts import cache as cache_lib, prior as prior_lib, routing as routing_lib
from moejax.runtime.offload import PREFILLS, OffloadConfig
from moejax.runtime.simulate import CacheConfig


#: the cache flags' defaults (``add_routing_args`` uses them): any other value turns the cache on
CACHE_DEFAULTS = {"cache_scope": "layer", "eviction": "lru", "cache_init": "empty", "cache_seed": 0, "miss": "fetch",
                  "miss_rank": "1", "cascade_bits": "8", "quant_group": None, "prefetch": 0.0}
#: routing parameters, their defaults (``add_routing_args`` uses them) and the routing kinds that use them
#: (any other kind refuses them)
ROUTING_PARAMS = {name: (default, routing_lib.PARAM_KINDS[name])
                  for name, default in routing_lib.PARAM_DEFAULTS.items()}
#: the offload flags that only mean something with --offload, and their defaults (``add_offload_args``)
OFFLOAD_DEFAULTS = {"paging": "host", "expert_store": "host"}


def add_routing_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("routing policy (docs/design.md §2)")
    g.add_argument("--routing", choices=routing_lib.KINDS, default=None,
                   help="expert ranking policy (default: original); any routing option turns the cache on")
    g.add_argument("--lam", action=flags.Given, type=routing_lib.PARAM_RANGES["lam"],
                   default=ROUTING_PARAMS["lam"][0],
                   help="cache-prior strength λ (default 0.5)")
    g.add_argument("--top-j", action=flags.Given, type=int, default=ROUTING_PARAMS["top_j"][0],
                   help="always keep the top-J (default 1 if K <= 2 else 2)")
    g.add_argument("--max-rank", action=flags.Given, type=int, default=ROUTING_PARAMS["max_rank"][0],
                   help="max-rank M (default K)")
    g.add_argument("--cumsum-p", action=flags.Given, type=routing_lib.PARAM_RANGES["cumsum_p"],
                   default=ROUTING_PARAMS["cumsum_p"][0],
                   help="cumsum probability threshold p (default 0.9)")
    g.add_argument("--prune-h", action=flags.Given, type=int, default=ROUTING_PARAMS["prune_h"][0],
                   help="pruning: keep ranks 1..h-1 (default K)")
    g.add_argument("--delta", action=flags.Given, type=routing_lib.delta_arg, default=ROUTING_PARAMS["delta"][0],
                   help="cache-prior: fixed calibrated Δ (default: the running mean of max(z)-min(z)); one "
                        "number for every layer, or comma-separated, one per MoE layer")
    g.add_argument("--prior", default=None, metavar="PATH",
                   help="learned-prior: checkpoint folder written by `moejax train-prior` (default: none; "
                        "--routing learned-prior needs one)")
    c = p.add_argument_group("expert cache")
    c.add_argument("--cache-size", default=None,
                   help="capacity: a count ('6'), with a decimal point a fraction of N ('0.5'), in global scope "
                        "of all L·N experts (default 0.5 when a cache is on); or the memory the cached experts "
                        "may take in all ('6GiB', '800MB': with --offload, of device slots); with --offload also "
                        "'auto': the most slots the free memory holds (the default 0.5 shrinks to that if it must)")
    c.add_argument("--cache-scope", action=flags.Given, choices=cache_lib.SCOPES,
                   default=CACHE_DEFAULTS["cache_scope"])
    c.add_argument("--eviction", action=flags.Given, choices=cache_lib.ONLINE_EVICTIONS,
                   default=CACHE_DEFAULTS["eviction"],
                   help="eviction policy (Belady is an offline oracle: use `moejax.trace replay`)")
    c.add_argument("--cache-init", action=flags.Given, choices=cache_lib.INITS,
                   default=CACHE_DEFAULTS["cache_init"])
    c.add_argument("--cache-seed", action=flags.Given, type=errors.seed_arg, default=CACHE_DEFAULTS["cache_seed"],
                   help="seed of --cache-init random")
    c.add_argument("--miss", action=flags.Given, choices=cache_lib.MISS_MODES, default=CACHE_DEFAULTS["miss"],
                   help="miss handling: fetch (lossless), drop / substitute / cascade a low-importance miss")
    c.add_argument("--miss-rank", action=flags.Given, default=CACHE_DEFAULTS["miss_rank"],
                   help="0-based position (by weight) from which a miss is low-importance; cascade: one per "
                        "tier, e.g. '1,3' with --cascade-bits 8,4 (default 1)")
    c.add_argument("--cascade-bits", action=flags.Given, default=CACHE_DEFAULTS["cascade_bits"],
                   help="cascade: bit width per tier, 8 and/or 4 (default 8)")
    c.add_argument("--quant-group", action=flags.Given, type=int, default=CACHE_DEFAULTS["quant_group"],
                   help="cascade: quantisation group size along the input axis (default: per channel)")
    c.add_argument("--prefetch", action=flags.Given, type=flags.finite_float(0.0, 1e6),
                   default=CACHE_DEFAULTS["prefetch"], metavar="F",
                   help="speculative next-layer prefetch of the top round(K·F) predicted experts (0 = off)")
    c.add_argument("--prefetch-percentile", type=flags.finite_float(0.0, 100.0, low_open=True, high_open=True),
                   default=None, metavar="Q",
                   help="prefetch every expert whose predicted probability is above the Q-th percentile (default: "
                        "off)")


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None


def add_weight_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("weights in memory")
    g.add_argument("--weight-dtype", choices=("stored", "int8"), default=None,
                   help="int8: every matrix (attention, MLPs, routed experts, LM head) held as int8 with one scale "
                        "per output row, quantised on load: half the memory and bytes per token of bf16, "
                        "like llama.cpp's Q8_0 (default: stored)")
    g.add_argument("--expert-dtype", choices=("stored", "int8"), default=None,
                   help="the same for the routed experts alone (default: as --weight-dtype)")


def weight_kwargs(args: argparse.Namespace) -> dict:
    """``moejax.load``'s ``weight_dtype`` / ``expert_dtype`` from the flags."""
    return {"weight_dtype": getattr(args, "weight_dtype", None), "expert_dtype": getattr(args, "expert_dtype", None)}


def weight_label(args: argparse.Namespace) -> str:
    """What the weight flags add to a model's label in results ("", "+int8", "+int8-experts", ...)."""
    w, e = getattr(args, "weight_dtype", None), getattr(args, "expert_dtype", None)
    matrices, experts = w == "int8", (w == "int8") if e is None else e == "int8"
    if matrices and experts:
        return "+int8"
    return "+int8-experts" if experts else "+int8-matrices" if matrices else ""


SHARD_HELP = ("experts: split each MoE layer's experts over the devices (--devices N, default all) for models "
              "larger than one device; every device computes its own experts, the rest is replicated")


def add_shard_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices (moejax.base.distributed)")
    g.add_argument("--shard", choices=("experts",), default=None, help=SHARD_HELP)
    g.add_argument("--devices", type=int, default=None, metavar="N", help="devices --shard uses (default: all)")


def shard_kwargs(args: argparse.Namespace) -> dict:
    """``moejax.load``'s ``shard`` / ``devices`` from the flags (``--devices`` alone spreads sweeps, not a model)."""
    if getattr(args, "devices", None) is not None and args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    if getattr(args, "shard", None) is None:
        return {}
    return {"shard": args.shard, "devices": args.devices}


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices and hosts (moejax.base.distributed)")
    g.add_argument("--devices", type=int, default=None, metavar="N",
                   help="spread the points of a sweep over the first N devices (default: every device; "
                        "one device = no spreading); with --shard experts: the devices the experts are split over")
    g.add_argument("--shard", choices=("experts",), default=None, help=SHARD_HELP + " (sweeps then run on them "
                   "one batch at a time)")
    g.add_argument("--distributed", action="store_true",
                   help="run as one program over several processes/hosts (jax.distributed): every process runs "
                        "the same command; process 0 writes the results (also implied by JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="process 0's address (default: JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, default=None, help="default: JAX_NUM_PROCESSES")
    g.add_argument("--process-id", type=int, default=None, help="default: JAX_PROCESS_ID")
    g.add_argument("--coordinator-timeout", type=flags.finite_float(0.0, 1e7, low_open=True), default=None,
                   metavar="SECONDS", help="seconds to wait for the coordinator and the other processes (default: "
                                           "MOEJAX_COORDINATOR_TIMEOUT, else 300)")


def start_distributed(args: argparse.Namespace):
    """Join the multi-process run the flags (or the ``JAX_*`` variables) ask for, then the sweep mesh over
    ``--devices`` (None: one device). Call before anything touches a JAX device."""

    asked = args.distributed or any(getattr(args, k) is not None for k in ("coordinator", "num_processes",
                                                                          "process_id"))
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    if asked or distributed.requested():
        distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                               timeout=getattr(args, "coordinator_timeout", None))
    if getattr(args, "shard", None) is not None:
        if distributed.is_multiprocess():
            raise ValueError("--shard experts runs in one process (its devices); a multi-process run spreads "
                             "sweep points: drop one of them")
        return None  # the devices hold the experts; a sweep's batches run on all of them
    return distributed.points_mesh(args.devices)


def add_offload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("expert offloading (experts in host memory, device slots = the cache)")
    g.add_argument("--offload", action="store_true",
                   help="page experts from host memory into device slots for real (turns the cache on)")
    g.add_argument("--paging", action=flags.Given, choices=("host", "jit"), default=OFFLOAD_DEFAULTS["paging"],
                   help="host: host-driven between jitted stages (everywhere, bandwidth emulation, batched "
                        "prompts); jit: routing, cache and paging inside one decode program, the fastest decode "
                        "when the cache rarely misses (the prompt runs token by token; longer compiles)")
    g.add_argument("--expert-store", action=flags.Given, choices=("host", "flash"),
                   default=OFFLOAD_DEFAULTS["expert_store"],
                   help="host: host memory (pinned_host where the backend has it), read once from the checkpoint; "
                        "flash: paged straight from the checkpoint's own files through their memory map")
    g.add_argument("--bandwidth-gbps", type=flags.finite_float(1e-6, 1e9), default=None,
                   help="emulate a host→device link of this bandwidth (GB/s), e.g. 2 (flash), 25 (PCIe) (default: "
                        "off, the machine's own speed)")
    g.add_argument("--latency-us", type=flags.finite_float(0.0, 1e9), default=0.0,
                   help="emulated per-transfer latency (µs)")
    g.add_argument("--prefill", choices=PREFILLS, default=None,
                   help="batched (default): the prompt runs a layer at a time, each expert it needs paged once per "
                        "layer; token: token by token, paging every miss as decoding does (host paging; a global "
                        "cache or --miss cascade always prefills token by token)")
    g.add_argument("--overlap", choices=("on", "off"), default=None,
                   help="on (default): while a decode step's misses are read, its resident and shared experts "
                        "compute (host paging; the same tokens either way); off: the misses first, then all")


def offload_from_args(args: argparse.Namespace):
    """An ``offload.OffloadConfig`` when ``--offload`` was given, else None (options without it: error)."""
    if not getattr(args, "offload", False):
        if getattr(args, "bandwidth_gbps", None) is not None or getattr(args, "latency_us", 0.0):
            raise ValueError("--bandwidth-gbps / --latency-us emulate transfers: they need --offload")
        if getattr(args, "prefill", None) is not None:
            raise ValueError("--prefill says how an offloaded prompt pages its experts: it needs --offload")
        if getattr(args, "overlap", None) is not None:
            raise ValueError("--overlap says how an offloaded decode step waits for its pages: it needs --offload")
        for name, default in OFFLOAD_DEFAULTS.items():
            if flags.given(args, name, default):
                raise ValueError(f"--{name.replace('_', '-')} says where and how experts are offloaded: it needs "
                                 "--offload")
        return None
    if args.overlap is not None and args.paging == "jit":
        raise ValueError("--overlap says how host paging waits for its pages: in-jit paging runs each step as one "
                         "program (drop --overlap, or use --paging host)")
    if args.prefill == "batched" and args.paging == "jit":
        raise ValueError("--prefill batched needs host paging: in-jit paging runs the prompt token by token "
                         "inside its scan (drop --prefill, or use --paging host)")

    return OffloadConfig(paging=args.paging, store=args.expert_store, bandwidth_gbps=args.bandwidth_gbps,
                         latency_us=args.latency_us, prefill=args.prefill or "batched",
                         overlap=args.overlap != "off")


def cache_requested(args: argparse.Namespace) -> bool:
    """Whether the run simulates (or offloads) a cache: any routing or cache option given turns it on; a routing
    parameter its kind does not use, or a --prior without --routing, is then refused by ``policy_from_args``
    (never silently ignored)."""
    return (args.routing is not None or args.cache_size is not None or getattr(args, "prior", None) is not None
            or getattr(args, "offload", False) or args.prefetch_percentile is not None
            or any(flags.given(args, k, d) for k, d in CACHE_DEFAULTS.items())
            or any(flags.given(args, k, d) for k, (d, _) in ROUTING_PARAMS.items()))


def add_generation_config_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--generation-config auto|none``: whether ``what`` not given (sampling settings, a request's fields)
    comes from the checkpoint's ``generation_config.json`` (``checkpoint_sampling``)."""
    p.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                   help=f"auto (default): {what} not given come from the checkpoint's generation_config.json, "
                        "as transformers' generate and vLLM take them; none: greedy, no penalty, unless given")


def checkpoint_sampling(args: argparse.Namespace, model) -> dict:
    """The sampling defaults ``--generation-config`` lets the checkpoint give (``Model.sampling_defaults``)."""
    return model.sampling_defaults if args.generation_config == "auto" else {}


def policy_from_args(args: argparse.Namespace, top_k: int) -> routing_lib.RoutingPolicy:
    prior_path = getattr(args, "prior", None)
    prior_lib.check_prior_flag(args.routing, prior_path)
    params = None
    if prior_path:
        params = prior_lib.load_prior(prior_path, top_k=top_k)  # N and layers are checked against the model
    unread = routing_lib.unread_param(args.routing, {name: getattr(args, name, None) for name in ROUTING_PARAMS},
                                      getattr(args, flags.NOTE, ()))
    if unread:
        name, kinds = unread
        raise ValueError(f"--{name.replace('_', '-')} only applies to --routing {' / '.join(kinds)} (got --routing "
                         f"{args.routing or 'original'})")
    return routing_lib.make_policy(args.routing or "original", top_k, lam=args.lam, top_j=args.top_j,
                                   max_rank=args.max_rank, cumsum_p=args.cumsum_p, prune_h=args.prune_h,
                                   delta=args.delta, prior=params)


def cache_from_args(args: argparse.Namespace, model=None, offload=None, tokens: int | None = None,
                    logits_rows: int = 0):
    """The ``CacheConfig`` of the flags; with the loaded ``model`` its size resolved to that model's count of
    experts (``api.Model.resolve_cache``: a memory size, "auto", the fit of ``offload``'s slots beside a KV cache
    of ``tokens`` positions and, for teacher-forced passes, the logits of ``logits_rows``; the default size
    shrinks to fit, a size given is refused if it cannot)."""

    cfg = CacheConfig(size=str(args.cache_size or "0.5"), scope=args.cache_scope, eviction=args.eviction,
                      init=args.cache_init, seed=args.cache_seed, miss=args.miss,
                      miss_rank=_int_list(args.miss_rank, "--miss-rank"),
                      cascade_bits=_int_list(args.cascade_bits, "--cascade-bits"), quant_group=args.quant_group,
                      prefetch=args.prefetch, prefetch_percentile=args.prefetch_percentile)
    cfg.miss_config(), cfg.prefetch_config()  # bad values fail here, with the option's own message
    for name, flag, needs, ok in (("cascade_bits", "--cascade-bits", "--miss cascade", args.miss == "cascade"),
                                  ("quant_group", "--quant-group", "--miss cascade", args.miss == "cascade"),
                                  ("miss_rank", "--miss-rank", "--miss drop / substitute / cascade",
                                   args.miss != "fetch"),
                                  ("cache_seed", "--cache-seed", "--cache-init random", args.cache_init == "random")):
        if flags.given(args, name, CACHE_DEFAULTS[name]) and not ok:  # it would change nothing: say so
            raise ValueError(f"{flag} only applies with {needs}")
    if model is None:
        return cfg
    return model.resolve_cache(cfg, offload, tokens, shrink_to_fit=args.cache_size is None, logits_rows=logits_rows)


def describe(args: argparse.Namespace) -> dict:
    """The routing/cache settings of a run, for tables and JSON."""
    return {"routing": args.routing or "original", "lam": args.lam, "top_j": args.top_j,
            "max_rank": args.max_rank, "cumsum_p": args.cumsum_p, "prune_h": args.prune_h, "delta": args.delta,
            "cache_size": args.cache_size or "0.5", "scope": args.cache_scope, "eviction": args.eviction,
            "cache_init": args.cache_init, "prior": getattr(args, "prior", None), "miss": args.miss,
            "miss_rank": args.miss_rank, "cascade_bits": args.cascade_bits, "prefetch": args.prefetch,
            "prefetch_percentile": args.prefetch_percentile}
