"""What a user waits for around the work, as ratios against anchors measured in the same run.

    python bench/bench_fixed_costs.py [--parts offload,start,server] [--out FILE.json [--overwrite]]
        [--models default,PATH] [--new-tokens 64] [--bandwidth-gbps B [--emulate-link]] [--repeats 1]

Every figure comes from a fresh child process, so the machine, its load
and the build are the same for a figure and its anchor. Three parts (``--parts``, default all):

1. offload: decode tokens/s of each ``--models`` model (default: ``default``, the embedded model) as
   ``python -m moejax.generate --model M --prompt-ids 1,2,3,4,5,6,7,8 --max-new-tokens 64 --ignore-eos --json``
   runs it, for every way of placing the experts (``CONFIGS``): all resident (no offload, the anchor); offloaded
   with a cache of every expert (C = N) under host and in-jit paging; C = N/2 and N/4 under host paging, in-jit
   paging and the flash store (host paging from the checkpoint's memory map); and a cache of N/4 only simulated
   (no offload). Each configuration runs in its own process through ``moejax.runtime.generate.run`` (the
   command's own code path, flags parsed by its own parser) ``1 + --warm-runs`` times: the tokens/s the
   command's JSON reports already leave compilation out (programs are compiled ahead of the timed decode),
   but the first run of a process also pays each program's first execution; ``tok/s`` is the later runs'
   (their median), ``1st run`` what the command prints. With ``--bandwidth-gbps B`` the offloaded rows with
   C < N also get the roofline 1 / (resident s/token + bytes per decode token / B) and the share of it
   reached; ``--emulate-link`` throttles the host-paged rows to B as well (generate's ``--bandwidth-gbps``;
   in-jit paging cannot be throttled: its rows run at the machine's speed and show no roofline then).
   Bytes per decode token: the offload block's ``bytes_per_decode_token`` (host paging); in-jit paging
   reports bytes per token prompt included, so a 1-token run of the same configuration gives the prompt's
   bytes to subtract.
2. start: the wall time of a whole ``python -m moejax.generate --model default`` process (``--new-tokens``
   greedy tokens from the same ids), cold (``MOEJAX_COMPILE_CACHE`` pointing at a new empty folder, which the
   command honours when ``JAX_COMPILATION_CACHE_DIR`` is unset: it is removed from the child's environment)
   and warm (the same folder again), against ``transformers`` on the same weights (exported with
   ``python -m moejax.convert moejax-to-hf default DST`` into a temporary folder): a process that imports
   transformers, loads ``AutoModelForCausalLM.from_pretrained(DST, dtype="auto")`` (the stored bfloat16) and
   generates the same greedy tokens (``min_new_tokens`` = ``max_new_tokens``: no early stop, like
   ``--ignore-eos``; torch's own thread count unless ``--torch-threads``); cold = its first run, warm = the runs
   after. Also moejax's own ``load_time_s``, ``compile_time_s``, ``time_to_first_token_s`` (what the caller
   waited, compilation included) and ``prefill_time_s``, transformers' import / load / generate split, and how
   many leading tokens the two engines agree on.
3. server: ``python -m moejax.serve --model default --port P`` with ``--warmup 32`` (``--server-warmup``) and
   without, each with a new empty compilation cache (cold) and then the same folder again (warm): seconds
   until ``/health`` first answers (any status: the server listens before it loads), until it answers 200
   with ``"status": "ok"``, then the latency of a first non-streaming ``/v1/completions`` request
   (``max_tokens`` = ``--new-tokens``, greedy, a short text prompt) and of the same request again (the anchor:
   a warm request), and the server's own account of its start (loading, warm-up). ``--warmup`` compiles for
   up to the server's ``--warmup-new-tokens`` (256 unless ``--server-warmup-new-tokens``) new tokens: several
   KV buckets more than a 64-token request needs. Only 127.0.0.1; every wait is bounded by ``--timeout``; the
   server is stopped at the end.

``--repeats`` repeats start and server (a new cache folder per cold repeat); with more than one, cells show
min/median. Temporary folders (compilation caches, the export, the children's TMPDIR) are removed on every
exit path; Ctrl-C or SIGTERM stops the running child. ``--out`` gets every figure, the exact commands, the
date, the CPU, the git commit and the load average (written after each part, atomically; an existing file is
refused unless ``--overwrite``). The figures are only as quiet as the machine: compare ratios of one run.

A model with real expert sizes for part 1 (OLMoE-1B-7B's first 4 decoder layers, random weights, ~4 GB on disk)
is made beforehand with

    python -m moejax.testing.random_checkpoint olmoe-1b-7b /tmp/olmoe-4l --layers 4
    python bench/bench_fixed_costs.py --parts offload --models default,/tmp/olmoe-4l

Quick check of the script itself: ``--parts offload --new-tokens 16 --configs resident,C0.25-host``.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_teacher_forced import cpu_model as cpu_name  # noqa: E402  (stdlib + numpy at import time)

PARTS = ("offload", "start", "server")
PROMPT_IDS = "1,2,3,4,5,6,7,8"
SERVER_PROMPT = "The history of the city of Paris began in the Roman period, when"
MiB = 2**20

#: offload part: key -> (label, generate flags, fraction of N the cache holds or None, paging)
CONFIGS = {
    "resident": ("resident (no offload)", [], None, None),
    "C1.0-host": ("offload C=N, host paging", ["--offload", "--cache-size", "1.0", "--paging", "host"], 1.0, "host"),
    "C1.0-jit": ("offload C=N, jit paging", ["--offload", "--cache-size", "1.0", "--paging", "jit"], 1.0, "jit"),
    "C0.5-host": ("offload C=N/2, host paging", ["--offload", "--cache-size", "0.5", "--paging", "host"], 0.5, "host"),
    "C0.5-jit": ("offload C=N/2, jit paging", ["--offload", "--cache-size", "0.5", "--paging", "jit"], 0.5, "jit"),
    "C0.5-flash": ("offload C=N/2, flash store", ["--offload", "--cache-size", "0.5", "--expert-store", "flash"],
                   0.5, "host"),
    "C0.25-host": ("offload C=N/4, host paging", ["--offload", "--cache-size", "0.25", "--paging", "host"], 0.25,
                   "host"),
    "C0.25-jit": ("offload C=N/4, jit paging", ["--offload", "--cache-size", "0.25", "--paging", "jit"], 0.25, "jit"),
    "C0.25-flash": ("offload C=N/4, flash store", ["--offload", "--cache-size", "0.25", "--expert-store", "flash"],
                    0.25, "host"),
    "sim-C0.25": ("cache simulated C=N/4, no offload", ["--cache-size", "0.25"], None, None),
}

#: the transformers side of the start part, run as ``python -c HF_CHILD FOLDER IDS NEW THREADS``
HF_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
t1 = time.perf_counter()
folder, ids, new, threads = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
if threads > 0:
    torch.set_num_threads(threads)
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
model.eval()
t2 = time.perf_counter()
eos = model.generation_config.eos_token_id
pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
with torch.inference_mode():
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=pad)
t3 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "generate_s": t3 - t2, "dtype": str(model.dtype),
                  "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
                  "torch": torch.__version__, "token_ids": out[0, len(ids):].tolist()}))
"""


# ------------------------------------------------------------------------------------------- child processes

_CHILDREN: set[subprocess.Popen] = set()


def stop(proc: subprocess.Popen, grace: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    _CHILDREN.discard(proc)
    return proc.returncode


def stop_all() -> None:
    for proc in list(_CHILDREN):
        stop(proc)


def child_env(tmp: str, compile_cache: str | None = None) -> dict:
    """The environment of a child: its temporary files under ``tmp`` (removed with the run's folder); with
    ``compile_cache``, moejax's compilation cache in that folder (JAX's own variable would override it)."""
    env = {**os.environ, "TMPDIR": tmp, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if compile_cache is not None:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env["MOEJAX_COMPILE_CACHE"] = compile_cache
    return env


def run_child(cmd: list[str], env: dict, timeout: float) -> dict:
    """Run ``cmd`` to its end: wall seconds of the whole process, exit status, stdout, the tail of stderr.
    Killed when ``timeout`` runs out or anything (Ctrl-C) interrupts the wait."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    _CHILDREN.add(proc)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        stop(proc)
        out, err = proc.communicate()
    finally:
        stop(proc)
    return {"wall_s": time.perf_counter() - t0, "returncode": proc.returncode, "timed_out": timed_out,
            "stdout": out, "stderr_tail": (err or "")[-3000:]}


def last_json(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (the commands print theirs last)."""
    for line in reversed((text or "").strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def failure(r: dict) -> str:
    why = "timed out" if r["timed_out"] else f"exit {r['returncode']}"
    tail = [ln for ln in r["stderr_tail"].strip().splitlines() if ln.strip()][-3:]
    return f"{why}: {' | '.join(tail)}"


# ------------------------------------------------------------------------------------------- small helpers

def spread(values: list) -> dict | None:
    """min, median and every value (None values left out)."""
    v = [x for x in values if x is not None]
    return {"min": min(v), "median": statistics.median(v), "values": v} if v else None


def cell(s: dict | None, fmt: str = "{:.2f}") -> str:
    """A table cell: the value, or min/median of several."""
    if not s:
        return "-"
    if len(s["values"]) == 1:
        return fmt.format(s["min"])
    return f"{fmt.format(s['min'])}/{fmt.format(s['median'])}"


def ratio(a: dict | None, b: dict | None) -> float | None:
    """Ratio of the medians."""
    return a["median"] / b["median"] if a and b and b["median"] else None


def fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def git_state() -> dict:
    """The commit and whether tracked files differ from it (read-only: no index refresh is written)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30,
                                  env=env).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "--short", "HEAD"),
            "modified_files": None if changed is None else len(changed.splitlines())}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("moejax", "jax", "jaxlib", "numpy", "torch", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def shell(cmd: list[str], env_note: str = "") -> str:
    """A command as one line to paste (the interpreter as ``python``)."""
    words = ["python" if w == sys.executable else w for w in cmd]
    text = " ".join(w if w and all(c.isalnum() or c in "-_./,=:+" for c in w) else json.dumps(w) for w in words)
    return f"{env_note} {text}".strip()


# ------------------------------------------------------------------------------------------- part 1: offload

def generate_argv(model: str, new_tokens: int, flags: list[str]) -> list[str]:
    return ["--model", model, "--prompt-ids", PROMPT_IDS, "--max-new-tokens", str(new_tokens), "--ignore-eos",
            "--json", *flags]


def worker(spec: dict) -> int:
    """In a child: ``generate.run`` the given command line ``spec["runs"]`` times (the first pays each program's
    first execution), optionally once more with one new token (the prompt's paged bytes); one JSON line."""
    from moejax.base import collector, compile_cache, errors, interrupts
    from moejax.runtime import generate

    interrupts.exit_cleanly_on_signals()
    compile_cache.enable()  # as the command does
    collector.for_compiling()
    parser = generate.build_parser()
    try:
        runs = []
        for _ in range(spec["runs"]):
            out, _ = generate.run(parser.parse_args(spec["argv"]))
            runs.append(out["stats"])
        prompt_bytes, o = None, runs[-1].get("offload")
        if spec.get("prompt_bytes") and o and o.get("bytes_per_decode_token") is None:  # in-jit paging
            one, _ = generate.run(parser.parse_args([*spec["argv"], "--max-new-tokens", "1"]))
            prompt_bytes = one["stats"]["offload"]["bytes_moved"]
    except errors.HANDLED as e:
        print(json.dumps({"error": errors.report_text(e)}))
        return 1
    print(json.dumps({"runs": runs, "prompt_bytes": prompt_bytes}))
    return 0


def decode_bytes_per_token(stats: dict, prompt_bytes: float | None) -> float | None:
    o = stats.get("offload")
    if not o:
        return None
    if o.get("bytes_per_decode_token") is not None:
        return o["bytes_per_decode_token"]
    if prompt_bytes is not None and stats["generated_tokens"] > 1:
        return (o["bytes_moved"] - prompt_bytes) / (stats["generated_tokens"] - 1)
    return None


def offload_row(key: str, model: str, args, tmp: str) -> dict:
    label, flags, size, paging = CONFIGS[key]
    flags = list(flags)
    emulated = bool(args.emulate_link and size is not None and paging == "host")
    if emulated:
        flags += ["--bandwidth-gbps", str(args.bandwidth_gbps)]
    argv = generate_argv(model, args.new_tokens, flags)
    spec = {"argv": argv, "runs": 1 + args.warm_runs, "prompt_bytes": size is not None}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    row = {"key": key, "label": label, "cache_fraction": size, "paging": paging, "emulated_link": emulated,
           "command": shell([sys.executable, "-m", "moejax.generate", *argv]), "worker": shell(cmd)}
    r = run_child(cmd, child_env(tmp), args.timeout)
    row["process_wall_s"] = r["wall_s"]
    res = last_json(r["stdout"])
    if r["returncode"] != 0 or not res or "runs" not in res:
        row["error"] = (res or {}).get("error") or failure(r)
        return row
    runs = res["runs"]
    warm = runs[1:] or runs
    row.update(tokens_per_s=spread([s["tokens_per_s"] for s in warm]), first_run_tokens_per_s=runs[0]["tokens_per_s"],
               compile_time_s=runs[0]["compile_time_s"], time_to_first_token_s=warm[-1]["time_to_first_token_s"],
               prefill_time_s=warm[-1].get("prefill_time_s"),
               miss_rate=(warm[-1].get("cache") or {}).get("miss_rate"),
               bytes_per_decode_token=decode_bytes_per_token(warm[-1], res["prompt_bytes"]),
               generated_tokens=warm[-1]["generated_tokens"], stats=warm[-1])
    c = warm[-1].get("cache") or {}
    row["model_shape"] = {k: c.get(k) for k in ("n_experts", "experts_per_token", "layers", "capacity")}
    return row


def offload_part(args, tmp: str) -> dict:
    out = {"prompt_ids": PROMPT_IDS, "new_tokens": args.new_tokens, "warm_runs": args.warm_runs,
           "bandwidth_gbps": args.bandwidth_gbps, "emulate_link": args.emulate_link, "models": {}}
    for model in args.models:
        rows = []
        for key in args.configs:
            print(f"[offload] {model}: {CONFIGS[key][0]} ...", file=sys.stderr, flush=True)
            rows.append(offload_row(key, model, args, tmp))
        add_offload_ratios(rows, args.bandwidth_gbps, args.emulate_link)
        out["models"][model] = rows
        print_offload(model, rows, args)
    return out


def add_offload_ratios(rows: list[dict], bandwidth_gbps: float | None, emulate_link: bool) -> None:
    """Each row against the resident one; offloaded rows with C < N against the roofline."""
    resident = next((r for r in rows if r["key"] == "resident" and r.get("tokens_per_s")), None)
    base = resident["tokens_per_s"]["median"] if resident else None
    for r in rows:
        tps = r.get("tokens_per_s")
        r["ratio_to_resident"] = tps["median"] / base if tps and base else None
        r["roofline_tokens_per_s"] = r["ratio_to_roofline"] = None
        throttled_elsewhere = emulate_link and not r["emulated_link"]  # in-jit paging under --emulate-link
        if (base and tps and bandwidth_gbps and r["cache_fraction"] is not None and r["cache_fraction"] < 1
                and r.get("bytes_per_decode_token") is not None and not throttled_elsewhere):
            roof = 1.0 / (1.0 / base + r["bytes_per_decode_token"] / (bandwidth_gbps * 1e9))
            r["roofline_tokens_per_s"], r["ratio_to_roofline"] = roof, tps["median"] / roof


def print_offload(model: str, rows: list[dict], args) -> None:
    shape = next((r["model_shape"] for r in rows if r.get("model_shape", {}).get("n_experts")), {})
    print(f"\n== offload: {model} (N={shape.get('n_experts', '?')} experts, K={shape.get('experts_per_token', '?')}, "
          f"{shape.get('layers', '?')} MoE layers), {args.new_tokens} new tokens after ids {PROMPT_IDS}, greedy, "
          f"--ignore-eos" + (f"; roofline at {args.bandwidth_gbps:g} GB/s" if args.bandwidth_gbps else "")
          + (" (host-paged rows throttled to it)" if args.emulate_link else ""))
    print(f"{'configuration':<36} {'tok/s':>11} {'x resid':>7} {'1st run':>8} {'miss':>6} {'MiB/tok':>8} "
          f"{'roofline':>8} {'x roof':>6}")
    for r in rows:
        if r.get("error"):
            print(f"{r['label']:<36} FAILED: {r['error'][:200]}")
            continue
        bpt = r.get("bytes_per_decode_token")
        print(f"{r['label']:<36} {cell(r['tokens_per_s'], '{:.1f}'):>11} {fmt(r['ratio_to_resident']):>7} "
              f"{r['first_run_tokens_per_s']:8.1f} {fmt(r['miss_rate'], '.3f'):>6} "
              f"{fmt(None if bpt is None else bpt / MiB, '.3f'):>8} {fmt(r['roofline_tokens_per_s'], '.1f'):>8} "
              f"{fmt(r['ratio_to_roofline']):>6}")


# ------------------------------------------------------------------------------------------- part 2: start

def moejax_start(args, cache_dir: str, tmp: str) -> dict:
    cmd = [sys.executable, "-m", "moejax.generate", *generate_argv("default", args.new_tokens, [])]
    r = run_child(cmd, child_env(tmp, cache_dir), args.timeout)
    out = {"command": shell(cmd, f"MOEJAX_COMPILE_CACHE={cache_dir}"), "wall_s": r["wall_s"],
           "cache_files": sum(len(f) for _, _, f in os.walk(cache_dir))}
    res = last_json(r["stdout"])
    if r["returncode"] != 0 or not res or "stats" not in res:
        out["error"] = failure(r)
        return out
    s = res["stats"]
    out.update({k: s.get(k) for k in ("load_time_s", "compile_time_s", "time_to_first_token_s", "prefill_time_s",
                                      "tokens_per_s", "generated_tokens")}, token_ids=res["token_ids"])
    return out


def transformers_start(args, folder: str, tmp: str) -> dict:
    cmd = [sys.executable, "-c", HF_CHILD, folder, PROMPT_IDS, str(args.new_tokens), str(args.torch_threads)]
    r = run_child(cmd, child_env(tmp), args.timeout)
    out = {"command": shell([sys.executable, "-c", "HF_CHILD", *cmd[3:]]), "wall_s": r["wall_s"]}
    res = last_json(r["stdout"])
    if r["returncode"] != 0 or not res:
        out["error"] = failure(r)
        return out
    out.update(res)
    return out


def export_hf(args, folder: str, tmp: str) -> dict:
    cmd = [sys.executable, "-m", "moejax.convert", "moejax-to-hf", "default", folder]
    r = run_child(cmd, child_env(tmp), args.timeout)
    out = {"command": shell(cmd), "wall_s": r["wall_s"]}
    if r["returncode"] != 0:
        out["error"] = failure(r)
    return out


def agreement(a: list[int] | None, b: list[int] | None) -> int | None:
    """How many leading tokens two generations share."""
    if not a or not b:
        return None
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def start_part(args, tmp: str) -> dict:
    folder = os.path.join(tmp, "default-hf")
    out = {"new_tokens": args.new_tokens, "prompt_ids": PROMPT_IDS, "export": export_hf(args, folder, tmp),
           "runs": {"moejax_cold": [], "moejax_warm": [], "transformers_cold": [], "transformers_warm": []}}
    runs = out["runs"]
    for i in range(args.repeats):
        cache_dir = os.path.join(tmp, f"xla-start-{i}")
        os.makedirs(cache_dir)
        for name, fn in (("moejax_cold", lambda: moejax_start(args, cache_dir, tmp)),
                         ("moejax_warm", lambda: moejax_start(args, cache_dir, tmp))):
            print(f"[start] {name} {i + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            runs[name].append(fn())
        if "error" in out["export"]:
            continue
        tf_name = "transformers_cold" if i == 0 else "transformers_warm"
        for name in (tf_name, "transformers_warm"):
            print(f"[start] {name} ...", file=sys.stderr, flush=True)
            runs[name].append(transformers_start(args, folder, tmp))
    summarise_start(out)
    print_start(out, args)
    return out


def summarise_start(out: dict) -> None:
    runs = out["runs"]
    ok = {k: [r for r in v if "error" not in r] for k, v in runs.items()}
    s = {k: spread([r["wall_s"] for r in v]) for k, v in ok.items()}
    for key in ("compile_time_s", "time_to_first_token_s", "prefill_time_s", "load_time_s", "tokens_per_s"):
        for which in ("cold", "warm"):
            s[f"moejax_{which}_{key}"] = spread([r.get(key) for r in ok[f"moejax_{which}"]])
    for key in ("import_s", "load_s", "generate_s"):
        s[f"transformers_{key}"] = spread([r.get(key) for r in ok["transformers_cold"] + ok["transformers_warm"]])
    s["ratio_cold"] = ratio(s["moejax_cold"], s["transformers_cold"])
    s["ratio_warm"] = ratio(s["moejax_warm"], s["transformers_warm"])
    mj = next((r.get("token_ids") for r in ok["moejax_warm"] + ok["moejax_cold"]), None)
    tf = next((r.get("token_ids") for r in ok["transformers_cold"] + ok["transformers_warm"]), None)
    s["tokens_agreeing"] = agreement(mj, tf)
    s["errors"] = [f"{k}: {r['error']}" for k, v in runs.items() for r in v if "error" in r]
    out["summary"] = s


def print_start(out: dict, args) -> None:
    s = out["summary"]
    tf = next((r for r in out["runs"]["transformers_cold"] + out["runs"]["transformers_warm"] if "dtype" in r), {})
    print(f"\n== start: a whole `python -m moejax.generate --model default` process ({args.new_tokens} greedy tokens "
          f"from ids {PROMPT_IDS}) vs transformers {tf.get('transformers', '?')} on the same weights "
          f"({tf.get('dtype', '?')}, torch {tf.get('torch_threads', '?')} threads); wall seconds"
          + (" (min/median)" if args.repeats > 1 else ""))
    print(f"{'':<34} {'moejax':>12} {'transformers':>13} {'moejax/tf':>10}")
    print(f"{'cold (empty compilation cache)':<34} {cell(s['moejax_cold']):>12} {cell(s['transformers_cold']):>13} "
          f"{fmt(s['ratio_cold']):>10}")
    print(f"{'warm (same cache folder again)':<34} {cell(s['moejax_warm']):>12} {cell(s['transformers_warm']):>13} "
          f"{fmt(s['ratio_warm']):>10}")
    for which in ("cold", "warm"):
        print(f"moejax {which}: load_time_s {cell(s[f'moejax_{which}_load_time_s'])}, compile_time_s "
              f"{cell(s[f'moejax_{which}_compile_time_s'])}, time_to_first_token_s "
              f"{cell(s[f'moejax_{which}_time_to_first_token_s'], '{:.3f}')} (prefill_time_s "
              f"{cell(s[f'moejax_{which}_prefill_time_s'], '{:.3f}')}), decode "
              f"{cell(s[f'moejax_{which}_tokens_per_s'], '{:.1f}')} tok/s")
    print(f"transformers (all runs): import {cell(s['transformers_import_s'])} s, load {cell(s['transformers_load_s'])} "
          f"s, generate {cell(s['transformers_generate_s'])} s; export to HF format "
          f"{out['export']['wall_s']:.1f} s")
    print(f"leading tokens the two agree on: {fmt(s['tokens_agreeing'], 'd')} of {args.new_tokens}")
    for e in s["errors"]:
        print(f"FAILED {e[:300]}")


# ------------------------------------------------------------------------------------------- part 3: server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_health(port: int) -> tuple[int, dict | None]:
    """``/health``'s status and body; (0, None) while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"null")
        except ValueError:
            return e.code, None
    except (OSError, ValueError, http.client.HTTPException):
        return 0, None


def wait_ready(proc: subprocess.Popen, port: int, t0: float, timeout: float) -> dict:
    """Seconds from the start until ``/health`` first answers and until it answers 200 "ok"."""
    out = {"first_answer_s": None, "first_status": None, "ready_s": None}
    deadline = t0 + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            out["error"] = f"the server exited with {proc.returncode} before it was ready"
            return out
        status, body = get_health(port)
        now = time.perf_counter() - t0
        if status and out["first_answer_s"] is None:
            out["first_answer_s"], out["first_status"] = now, status
        if status == 200 and isinstance(body, dict) and body.get("status") == "ok":
            out["ready_s"] = now
            return out
        time.sleep(0.05)
    out["error"] = f"not ready within {timeout:.0f} s"
    return out


def completion(port: int, max_tokens: int, timeout: float) -> dict:
    """One non-streaming /v1/completions request, greedy; its latency and the server's own figures."""
    body = json.dumps({"model": "default", "prompt": SERVER_PROMPT, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            res = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"latency_s": time.perf_counter() - t0, "error": f"HTTP {e.code}: {e.read()[:300]!r}"}
    except (OSError, ValueError, http.client.HTTPException) as e:
        return {"latency_s": time.perf_counter() - t0, "error": f"{type(e).__name__}: {e}"}
    ext = res.get("moejax") or {}
    return {"latency_s": time.perf_counter() - t0, "completion_tokens": res.get("usage", {}).get("completion_tokens"),
            "finish_reason": (res.get("choices") or [{}])[0].get("finish_reason"),
            **{k: ext.get(k) for k in ("compile_time_s", "time_to_first_token_s", "prefill_time_s", "tokens_per_s",
                                       "queued_s")}}


def server_run(args, warmup: int, cache: str, cache_dir: str, tmp: str, n: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "moejax.serve", "--model", "default", "--port", str(port),
           *(["--warmup", str(warmup)] if warmup else []),
           *(["--warmup-new-tokens", str(args.server_warmup_new_tokens)] if warmup and args.server_warmup_new_tokens
             else [])]
    out = {"warmup": warmup, "cache": cache, "command": shell(cmd, f"MOEJAX_COMPILE_CACHE={cache_dir}")}
    log_path = os.path.join(tmp, f"server-{n}.log")
    with open(log_path, "w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(tmp, cache_dir), cwd=ROOT)
        _CHILDREN.add(proc)
        try:
            out.update(wait_ready(proc, port, t0, args.timeout))
            if out["ready_s"] is not None:
                out["first"] = completion(port, args.new_tokens, args.timeout)
                out["first_completion_done_s"] = time.perf_counter() - t0  # what the first user waited in all
                out["second"] = completion(port, args.new_tokens, args.timeout)
        finally:
            out["returncode"] = stop(proc, grace=15)
            log.seek(0)
            text = log.read()
    out["log_tail"] = text[-2000:]
    said = re.search(r"ready after ([\d.]+) s \(loading ([\d.]+) s(?:, warm-up ([\d.]+) s)?", text)
    if said:  # the server's own account of its start
        out["server_ready_s"], out["server_loading_s"] = float(said.group(1)), float(said.group(2))
        out["server_warmup_s"] = float(said.group(3)) if said.group(3) else None
    for r in (out.get("first"), out.get("second")):
        if r and r.get("error"):
            out.setdefault("error", r["error"])
    return out


def server_part(args, tmp: str) -> dict:
    out = {"new_tokens": args.new_tokens, "prompt": SERVER_PROMPT, "runs": []}
    n = 0
    for i in range(args.repeats):
        for warmup in dict.fromkeys((args.server_warmup, 0)):
            cache_dir = os.path.join(tmp, f"xla-server-{i}-{warmup}")
            os.makedirs(cache_dir)
            for cache in args.server_caches:
                print(f"[server] --warmup {warmup}, {cache} cache, {i + 1}/{args.repeats} ...", file=sys.stderr,
                      flush=True)
                out["runs"].append(server_run(args, warmup, cache, cache_dir, tmp, n))
                n += 1
    out["summary"] = summarise_server(out["runs"])
    print_server(out, args)
    return out


def summarise_server(runs: list[dict]) -> list[dict]:
    rows = []
    for key in dict.fromkeys((r["warmup"], r["cache"]) for r in runs):
        mine = [r for r in runs if (r["warmup"], r["cache"]) == key]
        ok = [r for r in mine if "error" not in r]
        first = spread([r["first"]["latency_s"] for r in ok])
        second = spread([r["second"]["latency_s"] for r in ok])
        rows.append({"warmup": key[0], "cache": key[1], "runs": len(mine), "failed": len(mine) - len(ok),
                     "health_first_answer_s": spread([r["first_answer_s"] for r in ok]),
                     "ready_s": spread([r["ready_s"] for r in ok]),
                     "first_completion_s": first, "second_completion_s": second,
                     "first_completion_done_s": spread([r["first_completion_done_s"] for r in ok]),
                     "first_over_second": ratio(first, second),
                     "first_compile_time_s": spread([r["first"].get("compile_time_s") for r in ok]),
                     "server_loading_s": spread([r.get("server_loading_s") for r in ok]),
                     "server_warmup_s": spread([r.get("server_warmup_s") for r in ok]),
                     "completion_tokens": [r["first"].get("completion_tokens") for r in ok]})
    return rows


def print_server(out: dict, args) -> None:
    print(f"\n== server: `python -m moejax.serve --model default` started, /health polled every 50 ms, then 2 x "
          f"/v1/completions (max_tokens {args.new_tokens}, greedy, non-streaming); /health, 200 ok, start->1st done: "
          f"seconds from the process start; 1st/2nd req: each request's latency" + (" (min/median)" if args.repeats > 1
                                                                                 else ""))
    print(f"{'--warmup':>8} {'cache':>5} {'/health':>9} {'200 ok':>9} {'1st req':>9} {'2nd req':>9} {'1st/2nd':>7} "
          f"{'start->1st done':>15} {'1st compile':>11} {'load':>9} {'warm-up':>9} {'tokens':>6}")
    for r in out["summary"]:
        if r["failed"] == r["runs"]:
            err = next(x.get("error") for x in out["runs"] if (x["warmup"], x["cache"]) == (r["warmup"], r["cache"]))
            print(f"{r['warmup']:>8} {r['cache']:>5} FAILED: {err}")
            continue
        toks = ",".join(str(t) for t in r["completion_tokens"])
        print(f"{r['warmup']:>8} {r['cache']:>5} {cell(r['health_first_answer_s']):>9} {cell(r['ready_s']):>9} "
              f"{cell(r['first_completion_s']):>9} {cell(r['second_completion_s']):>9} {fmt(r['first_over_second']):>7} "
              f"{cell(r['first_completion_done_s']):>15} {cell(r['first_compile_time_s']):>11} "
              f"{cell(r['server_loading_s']):>9} {cell(r['server_warmup_s']):>9} {toks:>6}")
    for r in out["runs"]:
        if "error" in r:
            print(f"FAILED --warmup {r['warmup']} {r['cache']}: {r['error']}\n  log: {r['log_tail'][-400:]!r}")


# ------------------------------------------------------------------------------------------- main

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--models", default="default", help="offload: comma-separated models ('default' or folders)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"offload: configurations, of {', '.join(CONFIGS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens of every generation and request")
    p.add_argument("--warm-runs", type=int, default=1,
                   help="offload: runs after the first in each configuration's process (their median is reported)")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="offload: link bandwidth (GB/s) of the roofline for C < N")
    p.add_argument("--emulate-link", action="store_true",
                   help="offload: also throttle the host-paged rows to --bandwidth-gbps (generate's emulation)")
    p.add_argument("--repeats", type=int, default=1, help="start and server: repeats (min/median when > 1)")
    p.add_argument("--server-warmup", type=int, default=32, help="server: the --warmup tokens of the warmed start")
    p.add_argument("--server-warmup-new-tokens", type=int, default=None,
                   help="server: its --warmup-new-tokens with --warmup (default: the server's own, 256)")
    p.add_argument("--server-caches", default="cold,warm", help="server: cold, or cold,warm (compilation cache)")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="start: torch.set_num_threads in the transformers process (0: torch's default)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds any one process or wait may take")
    p.add_argument("--out", default=None, help="results JSON (atomic; an existing file needs --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    args.parts = [x for x in args.parts.split(",") if x]
    args.models = [x for x in args.models.split(",") if x]
    args.configs = [x for x in args.configs.split(",") if x]
    args.server_caches = [x for x in args.server_caches.split(",") if x]
    for name, chosen, known in (("part", args.parts, PARTS), ("configuration", args.configs, CONFIGS),
                                ("server cache", args.server_caches, ("cold", "warm"))):
        bad = [x for x in chosen if x not in known]
        if bad or not chosen:
            p.error(f"unknown {name} {', '.join(bad) or '(none)'}: expected some of {', '.join(known)}")
    if args.server_caches[0] != "cold":
        p.error("--server-caches: a warm start reuses the folder the cold start filled: give cold or cold,warm")
    if args.new_tokens < 2 or args.warm_runs < 0 or args.repeats < 1 or args.server_warmup < 0 or args.timeout <= 0:
        p.error("--new-tokens must be >= 2, --warm-runs >= 0, --repeats >= 1, --server-warmup >= 0, --timeout > 0")
    if args.server_warmup_new_tokens is not None and args.server_warmup_new_tokens < 1:
        p.error("--server-warmup-new-tokens must be >= 1")
    if args.bandwidth_gbps is not None and not args.bandwidth_gbps > 0:
        p.error("--bandwidth-gbps must be > 0")
    if args.emulate_link and args.bandwidth_gbps is None:
        p.error("--emulate-link throttles to --bandwidth-gbps: give it")
    return args


def machine() -> dict:
    return {"cpu": cpu_name(), "processor": platform.processor(), "machine": platform.machine(),
            "cores": os.cpu_count(), "system": platform.platform()}


def save(path: str | None, result: dict) -> None:
    if path:
        from moejax.base import atomic

        atomic.write_json(path, result, indent=1, sort_keys=False, make_parents=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if args.out:
        from moejax.base import atomic, errors

        try:
            atomic.check_output(args.out, args.overwrite, "--out")
            atomic.check_creatable(args.out, "--out")
        except (OSError, errors.UsageError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):  # unwind (children stopped, folders removed) as on Ctrl-C
        signal.signal(sig, lambda s, _f: sys.exit(128 + s))
    result = {"benchmark": "fixed costs around the work: offload vs resident decode, process start vs "
                           "transformers, server start and first requests",
              "command": shell([sys.executable, "bench/bench_fixed_costs.py",
                                *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "machine": machine(), "git": git_state(), "versions": versions(),
              "settings": {k: v for k, v in vars(args).items() if k != "worker"}, "parts": {}}
    m = result["machine"]
    print(f"machine: {m['cpu']} ({m['cores']} cores; platform.processor() {m['processor']!r}), git "
          f"{result['git']['commit']} ({result['git']['modified_files']} tracked files modified), load average "
          f"{os.getloadavg()[0]:.2f}")
    tmp = tempfile.mkdtemp(prefix="moejax-fixed-costs-")
    try:
        for part, fn in (("offload", offload_part), ("start", start_part), ("server", server_part)):
            if part not in args.parts:
                continue
            t0, load0 = time.perf_counter(), os.getloadavg()
            res = fn(args, tmp)
            res.update(wall_s=time.perf_counter() - t0, load_average_before=load0, load_average_after=os.getloadavg())
            result["parts"][part] = res
            save(args.out, result)
    except KeyboardInterrupt:
        print(f"\ninterrupted{f' ({args.out} holds the parts that finished)' if result['parts'] and args.out else ''}",
              file=sys.stderr)
        return 130
    finally:
        stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.out:
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
