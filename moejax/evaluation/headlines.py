"""The headline of each study's report section: the comparison the paper draws, computed from the records
(lowest miss rate within a perplexity bound per policy, against LRU and the Belady bound; lifetimes; rank
sensitivity; initial cache; Δ; eviction and collision misses; task accuracy)."""

from __future__ import annotations

from typing import Sequence

from moejax.evaluation import plots, records as rec
from moejax.evaluation.records import (cache_of, capacity_of, eviction_of, fmt_num, fmt_pct, fmt_value,
                                       group_by, is_belady, kind_of, kind_rank, md_table, n_experts_of, num,
                                       policy_param, routing_label, routing_of)



def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _rel(value, ref) -> str:
    value, ref = num(value), num(ref)
    if value is None or not ref:
        return "–"
    return f"{100 * (value / ref - 1):+.1f}%"


def _param_text(r: dict) -> str:
    if kind_of(r) == "original":
        return "original routing"
    name, value = policy_param(r)
    return "" if name is None else f"{rec.PARAM_SYMBOL.get(name, name)}={fmt_value(value)}"


def _panels(records: Sequence[dict]) -> list[tuple[tuple, list[dict]]]:
    g = group_by(records, lambda r: (r.get("model"), r.get("task"), capacity_of(r)))
    return sorted(g.items(), key=lambda kv: tuple(rec._sort_value(v) for v in kv[0]))


def _panel_name(key: tuple, records: Sequence[dict], n: int | None) -> str:
    model, task, cap = key
    parts = []
    if len({r.get("model") for r in records}) > 1:
        parts.append(str(model))
    if len({r.get("task") for r in records}) > 1:
        parts.append(str(task))
    if cap is not None:
        frac = ""
        if n:
            frac = {n // 2: " = N/2", n // 4: " = N/4", n: " = N"}.get(cap, "") if n % 4 == 0 else ""
        parts.append(f"C = {cap}" + (f" / {n}" if n else "") + frac)
    return " · ".join(parts) or "all points"


def _originals(records: Sequence[dict], metric: str) -> list[dict]:
    """Original-routing records with a miss rate (``rec.original_records``), those with ``metric`` first."""
    orig = [r for r in rec.original_records(records) if num(r.get("miss_rate")) is not None]
    return sorted(orig, key=lambda r: num(r.get(metric)) is None)  # stable: keeps forward / LRU first


def headline_pareto(records: Sequence[dict], tolerances=rec.PPL_TOLERANCES) -> str:
    """Per cache size: original LRU and Belady miss rates, and per routing kind the lowest miss rate whose
    perplexity stays within +1/5/10 % of original routing, with the comparison for cache-prior spelled out."""
    n = n_experts_of(records)
    out = []
    for key, rs in _panels(records):
        ref = rec.reference_ppl(rs, key[2]) or rec.reference_ppl(records)
        orig = _originals(rs, "ppl")
        bel = [r for r in records if is_belady(r) and capacity_of(r) == key[2] and r.get("model") == key[0]
               and num(r.get("miss_rate")) is not None]
        lru_mr = num(orig[0]["miss_rate"]) if orig else None
        bel_mr = num(bel[0]["miss_rate"]) if bel else None
        line = f"**{_panel_name(key, records, n)}** — original routing"
        line += f" ({eviction_of(orig[0])}): miss rate {fmt_pct(lru_mr)}, perplexity {fmt_num(orig[0].get('ppl'))}" if orig \
            else ": no record"
        line += f"; Belady bound: miss rate {fmt_pct(bel_mr)}" + (f" ({_rel(bel_mr, lru_mr)} vs LRU)" if lru_mr else "") \
            if bel_mr is not None else "; no Belady record"
        out.append(line + ".")
        if ref is None:
            out.append("\n(no original-routing perplexity to measure perplexity budgets against)\n")
            continue
        kinds = sorted({kind_of(r) for r in rs if kind_of(r) != "original" and not is_belady(r)}, key=kind_rank)
        rows, best = [], {}
        for kind in kinds:
            cand = [r for r in rs if kind_of(r) == kind and not is_belady(r)]
            row = [kind]
            for t in tolerances:
                b = rec.best_within(cand, ref, t)
                best[(kind, t)] = b
                row.append("–" if b is None else f"{fmt_pct(b['miss_rate'])} ({_param_text(b)}, ppl {_rel(b['ppl'], ref)})")
            rows.append(row)
        if rows:
            out.append("")
            out.append(md_table(["routing"] + [f"lowest miss rate at ≤ +{t:.0%} ppl" for t in tolerances], rows,
                                ["l"] + ["r"] * len(tolerances)))
            out.append("")
        sentences = []
        for t in tolerances[:2]:
            b = best.get(("cache-prior", t))
            if b is None:
                continue
            s = f"cache-prior within +{t:.0%} perplexity: miss rate {fmt_pct(b['miss_rate'])} ({_param_text(b)})"
            if lru_mr:
                s += f", {_rel(b['miss_rate'], lru_mr)} vs original LRU"
            if bel_mr is not None:
                s += (", below the Belady bound" if b["miss_rate"] < bel_mr else ", not below the Belady bound") \
                    + f" ({fmt_pct(bel_mr)})"
            sentences.append(s)
        if sentences:
            out.append("- " + "\n- ".join(sentences))
        out.append("")
    return "\n".join(out)


def headline_cache_size(records: Sequence[dict]) -> str:
    """Figure 10 as a table: per cache size the LRU, Belady and cache-prior (+1/5/10 % ppl) miss rates, and
    how often cache-prior within +1 % / +5 % perplexity beats the Belady bound."""
    out = []
    for (model, task), rs in sorted(group_by(records, lambda r: (r.get("model"), r.get("task"))).items(),
                                    key=lambda kv: tuple(rec._sort_value(v) for v in kv[0])):
        series = rec.cache_size_series(rs)
        caps = sorted({c for pts in series.values() for c, *_ in pts})
        look = {name: {p[0]: p for p in pts} for name, pts in series.items()}
        names = list(series)
        rows = []
        for c in caps:
            row = [str(c)]
            for name in names:
                p = look[name].get(c)
                if p is None:
                    row.append("–")
                elif len(p) > 2:
                    row.append(f"{fmt_pct(p[1])} ({_param_text(p[2])})")
                else:
                    row.append(fmt_pct(p[1]))
            rows.append(row)
        if len({r.get("model") for r in records}) > 1 or len({r.get("task") for r in records}) > 1:
            out.append(f"**{model} · {task}**\n")
        heads = {"lru": "LRU (original routing)", "belady": "Belady"}
        out.append(md_table(["C"] + [heads.get(n, n.replace("cache-prior", "cache-prior at") + " ppl") for n in names],
                            rows, ["r"] * (1 + len(names))))
        bel = look["belady"]
        bullets = []
        for name in names[2:4]:
            pts = [(c, p[1]) for c, p in look[name].items() if c in bel and bel[c][1] > 0]
            if pts:
                wins = sum(mr < bel[c][1] for c, mr in pts)
                bullets.append(f"- {name.replace('cache-prior', 'cache-prior within')} perplexity is below the Belady "
                               f"bound at {wins} of {len(pts)} cache sizes with a non-zero bound.")
        sel = [r for r in rs if rec.is_selection(r)]
        if sel:
            bad = rec.selection_mismatches(rs, series)
            bullets.append(f"- the study's own {len(sel)} selection records (`method: selection`) agree with this "
                           "recomputation" if not bad else "- **the study's selection records disagree**: " + "; ".join(bad))
        if bullets:
            out.append("\n" + "\n".join(bullets))
        out.append("")
    return "\n".join(out)


def headline_lifetimes(records: Sequence[dict]) -> str:
    out = []
    for key, rs in _panels(records):
        orig = _originals(rs, "lifetime")
        for r in rs:
            if not orig or r is orig[0] or kind_of(r) == "original" or is_belady(r) or rec.is_selection(r):
                continue
            o = orig[0]
            lo, lr = num(o.get("lifetime")), num(r.get("lifetime"))
            ratio = f"{lr / lo:.1f}×" if lo and lr is not None else "–"
            out.append(f"- {_panel_name(key, records, n_experts_of(records))}: {routing_label(r)} keeps experts "
                       f"resident {ratio} as long as original routing ({fmt_num(lr, 1)} vs {fmt_num(lo, 1)} tokens); "
                       f"miss rate {fmt_pct(r.get('miss_rate'))} vs {fmt_pct(o.get('miss_rate'))}.")
    return "\n".join(out)


def headline_sensitivity(records: Sequence[dict]) -> str:
    base = rec.reference_ppl(records)
    drop_pts, repl_pts = rec.sensitivity_split(records)
    cols: list[tuple[str, dict]] = []
    for title, pts in (("drop experts ranked ≥ k", drop_pts), ("replace rank k by a random expert", repl_pts)):
        for kind, group in sorted(group_by(pts, kind_of).items(), key=lambda kv: kind_rank(kv[0])):
            by: dict = {}
            for r in group:
                by.setdefault(rec._rank_k(r), []).append(float(r["ppl"]))
            label = title if len({kind_of(r) for r in pts}) == 1 else f"{title} ({kind})"
            cols.append((label, by))
    ks = sorted({k for _, by in cols for k in by})
    if not ks:
        return ""

    def cell(vals):
        if not vals:
            return "–"
        v = sum(vals) / len(vals)
        return f"{v:.3f}" + (f" ({v / base:.2f}×)" if base else "") + (f", mean of {len(vals)}" if len(vals) > 1 else "")

    rows = [[fmt_value(int(k) if float(k).is_integer() else k)] + [cell(by.get(k)) for _, by in cols] for k in ks]
    head = f"Original routing perplexity: {fmt_num(base)}.\n\n" if base else ""
    return head + md_table(["k"] + [c for c, _ in cols], rows, ["r"] * (1 + len(cols)))


def headline_init(records: Sequence[dict]) -> str:
    out = []
    groups = group_by(records, lambda r: rec.init_group_label(r, records))
    for label, rs in sorted(groups.items(), key=lambda kv: (kind_rank(kv[0].split(" ")[0]), kv[0])):
        by = group_by(rs, rec.init_label)
        parts = []
        for ini in sorted(by, key=lambda s: (s != "empty", s)):
            mr = [num(r.get("miss_rate")) for r in by[ini] if num(r.get("miss_rate")) is not None]
            pp = [num(r.get("ppl")) for r in by[ini] if num(r.get("ppl")) is not None]
            txt = f"{ini}: miss rate {fmt_pct(sum(mr) / len(mr)) if mr else '–'}"
            if pp:
                txt += f", ppl {sum(pp) / len(pp):.3f}"
            if len(by[ini]) > 1:
                txt += f" (mean of {len(by[ini])})"
            parts.append(txt)
        out.append(f"- {label}: " + "; ".join(parts))
    return "\n".join(out)


def headline_delta(records: Sequence[dict], tolerances=rec.PPL_TOLERANCES[:2]) -> str:
    ref = rec.reference_ppl(records)
    if ref is None:
        return "(no original-routing or λ = 0 record to measure perplexity budgets against)"
    rows = []
    prior = [r for r in records if kind_of(r) != "original" and not is_belady(r)]
    for label, rs in sorted(group_by(prior, rec.delta_label).items()):
        row = [label]
        for t in tolerances:
            b = rec.best_within(rs, ref, t)
            row.append("–" if b is None else f"{fmt_pct(b['miss_rate'])} ({_param_text(b)})")
        half = [r for r in rs if num(routing_of(r).get("lam")) == 0.5]
        row.append("–" if not half else f"{fmt_pct(half[0].get('miss_rate'))}, ppl {fmt_num(half[0].get('ppl'))}")
        rows.append(row)
    return (f"Reference perplexity (original routing): {ref:.3f}.\n\n"
            + md_table(["Δ estimate"] + [f"lowest miss rate at ≤ +{t:.0%} ppl" for t in tolerances] + ["at λ = 0.5"],
                       rows, ["l"] + ["r"] * (len(tolerances) + 1)))


def headline_eviction(records: Sequence[dict]) -> str:
    out = []
    by_scope = group_by([r for r in records if r.get("cache") is not None], lambda r: str(cache_of(r).get("scope")))
    label = lambda r: rec.eviction_label(r, by_scope[str(cache_of(r).get("scope"))])  # noqa: E731
    for (scope, size), group in plots.eviction_panels(records):
        best = min(group, key=lambda r: r["miss_rate"])
        line = (f"- {rec._scope_name(scope)}, cache size {size[1]}"
                + (f" (C = {size[0]})" if size[0] is not None and str(size[0]) != size[1] else "")
                + f": lowest miss rate {label(best)} {fmt_pct(best['miss_rate'])}")
        worst = max(group, key=lambda r: r["miss_rate"])
        if worst is not best:
            line += f" (highest {label(worst)} {fmt_pct(worst['miss_rate'])})"
        known = {label(r): rec.collision_rate(r) for r in group if rec.collision_rate(r) is not None}
        if known and max(known.values()) > 0:
            lo, hi = min(known, key=known.get), max(known, key=known.get)
            line += f"; collision misses from {fmt_pct(known[lo])} ({lo}) to {fmt_pct(known[hi])} ({hi}) of accesses"
            ls, lru = known.get("least-stale"), known.get("lru")
            if ls is not None and lru is not None:
                line += f"; LRU/Least-Stale collision ratio {lru / ls:.1f}×" if ls > 0 else \
                    f"; Least-Stale has no collision misses (LRU {fmt_pct(lru)})"
        elif known:
            line += "; no collision misses"
        for r in sorted(group, key=label):
            if num(r.get("prefetch_precision")) is not None or num(r.get("prefetch_recall")) is not None:
                line += (f"; {label(r)}: precision {fmt_pct(r.get('prefetch_precision'), 1)}, recall "
                         f"{fmt_pct(r.get('prefetch_recall'), 1)}, miss rate {fmt_pct(r['miss_rate'])}")
        out.append(line + ".")
    return "\n".join(out)


def headline_tasks(records: Sequence[dict], tolerances=(0.0, 0.02)) -> str:
    out = []
    n = n_experts_of(records)
    for key, rs in _panels(records):
        orig = [r for r in _originals(rs, "accuracy") if num(r.get("accuracy")) is not None]
        if not orig:
            out.append(f"**{_panel_name(key, records, n)}** — no original-routing record.")
            continue
        o = orig[0]
        name = _panel_name(key, records, n)
        if str(key[1]) not in name.split(" · "):
            name = f"{key[1]} · {name}"
        how = "" if kind_of(o) == "original" else f" ({routing_label(o)})"
        out.append(f"**{name}** — original routing{how}: accuracy {fmt_pct(o['accuracy'], 1)}, miss rate "
                   f"{fmt_pct(o.get('miss_rate'))}; {_plural(len(rs), 'point')}.")
        rows = []
        for kind in sorted({kind_of(r) for r in rs if kind_of(r) != "original" and not is_belady(r)}, key=kind_rank):
            row = [kind]
            for t in tolerances:
                b = rec.best_within([r for r in rs if kind_of(r) == kind], o["accuracy"], t, "accuracy")
                row.append("–" if b is None else f"{fmt_pct(b['miss_rate'])} ({_param_text(b)}, acc {fmt_pct(b['accuracy'], 1)})")
            rows.append(row)
        if rows:
            out.append("")
            out.append(md_table(["routing"] + ["lowest miss rate, no accuracy loss" if t == 0 else
                                               f"lowest miss rate, accuracy ≥ original − {100 * t:.0f} pts"
                                               for t in tolerances], rows, ["l"] + ["r"] * len(tolerances)))
        out.append("")
    return "\n".join(out)


def pareto_front_records(records: Sequence[dict], metric: str = "ppl") -> list[dict]:
    """The records on each (panel, routing kind)'s Pareto front, in table order."""
    sign = -1.0 if metric == "accuracy" else 1.0
    keep = []
    for _, rs in _panels(records):
        for kind, group in group_by([r for r in rs if not is_belady(r)], kind_of).items():
            pts = [(num(r.get("miss_rate")), None if num(r.get(metric)) is None else sign * r[metric]) for r in group]
            keep += [group[i] for i in rec.pareto_indices(pts)]
    keep_ids = {id(r) for r in keep}
    return [r for r in records if id(r) in keep_ids or is_belady(r)]
