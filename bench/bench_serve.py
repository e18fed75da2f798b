"""Serving benchmark: ``python -m moejax.serve`` under 1, 4 and 8 concurrent clients, original
routing vs cache-prior, with the one expert cache that every request shares.

    python bench/bench_serve.py [--out bench/results/serve.json] [--articles 8] [--per-article 4]
                                [--concurrency 1,4,8] [--repeats 2] [--max-tokens 32] [--lam 0.5]

For each configuration (original routing; cache-prior λ = ``--lam``; both ``--offload --bandwidth-gbps 2``,
the default cache of N/2 experts per layer, ``--max-queue`` large enough that nothing gets 429) one server
process is started on 127.0.0.1 and warmed up with every request of the measurement sent once, one after
another (same prompts, same ``max_tokens``: the server prefills in power-of-two pieces and buckets the KV
cache, so this compiles every program the measurement needs; the warm-up time is reported). Then, for each
repeat and each concurrency level c, the same fixed set of requests is sent: ``--articles`` WikiText-2 test
articles × ``--per-article`` consecutive sentences of each, greedy, ``max_tokens`` 32, all streaming. The
requests of an article belong to one client (client k sends articles a with a % c == k, in order), so c = 1
is the *single stream* (every article's sentences back to back) and c = 8 *interleaves* eight users whose
requests alternate in the engine's first-come-first-served queue (the engine runs batch 1).

Reported per level: requests/s (completed / wall time), output tokens/s, client-side time to first token
(send → first SSE chunk carrying text: queueing included, what a user sees) p50/p99, the engine's
``prefill_time_s`` (prefill, queueing and compiling excluded) p50, its decode tokens/s (median of requests),
queueing p50, the per-request time outside queue + prefill + decode (lowering / executable-cache lookup,
bookkeeping, HTTP), and the shared cache's miss rate over the level (difference of ``/v1/moejax/cache``
summary totals before/after: misses / accesses) with the bytes the requests really paged per routed token
(prompt + decode) and per generated token (and the cache's own accounting, which counts every load of every
token: a batched offloaded prompt pages less). ``same_article_adjacent`` is the share of consecutive requests in the engine's order that
continue the same article: 24/31 for the single stream of 8 × 4, 0 when interleaved. Percentiles pool
the repeats; cache rates are pooled totals. p99 of 32–64 requests is close to the maximum.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the tree this script is in, last: the results are written with moejax's atomic writer after every run, and a
# moejax that only the runs' working directory provides would lose them all at the end
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_teacher_forced import cpu_model  # noqa: E402  (stdlib + numpy at import time)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIKITEXT = os.path.join(os.path.dirname(ROOT), "shared", "data", "wikitext-2-raw-v1", "test.txt")
CONFIGS = {
    "original": [],
    "cache-prior": ["--routing", "cache-prior"],  # + --lam
}


# ------------------------------------------------------------------------------------------------ prompts


def wikitext_sentences(path: str, articles: int, per_article: int, min_words: int = 12,
                       max_words: int = 40) -> list[dict]:
    """``per_article`` consecutive-in-text sentences (``min_words``..``max_words`` words, WikiText's raw
    tokenisation kept) from each of the first ``articles`` articles that have that many."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    heads = list(re.finditer(r"^ = ([^=].*?) = \n", text, flags=re.M))
    out = []
    for i, h in enumerate(heads):
        body = text[h.end():heads[i + 1].start() if i + 1 < len(heads) else len(text)]
        sentences = []
        for para in body.split("\n"):
            para = para.strip()
            if not para or para.startswith("="):
                continue
            for s in re.split(r"(?<= \.) ", para):
                if min_words <= len(s.split()) <= max_words and s.endswith(" ."):
                    sentences.append(s)
        if len(sentences) >= per_article:
            out += [{"article": len(out) // per_article, "title": h.group(1), "prompt": s}
                    for s in sentences[:per_article]]
        if len(out) >= articles * per_article:
            break
    if len(out) < articles * per_article:
        raise ValueError(f"{path}: only {len(out) // per_article} articles have {per_article} usable sentences")
    return out


# ------------------------------------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def start_server(port: int, extra: list[str], log) -> tuple[subprocess.Popen, float]:
    cmd = [sys.executable, "-m", "moejax.serve", "--model", "default", "--port", str(port), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    deadline = time.time() + 900  # --warmup compiles before listening
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            get_json(port, "/health", timeout=2)
            return proc, time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not come up in 900 s")


def stop_server(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    return proc.returncode


# ------------------------------------------------------------------------------------------------ client


def stream_completion(port: int, prompt: str, max_tokens: int, timeout: float = 600) -> dict:
    """One streaming POST /v1/completions; client-side timings and the final chunk's ``moejax`` field."""
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t_send = time.perf_counter()
    first_text = None
    ext, text, error = None, [], None
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "error": resp.read().decode()[:300], "t_send": t_send,
                    "t_done": time.perf_counter()}
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]
                continue
            piece = obj["choices"][0]["text"] if obj.get("choices") else ""
            if piece and first_text is None:
                first_text = time.perf_counter()
            text.append(piece)
            if "moejax" in obj:
                ext = obj["moejax"]
    finally:
        conn.close()
    t_done = time.perf_counter()
    return {"status": 200 if error is None and ext is not None else 500, "error": error, "t_send": t_send,
            "t_first_text": first_text, "t_done": t_done, "moejax": ext, "text": "".join(text)}


def run_level(port: int, requests: list[dict], concurrency: int, max_tokens: int) -> dict:
    """Send ``requests`` from ``concurrency`` clients (client k: the articles a with a % c == k, in order,
    one request at a time) and measure the level."""
    per_client = [[r for r in requests if r["article"] % concurrency == k] for k in range(concurrency)]

    def client(mine: list[dict]) -> list[dict]:
        out = []
        for r in mine:
            res = stream_completion(port, r["prompt"], max_tokens)
            out.append({**res, "article": r["article"]})
        return out

    before = get_json(port, "/v1/moejax/cache")["summary"]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = [x for xs in pool.map(client, per_client) for x in xs]
    wall = time.perf_counter() - t0
    after = get_json(port, "/v1/moejax/cache")["summary"]

    ok = [r for r in results if r["status"] == 200]
    rows = []
    for r in ok:
        m = r["moejax"]
        n_gen = len(m["token_ids"])
        decode_s = (n_gen - 1) / m["tokens_per_s"] if n_gen > 1 and m["tokens_per_s"] > 0 else 0.0
        latency = r["t_done"] - r["t_send"]
        rows.append({
            "article": r["article"], "t_send": r["t_send"] - t0, "t_done": r["t_done"] - t0,
            "client_ttft_s": (r["t_first_text"] - r["t_send"]) if r["t_first_text"] else None,
            "latency_s": latency, "queued_s": m["queued_s"], "engine_ttft_s": m["prefill_time_s"],
            "decode_tokens_per_s": m["tokens_per_s"], "decode_s": decode_s, "generated": n_gen,
            "other_s": latency - m["queued_s"] - m["prefill_time_s"] - decode_s,
            "stopped": m["stopped"], "cache": m["cache"]})
    order = sorted(rows, key=lambda x: x["t_done"])  # batch 1, first come first served: completion order
    same = [a["article"] == b["article"] for a, b in zip(order, order[1:])]
    delta = {k: after[k] - before[k] for k in ("tokens", "accesses", "misses", "loads", "evictions", "bytes_moved")}
    per_request_sum = {k: sum(x["cache"][k] for x in rows) for k in ("accesses", "misses", "loads", "bytes_moved")}
    return {
        "concurrency": concurrency, "requests": len(results), "completed": len(ok),
        "errors": [{"status": r["status"], "error": r["error"]} for r in results if r["status"] != 200],
        "wall_s": wall, "cache_delta": delta, "per_request_cache_sum": per_request_sum,
        # bytes: a request reports what it really paged, the cache what token-by-token paging would (a batched
        # offloaded prompt pages each expert it needs once per layer), so only the counts must add up
        "counters_add_up": all(per_request_sum[k] == delta[k] for k in ("accesses", "misses", "loads")),
        "same_article_adjacent": float(np.mean(same)) if same else None,
        "engine_order_articles": [x["article"] for x in order], "per_request": rows,
    }


def pct(values, q) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(levels: list[dict]) -> dict:
    """Pool the repeats of one concurrency level."""
    rows = [r for lv in levels for r in lv["per_request"]]
    wall = sum(lv["wall_s"] for lv in levels)
    d = {k: sum(lv["cache_delta"][k] for lv in levels) for k in levels[0]["cache_delta"]}
    paged = sum(lv["per_request_cache_sum"]["bytes_moved"] for lv in levels)  # offloaded: really paged
    generated = sum(r["generated"] for r in rows)
    return {
        "concurrency": levels[0]["concurrency"], "repeats": len(levels),
        "requests": sum(lv["requests"] for lv in levels), "completed": len(rows),
        "requests_per_s": len(rows) / wall, "output_tokens_per_s": generated / wall,
        "requests_per_s_each_repeat": [lv["completed"] / lv["wall_s"] for lv in levels],
        "client_ttft_p50_s": pct([r["client_ttft_s"] for r in rows], 50),
        "client_ttft_p99_s": pct([r["client_ttft_s"] for r in rows], 99),
        "latency_p50_s": pct([r["latency_s"] for r in rows], 50),
        "latency_p99_s": pct([r["latency_s"] for r in rows], 99),
        "queued_p50_s": pct([r["queued_s"] for r in rows], 50),
        "queued_max_s": max(r["queued_s"] for r in rows),
        "engine_ttft_p50_s": pct([r["engine_ttft_s"] for r in rows], 50),
        "engine_ttft_p99_s": pct([r["engine_ttft_s"] for r in rows], 99),
        "decode_tokens_per_s_p50": pct([r["decode_tokens_per_s"] for r in rows], 50),
        "other_s_p50": pct([r["other_s"] for r in rows], 50),
        "other_s_p99": pct([r["other_s"] for r in rows], 99),
        "generated_tokens": generated,
        "miss_rate": d["misses"] / d["accesses"] if d["accesses"] else None,
        "miss_rate_each_repeat": [lv["cache_delta"]["misses"] / lv["cache_delta"]["accesses"] for lv in levels],
        "bytes_per_token": paged / d["tokens"] if d["tokens"] else None,
        "bytes_per_generated_token": paged / generated if generated else None,
        "cache_accounted_bytes_per_token": d["bytes_moved"] / d["tokens"] if d["tokens"] else None,
        "cache_delta": d, "counters_add_up": all(lv["counters_add_up"] for lv in levels),
        "same_article_adjacent": float(np.mean([lv["same_article_adjacent"] for lv in levels])),
        "errors": [e for lv in levels for e in lv["errors"]],
    }


# ------------------------------------------------------------------------------------------------ main


def run_config(name: str, args, requests: list[dict]) -> dict:
    extra = ["--offload", "--bandwidth-gbps", str(args.bandwidth_gbps), "--max-queue", str(args.max_queue),
             *CONFIGS[name]]
    if args.server_warmup:  # the server compiles before it listens: startup_s includes it
        extra += ["--warmup", str(args.server_warmup)]
    if name == "cache-prior":
        extra += ["--lam", str(args.lam)]
    port = free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = None
    out = {"config": name, "server_args": extra}
    try:
        proc, startup = start_server(port, extra, log)
        out["startup_s"] = startup
        view = get_json(port, "/v1/moejax/cache")
        out["policy"], out["capacity_per_layer"] = view["policy"], view["capacity"]
        out["experts"], out["layers"] = view["experts"], view["layers"]
        # warm-up: every request of the measurement once, one after another (compiles every piece/bucket)
        t0 = time.perf_counter()
        warm = [stream_completion(port, r["prompt"], args.max_tokens) for r in requests]
        out["warmup_s"] = time.perf_counter() - t0
        out["warmup_requests"] = len(warm)
        out["warmup_errors"] = [w["error"] for w in warm if w["status"] != 200]
        out["warmup_latency_s"] = [w["t_done"] - w["t_send"] for w in warm]
        out["warmup_latency_max_s"] = max(out["warmup_latency_s"])
        print(f"[{name}] up in {startup:.1f} s, warm-up {len(warm)} requests in {out['warmup_s']:.1f} s",
              flush=True)
        levels: dict[int, list[dict]] = {c: [] for c in args.concurrency}
        for rep in range(args.repeats):
            for c in args.concurrency:
                lv = run_level(port, requests, c, args.max_tokens)
                levels[c].append(lv)
                print(f"[{name}] repeat {rep} c={c}: {lv['completed']}/{lv['requests']} in {lv['wall_s']:.1f} s, "
                      f"miss rate {lv['cache_delta']['misses'] / lv['cache_delta']['accesses']:.4f}", flush=True)
        out["levels"] = [summarize(levels[c]) for c in args.concurrency]
        out["raw"] = {str(c): levels[c] for c in args.concurrency}
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        out["metrics_bytes_moved_total"] = float(re.search(r"^moejax_bytes_moved_total (\S+)$", metrics,
                                                           flags=re.M).group(1))
        out["final_summary"] = get_json(port, "/v1/moejax/cache")["summary"]  # warm-up included
        out["summary_bytes_moved_total"] = out["final_summary"]["bytes_moved"]
    finally:
        if proc is not None:
            out["server_returncode"] = stop_server(proc)
        log.seek(0)
        out["server_log_tail"] = log.read()[-2000:]
        log.close()
    return out


def print_table(result: dict) -> None:
    print(f"\nserve, default model, --offload --bandwidth-gbps {result['bandwidth_gbps']}, cache N/2, "
          f"{result['requests_per_level']} streaming requests per level x {result['repeats']} repeats, "
          f"max_tokens {result['max_tokens']}, greedy")
    head = (f"{'routing':<12} {'c':>2} {'req/s':>6} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'eng TTFT':>9} {'dec tok/s':>9} {'other p50':>9} {'miss rate':>9} {'MB/token':>8} {'same-art':>8}")
    print(head)
    for cfg in result["configs"]:
        for lv in cfg["levels"]:
            print(f"{cfg['config']:<12} {lv['concurrency']:>2} {lv['requests_per_s']:6.2f} "
                  f"{lv['output_tokens_per_s']:9.1f} {lv['client_ttft_p50_s']:8.3f}s {lv['client_ttft_p99_s']:8.3f}s "
                  f"{lv['engine_ttft_p50_s']:8.3f}s {lv['decode_tokens_per_s_p50']:9.1f} {lv['other_s_p50']:8.3f}s "
                  f"{lv['miss_rate']:9.4f} {lv['bytes_per_token'] / 1e6:8.3f} {lv['same_article_adjacent']:8.2f}")
    for cfg in result["configs"]:
        lat = sorted(cfg["warmup_latency_s"], reverse=True)
        print(f"{cfg['config']}: startup {cfg['startup_s']:.1f} s, warm-up {cfg['warmup_s']:.1f} s "
              f"({cfg['warmup_requests']} requests; slowest {', '.join(f'{x:.1f}' for x in lat[:4])} s), "
              f"expert lifetime in cache {cfg['final_summary']['lifetime_mean']:.1f} tokens (mean)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "serve.json"))
    p.add_argument("--data", default=WIKITEXT, help="WikiText-2 raw test text")
    p.add_argument("--articles", type=int, default=8, help="articles (one per client at the top concurrency)")
    p.add_argument("--per-article", type=int, default=4, help="sentences (requests) per article")
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--server-warmup", type=int, default=96,
                   help="the server's --warmup (prompt tokens); 0: compile on first use (default 96)")
    p.add_argument("--lam", type=float, default=0.5)
    p.add_argument("--bandwidth-gbps", type=float, default=2.0)
    p.add_argument("--configs", default="original,cache-prior")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    requests = wikitext_sentences(args.data, args.articles, args.per_article)
    args.max_queue = len(requests) + 8  # nothing waits beyond this: no 429
    t_start = time.perf_counter()
    configs = [run_config(name, args, requests) for name in args.configs.split(",")]
    import moejax

    result = {
        "benchmark": "python -m moejax.serve under concurrent streaming clients: default model, "
                     f"--offload --bandwidth-gbps {args.bandwidth_gbps}, cache N/2 per layer (LRU), batch-1 engine",
        "command": " ".join(["python", *sys.argv]),
        "prompts": "WikiText-2 raw test: first sentences of 12-40 words of the first articles that have enough",
        "articles": args.articles, "per_article": args.per_article, "requests_per_level": len(requests),
        "repeats": args.repeats, "max_tokens": args.max_tokens, "temperature": 0.0, "lam": args.lam,
        "bandwidth_gbps": args.bandwidth_gbps, "max_queue": args.max_queue, "concurrency": args.concurrency,
        "requests": requests, "configs": configs, "wall_s": time.perf_counter() - t_start,
        "cpu": cpu_model(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "load_average": os.getloadavg(), "versions": {"python": platform.python_version(),
                                                      "moejax": moejax.__version__, "numpy": np.__version__},
    }
    print_table(result)
    print(f"total wall time {result['wall_s']:.0f} s")
    from moejax.base import atomic  # imported late, like moejax itself here
    atomic.write_json(args.out, result, sort_keys=False, make_parents=True)
    return 0 if all(not lv["errors"] and lv["counters_add_up"] for c in configs for lv in c["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
