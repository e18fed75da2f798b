"""Plots and the study report: Pareto fronts, every study plot on synthetic records, the JSONL loader's
error handling, the figure-7 heat map classified cell by cell, and the report CLI end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moejax.evaluation import headlines, heatmap, plots, records as study_records, report
from moejax.evaluation.heatmap import HEAT_EMPTY as E, HEAT_HIT as H, HEAT_MISS as M, HEAT_RESIDENT as R

N, K = 8, 2


# ------------------------------------------------------------------------------------ synthetic records


def rec(study, kind="original", *, cap=4, eviction="lru", ppl=10.0, miss=0.4, task="wikitext", init="empty",
        lifetime=None, accuracy=None, sweep=None, key=None, **routing):
    r = {"key": key or f"{study}-{kind}-{cap}-{eviction}-{init}-{json.dumps(routing, sort_keys=True)}-{task}-{ppl}-{miss}",
         "study": study, "task": task, "model": "default",
         "routing": dict({"kind": kind, "lam": None, "top_j": None, "max_rank": None, "cumsum_p": None,
                          "prune_h": None, "delta": None}, **routing),
         "cache": None if cap is None else {"size": str(cap), "capacity": cap, "scope": "layer",
                                            "eviction": eviction, "init": init},
         "sweep": sweep or {}, "ppl": ppl, "accuracy": accuracy, "miss_rate": miss, "lifetime": lifetime,
         "lifetime_std": None if lifetime is None else lifetime / 2, "bytes_per_token": None if miss is None else 1000.0 * miss,
         "collision_misses": None, "prefetch_precision": None, "prefetch_recall": None,
         "metrics": {"n_experts": N, "experts_per_token": K}, "time_s": 1.5, "finished_at": "2025-01-01T00:00:00"}
    return r


def pareto_records():
    out = []
    for cap in (2, 4):
        base = 0.5 if cap == 2 else 0.35
        out.append(rec("pareto", cap=cap, ppl=10.0, miss=base))
        out.append(rec("pareto", cap=cap, eviction="belady", ppl=10.0, miss=base * 0.7))
        for i, lam in enumerate(np.linspace(0, 1, 6)):
            out.append(rec("pareto", "cache-prior", cap=cap, lam=float(lam), top_j=1, ppl=10.0 * (1 + 0.12 * lam ** 2),
                           miss=base * (1 - 0.7 * lam), sweep={"lam": float(lam)}))
            out.append(rec("pareto", "cumsum", cap=cap, cumsum_p=float(lam), top_j=1, ppl=10.0 * (1 + 0.2 * lam),
                           miss=base * (1 - 0.5 * lam) + 0.01 * (i % 2), sweep={"cumsum_p": float(lam)}))
        for m in range(0, K + 1):
            out.append(rec("pareto", "max-rank", cap=cap, max_rank=m, top_j=1, ppl=10.0 + 0.4 * m, miss=base - 0.05 * m))
        for h in (1, 2):
            # h = 1 is far off (+300 %): the plot clips it and says so
            out.append(rec("pareto", "pruning", cap=cap, prune_h=h, ppl=10.0 + 30.0 / h ** 2, miss=base * h / 2))
    return out


def cache_size_records():
    out = []
    for c in range(1, N + 1):
        lru = 0.6 * (1 - c / N)
        out.append(rec("cache_size", cap=c, miss=lru))
        out.append(rec("cache_size", cap=c, eviction="belady", miss=lru * 0.8))
        for lam in (0.0, 0.25, 0.5, 0.75):
            out.append(rec("cache_size", "cache-prior", cap=c, lam=lam, ppl=10.0 * (1 + 0.15 * lam * lam),
                           miss=lru * (1 - 0.6 * lam)))
    return out


def sensitivity_records():
    out = [rec("sensitivity", cap=None, ppl=10.0, miss=None)]
    for k in range(1, K + 1):
        out.append(rec("sensitivity", "pruning", cap=None, prune_h=k, ppl=10.0 * (3 - k), miss=None))
        for seed in (0, 1):
            out.append(rec("sensitivity", "random-replace", cap=None, random_rank=k, ppl=10.0 + 20 / k + seed,
                           miss=None, sweep={"random_rank": k, "seed": seed}))
    return out


def eviction_records():
    out = []
    for size, cap in (("1%", 1), ("5%", 3), ("25%", 12)):
        for i, ev in enumerate(("lru", "fld", "score", "least-stale")):
            r = rec("eviction", cap=cap, eviction=ev, ppl=None, miss=0.5 / (1 + cap) + 0.02 * i)
            r["cache"].update(size=size, scope="global")
            r["collision_misses"] = 10 * (4 - i)
            r["metrics"].update(accesses=2000, misses=int(2000 * r["miss_rate"]))
            out.append(r)
        p = rec("eviction", cap=cap, eviction="least-stale", ppl=None, miss=0.1)
        p["cache"].update(size=size, scope="global", prefetch="topk", overfetch=2)
        p.update(collision_misses=3, prefetch_precision=0.6, prefetch_recall=0.8)
        p["metrics"].update(accesses=2000)
        out.append(p)
    return out


def task_records():
    out = []
    for task, acc0 in (("mmlu", 0.30), ("gsm8k", 0.05)):
        out.append(rec("tasks", task=task, ppl=None, accuracy=acc0, miss=0.4))
        for lam in (0.2, 0.5, 0.8):
            out.append(rec("tasks", "cache-prior", task=task, lam=lam, ppl=None, accuracy=acc0 - 0.02 * lam,
                           miss=0.4 * (1 - lam / 2)))
            out.append(rec("tasks", "max-rank", task=task, max_rank=int(lam * 4), ppl=None,
                           accuracy=acc0 - 0.05 * lam, miss=0.4 * (1 - lam / 3)))
    return out


def lifetime_records():
    return [rec("lifetimes", cap=4, ppl=10.0, miss=0.35, lifetime=20.0),
            rec("lifetimes", "cache-prior", cap=4, lam=0.5, ppl=10.2, miss=0.15, lifetime=55.0)]


def init_records():
    out = []
    for label, kw in (("original", {}), ("cache-prior", {"lam": 0.5}), ("cache-prior", {"lam": 0.8})):
        out.append(rec("init", label, init="empty", ppl=10.0 + kw.get("lam", 0), miss=0.4 - kw.get("lam", 0) / 4, **kw))
        for seed in (0, 1):
            out.append(rec("init", label, init="random", ppl=10.01 + kw.get("lam", 0), miss=0.39 - kw.get("lam", 0) / 4
                           + 0.01 * seed, sweep={"seed": seed}, **kw))
    for r in out:  # the sweeps' metrics: miss rate over the first n tokens
        r["metrics"]["miss_rate_first_tokens"] = {"16": r["miss_rate"] + 0.2, "64": r["miss_rate"] + 0.1,
                                                  "256": r["miss_rate"]}
    return out


def delta_records():
    out = [rec("delta", ppl=10.0, miss=0.35)]
    for d in (None, 3.2):
        for lam in (0.0, 0.25, 0.5, 0.75, 1.0):
            out.append(rec("delta", "cache-prior", lam=lam, delta=d, ppl=10 * (1 + 0.1 * lam * lam) + (0.05 if d else 0),
                           miss=0.35 * (1 - 0.6 * lam)))
    return out


def all_records():
    return (pareto_records() + cache_size_records() + sensitivity_records() + eviction_records() + task_records()
            + lifetime_records() + init_records() + delta_records())


def write_jsonl(path: Path, records, tail: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


# ------------------------------------------------------------------------------------------ Pareto front


def test_pareto_front_hand_examples():
    assert study_records.pareto_front([]) == []
    assert study_records.pareto_front([(0.3, 10.0)]) == [(0.3, 10.0)]
    # (0.2, 11) and (0.1, 12) trade off against (0.3, 10); (0.3, 11) is dominated by (0.2, 11) and (0.3, 10)
    pts = [(0.3, 10.0), (0.2, 11.0), (0.3, 11.0), (0.1, 12.0), (0.25, 12.0)]
    assert study_records.pareto_front(pts) == [(0.1, 12.0), (0.2, 11.0), (0.3, 10.0)]
    assert study_records.pareto_indices(pts) == [3, 1, 0]
    # equal x: only the lower y survives; equal y: only the lower x; identical points both stay
    assert study_records.pareto_front([(0.1, 5.0), (0.1, 4.0)]) == [(0.1, 4.0)]
    assert study_records.pareto_front([(0.2, 4.0), (0.1, 4.0)]) == [(0.1, 4.0)]
    assert study_records.pareto_indices([(0.1, 4.0), (0.1, 4.0), (0.2, 5.0)]) == [0, 1]
    # missing or non-finite coordinates are never on the front and never dominate
    assert study_records.pareto_front([(None, 1.0), (0.5, float("nan")), (0.4, 9.0)]) == [(0.4, 9.0)]


def _dominates(q, p):
    return q[0] <= p[0] and q[1] <= p[1] and (q[0] < p[0] or q[1] < p[1])


coords = st.integers(0, 6).map(lambda v: v / 4)  # few distinct values: many ties and duplicates


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(coords, coords), max_size=25))
def test_pareto_front_property(points):
    front = study_records.pareto_indices(points)
    on = set(front)
    for i in front:  # nothing dominates a front point
        assert not any(_dominates(q, points[i]) for q in points)
    for i, p in enumerate(points):  # every dominated point is off the front, every other one on it
        assert (i in on) == (not any(_dominates(q, p) for q in points))
    xs = [points[i] for i in front]
    assert xs == sorted(xs)


def test_ppl_view_zoom():
    ref = 100.0
    assert plots.ppl_view([100.0, 100.5], ref) is None  # all within +1 %: no zoom needed
    # 9 of 10 points within +1 % (>= 85 %): zoom to +1 %, the far-off one is left out
    assert plots.ppl_view([100.0] * 9 + [230.0], ref) == 0.01
    # half within +1 %, all but one within +5 %: +5 %
    assert plots.ppl_view([100.0] * 5 + [104.0] * 4 + [150.0], ref) == 0.05
    # the tightest level that holds 85 % already holds everything: no clipping
    assert plots.ppl_view([100.0, 101.5, 101.8], ref) is None
    assert plots.ppl_view([100.0, 150.0, 190.0, 300.0], ref) == 0.30


def test_best_within_and_cache_size_series():
    rs = [rec("x", "cache-prior", lam=lam, ppl=p, miss=m)
          for lam, p, m in ((0.0, 10.0, 0.4), (0.3, 10.09, 0.3), (0.6, 10.4, 0.2), (0.9, 11.5, 0.1))]
    assert study_records.best_within(rs, 10.0, 0.01)["routing"]["lam"] == 0.3
    assert study_records.best_within(rs, 10.0, 0.05)["routing"]["lam"] == 0.6
    assert study_records.best_within(rs, 10.0, 0.20)["routing"]["lam"] == 0.9
    assert study_records.best_within(rs, 9.0, 0.01) is None
    acc = [dict(r, accuracy=a) for r, a in zip(rs, (0.5, 0.5, 0.47, 0.40))]
    assert study_records.best_within(acc, 0.5, 0.0, "accuracy")["routing"]["lam"] == 0.3
    assert study_records.best_within(acc, 0.5, 0.05, "accuracy")["routing"]["lam"] == 0.6
    series = study_records.cache_size_series(cache_size_records())
    assert [c for c, _ in series["lru"]] == list(range(1, N + 1))
    assert series["belady"][0] == (1, pytest.approx(0.6 * (1 - 1 / N) * 0.8))
    # ppl(λ) = 10·(1 + 0.15 λ²): +1 % allows λ = 0.25 (+0.94 %), +5 % λ = 0.5 (+3.75 %), +10 % λ = 0.75 (+8.4 %)
    # (at C = N every λ has no misses, and the tie goes to the lower perplexity, λ = 0)
    lams = {name: {p[2]["routing"]["lam"] for p in series[name] if p[0] < N} for name in series
            if name.startswith("cache")}
    assert {p[2]["routing"]["lam"] for p in series["cache-prior +5%"] if p[0] == N} == {0.0}
    assert lams == {"cache-prior +1%": {0.25}, "cache-prior +5%": {0.5}, "cache-prior +10%": {0.75}}


def test_sensitivity_hooks_count_as_their_own_kinds():
    # the sweeps record the sensitivity hooks as original routing plus drop_rank / random_rank
    base = rec("sensitivity", cap=None, ppl=10.0, miss=None)
    drop = rec("sensitivity", cap=None, ppl=30.0, miss=None, drop_rank=2)
    repl = rec("sensitivity", cap=None, ppl=40.0, miss=None, random_rank=1, seed=0)
    assert [study_records.kind_of(r) for r in (base, drop, repl)] == ["original", "drop", "random-replace"]
    assert study_records.sensitivity_split([base, drop, repl]) == ([drop], [repl])
    assert study_records.reference_ppl([drop, repl, base]) == 10.0  # the hooks are not "original routing"
    assert study_records.routing_label(drop) == "drop k=2" and study_records.policy_param(repl) == ("random_rank", 1)
    text = headlines.headline_sensitivity([base, drop, repl])
    assert "| 2 | 30.000 (3.00×) | – |" in text and "| 1 | – | 40.000 (4.00×) |" in text


def test_n_experts_and_top_k_inference():
    sized = lambda size, cap: {"cache": {"size": size, "capacity": cap, "scope": "layer"}}  # noqa: E731
    assert study_records.n_experts_of([sized("0.5", 16)]) == 32  # not 31, which also rounds to 16
    assert study_records.n_experts_of([sized("16", 16), sized("0.25", 8)]) == 32
    assert study_records.n_experts_of([sized("0.3", 10)]) is None  # ambiguous: no exact N
    assert study_records.n_experts_of([{"metrics": {"expert_usage": {"entropy_max_bits": 5.0}}}]) == 32
    assert study_records.n_experts_of([{"metrics": {"cache": {"n_experts": 60}}}]) == 60
    assert study_records.top_k_of([{"metrics": {"cache": {"tokens": 100, "per_layer": {"accesses": [400, 400]}}}}]) == 4
    assert study_records.top_k_of([{"metrics": {"experts_per_token": 2}}]) == 2
    token = study_records.N_EXPERTS_HINT.set(32)  # the report's fallback: N from all the files it reads
    try:
        assert study_records.n_experts_of([sized("16", 16)]) == 32
    finally:
        study_records.N_EXPERTS_HINT.reset(token)
    assert study_records.n_experts_of([sized("16", 16)]) is None


# ------------------------------------------------------------------------------------------ plots


def _check_written(paths, stem):
    assert [p.name for p in paths] == [f"{Path(stem).name}.png", f"{Path(stem).name}.svg"]
    png, svg = paths
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert b"<svg" in svg.read_bytes()[:2000] and svg.stat().st_size > 5000
    assert not list(png.parent.glob(".*.tmp"))  # atomic: no temporary left behind


@pytest.mark.parametrize("name,make", [
    ("pareto", pareto_records), ("cache_size", cache_size_records), ("sensitivity", sensitivity_records),
    ("eviction", eviction_records), ("tasks", task_records), ("init", init_records), ("delta", delta_records)])
def test_each_plot_writes_png_and_svg(tmp_path, name, make):
    stem = tmp_path / "figs" / name
    _check_written(getattr(plots, name)(make(), stem), stem)


def test_plots_refuse_records_without_data(tmp_path):
    empty = [rec("pareto", ppl=None, miss=None)]
    for fn in (plots.pareto, plots.tasks, plots.cache_size, plots.sensitivity, plots.delta, plots.eviction):
        with pytest.raises(plots.PlotError):
            fn(empty, tmp_path / "x")
    assert not list(tmp_path.iterdir())


def test_save_figure_replaces_atomically_and_writes_what_the_path_names(tmp_path):
    stem = tmp_path / "fig"  # a stem: STEM.png and STEM.svg
    first = plots.pareto(pareto_records(), stem)
    assert [p.name for p in first] == ["fig.png", "fig.svg"]
    before = first[1].read_bytes()
    second = plots.pareto(pareto_records()[:6], stem)
    assert second == first and second[1].read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png", "fig.svg"]
    assert [p.name for p in plots.pareto(pareto_records(), tmp_path / "one.pdf")] == ["one.pdf"]  # that file only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png", "fig.svg", "one.pdf"]


def test_svg_output_is_reproducible(tmp_path):
    a = plots.delta(delta_records(), tmp_path / "a")[1].read_bytes()
    b = plots.delta(delta_records(), tmp_path / "b")[1].read_bytes()
    assert a == b


def test_cache_size_selection_records_are_cross_checked():
    rs = cache_size_records()
    series = study_records.cache_size_series(rs)
    sel = []
    for name, bound in (("cache-prior +1%", 0.01), ("cache-prior +5%", 0.05)):
        for c, mr, best in series[name]:
            sel.append(dict(best, key=f"sel-{c}-{bound}", method="selection",
                            sweep={"cache_size": str(c), "ppl_bound": bound}))
    # selections are copies: they change neither the curves nor, when right, the headline's verdict
    assert study_records.cache_size_series(rs + sel) == series
    assert study_records.selection_mismatches(rs + sel) == []
    assert "agree with this recomputation" in headlines.headline_cache_size(rs + sel)
    sel[0] = dict(sel[0], miss_rate=0.99)
    assert study_records.selection_mismatches(rs + sel) == [
        "C = 1, +1%: study selected miss rate 0.9900, recomputed 0.4462"]
    assert "**the study's selection records disagree**" in headlines.headline_cache_size(rs + sel)


def test_original_routing_as_lambda_zero():
    # the tasks study runs original routing as cache-prior λ = 0 (bit for bit the same)
    rs = [r for r in task_records() if study_records.kind_of(r) != "original"]
    rs += [rec("tasks", "cache-prior", task=t, lam=0.0, ppl=None, accuracy=a, miss=0.4)
           for t, a in (("mmlu", 0.30), ("gsm8k", 0.05))]
    assert [study_records.routing_label(r) for r in study_records.original_records(rs)] == ["cache-prior λ=0"] * 2
    text = headlines.headline_tasks(rs)
    assert "**mmlu · C = 4 / 8 = N/2** — original routing (cache-prior λ=0): accuracy 30.0%, miss rate 40.00%" in text


def test_lifetimes_table_markdown():
    table = study_records.lifetimes_table(lifetime_records()).splitlines()
    assert table[0] == "| model | task | cache size | routing | eviction | lifetime (tokens) | miss rate |"
    assert table[2] == "| default | wikitext | 4 / 8 | original | lru | 20.0 (± 10.0) | 35.0% |"
    assert table[3] == "| default | wikitext | 4 / 8 | cache-prior λ=0.5 | lru | 55.0 (± 27.5) | 15.0% |"


def test_eviction_labels_show_only_distinguishing_options():
    rs = eviction_records()
    for r in rs:
        r["cache"]["miss"] = "fetch"  # the same everywhere: not part of any label
    labels = {study_records.eviction_label(r, rs) for r in rs}
    assert labels == {"lru", "fld", "score", "least-stale", "least-stale prefetch=topk overfetch=2"}


def test_collision_rate_from_counts():
    r = rec("eviction", miss=0.25)
    assert study_records.collision_rate(r) is None
    r["collision_misses"] = 50
    r["metrics"]["accesses"] = 1000
    assert study_records.collision_rate(r) == pytest.approx(0.05)
    del r["metrics"]["accesses"]
    r["metrics"]["misses"] = 250
    assert study_records.collision_rate(r) == pytest.approx(0.05)  # 50 / 250 of the 25 % miss rate


# ------------------------------------------------------------------------------------------ heat map


def test_heatmap_classification_by_hand(tmp_path):
    # N = 4 experts, K = 1, C = 2, LRU, one layer; a cell shows the residency *before* that token's access:
    # t0 uses 0 (miss, cache {0} after); t1 uses 1 (miss, {0,1}); t2 uses 0 (hit); t3 uses 2 (miss; 1 was
    # resident until now and is evicted as least recently used -> {0,2}); t4 uses 1 (miss; evicts 0 -> {2,1});
    # t5 uses 2 (hit)
    experts = np.array([0, 1, 0, 2, 1, 2], np.int32)[:, None, None]
    res = heatmap.classify_trace({"experts": experts, "n_experts": np.int64(4)}, 0, 2)
    expected = np.array([
        # t: 0  1  2  3  4  5
        [M, R, H, R, R, E],  # expert 0
        [E, M, R, R, M, R],  # expert 1
        [E, E, E, M, R, H],  # expert 2
        [E, E, E, E, E, E],  # expert 3
    ])
    np.testing.assert_array_equal(res["cells"], expected)
    assert res["misses"] == 4 and res["accesses"] == 6 and res["capacity"] == 2
    # K = 2, same-step order: the higher-weighted (first) expert counts as older; -1 = a dropped slot
    experts2 = np.array([[0, 1], [2, -1], [1, 3]], np.int32)[:, None, :]
    res2 = heatmap.classify_trace({"experts": experts2, "n_experts": np.int64(4)}, 0, "0.5")  # 0.5 of N = 2
    # t0: 0, 1 miss -> {0, 1}; t1: 2 miss, evict 0 (older of the pair) -> {1, 2}; t2: 1 hit, 3 miss, evict 2
    np.testing.assert_array_equal(res2["cells"], np.array([[M, R, E], [M, R, H], [E, M, R], [E, E, M]]))
    np.testing.assert_array_equal(res2["hits"], [[False, False], [False, False], [True, False]])
    assert res2["misses"] == 4 and res2["accesses"] == 6  # K · T accesses, the dropped slot included


def test_heatmap_other_layers_belady_and_global():
    rng = np.random.default_rng(0)
    experts = np.stack([rng.permutation(6)[:2] for _ in range(40 * 2)]).reshape(40, 2, 2).astype(np.int32)
    tr = {"experts": experts, "n_experts": np.int64(6)}
    for ev in ("lru", "belady"):
        res = heatmap.classify_trace(tr, 1, 3, eviction=ev)
        cells = res["cells"]
        assert ((cells == H) | (cells == M)).sum(axis=0).tolist() == [2] * 40  # K used per token
        assert ((cells == H) | (cells == R)).sum(axis=0).max() <= 3  # never more than C resident
    from moejax.experts import trace as trace_lib

    stats = trace_lib.replay(trace_lib.validate_trace(experts[:, 1:2], n_experts=6), 3, eviction="belady")
    assert heatmap.classify_trace(tr, 1, 3, eviction="belady")["misses"] == stats["misses"]  # next-use indices agree
    lru, bel = (heatmap.classify_trace(tr, 0, 3, eviction=e)["misses"] for e in ("lru", "belady"))
    assert bel <= lru
    g = heatmap.classify_trace(tr, 1, 4, scope="global")
    assert ((g["cells"] == H) | (g["cells"] == M)).sum(axis=0).tolist() == [2] * 40
    with pytest.raises(ValueError, match="layer 2 out of range"):
        heatmap.classify_trace(tr, 2, 3)


def test_heatmap_cross_checks_recorded_hits(tmp_path):
    experts = np.array([0, 1, 0, 2, 1, 2], np.int32)[:, None, None]
    hits = np.array([0, 0, 1, 0, 0, 1], bool)[:, None, None]
    good = {"experts": experts, "n_experts": np.int64(4), "hits": hits, "capacity": np.int64(2),
            "eviction": np.asarray("lru")}
    assert heatmap.classify_trace(good, 0, 2)["misses"] == 4
    bad = dict(good, hits=np.array([0, 0, 1, 1, 0, 1], bool)[:, None, None])
    with pytest.raises(ValueError, match="disagree with the replay at token 3"):
        heatmap.classify_trace(bad, 0, 2)
    heatmap.classify_trace(bad, 0, 3)  # recorded at another capacity: no check
    with pytest.raises(ValueError, match="token 3"):
        heatmap.classify_trace(bad, 0, 3, check_hits=True)
    path = tmp_path / "t.npz"
    np.savez(path, **bad)
    with pytest.raises(ValueError, match="disagree"):
        heatmap.classify_trace(str(path), 0, 2)


def test_heatmap_plot_and_cli(tmp_path):
    from moejax.experts import trace as trace_lib

    tr = trace_lib.synthetic_trace(40, 2, 6, 2, seed=1)  # the shapes of the test above: no new compilation
    path = tmp_path / "t.npz"
    trace_lib.save_trace(path, tr.experts, tr.weights, None, tr.n_experts, tr.gating)
    stem = tmp_path / "out" / "heat"
    paths = heatmap.trace_heatmap([str(path), str(path)], 1, 4, stem, max_tokens=30, labels=["a", "b"])
    _check_written(paths, stem)
    assert heatmap.main(["heatmap", str(path), "--layer", "0", "--cache-size", "0.5", "--out", str(tmp_path / "cli"),
                       "--start", "10"]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 1000 and (tmp_path / "cli.svg").exists()
    assert heatmap.main(["heatmap", str(path), "--layer", "5", "--cache-size", "4", "--out", str(tmp_path / "x")]) == 2
    assert heatmap.main(["heatmap", str(tmp_path / "missing.npz"), "--cache-size", "4", "--out", str(tmp_path / "x")]) == 1
    assert not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------------------ loading


def test_truncated_last_line_is_skipped_with_warning(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", lifetime_records(), tail='{"key": "half", "study": "lif')
    records, notes = report.read_jsonl(path)
    assert len(records) == 2 and len(notes) == 1 and f"{path}:3: skipped a truncated last line" in notes[0]
    with pytest.warns(UserWarning, match="truncated"):
        assert len(report.load_records([path])) == 2


@pytest.mark.parametrize("content,match", [
    ("", "empty results file"),
    ("\n\n", "empty results file"),
    ('{"key": "a"', "no complete records"),
    ('{"key": "a"}\nnot json\n{"key": "b"}\n', r"r.jsonl:2: not valid JSON"),
    ('{"key": "a"}\n[1, 2]\n', r"r.jsonl:2: a record must be a JSON object"),
    ('{"key": "a", "ppl": "12"}\n', r"r.jsonl:1: field 'ppl' must be a number"),
    ('{"key": "a", "routing": "cache-prior"}\n', r"r.jsonl:1: field 'routing' must be an object"),
    ('{"key": "a", "cache": {"capacity": "big"}}\n', r"r.jsonl:1: cache.capacity must be a number"),
])
def test_malformed_files_name_file_and_line(tmp_path, content, match):
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    with pytest.raises(report.ResultsError, match=match):
        report.read_jsonl(path)


def test_missing_file_and_duplicates(tmp_path):
    with pytest.raises(report.ResultsError, match="no such results file"):
        report.load_records([tmp_path / "nope.jsonl"])
    a = rec("pareto", key="k1", ppl=10.0)
    b = rec("pareto", key="k1", ppl=11.0)  # a resumed run wrote the point again: the later one wins
    notes = []
    out = report.load_records([write_jsonl(tmp_path / "a.jsonl", [a]), write_jsonl(tmp_path / "b.jsonl", [b])], notes)
    assert [r["ppl"] for r in out] == [11.0] and "1 duplicate" in notes[0]


def test_grouping_known_unknown_and_plain_sweeps():
    rs = lifetime_records() + pareto_records()[:3] + [rec(None, sweep={"lam": 0.1}), rec("mystery", ppl=None)]
    groups = report.group_records(rs)
    assert list(groups) == ["pareto", "lifetimes", "mystery", "sweep wikitext (lam)"]


# ------------------------------------------------------------------------------------------ report


def test_unknown_study_gets_generic_table(tmp_path):
    r = rec("mystery", "cache-prior", lam=0.3, ppl=None, miss=0.2, sweep={"alpha": 3})
    r["metrics"]["speedup"] = 1.7
    r["routing"]["bonus"] = "x"
    r2 = rec("mystery", ppl=None, miss=0.4, task="mmlu", cap=None)
    text = report.render_section("mystery", [r, r2], None, tmp_path)
    assert text.startswith("## mystery")
    # every field that some record fills gets a column; the model (the same for all) is in the header line
    assert ("| task | routing | routing options | C | size | scope | eviction | init | sweep | miss rate | "
            "bytes/token | time (s) | metrics.speedup |") in text
    assert "| mmlu | original | – | – | – | – | – | – | – | 40.00% | 400 B | 1.5 | – |" in text
    assert "| wikitext | cache-prior λ=0.3 | bonus=x | 4 | 4 | layer | lru | empty | alpha=3 | 20.00% | 200 B | 1.5 | 1.7 |" in text


def test_report_cli_end_to_end(tmp_path):
    res = tmp_path / "results"
    res.mkdir()
    rs = all_records()
    write_jsonl(res / "a.jsonl", rs[: len(rs) // 2])
    write_jsonl(res / "b.jsonl", rs[len(rs) // 2:] + [rec("mystery", ppl=None, miss=0.3)], tail='{"trunc')
    out = tmp_path / "rep" / "REPORT.md"
    figs = tmp_path / "rep" / "figs"
    assert report.main([str(res / "a.jsonl"), str(res / "b.jsonl"), "--out", str(out), "--figures", str(figs)]) == 0
    text = out.read_text()
    for title in ("Pareto fronts (paper figures 4 and 14)", "Cache-size ablation", "Cache lifetimes",
                  "Expert-rank sensitivity", "Initial cache state", "Logit range", "Eviction policies",
                  "Task accuracy", "## mystery"):
        assert title in text, title
    assert "skipped a truncated last line" in text
    for name in ("pareto", "cache_size", "sensitivity", "init", "delta", "eviction", "tasks"):
        assert "![" in text and f"](figs/{name}.png)" in text, name
        assert (figs / f"{name}.png").stat().st_size > 5000 and (figs / f"{name}.svg").exists()
    # headline: at C = 4, original LRU 35 %, Belady 24.5 %; cache-prior within +1 % ppl: λ = 0.2 (+0.48 %)
    assert "**C = 4 / 8 = N/2** — original routing (lru): miss rate 35.00%, perplexity 10.000; " \
           "Belady bound: miss rate 24.50% (-30.0% vs LRU)." in text
    assert "cache-prior within +1% perplexity: miss rate 30.10% (λ=0.2), -14.0% vs original LRU, " \
           "not below the Belady bound (24.50%)" in text
    assert "| 4 / 8 | cache-prior λ=0.5 | lru | 55.0 (± 27.5) | 15.0% |" in text
    assert "LRU/Least-Stale collision ratio" in text
    # sorted sensibly: pareto rows by capacity, then kind order (pruning before cache-prior)
    body = text[text.index("## Perplexity"):text.index("## Cache-size")]
    assert body.index("| 2 | pruning") < body.index("| 2 | cache-prior") < body.index("| 4 | pruning")
    # errors (through the real module entry point): clear message naming file and line, exit status 2,
    # no report written
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a"}\n{"key": 1}\n')
    proc = subprocess.run([sys.executable, "-m", "moejax.report", str(bad), "--out", str(tmp_path / "r2.md")],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and f"error: {bad}:2: field 'key' must be a string" in proc.stderr
    assert not (tmp_path / "r2.md").exists()
    assert report.main([str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "r2.md")]) == 1


def test_report_default_paths_and_trace_section(tmp_path, capsys):
    from moejax.experts import trace as trace_lib

    tr = trace_lib.synthetic_trace(40, 2, 6, 2, seed=3)
    tpath = tmp_path / "trace.npz"
    trace_lib.save_trace(tpath, tr.experts, tr.weights, None, tr.n_experts, tr.gating)
    path = write_jsonl(tmp_path / "lifetimes.jsonl", lifetime_records())
    assert report.main([str(path), "--trace", f"{tpath}=original", "--trace-cache-size", "3",
                        "--trace-note", "Recorded with generate."]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "Traces: `trace.npz` (original).\n\nRecorded with generate." in text
    assert "## Routing trace heat map (paper figure 7)" in text and "](figures/heatmap_layer0.png)" in text
    assert (tmp_path / "figures" / "heatmap_layer0.svg").exists()
    assert "wrote" in capsys.readouterr().out


def test_the_ppl_change_column_compares_each_model_with_its_own_original_routing():
    """A results file holding two models' records made each λ = 0 row read ±33 % (one shared baseline)."""
    def record(model, lam, ppl):
        return {"model": model, "task": "wikitext", "ppl": ppl, "method": "forward",
                "routing": {"kind": "cache-prior", "lam": lam}, "cache": {"capacity": 4, "size": "4"}}

    records = [record("a", 0.0, 10.0), record("a", 0.5, 11.0), record("b", 0.0, 20.0), record("b", 0.5, 22.0)]
    dppl = report._extra_columns(records)["Δppl"][0]
    assert dppl(records[0]) == dppl(records[2]) and dppl(records[1]) == dppl(records[3])
    assert dppl(records[0]) != dppl(records[1])


def test_records_of_different_token_budgets_in_one_study_are_noted():
    """A quick run and a longer one into one --out were averaged into one panel without a word."""
    def record(tokens, key):
        return {"study": "cache_size", "key": key, "model": "m", "task": "wikitext", "ppl": 10.0,
                "metrics": {"predicted_tokens": tokens}}

    assert report.mixed_budgets([record(63, "a"), record(63, "b")]) == []
    notes = report.mixed_budgets([record(63, "a"), record(159, "b")])
    assert len(notes) == 1 and "63, 159" in notes[0] and "cache_size / m" in notes[0]
