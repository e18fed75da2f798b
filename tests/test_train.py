"""Training: sparse dispatch = model.forward, the balancing loss, loss goes down, seeded runs repeat,
resume = uninterrupted run, export loads in moejax and in transformers with matching logits."""

from __future__ import annotations

import dataclasses
import errno
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.base import tempfiles
from moejax.models import checkpoint
from moejax.models import moe as moe_lib
from moejax.models.config import from_hf
from moejax.runtime import api
from moejax.training import data, recipe, train
from support.file_limit import run_module_with_file_limit
from support.train_fixtures import write_corpus


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    corpus = os.path.dirname(write_corpus(str(root / "corpus"), docs_per_shard=30)[0])
    data_dir = str(root / "data")
    data.TokenData(data_dir, corpus, vocab_size=320, seq_len=32, log=lambda s: None)  # tokenizer once
    return {"root": root, "corpus": corpus, "data": data_dir}


def run(dirs, name, *extra):
    out = str(dirs["root"] / name)
    argv = _argv(dirs, out, *extra)
    assert train.main(argv) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return out, [json.loads(line) for line in f]


def _argv(dirs, out, *extra):
    return ["--out", out, "--config", "micro", "--steps", "12", "--batch", "4", "--seq-len", "32", "--lr", "1e-2",
            "--warmup", "2", "--eval-every", "0", "--ckpt-every", "0", "--ckpt-minutes", "0", "--vocab-size", "320",
            "--data-dir", dirs["data"], "--corpus-dir", dirs["corpus"], *extra]


@pytest.fixture(scope="module")
def baseline(dirs):
    return run(dirs, "a")


def micro_params(seed=1, router_scale=30.0):
    cfg = from_hf(recipe.hf_config("micro", 64))
    p = recipe.init_params(cfg, jax.random.key(seed))
    for lp in p["layers"]:
        lp["moe"]["router"] = lp["moe"]["router"] * router_scale  # decisive routing: no near ties
    return cfg, p


def test_sparse_dispatch_equals_model_forward():
    cfg, p = micro_params()
    toks = jax.random.randint(jax.random.key(2), (3, 16), 0, 64)
    dense = jax.jit(lambda q, t: recipe.batch_forward(q, cfg, t))(p, toks)
    sparse = jax.jit(lambda q, t: recipe.sparse_batch_forward(q, cfg, t, cfg.n_experts / cfg.top_k))(p, toks)
    for a, b in zip(dense[:3], sparse[:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    assert float(sparse[3]) == 0.0
    batch = jax.random.randint(jax.random.key(3), (3, 17), 0, 64)
    g_dense = jax.jit(jax.grad(lambda q: recipe.loss_fn(q, cfg, batch, 0.1, 0.0)[0]))(p)
    g_sparse = jax.jit(jax.grad(lambda q: recipe.loss_fn(q, cfg, batch, 0.1, cfg.n_experts / cfg.top_k)[0]))(p)
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_sparse)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    low = jax.jit(lambda q, t: recipe.sparse_batch_forward(q, cfg, t, 0.5))(p, toks)  # tight capacity: some assignments dropped
    assert 0 < float(low[3]) < 1


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.lists(st.integers(0, 8), min_size=1, max_size=200))
def test_queue_positions_are_the_running_count(n, values):
    """The capacity dispatch's place of each assignment in its expert's queue: the running count of its value
    before it (what the one-hot cumulative sum gave), by one stable sort."""
    a = np.asarray([v % n for v in values], np.int32)
    want = [int(np.sum(a[:i] == v)) for i, v in enumerate(a)]
    np.testing.assert_array_equal(np.asarray(jax.jit(moe_lib.queue_positions, static_argnums=1)(jnp.asarray(a), n)), want)


def test_steps_auto_leaves_evaluation_and_checkpoints_out_of_the_speed():
    """--steps auto's speed is the training steps' own: the H200 run measured 656 ms a step where its steps
    took 200 ms, because the first evaluation (15 s, compiling) and checkpoint (72 s, orbax starting) fell in
    the measuring window."""
    since, now = (10, 100.0, 0.0), (200, 227.0, 87.0)  # 190 steps in 127 s, 87 of them evaluating and saving
    assert train.step_seconds(since, now) == pytest.approx(40.0 / 190)
    assert train.step_seconds((10, 0.0, 0.0), (10, 5.0, 0.0)) == 5.0  # no step: no division by zero
    # the schedule: the time left less 3 % of the budget, at that speed; never shorter than the warmup
    assert train.planned_steps(200, 0.2, left_s=300.0, budget_s=1000.0, warmup=200) == 200 + 1350
    assert train.planned_steps(200, 0.2, left_s=-50.0, budget_s=330.0, warmup=200) == 201
    assert train.planned_steps(20, 0.2, left_s=1.0, budget_s=10.0, warmup=200) == 201
    # after an evaluation that took longer than planned: shorter, never longer, never before the warmup ends
    assert train.replanned_steps(1063, 500, 0.195, left_s=100.0, budget_s=480.0, warmup=200) == 500 + 438
    assert train.replanned_steps(600, 500, 0.195, left_s=100.0, budget_s=480.0, warmup=200) == 600
    assert train.replanned_steps(1063, 100, 0.195, left_s=0.0, budget_s=480.0, warmup=200) == 201


def test_steps_auto_shortens_its_schedule_after_a_slow_evaluation(dirs, monkeypatch, capsys):
    """An evaluation slower than planned (the H200's first one compiled for 84 s) shortens the schedule so
    that the learning rate still decays within the budget, instead of the budget cutting the run off."""
    import time as time_mod

    compiled = recipe.compiled_steps

    slept = []

    def slow_eval(*a, **k):  # the first evaluation takes 3 s more
        opt, step, eval_step = compiled(*a, **k)
        return opt, step, lambda *x: (slept or (time_mod.sleep(3.0), slept.append(1)), eval_step(*x))[1]

    monkeypatch.setattr(recipe, "compiled_steps", slow_eval)
    out = str(dirs["root"] / "auto")
    argv = _argv(dirs, out, "--steps", "auto", "--time-budget-min", "0.25", "--warmup", "4", "--eval-every", "25",
                 "--eval-seqs", "4")
    assert train.main(argv) == 0
    err = capsys.readouterr().err
    first = int(err.split("-> schedule of ")[1].split()[0])
    assert "more spent evaluating/checkpointing than planned" in err
    run = json.load(open(os.path.join(out, "run.json")))
    assert run["planned_steps"] < first and run["last"]["step"] <= first


def test_load_balancing_loss():
    N, K = 8, 2
    z = jnp.zeros((1, 64, N))
    uniform = jnp.stack([jnp.arange(64) % N, (jnp.arange(64) + 1) % N], -1)[None]
    assert float(recipe.load_balancing_loss(z, uniform, N)) == pytest.approx(1.0)
    collapsed = jnp.zeros((1, 64, K), jnp.int32).at[..., 1].set(1)
    peaked = jnp.zeros((1, 64, N)).at[..., :2].set(5.0)
    assert float(recipe.load_balancing_loss(peaked, collapsed, N)) > 3.0


def test_loss_decreases_and_aux_is_finite(baseline):
    _, m = baseline
    assert len(m) == 12
    assert np.mean([r["ce"] for r in m[-3:]]) < np.mean([r["ce"] for r in m[:3]]) - 0.3
    assert all(np.isfinite(r["aux"]) and np.isfinite(r["grad_norm"]) for r in m)
    assert all(r["tokens_per_s"] > 0 for r in m)


def test_same_seed_same_losses(dirs, baseline):
    _, again = run(dirs, "a2")
    assert [r["loss"] for r in again] == [r["loss"] for r in baseline[1]]
    _, other = run(dirs, "seed1", "--seed", "1", "--stop-after", "3")
    assert [r["loss"] for r in other] != [r["loss"] for r in baseline[1][:3]]


def test_resume_continues_exactly(dirs, baseline):
    out, first = run(dirs, "b", "--stop-after", "5", "--eval-every", "5", "--eval-seqs", "4")
    assert len(first) == 5 and train.latest_checkpoint(out).endswith("step_00000005")
    assert "val_ce" in first[-1] and np.isfinite(first[-1]["val_ce"])
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:  # an interrupted run logged past its checkpoint
        f.write(json.dumps({"step": 6, "loss": -1.0}) + "\n" + json.dumps({"step": 7, "loss": -1.0}) + '\n{"step": 8, "lo')
    _, both = run(dirs, "b", "--resume")
    assert [r["step"] for r in both] == list(range(1, 13))  # those steps once, as run again
    resumed = both[5:]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in baseline[1][5:]], rtol=1e-6)


def test_resume_keeps_the_runs_settings_and_refuses_to_change_its_training(dirs, tmp_path, capsys):
    """A training setting given to `--resume` with another value is refused (exit 2, nothing touched), not
    ignored (`--resume --steps 24` on a 12-step run training silently to step 12); the session's settings
    (evaluation, checkpoints, data folders) are the run's own unless given again, not the defaults."""
    out, first = run(dirs, "settings", "--stop-after", "3", "--eval-every", "3", "--eval-seqs", "2")
    before = _snapshot(out)
    for changed, was in (("--steps", "12"), ("--lr", "0.01"), ("--config", "micro")):
        value = {"--steps": "24", "--lr": "0.02", "--config": "small"}[changed]
        assert train.main(["--out", out, "--resume", changed, value]) == 2
        err = capsys.readouterr().err
        assert f"{changed} {value} (the run's is {was})" in err and "--overwrite" in err, err
        assert _snapshot(out) == before
    moved = tmp_path / "data-moved"
    shutil.copytree(dirs["data"], moved)
    assert train.main(["--out", out, "--resume", "--stop-after", "3", "--steps", "12", "--data-dir", str(moved)]) == 0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6] and "val_ce" in metrics[-1]  # --eval-every 3 kept
    run_args = json.load(open(os.path.join(out, "run.json")))["args"]
    assert run_args["eval_every"] == 3 and run_args["eval_seqs"] == 2 and run_args["data_dir"] == str(moved)
    assert "given" not in run_args


def _snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(folder) for f in files}


def test_rerun_and_export_never_destroy_what_is_there(dirs, baseline, tmp_path, capsys):
    """A rerun without --resume neither truncates metrics.jsonl nor repoints latest.json; --export does not
    replace a folder holding unrelated files."""
    out, _ = baseline
    before = _snapshot(out)
    assert train.main(_argv(dirs, out)) == 2
    err = capsys.readouterr().err
    assert "holds a training run" in err and "--resume" in err and "--overwrite" in err
    assert _snapshot(out) == before
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    assert train.main(_argv(dirs, str(mine))) == 2 and "not empty" in capsys.readouterr().err
    for overwrite in ([], ["--overwrite"]):
        assert train.main(["--out", out, "--export", str(mine), *overwrite]) == 2
        assert (mine / "todo.txt").read_text() == "keep me"
    assert train.main(["--out", out, "--export", str(dirs["root"]), "--overwrite"]) == 2  # contains the run
    assert _snapshot(out) == before
    folder = str(tmp_path / "model")
    assert train.main(["--out", out, "--export", folder]) == 0
    assert train.main(["--out", out, "--export", folder]) == 2 and "already exists" in capsys.readouterr().err
    assert train.main(["--out", out, "--export", folder, "--overwrite"]) == 0  # a checkpoint: replaced


def test_export_at_end_equals_export_of_the_final_checkpoint(dirs, baseline, tmp_path, capsys):
    """--export-at-end writes from memory what --export writes from the last checkpoint; with no checkpoint
    asked for (--ckpt-every 0 --ckpt-minutes 0) none is written; an export folder that may not be replaced
    is refused before training."""
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("keep me")
    assert train.main(_argv(dirs, str(dirs["root"] / "e0"), "--export-at-end", str(mine), "--overwrite")) == 2
    assert "not a checkpoint folder" in capsys.readouterr().err and not (dirs["root"] / "e0").exists()
    at_end = str(tmp_path / "at-end")
    out, m = run(dirs, "e", "--export-at-end", at_end)
    assert [r["loss"] for r in m] == [r["loss"] for r in baseline[1]]
    assert train.latest_checkpoint(out) is None and not os.path.exists(os.path.join(out, "checkpoints"))
    from_ckpt = train.export(baseline[0], str(tmp_path / "from-ckpt"))
    got, want = _snapshot(at_end), _snapshot(from_ckpt)
    assert got.keys() == want.keys() and got["params.safetensors"] == want["params.safetensors"]
    timeless = lambda files: {k: v for k, v in json.loads(files["training.json"]).items() if k != "time_s"}  # noqa: E731
    assert timeless(got) == {**timeless(want), "command": timeless(want)["command"] + " --export-at-end MODEL"}
    assert "--warmup 2 " in timeless(got)["command"] and "--export MODEL" in want["README.md"].decode()
    assert all(got[k] == want[k] for k in got if k not in ("training.json", "README.md"))  # README: the time too
    out, _ = run(dirs, "e2", "--export-at-end", str(tmp_path / "at-end-2"), "--ckpt-every", "6")
    assert train.latest_checkpoint(out).endswith("step_00000012")  # checkpoints asked for: the last one too


def test_overwrite_starts_a_fresh_run(dirs, tmp_path):
    out, first = run(dirs, "fresh", "--stop-after", "3")
    _, again = run(dirs, "fresh", "--stop-after", "2", "--overwrite")
    assert [r["step"] for r in again] == [1, 2] and again[0]["loss"] == first[0]["loss"]
    assert train.latest_checkpoint(out).endswith("step_00000002")
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # the old run is gone, not hidden


@pytest.mark.parametrize("failure", ["full disk", "ctrl-c"])
def test_an_overwrite_that_fails_before_its_first_checkpoint_keeps_the_old_run(dirs, monkeypatch, capsys, failure):
    """`--overwrite` keeps the old run aside until the new one can be resumed: deleted before training, a full
    disk at the new run's first checkpoint (or Ctrl-C before it) would leave neither run."""
    out, _ = run(dirs, f"kept-{failure.replace(' ', '-')}", "--stop-after", "3")
    before = _snapshot(out)

    def fails(path, tree):
        if failure == "ctrl-c":
            raise KeyboardInterrupt
        raise ValueError("[Errno 28] No space left on device")

    monkeypatch.setattr(train.orbax_io, "save", fails)
    if failure == "ctrl-c":
        with pytest.raises(KeyboardInterrupt):
            train.main(_argv(dirs, out, "--stop-after", "2", "--overwrite"))
    else:
        assert train.main(_argv(dirs, out, "--stop-after", "2", "--overwrite")) == 1
    err = capsys.readouterr().err
    assert f"the run that was in {out} is kept" in err
    assert _snapshot(out) == before and not [n for n in os.listdir(out) if n.startswith(".")]
    monkeypatch.undo()
    assert train.main(_argv(dirs, out, "--resume", "--stop-after", "1")) == 0  # and it still resumes


def test_a_run_set_aside_by_a_killed_overwrite_is_named_not_called_foreign(dirs, capsys):
    """Killed (SIGKILL) between setting the old run aside and the new run's first files, the folder holds only
    `.run.old-*`: the refusal says where the old run is instead of calling the folder unrelated."""
    out, _ = run(dirs, "killed-overwrite", "--stop-after", "2")
    aside = train.set_aside_run(out)
    assert os.listdir(out) == [os.path.basename(aside)]
    assert train.main(_argv(dirs, out)) == 2
    err = capsys.readouterr().err
    assert f"set aside by an --overwrite that did not finish, in {aside}" in err
    shutil.copytree(aside, out, dirs_exist_ok=True)  # a run beside it: --overwrite goes on, and says it is there
    assert train.main(_argv(dirs, out, "--overwrite", "--stop-after", "1")) == 0
    assert f"note: {aside} holds a run set aside" in capsys.readouterr().err and os.path.isdir(aside)


def test_export_loads_in_moejax_and_transformers(dirs, baseline, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out, _ = baseline
    folder = train.export(out, str(tmp_path / "model"))
    files = set(os.listdir(folder))
    assert {"moejax.json", "params.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "README.md", "training.json"} <= files
    gen = json.load(open(os.path.join(folder, "generation_config.json")))
    assert gen["text_style"] == "wikitext" and gen["eos_token_id"] == 0
    model = api.load(folder)
    assert model.params["embed"].dtype == jnp.bfloat16
    trained, cfg, _ = train.load_trained_params(out)
    ids = model.encode(" The city was founded in 1850 .")
    assert ids[0] == 0
    got = model.forward(ids).logits
    want = np.asarray(jax.jit(lambda p, t: recipe.batch_forward(p, cfg, t[None])[0][0])(
        jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), trained), jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-2)
    assert "trained:" in open(os.path.join(folder, "README.md")).read()

    # Hugging Face: export, load with transformers, compare fp32 logits
    p32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), model.params)
    hf_dir = checkpoint.save_hf(p32, model.cfg, str(tmp_path / "hf"), tokenizer_from=folder)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(jax.jit(lambda p, t: recipe.batch_forward(p, model.cfg, t[None])[0][0])(p32, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


def test_batched_attention_equals_model_attention():
    """The training path's jax.nn.dot_product_attention gives model.forward's logits (float32, XLA)."""
    cfg, p = micro_params()
    toks = jax.random.randint(jax.random.key(4), (2, 16), 0, 64)
    ref = jax.jit(lambda q, t: recipe.sparse_batch_forward(q, cfg, t, cfg.n_experts / cfg.top_k))(p, toks)
    fast = jax.jit(lambda q, t: recipe.sparse_batch_forward(q, cfg, t, cfg.n_experts / cfg.top_k,
                                                           attention="xla"))(p, toks)
    np.testing.assert_allclose(np.asarray(ref[0]), np.asarray(fast[0]), atol=2e-5)


def test_router_losses():
    """z-loss is mean logsumexp²; the offset loss sees only the expert-wise common mode of the logits."""
    z = jax.random.normal(jax.random.key(5), (2, 3, 7, 8))
    np.testing.assert_allclose(float(recipe.router_z_loss(z)), float(np.mean(jax.nn.logsumexp(z, -1) ** 2)),
                               rtol=1e-6)
    centred = z - z.reshape(2, -1, 8).mean(1)[:, None, None, :]
    assert float(recipe.router_offset_loss(centred)) < 1e-10
    bias = jnp.arange(8.0)
    np.testing.assert_allclose(float(recipe.router_offset_loss(centred + bias)), float(jnp.var(bias)), rtol=1e-5)


def test_offset_penalty_fades_over_its_decay_steps():
    """--offset-decay-steps: the full weight at step 0, linear to 0 at the end of the fade, 0 after; without it
    the weight is constant. The training step reports the weight it used."""
    const = recipe.StepConfig(lr=1e-3, warmup=0, offset_coef=2.0)
    fade = dataclasses.replace(const, offset_decay_steps=100)
    assert [float(recipe.offset_coef_at(s, const)) for s in (0, 50, 500)] == [2.0, 2.0, 2.0]
    assert [float(recipe.offset_coef_at(s, fade)) for s in (0, 25, 100, 500)] == pytest.approx([2.0, 1.5, 0.0, 0.0])
    cfg, p = micro_params()
    train_step, _ = recipe.make_steps(cfg, recipe.make_optimizer(0.1, 1.0), dataclasses.replace(fade, offset_decay_steps=4))
    batch = jax.random.randint(jax.random.key(7), (2, 9), 0, 64)
    opt_state = recipe.make_optimizer(0.1, 1.0).init(p)
    _, _, metrics = train_step(p, opt_state, batch, jnp.int32(1), jnp.int32(10))
    assert float(metrics["offset_coef"]) == pytest.approx(1.5)


def test_bf16_loss_keeps_routers_fp32_and_is_close():
    cfg, p = micro_params(router_scale=1.0)
    batch = jax.random.randint(jax.random.key(6), (2, 17), 0, 64)
    cast = recipe.cast_params(p, jnp.bfloat16)
    assert cast["layers"][0]["moe"]["router"].dtype == jnp.float32
    assert cast["embed"].dtype == jnp.bfloat16
    f32 = float(recipe.loss_fn(p, cfg, batch, 0.01)[0])
    b16 = float(recipe.loss_fn(p, cfg, batch, 0.01, compute_dtype=jnp.bfloat16)[0])
    assert abs(f32 - b16) < 0.05 * f32


def test_lr_schedule_warmup_and_cosine_floor():
    assert float(recipe.lr_at(5, 100, 1.0, 10)) == pytest.approx(0.5)
    assert float(recipe.lr_at(10, 100, 1.0, 10)) == pytest.approx(1.0)
    assert float(recipe.lr_at(100, 100, 1.0, 10, 0.1)) == pytest.approx(0.1)
    mid = [float(recipe.lr_at(s, 100, 1.0, 10, 0.1)) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(mid, mid[1:]))


def test_a_full_disk_at_the_export_keeps_the_trained_state_as_a_checkpoint(dirs, tmp_path, capsys, monkeypatch):
    """--export-at-end with no checkpoints asked for: an export the disk cannot take does not lose the whole run
    (exit 1, nothing kept): the state is saved as a checkpoint and the error says how to export it; a target
    that cannot be written at all is refused before training."""
    assert train.main(_argv(dirs, str(dirs["root"] / "ro"), "--export-at-end", "/proc/moejax-export")) == 1
    assert "--export-at-end /proc/moejax-export: cannot be written" in capsys.readouterr().err
    assert not (dirs["root"] / "ro").exists()

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train, "write_export", full)
    out, target = str(dirs["root"] / "full"), str(tmp_path / "model")
    assert train.main(_argv(dirs, out, "--export-at-end", target)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    kept = train.latest_checkpoint(out)
    assert kept.endswith("step_00000012") and f"the checkpoint {kept}" in err and f"--export {target}" in err
    monkeypatch.undo()
    monkeypatch.setattr(train.checkpoint, "save_moejax", full)  # fails inside the export: its staging goes too
    with pytest.raises(OSError):
        train.export(out, target)
    assert "export-files" not in os.listdir(out)
    assert not glob.glob(os.path.join(tempfiles.temp_root(), "moejax-export-*"))
    monkeypatch.undo()
    assert os.path.isfile(os.path.join(train.export(out, target), "params.safetensors"))


def test_an_orbax_save_that_fails_is_a_failure_and_leaves_no_partial_folder(dirs, monkeypatch):
    import orbax.checkpoint as ocp

    def full(self, path, state, *a, **k):  # what orbax does on a full disk: a partial folder, then ValueError
        os.makedirs(f"{path}.orbax-checkpoint-tmp-1")
        raise ValueError("RESOURCE_EXHAUSTED: No space left on device")

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", full)
    out = str(dirs["root"] / "orbax-full")
    assert train.main(_argv(dirs, out, "--ckpt-every", "6")) == 1  # a failure, not a usage error (2)
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # nor the folder the first checkpoint made


def test_a_real_failed_save_is_one_error_line_not_orbaxs_tracebacks(dirs):
    """A save that orbax really fails (a file-size limit: writes past 64 KiB fail as on a full disk) is one
    error, the last line, alone, and the unfinished folder is gone: left to itself, orbax prints some 300-700
    lines (its ERROR records with tracebacks, asyncio's "Task exception was never retrieved", tensorstore's
    "Event loop is closed" tracebacks and "coroutine ... was never awaited", some after moejax's own error line,
    which would share a line with the progress bar), and a late metadata write can leave the folder behind."""
    out = str(dirs["root"] / "orbax-fsize")

    proc = run_module_with_file_limit("moejax.train", _argv(dirs, out, "--ckpt-every", "2", "--steps", "4"), 65536)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert lines[-1].startswith(f"error: could not write the checkpoint {out}/checkpoints/step_00000002: "), lines[-3:]
    assert "Traceback" not in proc.stderr and "ERROR:" not in proc.stderr and len(lines) < 10, proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "checkpoints"))  # nor the folder the first checkpoint made


def test_a_token_file_the_disk_cannot_take_is_one_error_after_the_progress_bar(dirs, tmp_path):
    """The first shard is tokenized when the first batch is read, inside the block that closes the progress bar:
    the error is the last line, alone (not on the bar's line, and no bar is redrawn after it at exit), and the
    unstarted run leaves nothing."""
    data_dir = tmp_path / "data"  # the tokenizer without the token files: the run must write them
    data_dir.mkdir()
    for name in data.TOKENIZER_FILES:
        shutil.copy2(os.path.join(dirs["data"], name), data_dir / name)
    out = str(tmp_path / "run")
    argv = [a if a != dirs["data"] else str(data_dir) for a in _argv(dirs, out, "--steps", "4")]
    proc = run_module_with_file_limit("moejax.train", argv, 16 * 1024)
    assert proc.returncode == 1, proc.stderr[-3000:]
    tail = proc.stderr.rstrip("\n").split("\n")[-1]
    assert tail.startswith(f"error: [Errno {errno.EFBIG}] File too large: '{data_dir}/") and tail.endswith(".bin'"), \
        proc.stderr[-2000:]
    assert "\r" not in tail and "Traceback" not in proc.stderr
    assert not os.path.exists(out) and not list(data_dir.glob("*.bin*"))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_checkpoint_is_one_error_naming_it(dirs, tmp_path, damage):
    """A checkpoint with a data file cut short or gone: orbax raises a bare Exception from tensorstore (a
    144-line traceback); `--resume` and `--export` say which checkpoint cannot be read, in one line (run as
    commands: orbax's abandoned reads report from its threads until the process ends)."""
    out, _ = run(dirs, f"damaged-{damage}", "--ckpt-every", "6", "--stop-after", "6")
    ckpt = train.latest_checkpoint(out)
    biggest = max((p for p in Path(ckpt).rglob("*") if p.is_file() and p.parent.name == "d"),
                  key=lambda p: p.stat().st_size)
    if damage == "truncated":
        os.truncate(biggest, 100)
    else:
        biggest.unlink()
    env = {**os.environ, "MOEJAX_COMPILE_CACHE": "off"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    for argv in (_argv(dirs, out, "--resume"), ["--out", out, "--export", str(tmp_path / "export")]):
        proc = subprocess.run([sys.executable, "-m", "moejax.train", *argv], capture_output=True, text=True,
                              env=env, timeout=600)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
        assert lines[0].startswith(f"error: cannot read the checkpoint {ckpt} (damaged or incomplete): "), lines
        assert len(lines[0]) < 600
    assert not (tmp_path / "export").exists()


def test_a_tokenizer_set_left_incomplete_is_completed_not_fatal(dirs, tmp_path, monkeypatch):
    """A data folder left without special_tokens_map.json (a full disk after tokenizer.json) does not fail every
    later run: tokenizer.json is written last, and a set left incomplete is completed."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((Path(dirs["data"]) / "tokenizer.json").read_bytes())
    monkeypatch.setattr(data, "train_tokenizer", lambda *a, **k: pytest.fail("retrained"))
    data.ensure_tokenizer(str(folder), dirs["corpus"])
    assert sorted(os.listdir(folder)) == sorted(data.TOKENIZER_FILES)
    fresh = tmp_path / "fresh"  # and a disk that fills at the last file leaves none of the set

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data.atomic, "write_text", full)
    with pytest.raises(OSError):
        data.save_tokenizer(data.load_tokenizer(str(folder)), str(fresh))
    assert os.listdir(fresh) == []


def _stopped(argv, stop):
    """``train.main(argv)`` with the compile raising ``stop``: an OSError is one error line (exit 1), the rest
    go up as they came."""
    if stop is OSError:
        assert train.main(argv) == 1
    else:
        with pytest.raises(stop):
            train.main(argv)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, MemoryError, OSError])
def test_a_run_ended_before_its_first_step_leaves_nothing_a_rerun_would_need_resume_for(dirs, monkeypatch, stop):
    """Ctrl-C during the first compile (or any failure before step 1) removes what the run made, folders
    included, so that the plain rerun is not refused as a run to --resume. A folder the user made stays; a
    resumed run, or one that has logged a step, keeps everything."""
    def stopped(*a, **k):
        raise stop("stopped while compiling")

    out = dirs["root"] / f"early-{stop.__name__}" / "run"
    monkeypatch.setattr(recipe, "compiled_steps", stopped)
    _stopped(_argv(dirs, str(out)), stop)
    assert not out.parent.exists()
    empty = dirs["root"] / f"empty-{stop.__name__}"
    empty.mkdir()
    _stopped(_argv(dirs, str(empty)), stop)
    assert os.listdir(empty) == []  # emptied, not removed: the user made it
    monkeypatch.undo()
    _, m = run(dirs, f"early-{stop.__name__}/run", "--stop-after", "2")  # the plain rerun
    assert [r["step"] for r in m] == [1, 2]
    before = _snapshot(str(out))
    monkeypatch.setattr(recipe, "compiled_steps", stopped)
    _stopped(_argv(dirs, str(out), "--resume"), stop)
    assert _snapshot(str(out)) == before
