"""Prefill + KV cache + a jitted ``lax.scan`` decode loop.

Every state that flows through a decode step is in ``DecodeState``: the KV cache, the last token, its
position, the sampling key, the router state (expert cache, routing statistics) and whether an EOS was
seen. The loop runs in chunks of ``chunk`` scan steps so text can be streamed between chunks; the state is
donated to each chunk so the KV cache is updated in place.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base import seeds
from moejax.models import gating
from moejax.models.config import ModelConfig
from moejax.models.model import forward, forward_sequential
from moejax.models.attention import init_kv
from moejax.runtime.sampling import Sampling, sample, see, seen_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    kv: Any
    token: jax.Array  # last token, int32 scalar
    pos: jax.Array  # position of ``token``
    key: jax.Array
    router_state: Any
    done: jax.Array  # an EOS was fed or the token budget is spent: later steps change nothing
    limit: jax.Array  # steps feeding a position >= limit are inactive
    seen: jax.Array | None = None  # the tokens so far, when sampling has a repetition penalty (``seen_tokens``)


def _trace_record(out) -> dict:
    """What a routing trace keeps of a forward pass, each [moe_layers, T, ...]."""
    return {"experts": out.experts, "weights": out.weights, "logits": out.router_logits, **out.records}


@functools.partial(jax.jit, static_argnames=("cfg", "router"), donate_argnames=("kv",))
def prefill(params, cfg: ModelConfig, tokens, kv, key, router, router_state, sampling: Sampling, pos0=0,
            seen=None):
    """Run the prompt (or a piece of it starting at ``pos0``), fill the KV cache, sample the next token
    (``seen``: the whole prompt's tokens, with a repetition penalty)."""
    sequential = router is not None and getattr(router, "token_sequential", lambda s: False)(router_state)
    if sequential:
        out = forward_sequential(params, cfg, tokens, pos0, kv, router, router_state)
    else:
        out = forward(params, cfg, tokens, pos0, kv, router, router_state, last_logits_only=True)
    key, sub = jax.random.split(key)
    first = sample(out.logits[-1], sub, sampling, seen)
    return first, out.kv, key, out.router_state, _trace_record(out), jnp.isfinite(out.logits[-1]).all()


def keep_when_done(done, new, old, no_rollback: tuple[str, ...] = ()):
    """The router state after a step: the old one where the step was inactive (``done``), except the
    top-level entries named in ``no_rollback`` (a router's large buffers, e.g. the in-jit pager's slot
    stacks), which always take the new value: selecting between two versions of a buffer keeps both alive,
    so its in-place writes become a copy of the whole buffer every step (on the H200 the in-jit pager's
    decode ran at 69 tokens/s against 863 with every weight on the device). ``done`` never clears within a
    generation, so what an inactive step wrote there is never read with the rolled-back state."""
    if isinstance(new, dict) and no_rollback:
        return {k: v if k in no_rollback else keep_when_done(done, v, old[k]) for k, v in new.items()}
    return jax.tree.map(lambda n, o: jnp.where(done, o, n), new, old)


@functools.partial(jax.jit, static_argnames=("cfg", "router", "steps", "eos"), donate_argnames=("state",))
def decode_chunk(params, cfg: ModelConfig, state: DecodeState, router, sampling: Sampling, steps: int,
                 eos: tuple[int, ...]):
    """``steps`` decode steps in one ``lax.scan``: feed the last token, sample the next."""

    def step(s: DecodeState, _):
        out = forward(params, cfg, s.token[None], s.pos, s.kv, router, s.router_state)
        key, sub = jax.random.split(s.key)
        nxt = sample(out.logits[0], sub, sampling, s.seen)
        done = s.done | jnp.isin(s.token, jnp.asarray(eos or (-1,), jnp.int32)) | (s.pos >= s.limit)
        # inactive steps (past EOS or the budget, padding the last chunk) leave the router state alone
        router_state = keep_when_done(done, out.router_state, s.router_state, getattr(router, "no_rollback", ()))
        new = DecodeState(out.kv, nxt, s.pos + 1, key, router_state, done, s.limit, see(s.seen, nxt))
        return new, (nxt, done, _trace_record(out), jnp.isfinite(out.logits[0]).all())

    return jax.lax.scan(step, state, None, length=steps)


@dataclasses.dataclass
class GenerateResult:
    token_ids: list[int]
    stats: dict
    records: list  # router records: prefill's, then (records, done) per decode chunk
    router_state: Any

    def trace(self) -> dict[str, np.ndarray]:
        """Per fed token (prompt, then generated but the last) and MoE layer: ``experts`` [T, L, K],
        ``weights`` [T, L, K], router ``logits`` [T, L, N] and any router record (e.g. ``hits``)."""
        prefill, chunks = self.records[0], self.records[1:]
        parts = [{k: np.swapaxes(np.asarray(v), 0, 1) for k, v in prefill.items()}]
        for rec, done in chunks:
            active = ~np.asarray(done)
            parts.append({k: np.asarray(v)[active][:, :, 0] for k, v in rec.items()})
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def check_step(cfg: ModelConfig, router_logits, logits_finite, where: str) -> None:
    """Stop generation with ``gating.NonFiniteError`` (naming the layer) when routing or the next-token
    distribution went NaN/inf: otherwise the tokens are garbage (or empty text) reported as a success."""
    gating.check_finite(router_logits, f"router logits ({where})", cfg)
    if not bool(logits_finite):
        raise gating.NonFiniteError(f"the next-token logits after {where} are not finite (damaged weights, or "
                                    "an overflow in this dtype)")


#: compiled prefill pieces and decode chunks by (function, static arguments, shapes and shardings of the weights and
#: arguments), with their output shapes: lowering a program again for every request re-traced it (``eval_shape``
#: of a new partial each time) and called a new executable through JAX's slow first-call path, 25-65 ms a request
#: on the shipped model's server (``python bench/bench_serve.py``)
_PROGRAMS: "collections.OrderedDict" = collections.OrderedDict()
_PROGRAMS_MAX = 256  # a warmed server holds one per (piece, KV bucket) and decode chunk: 45 for 512 tokens
_PROGRAMS_LOCK = threading.Lock()
_SHAPES: "collections.OrderedDict" = collections.OrderedDict()  # program_shapes, keyed as _PROGRAMS


def _signature(tree) -> tuple:
    """What a compiled program is specialised to: the tree's structure and each leaf's shape, dtype, weak type and
    sharding (None for bare shapes)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((jnp.shape(x), jnp.result_type(x), getattr(x, "weak_type", False),
                           getattr(x, "sharding", None)) for x in leaves)


def compiled_program(fn, params, args: dict, statics: dict, params_signature: tuple | None = None):
    """``fn.lower(params, **args, **statics).compile()`` and the output shapes (``jax.eval_shape``), made once per
    signature and kept (``_PROGRAMS``, least recently used dropped past ``_PROGRAMS_MAX``). ``params_signature``:
    ``_signature(params)`` when the caller has it (a model's weights are thousands of leaves)."""
    key = (fn, tuple(sorted(statics.items())), params_signature or _signature(params), _signature(args))
    with _PROGRAMS_LOCK:
        hit = _PROGRAMS.get(key)
        if hit is not None:
            _PROGRAMS.move_to_end(key)
            return hit
    for listener in tuple(COMPILE_LISTENERS):
        listener(getattr(fn, "__name__", str(fn)))
    program = (fn.lower(params, **args, **statics).compile(), program_shapes(fn, params, args, statics, key))
    with _PROGRAMS_LOCK:
        _PROGRAMS[key] = program
        while len(_PROGRAMS) > _PROGRAMS_MAX:
            _PROGRAMS.popitem(last=False)
    return program


def program_shapes(fn, params, args: dict, statics: dict, key: tuple | None = None,
                   params_signature: tuple | None = None):
    """The output shapes of ``fn(params, **args, **statics)`` (``jax.eval_shape``), kept per signature like the
    programs: what the next program's arguments look like, known before anything compiles."""
    key = key or (fn, tuple(sorted(statics.items())), params_signature or _signature(params), _signature(args))
    with _PROGRAMS_LOCK:
        hit = _SHAPES.get(key)
    if hit is None:
        hit = jax.eval_shape(functools.partial(fn, **statics), params, **args)
        with _PROGRAMS_LOCK:
            _SHAPES[key] = hit
            while len(_SHAPES) > _PROGRAMS_MAX:
                _SHAPES.popitem(last=False)
    return hit


def compiled_programs(jobs: list, params, params_signature: tuple | None = None) -> list:
    """``compiled_program`` of each ``(fn, args, statics)``, compiled side by side on a thread each (XLA compiles
    outside the interpreter lock): a generation's prompt and decode programs compile in the time of the longest
    rather than their sum (the default model's cold ``generate``: two programs of ~4.5 s each on 2 cores;
    ``bench/bench_fixed_costs.py --parts start``). The compile listeners hear every name first."""
    if len(jobs) < 2:
        return [compiled_program(fn, params, args, statics, params_signature) for fn, args, statics in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1),
                                               thread_name_prefix="moejax-compile") as pool:
        futures = [pool.submit(compiled_program, fn, params, args, statics, params_signature)
                   for fn, args, statics in jobs]
        return [f.result() for f in futures]


#: called with a program's name before ``compiled_program`` compiles it (or loads it from the persistent cache):
#: the commands say that the wait is compilation while it happens
COMPILE_LISTENERS: list = []


def clear_programs() -> None:
    """Drop the kept programs (``compiled_program``), e.g. beside ``jax.clear_caches()``."""
    with _PROGRAMS_LOCK:
        _PROGRAMS.clear()
        _SHAPES.clear()


def _shapes(tree):
    """Arrays (or shapes) as bare ``ShapeDtypeStruct``s: no sharding or commitment that would key a
    separate compilation."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False)),
                        tree)


CHUNK = 16  # decode steps per jitted chunk (text streams, stops and cancellation are checked between chunks)
MIN_KV_BUCKET = 64


def kv_rows(prompt_tokens: int, new_tokens: int, chunk: int = CHUNK) -> int:
    """KV cache rows a generation writes: the prompt, then every step of every chunk (the last chunk runs
    to its end), and one spare."""
    return int(prompt_tokens) + chunk * max(0, -(-(int(new_tokens) - 1) // chunk)) + 1


@functools.partial(jax.jit, static_argnames=("rows",), donate_argnums=(0,))
def _grow_kv(kv, rows: int):
    return jax.tree.map(lambda a: jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1)), kv)


def grow_kv(kv, rows: int):
    """A KV cache (every leaf's leading axis is its rows) with zero rows added up to ``rows``; itself when it
    has them (positions past the current one are masked, so the added rows change nothing)."""
    if all(a.shape[0] == rows for a in jax.tree.leaves(kv)):
        return kv
    return _grow_kv(kv, rows=rows)


def kv_bucket(rows: int) -> int:
    """``rows`` rounded up to a power of two (at least ``MIN_KV_BUCKET``): with KV caches of these lengths
    the decode chunk compiles once per bucket instead of once per prompt length (positions past the
    current one are masked, so the length changes nothing else)."""
    return max(MIN_KV_BUCKET, 1 << (int(rows) - 1).bit_length())


def prompt_pieces(n: int) -> list[int]:
    """``n`` as distinct powers of two, largest first (37 -> [32, 4, 1]). A prompt prefilled in these
    pieces (each attending to the KV cache of the ones before) needs at most log2(context) + 1 programs
    whatever its length; the result equals a one-piece prefill up to rounding (f32: ~1e-6; bf16 rounds the
    pieces differently, ~1e-2 in router logits, enough to flip a near-tie expert choice)."""
    return [1 << b for b in reversed(range(int(n).bit_length())) if n >> b & 1]


def report_cache(on_cache, router_state, records: dict) -> None:
    """``on_cache(cache_state, experts [t, L, K], hits [t, L, K] or None)`` when there is a cache to show."""
    if on_cache is not None and isinstance(router_state, dict) and "cache" in router_state:
        on_cache(router_state["cache"], records.get("experts"), records.get("hits"))


def generation_budget(prompt_tokens: int, max_new_tokens: int, context: int) -> int:
    """How many new tokens fit: ``max_new_tokens`` (>= 0) capped at the context left after the prompt."""
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens}")
    return max(0, min(int(max_new_tokens), context - prompt_tokens))


def stop_reason(tokens: list[int], requested: int, eos: tuple, ended_by: str | None = None) -> str:
    """Why generation ended: "eos", "max_new_tokens", "context_length" (the budget ran out first), or what
    ``Stop`` ended it with ("stop": a stop string, "cancelled")."""
    if ended_by is not None:
        return ended_by
    if tokens and tokens[-1] in eos:
        return "eos"
    return "max_new_tokens" if len(tokens) >= requested else "context_length"


def cut_at_stops(text: str, strings) -> str:
    """``text`` up to the earliest of the stop ``strings`` (all of it when none occurs)."""
    return text[:min((i for i in (text.find(s) for s in strings if s) if i >= 0), default=len(text))]


@dataclasses.dataclass(frozen=True)
class Stop:
    """Ends a generation besides EOS and the token budget; checked between decode chunks (a chunk's later
    tokens are computed, and seen by the expert cache, but not returned).

    ``strings``: stop strings, matched on ``render(new token ids)`` (the text the caller shows; the prompt is
    not searched). The generation keeps the shortest run of tokens whose text contains one (so the text,
    cut with ``cut_at_stops``, ends just before it), and stops with ``"stopped": "stop"``.
    ``cancelled``: polled after every chunk; True ends the generation there (``"stopped": "cancelled"``),
    e.g. when a streaming client went away."""

    strings: tuple[str, ...] = ()
    render: Callable[[list[int]], str] | None = None
    cancelled: Callable[[], bool] | None = None

    def __post_init__(self):
        if isinstance(self.strings, str):
            raise TypeError("Stop.strings is a sequence of strings, not one string")
        if any(not isinstance(s, str) or not s for s in self.strings):
            raise ValueError("stop strings must be non-empty strings")
        if self.strings and self.render is None:
            raise ValueError("stop strings need a render function (token ids -> text): a tokenizer")

    def check(self, tokens: list[int], checked: int) -> tuple[int | None, str | None]:
        """(tokens to keep, why) once ``tokens`` (``checked`` of them already seen without a stop) end the
        generation; (None, None) otherwise."""
        if self.strings and len(tokens) > checked:
            text = self.render(tokens)
            if any(s in text for s in self.strings):
                keep = checked + 1
                while keep < len(tokens) and not any(s in self.render(tokens[:keep]) for s in self.strings):
                    keep += 1
                return keep, "stop"
        if self.cancelled is not None and self.cancelled():
            return len(tokens), "cancelled"
        return None, None


NO_STOP = Stop()


def check_prompt(prompt_ids, cfg: ModelConfig, context: int | None = None) -> np.ndarray:
    """The prompt as int32 ids, or a ``ValueError`` naming what is wrong (empty, longer than ``context``, an id
    outside the vocabulary): what ``generate`` refuses, for callers that check before printing anything."""
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    context = context or cfg.max_position_embeddings
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if prompt.size > context:
        raise ValueError(f"the prompt has {prompt.size} tokens, longer than the context of {context}")
    if np.any(prompt < 0) or np.any(prompt >= cfg.vocab_size):
        bad = prompt[(prompt < 0) | (prompt >= cfg.vocab_size)][0]
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    return prompt


def generate(params, cfg: ModelConfig, prompt_ids, *, max_new_tokens: int, sampling: Sampling = Sampling(),
             seed: int = 0, router=None, router_state=None, stop_at_eos: bool = True, chunk: int = CHUNK,
             on_tokens: Callable[[list[int]], None] | None = None, context: int | None = None,
             prefill_policy=None, stop: Stop = NO_STOP, bucketed: bool = False,
             on_cache: Callable | None = None) -> GenerateResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; ``on_tokens`` receives them as they come.

    ``prefill_policy`` (a routing policy) routes the prompt instead of ``router_state["policy"]``, which
    then acts during generation only (GSM8K protocol); the cache is shared by both phases. ``stop``: stop
    strings and cancellation, checked after the first token and after every chunk. ``bucketed``: a KV cache
    of ``kv_bucket`` rows and the prompt prefilled in ``prompt_pieces`` (on a cache of the prompt's own bucket,
    grown after it), so a long-running process (the
    server, task evaluation) compiles a handful of programs for every prompt length instead of two per
    length; off, the prompt runs in one piece (what a single generation wants). ``on_cache(cache_state,
    experts, hits)``: with an expert cache, called after the prompt and after every chunk with the cache state
    and the new tokens' experts and hit flags ([t, moe_layers, K] numpy), e.g. to show the cache live; it
    must copy what it keeps (the state is donated to the next chunk)."""
    context = context or cfg.max_position_embeddings
    prompt = check_prompt(prompt_ids, cfg, context)
    requested, max_new_tokens = max_new_tokens, generation_budget(prompt.size, max_new_tokens, context)
    eos = tuple(cfg.eos_token_ids) if stop_at_eos else ()
    n_chunks = max(0, -(-(max_new_tokens - 1) // chunk))
    dtype = params["embed"].dtype
    rows = kv_rows(prompt.size, max_new_tokens, chunk)
    rows = kv_bucket(rows) if bucketed else rows
    # bucketed, the prompt runs on a cache of its own bucket, grown to the generation's after it: its pieces
    # compile once per prompt bucket, not once for every generation length as well (the server's warm-up)
    prompt_rows = min(kv_bucket(prompt.size), rows) if bucketed else rows
    kv = init_kv(cfg, prompt_rows, dtype)
    key = seeds.prng_key(seed)
    pieces = prompt_pieces(prompt.size) if bucketed else [int(prompt.size)]
    starts = np.cumsum([0] + pieces[:-1]).tolist()

    # compile ahead of time so time to first token and tokens/s measure the model, not XLA
    t_compile = time.perf_counter()
    statics = dict(cfg=cfg, router=router)
    decode_policy = None
    if prefill_policy is not None:
        if router_state is None:
            raise ValueError("prefill_policy needs a router state (a simulated or offloaded expert cache)")
        decode_policy = router_state["policy"]
        router_state = {**router_state, "policy": prefill_policy}
    # the prompt stays a host array, cut into pieces on the host: slicing a device array (and any other eager op
    # whose shape is the prompt's length) compiled a small program for every new prompt length, ~10 ms each,
    # after the server's warm-up had compiled everything its requests run
    seen = seen_tokens(sampling, cfg.vocab_size, prompt)
    jobs, kv_s, rs_s = [], kv, router_state
    weights_signature = _signature(params)
    for n, a in zip(pieces, starts):  # each piece sees the states the one before leaves
        # lowered from shapes alone, so a piece size compiles once whether it comes first or later
        args = _shapes(dict(tokens=prompt[a:a + n], kv=kv_s, key=key, router_state=rs_s, pos0=jnp.int32(a),
                            seen=seen, sampling=sampling))
        jobs.append((prefill, args, statics))
        first_s, kv_s, key_s, rs_s, _, _ = program_shapes(prefill, params, args, statics,
                                                          params_signature=weights_signature)
    if decode_policy is not None:
        rs_s = {**rs_s, "policy": jax.eval_shape(lambda p: p, decode_policy)}
    kv_s = jax.eval_shape(functools.partial(grow_kv, rows=rows), kv_s)
    state_s = DecodeState(kv_s, first_s, jax.ShapeDtypeStruct((), jnp.int32), key_s, rs_s,
                          jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32), _shapes(seen))
    if n_chunks:
        jobs.append((decode_chunk, dict(state=state_s, sampling=_shapes(sampling)),
                     dict(statics, steps=chunk, eos=eos)))
    programs = [run for run, _ in compiled_programs(jobs, params, weights_signature)]
    run_pieces, run_chunk = programs[:len(pieces)], (programs[-1] if n_chunks else None)
    compile_time = time.perf_counter() - t_compile

    t0 = time.perf_counter()
    piece_records = []
    for run, n, a in zip(run_pieces, pieces, starts):  # every piece gets the same key: one split, as unpieced
        first, kv, key_after, router_state, rec, finite = run(params, tokens=prompt[a:a + n], kv=kv, key=key,
                                                              router_state=router_state, pos0=jnp.int32(a),
                                                              seen=seen, sampling=sampling)
        piece_records.append(rec)
    key = key_after
    kv = grow_kv(kv, rows=rows)
    if len(pieces) > 1:  # joined on the host (as every reader of the records reads them), for the same reason
        rec = jax.tree.map(lambda *r: np.concatenate([np.asarray(x) for x in r], axis=1), *piece_records)
    check_step(cfg, rec["logits"], finite, "the prompt")
    report_cache(on_cache, router_state, {k: np.swapaxes(np.asarray(v), 0, 1) for k, v in rec.items()
                                           if k in ("experts", "hits")})
    if decode_policy is not None:  # a copy: decode chunks donate their state, and these are the caller's arrays
        router_state = {**router_state, "policy": jax.tree.map(jnp.copy, decode_policy)}
    first = int(first)
    ttft = time.perf_counter() - t0
    tokens = [first] if max_new_tokens > 0 else []
    records = [rec]
    keep, ended_by = stop.check(tokens, 0)
    if tokens and on_tokens:
        on_tokens(tokens[:])
    limit = jnp.int32(prompt.size + max_new_tokens - 1)
    state = DecodeState(kv, jnp.int32(first), jnp.int32(prompt.size), key, router_state, jnp.bool_(False), limit,
                        see(seen, first))
    finished = not tokens or (first in eos) or ended_by is not None
    fed = int(prompt.size)  # tokens run through the model (and the expert cache): the prompt, then each step's
    while not finished and len(tokens) < max_new_tokens:
        state, (new, done, rec, finite) = run_chunk(params, state=state, sampling=sampling)
        records.append((rec, done))
        new, done = np.asarray(new), np.asarray(done)
        active = ~done
        fed += int(active.sum())
        router_logits = np.swapaxes(np.asarray(rec["logits"])[active][:, :, 0], 0, 1)  # [L, steps, N]
        check_step(cfg, router_logits, np.asarray(finite)[active].all(), f"generated token {len(tokens)}+")
        report_cache(on_cache, state.router_state, {k: np.asarray(v)[active][:, :, 0] for k, v in rec.items()
                                                     if k in ("experts", "hits")})
        fresh = []
        for tok, was_done in zip(new.tolist(), done.tolist()):
            if was_done or len(tokens) >= max_new_tokens:
                finished = True
                break
            tokens.append(tok)
            fresh.append(tok)
            if tok in eos:
                finished = True
                break
        keep, ended_by = stop.check(tokens, len(tokens) - len(fresh))
        if keep is not None:
            fresh = fresh[:len(fresh) - (len(tokens) - keep)]
            del tokens[keep:]
            finished = True
        if fresh and on_tokens:
            on_tokens(fresh)
    jax.block_until_ready(state.token)
    total = time.perf_counter() - t0
    stats = generation_stats(int(prompt.size), tokens, ttft, total, total - ttft, compile_time,
                             stop_reason(tokens, requested, eos, ended_by), fed)
    return GenerateResult(tokens, stats, records, state.router_state)


def generation_stats(prompt_tokens: int, tokens: list[int], ttft: float, total: float, decode_time: float,
                     compile_time: float, stopped: str, fed_tokens: int) -> dict:
    """``GenerateResult.stats`` of a generation (simulated or offloaded): tokens/s counts the decoded tokens,
    i.e. all but the first, which the prefill produced. ``time_to_first_token_s`` is what the caller waited for
    the first token, compiling new shapes included (``compile_time_s``, also apart; ``prefill_time_s`` the
    prefill alone). ``fed_tokens`` exceeds prompt + generated − 1 when a
    stop string cut a decode chunk (the cache saw the rest of the chunk)."""
    n_decode = max(len(tokens) - 1, 0)
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": len(tokens),
        "time_to_first_token_s": compile_time + ttft,
        "prefill_time_s": ttft,
        "total_time_s": total,
        "compile_time_s": compile_time,
        "tokens_per_s": n_decode / decode_time if n_decode and decode_time > 0 else 0.0,
        "stopped": stopped,
        "fed_tokens": fed_tokens,
    }
