"""What every task shares: the task data record, file reading, the model stream (one expert-cache state through
every forward and generation, compiled-program budget), prompt fitting, continuation scoring, tallies."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any, Callable

import numpy as np

from moejax.base import errors, textproc
from moejax.experts import routing as routing_lib
from moejax.runtime import decode


PAD_MULTIPLE = 64


N_SAMPLES = 3  # generations kept in the result for inspection


@dataclasses.dataclass
class TaskData:
    """What a task evaluates: examples in scoring order, the few-shot pool, and where they came from."""

    examples: list
    shots: Any  # mmlu: {subject: [MultipleChoice]}; gsm8k / nq_open: list; truthfulqa: []
    files: list[str]
    shot_source: dict[str, str] = dataclasses.field(default_factory=dict)  # mmlu: subject -> dev path


def _need_str(obj: dict, field: str, where: str) -> str:
    if field not in obj:
        raise errors.Failure(f"{where}: missing field {field!r}")
    value = obj[field]
    if not isinstance(value, str) or not value.strip():
        raise errors.Failure(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return value


@contextlib.contextmanager
def _open_text(path: str, newline: str | None = None):
    """A data file opened as UTF-8 text; bytes that are not UTF-8 become a ``Failure`` naming the file."""
    with open(path, encoding="utf-8", newline=newline) as f:
        try:
            yield f
        except UnicodeDecodeError as e:
            raise errors.Failure(f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a read)") from None


def read_jsonl(path: str, parse: Callable[[Any, str], Any], n: int | None = None) -> list:
    """Rows of a JSON-lines file through ``parse(obj, where)``; blank lines skipped; stops after ``n``."""
    rows = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if n is not None and len(rows) >= n:
                break
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise errors.Failure(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, RecursionError) as e:  # an integer of over 4300 digits, nesting too deep
                raise errors.Failure(f"{where}: invalid JSON ({e})") from None
            rows.append(parse(obj, where))
    return rows


def _file_in(path: str, name: str) -> str:
    return os.path.join(path, name) if os.path.isdir(path) else path


def log_softmax_at(logits: np.ndarray, positions, ids) -> np.ndarray:
    """log p(ids[i] | position positions[i]) from raw logits [T, V], in float64."""
    z = np.asarray(logits[np.asarray(positions)], np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logp[np.arange(len(ids)), np.asarray(ids)]


def _mapped_regions() -> int | None:
    """Memory regions this process has mapped (Linux), None where /proc is not there."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _map_budget() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 32765


class ProgramBudget:
    """Drops XLA's compiled programs (``jax.clear_caches``) before they exhaust the process's memory maps.

    Without padding every prompt length is its own program, and on XLA:CPU one program with a simulated
    cache maps ~700 regions (a cached generation ~1,600): a 100-example MMLU run with a cache would die
    in LLVM ("Cannot allocate memory") at the kernel's ``vm.max_map_count`` (65,530). So when a new shape
    is about to compile and the process holds more than half that many regions (or, without /proc, after
    ``fallback_shapes`` new shapes), the caches are cleared; the lengths that come back compile again."""

    def __init__(self, budget: int | None = None, fallback_shapes: int = 32):
        self.budget = budget or _map_budget()
        self.fallback_shapes = fallback_shapes
        self.shapes: set = set()
        self.clears = 0

    def before(self, key) -> None:
        if key in self.shapes:
            return
        regions = _mapped_regions()
        full = regions > self.budget if regions is not None else len(self.shapes) >= self.fallback_shapes
        if full:
            import gc

            import jax

            jax.clear_caches()
            gc.collect()
            self.shapes.clear()
            self.clears += 1
        self.shapes.add(key)


def own_state(state):
    """A committed copy of a router state. ``Model.generate`` donates the state it is given, so the
    caller's stays valid; and committed arrays match the states the model hands back, so the second
    call does not compile again (a fresh state's arrays are uncommitted, which is another jit key)."""
    import jax

    def copy(x):
        return jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array) else x

    return jax.tree_util.tree_map(copy, state)


def resolve_policy(model, routing):
    """A routing policy from a policy or a kind name (as ``Model.forward`` reads ``routing=``)."""
    return routing_lib.as_policy(routing, model.cfg.top_k)


def padded_length(n_tokens: int, context: int, rope_long_after: int) -> int:
    """Length a pass of ``n_tokens`` is right-padded to: a multiple of ``PAD_MULTIPLE`` (one compiled program
    per bucket instead of one per prompt length), never past the context, and never across a longrope
    model's switch to its long factors (the rope of the real tokens would change)."""
    limit = max(context, n_tokens)
    if n_tokens <= rope_long_after:
        limit = min(limit, rope_long_after)
    return min(-(-n_tokens // PAD_MULTIPLE) * PAD_MULTIPLE, limit)


class Stream:
    """Every forward and generation of one evaluation, in order, carrying the expert-cache state."""

    def __init__(self, model, routing=None, cache=None, state=None, options: dict | None = None):
        self.model, self.options = model, dict(options or {})
        self.simulate = routing is not None or cache is not None or state is not None
        self.state = None
        if self.simulate:
            if state is None:
                state = model.router_state(routing, cache)
            elif routing is not None:  # the given cache, with ``routing``'s policy
                state = {**state, "policy": resolve_policy(model, routing)}
            self.state = own_state(state)
        self.tokens = 0  # tokens fed to the model (their routing moved the cache)
        self.offload_calls: list[tuple[int, dict]] = []  # (tokens fed, stats["offload"]) of each paged call
        self.context = model.cfg.max_position_embeddings
        self.programs = ProgramBudget()

    def _cache_kwargs(self) -> dict:
        return {"state": self.state} if self.simulate else {}

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Teacher-forced logits [T, V]; right-padded to a multiple of 64 when no cache is simulated."""
        ids = np.asarray(ids, np.int32)
        self.tokens += len(ids)
        if self.simulate or self.options:  # an option might care about every token: no padding either
            self.programs.before(("forward", len(ids)))
            out = self.model.forward(ids, **self._cache_kwargs(), **self.options)
            if self.simulate:
                self.state = out.state
            self._offloaded(len(ids), out)
            return out.logits
        padded = padded_length(len(ids), self.context, getattr(self.model.cfg, "rope_long_after", self.context))
        self.programs.before(("forward", padded))
        full = np.zeros(padded, np.int32)
        full[: len(ids)] = ids
        return self.model.forward(full).logits[: len(ids)]

    def generate(self, ids: np.ndarray, max_new_tokens: int, prefill_routing=None, stop=()) -> list[int]:
        """Greedy generation (unless options say otherwise) up to a ``stop`` string; the cache state goes on
        from the result."""
        # bucketed: a few programs for all prompt lengths, instead of two compilations per length
        kw = {"max_new_tokens": max_new_tokens, "stop": stop, "bucketed": True, **self._cache_kwargs()}
        if self.simulate and prefill_routing is not None:
            kw["prefill_routing"] = prefill_routing
        self.programs.before(("generate", len(ids), max_new_tokens))
        result = self.model.generate(np.asarray(ids, np.int32), **kw, **self.options)
        if self.simulate:
            self.state = result.router_state
        # what the model ran: the last generated token is never fed, and a stop's chunk runs to its end
        self.tokens += result.stats["fed_tokens"]
        self._offloaded(result.stats["fed_tokens"], result)
        return list(result.token_ids)

    def _offloaded(self, tokens: int, output) -> None:
        if self.options.get("offload") is not None:  # real paging: keep what this call moved
            self.offload_calls.append((tokens, output.stats["offload"]))


class Encoder:
    """Prompt and continuation token ids for the model's tokenizer and BOS."""

    def __init__(self, model):
        if model.tokenizer is None:
            raise ValueError(f"{model.path} has no tokenizer.json: task evaluation needs one")

        self.tok, self.bos = model.tokenizer, model.cfg.bos_token_id
        style = textproc.is_wikitext_style(getattr(model, "generation_config", None))
        self._render = textproc.wikitext_detokenize if style else str

    def render(self, tokens) -> str:
        """Generated text as the user would read it (WikiText spacing undone for wikitext-style models)."""
        return self._render(self.tok.decode(tokens))

    def text(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, text: str) -> np.ndarray:
        return np.asarray(([] if self.bos is None else [self.bos]) + self.text(text), np.int32)

    def continuation(self, context: str, continuation: str) -> list[int]:
        """The tokens of ``context + continuation`` beyond those of ``context`` (lm-eval-harness), so the
        continuation is tokenised as it would appear in running text."""
        whole, ctx = self.text(context + continuation), self.text(context)
        if len(whole) > len(ctx) and whole[: len(ctx)] == ctx:
            return whole[len(ctx):]
        return self.text(continuation)


@dataclasses.dataclass
class FittedPrompt:
    ids: np.ndarray
    text: str
    shots: int
    truncated: bool


def fit_prompt(enc: Encoder, build: Callable[[int], str], shots: int, budget: int) -> FittedPrompt:
    """The prompt with the most shots (``shots`` down to 0) of at most ``budget`` tokens; 0-shot cut from
    the left (BOS kept) when even that is too long.

    A prompt grows with its shots, so the count is found by doubling up to the first prompt that does not fit,
    then halving the gap: O(log k) prompts built of at most about twice the fitting one, instead of one per
    count from ``shots`` down (quadratic in ``shots``, minutes before the first example of a large one). Each
    shot adds at least one token, so more than ``budget`` shots never fit (callers cap ``shots`` at their pool:
    ``build(k)`` holds k shots)."""
    if budget < 2:
        raise ValueError(f"no room for a prompt: {budget} tokens left in the context")
    built: dict[int, tuple[str, np.ndarray]] = {}

    def fits(k: int) -> bool:
        text = build(k)
        built[k] = (text, enc.prompt(text))
        return len(built[k][1]) <= budget

    best = _largest_fitting(fits, min(shots, budget))
    if best >= 0:
        text, ids = built[best]
        return FittedPrompt(ids, text, best, False)
    text, ids = built[0]
    head = [] if enc.bos is None else [enc.bos]
    ids = np.asarray(head + ids[len(ids) - (budget - len(head)):].tolist(), np.int32)
    return FittedPrompt(ids, text, 0, True)


def _largest_fitting(fits: Callable[[int], bool], most: int) -> int:
    """The largest k in 0..``most`` with ``fits(k)`` (-1 if none), for a ``fits`` true up to some k and false
    after: doubling from 1, then bisecting."""
    best, worst, k = -1, most + 1, min(1, most)
    while k < worst:
        if not fits(k):
            worst = k
            break
        best = k
        k = most + 1 if k == most else min(most, 2 * k)
    while worst - best > 1:
        mid = (best + worst) // 2
        if fits(mid):
            best = mid
        else:
            worst = mid
    return best


@dataclasses.dataclass
class Request:
    """One example's model work, decided before any of it runs: its prompt, then either the continuations
    scored after it (``score_continuations``) or ``max_new_tokens`` generated after it."""

    row: Any
    prompt: FittedPrompt
    continuations: list[list[int]] | None = None
    max_new_tokens: int = 0

    def passes(self) -> list[tuple[int, int]]:
        """(positions, logit rows returned) of each model call it makes: a scored forward holds and returns
        every position it reads; a generation holds the bucketed KV cache of an offloaded ``generate``
        (``decode.kv_bucket`` of ``decode.kv_rows``: what in-jit paging allocates, and at least the host
        pager's prompt + new tokens + 1) and returns no pass of logits."""
        n = len(self.prompt.ids)
        if self.continuations is None:
            return [(decode.kv_bucket(decode.kv_rows(n, self.max_new_tokens)), 0)]
        if all(len(c) == 1 for c in self.continuations):
            return [(n, n)]
        return [(n + len(c) - 1, n + len(c) - 1) for c in self.continuations]


def score_continuations(stream: Stream, prompt: np.ndarray, continuations: list[list[int]]) -> list[float]:
    """Sum of log-probs of each continuation after ``prompt``; one forward in all when every
    continuation is one token, else one forward over ``prompt + continuation[:-1]`` each, in order."""
    if all(len(c) == 1 for c in continuations):
        logits = stream.logits(prompt)
        last = len(prompt) - 1
        return log_softmax_at(logits, [last] * len(continuations), [c[0] for c in continuations]).tolist()
    scores = []
    for cont in continuations:
        ids = np.concatenate([prompt, np.asarray(cont[:-1], np.int32)])
        logits = stream.logits(ids)
        positions = np.arange(len(prompt) - 1, len(ids))
        scores.append(float(log_softmax_at(logits, positions, cont).sum()))
    return scores


@dataclasses.dataclass
class Tally:
    """Counters every task reports."""

    shots_used: list = dataclasses.field(default_factory=list)
    shortened: int = 0
    truncated: int = 0

    def add(self, p: FittedPrompt, asked: int) -> None:
        self.shots_used.append(p.shots)
        self.shortened += p.shots < asked
        self.truncated += p.truncated

    def summary(self) -> dict:
        return {"shortened": self.shortened, "truncated": self.truncated,
                "mean_shots": float(np.mean(self.shots_used)) if self.shots_used else 0.0}


def _generation_budget(context: int, max_new_tokens: int) -> int:
    if max_new_tokens < 1 or max_new_tokens > context - 2:
        raise ValueError(f"max_new_tokens must be in 1..{context - 2} (context {context}), got {max_new_tokens}")
    return context - max_new_tokens


def _progress(total: int, task: str, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    if not enabled:
        return (lambda n: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=task, unit="ex", file=sys.stderr)
    return bar.update, bar.close
