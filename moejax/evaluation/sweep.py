"""Sweeps over routing / cache settings, evaluated in vmapped batches, with resumable JSONL results.

    python -m moejax.evaluate --sweep lam=0:1:50 --cache-size 0.5 --results lam.jsonl
    python -m moejax.evaluate --routing max-rank --sweep max_rank=4:32:8 --sweep cache_size=8,16 --results mr.jsonl

What the points are (specs, grid, identity, record schema) is ``sweep_points``; this module runs them.

Results file: one JSON object per line (``sweep_points``' record schema), appended, flushed and fsync'ed as soon
as each point (or each vmapped batch of points) is done, so an interrupted run loses only the batch in
flight. Rerunning the same command skips every point whose ``key`` is already in the file. A half-written
last line (a crash in the middle of a write) is ignored when reading and cut off before the next append;
a malformed line anywhere else is an error naming the file and line.

Batching: WikiText points with the same routing kind, cache scope and eviction policy (and no router
hook) run as one ``jax.vmap`` over their stacked router states (policy values, capacity and initial
cache are data), chunk after chunk, the states carried across chunks exactly as the one-point loop does.
With a mesh (``Runner(mesh=...)``) each batch is spread over the mesh's devices along the point axis.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import atomic, distributed, errors
from moejax.models import gating
from moejax.models.model import forward
from moejax.experts import trace as trace_lib
from moejax.runtime import simulate
from moejax.evaluation import perplexity, results as results_file, tasks
from moejax.evaluation.sweep_points import Point, make_point, make_record, point_key


def default_batch_size() -> int:
    """Points per vmapped batch: 1 on CPU, where a teacher-forced pass is compute-bound and a batch of
    policies measured no faster per point than the loop while compiling slower (bench_evaluate.py on
    the CPU-trained model in tests/data/cpu-default-model); 8 on accelerators, where a pass leaves the device mostly idle."""
    return 1 if jax.default_backend() == "cpu" else 8


# ---------------------------------------------------------------------------------------- WikiText engine


def wikitext_ids(model, text: str, max_tokens: int | None) -> tuple[np.ndarray, str]:
    """Token ids of ``text`` (the first ``max_tokens``) and the text they decode to (what is scored)."""
    if model.tokenizer is None:
        raise errors.Failure(f"{model.path} has no tokenizer.json: WikiText evaluation needs one")
    ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {max_tokens}")
        ids = ids[:max_tokens]
        text = model.tokenizer.decode(ids, skip_special_tokens=False)
    if len(ids) == 0:
        raise ValueError("the WikiText text is empty")
    return ids, text


def _target_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """-log p(tokens[1:]) under logits[:-1], float32 [T-1]."""
    logp = jax.nn.log_softmax(logits[:-1].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[1:, None], axis=-1)[:, 0]


def _vmapped_pass(params, cfg, tokens, states, sequential: bool):

    router = simulate.CacheRouter(cfg.gating)
    run = simulate.forward_token_sequential if sequential else simulate.forward_layer_parallel

    def one(state):
        out = run(params, cfg, tokens, router, state)
        return _target_nll(out.logits, tokens), out.experts, out.weights, out.records["hits"], out.router_state

    return jax.vmap(one)(states)


@functools.partial(jax.jit, static_argnames=("cfg", "sequential"))
def batched_pass(params, cfg, tokens, states, sequential: bool = False):
    """One teacher-forced pass of ``tokens`` for a stack of router states (leading axis B; the policy is
    part of the state): (nll [B, T-1], experts [B, L, T, K], weights, hits [B, L, T, K], states')."""
    return _vmapped_pass(params, cfg, tokens, states, sequential)


@functools.partial(jax.jit, static_argnames=("cfg", "sequential", "mesh"))
def sharded_batched_pass(params, cfg, tokens, states, sequential: bool, mesh):
    """``batched_pass`` with the B points laid along the mesh axis "points" (B a multiple of its devices):
    every device runs the vmapped pass on its own B / devices points; params and tokens are replicated.
    Nothing crosses devices, so each point's result is what ``batched_pass`` gives it."""
    from jax.sharding import PartitionSpec as P

    body = functools.partial(_vmapped_pass, cfg=cfg, sequential=sequential)
    return jax.shard_map(lambda p, t, s: body(p, tokens=t, states=s), mesh=mesh,
                         in_specs=(P(), P(), P(distributed.POINTS)), out_specs=P(distributed.POINTS),
                         check_vma=False)(params, tokens, states)


@functools.partial(jax.jit, static_argnames=("cfg", "hook"))
def hook_pass(params, cfg, tokens, hook, state):
    """One teacher-forced pass with a router hook (None = the architecture's own routing, no cache)."""

    out = forward(params, cfg, tokens, 0, None, hook, state)
    return _target_nll(out.logits, tokens), out.experts, out.weights, out.router_state


EARLY_WINDOWS = (16, 64, 256, 1024)


@dataclasses.dataclass
class _Acc:
    """Running totals of one point over the chunks."""

    n_layers: int
    n_experts: int
    nll_sum: float = 0.0
    n_pred: int = 0
    counts: np.ndarray = None
    reuse: np.ndarray = None  # [L, 4] perplexity.reuse_counts summed over the chunks
    early_miss: list = dataclasses.field(default_factory=list)  # per token: misses over all layers
    early_valid: list = dataclasses.field(default_factory=list)
    trace_e: list = dataclasses.field(default_factory=list)
    trace_w: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.counts = np.zeros((self.n_layers, self.n_experts), np.int64)
        self.reuse = np.zeros((self.n_layers, len(perplexity.REUSE_FIELDS)), np.int64)

    def add(self, nll, experts, hits=None, weights=None, keep_trace=False):
        total = float(np.asarray(nll, np.float64).sum())
        if not math.isfinite(total):
            raise gating.NonFiniteError("the negative log-likelihood is not finite (NaN/inf logits: damaged "
                                        "weights, or an overflow in this dtype); refusing to report a perplexity")
        self.nll_sum += total
        self.n_pred += int(nll.shape[0])
        self.counts += perplexity.expert_counts(experts, self.n_experts)
        self.reuse += perplexity.reuse_counts(experts)
        if hits is not None and sum(len(m) for m in self.early_miss) < EARLY_WINDOWS[-1]:
            valid = experts >= 0  # [L, T, K]
            self.early_miss.append(((valid & ~hits).sum(axis=(0, 2))))
            self.early_valid.append(np.full(experts.shape[1], experts.shape[0] * experts.shape[2]))
        if keep_trace:
            self.trace_e.append(np.swapaxes(experts, 0, 1))
            self.trace_w.append(np.swapaxes(weights, 0, 1))

    def early(self) -> dict:
        if not self.early_miss:
            return {}
        miss = np.concatenate(self.early_miss)
        acc = np.concatenate(self.early_valid)
        return {str(w): float(miss[:w].sum() / acc[:w].sum()) for w in EARLY_WINDOWS if w <= len(miss)}


def _result(model, text: str, ids: np.ndarray, context: int, n_chunks: int, acc: _Acc, state) -> dict:

    res = perplexity.perplexity_result(text, ids, context, n_chunks, acc.nll_sum, acc.n_pred, acc.counts, acc.reuse)
    if state is not None:
        stats = simulate.summarize(state, model.params, model.cfg)
        rs = state["routing"]
        delta_avg = np.asarray(rs.delta_sum, np.float64) / np.maximum(np.asarray(rs.delta_count, np.float64), 1.0)
        res.update(miss_rate=stats["miss_rate"], lifetime=stats["lifetime_mean"], lifetime_std=stats["lifetime_std"],
                   bytes_per_token=stats.get("bytes_per_token"), cache=stats, miss_rate_first_tokens=acc.early(),
                   delta_avg=delta_avg.tolist())
    return res


def _committed(tree):
    """Place a pytree on this process's device explicitly. Freshly built arrays are uncommitted, the states
    a jitted pass returns are committed, and jit compiles separately for each (a whole second compilation
    on the second chunk); committing the initial state up front keeps one program per shape."""
    return jax.device_put(tree, distributed.local_device())


def _stack(trees: list):
    return _committed(jax.tree.map(lambda *xs: jnp.stack(xs), *trees))


def _initial_state(model, point: Point) -> dict:

    return simulate.init_router_state(model.cfg, point.policy, point.cache, model.selection_biases)


def run_forward_batch(model, chunks: list[np.ndarray], text: str, ids: np.ndarray, context: int,
                      points: list[Point], batch_size: int | None = None, on_chunk: Callable | None = None,
                      mesh=None) -> list[dict]:
    """Evaluate same-group points (``Point.batch_group``) in one vmapped pass per chunk. The batch is padded
    to ``batch_size`` with copies of the last point (one compiled program for every batch of a sweep), and
    with a ``mesh`` (axis "points") further to a multiple of its devices, each of which runs its share."""
    cfg = model.cfg
    n = len(points)
    pad = max(batch_size or n, n)
    devices = distributed.mesh_size(mesh)
    pad = -(-pad // devices) * devices
    states = [_initial_state(model, p) for p in points]
    states += [states[-1]] * (pad - n)
    sequential = points[0].cache.scope == "global"
    if mesh is None:
        stacked = _stack(states)
    else:
        from jax.sharding import NamedSharding, PartitionSpec as P

        along = NamedSharding(mesh, P(distributed.POINTS))
        stacked = jax.tree.map(lambda *xs: distributed.global_array(np.stack([np.asarray(x) for x in xs]), along),
                               *states)
        params = replicated_params(model, mesh)
    accs = [_Acc(cfg.n_moe_layers, cfg.n_experts) for _ in range(n)]
    for ci, chunk in enumerate(chunks):
        if mesh is None:
            nll, experts, _, hits, stacked = batched_pass(model.params, cfg, jnp.asarray(chunk), stacked, sequential)
        else:
            tokens = distributed.global_array(np.asarray(chunk, np.int32), distributed.replicated(mesh))
            nll, experts, _, hits, stacked = sharded_batched_pass(params, cfg, tokens, stacked, sequential, mesh)
        nll, experts, hits = (distributed.to_host(a) for a in (nll, experts, hits))
        for b in range(n):
            accs[b].add(nll[b], experts[b], hits[b])
        if on_chunk:
            on_chunk(ci + 1, len(chunks))
    if mesh is not None:
        stacked = jax.tree.map(distributed.to_host, stacked)
    return [_result(model, text, ids, context, len(chunks), accs[b], jax.tree.map(lambda a, b=b: a[b], stacked))
            for b in range(n)]


_REPLICATED: dict = {}


def replicated_params(model, mesh):
    """The model's parameters replicated on every device of ``mesh`` (made once per model and mesh)."""
    key = (id(model.params), mesh)
    if key not in _REPLICATED:
        _REPLICATED.clear()  # one replicated copy at a time
        sharding = distributed.replicated(mesh)
        _REPLICATED[key] = (model.params, jax.tree.map(lambda a: distributed.global_array(a, sharding), model.params))
    return _REPLICATED[key][1]


def run_forward_single(model, chunks, text, ids, context, point: Point, keep_trace: bool = False,
                       on_chunk: Callable | None = None) -> tuple[dict, Any]:
    """One point, no vmap: a router hook (``point.hook``), or plain original routing when the point has no
    hook and no cache. With ``keep_trace`` also returns the routing trace (``trace.Trace``)."""
    cfg = model.cfg
    acc = _Acc(cfg.n_moe_layers, cfg.n_experts)
    state = None if point.hook_state is None else _committed(point.hook_state)
    for ci, chunk in enumerate(chunks):
        nll, experts, weights, state = hook_pass(model.params, cfg, jnp.asarray(chunk), point.hook, state)
        acc.add(np.asarray(nll), np.asarray(experts), weights=np.asarray(weights), keep_trace=keep_trace)
        if on_chunk:
            on_chunk(ci + 1, len(chunks))
    res = _result(model, text, ids, context, len(chunks), acc, None)
    tr = None
    if keep_trace:

        tr = trace_lib.validate_trace(np.concatenate(acc.trace_e), np.concatenate(acc.trace_w).astype(np.float32),
                                  None, cfg.n_experts, gating.spec(cfg.gating), model.selection_biases)
    return res, tr


# ---------------------------------------------------------------------------------------- the runner


@dataclasses.dataclass
class WikitextInput:
    """The scored text of a WikiText evaluation, shared by all points of a run."""

    text: str
    ids: np.ndarray
    context: int
    bos: int | None

    @property
    def chunks(self) -> list[np.ndarray]:

        return perplexity.chunk_tokens(self.ids, self.context, self.bos)


def wikitext_input(model, text: str, context: int, max_tokens: int | None) -> WikitextInput:
    ids, scored = wikitext_ids(model, text, max_tokens)
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    model.cfg.check_context(context)
    return WikitextInput(scored, ids, context, model.cfg.bos_token_id)


class NotSaved(errors.Failure):
    """The results file could not take a computed record (a full disk): the run stops there. ``records``: the
    records this run has, in the points' order, the unsaved ones included, for the caller to show rather than
    lose with the process."""

    def __init__(self, message: str, records: list[dict]):
        super().__init__(message)
        self.records = records


class _AppendFailed(Exception):
    """``Runner._emit``'s failed append, carried up to ``Runner.run``."""


class Runner:
    """Evaluates points, skipping those already in the results file and appending each one as it is done.

    ``inputs`` maps (data, context, max_tokens) to a ``WikitextInput`` (built on first use from
    ``load_text(data)``); the original-routing trace per input is computed once (or read from
    ``trace_dir``) for replay points."""

    def __init__(self, model, *, results: str | None = None, batch_size: int = 1, progress: bool = True,
                 trace_dir: str | None = None, load_text: Callable[[str | None], str] | None = None,
                 reuse: dict[str, dict] | None = None, mesh=None):

        self.model, self.results, self.progress = model, results, progress and distributed.is_leader()
        self.mesh = mesh  # axis "points": a vmapped batch is batch_size points per device, spread over them
        self.batch_size = max(1, int(batch_size)) * distributed.mesh_size(mesh)
        self.pad_size = self.batch_size  # what ``plan`` pads the batches of a run to
        self.trace_dir = trace_dir
        self.load_text = load_text or perplexity.load_wikitext
        self.reuse = reuse or {}
        self._inputs: dict[tuple, WikitextInput] = {}
        self._traces: dict[tuple, tuple] = {}
        self.computed = 0
        self.by_other_runs = 0  # points another run sharing the results file computed meanwhile

    # -- inputs
    def wikitext(self, point: Point) -> WikitextInput:
        ident = point.identity
        k = (ident["data"], ident["context"], ident["max_tokens"])
        if k not in self._inputs:
            self._inputs[k] = wikitext_input(self.model, self.load_text(point.task_options.get("data")),
                                             ident["context"], ident["max_tokens"])
        return self._inputs[k]

    def original_trace(self, point: Point):
        """(trace, plain-pass result) of original routing over ``point``'s WikiText input."""

        ident = point.identity
        k = (ident["model"], ident["data"], ident["context"], ident["max_tokens"], ident["weights"],
             ident.get("data_digest"))
        if k in self._traces:
            return self._traces[k]
        name = point_key({"trace": "original", "model": k[0], "data": k[1], "context": k[2], "max_tokens": k[3],
                          "weights": k[4], "data_digest": k[5]})  # edited data: a new trace, not the old one
        path = os.path.join(self.trace_dir, f"trace-{name[:16]}.npz") if self.trace_dir else None
        if path and not distributed.is_leader():  # process 0 writes the trace files; the others recompute
            path = None
        if path and os.path.exists(path):
            tr = trace_lib.load_trace(path)
            with open(path[:-4] + ".json") as f:
                res = json.load(f)
        else:
            inp = self.wikitext(point)
            plain = make_point(self.model, ident["model"], context=ident["context"], max_tokens=ident["max_tokens"],
                               data=point.task_options.get("data"))
            res, tr = run_forward_single(self.model, inp.chunks, inp.text, inp.ids, inp.context, plain, keep_trace=True)
            res = results_file.as_json(res)
            if path:
                atomic.write_json(path[:-4] + ".json", res, indent=None, sort_keys=False, make_parents=True)
                trace_lib.save_trace(path, tr.experts, tr.weights, None, tr.n_experts, tr.gating, tr.score_bias)
        self._traces[k] = (tr, res)
        return tr, res

    # -- one point / one batch
    def _evaluate(self, batch: list[Point], on_chunk=None) -> list[dict]:
        p0 = batch[0]
        if p0.method == "task":
            return [self._task(p) for p in batch]
        if p0.method == "replay":
            return [self._replay(p) for p in batch]
        inp = self.wikitext(p0)
        if p0.offload is not None:

            return [perplexity.perplexity_of_ids(self.model, inp.text, inp.ids, inp.context, p.policy, p.cache,
                                               offload=p.offload) for p in batch]
        if p0.batch_group() is not None:
            return run_forward_batch(self.model, inp.chunks, inp.text, inp.ids, inp.context, batch,
                                     self.pad_size, on_chunk, self.mesh)
        return [run_forward_single(self.model, inp.chunks, inp.text, inp.ids, inp.context, p, on_chunk=on_chunk)[0]
                for p in batch]

    def _replay(self, point: Point) -> dict:

        tr, plain = self.original_trace(point)
        c = point.cache
        stats = trace_lib.replay(tr, str(c.capacity(self.model.cfg)), c.scope, c.eviction, init=c.init, seed=c.seed,
                                 expert_bytes=simulate.expert_bytes(self.model.params, self.model.cfg))
        res = {k: v for k, v in plain.items() if k not in ("miss_rate", "lifetime", "lifetime_std", "cache")}
        res.update(miss_rate=stats["miss_rate"], lifetime=stats["lifetime_mean"], lifetime_std=stats["lifetime_std"],
                   bytes_per_token=stats.get("bytes_per_token"), cache=stats, method="replay of the recorded "
                   "original-routing trace")
        return res

    def _task(self, point: Point) -> dict:
        o = point.task_options
        options = {} if point.offload is None else {"offload": point.offload}
        return tasks.evaluate_task(self.model, point.record["task"], o.get("data"), limit=o.get("limit"),
                                   routing=point.policy if point.cache is not None else None, cache=point.cache,
                                   shots=o.get("shots"), max_new_tokens=o.get("max_new_tokens"), progress=False,
                                   **options)

    # -- the loop
    def plan(self, points: list[Point]) -> tuple[list[dict], list[list[Point]]]:
        """(records already done, batches still to compute) — points deduplicated by key."""
        done = {r["key"]: r for r in results_file.load_results(self.results)} if self.results else {}
        seen, todo, finished = set(), [], []
        for p in points:
            if p.key in seen:
                continue
            seen.add(p.key)
            (finished if p.key in done else todo).append(done.get(p.key, p))
        groups = self._groups(todo)
        # a vmapped batch is padded to one size (one program): --batch-size, or less when no group fills it
        # (a batch of 99999 for 3 points padded to 99999 copies); a multiple of the devices it is spread over
        largest = max((len(m) for (how, _), m in groups.items() if how == "batch"), default=1)
        devices = distributed.mesh_size(self.mesh)
        self.pad_size = min(self.batch_size, -(-largest // devices) * devices)
        return finished, self._batches(groups)

    @staticmethod
    def _groups(todo: list[Point]) -> dict[Any, list[Point]]:
        groups: dict[Any, list[Point]] = {}
        for i, p in enumerate(todo):
            g = p.batch_group()
            groups.setdefault(("batch", g) if g is not None else ("single", i), []).append(p)
        return groups

    def _batches(self, groups: dict[Any, list[Point]]) -> list[list[Point]]:
        batches = []
        for (how, _), members in groups.items():
            size = self.pad_size if how == "batch" else 1
            batches += [members[i:i + size] for i in range(0, len(members), size)]
        return batches

    def run(self, points: list[Point]) -> list[dict]:
        """Records of all ``points`` in their order: read from the results file where done, else computed
        (or copied from ``reuse``, records of the same key from elsewhere) and appended as they finish.

        Runs sharing one results file split its points (``results.PointClaims``): a point another run is
        computing is skipped, and at the end waited for and read from the file (computed here only if that
        run ended without it)."""
        finished, batches = self.plan(points)
        by_key = {r["key"]: r for r in finished}
        total = sum(len(b) for b in batches)
        bar = None
        if self.progress and total:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="pt", file=sys.stderr, desc="sweep", dynamic_ncols=True)
            if finished:
                bar.write(f"{len(finished)} point(s) already in {self.results}, {total} to go", file=sys.stderr)
        # runs sharing the file split its points; a multi-process run computes every batch in step instead
        share = self.results and total and not distributed.is_multiprocess()
        claims = results_file.PointClaims(self.results) if share else None
        self._wanted = {p.key for b in batches for p in b}
        try:
            deferred: list[Point] = []
            for batch in batches:
                mine = self._claim(batch, claims, by_key, bar)
                deferred += [p for p in batch if p.key not in by_key and p.key not in mine]
                self._compute([p for p in batch if p.key in mine], by_key, bar, claims)
            if claims is not None:  # computed elsewhere: wait for those runs, take their records, compute the rest
                self._take_records(claims, by_key, bar)
                waiting = [p.key for p in deferred if p.key not in by_key]
                if waiting and bar is not None:
                    bar.write(f"waiting for {len(waiting)} point(s) another run sharing {self.results} is computing",
                              file=sys.stderr)
                claims.wait(waiting)
                self._take_records(claims, by_key, bar)
                left = [p for p in deferred if p.key not in by_key]
                claims.release([p.key for p in deferred if p.key in by_key])
                for batch in self._batches(self._groups(left)):
                    self._compute(batch, by_key, bar, claims)
        except _AppendFailed as failed:
            keys = dict.fromkeys(p.key for p in points)
            raise NotSaved(f"{errors.report_text(failed.__cause__)}: the run stopped at the first record the results "
                           f"file could not take ({failed.args[0]} point(s) computed and not in it)",
                           [by_key[k] for k in keys if k in by_key]) from failed.__cause__
        finally:
            if claims is not None:
                claims.close()
            if bar is not None:
                bar.close()
        keys = dict.fromkeys(p.key for p in points)  # distinct, in order
        return [by_key[k] for k in keys if k in by_key]

    def _claim(self, batch: list[Point], claims, by_key: dict, bar) -> set[str]:
        """The keys of ``batch`` this run computes now: not done yet (other runs' records appended meanwhile
        are taken) and not being computed by another run."""
        if claims is None:
            return {p.key for p in batch if p.key not in by_key}
        self._take_records(claims, by_key, bar)
        mine = set(claims.claim([p.key for p in batch if p.key not in by_key]))
        # a run appends a point's record before it drops the claim: read again, or a point finished between
        # the read above and the claim would be computed twice
        self._take_records(claims, by_key, bar)
        done = {k for k in mine if k in by_key}
        claims.release(done)
        return mine - done

    def _take_records(self, claims, by_key: dict, bar) -> None:
        for rec in claims.new_records():
            if rec["key"] not in by_key and rec["key"] in self._wanted:
                by_key[rec["key"]] = rec
                self.by_other_runs += 1
                if bar is not None:
                    bar.update(1)

    def _compute(self, batch: list[Point], by_key: dict, bar, claims=None) -> None:
        reused = [p for p in batch if p.key in self.reuse]
        copies = []
        for p in reused:
            rec = dict(self.reuse[p.key], **p.record, key=p.key)
            rec["metrics"] = dict(rec.get("metrics") or {}, reused_from=self.reuse[p.key].get("study"))
            copies.append(rec)
        self._emit(copies, by_key, bar)
        if claims is not None:
            claims.release([p.key for p in reused])
        batch = [p for p in batch if p.key not in self.reuse]
        if not batch:
            return
        on_chunk = None
        if bar is not None:
            label = ", ".join(f"{k}={_fmt(v)}" for k, v in batch[0].record["sweep"].items()) or batch[0].record["routing"]["kind"]

            def on_chunk(i, n, label=label, size=len(batch)):
                bar.set_postfix_str(f"{label}{' +%d' % (size - 1) if size > 1 else ''} chunk {i}/{n}")
        start = time.perf_counter()
        results = self._evaluate(batch, on_chunk)
        per_point = (time.perf_counter() - start) / len(batch)
        records = [make_record(p, dict(res, batch_size=len(batch)) if len(batch) > 1 else res, per_point)
                   for p, res in zip(batch, results)]
        self.computed += len(records)
        self._emit(records, by_key, bar)
        if claims is not None:  # after the appends: a run that finds a point unclaimed finds its record too
            claims.release([p.key for p in batch])

    def _emit(self, records: list[dict], by_key: dict, bar) -> None:
        """Take ``records`` and append them to the results file; where the file cannot take one (a full disk),
        ``_AppendFailed`` with the number of them not in it (all are in ``by_key``, to be shown)."""
        for rec in records:
            by_key[rec["key"]] = rec
        for i, rec in enumerate(records):
            if self.results:
                try:
                    results_file.append_result(self.results, rec)
                except OSError as e:
                    raise _AppendFailed(len(records) - i) from e
            if bar is not None:
                bar.update(1)


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------------------------- output


def format_table(records: list[dict]) -> str:
    """One row per record: swept values, quality, miss rate, lifetime, bytes per token, seconds."""
    if not records:
        return "(no points)"
    names = list(dict.fromkeys(k for r in records for k in r.get("sweep", {})))
    quality = "accuracy" if any(r.get("accuracy") is not None for r in records) else "ppl"
    head = ["kind", *names, quality, "miss_rate", "lifetime", "bytes/token", "time_s"]
    rows = []
    for r in records:
        def f(x, spec):
            return "-" if x is None else format(x, spec)

        rows.append([r["routing"]["kind"], *(_fmt(r["sweep"].get(n)) for n in names), f(r.get(quality), ".4f"),
                     f(r.get("miss_rate"), ".4f"), f(r.get("lifetime"), ".2f"), f(r.get("bytes_per_token"), ".0f"),
                     f(r.get("time_s"), ".1f")])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head, *rows])
