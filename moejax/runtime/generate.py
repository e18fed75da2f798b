"""``python -m moejax.generate``: generate text from an MoE checkpoint, streaming it as it comes.

    python -m moejax.generate --model PATH --prompt "The capital of France" --max-new-tokens 64
    python -m moejax.generate --model PATH --prompt-ids 5,17,42 --json
    python -m moejax.generate --model PATH --routing cache-prior --lam 0.5 --cache-size 0.5 --trace-out t.npz

Any routing or cache option simulates an expert cache over every token (prompt included) and prints its
statistics (overall and per MoE layer) after the text; ``--json`` puts them under ``stats.cache``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time

from moejax.base import atomic, collector, commands, compile_cache, errors, flags, interrupts, textproc
from moejax.models import gating
from moejax.experts import trace as trace_lib
from moejax.runtime import api, cli_options, decode, offload as offload_lib
from moejax.runtime import sampling as sampling_lib

DEFAULT_PROMPT = "The history of the"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("generate"), description=__doc__,
                                formatter_class=commands.HelpFormatter)
    p.add_argument("--model", default=api.DEFAULT_MODEL_NAME,
                   help="moejax or Hugging Face checkpoint folder, or 'default' (the embedded model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 5,17,42 (no tokenizer needed; "
                     "default: --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=flags.finite_float(0.0, 1e6), default=None,
                   help="0 = greedy (the default, unless the checkpoint's generation_config.json samples)")
    p.add_argument("--top-p", type=flags.finite_float(0.0, 1.0, low_open=True), default=None,
                   help="nucleus sampling (default 1.0: off); with --temperature > 0")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default 0: off); "
                                                            "with --temperature > 0")
    p.add_argument("--repetition-penalty", type=flags.finite_float(0.0, 1e6, low_open=True), default=None,
                   help="divide the logits of tokens already in the prompt or output by this (transformers' "
                        "repetition_penalty; greedy too; default 1: off)")
    cli_options.add_generation_config_arg(p, "sampling settings")
    p.add_argument("--seed", type=errors.seed_arg, default=None, help="sampling seed (default 0); with --temperature > 0")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="compute dtype (default: stored)")
    p.add_argument("--json", action="store_true", help="print one JSON object with text, token_ids and stats")
    p.add_argument("--trace-out", metavar="FILE.npz",
                   help="record the routing trace (experts, weights, router logits per token and MoE layer); "
                        ".npz is appended unless the name ends so; an existing file is kept unless --overwrite "
                        "(default: no trace)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --trace-out file")
    cli_options.add_weight_args(p)
    cli_options.add_routing_args(p)
    cli_options.add_offload_args(p)
    cli_options.add_shard_args(p)
    return p


def parse_prompt_ids(text: str) -> list[int]:
    """``5,17,42`` (spaces and one trailing comma allowed); an empty entry such as ``1,,2`` is refused, since it
    more likely lost an id than meant nothing."""
    items = text.replace(" ", "").split(",")
    if len(items) > 1 and items[-1] == "":
        items.pop()
    if items == [""]:
        raise ValueError("the prompt is empty: --prompt-ids has no token ids")
    if not all(t.isascii() and t.lstrip("-").isdigit() for t in items):  # int() also takes "1_0" and "١٢"
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}")
    return [int(t) for t in items]


def is_utf8(text: str) -> bool:
    """False for the lone surrogates Python makes of command-line bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def prompt_token_ids(model: api.Model, args: argparse.Namespace) -> list[int]:
    if args.prompt_ids is not None:
        if args.chat:
            raise ValueError("--chat applies its template to --prompt text; --prompt-ids are used as given: drop one")
        return parse_prompt_ids(args.prompt_ids)
    text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if not text.strip():
        raise ValueError("the prompt is empty: give some text with --prompt")
    if args.chat:
        if model.tokenizer is None:
            raise ValueError(f"{model.path} has no tokenizer.json, so --chat cannot apply a chat template")
        return model.chat_ids([{"role": "user", "content": text}])
    return model.encode(text)


class Streamer:
    """Prints text as tokens arrive. It decodes the whole continuation each time (so BPE merges come out
    right) and holds back trailing whitespace, which WikiText detokenisation may still remove."""

    def __init__(self, model: api.Model, render, out=None, prefix: str = ""):
        self.model, self.render, self.out, self.ids, self.printed = model, render, out or sys.stdout, [], ""
        self.prefix = prefix  # the prompt, printed with the first token: a compile note on stderr comes first

    def _prefix(self) -> None:
        if self.prefix:
            self.out.write(self.prefix)
            self.prefix = ""

    def text(self) -> str:
        text = self.render(self.model.decode(self.ids))
        return text + " " if self.model.tokenizer is None and text else text

    def __call__(self, new_ids: list[int]) -> None:
        self._prefix()
        self.ids += new_ids
        stable = self.text().rstrip()
        if stable.startswith(self.printed):
            self.out.write(stable[len(self.printed):])
            self.printed = stable
        self.out.flush()

    def finish(self) -> None:
        self._prefix()
        text = self.text()
        self.out.write(text[len(os.path.commonprefix([text, self.printed])):])  # what is not printed yet
        self.out.write("\n")
        self.out.flush()


@contextlib.contextmanager
def compile_note(enabled: bool = True):
    """One stderr line when the generation starts compiling (a cold start waits seconds for XLA, and the
    wait should say what it is); the summary line then says how long it took."""
    said, lock = [], threading.Lock()

    def note(name: str) -> None:  # called from the threads that compile (``decode.compiled_programs``)
        with lock:
            if said:
                return
            said.append(name)
            sys.stderr.write("moejax.generate: compiling for this model and prompt shape (kept on disk: the next "
                             "run of this shape starts faster) ...\n")
            sys.stderr.flush()

    if enabled:
        decode.COMPILE_LISTENERS.append(note)
    try:
        yield
    finally:
        if enabled:
            decode.COMPILE_LISTENERS.remove(note)


def format_offload(o: dict) -> str:
    """One block of offload figures for the terminal."""
    mem = o.get("device_memory", {})
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.1f} MiB"  # noqa: E731
    gbps = o.get("achieved_gbps")
    lines = [f"offload ({o['paging']} paging, {o.get('store', 'host')} store"
             + (f", emulated {o['bandwidth_gbps']} GB/s" if o.get("bandwidth_gbps") else "") + ")",
             f"  bytes moved {o['bytes_moved'] / 2**20:.1f} MiB, {o['bytes_per_token'] / 2**20:.2f} MiB/token"
             + (f", achieved {gbps:.2f} GB/s" if gbps else ""),
             f"  device memory: accounted {mib(mem.get('accounted_total'))} (experts on host "
             f"{mib(mem.get('all_experts_on_host'))}), measured peak {mib(mem.get('measured_peak'))}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[dict, Exception | None]:
    dtype = None if args.dtype is None else {"float32": "float32", "bfloat16": "bfloat16",
                                             "float16": "float16"}[args.dtype]
    offload = cli_options.offload_from_args(args)  # with --offload the routed experts never reach the device
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
             "repetition_penalty": args.repetition_penalty}
    sampling_lib.Sampling(**sampling_lib.resolve_sampling(given, {})[0])  # NaN, < 0: refused before loading
    if args.devices is not None and args.shard is None:
        raise ValueError("--devices goes with --shard experts (the devices the experts are split over)")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.prompt is not None and not is_utf8(args.prompt):
        raise ValueError("--prompt is not valid UTF-8 text (the shell passed bytes of another encoding)")
    check_trace_out(args)  # before the work: a generation must not be lost to an unwritable or taken path
    t_load = time.perf_counter()
    model = api.load(args.model, dtype=dtype, offload=offload, **cli_options.weight_kwargs(args),
                     **cli_options.shard_kwargs(args))
    load_time = time.perf_counter() - t_load
    ids = prompt_token_ids(model, args)
    routing = cache = None
    if cli_options.cache_requested(args):  # every option is validated before anything is printed
        routing = cli_options.policy_from_args(args, model.cfg.top_k)
        cache = cli_options.cache_from_args(args, model, offload, len(ids) + args.max_new_tokens)
    positions = model.cfg.max_position_embeddings
    decode.check_prompt(ids, model.cfg)  # a prompt past the context: one error line, before the note below
    if offload is not None:
        offload_lib.check_cache(model.cfg, cache.capacity(model.cfg), cache.eviction)
    sampling, from_file = sampling_lib.resolve_sampling(given, cli_options.checkpoint_sampling(args, model))
    ignored = [flag for flag, value in (("--top-p", args.top_p), ("--top-k", args.top_k), ("--seed", args.seed))
               if value is not None]
    if sampling["temperature"] == 0 and ignored:  # a note, not a refusal: scripts pass a seed to every run
        act = "act" if len(ignored) > 1 else "acts"
        sys.stderr.write(f"note: {' and '.join(ignored)} only {act} when sampling (--temperature > 0); "
                         "this run decodes greedily\n")
    if from_file:
        shown = ", ".join(f"{key} {sampling[key]:g}" for key in from_file)
        sys.stderr.write(f"note: decoding with the checkpoint's generation_config.json settings ({shown}); "
                         "flags override them, --generation-config none ignores them\n")
    budget = decode.generation_budget(len(ids), args.max_new_tokens, positions)
    if budget < args.max_new_tokens:
        sys.stderr.write(f"note: the context holds {positions} positions and the prompt takes {len(ids)}: "
                         f"at most {budget} new tokens (not {args.max_new_tokens})\n")
    render = textproc.wikitext_detokenize if textproc.is_wikitext_style(model.generation_config) else str
    streamer = None
    if not args.json:
        prefix = ""
        if args.prompt_ids is None and not args.chat:
            prefix = render(args.prompt if args.prompt is not None else DEFAULT_PROMPT)
            prefix += " " if not model.decode(ids[-1:]).endswith(" ") else ""
        streamer = Streamer(model, render, prefix=prefix)
    with compile_note(enabled=not args.json and sys.stderr.isatty()):  # progress for a person, not a log
        result = model.generate(ids, max_new_tokens=args.max_new_tokens, **sampling, seed=args.seed or 0,
                                stop_at_eos=not args.ignore_eos,
                                on_tokens=streamer, routing=routing, cache=cache, offload=offload)
    raw_text = model.decode(result.token_ids)
    text = render(raw_text)
    result.stats["load_time_s"] = load_time
    result.stats["sampling"] = {**sampling, "from_generation_config": from_file}
    if "cache" in result.stats:
        result.stats["cache"].update(cli_options.describe(args), capacity=cache.capacity(model.cfg),
                                     cache_memory_bytes=model.cache_memory_bytes(cache, offload),
                                     layers=model.cfg.n_moe_layers, experts_per_token=model.cfg.top_k,
                                     n_experts=model.cfg.n_experts)
    trace_failure = None
    if args.trace_out is not None:
        tr = result.trace()
        try:  # a full disk is found only now: the generation is still printed, then the failure is the error
            check_trace_out(args)  # a file made there while generating is not replaced either
            trace_lib.save_trace(args.trace_out, tr["experts"], tr["weights"], tr["logits"], model.cfg.n_experts,
                                 gating.spec(model.cfg.gating), model.selection_biases)
        except (OSError, ValueError) as e:
            trace_failure = e
    if not args.json:
        streamer.finish()
        s = result.stats
        sys.stderr.write(f"[{s['prompt_tokens']} prompt tokens, {s['generated_tokens']} generated, "
                         f"time to first token {s['time_to_first_token_s']:.3f} s"
                         + (f" ({s['compile_time_s']:.1f} s of it compiling)" if s["compile_time_s"] >= 0.05 else "")
                         + ", "
                         f"{s['tokens_per_s']:.1f} tokens/s]\n")
        if "cache" in s:
            sys.stderr.write(trace_lib.format_table(s["cache"]) + "\n")
        if "offload" in s:
            sys.stderr.write(format_offload(s["offload"]) + "\n")
    out = {"text": text, "raw_text": raw_text, "token_ids": result.token_ids, "prompt_ids": ids,
           "stopped": result.stats["stopped"], "stats": trace_lib.json_safe(result.stats)}
    return out, trace_failure


def _virtual_filesystem(folder: str) -> bool:
    """/proc, /sys, /dev: root passes ``os.access`` there, but a new file cannot be made."""
    real = os.path.realpath(folder)
    return any(real == top or real.startswith(top + os.sep) for top in ("/proc", "/sys", "/dev"))


def check_writable(path: str, flag: str) -> None:
    """An output file's folder must exist and be writable, and the path must not be a folder."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.basename(path) or os.path.basename(path) == ".npz":
        raise ValueError(f"{flag} {path!r} names no file")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{flag} {path} exists and is not a regular file")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or _virtual_filesystem(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def check_trace_out(args: argparse.Namespace) -> None:
    """``--trace-out`` names a new file in a writable folder, or an existing one with ``--overwrite``."""
    if args.trace_out is None:
        if args.overwrite:
            raise errors.UsageError("--overwrite only applies with --trace-out (the one file generate writes)")
        return
    if os.path.isdir(args.trace_out):
        raise ValueError(f"--trace-out {args.trace_out} is a folder; give a file name")
    path = trace_lib.trace_path(args.trace_out)
    check_writable(path, "--trace-out")
    atomic.check_output(path, args.overwrite, "--trace-out")


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    args = build_parser().parse_args(argv)
    compile_cache.enable()
    collector.for_compiling()
    try:
        result, trace_failure = run(args)
    except errors.HANDLED as e:
        return errors.report(e)
    status = errors.print_result(json.dumps(result)) if args.json else 0
    if trace_failure is not None:  # the generation was printed; the trace was not written
        return errors.report(trace_failure, "--trace-out: the generation was printed, its trace was not written: ")
    return status


if __name__ == "__main__":
    sys.exit(main())
