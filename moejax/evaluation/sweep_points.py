"""What a sweep evaluates: ``--sweep`` specs, the grid of points they expand to, and each point's identity,
key and JSONL record.

Sweep specs (``--sweep NAME=VALUES``, several flags = the grid of all combinations, first flag outermost):

  ``a:b:n``   n equidistant points from a to b inclusive (``lam=0:1:50``); integer parameters need
              integer points (``max_rank=4:32:8``)
  ``a:b``     integer parameters only: a, a+1, ..., b (``prune_h=2:4``)
  ``x,y,z``   a list (``cache_size=1,2,4,8`` counts, ``cache_size=0.25,0.5`` fractions of N)

Parameters: ``lam``, ``delta`` (cache-prior), ``max_rank`` (max-rank), ``cumsum_p`` (cumsum), ``prune_h``
(pruning), ``top_j`` (max-rank, cumsum, cache-prior), ``cache_size`` (any policy). Without ``--routing`` the
kind is the one the swept parameter belongs to.

Record::

    {"key": sha1 of the canonical JSON of everything that defines the point (task, model, its fingerprint
            (weights, configuration, tokenizer: ``Model.fingerprint``), data and its digest, limit, max_tokens,
            context, shots, max_new_tokens, routing (a learned prior: its path and digest), cache without its
            size string, method),
     "study": str | null, "task": str, "model": str,
     "routing": {"kind", "lam", "top_j", "max_rank", "cumsum_p", "prune_h", "delta", (+ "drop_rank",
                 "random_rank", "seed" for the sensitivity hooks)}  -- null where the kind does not use it,
     "cache": {"size", "capacity", "scope", "eviction", "init", "seed"} | null,
     "sweep": {swept parameter: value}, "method": "forward" | "replay" | "task",
     "ppl", "accuracy", "miss_rate", "lifetime", "lifetime_std", "bytes_per_token", "collision_misses",
     "prefetch_precision", "prefetch_recall": float | int | null,
     "metrics": {the evaluation's full result, JSON-safe}, "time_s": float, "finished_at": ISO-8601}
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import itertools
import json
import math
import os
from typing import Any, Iterable

import numpy as np

from moejax.base import flags, paths
from moejax.models import hub
from moejax.models.assets import DEFAULT_MODEL_NAME
from moejax.experts import routing as routing_lib
from moejax.experts import capacity as capacity_lib
from moejax.evaluation import results as results_file, tasks


# ---------------------------------------------------------------------------------------- sweep specs

#: swept parameter -> (value type, routing kinds it applies to; None = any kind)
SWEEP_PARAMS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "lam": ("float", ("cache-prior",)),
    "delta": ("float", ("cache-prior",)),
    "max_rank": ("int", ("max-rank",)),
    "cumsum_p": ("float", ("cumsum",)),
    "prune_h": ("int", ("pruning",)),
    "top_j": ("int", ("max-rank", "cumsum", "cache-prior")),
    "cache_size": ("size", None),
}
ROUTING_FIELDS = ("lam", "top_j", "max_rank", "cumsum_p", "prune_h", "delta")
KIND_FIELDS = {"original": (), "pruning": ("prune_h",), "max-rank": ("max_rank", "top_j"),
               "cumsum": ("cumsum_p", "top_j"), "cache-prior": ("lam", "top_j", "delta"),
               "learned-prior": ()}  # its parameters are the checkpoint: routing["prior"] holds the path


#: what a float of a spec may be where its parameter has no range of its own (a cache size's fraction)
FINITE = flags.finite_float()


class SweepError(ValueError):
    """A malformed ``--sweep`` spec or a sweep that does not fit the chosen policy."""


@dataclasses.dataclass(frozen=True)
class SweepAxis:
    name: str
    values: tuple


def _number(text: str, kind: str, spec: str, allowed: flags.FloatRange = FINITE):
    """One number of a spec; a float must lie in ``allowed`` (the flag's own range for a routing parameter)."""
    text = text.strip()
    try:
        value = float(text) if kind == "float" else int(text)
    except ValueError:
        what = "a number" if kind == "float" else "an integer"
        raise SweepError(f"--sweep {spec!r}: {text!r} is not {what}") from None
    if kind == "float" and not allowed.contains(value):
        why = "is not in" if math.isfinite(value) else "is not finite: a point must lie in"
        raise SweepError(f"--sweep {spec!r}: {text!r} {why} {allowed.describe()}")
    return value


def _size(text: str, spec: str) -> str:
    """A cache size as the string ``parse_capacity`` reads: a count ('6'), fraction ('0.5'), '5%' or '6GiB'."""
    text = text.strip()
    try:
        capacity_lib.parse_capacity(text, 10**9, 1, "layer", 1)  # syntax and sign only; the model checks the range
    except ValueError as e:  # the stand-in N is no N of the model: not in the message
        raise SweepError(f"--sweep {spec!r}: {e}".replace(f"N={10**9}", "N")) from None
    return text


def parse_sweep(spec: str) -> SweepAxis:
    """``NAME=VALUES`` (module docstring) -> ``SweepAxis``; errors name the spec and what is wrong."""
    if "=" not in spec:
        raise SweepError(f"--sweep {spec!r}: expected NAME=VALUES, e.g. lam=0:1:50 or cache_size=1,2,4")
    name, _, body = spec.partition("=")
    name, body = name.strip().replace("-", "_"), body.strip()
    if name not in SWEEP_PARAMS:
        raise SweepError(f"--sweep {spec!r}: unknown parameter {name!r}; expected one of {sorted(SWEEP_PARAMS)}")
    if not body:
        raise SweepError(f"--sweep {spec!r}: no values after '='")
    kind = SWEEP_PARAMS[name][0]
    allowed = routing_lib.PARAM_RANGES.get(name, FINITE)
    if ":" in body:
        parts = body.split(":")
        if len(parts) not in (2, 3):
            raise SweepError(f"--sweep {spec!r}: a range is a:b (integers) or a:b:n (n points)")
        num_kind = "float" if kind in ("float", "size") else "int"
        if kind == "size":
            num_kind = "float" if any("." in p for p in parts[:2]) else "int"
        a, b = (_number(p, num_kind, spec, allowed) for p in parts[:2])
        if len(parts) == 2:
            if num_kind != "int":
                raise SweepError(f"--sweep {spec!r}: a float range needs a number of points, e.g. {name}={a}:{b}:20")
            if b < a:
                raise SweepError(f"--sweep {spec!r}: empty range ({b} < {a})")
            _check_points(b - a + 1, spec)
            values = list(range(a, b + 1))
        else:
            n = _number(parts[2], "int", spec)
            if n < 1:
                raise SweepError(f"--sweep {spec!r}: the number of points must be >= 1, got {n}")
            _check_points(n, spec)
            # rounded to 12 decimals: 0.3, not linspace's 0.30000000000000004, in records and keys
            values = [round(v, 12) for v in np.linspace(a, b, n).tolist()] if n > 1 else [float(a)]
            if num_kind == "int":
                if not all(float(v).is_integer() for v in values):
                    raise SweepError(f"--sweep {spec!r}: {n} equidistant points from {a} to {b} are not "
                                     f"integers; use {name}={a}:{b} or choose n with (b-a) divisible by n-1")
                values = [int(round(v)) for v in values]
        if kind == "size":
            values = [_size(repr(float(v)) if num_kind == "float" else str(v), spec) for v in values]
    else:
        items = [t for t in body.split(",")]
        if any(not t.strip() for t in items):
            raise SweepError(f"--sweep {spec!r}: empty item in the list")
        values = [_size(t, spec) if kind == "size" else _number(t, kind, spec, allowed) for t in items]
    if len(set(values)) != len(values):
        raise SweepError(f"--sweep {spec!r}: repeated values")
    return SweepAxis(name, tuple(values))


#: more points than any sweep can compute (each is a pass over the text): a typo, refused before the grid is built
MAX_POINTS = 100_000


def _check_points(n: int, spec: str) -> None:
    if n > MAX_POINTS:
        raise SweepError(f"--sweep {spec!r}: {n} points; at most {MAX_POINTS} (each point is a pass over the text)")


def expand_grid(axes: Iterable[SweepAxis]) -> list[dict]:
    """All combinations of the axes' values, first axis outermost; [{}] for no axes."""
    axes = list(axes)
    names = [a.name for a in axes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SweepError(f"--sweep given twice for {dup}")
    total = math.prod(len(a.values) for a in axes)
    if total > MAX_POINTS:
        raise SweepError(f"--sweep: the grid has {total} points; at most {MAX_POINTS}")
    return [dict(zip(names, combo)) for combo in itertools.product(*(a.values for a in axes))]


def infer_kind(kind: str | None, names: Iterable[str]) -> str | None:
    """The routing kind of a sweep: the given one (checked against the swept parameters) or the one the
    parameters imply. Returns None when nothing decides (no routing and only cache_size swept)."""
    names = [n for n in names if SWEEP_PARAMS[n][1] is not None]
    if kind is not None:
        for n in names:
            kinds = SWEEP_PARAMS[n][1]
            if kind in KIND_FIELDS and kind not in kinds:
                raise SweepError(f"--sweep {n} applies to routing {' / '.join(kinds)}, not --routing {kind}")
        return kind
    implied = [set(SWEEP_PARAMS[n][1]) for n in names]
    if not implied:
        return None
    common = set.intersection(*implied)
    if len(common) != 1:
        raise SweepError(f"--sweep {', '.join(names)}: give --routing (one of {sorted(common or set().union(*implied))})")
    return common.pop()


# ---------------------------------------------------------------------------------------- points


def model_label(model_arg: str) -> str:
    """How a model is named in records and keys: "default", a Hugging Face hub id as given, or the checkpoint
    folder's real path."""
    if model_arg == DEFAULT_MODEL_NAME or hub.repo_of(model_arg):
        return model_arg
    return os.path.realpath(os.path.expanduser(model_arg))


def routing_record(kind: str, top_k: int, *, lam=None, top_j=None, max_rank=None, cumsum_p=None, prune_h=None,
                   delta=None, **extra) -> dict:
    """The canonical routing dict of a record: the kind's own parameters with defaults resolved (J, M, h),
    every other field null; ``extra`` (e.g. ``drop_rank``) is added as is."""
    values = {"lam": None if lam is None else float(lam),
              "top_j": routing_lib.default_top_j(top_k) if top_j is None else int(top_j),
              "max_rank": top_k if max_rank is None else int(max_rank),
              "cumsum_p": None if cumsum_p is None else float(cumsum_p),
              "prune_h": top_k if prune_h is None else int(prune_h),
              "delta": None if delta is None else float(delta) if np.ndim(delta) == 0 else [float(d) for d in delta]}
    used = KIND_FIELDS.get(kind, ROUTING_FIELDS)  # unknown (newer) kinds: keep everything given
    out = {"kind": kind, **{f: (values[f] if f in used else None) for f in ROUTING_FIELDS}}
    out.update(extra)
    return out


#: CacheConfig options beyond size/scope/eviction/init (miss handling, prefetch): recorded (and part of the
#: key) only where they differ from these defaults, so records of plain caches keep their keys
CACHE_EXTRAS = {"miss": "fetch", "miss_rank": (1,), "cascade_bits": (8,), "quant_group": None, "prefetch": 0.0,
                "prefetch_percentile": None, "memory": None}


def cache_record(cache, cfg) -> dict | None:
    """The record's cache dict for a ``simulate.CacheConfig`` (None: no cache)."""
    if cache is None:
        return None
    out = {"size": str(cache.size), "capacity": int(cache.capacity(cfg)), "scope": cache.scope,
           "eviction": cache.eviction, "init": cache.init, "seed": int(cache.seed) if cache.init == "random" else None}
    for name, default in CACHE_EXTRAS.items():
        value = getattr(cache, name, default)
        if isinstance(default, tuple):
            value = tuple(value)
        if value != default:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def point_key(identity: dict) -> str:
    """sha1 of the canonical (sort_keys, compact) JSON of a point's identity."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


@dataclasses.dataclass
class Point:
    """One evaluation: what defines it (``identity``, hashed into ``key``), how to compute it, how to record it.

    method "forward": WikiText through the model (``policy``/``cache`` simulated, or ``hook`` as the router,
    or plain original routing when all are None); "replay": WikiText's recorded original-routing trace
    replayed through ``cache`` (``eviction`` may be belady); "task": ``moejax.evaluation.tasks.evaluate_task``.
    """

    identity: dict
    record: dict  # study, task, model, routing, cache, sweep, method
    method: str = "forward"
    policy: Any = None
    cache: Any = None
    hook: Any = None
    hook_state: Any = None
    task_options: dict = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)  # added to the record's metrics
    offload: Any = None  # offload.OffloadConfig: experts paged for real (the one-point loop of model.forward)

    @property
    def key(self) -> str:
        return point_key(self.identity)

    def batch_group(self) -> tuple | None:
        """Points with equal groups can share one vmapped pass (None: never batched)."""
        if self.method != "forward" or self.hook is not None or self.cache is None or self.offload is not None:
            return None
        # size, initial contents and seed are data; every other cache option is static (code paths)
        static = tuple((f.name, getattr(self.cache, f.name)) for f in dataclasses.fields(self.cache)
                       if f.name not in ("size", "init", "seed"))
        return (self.policy.kind, static)


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # noqa: ARG001 - size and mtime key the cache
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def data_digest(path: str) -> str | None:
    """sha256 of a data file's bytes, or of a data folder's files (names and bytes, in name order); None when
    there is nothing there (the loader names the problem)."""
    if os.path.isfile(path):
        st = os.stat(path)
        return _digest(path, st.st_size, st.st_mtime_ns)
    if not os.path.isdir(path):
        return None
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            if os.path.isfile(full):
                h.update(os.path.relpath(full, path).encode() + b"\0" + data_digest(full).encode())
    return h.hexdigest()


def make_point(model, model_name: str, *, task: str = "wikitext", study: str | None = None, data: str | None = None,
               context: int | None = 1024, max_tokens: int | None = None, limit: int | None = None,
               shots: int | None = None, max_new_tokens: int | None = None, routing: dict | None = None,
               policy=None, cache=None, sweep: dict | None = None, method: str = "forward", hook=None,
               hook_state=None, offload=None) -> Point:
    """Assemble a ``Point``; ``routing`` is the record dict (``routing_record``), ``policy`` the policy object.
    Options that do not apply to the task are dropped from the identity (``limit`` for WikiText, ...)."""
    if task == "wikitext":
        limit = shots = max_new_tokens = None
    else:
        context = max_tokens = None
    routing = routing or routing_record("original", model.cfg.top_k)
    crec = cache_record(cache, model.cfg)
    data_id = None if data is None else os.path.realpath(os.path.expanduser(data))
    identity = {"task": task, "model": model_name, "weights": model.fingerprint, "data": data_id, "limit": limit,
                "max_tokens": max_tokens, "context": context, "shots": shots, "max_new_tokens": max_new_tokens, "routing": routing,
                "cache": None if crec is None else {k: v for k, v in crec.items() if k != "size"},
                "method": method}
    if data_id is not None:  # the data's contents, not only its path: edited data is evaluated again
        identity["data_digest"] = data_digest(data_id)
        shots = [f for f in tasks.shot_files(task, data_id) if os.path.isfile(f)] if task in tasks.TASKS else []
        if shots:  # where a task file's shots come from (gsm8k's train.jsonl beside it, MMLU's dev csv)
            identity["shot_digests"] = [data_digest(f) for f in shots]
    elif task == "wikitext":  # the default text (``$MOEJAX_WIKITEXT``, ``$MOEJAX_DATA``, else HF's) is data too
        default = paths.wikitext_test()
        identity["data_digest"] = data_digest(default) if default else "hf:wikitext/wikitext-2-raw-v1/test"
    if routing.get("prior"):  # a learned prior's files too: one retrained at the same path is evaluated again
        identity["prior_digest"] = data_digest(routing["prior"])
    record = {"study": study, "task": task, "model": model_name, "routing": routing, "cache": crec,
              "sweep": dict(sweep or {}), "method": method}
    if offload is not None:  # real paging: in the identity (and the record) only when on
        orec = {k: v for k, v in dataclasses.asdict(offload).items() if k != "store_dir"}
        identity["offload"] = record["offload"] = orec
    opts = {"limit": limit, "shots": shots, "max_new_tokens": max_new_tokens, "data": data}
    return Point(identity, record, method, policy, cache, hook, hook_state, opts, offload=offload)


def make_record(point: Point, result: dict, time_s: float) -> dict:
    """The JSONL record of a finished point (schema in the module docstring)."""
    result = {**result, **point.extra}
    stats = result.get("cache") if isinstance(result.get("cache"), dict) else {}

    def pick(*names):
        for src in (result, stats):
            for n in names:
                if src.get(n) is not None:
                    return src[n]
        return None

    rec = {"key": point.key, **point.record,
           "ppl": result.get("ppl"), "accuracy": result.get("accuracy"),
           "miss_rate": pick("miss_rate"), "lifetime": pick("lifetime", "lifetime_mean"),
           "lifetime_std": pick("lifetime_std"), "bytes_per_token": pick("bytes_per_token"),
           "collision_misses": pick("collision_misses"), "prefetch_precision": pick("prefetch_precision"),
           "prefetch_recall": pick("prefetch_recall"),
           "metrics": result, "time_s": float(time_s),
           "finished_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return results_file.as_json(rec)
