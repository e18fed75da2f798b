"""``python -m moejax.train``: train a small granular Qwen3-MoE on the WikiText-style corpus, and ship it.

    python -m moejax.train --out runs/run1 --corpus-dir CORPUS --config small --steps 3000 --batch 16
        --seq-len 256 --time-budget-min 50 --data-dir runs/data             # (one command)
    python -m moejax.train --out runs/run1 --resume            # continue from the last checkpoint (its corpus too)
    python -m moejax.train --out runs/run1 --export runs/model           # a bf16 moejax folder

The model is the pure ``moejax.models.model.forward`` (vmapped over the batch) with the architecture's own
routing, so what is trained is exactly what inference runs. Loss = cross-entropy + ``aux_coef`` × the
Switch/Qwen load-balancing loss ``N · Σ_i f_i · P_i`` per MoE layer (f_i: share of the token-expert
assignments expert i receives, P_i: its mean router probability), averaged over layers. AdamW with linear
warmup and cosine decay, global-norm clipping. Checkpoints (orbax: params, optimizer state, step, data
position, rng) are written atomically every ``--ckpt-every`` steps and when the time budget runs out.
The command is the same on CPU and GPU; the data order is a pure function of (seed, position), so a run is
reproducible and a resumed run continues exactly where the interrupted one stopped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import atomic, collector, commands, errors, flags, interrupts, orbax_io, seeds, tempfiles
from moejax.models import checkpoint
from moejax.models.config import ModelConfig, from_hf
from moejax.training import data, recipe


# ---------------------------------------------------------------------------------- checkpoints
def _ckpt_root(out: str) -> str:
    return os.path.join(out, "checkpoints")


RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints", "tokenizer", "export-files")  # export-files: older runs'
RUN_ASIDE_PREFIX = ".run.old-"  # where --overwrite keeps the old run until the new one has a checkpoint


def runs_set_aside(out: str) -> list[str]:
    """The folders in ``out`` holding a run an ``--overwrite`` set aside and did not finish with (killed before
    the new run's first checkpoint): never removed automatically, they may be the only copy of a run."""
    names = sorted(os.listdir(out)) if os.path.isdir(out) else []
    return [os.path.join(out, n) for n in names if n.startswith(RUN_ASIDE_PREFIX)]


def holds_run(out: str) -> bool:
    """Whether ``out`` holds a run of train's: its record ``run.json`` (written before any metrics or checkpoint)
    or its checkpoint index. ``metrics.jsonl``, ``checkpoints/`` or ``tokenizer/`` alone are names other tools
    use too: a folder with only those is the user's, whose files a resume would cut or delete."""
    return os.path.isfile(os.path.join(out, "run.json")) or os.path.isfile(os.path.join(_ckpt_root(out), "latest.json"))


def check_out_folder(out: str, resume: bool, overwrite: bool) -> None:
    """Refuse to start a fresh run over a folder that holds a run (its metrics and checkpoints would be
    lost) unless ``--resume`` (continue it) or ``--overwrite`` (start over), and any use of a folder that holds
    files but no run (``holds_run``): resuming there would empty a ``metrics.jsonl`` of the user's (a run with
    no checkpoint keeps no metrics). An empty or new folder is a fresh start, ``--resume`` or not."""
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise FileExistsError(f"--out {out} exists and is not a folder")
    names = set(os.listdir(out))
    if holds_run(out):
        if not resume and not overwrite:
            raise FileExistsError(f"--out {out} holds a training run ({', '.join(sorted(names & set(RUN_FILES)))}): "
                                  "pass --resume to continue it, or --overwrite to start over (its checkpoints "
                                  "and metrics are deleted once the new run has its first checkpoint)")
        return
    if not names:
        return
    aside = runs_set_aside(out)
    if aside:  # an --overwrite killed (SIGKILL, power cut) before its first checkpoint: the old run is there
        raise FileExistsError(f"--out {out} holds a run set aside by an --overwrite that did not finish, in "
                              f"{aside[0]}: move its files back into {out} to keep it, or delete that folder")
    listing = ", ".join(sorted(names)[:5])
    if resume:
        raise errors.UsageError(f"--out {out} holds no training run to resume ({listing}): give the folder of a "
                                "run, or an empty or new folder to start one")
    raise FileExistsError(f"--out {out} is not empty and holds no training run ({listing}): choose an empty or "
                          "new folder")


def remove_run(out: str) -> None:
    """Delete a previous run's own files in ``out`` (never anything else)."""
    for name in RUN_FILES:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


def save_state(out: str, step: int, params, opt_state, data_pos: int, rng: jax.Array, keep: int = 2) -> str:
    """Orbax checkpoint of the whole training state; ``latest.json`` is switched atomically afterwards."""
    root = _ckpt_root(out)
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"step_{step:08d}")
    state = {"params": params, "opt_state": {str(i): x for i, x in enumerate(jax.tree.leaves(opt_state))},
             "step": np.int64(step), "data_pos": np.int64(data_pos), "rng": np.asarray(jax.random.key_data(rng))}
    if os.path.exists(path):
        shutil.rmtree(path)
    try:
        orbax_io.save(path, state)  # orbax writes to a temporary folder and renames it when complete
    except (OSError, ValueError) as e:  # a full disk reaches us as orbax's ValueError: a failure, not a usage error
        atomic.remove_empty_folders([root])  # a first checkpoint that failed left an empty checkpoints/
        raise errors.Failure(f"could not write the checkpoint {path}: {errors.excerpt(e)}") from e
    atomic.write_json(os.path.join(root, "latest.json"), {"step": step, "path": os.path.basename(path)})
    old = sorted(p for p in os.listdir(root) if p.startswith("step_") and p != os.path.basename(path))
    for p in old[:max(0, len(old) - keep + 1)]:
        shutil.rmtree(os.path.join(root, p), ignore_errors=True)
    return path


def latest_checkpoint(out: str) -> str | None:
    meta = os.path.join(_ckpt_root(out), "latest.json")
    if not os.path.isfile(meta):
        return None
    with open(meta) as f:
        return os.path.join(_ckpt_root(out), json.load(f)["path"])


def restore_state(path: str, params_like, opt_state_like, rng_like):
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), t)  # noqa: E731
    opt_leaves, opt_def = jax.tree.flatten(opt_state_like)
    target = {"params": abstract(params_like), "opt_state": {str(i): abstract(x) for i, x in enumerate(opt_leaves)},
              "step": jax.ShapeDtypeStruct((), np.int64), "data_pos": jax.ShapeDtypeStruct((), np.int64),
              "rng": abstract(np.asarray(jax.random.key_data(rng_like)))}
    state = orbax_io.restore(path, target)
    opt_state = jax.tree.unflatten(opt_def, [state["opt_state"][str(i)] for i in range(len(opt_leaves))])
    rng = jax.random.wrap_key_data(jnp.asarray(state["rng"]))
    return state["params"], opt_state, int(state["step"]), int(state["data_pos"]), rng


def load_trained_params(out: str) -> tuple[dict, ModelConfig, dict]:
    """Parameters of the latest checkpoint of a run folder, its config and the run record."""
    run = read_run(os.path.join(out, "run.json"))
    cfg = from_hf(run["hf_config"])
    path = latest_checkpoint(out)
    if path is None:
        raise FileNotFoundError(f"{out} has no checkpoint yet")
    state = orbax_io.restore(path)
    return state["params"], cfg, {**run, "step": int(state["step"]), "data_pos": int(state["data_pos"])}


# ------------------------------------------------------------------------------------------ train
def _keep_metrics_until(path: str, step: int) -> None:
    """Cut ``metrics.jsonl`` back to the steps up to ``step`` (the checkpoint a run resumes from; 0: none):
    the steps an interrupted run logged past its last checkpoint are run again, and were logged twice."""
    if not os.path.exists(path):
        return
    if step == 0:
        os.remove(path)
        return
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line torn by the interruption
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    atomic.write_text(path, "".join(kept))


def _log_jsonl(path: str, record: dict) -> None:
    with open(path, "ab") as f:
        atomic.append_whole(f, (json.dumps(record) + "\n").encode(), path, fsync=False)


RESUMED_ARGS = ("config", "batch", "seq_len", "lr", "seed", "steps", "warmup", "aux_coef", "weight_decay", "clip",
                "capacity_factor", "vocab_size", "z_coef", "router_lr_scale", "compute_dtype", "attention",
                "min_lr_ratio", "aux_coef_start", "aux_decay_steps", "offset_coef", "offset_decay_steps")
# where the data is and how this session evaluates, checkpoints and stops: the run's own unless given again
SESSION_ARGS = ("data_dir", "corpus_dir", "time_budget_min", "eval_every", "eval_seqs", "eval_capacity_factor",
                "ckpt_every", "ckpt_minutes")


def read_run(path: str) -> dict:
    """A run's ``run.json``, or a ``Failure`` naming it when it is damaged."""
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except ValueError as e:  # bad JSON or UTF-8, an integer of over 4300 digits
        raise errors.Failure(f"{path} is not valid JSON: {e}") from None
    if not isinstance(run, dict) or not isinstance(run.get("args"), dict):
        raise errors.Failure(f"{path} is not a training run record (a JSON object with \"args\")")
    return run


def resume_args(args: argparse.Namespace, run_path: str) -> dict:
    """The previous run's record; a resumed run continues as begun. Its training settings (``RESUMED_ARGS``) replace
    those of ``args``; one given on the command line with another value is a usage error (``--resume --steps 8`` on
    a 4-step run silently trained to step 4). Its session settings (``SESSION_ARGS``: data folders, evaluation,
    checkpoints, time budget) are kept unless given again. ``args.given``: the flags given (``given_flags``)."""
    run = read_run(run_path)
    given = getattr(args, "given", set())
    differ = [f"{_flag(k)} {getattr(args, k)} (the run's is {run['args'][k]})" for k in RESUMED_ARGS
              if k in run["args"] and k in given and getattr(args, k) != run["args"][k]]
    if differ:
        raise errors.UsageError(f"--resume continues the run in {os.path.dirname(run_path)} with its own training "
                                f"settings, and {'; '.join(differ)} would change them: leave them out, or start "
                                "over with --overwrite")
    for k in RESUMED_ARGS + SESSION_ARGS:
        if k in run["args"] and (k in RESUMED_ARGS or k not in given):
            setattr(args, k, run["args"][k])
    return run


def train(args: argparse.Namespace) -> dict:
    """Run (or resume) training; returns a summary. Every step's metrics go to ``OUT/metrics.jsonl``."""
    out = os.path.abspath(args.out)
    check_out_folder(out, args.resume, args.overwrite)
    run_path = os.path.join(out, "run.json")
    run_prev = resume_args(args, run_path) if args.resume and os.path.isfile(run_path) else {}
    check_schedule(args)
    # the corpus given, a resumed run's own, else $MOEJAX_DATA/corpus; none: fail before creating or deleting anything
    args.corpus_dir = data.corpus_folder(args.corpus_dir, "--corpus-dir")
    data.split_shards(args.corpus_dir)
    if args.export_at_end:  # before anything, not after training: a folder that cannot be written fails now
        checkpoint.check_replaceable(args.export_at_end, args.overwrite, protect=(out,))
        atomic.check_creatable(args.export_at_end, "--export-at-end")
    fresh, made = not args.resume, atomic.missing_folders(out)
    for aside in runs_set_aside(out):
        print(f"note: {aside} holds a run set aside by an --overwrite that did not finish; delete it if it is not "
              "needed", file=sys.stderr)
    previous = set_aside_run(out) if args.overwrite and fresh else None
    try:
        summary = _run(args, out, run_path, run_prev, on_checkpoint=lambda: drop_previous_run(previous))
    except BaseException:
        if previous and os.path.isdir(previous) and latest_checkpoint(out) is None:
            restore_previous_run(out, previous)  # the new run has nothing to resume from: the old one stays
        elif fresh and not os.path.lexists(os.path.join(out, "metrics.jsonl")):
            discard_unstarted_run(out, made)
        drop_previous_run(previous)
        raise
    drop_previous_run(previous)
    return summary


def set_aside_run(out: str) -> str | None:
    """``--overwrite``: move the run in ``out`` (its ``RUN_FILES``) into a hidden folder ``out/.run.old-*``, kept
    until the new run has written its first checkpoint: a new run that fails before that (a full disk at its first
    checkpoint, an error, Ctrl-C) gives the old one back instead of leaving neither. None if ``out`` holds no run.
    Killed in between, the old run is in that folder, never removed automatically."""
    names = [n for n in RUN_FILES if os.path.lexists(os.path.join(out, n))]
    if not names:
        return None
    with interrupts.deferred():  # moved whole or not at all
        aside = tempfile.mkdtemp(prefix=RUN_ASIDE_PREFIX, dir=out)
        for n in names:
            os.replace(os.path.join(out, n), os.path.join(aside, n))
    return aside


def restore_previous_run(out: str, previous: str) -> None:
    """Put the run ``set_aside_run`` moved into ``previous`` back in ``out``, replacing the new run's files."""
    with interrupts.deferred():
        remove_run(out)
        for n in os.listdir(previous):
            os.replace(os.path.join(previous, n), os.path.join(out, n))
        os.rmdir(previous)
    print(f"the run that was in {out} is kept: the new run ended before its first checkpoint (delete the run's "
          "files first to start over without it)", file=sys.stderr)


def drop_previous_run(previous: str | None) -> None:
    """Delete the run ``set_aside_run`` kept, once the new run can be resumed (or has finished)."""
    if previous and os.path.isdir(previous):
        shutil.rmtree(previous)


def discard_unstarted_run(out: str, made: list[str]) -> None:
    """What a fresh run that ended before its first step (an error, Ctrl-C during the first compile) wrote in
    ``out`` — its ``run.json`` and ``tokenizer/`` — and the folders it made: otherwise the plain rerun is
    refused as a run that needs ``--resume``, a run with nothing to resume."""
    remove_run(out)
    atomic.remove_empty_folders(made)


def _run(args: argparse.Namespace, out: str, run_path: str, run_prev: dict, on_checkpoint: Callable[[], None]) -> dict:
    """``train`` once the run's folder and settings are checked; ``on_checkpoint`` runs after every checkpoint."""
    from tqdm import tqdm

    os.makedirs(out, exist_ok=True)
    log = lambda s: tqdm.write(s, file=sys.stderr)  # noqa: E731
    ds = data.TokenData(args.data_dir, args.corpus_dir, args.vocab_size, args.seq_len, args.seed, log=log)
    hf = recipe.hf_config(args.config, ds.vocab_size, max_len=max(1024, args.seq_len), eos_id=ds.eos_id)
    cfg = from_hf(hf)
    tok_dir = os.path.join(out, "tokenizer")
    if not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        os.makedirs(tok_dir, exist_ok=True)
        for name in data.TOKENIZER_FILES:
            shutil.copy2(os.path.join(args.data_dir, name), os.path.join(tok_dir, name))

    sc = step_config(args)
    opt, train_step, eval_step = recipe.compiled_steps(cfg, sc)
    auto_steps = args.steps == "auto"
    # planned length of the LR schedule: fixed, or (auto) set once the speed is measured after warmup
    total_steps = int(run_prev.get("planned_steps") or 0) if auto_steps else int(args.steps)
    rng = seeds.prng_key(args.seed, typed=True)
    rng, init_key = jax.random.split(rng)
    params = recipe.init_params(cfg, init_key)
    opt_state = opt.init(params)
    step, data_pos = 0, 0
    metrics_path = os.path.join(out, "metrics.jsonl")
    if args.resume:
        path = latest_checkpoint(out)
        if path is None:
            log(f"--resume: no checkpoint in {out}, starting from scratch")
        else:
            params, opt_state, step, data_pos, rng = restore_state(path, params, opt_state, rng)
            log(f"resumed from {path} (step {step}, data position {data_pos})")
    _keep_metrics_until(metrics_path, step)
    n_params = recipe.count_params(params)
    run = {"args": {k: v for k, v in vars(args).items() if k not in ("export", "export_at_end", "resume", "overwrite", "given")}, "hf_config": hf,
           "params": n_params, "hardware": hardware(), "planned_steps": total_steps or None}
    atomic.write_json(run_path, run)
    log(f"model {args.config}: {n_params / 1e6:.2f}M params ({cfg.n_experts} experts, top-{cfg.top_k}, "
        f"{cfg.num_layers} layers, d={cfg.hidden_size}); {jax.devices()[0].platform}; "
        f"batch {args.batch} x {args.seq_len} tokens")


    def evaluate(params) -> dict:
        ms = [eval_step(params, jnp.asarray(b)) for b in ds.val_batches(args.eval_seqs, args.batch)]
        return {k: float(np.mean([m[k] for m in ms])) for k in ms[0]} if ms else {}

    prior_time = float((run_prev.get("last") or {}).get("time_s", 0.0)) if step else 0.0
    start = time.time()
    budget = args.time_budget_min * 60 if args.time_budget_min else None
    tokens_per_step = args.batch * args.seq_len
    max_steps = (1 << 62) if auto_steps else int(args.steps)
    next_batch = ds.batch(data_pos, args.batch)  # before the bar: a first shard may be tokenized (and fail) here
    bar = tqdm(total=None if auto_steps else max_steps, initial=step, desc="train", dynamic_ncols=True,
               mininterval=2.0, file=sys.stderr)
    last_ckpt_time, window_t, window_steps, stop_reason = time.time(), time.time(), 0, "steps"
    m, first_step = None, step
    # the run's last state is checkpointed, unless it is exported from memory instead and no checkpoint
    # was asked for: a run not meant to resume, e.g. on a lent machine (orbax's first save took 72 s there)
    final_checkpoint = not (args.export_at_end and not args.ckpt_every and not args.ckpt_minutes)
    probe_from = None  # (step, time, overhead) where the speed measurement of --steps auto starts
    measured_step_s = None  # --steps auto: the speed it planned with
    overhead_s = 0.0  # time spent evaluating and checkpointing, which the speed measurement leaves out
    overhead_planned = 0.0  # overhead_s when the schedule was last checked against the time left
    try:  # the bar is closed before an error is reported: its line and the error's stay apart
        while step < max_steps:
            if auto_steps and not total_steps:
                # the schedule's length does not matter during warmup; measure the speed there, then fix it
                probe_start, probe_end = min(10, args.warmup // 4), max(min(args.warmup, 200), 20)
                if step == probe_start:
                    probe_from = (step, time.time(), overhead_s)
                elif probe_from and step >= probe_end:
                    measured_step_s = step_seconds(probe_from, (step, time.time(), overhead_s))
                    per_step = measured_step_s
                    total_steps = planned_steps(step, per_step, budget - (time.time() - start), budget, args.warmup)
                    run["planned_steps"] = total_steps
                    atomic.write_json(run_path, run)
                    log(f"--steps auto: {per_step * 1e3:.1f} ms/step -> schedule of {total_steps} steps")
            batch, next_pos = next_batch
            params, opt_state, m = train_step(params, opt_state, jnp.asarray(batch), jnp.int32(step),
                                              jnp.int32(total_steps or max(args.warmup + 1, 1 << 30)))
            step, data_pos = step + 1, next_pos
            if step < max_steps:
                next_batch = ds.batch(data_pos, args.batch)  # prepared while the step runs
            m = {k: float(v) for k, v in m.items()}
            window_steps += 1
            now = time.time()
            tps = window_steps * tokens_per_step / max(now - window_t, 1e-9)
            if now - window_t > 30:
                window_t, window_steps = now, 0
            rec = {"step": step, "tokens": step * tokens_per_step,
                   "time_s": round(prior_time + now - start, 2), "tokens_per_s": round(tps, 1), **m}
            bar.set_postfix(loss=f"{m['ce']:.3f}", aux=f"{m['aux']:.3f}", tok_s=f"{tps:.0f}", refresh=False)
            bar.update(1)
            if args.eval_every and (step % args.eval_every == 0 or step == (total_steps if auto_steps else args.steps)):
                t_eval = time.time()
                ev = evaluate(params)
                overhead_s += time.time() - t_eval
                rec["val_ce"] = ev.get("ce")
                log(f"step {step}: train ce {m['ce']:.4f}  val ce {ev.get('ce', float('nan')):.4f}  "
                    f"aux {m['aux']:.3f}  z {m['z_loss']:.2f}  load min/max {m['min_load']:.2f}/{m['max_load']:.2f}  "
                    f"dropped {m['dropped']:.3f}  lr {m['lr']:.2e}  {tps:.0f} tok/s")
            if not (np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])):
                _log_jsonl(metrics_path, rec)
                raise FloatingPointError(f"step {step}: loss {m['loss']}, gradient norm {m['grad_norm']} (not finite); "
                                         "the last checkpoint is untouched")
            _log_jsonl(metrics_path, rec)
            out_of_time = budget is not None and now - start > budget
            interrupted = args.stop_after is not None and step - first_step >= args.stop_after
            out_of_time = out_of_time or interrupted
            if auto_steps and total_steps and measured_step_s and overhead_s > overhead_planned:
                # an evaluation or checkpoint took longer than planned for (a first one compiles): shorten the
                # schedule so that the learning rate still decays within the budget instead of being cut off
                shorter = replanned_steps(total_steps, step, measured_step_s, budget - (time.time() - start), budget,
                                          args.warmup)
                if shorter < total_steps:
                    log(f"--steps auto: {overhead_s - overhead_planned:.0f} s more spent evaluating/checkpointing than "
                        f"planned -> schedule of {shorter} steps instead of {total_steps}")
                    total_steps = run["planned_steps"] = shorter
                    atomic.write_json(run_path, run)
            overhead_planned = overhead_s
            if auto_steps and total_steps and step >= total_steps:
                out_of_time = True  # the schedule is done
            if (args.ckpt_every and step % args.ckpt_every == 0) \
                    or (final_checkpoint and (out_of_time or step == max_steps)) \
                    or (args.ckpt_minutes and now - last_ckpt_time > args.ckpt_minutes * 60):
                t_ckpt = time.time()
                save_state(out, step, params, opt_state, data_pos, rng)
                on_checkpoint()
                last_ckpt_time = time.time()
                overhead_s += last_ckpt_time - t_ckpt
            if out_of_time:
                stop_reason = ("interrupted" if interrupted else
                               "schedule done" if auto_steps and step >= total_steps else "time budget")
                break
    finally:
        bar.close()
    final_eval = evaluate(params) if args.eval_every else {}
    summary = {"step": step, "tokens": step * tokens_per_step, "stop": stop_reason,
               "time_s": round(prior_time + time.time() - start, 1),
               "train_ce": m["ce"] if m else (run_prev.get("last") or {}).get("train_ce"), "val_ce": final_eval.get("ce"),
               "params": n_params}
    run["last"] = summary
    atomic.write_json(run_path, run)
    log(f"done: {json.dumps(summary)}")
    if args.export_at_end:
        try:
            log(f"exported: {write_export(params, cfg, {**run, 'step': step}, out, args.export_at_end, overwrite=args.overwrite, at_end=True)}")
        except OSError as e:  # a full disk: the trained parameters must not go with the process
            raise export_failed(e, args.export_at_end, out, lambda: save_state(out, step, params, opt_state, data_pos, rng),
                                saved=latest_checkpoint(out) if final_checkpoint else None) from e
    return summary


def export_failed(err: OSError, folder: str, out: str, save: Callable[[], str], saved: str | None) -> Exception:
    """The error of an ``--export-at-end`` that could not be written, after keeping the trained state: a
    checkpoint in ``out`` (``save``) unless the run already wrote one at its last step (``saved``), from which
    ``--export`` writes the folder again."""
    if saved is None:
        try:
            saved = save()
        except Exception as second:  # noqa: BLE001 - the disk is full for the checkpoint too
            return errors.Failure(f"--export-at-end {folder}: {err.strerror or err}; the trained parameters could "
                                  f"not be kept either ({second}): they are lost")
    return errors.Failure(f"--export-at-end {folder}: {err.strerror or err}; the trained state is kept as the "
                          f"checkpoint {saved}: make room, then python -m moejax.train --out {out} --export {folder}")


def step_seconds(since: tuple[int, float, float], now: tuple[int, float, float]) -> float:
    """Seconds per training step between two (step, clock, overhead) readings, leaving out the time spent
    evaluating and checkpointing in between: the first evaluation compiles its step and the first checkpoint
    starts up orbax, which on an H200 took 15 s and 72 s against 0.2 s a step; counted, they made the
    steps look three times slower (656 ms), which plans a third of the steps the time left allows."""
    return max((now[1] - since[1]) - (now[2] - since[2]), 0.0) / max(now[0] - since[0], 1)


def planned_steps(step: int, per_step: float, left_s: float, budget_s: float, warmup: int) -> int:
    """``--steps auto``: the schedule's length once the speed is known, as many steps as the time left
    allows less a 3 % margin of the budget (for the evaluations and checkpoints still to come), never
    ending before the warmup does."""
    more = int(max(left_s - 0.03 * budget_s, 0.0) / per_step) if per_step > 0 else 0
    return max(step + 1, warmup + 1, step + more)


def replanned_steps(total: int, step: int, per_step: float, left_s: float, budget_s: float, warmup: int) -> int:
    """``--steps auto`` after an unplanned delay: the schedule shortened to what the time left still holds
    (``planned_steps``), never lengthened (the learning rate would rise again). On the H200 the first
    evaluation compiled for 84 s and the run was cut off at step 628 of 1,063, its rate still at 60 %."""
    return min(total, planned_steps(step, per_step, left_s, budget_s, warmup))


def step_config(args: argparse.Namespace) -> recipe.StepConfig:
    return recipe.StepConfig(lr=args.lr, warmup=args.warmup, weight_decay=args.weight_decay, clip=args.clip,
                             aux_coef=args.aux_coef, aux_coef_start=args.aux_coef_start,
                             aux_decay_steps=args.aux_decay_steps, z_coef=args.z_coef, router_lr_scale=args.router_lr_scale,
                             capacity_factor=args.capacity_factor, eval_capacity_factor=args.eval_capacity_factor,
                             compute_dtype=args.compute_dtype, attention=args.attention, min_lr_ratio=args.min_lr_ratio,
                             offset_coef=args.offset_coef, offset_decay_steps=args.offset_decay_steps)


def hardware() -> dict:
    dev = jax.devices()[0]
    return {"platform": dev.platform, "device": getattr(dev, "device_kind", str(dev)), "cpus": os.cpu_count(),
            "machine": platform.machine(), "jax": jax.__version__}


# ------------------------------------------------------------------------------------------ export
def export(out: str, folder: str, dtype=jnp.bfloat16, text_style: str = "wikitext", overwrite: bool = False) -> str:
    """Write the run's latest parameters as a moejax checkpoint folder (bf16) with the tokenizer, a
    ``generation_config.json`` (``"text_style": "wikitext"``) and a README recording how it was trained.
    An existing ``folder`` is replaced only with ``overwrite`` and only if it is a checkpoint."""
    checkpoint.check_replaceable(folder, overwrite, protect=(out,))
    params, cfg, run = load_trained_params(out)
    return write_export(params, cfg, run, out, folder, dtype, text_style, overwrite)


def write_export(params, cfg: ModelConfig, run: dict, out: str, folder: str, dtype=jnp.bfloat16,
                 text_style: str = "wikitext", overwrite: bool = False, at_end: bool = False) -> str:
    """``export``'s folder from parameters in hand: a checkpoint's, or (``--export-at-end``) the training
    loop's own, with ``run`` = the run record plus the step they are from."""
    params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else 0
    with interrupts.deferred():  # the staging folder is owned (removed below) from the moment it exists
        staging = tempfiles.make_temp_dir("moejax-export-")
    try:
        for name in data.TOKENIZER_FILES:
            shutil.copy2(os.path.join(out, "tokenizer", name), os.path.join(staging, name))
        atomic.write_json(os.path.join(staging, "generation_config.json"), {
            "bos_token_id": eos, "eos_token_id": eos, "do_sample": False, "max_new_tokens": 64,
            "text_style": text_style})
        a = run["args"]
        last = run.get("last") or {}
        info = {"model": "qwen3_moe", "params": run["params"], "step": run["step"],
                "tokens": run["step"] * a["batch"] * a["seq_len"], "val_ce": last.get("val_ce"),
                "time_s": last.get("time_s"), "hardware": run["hardware"],
                "command": command_line(a) + (" --export-at-end MODEL" if at_end else "")}
        extra = {"training.json": atomic.json_text(info), "README.md": readme_text(cfg, info, at_end)}
        folder = checkpoint.save_moejax(params, cfg, folder, tokenizer_from=staging, overwrite=overwrite,
                                        protect=(out,), extra_files=extra)
    finally:  # a failed export left OUT/export-files behind
        shutil.rmtree(staging, ignore_errors=True)
    os.chmod(folder, 0o755)
    return folder


def hw_text(hw: dict) -> str:
    return f"{hw.get('platform')} ({hw.get('device')}, {hw.get('cpus')} CPU cores, jax {hw.get('jax')})"


def command_line(a: dict) -> str:
    """The training command as run: the settings that differ from the defaults (and the model's size and
    length, always), with the run's and data's folders left as OUT and DATA."""
    defaults = vars(build_parser().parse_args(["--out", "OUT"]))
    always = ("config", "steps", "batch", "seq_len", "lr", "seed")
    skip = ("out", "data_dir", "corpus_dir", "export", "export_at_end", "resume", "overwrite", "stop_after")
    flags = [f"{_flag(k)} {v:g}" if isinstance(v, float) else f"{_flag(k)} {v}"
             for k, v in ((k, a.get(k)) for k in defaults) if k not in skip and v is not None  # the parser's order
             and (k in always or v != defaults[k])]
    return "python -m moejax.train --out OUT " + " ".join(flags) + " --data-dir DATA"


def readme_text(cfg: ModelConfig, info: dict, at_end: bool = False) -> str:
    then = "" if at_end else ", then `python -m moejax.train --out OUT --export MODEL`"
    ppl = f"{np.exp(info['val_ce']):.1f}" if info.get("val_ce") else "n/a"
    return f"""# moejax default model

A small granular Qwen3-MoE trained from scratch by `moejax.train` on the WikiText-style English Wikipedia
corpus (Wikipedia contributors, CC BY-SA 3.0 / GFDL; share-alike applies to verbatim outputs).

- architecture: qwen3_moe, {cfg.num_layers} layers, d_model {cfg.hidden_size}, {cfg.num_heads} heads x {cfg.head_dim}
  ({cfg.num_kv_heads} KV heads), {cfg.n_experts} routed experts per layer, top-{cfg.top_k}, expert FFN
  {cfg.moe_intermediate_size}, tied embeddings, byte-level BPE vocabulary {cfg.vocab_size}
- parameters: {info['params']:,} (stored bf16)
- trained: {info['step']} steps, {info['tokens']:,} tokens, {info.get('time_s')} s on {hw_text(info['hardware'])}
- validation (corpus shard -07) cross-entropy {info.get('val_ce')} nats/token (perplexity {ppl}, BPE tokens)
- text style: WikiText (` @-@ `, spaces before punctuation); `generation_config.json` has
  `"text_style": "wikitext"` and `moejax.base.textproc.wikitext_detokenize` undoes the spacing
- command: `{info['command']}`{then}
"""


# --------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=commands.prog("train"), description=__doc__,
                                formatter_class=commands.HelpFormatter)
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, run.json, tokenizer")
    p.add_argument("--config", default="small", choices=sorted(recipe.CONFIGS))
    p.add_argument("--steps", type=_steps_arg, default=3000,
                   help="total steps (the LR schedule's length), or 'auto': as many as --time-budget-min allows "
                        "at the speed measured during warmup")
    p.add_argument("--corpus-dir", default=None, help="the training corpus: gzip/xz text shards "
                   f"{data.CORPUS_PATTERN}, the last held out for validation (default: $MOEJAX_DATA/corpus)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in an OUT that holds a run (deleted once the new run has written its first "
                        "checkpoint; kept if it fails before), or replace an existing --export "
                        "checkpoint folder")
    p.add_argument("--seed", type=errors.seed_arg, default=0)
    p.add_argument("--time-budget-min", type=flags.finite_float(0.0, 1e7, low_open=True), default=None,
                   help="stop cleanly (final checkpoint) after M minutes (default: no limit)")
    p.add_argument("--export", metavar="DIR", help="write OUT's latest params as a bf16 moejax folder and exit "
                   "(default: train)")
    p.add_argument("--export-at-end", metavar="DIR",
                   help="when training stops, write its params as --export would, straight from memory; with "
                        "--ckpt-every 0 --ckpt-minutes 0 this replaces the final checkpoint (no orbax at all: a run "
                        "that will not be resumed; default: no export)")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: simulate an interruption
    g1 = p.add_argument_group("optimiser")
    g1.add_argument("--batch", type=int, default=16)
    g1.add_argument("--seq-len", type=int, default=256)
    g1.add_argument("--lr", type=flags.finite_float(0.0, 10.0, low_open=True), default=3e-3)
    g1.add_argument("--warmup", type=int, default=100)
    g1.add_argument("--weight-decay", type=flags.finite_float(0.0, 100.0), default=0.1)
    g1.add_argument("--clip", type=flags.finite_float(0.0, 1e6, low_open=True), default=1.0)
    g1.add_argument("--min-lr-ratio", type=flags.finite_float(0.0, 1.0),
                    default=0.1, help="final learning rate / peak (cosine decay)")
    g2 = p.add_argument_group("router losses")
    g2.add_argument("--aux-coef", type=flags.finite_float(0.0, 1e6), default=0.5,
                    help="load-balancing loss coefficient (0.01-0.1 let the CPU run's router collapse onto 4 experts "
                         "early on; at 0.01 the granular config collapses for ~50 steps with every remedy, and "
                         "--z-coef 1e-3 --router-lr-scale 0.1 --offset-coef 1 recovers best: docs/benchmarks.md#training)")
    g2.add_argument("--aux-coef-start", type=flags.finite_float(0.0, 1e6), default=None,
                    help="balancing weight at step 0, decaying linearly to --aux-coef over --aux-decay-steps "
                         "(default: --aux-coef throughout)")
    g2.add_argument("--aux-decay-steps", type=int, default=0)
    g2.add_argument("--z-coef", type=flags.finite_float(0.0, 1e6),
                    default=0.0, help="router z-loss coefficient (ST-MoE uses 1e-3)")
    g2.add_argument("--offset-coef", type=flags.finite_float(0.0, 1e6), default=0.0,
                    help="penalty on the variance across experts of the batch-mean router logit: a common-mode "
                         "offset makes every token pick the same experts (the collapse seen on CPU runs)")
    g2.add_argument("--offset-decay-steps", type=int, default=0,
                    help="fade the offset penalty linearly to 0 over this many first steps (0: constant); the "
                         "collapse it prevents is an early one, and kept on it holds expert usage near uniform")
    g2.add_argument("--router-lr-scale", type=flags.finite_float(0.0, 1e6),
                    default=1.0, help="router learning rate / the others'")
    g3 = p.add_argument_group("computation")
    g3.add_argument("--compute-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="forward/backward precision (float32 master weights and routers either way)")
    g3.add_argument("--attention", default="model", choices=("model", "auto", "xla", "cudnn"),
                    help="training attention: attention.gqa_attention per sequence, or jax.nn.dot_product_attention "
                         "over the batch (auto: fused kernel where the backend has one)")
    g3.add_argument("--capacity-factor", type=flags.finite_float(0.0, 1e6), default=1.25,
                    help="sparse expert capacity per batch (x B·T·K/N); 0 = exact dense experts (model.forward)")
    g3.add_argument("--eval-capacity-factor", type=flags.finite_float(0.0, 1e6), default=2.0,
                    help="capacity factor of the periodic validation loss (0 = exact)")
    g4 = p.add_argument_group("evaluation and checkpoints")
    g4.add_argument("--eval-every", type=int, default=200, help="validation loss every N steps (0: never)")
    g4.add_argument("--eval-seqs", type=int, default=64, help="validation sequences per evaluation")
    g4.add_argument("--ckpt-every", type=int, default=500)
    g4.add_argument("--ckpt-minutes", type=flags.finite_float(0.0, 1e7),
                    default=10.0, help="also checkpoint every M minutes")
    g5 = p.add_argument_group("data and tokenizer")
    g5.add_argument("--data-dir", default=data.DEFAULT_DATA_DIR)
    g5.add_argument("--vocab-size", type=int, default=data.DEFAULT_VOCAB)
    return p


def _steps_arg(text: str):
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--steps must be >= 1, got {value}")
    return value


_INTS = {"batch": 1, "seq_len": 1, "eval_seqs": 1, "vocab_size": 1, "warmup": 0, "aux_decay_steps": 0,
         "offset_decay_steps": 0, "eval_every": 0, "ckpt_every": 0}  # name -> smallest value
_POSITIVE_FLOATS = ("lr", "clip", "time_budget_min")
_NON_NEGATIVE_FLOATS = ("weight_decay", "min_lr_ratio", "aux_coef", "aux_coef_start", "z_coef", "offset_coef",
                        "router_lr_scale", "capacity_factor", "eval_capacity_factor", "ckpt_minutes")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args: argparse.Namespace) -> None:
    """Refuse flag values training cannot run with (NaN included), before anything is created."""
    for name, low in _INTS.items():
        if getattr(args, name) < low:
            raise ValueError(f"{_flag(name)} must be >= {low}, got {getattr(args, name)}")
    for name in _POSITIVE_FLOATS + _NON_NEGATIVE_FLOATS:
        value, strict = getattr(args, name), name in _POSITIVE_FLOATS
        if value is not None and not (math.isfinite(value) and (value > 0 if strict else value >= 0)):
            raise ValueError(f"{_flag(name)} must be a finite number {'>' if strict else '>='} 0, got {value}")
    if args.steps == "auto" and not args.time_budget_min:
        raise ValueError("--steps auto needs --time-budget-min (the run's length is what the budget allows)")
    if args.min_lr_ratio > 1:
        raise ValueError(f"--min-lr-ratio is the final learning rate / the peak, at most 1, got {args.min_lr_ratio}")


def check_schedule(args: argparse.Namespace) -> None:
    """Refuse schedule flags that would silently do nothing; on ``--resume`` after the run's own settings
    replaced the command line's (``resume_args``)."""
    if args.steps != "auto" and args.warmup >= args.steps:
        raise errors.UsageError(f"--warmup {args.warmup} must be below --steps {args.steps}: the learning rate would "
                                "never reach its peak (pass a shorter --warmup)")
    if (args.aux_coef_start is None) != (args.aux_decay_steps == 0):
        raise errors.UsageError("--aux-coef-start and --aux-decay-steps go together: the balancing weight decays "
                                "from --aux-coef-start to --aux-coef over --aux-decay-steps steps")
    if args.offset_decay_steps and not args.offset_coef:
        raise errors.UsageError("--offset-decay-steps fades the offset penalty: it needs --offset-coef > 0")


def given_flags(argv: list[str] | None) -> set[str]:
    """The destinations of the flags ``argv`` gives (a default counts as not given)."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    collector.for_compiling()
    args = build_parser().parse_args(argv)
    args.given = given_flags(argv)
    args.data_dir = os.path.abspath(os.path.expanduser(args.data_dir))
    try:
        if args.export:
            print(export(args.out, args.export, overwrite=args.overwrite))
            return 0
        check_args(args)
        train(args)
    except errors.HANDLED as e:
        return errors.report(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
