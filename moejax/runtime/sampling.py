"""How the next token is chosen from the logits: greedy, temperature, top-k, top-p (nucleus) and the repetition
penalty, in transformers' order, as a pytree of numbers so that one compiled program serves every setting; and
the defaults a checkpoint's ``generation_config.json`` asks for."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from moejax.base.typecheck import is_integer, is_number


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when temperature == 0 (or below float32's smallest normal number, which XLA flushes to 0: the
    limit of sampling as T → 0); otherwise temperature, then top-k, then nucleus (top-p) sampling — the order
    of transformers' logits warpers (tokens tied at the nucleus' edge all stay; a sort kept whichever it put
    first). ``repetition_penalty`` (transformers' ``RepetitionPenaltyLogitsProcessor``,
    greedy included): every token already in the prompt or the output has its logit divided by it (multiplied,
    where negative) before the choice; 1 is off.

    A pytree: the four numbers are its leaves, so jitted code takes them as values and one compiled program
    serves every temperature, top-p, top-k and penalty (a server's requests each send their own); only which
    steps run (``steps``: greedy or not, top-k, top-p, penalty on or off) is part of the program."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not (is_number(self.repetition_penalty) and 0 < self.repetition_penalty
                and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty!r}")
        greedy = self.temperature < GREEDY_BELOW
        object.__setattr__(self, "steps", SamplingSteps(greedy, not greedy and self.top_k > 0,
                                                        not greedy and self.top_p < 1, self.repetition_penalty != 1))

    def decided_at_run_time(self) -> "Sampling":
        """The same numbers in a program that serves every setting: whether it is greedy, and whether top-k, top-p
        and the penalty act, is read from the numbers when the program runs (``lax.cond`` per token; the
        penalty's token set is always carried). A server's requests each bring their own sampling; with the
        steps fixed at compile time every new combination (greedy or not, top-k, top-p, penalty on or off)
        compiled the prompt and decode programs again. Same tokens as the fixed steps for the same numbers."""
        return _unflatten_sampling(RUN_TIME_STEPS, (self.temperature, self.top_p, self.top_k, self.repetition_penalty))


#: temperatures below float32's smallest normal number decode greedily (XLA flushes them to 0): the one threshold
#: of the steps fixed when made and of those decided at run time
GREEDY_BELOW = float(np.finfo(np.float32).tiny)


class SamplingSteps(typing.NamedTuple):
    """Which steps a ``Sampling`` runs: the static part of the pytree (what a compiled program depends on)."""

    greedy: bool
    top_k: bool
    top_p: bool
    penalty: bool
    at_run_time: bool = False  # each step acts or not by its number, decided when the program runs


#: ``Sampling.decided_at_run_time``'s steps: all present, each one switched by its number
RUN_TIME_STEPS = SamplingSteps(greedy=False, top_k=True, top_p=True, penalty=True, at_run_time=True)


def _typed(x, dtype):
    """A number from the caller as a typed scalar (a float past float32's range as its largest: the limit, with
    no overflow warning); traced values and shapes as they are."""
    if not isinstance(x, (int, float, np.number)):
        return x
    if dtype == np.float32:
        x = min(float(x), float(np.finfo(np.float32).max))
    return np.asarray(x, dtype)


def _f32(x) -> jax.Array:
    """A sampling number (a caller's number, or traced) as a float32 scalar."""
    return jnp.asarray(_typed(x, np.float32), jnp.float32)


def _flatten_sampling(s: Sampling):
    leaves = (s.temperature, s.top_p, s.top_k, s.repetition_penalty)
    return tuple(_typed(x, dtype) for x, dtype in zip(leaves, (np.float32, np.float32, np.int32, np.float32))), s.steps


def _unflatten_sampling(steps: SamplingSteps, leaves) -> Sampling:
    s = object.__new__(Sampling)  # traced values: no checks (they were made on the numbers)
    for name, value in zip(("temperature", "top_p", "top_k", "repetition_penalty"), leaves):
        object.__setattr__(s, name, value)
    object.__setattr__(s, "steps", steps)
    return s


jax.tree_util.register_pytree_node(Sampling, _flatten_sampling, _unflatten_sampling)


#: transformers' ``GenerationConfig`` defaults for what a ``generation_config.json`` that samples leaves out
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}


def sampling_defaults(generation_config: dict) -> dict:
    """The decoding a checkpoint's ``generation_config.json`` asks for, read as transformers' ``generate`` reads
    it: with ``"do_sample": true`` its temperature, top_p and top_k (transformers' defaults 1.0, 1.0 and 50 for
    those left out; null or 0 top_k: off); its ``repetition_penalty`` always (transformers applies it to
    greedy decoding too). Only the keys the file sets or implies; ``Sampling(**...)`` checks them (a
    ``ValueError`` for values no sampler can mean)."""
    g = generation_config
    out = {}
    if g.get("do_sample") is True:
        out = {k: g.get(k, v) for k, v in HF_SAMPLING_DEFAULTS.items()}
        out["top_k"] = out["top_k"] or 0
        out["top_p"] = 1.0 if out["top_p"] is None else out["top_p"]
        out["temperature"] = 1.0 if out["temperature"] is None else out["temperature"]
    if g.get("repetition_penalty") is not None:
        out["repetition_penalty"] = g["repetition_penalty"]
    for key, value in out.items():
        if not is_number(value):
            raise ValueError(f"{key} must be a number, got {value!r}")
    Sampling(**out)
    return out


#: what each sampling setting is when neither the user nor the checkpoint sets it: greedy, nothing penalised
SAMPLING_FALLBACK = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def resolve_sampling(given: dict, defaults: dict) -> tuple[dict, list[str]]:
    """The settings a command decodes with: each of ``SAMPLING_FALLBACK``'s keys as ``given`` (None: not given),
    else as the checkpoint's ``defaults`` (``sampling_defaults``), else the fallback; and the keys taken from
    the checkpoint. Decoding greedily, the checkpoint's top_p and top_k are dropped (they would not act)."""
    out, from_file = {}, []
    for key, fallback in SAMPLING_FALLBACK.items():
        if given.get(key) is not None:
            out[key] = given[key]
        elif key in defaults:
            out[key] = defaults[key]
            from_file.append(key)
        else:
            out[key] = fallback
    if Sampling(**out).steps.greedy:
        for key in ("top_p", "top_k"):
            if key in from_file:
                out[key] = SAMPLING_FALLBACK[key]
                from_file.remove(key)
    return out, from_file


def seen_tokens(sampling: Sampling, vocab_size: int, tokens) -> jax.Array | None:
    """What a repetition penalty applies to: a [V] mask of the tokens so far (prompt, then output); None
    without a penalty (nothing is carried then)."""
    if not sampling.steps.penalty:
        return None
    mask = np.zeros(vocab_size, np.bool_)  # on the host: a scatter of a prompt's length compiles once per length
    mask[np.asarray(tokens, np.int64)] = True
    return jnp.asarray(mask)


def see(seen: jax.Array | None, token) -> jax.Array | None:
    """``seen`` with ``token`` added (None stays None)."""
    return None if seen is None else seen.at[token].set(True)


def penalised_logits(logits: jax.Array, sampling: Sampling, seen: jax.Array | None = None) -> jax.Array:
    """``logits`` with the repetition penalty applied to the ``seen`` tokens (unchanged without one)."""
    if not sampling.steps.penalty:
        return logits
    logits = logits.astype(jnp.float32)
    penalty = _f32(sampling.repetition_penalty)
    return jnp.where(seen, jnp.where(logits < 0, logits * penalty, logits / penalty), logits)


def sampling_logits(logits: jax.Array, sampling: Sampling, seen: jax.Array | None = None) -> jax.Array:
    """The float32 logits a sampled token is drawn from: penalised, divided by the temperature, then -inf
    outside the top-k and outside the nucleus (top-p), transformers' order. Shifted to a maximum of 0."""
    logits = penalised_logits(logits, sampling, seen).astype(jnp.float32)
    # shifted to a maximum of 0 first: a tiny temperature then tends to greedy (0 / T = 0, the rest -inf)
    # instead of inf / inf = NaN (a subnormal T gave garbage tokens); a huge one is float32's largest (the
    # limit T → inf, uniform sampling, without an overflow warning when it is cast)
    logits = (logits - jnp.max(logits, axis=-1, keepdims=True)) / _f32(sampling.temperature)
    steps = sampling.steps
    if steps.top_k:
        k = jnp.asarray(sampling.top_k, jnp.int32)
        logits = _when(steps.at_run_time, k > 0, lambda x: _top_k(x, k), logits)
    if steps.top_p:
        top_p = jnp.asarray(sampling.top_p, jnp.float32)
        logits = _when(steps.at_run_time, top_p < 1, lambda x: _top_p(x, top_p), logits)
    return logits


def _when(at_run_time: bool, acts, step: Callable, x):
    """``step(x)``; with the steps decided at run time, only where ``acts`` (a ``lax.cond``: the other branch
    does not run)."""
    return jax.lax.cond(acts, step, lambda y: y, x) if at_run_time else step(x)


def _top_k(logits: jax.Array, k: jax.Array) -> jax.Array:
    """The k largest stay (ties with the k-th too, as transformers); k >= V keeps all."""
    keys = ordered_keys(logits)
    kth = largest_key_where(lambda t: jnp.sum(keys >= t, dtype=jnp.int32) >= k)
    return jnp.where(keys < kth, -jnp.inf, logits)


def _top_p(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """The nucleus: every token whose more likely tokens hold less than top_p of the mass. ``logits`` have a
    maximum of 0: the most likely token always stays (a subnormal top_p, flushed to 0 by XLA, kept none)."""
    keys = ordered_keys(logits)
    probs = jax.nn.softmax(logits)
    below = largest_key_where(lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0)) >= top_p)
    return jnp.where((keys > below) | (logits == 0), logits, -jnp.inf)


def ordered_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values ``x``; equal values, -0 and +0 too, get equal keys."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def largest_key_where(holds: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The largest uint32 ``t`` for which ``holds(t)`` (true up to some point, false after it), or 0: found a
    bit at a time, 32 passes over the keys. Top-k and top-p thresholds without sorting the vocabulary (a sort
    of 152k logits took 31-40 ms a token on the CPU; these passes 2-4 ms). A loop on the CPU (unrolled, it
    compiles 1.4 s longer and runs no faster); unrolled elsewhere, 32 straight-line reductions with no loop
    control for an accelerator to run (not yet measured on one)."""
    def set_bit(i, t):
        candidate = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        return jnp.where(holds(candidate), candidate, t)

    def search(unroll: bool):
        return lambda: jax.lax.fori_loop(0, 32, set_bit, jnp.uint32(0), unroll=unroll)
    return jax.lax.platform_dependent(cpu=search(False), default=search(True))


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling, seen: jax.Array | None = None) -> jax.Array:
    """The next token from one position's logits [V]; ``seen`` (``seen_tokens``) when ``sampling`` penalises."""
    greedy = lambda: jnp.argmax(penalised_logits(logits, sampling, seen), axis=-1).astype(jnp.int32)  # noqa: E731
    drawn = lambda: jax.random.categorical(key, sampling_logits(logits, sampling, seen)).astype(jnp.int32)  # noqa: E731
    if sampling.steps.at_run_time:
        return jax.lax.cond(_f32(sampling.temperature) < GREEDY_BELOW, greedy, drawn)
    return greedy() if sampling.steps.greedy else drawn()
