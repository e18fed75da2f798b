"""``python -m moejax.report``: a markdown report (tables, headline comparisons, figures) from study results.

    python -m moejax.report RESULTS.jsonl [MORE.jsonl ...] [--out REPORT.md] [--figures DIR] [--overwrite]
        [--trace TRACE.npz[=LABEL] ... --trace-layer 0 --trace-cache-size 0.5]

Input: JSONL result files, one JSON object per sweep point (the sweeps' record schema: ``key``, ``study``,
``task``, ``model``, ``routing`` {kind, lam, top_j, max_rank, cumsum_p, prune_h, delta, ...}, ``cache``
{size, capacity, scope, eviction, init} or null, ``sweep``, ``ppl``, ``accuracy``, ``miss_rate``,
``lifetime``, ``lifetime_std``, ``bytes_per_token``, ``collision_misses``, ``prefetch_precision``,
``prefetch_recall``, ``metrics``, ``time_s``, ``finished_at``). A truncated last line (a run killed mid-write)
is skipped with a warning; any other malformed line is an error naming the file and line. A record that
appears twice (same study and key, e.g. a resumed run) counts once, the later one winning.

Records are grouped by ``study`` (plain sweeps, ``study`` null, by task and swept parameters); each group
gets a section: what the paper's figure shows, the headline comparison, the figure(s) (PNG + SVG written by
``moejax.plots`` into ``--figures``, linked relative to the report) and a table of the points. Studies this
module does not know get a generic table (and a trade-off plot when they carry miss rates and perplexity or
accuracy). The report and its figures are written atomically, as one set (``atomic.together``): by default
to REPORT.md beside the first input, with figures in ``figures/`` beside it. Figures have fixed names
(``pareto.png``, ...) and carry a mark (``FIGURE_MARK``); an existing file of such a name that lacks it, or an
``--out`` that is not a moejax report, is the user's and is refused before any figure is drawn, unless
``--overwrite``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

from moejax.base import atomic, commands, errors, interrupts
from moejax.base.errors import Failure
from moejax.base.typecheck import is_number
from moejax.evaluation import heatmap, plots, records as rec
from moejax.evaluation.headlines import (_plural, _rel, headline_cache_size, headline_delta, headline_eviction,
                                         headline_init, headline_lifetimes, headline_pareto, headline_sensitivity,
                                         headline_tasks, pareto_front_records)
from moejax.evaluation.records import (PlotError, cache_of, capacity_of, eviction_of, fmt_num, fmt_pct, fmt_value,
                                       group_by, is_belady, kind_of, kind_rank, md_table, n_experts_of, num,
                                       policy_param, routing_label, routing_of)

STUDY_ORDER = ("pareto", "cache_size", "lifetimes", "sensitivity", "init", "delta", "eviction", "tasks")
NUMBER_FIELDS = ("ppl", "accuracy", "miss_rate", "lifetime", "lifetime_std", "bytes_per_token", "collision_misses",
                 "prefetch_precision", "prefetch_recall", "time_s")
# The range each number of a record can have (a perplexity below 1 or a 700 % miss rate is a damaged file).
FIELD_RANGES = {"ppl": (1.0, math.inf), "accuracy": (0.0, 1.0), "miss_rate": (0.0, 1.0),
                "prefetch_precision": (0.0, 1.0), "prefetch_recall": (0.0, 1.0), "lifetime": (0.0, math.inf),
                "lifetime_std": (0.0, math.inf), "bytes_per_token": (0.0, math.inf),
                "collision_misses": (0.0, math.inf), "time_s": (0.0, math.inf)}
DICT_FIELDS = ("routing", "cache", "sweep", "metrics")
STRING_FIELDS = ("key", "study", "task", "model", "finished_at")
DETAILS_ROWS = 25  # longer tables fold into <details>


class ResultsError(Failure):
    """A results file that cannot be read; the message names the file (and line)."""


# ------------------------------------------------------------------------------------------ loading


def check_record(rec: Any, where: str) -> dict:
    """Raise ResultsError unless ``rec`` follows the record schema's types (unknown keys are fine)."""
    if not isinstance(rec, dict):
        raise ResultsError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    for name in STRING_FIELDS:
        if rec.get(name) is not None and not isinstance(rec[name], str):
            raise ResultsError(f"{where}: field {name!r} must be a string or null, got {rec[name]!r}")
    for name in DICT_FIELDS:
        if rec.get(name) is not None and not isinstance(rec[name], dict):
            raise ResultsError(f"{where}: field {name!r} must be an object or null, got {rec[name]!r}")
    for name in NUMBER_FIELDS:
        v = rec.get(name)
        if v is not None and not is_number(v):
            raise ResultsError(f"{where}: field {name!r} must be a number or null, got {v!r}")
        low, high = FIELD_RANGES.get(name, (-math.inf, math.inf))
        if v is not None and not low <= v <= high and v == v:  # NaN stands for "not defined" (no lifetime yet)
            raise ResultsError(f"{where}: field {name!r} is {v!r}, outside [{low:g}, {high:g}]")
    cache = rec.get("cache") or {}
    if cache.get("capacity") is not None and num(cache["capacity"]) is None:
        raise ResultsError(f"{where}: cache.capacity must be a number, got {cache['capacity']!r}")
    if rec.get("routing") is not None and not isinstance(rec["routing"].get("kind", ""), str):
        raise ResultsError(f"{where}: routing.kind must be a string, got {rec['routing']['kind']!r}")
    return rec


def read_jsonl(path) -> tuple[list[dict], list[str]]:
    """(records, warnings) of one results file. Blank lines are ignored; an unparsable *last* line is a
    truncated write and is skipped with a warning; anything else malformed raises ResultsError."""
    path = Path(path)
    if not path.exists():
        raise ResultsError(f"{path}: no such results file")
    if not path.is_file():
        raise ResultsError(f"{path}: not a file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ResultsError(f"{path}:{line}: not UTF-8 text ({err.reason})") from None
    lines = text.split("\n")
    numbered = [i for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ResultsError(f"{path}: empty results file (no records)")
    records, notes = [], []
    for i in numbered:
        where = f"{path}:{i + 1}"
        try:
            obj = json.loads(lines[i])
        except ValueError as err:  # not JSON, or an integer of over 4300 digits
            if not isinstance(err, json.JSONDecodeError):
                raise ResultsError(f"{where}: not valid JSON ({err})") from None
            if i == numbered[-1]:
                notes.append(f"{where}: skipped a truncated last line ({err.msg}; an interrupted write?)")
                continue
            preview = lines[i].strip()
            preview = preview[:60] + ("…" if len(preview) > 60 else "")
            raise ResultsError(f"{where}: not valid JSON ({err.msg}, column {err.colno}): {preview}") from None
        records.append(check_record(obj, where))
    if not records:
        raise ResultsError(f"{path}: no complete records (its only line is truncated)")
    return records, notes


def load_records(paths: Sequence, notes: list[str] | None = None, counts: dict | None = None) -> list[dict]:
    """Records of every file, in order, one per (study, key) (a later duplicate replaces the earlier one).
    Warnings go to ``notes`` when given, else through ``warnings.warn``; ``counts`` (when given) receives
    the number of complete records per file."""
    if not paths:
        raise ResultsError("no results files given")
    out: dict = {}
    dup = 0
    for p in paths:
        recs, msgs = read_jsonl(p)
        if counts is not None:
            counts[str(p)] = counts.get(str(p), 0) + len(recs)
        for m in msgs:
            notes.append(m) if notes is not None else warnings.warn(m, stacklevel=2)
        for j, r in enumerate(recs):
            ident = (r.get("study"), r["key"]) if r.get("key") is not None else (str(p), j)
            dup += ident in out
            out.pop(ident, None)
            out[ident] = r
    if dup:
        msg = f"{dup} duplicate record(s) (same study and key) replaced by the later one"
        notes.append(msg) if notes is not None else warnings.warn(msg, stacklevel=2)
    for msg in mixed_budgets(list(out.values())):
        notes.append(msg) if notes is not None else warnings.warn(msg, stacklevel=2)
    return list(out.values())


def mixed_budgets(records: Sequence[dict]) -> list[str]:
    """Notes for WikiText records of one study, model and task scored over different numbers of tokens (a
    quick run and a longer one into the same ``--out``): the panels average and compare them as one run."""
    budgets: dict = {}
    for r in records:
        metrics = r.get("metrics") if isinstance(r.get("metrics"), dict) else {}
        n = metrics.get("predicted_tokens")
        if r.get("task") == "wikitext" and isinstance(n, int):
            budgets.setdefault((r.get("study"), r.get("model"), r.get("task")), set()).add(n)
    return [f"{study or 'sweep'} / {model}: records scored over different token counts "
            f"({', '.join(map(str, sorted(ns)))}) are averaged and compared as one run; keep each budget in its "
            "own results file" for (study, model, _), ns in sorted(budgets.items(), key=str) if len(ns) > 1]


def group_name(r: dict) -> str:
    if r.get("study"):
        return str(r["study"])
    params = ",".join(sorted((r.get("sweep") or {}).keys())) or "single points"
    return f"sweep {r.get('task') or 'unknown task'} ({params})"


def group_records(records: Sequence[dict]) -> dict[str, list[dict]]:
    """Known studies in STUDY_ORDER, then the others (unknown studies, plain sweeps) by name."""
    groups = group_by(records, group_name)
    order = [s for s in STUDY_ORDER if s in groups] + sorted(g for g in groups if g not in STUDY_ORDER)
    return {g: groups[g] for g in order}


# ------------------------------------------------------------------------------------------ columns


def fmt_bytes(x) -> str:
    x = num(x)
    if x is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return "–"


def routing_options(r: dict) -> str:
    """Routing settings other than the kind and its swept parameter: "J=2, Δ=1.3, bound=belady"."""
    main, _ = policy_param(r)
    parts = []
    for k, v in routing_of(r).items():
        if k in ("kind", main) or v is None:
            continue
        parts.append(f"{rec.PARAM_SYMBOL.get(k, k)}={fmt_value(v)}")
    return ", ".join(parts) or "–"


def _lifetime(r: dict) -> str:
    life, std = num(r.get("lifetime")), num(r.get("lifetime_std"))
    if life is None:
        return "–"
    return f"{life:.1f} ± {std:.1f}" if std is not None else f"{life:.1f}"


def _collisions(r: dict) -> str:
    c = r.get("collision_misses")
    if c is None:
        c = (r.get("metrics") or {}).get("collision_misses")
    rate = rec.collision_rate(r)
    if c is None and rate is None:
        return "–"
    return " ".join(x for x in (None if c is None else str(int(c)), None if rate is None else f"({fmt_pct(rate)})") if x)


def _prefetch(r: dict) -> str:
    p, rec = num(r.get("prefetch_precision")), num(r.get("prefetch_recall"))
    if p is None and rec is None:
        return "–"
    return f"{fmt_pct(p, 1)} / {fmt_pct(rec, 1)}"


COLUMNS: dict[str, tuple[Callable[[dict], Any], str]] = {
    "model": (lambda r: r.get("model") or "–", "l"),
    "task": (lambda r: r.get("task") or "–", "l"),
    "routing": (lambda r: routing_label(r), "l"),
    "method": (lambda r: r.get("method") or "–", "l"),
    "routing options": (routing_options, "l"),
    "C": (lambda r: "–" if capacity_of(r) is None else capacity_of(r), "r"),
    "size": (lambda r: cache_of(r).get("size", "–") if r.get("cache") else "–", "r"),
    "scope": (lambda r: cache_of(r).get("scope") or "–", "l"),
    "eviction": (lambda r: eviction_of(r) if r.get("cache") else "–", "l"),
    "init": (lambda r: "–" if not r.get("cache") else rec.init_label(r)
             + (f" (seed {cache_of(r)['seed']})" if rec.init_label(r) == "random" and cache_of(r).get("seed") is not None
                else ""), "l"),
    "sweep": (lambda r: ", ".join(f"{k}={fmt_value(v)}" for k, v in (r.get("sweep") or {}).items()) or "–", "l"),
    "ppl": (lambda r: fmt_num(r.get("ppl")), "r"),
    "accuracy": (lambda r: fmt_pct(r.get("accuracy"), 1), "r"),
    "miss rate": (lambda r: fmt_pct(r.get("miss_rate")), "r"),
    "collision misses": (_collisions, "r"),
    "lifetime": (_lifetime, "r"),
    "bytes/token": (lambda r: fmt_bytes(r.get("bytes_per_token")), "r"),
    "prefetch P / R": (_prefetch, "r"),
    "time (s)": (lambda r: fmt_num(r.get("time_s"), 1), "r"),
}


def records_table(records: Sequence[dict], columns: Sequence[str], extra: dict | None = None,
                  keep_empty: Sequence[str] = ()) -> str:
    """A markdown table of ``records`` (already sorted) with the named COLUMNS (plus ``extra`` {name:
    (getter, align)}); columns that are empty ("–") for every record are dropped, and so are the model and
    task columns when every record has the same one (the section header names it)."""
    cat = dict(COLUMNS, **(extra or {}))
    cells = {c: [str(cat[c][0](r)) for r in records] for c in columns}
    cols = [c for c in columns if c in keep_empty or (any(v not in ("–", "") for v in cells[c])
                                                      and not (c in ("model", "task") and len(set(cells[c])) == 1))]
    rows = [[cells[c][i] for c in cols] for i in range(len(records))]
    return md_table(cols, rows, [cat[c][1] for c in cols])


def fold(table: str, n_rows: int, summary: str) -> str:
    if n_rows <= DETAILS_ROWS:
        return table
    return f"<details><summary>{summary} ({n_rows} rows)</summary>\n\n{table}\n\n</details>"


def _param_sort(r: dict):
    return rec._sort_value(policy_param(r)[1])


def sort_records(records: Sequence[dict], study: str) -> list[dict]:
    base = lambda r: (str(r.get("model")), str(r.get("task")))  # noqa: E731
    if study == "eviction":
        key = lambda r: (base(r), rec._sort_value(capacity_of(r)), rec.eviction_rank(eviction_of(r)),  # noqa: E731
                         kind_rank(kind_of(r)), _param_sort(r), json.dumps(cache_of(r), sort_keys=True))
    elif study == "init":
        key = lambda r: (base(r), kind_rank(kind_of(r)), _param_sort(r), str(cache_of(r).get("init")),  # noqa: E731
                         rec._sort_value(capacity_of(r)), r.get("key") or "")
    elif study == "delta":
        key = lambda r: (base(r), kind_rank(kind_of(r)), rec.delta_label(r), _param_sort(r))  # noqa: E731
    elif study == "sensitivity":
        key = lambda r: (base(r), kind_rank(kind_of(r)), rec._sort_value(rec._rank_k(r)), r.get("key") or "")  # noqa: E731
    else:
        key = lambda r: (base(r), rec._sort_value(capacity_of(r)), is_belady(r), kind_rank(kind_of(r)),  # noqa: E731
                         _param_sort(r), json.dumps(r.get("sweep") or {}, sort_keys=True))
    return sorted(records, key=key)


# ------------------------------------------------------------------------------------------ sections


STUDIES: dict[str, dict] = {
    "pareto": dict(
        title="Perplexity vs miss rate: Pareto fronts (paper figures 4 and 14)",
        intro="WikiText perplexity against cache miss rate for every routing policy's sweep, one panel per cache "
              "size; lines join each policy's Pareto-optimal points, the star is original routing with LRU and the "
              "dashed line the Belady (optimal eviction) bound. Paper: cache-prior Pareto-dominates pruning, "
              "max-rank and cumsum at C = N/2 and N/4, e.g. Qwen1.5-MoE halves its LRU miss rate at +0.5 % perplexity.",
        plot=plots.pareto, headline=headline_pareto,
        columns=["model", "task", "C", "routing", "routing options", "eviction", "method", "ppl", "Δppl", "miss rate",
                 "lifetime", "bytes/token"],
        front="ppl"),
    "cache_size": dict(
        title="Cache-size ablation (paper figure 10)",
        intro="Miss rate against cache size C for original routing with LRU, the Belady bound, and cache-prior at "
              "the λ with the fewest misses whose perplexity stays within +1 / +5 / +10 % of original routing. "
              "Paper: with +1 % perplexity cache-prior beats the Belady bound at every size for all models but "
              "Phi-3.5-MoE; with +5 % for all.",
        plot=plots.cache_size, headline=headline_cache_size,
        columns=["model", "task", "C", "routing", "routing options", "eviction", "method", "sweep", "ppl", "Δppl",
                 "miss rate", "lifetime"]),
    "lifetimes": dict(
        title="Cache lifetimes and miss rates (paper table 2)",
        intro="Mean tokens an expert stays resident from load to eviction (± std) and the miss rate, original "
              "routing vs cache-prior. Paper: cache-prior keeps experts 2–9× longer (e.g. Qwen1.5-MoE 26 → 58 "
              "tokens, miss rate 35 % → 16 % at λ = 0.5).",
        plot=None, headline=headline_lifetimes, table=rec.lifetimes_table),
    "sensitivity": dict(
        title="Expert-rank sensitivity (paper figure 2)",
        intro="Perplexity when every expert ranked ≥ k is dropped (left) and when the rank-k expert is replaced "
              "by a random one (right). Paper: the top-1 expert is critical for all models; granular models "
              "(many small experts, larger K) tolerate swaps from rank 3 on.",
        plot=plots.sensitivity, headline=headline_sensitivity,
        columns=["model", "task", "routing", "routing options", "sweep", "ppl", "Δppl", "miss rate"]),
    "init": dict(
        title="Initial cache state: empty vs random (paper appendix G)",
        intro="Miss rate and perplexity with the cache starting empty or filled with random experts. Paper: the "
              "initial content does not lock cache-prior onto the same experts; the cache turns over within a "
              "few tokens.",
        plot=plots.init, headline=headline_init,
        columns=["model", "task", "C", "routing", "routing options", "init", "cache options", "ppl",
                 "miss rate", "first-token miss rates", "lifetime"]),
    "delta": dict(
        title="Logit range Δ: running mean vs calibrated (paper appendix D, figure 15)",
        intro="Cache-prior with Δavg as a running mean over the tokens seen so far against a fixed Δ calibrated "
              "beforehand. Paper: the running average performs comparably to the calibrated estimate.",
        plot=plots.delta, headline=headline_delta,
        columns=["model", "task", "C", "routing", "Δ estimate", "routing options", "ppl", "Δppl", "miss rate"]),
    "eviction": dict(
        title="Eviction policies and collision misses (SpecMD figure 4)",
        intro="Miss rate (gray) and collision misses (red: misses on an expert evicted earlier in the same "
              "forward pass) per eviction policy and pool size; prefetch precision/recall where measured. "
              "SpecMD (5 % capacity): Least-Stale 1.6–1.9 % collision rate, LRU 4.5–12.6 %, score-based 43–61 %.",
        plot=plots.eviction, headline=headline_eviction,
        columns=["model", "task", "scope", "size", "C", "eviction", "routing", "cache options", "sweep", "method",
                 "miss rate", "collision misses", "prefetch P / R", "lifetime", "bytes/token", "ppl"]),
    "tasks": dict(
        title="Task accuracy vs miss rate (paper figures 5 and 6)",
        intro="Accuracy against miss rate per task (MMLU 5-shot, GSM8K 8-shot chain-of-thought, ...), one line "
              "per routing policy through its Pareto front. Paper: cache-prior often cuts misses substantially "
              "with no accuracy loss; GSM8K is noisier.",
        plot=plots.tasks, headline=headline_tasks,
        columns=["model", "task", "C", "routing", "routing options", "accuracy", "miss rate", "lifetime"],
        front="accuracy"),
}
GENERIC_COLUMNS = ["model", "task", "routing", "routing options", "C", "size", "scope", "eviction", "init",
                   "cache options", "sweep", "method", "ppl", "accuracy", "miss rate", "collision misses", "lifetime",
                   "bytes/token", "prefetch P / R", "time (s)"]


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "group"


def _extra_columns(records: Sequence[dict]) -> dict:
    def source(r):  # a record is compared with its own model's and task's original routing, never another's
        return r.get("model"), r.get("task")

    groups: dict = {}
    for r in records:
        groups.setdefault(source(r), []).append(r)
    ref = {s: rec.reference_ppl(rs) for s, rs in groups.items()}
    by_cap = {(s, c): rec.reference_ppl(rs, c) for s, rs in groups.items() for c in {capacity_of(r) for r in rs}}

    def dppl(r):
        base = by_cap.get((source(r), capacity_of(r))) or ref.get(source(r))
        return _rel(r.get("ppl"), base) if base else "–"

    varying = rec.varying_cache_options(records)

    def early(r):
        pts = rec.first_token_miss_rates(r)
        return " / ".join(f"{fmt_pct(v, 1)} ({n})" for n, v in pts) if pts else "–"

    return {"Δppl": (dppl, "r"), "Δ estimate": (lambda r: rec.delta_label(r), "l"),
            "cache options": (lambda r: rec.cache_options_text(r, varying) or "–", "l"),
            "first-token miss rates": (early, "r")}


def _metric_columns(records: Sequence[dict]) -> dict:
    """Generic tables: scalar entries of ``metrics`` the fixed columns do not already show."""
    shown = {"accesses", "misses", "n_experts", "experts_per_token", "collision_misses"}
    names = []
    for r in records:
        for k, v in (r.get("metrics") or {}).items():
            if k not in names and k not in shown and k not in NUMBER_FIELDS and (num(v) is not None or isinstance(v, str)):
                names.append(k)
    return {f"metrics.{k}": ((lambda r, k=k: fmt_value(num((r.get("metrics") or {}).get(k)))
                              if num((r.get("metrics") or {}).get(k)) is not None
                              else str((r.get("metrics") or {}).get(k) or "–")), "r") for k in names[:8]}


def _figure_md(paths: Sequence[Path], out_dir: Path, title: str) -> str:
    png = next(p for p in paths if p.suffix == ".png")
    svg = next((p for p in paths if p.suffix == ".svg"), None)
    rel = lambda p: Path(os.path.relpath(p, out_dir)).as_posix()  # noqa: E731
    text = f"![{title}]({rel(png)})"
    if svg is not None:
        text += f"\n\n([SVG]({rel(svg)}))"
    return text


def section_plot(name: str, records: Sequence[dict]) -> Callable | None:
    """The plot of a group's section: its study's, or for a group no study describes a trade-off plot when
    every record has a miss rate and some have perplexity or accuracy; None for a section without a figure."""
    if name in STUDIES:
        return STUDIES[name].get("plot")
    if not all(num(r.get("miss_rate")) is not None for r in records):
        return None
    if any(num(r.get("ppl")) is not None for r in records):
        return plots.pareto
    if any(num(r.get("accuracy")) is not None for r in records):
        return plots.tasks
    return None


def heatmap_stem(fig_dir: Path, layer: int) -> Path:
    return fig_dir / f"heatmap_layer{layer}"


def render_section(name: str, records: list[dict], fig_dir: Path | None, out_dir: Path) -> str:
    spec = STUDIES.get(name)
    records = sort_records(records, name)
    models = sorted({str(r.get("model")) for r in records})
    tasks = sorted({str(r.get("task")) for r in records})
    parts = []
    plot = section_plot(name, records)
    if spec is None:
        what = "plain sweep" if name.startswith("sweep ") else "study"
        parts.append(f"## {name}\n")
        parts.append(f"A {what} this report has no dedicated section for: {_plural(len(records), 'record')} "
                     f"(model {', '.join(models)}; task {', '.join(tasks)}).\n")
    else:
        parts.append(f"## {spec['title']}\n")
        parts.append(f"{spec['intro']}\n")
        parts.append(f"{_plural(len(records), 'record')} · model {', '.join(models)} · task {', '.join(tasks)} · "
                     f"study `{name}`.\n")
        try:
            head = spec["headline"](records)
        except PlotError as err:
            head = f"(no headline: {err})"
        if head.strip():
            parts.append("### Headline\n")
            parts.append(head.strip() + "\n")
    if plot is not None and fig_dir is not None:
        try:
            paths = plot(records, fig_dir / slug(name))
            parts.append(_figure_md(paths, out_dir, spec["title"] if spec else name) + "\n")
        except PlotError as err:
            parts.append(f"(no figure: {err})\n")
    extra = dict(_extra_columns(records), **_metric_columns(records))
    if spec is not None and spec.get("table") is not None:
        parts.append("### Points\n")
        parts.append(spec["table"](records) + "\n")
    else:
        columns = spec["columns"] if spec else GENERIC_COLUMNS + [c for c in extra if c.startswith("metrics.")]
        table = records_table(records, columns, extra)
        if spec is not None and spec.get("front"):
            front = pareto_front_records(records, spec["front"])
            parts.append("### Pareto-optimal points\n")
            parts.append(records_table(front, columns, extra) + "\n")
            if len(records) <= DETAILS_ROWS:
                parts.append("### All points\n")
            parts.append(fold(table, len(records), "All points") + "\n")
        else:
            parts.append("### Points\n")
            parts.append(fold(table, len(records), "All points") + "\n")
    return "\n".join(parts)


def render_heatmap_section(traces: Sequence[tuple[str, str | None]], layer: int, cache_size: str, eviction: str,
                           max_tokens: int, fig_dir: Path, out_dir: Path, note: str | None = None) -> str:
    labels = [label or Path(path).stem for path, label in traces]
    paths = heatmap.trace_heatmap([p for p, _ in traces], layer, cache_size, heatmap_stem(fig_dir, layer),
                                eviction, max_tokens, labels=labels)
    return "\n".join([
        "## Routing trace heat map (paper figure 7)\n",
        f"Tokens (x) × experts (y) of MoE layer {layer}, cache size {cache_size}, {heatmap._eviction_name(eviction)} "
        f"eviction, reconstructed by replaying each recorded trace through `moejax.experts.cache`: green "
        "= cache hit, red = miss, blue = resident but unused. Paper (Phi-3.5-MoE, GSM8K): original routing ~23 % "
        "misses, cache-prior λ = 0.5 ~15 %, with visibly longer residencies.\n",
        "Traces: " + ", ".join(f"`{Path(os.path.relpath(p, out_dir)).as_posix()}` ({lab})"
                               for (p, _), lab in zip(traces, labels)) + ".\n",
        *([note.strip() + "\n"] if note else []),
        _figure_md(paths, out_dir, "routing trace heat map") + "\n"])


def check_traces(traces: Sequence[tuple[str, str | None]], fig_dir: Path | None, layer: int, cache_size: str,
                 tokens: int) -> None:
    """Refuse the --trace options and unreadable traces before any figure is written."""
    if not traces:
        return
    if fig_dir is None:
        raise ValueError("--trace needs a figures folder (drop --no-figures)")
    if tokens < 1:
        raise ValueError(f"--trace-tokens must be >= 1, got {tokens}")
    heatmap.check_heatmap([p for p, _ in traces], layer, cache_size, flags=("--trace-layer", "--trace-cache-size"))


def build_report(paths: Sequence, out: Path, fig_dir: Path | None, traces: Sequence[tuple[str, str | None]] = (),
                 trace_layer: int = 0, trace_cache_size: str = "0.5", trace_eviction: str = "lru",
                 trace_tokens: int = 200, command: str | None = None, trace_note: str | None = None,
                 overwrite: bool = False) -> str:
    """The report's text; its figures are written into ``fig_dir`` (marked ``FIGURE_MARK``). A figure file in
    the way that a report did not write is refused (``check_figures``) before any is drawn, unless ``overwrite``."""
    check_traces(traces, fig_dir, trace_layer, trace_cache_size, trace_tokens)
    notes: list[str] = []
    per_file: dict = {}
    records = load_records(paths, notes, per_file)
    if fig_dir is not None:
        check_figures(figure_targets(records, fig_dir, traces, trace_layer), overwrite,
                      [*map(str, paths), *(p for p, _ in traces)])
    token = rec.N_EXPERTS_HINT.set(n_experts_of(records))  # N for sections that cannot tell it themselves
    try:
        with plots.marking(FIGURE_MARK):
            return _build(records, notes, per_file, out, fig_dir, traces, trace_layer, trace_cache_size,
                          trace_eviction, trace_tokens, command, trace_note)
    finally:
        rec.N_EXPERTS_HINT.reset(token)


FIGURE_MARK = "moejax.report"  # in every figure a report writes: PNG "Software", SVG creator


def figure_targets(records: Sequence[dict], fig_dir: Path, traces: Sequence = (), trace_layer: int = 0) -> list[Path]:
    """Every file the report's figures may be written to: each section's plot and the trace heat map."""
    stems = [fig_dir / slug(name) for name, rs in group_records(records).items() if section_plot(name, rs)]
    stems += [heatmap_stem(fig_dir, trace_layer)] if traces else []
    return [path for stem in stems for path in plots.figure_paths(stem, "--figures")]


def check_figures(targets: Sequence[Path], overwrite: bool, inputs: Sequence[str] = ()) -> None:
    """A figure may replace a figure an earlier report wrote (it carries FIGURE_MARK), anything else only with
    ``overwrite``: its name is fixed, not one the user chose, so a file of that name is the user's own. Never a
    folder, a device or one of the report's inputs."""
    for path in targets:
        if not os.path.lexists(path):
            continue
        if _is_input(path, inputs):
            raise errors.UsageError(f"--figures {path} is one of the report's inputs: choose another --figures folder")
        if os.path.isdir(path) or (os.path.exists(path) and not os.path.isfile(path)):
            raise errors.UsageError(f"--figures {path} exists and is not a regular file: refusing to replace it")
        if not overwrite and plots.figure_mark(path) != FIGURE_MARK:
            raise errors.UsageError(f"--figures {path} exists and is not a figure of a moejax report: refusing to "
                                    "replace it (pass --overwrite to replace it)")


def _is_input(path, inputs: Sequence[str]) -> bool:
    real = os.path.realpath(path)
    return any(os.path.realpath(p) == real for p in inputs)


def _build(records, notes, per_file, out, fig_dir, traces, trace_layer, trace_cache_size, trace_eviction,
           trace_tokens, command, trace_note) -> str:
    out_dir = out.parent
    groups = group_records(records)
    lines = [REPORT_HEADING, ""]
    if command:
        lines += ["Generated by", "", "```sh", command, "```", ""]
    lines.append(md_table(["results file", "records"], [[f"`{p}`", n] for p, n in per_file.items()], ["l", "r"]))
    lines.append("")
    lines.append(f"{len(records)} distinct records in {len(groups)} group(s): "
                 + ", ".join(f"[{g}](#{_anchor(STUDIES[g]['title'] if g in STUDIES else g)}) ({len(rs)})"
                             for g, rs in groups.items()) + ".")
    lines.append("")
    if notes:
        lines += ["Warnings:", ""] + [f"- {n}" for n in notes] + [""]
    for name, rs in groups.items():
        lines.append(render_section(name, rs, fig_dir, out_dir))
    if traces:
        lines.append(render_heatmap_section(traces, trace_layer, trace_cache_size, trace_eviction, trace_tokens,
                                            fig_dir, out_dir, trace_note))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip() + "\n"  # no runs of blank lines


def _anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _parse_trace(spec: str) -> tuple[str, str | None]:
    path, sep, label = spec.partition("=")
    return path, (label or None) if sep else None


REPORT_HEADING = "# moejax study report"


def check_report_target(out: Path, inputs: Sequence[str], overwrite: bool = False) -> None:
    """The report may replace an earlier report, another file only with ``overwrite``; never one of its inputs
    or a folder."""
    real = os.path.realpath(out)
    for path in inputs:
        if os.path.realpath(path) == real:
            raise errors.UsageError(f"--out {out} is one of the report's inputs ({path}): choose another path")
    if os.path.isdir(out):
        raise IsADirectoryError(f"--out {out} is a folder; give a file name")
    if os.path.exists(out) and not os.path.isfile(out):
        raise errors.UsageError(f"--out {out} exists and is not a regular file: refusing to replace it")
    if os.path.lexists(out) and not overwrite:
        try:
            with open(out, "rb") as f:
                head = f.read(len(REPORT_HEADING))
        except OSError as e:
            raise errors.UsageError(f"--out {out}: {e.strerror}") from None
        if head != REPORT_HEADING.encode():
            raise errors.UsageError(f"--out {out} exists and is not a moejax report: refusing to replace it "
                                    "(pass --overwrite to replace it, or choose another path)")


def main(argv: list[str] | None = None) -> int:
    interrupts.exit_cleanly_on_signals()
    errors.plain_warnings()
    p = argparse.ArgumentParser(prog=commands.prog("report"), description=__doc__.split("\n\n")[0],
                                     formatter_class=commands.HelpFormatter)
    p.add_argument("results", nargs="+", metavar="RESULTS.jsonl")
    p.add_argument("--out", default=None, help="report path (default: REPORT.md beside the first results file)")
    p.add_argument("--figures", default=None, help="figure folder (default: figures/ beside the report)")
    p.add_argument("--no-figures", action="store_true", help="tables only")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out that is not a moejax report, and files in the figure folder named like "
                        "the report's figures that an earlier report did not write")
    p.add_argument("--trace", action="append", default=[], metavar="TRACE.npz[=LABEL]",
                   help="add the figure-7 heat map of this routing trace (repeat for stacked panels)")
    p.add_argument("--trace-layer", type=int, default=0)
    p.add_argument("--trace-cache-size", default="0.5", help="count or fraction of N for the heat map replay")
    p.add_argument("--trace-eviction", default="lru", choices=("lru", "lfu", "fld", "score", "least-stale", "belady"))
    p.add_argument("--trace-tokens", type=int, default=200, help="tokens shown in the heat map")
    p.add_argument("--trace-note", default=None, help="text for the heat-map section (e.g. how the traces were made; default: "
                        "none)")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else Path(args.results[0]).parent / "REPORT.md"
    fig_dir = None if args.no_figures else (Path(args.figures) if args.figures else out.parent / "figures")
    command = shlex.join(["python", "-m", "moejax.report", *(argv if argv is not None else sys.argv[1:])])
    try:
        check_report_target(out, [*args.results, *(_parse_trace(t)[0] for t in args.trace)], args.overwrite)
        if fig_dir is not None and fig_dir.exists() and not fig_dir.is_dir():
            raise errors.UsageError(f"--figures {fig_dir} is a file, not a folder")
        with atomic.together():  # the report and its figures change as one set, or not at all
            text = build_report(args.results, out, fig_dir, [_parse_trace(t) for t in args.trace],
                                args.trace_layer, args.trace_cache_size, args.trace_eviction, args.trace_tokens,
                                command, args.trace_note, args.overwrite)
            atomic.write_text(out, text, make_parents=True)
    except errors.HANDLED as err:
        return errors.report(err)
    return errors.print_result(f"wrote {out}" + (f" (figures in {fig_dir})" if fig_dir else ""))


if __name__ == "__main__":
    sys.exit(main())
