"""The serving engine behind ``python -m moejax.serve``: the model, its one shared expert-cache state, and a
worker thread that runs one request at a time in arrival order (batch 1, FIFO, a bounded queue), with the
telemetry that ``/metrics`` and ``/v1/moejax/cache`` report. No HTTP here: ``serve`` turns requests into
``Job``s and the engine's results into OpenAI's response shapes.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from moejax.experts import routing as routing_lib, trace as trace_lib
from moejax.runtime import api, cli_options, decode, simulate
from moejax.runtime import sampling as sampling_lib

#: seconds a cancelled generation has to end before its request is answered 503 (shutdown; under uvicorn's
#: graceful-shutdown wait, ``serve.GRACEFUL_SHUTDOWN_S``)
ABANDON_AFTER_S = 3.0
ROUTING_OVERRIDE_KEYS = ("routing", "lam", "top_j", "max_rank", "cumsum_p", "prune_h", "delta")
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class RequestError(ValueError):
    """A request the server refuses: an OpenAI error object with this HTTP status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def kind(self) -> str:
        return {404: "not_found_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if 400 <= self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------------------ requests


@dataclasses.dataclass
class Job:
    """One generation request, as the engine runs it. ``emit(kind, payload)`` is called from the engine's
    thread: ("tokens", [ids]) as they come, then ("done", result dict) or ("error", exception)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    routing: dict | None = None
    emit: Callable[[str, Any], None] = lambda kind, payload: None
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)


# ------------------------------------------------------------------------------------------------ telemetry


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


class Telemetry:
    """What /metrics and /v1/moejax/cache report; updated by the engine thread under ``lock``."""

    def __init__(self, n_layers: int, n_experts: int):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # (endpoint, status) -> count
        self.prompt_tokens = self.generated_tokens = 0
        self.ttft, self.tps = Histogram(TTFT_BUCKETS), Histogram(TPS_BUCKETS)
        self.recent_hits = np.zeros((n_layers, n_experts), np.int64)  # the running (or last) request's accesses
        self.recent_misses = np.zeros((n_layers, n_experts), np.int64)
        self.total_hits = np.zeros((n_layers, n_experts), np.int64)
        self.total_misses = np.zeros((n_layers, n_experts), np.int64)
        self.cache: dict = {}  # simulate.summarize of the shared state after the last request
        self.resident = np.zeros((n_layers, n_experts), bool)
        self.finished = 0
        self.bytes_moved_offload = 0

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[(endpoint, status)] += 1


# ------------------------------------------------------------------------------------------------ engine


def warm_up_runs(context: int, max_prompt: int, max_tokens: int) -> list[tuple[int, int]]:
    """The generations (prompt tokens, new tokens) that compile every program prompts up to ``max_prompt``
    tokens with up to ``max_tokens`` new tokens need. Programs are keyed by (prefill piece, the prompt's KV
    bucket), (decode chunk, KV bucket) and the growth of one to the other (``decode.grow_kv``): per bucket B,
    a prompt of 2^k - 1 tokens (every piece up to the largest a prompt in B can have) with enough new tokens
    to land in B, and if that needed no decode chunk, one more
    generation that fills B exactly. The programs serve every sampling setting (bucketed generation decides
    the sampling steps when the program runs)."""
    max_prompt = max(1, min(int(max_prompt), context - 1))
    max_tokens = max(1, min(int(max_tokens), context - 1))
    chunk = decode.CHUNK
    top = decode.kv_bucket(decode.kv_rows(max_prompt, max_tokens))
    bucket, out = decode.MIN_KV_BUCKET, []
    while bucket <= top:
        longest_piece = 1 << (min(max_prompt, bucket - 1).bit_length() - 1)
        n = min(bucket - 1, 2 * longest_piece - 1)  # holds every piece up to longest_piece
        chunks = max(0, -(-(bucket // 2 + 1 - (n + 1)) // chunk))  # enough new tokens to land in the bucket
        runs = [(n, chunk * chunks + 1)]
        if not chunks:  # that run has no decode chunk: one that fills the bucket exactly
            runs.append((bucket - chunk - 1, 2))
        for n, new in runs:
            if n >= 1 and n + new <= context:
                assert decode.kv_bucket(decode.kv_rows(n, new)) == bucket
                out.append((n, new))
        bucket *= 2
    return out


class Engine:
    """The model, its one shared expert-cache state, and a worker thread running one request at a time in
    arrival order. Thread-safe: ``submit`` from any thread; everything else runs on the worker."""

    def __init__(self, model: api.Model, policy, cache: simulate.CacheConfig, offload=None, max_queue: int = 16,
                 name: str = "default", routing_params: dict | None = None, sampling_defaults: dict | None = None):
        self.model, self.policy, self.cache_config, self.offload, self.name = model, policy, cache, offload, name
        self.routing_params = dict(routing_params or {})  # the served policy's parameters as given (lam, ...)
        # what a request that leaves a sampling field out gets (the checkpoint's generation_config.json, or {})
        self.sampling_defaults = dict(sampling_defaults or {})
        self.state = model.router_state(policy, cache)
        self.telemetry = Telemetry(model.cfg.n_moe_layers, model.cfg.n_experts)
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.BoundedSemaphore(max_queue + 1)  # waiting + the one running
        self._busy = False
        self._closing = False
        self._ended = False  # close() has queued the worker's end-of-work mark
        self._current: Job | None = None
        self._live_at = 0.0
        self._thread = threading.Thread(target=self._work, name="moejax-engine", daemon=True)
        self._thread.start()

    # -- called from the server
    def submit(self, job: Job) -> None:
        if self._closing:
            raise RequestError("the server is shutting down", status=503, code="shutting_down")
        if not self._slots.acquire(blocking=False) and not (self._drop_cancelled() and
                                                            self._slots.acquire(blocking=False)):
            raise RequestError("the queue is full; retry later", status=429, code="queue_full")
        self._queue.put(job)

    def _drop_cancelled(self) -> int:
        """Take the waiting jobs whose clients went away off the queue now, freeing their places (the worker
        would skip them only when it reached them); how many."""
        with self._queue.mutex:
            waiting = self._queue.queue
            kept = [j for j in waiting if j is None or not j.cancelled.is_set()]
            dropped = len(waiting) - len(kept)
            waiting.clear()
            waiting.extend(kept)
        for _ in range(dropped):
            self._slots.release()
        return dropped

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def busy(self) -> bool:
        return self._busy

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop taking work, cancel what runs and waits, and let the worker end; whether it has ended within
        ``timeout`` seconds (None: wait until it has — a compilation in progress cannot be interrupted)."""
        self.cancel_all()
        if not self._ended:
            self._ended = True
            self._queue.put(None)
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def cancel_all(self) -> None:
        """Stop taking work and cancel what runs and waits, without waiting: the running generation ends at its
        next chunk (its stream gets its last chunk and [DONE]), the waiting ones get a 503. A running one that
        has not ended ``ABANDON_AFTER_S`` later (it is compiling: a cold start takes tens of seconds) gets the
        503 then, so that its stream ends within the server's graceful-shutdown wait instead of being cut off."""
        self._closing = True
        current = self._current
        if current is not None and not current.cancelled.is_set():
            current.cancelled.set()
            timer = threading.Timer(ABANDON_AFTER_S, self._abandon, args=(current,))
            timer.daemon = True
            timer.start()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:  # close()'s end-of-work mark: keep it for the worker
                self._queue.put(None)
                break
            job.cancelled.set()
            job.emit("error", RequestError("the server is shutting down", status=503, code="shutting_down"))
            self._slots.release()

    def _abandon(self, job: Job) -> None:
        if self._current is job:  # still running: its client hears now; what it emits later goes nowhere
            job.emit("error", RequestError("the server is shutting down", status=503, code="shutting_down"))

    # -- the worker thread
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.cancelled.is_set():  # its client went away while it waited
                    continue
                self._current, self._busy = job, True
                try:
                    job.emit("done", self.run(job))
                except Exception as e:  # noqa: BLE001 - reported to the request; the server keeps serving
                    job.emit("error", e)
            finally:
                self._current, self._busy = None, False
                self._slots.release()

    def warm_up(self, max_prompt: int, max_tokens: int = 256,
                progress: Callable[[int, int], None] | None = None, stop: Callable[[], bool] | None = None) -> float:
        """Compile, before serving, what prompts up to ``max_prompt`` tokens with up to ``max_tokens`` new
        tokens need under the server's policy (``warm_up_runs``), on throwaway cache states, so the shared cache
        starts as configured. ``progress(done, total)`` after each run; ``stop()`` true ends it early (the
        server is stopping). Returns the seconds it took."""
        t0 = time.perf_counter()
        runs = warm_up_runs(self.model.cfg.max_position_embeddings, max_prompt, max_tokens)
        bos = self.model.cfg.bos_token_id or 0
        served, _ = sampling_lib.resolve_sampling({}, self.sampling_defaults)
        for done, (n, new) in enumerate(runs):
            if stop is not None and stop():
                break
            if progress is not None:
                progress(done, len(runs))
            self.model.generate([bos] * n, max_new_tokens=new, offload=self.offload,  # EOS set as served
                                state=self.model.router_state(self.policy, self.cache_config), bucketed=True,
                                **served)
        else:
            if progress is not None:
                progress(len(runs), len(runs))
        return time.perf_counter() - t0

    def policy_for(self, override: dict | None):
        if override is None:
            return self.policy
        kw = {k: override[k] for k in ROUTING_OVERRIDE_KEYS[1:] if override.get(k) is not None}
        if override["routing"] == self.policy.kind:  # the served policy adjusted: what it was given stays
            for key, value in self.routing_params.items():
                kw.setdefault(key, value)
        for key, (default, _) in cli_options.ROUTING_PARAMS.items():  # the command line's defaults (λ = 0.5, p = 0.9)
            if default is not None:
                kw.setdefault(key, default)
        try:
            return routing_lib.make_policy(override["routing"], self.model.cfg.top_k, **kw)
        except (ValueError, TypeError) as e:
            raise RequestError(f"'moejax': {e}", param="moejax") from None

    def run(self, job: Job) -> dict:
        """Generate for ``job`` from the shared cache state, and carry the state on."""
        policy = self.policy_for(job.routing)
        before = simulate.summarize(self.state, self.model.params, self.model.cfg)
        state = {**self.state, "policy": policy}
        t0 = time.perf_counter()
        with self.telemetry.lock:
            self.telemetry.recent_hits[:] = 0
            self.telemetry.recent_misses[:] = 0
        self._live_at = 0.0
        result = self.model.generate(
            job.prompt_ids, max_new_tokens=job.max_tokens, temperature=job.temperature, top_p=job.top_p,
            top_k=job.top_k, repetition_penalty=job.repetition_penalty, seed=job.seed, state=state, offload=self.offload, stop=job.stop, cancelled=job.cancelled.is_set,
            on_tokens=lambda ids: job.emit("tokens", list(ids)), bucketed=True, keep_slots=True,
            on_cache=self._live)
        self.state = {**result.router_state, "policy": self.policy}  # the same cache object: slots stay kept
        after = simulate.summarize(self.state, self.model.params, self.model.cfg)
        stats = result.stats
        self._record(stats, after)
        mine = {k: after[k] - before[k] for k in ("accesses", "misses", "loads", "prefetch_loads", "evictions")}
        mine["hits"] = mine["accesses"] - mine["misses"]
        mine["miss_rate"] = mine["misses"] / mine["accesses"] if mine["accesses"] else 0.0
        if "offload" in stats:
            mine["bytes_moved"] = int(stats["offload"]["bytes_moved"])
        elif "bytes_moved" in after:
            mine["bytes_moved"] = after["bytes_moved"] - before["bytes_moved"]
        return {"token_ids": result.token_ids, "stopped": stats["stopped"], "prompt_tokens": stats["prompt_tokens"],
                "time_to_first_token_s": stats["time_to_first_token_s"], "prefill_time_s": stats["prefill_time_s"],
                "tokens_per_s": stats["tokens_per_s"],
                "compile_time_s": stats["compile_time_s"], "queued_s": t0 - job.submitted, "cache": mine}

    def _accesses(self, experts, hits) -> tuple[np.ndarray, np.ndarray]:
        """Hits and misses per (MoE layer, expert) of records [t, L, K] (dropped slots, -1, skipped)."""
        L, N = self.telemetry.recent_hits.shape
        h, m = np.zeros((L, N), np.int64), np.zeros((L, N), np.int64)
        if experts is None:
            return h, m
        experts = np.asarray(experts).reshape(-1, L, np.shape(experts)[-1])
        hits = (np.zeros(experts.shape, bool) if hits is None else np.asarray(hits).reshape(experts.shape)).astype(bool)
        valid = experts >= 0
        layer = np.broadcast_to(np.arange(L)[None, :, None], experts.shape)
        np.add.at(h, (layer[valid & hits], experts[valid & hits]), 1)
        np.add.at(m, (layer[valid & ~hits], experts[valid & ~hits]), 1)
        return h, m

    def _live(self, cache_state, experts, hits) -> None:
        """``on_cache`` during a generation: the dashboard sees hits, misses, residency and the totals as
        tokens arrive (totals recomputed at most every 0.1 s)."""
        h, m = self._accesses(experts, hits)
        now = time.perf_counter()
        fresh = now - self._live_at >= 0.1
        if fresh:
            self._live_at = now
            resident = np.asarray(cache_state.resident)
            summary = simulate.summarize({"cache": cache_state}, self.model.params, self.model.cfg)
        t = self.telemetry
        with t.lock:
            t.recent_hits += h
            t.recent_misses += m
            if fresh:
                t.resident, t.cache = resident.reshape(t.resident.shape), summary

    def _record(self, stats: dict, summary: dict) -> None:
        """A finished request into the telemetry (its hits and misses per expert came in through ``_live``)."""
        t = self.telemetry
        with t.lock:
            t.prompt_tokens += stats["prompt_tokens"]
            t.generated_tokens += stats["generated_tokens"]
            t.ttft.observe(stats["time_to_first_token_s"])  # what a client waits: compiling new shapes included
            if stats["generated_tokens"] > 1:
                t.tps.observe(stats["tokens_per_s"])
            t.total_hits += t.recent_hits
            t.total_misses += t.recent_misses
            t.cache = summary
            t.resident = np.asarray(self.state["cache"].resident).reshape(t.resident.shape)
            t.finished += 1
            if "offload" in stats:
                t.bytes_moved_offload += int(stats["offload"]["bytes_moved"])

    # -- views
    def cache_view(self) -> dict:
        t = self.telemetry
        with t.lock:
            s = t.cache or simulate.summarize(self.state, self.model.params, self.model.cfg)
            return trace_lib.json_safe({
                "layers": int(t.resident.shape[0]), "experts": int(t.resident.shape[1]),
                "capacity": self.cache_config.capacity(self.model.cfg), "scope": self.cache_config.scope,
                "eviction": self.cache_config.eviction, "policy": self.describe_policy(),
                "requests_finished": t.finished, "busy": self.busy, "queued": self.queued,
                "resident": t.resident.astype(int).tolist(),
                "recent": {"hits": t.recent_hits.tolist(), "misses": t.recent_misses.tolist()},
                "totals": {"hits": t.total_hits.tolist(), "misses": t.total_misses.tolist()},
                "summary": {k: v for k, v in s.items() if k != "per_layer"},
                "per_layer": s.get("per_layer", {}),
            })

    def describe_policy(self) -> dict:
        p = self.policy
        return {"routing": p.kind, "lam": float(p.lam), "top_j": int(p.top_j), "max_rank": int(p.max_rank),
                "cumsum_p": float(p.cumsum_p), "prune_h": int(p.prune_h)}

    def metrics_text(self) -> str:
        t = self.telemetry
        with t.lock:
            s = t.cache or simulate.summarize(self.state, self.model.params, self.model.cfg)
            lines = ["# HELP moejax_requests_total Requests by endpoint and HTTP status.",
                     "# TYPE moejax_requests_total counter"]
            lines += [f'moejax_requests_total{{endpoint="{e}",status="{c}"}} {n}'
                      for (e, c), n in sorted(t.requests.items())]
            lines += ["# TYPE moejax_prompt_tokens_total counter", f"moejax_prompt_tokens_total {t.prompt_tokens}",
                      "# TYPE moejax_generated_tokens_total counter",
                      f"moejax_generated_tokens_total {t.generated_tokens}",
                      "# HELP moejax_time_to_first_token_seconds Compilation of new shapes + prefill of each request "
                      "(queueing excluded).",
                      "# TYPE moejax_time_to_first_token_seconds histogram",
                      *t.ttft.lines("moejax_time_to_first_token_seconds"),
                      "# HELP moejax_tokens_per_second Decode speed of each request.",
                      "# TYPE moejax_tokens_per_second histogram", *t.tps.lines("moejax_tokens_per_second"),
                      "# TYPE moejax_queue_depth gauge", f"moejax_queue_depth {self.queued}",
                      "# TYPE moejax_busy gauge", f"moejax_busy {int(self.busy)}"]
            hits = s["accesses"] - s["misses"]
            lines += ["# HELP moejax_cache_miss_rate Misses / accesses of the shared expert cache since start.",
                      "# TYPE moejax_cache_miss_rate gauge", f"moejax_cache_miss_rate {s['miss_rate']:.6f}",
                      "# TYPE moejax_cache_hits_total counter", f"moejax_cache_hits_total {hits}",
                      "# TYPE moejax_cache_misses_total counter", f"moejax_cache_misses_total {s['misses']}",
                      "# TYPE moejax_cache_loads_total counter", f"moejax_cache_loads_total {s['loads']}",
                      "# HELP moejax_bytes_moved_total Expert bytes moved into the cache (offload: really paged).",
                      "# TYPE moejax_bytes_moved_total counter",
                      f"moejax_bytes_moved_total {t.bytes_moved_offload if self.offload else s.get('bytes_moved', 0)}"]
            pl = s["per_layer"]
            for name, key in (("hits", None), ("misses", "misses"), ("loads", "loads")):
                lines.append(f"# TYPE moejax_cache_layer_{name}_total counter")
                for i, acc in enumerate(pl["accesses"]):
                    value = acc - pl["misses"][i] if key is None else pl[key][i]
                    lines.append(f'moejax_cache_layer_{name}_total{{layer="{i}"}} {value}')
            lines.append("# TYPE moejax_cache_layer_miss_rate gauge")
            lines += [f'moejax_cache_layer_miss_rate{{layer="{i}"}} {r:.6f}' for i, r in enumerate(pl["miss_rate"])]
        return "\n".join(lines) + "\n"
