"""Evaluation: WikiText-2 perplexity and downstream tasks with any routing policy and expert cache; sweeps.

    python -m moejax.evaluate --model default --task wikitext [--context 1024] [--max-tokens N] [--json]
    python -m moejax.evaluate --model PATH --routing cache-prior --lam 0.5 --cache-size 0.5
    python -m moejax.evaluate --task mmlu --limit 200 --routing cache-prior --lam 0.5 --json
    python -m moejax.evaluate --sweep lam=0:1:50 --cache-size 0.5 --max-tokens 32768 --results lam.jsonl

WikiText protocol (paper §4.2, docs/design.md §2): the raw test text (``test.txt`` is the rows joined by blank
lines) is tokenised as one string and cut into consecutive chunks of ``context - 1`` tokens; each chunk gets
the model's BOS token in front, so every text token is predicted exactly once and the totals give
perplexity per token, per word (whitespace-separated words of the raw text) and bits per byte (UTF-8).
The routing policy and the expert cache act on every token in order: token t routes with the cache
state left by token t−1, carried across chunks.

Tasks other than WikiText (mmlu, gsm8k, truthfulqa, nq_open) are run by ``moejax.evaluation.tasks.evaluate_task``.

``--sweep`` (a grid over λ, M, p, h, J, Δ, cache size) and ``--results FILE.jsonl`` (one JSON record per
point, appended as each is done; a rerun skips finished points) are described in ``moejax.evaluation.sweep``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax.numpy as jnp

from moejax.base import collector, commands, compile_cache, distributed, errors, flags, interrupts
from moejax.experts.trace import json_safe
from moejax.runtime import api, cli_options
from moejax.evaluation import perplexity, sweep, sweep_points, tasks

TASK_NAMES = ("wikitext", "mmlu", "gsm8k", "truthfulqa", "nq_open")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("evaluate"), description=__doc__,
                                formatter_class=commands.HelpFormatter)
    p.add_argument("--model", default=api.DEFAULT_MODEL_NAME)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--task", choices=TASK_NAMES, default="wikitext")
    p.add_argument("--data", help="the task's data file or folder (default: $MOEJAX_DATA/TASK, else the HF datasets copy)")
    p.add_argument("--context", type=int, default=None,
                   help="WikiText chunk length in tokens, BOS included (default: 1024, or the model's positions "
                        "if fewer; longer than the model's positions is refused)")
    p.add_argument("--max-tokens", type=int, default=None, help="WikiText: score only the first N text tokens (default: all)")
    p.add_argument("--limit", type=int, default=None, help="tasks: only the first N examples (default: all)")
    p.add_argument("--shots", type=int, default=None, help="tasks: few-shot examples (task default: MMLU 5, GSM8K 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generative tasks: generation budget (default: the task's own)")
    p.add_argument("--json", action="store_true", help="print JSON (one object; with --sweep/--results one per point)")
    p.add_argument("--no-progress", action="store_true")
    s = p.add_argument_group("sweeps and results (moejax.evaluation.sweep)")
    s.add_argument("--sweep", action="append", default=[], metavar="NAME=VALUES",
                   help="lam=0:1:50 (n points a..b), max_rank=4:8 (integers a..b), cache_size=1,2,4 (list); "
                        "parameters: " + ", ".join(sorted(sweep_points.SWEEP_PARAMS)) + "; several flags = a grid")
    s.add_argument("--results", metavar="FILE.jsonl",
                   help="append each point as one JSON line as soon as it is done; points already there are skipped "
                        "(default: no file)")
    s.add_argument("--batch-size", type=int, default=None,
                   help="WikiText points of one policy kind evaluated together in one vmapped pass "
                        "(default: 1 on CPU, 8 on accelerators)")
    s.add_argument("--study", default=None, help="label stored in each record's 'study' field (default: none)")
    cli_options.add_weight_args(p)
    cli_options.add_routing_args(p)
    cli_options.add_offload_args(p)
    cli_options.add_distributed_args(p)
    return p


def offload_from_args(args: argparse.Namespace):
    return cli_options.offload_from_args(args) if hasattr(cli_options, "offload_from_args") else None


# The options each task reads; any other is refused rather than silently ignored.
TASK_OPTIONS = {
    "wikitext": ("context", "max_tokens"),
    "mmlu": ("limit", "shots"),
    "gsm8k": ("limit", "shots", "max_new_tokens"),
    "truthfulqa": ("limit",),
    "nq_open": ("limit", "shots", "max_new_tokens"),
}


#: tasks scored by teacher-forced passes (``Model.forward``), not by generating
FORWARD_TASKS = ("wikitext", "mmlu", "truthfulqa")


def _check_args(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "limit", "shots", "max_new_tokens", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "shots" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be >= {0 if name == 'shots' else 1}, got {value}")
    if args.context is not None and args.context < 2:
        raise ValueError(f"--context must be at least 2 tokens, got {args.context}")
    offload = offload_from_args(args)
    if offload is not None and offload.paging == "jit" and args.task in FORWARD_TASKS:
        raise ValueError(f"--paging jit pages generate's decode loop; --task {args.task} scores teacher-forced "
                         "passes, which page on the host (drop --paging, or use --paging host)")
    for name in ("context", "max_tokens", "limit", "shots", "max_new_tokens"):
        if getattr(args, name) is not None and name not in TASK_OPTIONS[args.task]:
            reads = ", ".join("--" + n.replace("_", "-") for n in TASK_OPTIONS[args.task])
            raise errors.UsageError(f"--{name.replace('_', '-')} does not apply to --task {args.task} "
                                    f"(it reads {reads})")
    if not (args.sweep or args.results):
        for name in ("batch_size", "study"):
            if getattr(args, name) is not None:
                raise errors.UsageError(f"--{name.replace('_', '-')} applies to sweeps and results files: "
                                        "pass --sweep or --results with it")


def pass_size(args: argparse.Namespace, model: api.Model) -> tuple[int, int]:
    """(positions, logit rows) of the largest pass the evaluation makes: what an offloaded pass holds beside
    its slots (a KV cache, the float32 logits a teacher-forced pass returns). WikiText: a chunk of
    ``--context``. A task (which does not read ``--context``): its longest prompt, built now as the run will
    build it (``tasks.longest_pass``) — only when offloading, the one case the figure decides anything."""
    if args.task == "wikitext" or offload_from_args(args) is None:
        return args.context, args.context if args.task in ("wikitext", "mmlu", "truthfulqa") else 0
    return tasks.longest_pass(model, args.task, args.data, limit=args.limit, shots=args.shots,
                              max_new_tokens=args.max_new_tokens)


def build_points(args: argparse.Namespace, model: api.Model) -> list[sweep_points.Point]:
    """The evaluation points of a command line: one, or the grid of its ``--sweep`` flags. Every point's
    policy and cache are built (and checked against the model) before anything is computed."""
    axes = [sweep_points.parse_sweep(spec) for spec in args.sweep]
    for axis in axes:  # the sweep sets the value of every point: the flag's own value would change nothing
        flag = "--" + axis.name.replace("_", "-")
        default = cli_options.ROUTING_PARAMS.get(axis.name, (None,))[0]
        if flags.given(args, axis.name, default):
            raise ValueError(f"{flag} and --sweep {axis.name}=... both set {axis.name}: the sweep's values win, "
                             f"so drop {flag}")
    grid = sweep_points.expand_grid(axes)
    kind = sweep_points.infer_kind(args.routing, [a.name for a in axes])
    with_cache = cli_options.cache_requested(args) or bool(axes)
    label = sweep_points.model_label(args.model) + (f"@{args.dtype}" if args.dtype else "") + cli_options.weight_label(args)
    points = []
    tokens, rows = pass_size(args, model) if with_cache else (args.context, 0)
    for values in grid:
        a = argparse.Namespace(**vars(args))
        a.routing = kind
        for name, value in values.items():
            setattr(a, name, value)
        policy = cache = None
        routing = sweep_points.routing_record("original", model.cfg.top_k)
        if with_cache:
            policy = cli_options.policy_from_args(a, model.cfg.top_k)
            cache = cli_options.cache_from_args(a, model, offload_from_args(args), tokens,  # checked now,
                                                logits_rows=rows)  # not hours later
            kind_now = a.routing or "original"
            extra = {"prior": os.path.realpath(a.prior)} if getattr(a, "prior", None) else {}
            routing = sweep_points.routing_record(kind_now, model.cfg.top_k, lam=a.lam, top_j=a.top_j,
                                                  max_rank=a.max_rank, cumsum_p=a.cumsum_p, prune_h=a.prune_h,
                                                  delta=a.delta, **extra)
        method = "forward" if args.task == "wikitext" else "task"
        points.append(sweep_points.make_point(model, label, task=args.task, study=args.study, data=args.data,
                                              context=args.context, max_tokens=args.max_tokens, limit=args.limit,
                                              shots=args.shots, max_new_tokens=args.max_new_tokens, routing=routing,
                                              policy=policy, cache=cache, sweep=values, method=method,
                                              offload=offload_from_args(args)))
    seen: dict[str, dict] = {}
    for point in points:  # two values that mean one point (cache_size=2 and 0.0625 of N = 32) would print once
        if point.key in seen:
            raise errors.UsageError(f"--sweep values {seen[point.key]} and {point.record['sweep']} are the same "
                                    "point for this model (give each once)")
        seen[point.key] = point.record["sweep"]
    return points


def run_task(model: api.Model, args: argparse.Namespace, routing, cache) -> dict[str, Any]:
    """One evaluation of ``args.task`` (no sweep, no results file)."""
    offload = offload_from_args(args)
    if args.task == "wikitext":
        text = perplexity.load_wikitext(args.data)
        return perplexity.wikitext_perplexity(model, text, args.context, args.max_tokens, routing, cache,
                                   progress=not (args.json or args.no_progress), offload=offload)
    options = {} if offload is None else {"offload": offload}
    return tasks.evaluate_task(model, args.task, args.data, limit=args.limit, routing=routing, cache=cache,
                               shots=args.shots, max_new_tokens=args.max_new_tokens,
                               progress=not (args.json or args.no_progress), **options)


def _print_single(res: dict[str, Any]) -> None:
    if res.get("task", "wikitext") == "wikitext" and "ppl" in res:
        print(f"wikitext  context {res['context']}  tokens {res['tokens']}  words {res['words']}")
        print(f"ppl/token {res['ppl']:.2f}  ppl/word {res['ppl_word']:.2f}  bits/byte {res['bits_per_byte']:.4f}")
        usage = res["expert_usage"]
        print("expert usage entropy (bits, max %.2f): %s" % (
            usage["entropy_max_bits"], " ".join(f"{e:.2f}" for e in usage["entropy_bits"])))
        if "reuse" in usage:
            print("experts the previous token also chose: %s (independent routing: %s)" % (
                " ".join(f"{r:.3f}" for r in usage["reuse"]),
                " ".join(f"{r:.3f}" for r in usage["reuse_independent"])))
    else:
        shown = {k: v for k, v in res.items() if isinstance(v, (int, float, str)) and k not in ("miss_rate", "lifetime")}
        print("  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()))
    if res.get("miss_rate") is not None:
        lifetime = res.get("lifetime")
        bpt = res.get("bytes_per_token")
        print(f"miss rate {res['miss_rate']:.4f}  lifetime "
              f"{'-' if lifetime is None or lifetime != lifetime else f'{lifetime:.2f}'} tokens  "
              f"bytes/token {'-' if bpt is None else f'{bpt:.0f}'}")


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    errors.plain_warnings()

    args = build_parser().parse_args(argv)
    compile_cache.enable()
    collector.for_compiling()
    try:
        _check_args(args)
        folder = api.text_model_folder(args.model, "WikiText and the tasks are scored as text")
        mesh = cli_options.start_distributed(args)
        model = api.load(folder, dtype=None if args.dtype is None else getattr(jnp, args.dtype),
                         offload=offload_from_args(args), **cli_options.weight_kwargs(args),
                         **cli_options.shard_kwargs(args))
        if args.context is None:
            args.context = min(1024, model.cfg.max_position_embeddings)
        model.cfg.check_context(args.context, "--context")
        if args.sweep or args.results:
            points = build_points(args, model)
            runner = sweep.Runner(model, results=args.results, batch_size=args.batch_size or sweep.default_batch_size(),
                                  progress=not args.no_progress and not args.json,
                                  load_text=perplexity.load_wikitext, mesh=mesh)
            try:
                records, not_saved = runner.run(points), None
            except sweep.NotSaved as e:  # a full disk: what was computed is shown, then the error
                records, not_saved = e.records, e
            if not distributed.is_leader():  # process 0 prints for the run
                return errors.exit_status(not_saved) if not_saved else 0
            if args.json:
                status = errors.print_result("\n".join(json.dumps(rec) for rec in records)) if records else 0
            else:
                status = errors.print_result(sweep.format_table(records))
            if not_saved is not None:
                return errors.report(errors.Failure(f"{not_saved}; they are printed above"))
            if args.results:  # on stderr with --json too: stdout stays one record per line
                others = f", {runner.by_other_runs} by another run sharing it" if runner.by_other_runs else ""
                print(f"{runner.computed} point(s) computed{others}, "
                      f"{len(records) - runner.computed - runner.by_other_runs} already in {args.results}",
                      file=sys.stderr)
            return status
        routing = cache = None
        if cli_options.cache_requested(args):
            routing = cli_options.policy_from_args(args, model.cfg.top_k)
            cache = cli_options.cache_from_args(args, model, offload_from_args(args), *pass_size(args, model))
        res = run_task(model, args, routing, cache)
    except errors.HANDLED as e:
        return errors.report(e)
    if not distributed.is_leader():
        return 0
    if args.json:
        return errors.print_result(json.dumps(json_safe(res)))
    try:
        _print_single(res)
    except OSError as e:  # stdout is full or closed: the results file (if any) is written
        return errors.stdout_failed(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
