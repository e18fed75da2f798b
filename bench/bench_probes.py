"""Small in-process probes behind figures of docs/benchmarks.md: each times one piece on random arrays, the shipped
default model or a local stand-in, prints its figures and leaves nothing behind (temporary files are removed).

    python bench/bench_probes.py row-dot            # one-row products: the matmul library vs the fused loop
    python bench/bench_probes.py column-blocks      # wide matrices whole vs in column blocks, 1 and 4 rows (+ 16-256)
    python bench/bench_probes.py latent-values      # MLA's values for one token: batched einsum vs the summed form
    python bench/bench_probes.py kv-attention       # one query over an 8,192-row bf16 KV cache: whole vs blocked
    python bench/bench_probes.py sampling-compile   # compile time of a new temperature in one process
    python bench/bench_probes.py bucketed-compile   # compile time of five sampling settings, bucketed generation
    python bench/bench_probes.py hub                # moejax.load("org/tiny") through a local hub stand-in; Ctrl-C
    python bench/bench_probes.py routing-scan       # jit(route_tokens) per token step, and a minimal cache step
    python bench/bench_probes.py router-compile     # compiling a token's cache steps: updates per layer vs deferred
    python bench/bench_probes.py cache-pass         # the default model's 1,024-token cache pass vs plain pass
    python bench/bench_probes.py alternate-columns  # gpt-oss's [D, 2F] gate/up block into the serving layout
    python bench/bench_probes.py page-faults        # a fresh buffer's page faults vs preadv into a mapped one
    python bench/bench_probes.py mxfp4-decode       # one gpt-oss-20b expert's MXFP4 blocks decoded on the host
    python bench/bench_probes.py delta-per-layer    # cache-prior with a per-layer calibrated delta vs one mean

What each measures (every time is of a jitted program after a warm-up call, unless said otherwise):

- ``row-dot``: one bf16 row times ``[out, in]`` matrices (random, bf16) through ``layout._padded_dot`` (the matmul
  library, the row padded to ``MIN_ROWS``) and through ``layout.row_dot`` (XLA:CPU's fused loop); an int8
  ``[50,304, 2,048]`` matrix through ``layout._int8_library_dot`` (int8 x int8, the row padded to two) and through
  ``row_dot`` in float32 times the scales. Median of ``--repeats`` (20); GB/s of weights.
- ``column-blocks``: matrices past ``ROW_DOT_MAX_IN`` columns through ``layout.nt_dot`` held whole (the library)
  and as ``layout.in_column_blocks`` (a loop per block for one row, the library per block for more), 1 and 4
  rows, GB/s of weights (median of ``--repeats``); then 16 / 64 / 256 rows of ``[28,672, 4,096]``, ms.
- ``latent-values``: DeepSeek-V2-Lite's shapes (16 heads, r = 512, 128 values, bf16): ``einsum("thr,rhv->thv")``
  against the model's ``_latent_values`` (the summed form it takes for one token on the CPU), ``w_v`` sliced out
  of ``kv_b`` inside the program as the model does. Median of 50, ms.
- ``kv-attention``: one bf16 query of 8 heads x 128 over an 8,192-row cache held as bf16 bit patterns (``init_kv``):
  the whole-cache path (``_attend_groups`` on the widened cache, what other platforms run) and its two pieces
  (widening the keys to float32; the score product on float32 keys laid out [heads, S, hd]), and the CPU's
  blocked path (``_attend_cache_blocks``, ``KV_BLOCK`` rows a block, blocks past the position skipped) at
  positions 16, 4,100 and 8,191 (the position traced: one program); then the KV cache of 7,033 tokens of the
  long-context model (8 layers of keys and values, one bf16 array [16, 7,033, 8, 128], 230 MB) summed in float32
  by one jitted reduction, against numpy summing a float32 array of as many bytes. Median of 20, ms.
- ``sampling-compile``: ``moejax.load("default")``, then ``generate`` of 32 new tokens after 8 ids at temperatures
  0.7, 0.8 and 1.0 in turn; each call's ``stats["compile_time_s"]``.
- ``bucketed-compile``: the same with ``bucketed=True`` (what the server and task evaluation run), 40 new tokens,
  five settings in turn: greedy; temperature 0.8 + top-p 0.9; temperature 0.8 + top-k 50; temperature 0.8 +
  top-k 50 + top-p 0.9 + repetition penalty 1.1; repetition penalty 1.1 alone.
- ``hub``: the default model exported to a Hugging Face folder (``moejax.convert moejax-to-hf``) served as
  ``org/tiny`` by ``tests/support/fake_hub.py`` on 127.0.0.1, with a hub cache in a temporary folder: the first
  ``moejax.load("org/tiny")`` (it fetches), then ``hub.snapshot_folder("org/tiny")`` (what ``moejax.load`` does
  to find the cached snapshot) and the whole ``moejax.load`` with the hub reachable (one check with it) and
  with ``HF_HUB_OFFLINE`` set, ``--repeats`` times each; then ``python -m moejax.generate --model org/tiny
  --prompt-ids 1,2`` against a hub that stalls the weights after 1,000 bytes, SIGINT once the partial file
  exists: seconds to exit, exit status, partial files left.
- ``routing-scan``: ``jit(router.route_tokens)`` on the default model's layer-0 router logits for 1,024 WikiText-2
  tokens (1,024 x 64), cache-prior lambda = 0.5 with a per-layer LRU of C = 32: us per token step (best of
  ``--repeats``, 9) and the operations of the scan body after XLA's optimisation (its instructions but
  parameters, tuples, constants and bitcasts); then a minimal step written for the purpose (cache-biased top-8 of
  64 by rounds of argmax, softmax weights over the chosen, LRU update, C = 32) as a plain ``lax.scan`` over the
  same logits.
- ``router-compile``: one decoding token's router steps through the cache at the default model's 8 MoE layers
  (cache-prior lambda = 0.5, per-layer LRU C = 32) as a jitted program: each layer's cache update right after its
  layer (``router.router_step``) against all updates after the last layer (``router.router_step_deferred`` +
  ``cache.access_layers``, what ``model.forward`` runs for one token); seconds to lower and for XLA to compile
  (the compilation cache off), instructions after optimisation, best of ``--repeats`` (3).
- ``cache-pass``: the default model over the first 1,024 WikiText-2 test tokens: ``simulate.forward_layer_parallel``
  with cache-prior lambda = 0.5 and a per-layer LRU of N/2 against the plain ``_forward_original``, alternating,
  best and median of ``--repeats`` (9) each.
- ``alternate-columns``: a random bf16 ``[2,880, 5,760]`` block (one gpt-oss-20b expert's ``gate_up_proj``, gate and
  up in alternate columns, 33 MB) into the serving layout ``[2F, D]``: ``expert_store._rows_of_alternate_columns``
  (256 x 256 tiles), numpy's whole strided copy, and XLA's transpose of a device array. Median of 20, ms.
- ``page-faults``: one Qwen1.5-MoE-A2.7B expert stored int8 (8.67 MB): a fresh anonymous mapping touched a byte per
  page (every page faults: what a new buffer for each page costs on the CPU, ``page_writes="copy"``), and
  ``os.preadv`` of the same bytes from a temporary file in the page cache into a buffer already touched (what
  ``page_writes="auto"`` does, into the slot's own buffer). Median of 20, ms.
- ``mxfp4-decode``: one gpt-oss-20b expert at its MXFP4 release's shapes (``gate_up`` [5,760, 2,880] and ``down``
  [2,880, 2,880]: random codes, the scale byte ``random_checkpoint --mxfp4`` writes, 13.2 MB) decoded to bf16 by
  ``mxfp4.decode_into`` into kept buffers, what the flash store does on the host for each page it reads; then the
  same for two experts on two threads at once (the store's two reader threads). Median of 20, ms.
- ``delta-per-layer``: the default model, cache-prior at lambda = 0.3 and 0.1 with a per-layer LRU of N/2, over the
  first 1,023 WikiText-2 test tokens (one chunk of 1,024 with BOS): delta calibrated per MoE layer (the delta
  study's ``studies.calibrate_delta`` on ``tests/data/corpus``'s held-out shard, 8,184 tokens) against the mean of
  those values for every layer. Miss rate and perplexity.

Every probe prints the CPU, the load average and the git commit first. ``--repeats`` changes the repeat count
where one is named above. Nothing is written into the repository.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib
import mmap
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_teacher_forced import cpu_model  # noqa: E402  (stdlib at import time)
from common import REPO, WIKITEXT2_TEST, times  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PROMPT_IDS = list(range(1, 9))


# ------------------------------------------------------------------------------------------------ helpers
def header(name: str) -> None:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=30, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    print(f"== {name}: {datetime.date.today().isoformat()}, {cpu_model()} {instruction_set()} ({os.cpu_count()} cores), "
          f"commit {commit}, load average {os.getloadavg()[0]:.2f}, jax {jax.__version__}", flush=True)


def instruction_set() -> str:
    """The widest x86 vector instruction set the CPU reports (the machines' names in docs/benchmarks.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""


def median_ms(fn, repeats: int) -> float:
    return 1e3 * statistics.median(times(fn, repeats))


def model_fn(name: str):
    """A function of the model code by name, wherever the model modules define it."""
    for module in ("moejax.models.attention", "moejax.models.moe", "moejax.models.ops", "moejax.models.model"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"no {name} in moejax.models")


def bf16_matrix(shape: tuple[int, ...], seed: int) -> jax.Array:
    return (0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)).astype(jnp.bfloat16)


def wikitext_ids(model, n: int) -> np.ndarray:
    from moejax.evaluation import perplexity

    text = perplexity.load_wikitext(WIKITEXT2_TEST)[:20 * n]
    ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)[:n]
    if len(ids) < n:
        raise SystemExit(f"the WikiText-2 copy gave {len(ids)} tokens, {n} wanted")
    return ids


# ------------------------------------------------------------------------------------------------ products
def probe_row_dot(args) -> None:
    from moejax.models import layout

    library = jax.jit(lambda r, w: layout._padded_dot(r, w, pad=layout.MIN_ROWS - 1))
    loop = jax.jit(layout.row_dot)
    print(f"{'matrix':34s} {'library ms':>11s} {'GB/s':>6s} {'loop ms':>9s} {'GB/s':>6s}")
    for out_dim, in_dim in ((50304, 2048), (16384, 2048), (2048, 2048), (1024, 2048), (2048, 1024)):
        w = bf16_matrix((out_dim, in_dim), 0)
        row = bf16_matrix((1, in_dim), 1)
        lib, fused = median_ms(lambda: library(row, w), args.repeats), median_ms(lambda: loop(row, w), args.repeats)
        print(f"{f'bf16 [{out_dim:,}, {in_dim:,}] {w.nbytes / 1e6:.1f} MB':34s} {lib:11.3f} {w.nbytes / lib / 1e6:6.1f} "
              f"{fused:9.3f} {w.nbytes / fused / 1e6:6.1f}")
    q = jax.random.randint(jax.random.key(2), (50304, 2048), -127, 128, jnp.int32).astype(jnp.int8)
    scale = jnp.full((50304, 1), 0.01, jnp.float32)
    row = bf16_matrix((1, 2048), 1).astype(jnp.float32)
    int8_library = jax.jit(lambda r, q, s: layout._int8_library_dot(r, q) * s[:, 0][None])
    int8_loop = jax.jit(lambda r, q, s: layout.row_dot(r, q) * s[:, 0][None])
    lib = median_ms(lambda: int8_library(row, q, scale), args.repeats)
    fused = median_ms(lambda: int8_loop(row, q, scale), args.repeats)
    print(f"{f'int8 [50,304, 2,048] {q.nbytes / 1e6:.1f} MB':34s} {lib:11.3f} {q.nbytes / lib / 1e6:6.1f} "
          f"{fused:9.3f} {q.nbytes / fused / 1e6:6.1f}")


def probe_column_blocks(args) -> None:
    from moejax.models import layout

    dot = jax.jit(layout.nt_dot)
    print(f"GB/s of weights, median of {args.repeats}")
    print(f"{'matrix [out, in]':40s} {'blocks':>11s} {'1 whole':>8s} {'1 blocked':>10s} {'4 whole':>8s} "
          f"{'4 blocked':>10s}")
    for name, (out_dim, in_dim), int8 in (("Mixtral expert down", (4096, 14336), False),
                                          ("Mixtral expert gate+up", (28672, 4096), False),
                                          ("attention", (4096, 4096), False),
                                          ("DeepSeek-V2 dense down", (2048, 10944), False),
                                          ("LM head", (32000, 4096), False),
                                          ("int8 gate+up", (28672, 4096), True)):
        w = bf16_matrix((out_dim, in_dim), 0)
        if int8:
            w = layout.quantize_matrix(w)
        blocks = layout.in_column_blocks(w)
        nbytes = layout.matrix_nbytes(w)
        cells = []
        for rows in (1, 4):
            x = bf16_matrix((rows, in_dim), rows)
            for held in (w, blocks):
                cells.append(nbytes / median_ms(lambda: dot(x, held), args.repeats) / 1e6)
        widths = blocks.widths
        print(f"{f'{name} [{out_dim:,}, {in_dim:,}]':40s} {f'{len(widths)} x {max(widths):,}':>11s} "
              + " ".join(f"{c:>{n}.1f}" for c, n in zip(cells, (8, 10, 8, 10))))
        del w, blocks
    w = bf16_matrix((28672, 4096), 0)
    blocks = layout.in_column_blocks(w)
    for rows in (16, 64, 256):
        x = bf16_matrix((rows, 4096), rows)
        whole = median_ms(lambda: dot(x, w), max(3, args.repeats // 2))
        cut = median_ms(lambda: dot(x, blocks), max(3, args.repeats // 2))
        print(f"[28,672, 4,096] bf16, {rows} rows: whole {whole:.1f} ms, {len(blocks.widths)} blocks {cut:.1f} ms")


def probe_latent_values(args) -> None:
    latent_values = model_fn("_latent_values")
    heads, r, nope, vd = 16, 512, 128, 128
    kv_b = bf16_matrix((r, heads * (nope + vd)), 0)
    out_latent = bf16_matrix((1, heads, r), 1)

    def w_v(kv_b):
        return kv_b.reshape(r, heads, nope + vd)[..., nope:]

    batched = jax.jit(lambda o, kv_b: jnp.einsum("thr,rhv->thv", o, w_v(kv_b)))
    summed = jax.jit(lambda o, kv_b: latent_values(o, w_v(kv_b)))
    np.testing.assert_allclose(np.asarray(batched(out_latent, kv_b), np.float32),
                               np.asarray(summed(out_latent, kv_b), np.float32), rtol=0.05, atol=1e-3)
    print(f"one token, 16 heads x [512 -> 128], bf16, median of {args.repeats} runs: batched einsum "
          f"{median_ms(lambda: batched(out_latent, kv_b), args.repeats):.3f} ms, summed (_latent_values) "
          f"{median_ms(lambda: summed(out_latent, kv_b), args.repeats):.3f} ms")


def probe_kv_attention(args) -> None:
    attend_groups, attend_blocks = model_fn("_attend_groups"), model_fn("_attend_cache_blocks")
    cache_values, kv_block = model_fn("cache_values"), model_fn("KV_BLOCK")
    rows, heads, hd = 8192, 8, 128
    scale = hd ** -0.5
    bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)  # noqa: E731  (init_kv's bf16 cache)
    k, v = bits(bf16_matrix((rows, heads, hd), 0)), bits(bf16_matrix((rows, heads, hd), 1))
    q = bf16_matrix((1, heads, hd), 2)

    def mask_at(pos):
        return (jnp.arange(rows) <= pos)[None]

    whole = jax.jit(lambda q, k, v, pos: attend_groups(q, cache_values(k), cache_values(v), mask_at(pos), scale))

    def blocked_fn(q, k, v, pos):
        blocks = [(a, min(a + kv_block, rows), a <= pos) for a in range(0, rows, kv_block)]
        return attend_blocks(q, k, v, mask_at(pos), scale, blocks)

    blocked = jax.jit(blocked_fn)
    widen = jax.jit(lambda k: cache_values(k).astype(jnp.float32))
    kf = jnp.asarray(np.asarray(widen(k)).transpose(1, 0, 2))  # [heads, S, hd] float32
    scores = jax.jit(lambda q, kf: jnp.matmul(q.astype(jnp.float32).transpose(1, 0, 2), kf.transpose(0, 2, 1)))
    n = args.repeats
    print(f"one query, {heads} heads x {hd}, a {rows:,}-row bf16 cache ({2 * k.nbytes / 1e6:.0f} MB of keys and "
          f"values), median of {n}, ms")
    print("  whole cache (_attend_groups on the widened cache): "
          + ", ".join(f"position {p}: {median_ms(lambda: whole(q, k, v, jnp.int32(p)), n):.2f}"
                      for p in (16, 4100, 8191)))
    print(f"  of which widening the keys to float32: {median_ms(lambda: widen(k), n):.2f}; the score product alone "
          f"on float32 keys [heads, S, hd]: {median_ms(lambda: scores(q, kf), n):.2f}")
    print(f"  blocked ({kv_block} rows a block, _attend_cache_blocks): "
          + ", ".join(f"position {p}: {median_ms(lambda: blocked(q, k, v, jnp.int32(p)), n):.2f}"
                      for p in (16, 4100, 8191)))
    k = v = kf = None  # freed before the next arrays
    layers, tokens = 8, 7033
    cache = bf16_matrix((2 * layers, tokens, heads, hd), 10)  # every layer's keys and values, bf16
    total = jax.jit(lambda c: jnp.sum(c, dtype=jnp.float32))
    flat = np.random.default_rng(0).standard_normal(cache.nbytes // 4, np.float32)
    print(f"  the KV cache of {tokens:,} tokens ({layers} layers of keys and values, {cache.nbytes / 1e6:.0f} MB) "
          f"summed in float32 by one XLA reduction: {median_ms(lambda: total(cache), n):.1f}; numpy summing a float32 "
          f"array of as many bytes: {median_ms(lambda: flat.sum(), n):.1f}")


# ------------------------------------------------------------------------------------------ the default model
def probe_sampling_compile(args) -> None:
    import moejax

    m = moejax.load("default")
    for temperature in (0.7, 0.8, 1.0):
        r = m.generate(PROMPT_IDS, max_new_tokens=32, temperature=temperature, stop_at_eos=False)
        print(f"temperature {temperature}: compile {r.stats['compile_time_s']:.3f} s, "
              f"{r.stats['tokens_per_s']:.0f} tok/s", flush=True)


SETTINGS = (("greedy", {}), ("top-p", dict(temperature=0.8, top_p=0.9)), ("top-k", dict(temperature=0.8, top_k=50)),
            ("all four", dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)),
            ("penalty", dict(repetition_penalty=1.1)))


def probe_bucketed_compile(args) -> None:
    import moejax

    m = moejax.load("default")
    for name, setting in SETTINGS:
        r = m.generate(PROMPT_IDS, max_new_tokens=40, stop_at_eos=False, bucketed=True, **setting)
        print(f"{name:9s} {setting}: compile {r.stats['compile_time_s']:.3f} s", flush=True)


def probe_hub(args) -> None:
    tmp = tempfile.mkdtemp(prefix="moejax-probe-hub-")
    os.environ.update(HF_HUB_CACHE=os.path.join(tmp, "cache"), HF_HUB_DISABLE_TELEMETRY="1")
    os.environ.pop("HF_HUB_OFFLINE", None)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from support.fake_hub import FakeHub

    hubs: list = []
    child = None
    try:
        folder = os.path.join(tmp, "hf")
        subprocess.run([sys.executable, "-m", "moejax.convert", "moejax-to-hf", "default", folder], check=True,
                       capture_output=True, timeout=300)
        files = {}
        for name in os.listdir(folder):
            with open(os.path.join(folder, name), "rb") as f:
                files[name] = f.read()
        hubs.append(FakeHub({"org/tiny": files}))
        os.environ["HF_ENDPOINT"] = hubs[-1].url
        import huggingface_hub.constants as hub_constants

        import moejax
        from moejax.models import hub

        hub_constants.ENDPOINT, hub_constants.HF_HUB_CACHE = hubs[-1].url, os.environ["HF_HUB_CACHE"]
        hub_constants.HF_HUB_OFFLINE = False
        size = sum(len(b) for b in files.values()) / 1e6
        t = time.perf_counter()
        moejax.load("org/tiny")
        print(f"org/tiny ({len(files)} files, {size:.1f} MB): first moejax.load (fetches) {time.perf_counter() - t:.2f} s")

        def timed(fn):
            out = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t)
            return out

        for label, offline in (("hub reachable", False), ("HF_HUB_OFFLINE=1", True)):
            hub_constants.HF_HUB_OFFLINE = offline
            os.environ["HF_HUB_OFFLINE"] = "1" if offline else "0"
            snap, whole = timed(lambda: hub.snapshot_folder("org/tiny")), timed(lambda: moejax.load("org/tiny"))
            print(f"{label}: hub.snapshot_folder {1e3 * min(snap):.1f}-{1e3 * max(snap):.1f} ms, moejax.load "
                  f"{min(whole):.2f}-{max(whole):.2f} s ({args.repeats} runs each)")
        hub_constants.HF_HUB_OFFLINE = False
        os.environ.pop("HF_HUB_OFFLINE")

        hubs.append(FakeHub({"org/tiny": files}, stall={"model.safetensors": 1000}))
        hubs[-1].server.handle_error = lambda *_: None  # the stalled answer's pipe breaks when the child stops
        cache = os.path.join(tmp, "cache-stall")
        env = dict(os.environ, HF_ENDPOINT=hubs[-1].url, HF_HUB_CACHE=cache, JAX_PLATFORMS="cpu")
        child = subprocess.Popen([sys.executable, "-m", "moejax.generate", "--model", "org/tiny", "--prompt-ids", "1,2"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        partial = os.path.join(cache, "*", "blobs", "*.incomplete")
        while not glob.glob(partial):
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the download did not start: {child.communicate(timeout=30)[1][-2000:]}")
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        t = time.monotonic()
        out, err = child.communicate(timeout=60)
        print(f"Ctrl-C during the stalled download (python -m moejax.generate --model org/tiny): exit "
              f"{child.returncode} after {time.monotonic() - t:.2f} s, {len(glob.glob(partial))} partial files left, "
              f"traceback: {'Traceback' in err}")
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for fake in hubs:
            fake.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def probe_routing_scan(args) -> None:
    import moejax
    from moejax.experts import router, routing
    from moejax.runtime import simulate

    m = moejax.load("default")
    ids = wikitext_ids(m, 1024)
    z = jnp.asarray(np.asarray(m.forward(ids).router_logits[0], np.float32))  # [1024, 64], MoE layer 0
    T, N = z.shape
    state = m.router_state(routing.make_policy("cache-prior", m.cfg.top_k, lam=0.5), simulate.CacheConfig("32"))
    gating = m.cfg.gating
    scan = jax.jit(lambda z, cs, rs, policy: router.route_tokens(z, 0, cs, rs, policy, gating)[:3])
    best = min(times(lambda: scan(z, state["cache"], state["routing"], state["policy"]), args.repeats))
    hlo = scan.lower(z, state["cache"], state["routing"], state["policy"]).compile().as_text()
    print(f"jit(route_tokens), {T:,} x {N} logits, cache-prior lambda 0.5, LRU C = 32: {1e6 * best / T:.2f} us a token "
          f"step (best of {args.repeats}); the scan body after optimisation: {_while_body_ops(hlo)} operations")

    k, capacity, lam = m.cfg.top_k, 32, 0.5
    delta = jnp.mean(jnp.max(z, -1) - jnp.min(z, -1))

    def minimal(z):
        def step(carry, z_t):
            resident, last, t = carry
            biased = z_t + lam * delta * resident
            chosen = []
            for _ in range(k):  # top-k by rounds of argmax
                e = jnp.argmax(biased)
                chosen.append(e)
                biased = biased.at[e].set(-jnp.inf)
            ids = jnp.stack(chosen)
            weights = jax.nn.softmax(z_t[ids])
            hits = resident[ids]
            for e in chosen:  # LRU: a miss evicts the least recently used resident expert when full
                victim = jnp.argmin(jnp.where(resident, last, jnp.iinfo(jnp.int32).max))
                evict = ~resident[e] & (resident.sum() >= capacity)
                resident = resident.at[victim].set(resident[victim] & ~evict).at[e].set(True)
                last = last.at[e].set(t)
            return (resident, last, t + 1), (ids, weights, hits)

        init = (jnp.zeros(N, bool), jnp.full(N, -1, jnp.int32), jnp.int32(0))
        return jax.lax.scan(step, init, z)[1]

    plain = jax.jit(minimal)
    best = min(times(lambda: plain(z), args.repeats))
    print(f"a minimal step (cache-biased top-{k} of {N} by rounds of argmax, softmax weights, LRU update, "
          f"C = {capacity}) as a plain scan: {1e6 * best / T:.2f} us a token step (best of {args.repeats})")


def probe_router_compile(args) -> None:
    """One decoding token's router steps through the cache at every MoE layer, compiled as a decode program holds
    them: each layer's cache update right after its layer (``router.router_step``) against all of them after the
    last layer (``router.router_step_deferred`` + ``cache.access_layers``, what ``model.forward`` runs). The
    default model's shapes (8 MoE layers, 64 experts, top-8), cache-prior lambda 0.5, per-layer LRU C = 32;
    ``MOEJAX_COMPILE_CACHE`` is ignored (each program is compiled, never read back). Seconds to lower and to
    compile, instructions after optimisation; best of ``--repeats`` (3)."""
    import moejax
    from moejax.experts import cache, router, routing
    from moejax.runtime import simulate

    jax.config.update("jax_enable_compilation_cache", False)
    m = moejax.load("default")
    cfg, gating = m.cfg, m.cfg.gating
    state = m.router_state(routing.make_policy("cache-prior", cfg.top_k, lam=0.5), simulate.CacheConfig("32"))
    layers = cfg.n_moe_layers

    def token(deferred: bool):
        def run(z, cs, rs, policy):
            pending, out = [], []
            for layer in range(layers):
                if deferred:
                    e, w, h, tier, left, cs, rs = router.router_step_deferred(z[layer], cs, rs, policy, gating, layer)
                    pending.append(left)
                else:
                    e, w, h, cs, rs = router.router_step(z[layer], cs, rs, policy, gating, layer)
                out.append(e)
            if deferred:
                cs = cache.access_layers(cs, *(jnp.stack(parts) for parts in zip(*pending)))
            return jnp.stack(out), cs, rs
        return run

    z = jax.random.normal(jax.random.PRNGKey(0), (layers, cfg.n_experts))
    operands = (z, state["cache"], state["routing"], state["policy"])
    for name, deferred in (("each layer's update after its layer", False), ("all updates after the last layer", True)):
        best_lower = best_compile = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            lowered = jax.jit(token(deferred)).lower(*operands)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            best_lower, best_compile = min(best_lower, t1 - t0), min(best_compile, t2 - t1)
        ops = sum(1 for line in compiled.as_text().splitlines() if " = " in line)
        print(f"{name}: lower {best_lower:.2f} s, XLA compile {best_compile:.2f} s, {ops:,} instructions after "
              f"optimisation (best of {args.repeats})")


def _while_body_ops(hlo: str) -> int:
    """Operations in the largest while-loop body of an optimised HLO module's text: its instructions, not counting
    parameters, tuples, tuple elements, constants and bitcasts (each of the others runs as a kernel of its own)."""
    bodies, sizes, name = set(), {}, None
    skip = (" parameter(", " get-tuple-element(", " tuple(", " constant(", " bitcast(")
    for line in hlo.splitlines():
        if " while(" in line and "body=" in line:
            bodies.add(line.split("body=", 1)[1].split(",", 1)[0].strip().lstrip("%"))
        if line.startswith("%") and line.rstrip().endswith("{"):
            name = line[1:].split(" ", 1)[0]
            sizes[name] = 0
        elif line.startswith("}"):
            name = None
        elif name is not None and " = " in line and not any(op in line for op in skip):
            sizes[name] += 1
    return max((sizes.get(b, 0) for b in bodies), default=0)


def probe_cache_pass(args) -> None:
    import moejax
    from moejax.experts import routing
    from moejax.runtime import api, simulate

    m = moejax.load("default")
    toks = jnp.asarray(wikitext_ids(m, 1024))
    state = m.router_state(routing.make_policy("cache-prior", m.cfg.top_k, lam=0.5), simulate.CacheConfig("0.5"))
    router = simulate.CacheRouter(m.cfg.gating)
    plain = lambda: api._forward_original(m.params, m.cfg, toks).logits  # noqa: E731
    cached = lambda: simulate.forward_layer_parallel(m.params, m.cfg, toks, router, state).logits  # noqa: E731
    got = {"cache pass": [], "plain pass": []}
    for fn in (plain, cached):
        times(fn, 0)
    for _ in range(args.repeats):
        got["plain pass"] += times(plain, 1, warm=0)
        got["cache pass"] += times(cached, 1, warm=0)
    print(f"the default model, {len(toks):,} tokens, alternating, {args.repeats} runs each: " + "; ".join(
        f"{k} best {1e3 * min(v):.0f} ms, median {1e3 * statistics.median(v):.0f} ms" for k, v in got.items()))


# ------------------------------------------------------------------------------------------------ host copies
def probe_alternate_columns(args) -> None:
    from moejax.runtime import expert_store

    d, f = 2880, 2880
    block = np.asarray(bf16_matrix((d, 2 * f), 0))
    out = np.empty((2 * f, d), block.dtype)
    expert_store._rows_of_alternate_columns(block, out)
    expected = out.copy()

    def whole():
        out.reshape(2, f, d)[...] = block.reshape(d, f, 2).transpose(2, 1, 0)

    whole()
    np.testing.assert_array_equal(out, expected)
    device = jnp.asarray(block)
    xla = jax.jit(lambda b: b.reshape(d, f, 2).transpose(2, 1, 0).reshape(2 * f, d))
    n = args.repeats
    print(f"[{d:,}, {2 * f:,}] bf16 block ({block.nbytes / 1e6:.1f} MB) -> [2F, D], median of {n}: 256 x 256 tiles "
          f"{median_ms(lambda: expert_store._rows_of_alternate_columns(block, out), n):.1f} ms, numpy's whole strided "
          f"copy {median_ms(whole, n):.1f} ms, XLA's transpose {median_ms(lambda: xla(device), n):.1f} ms")


def probe_page_faults(args) -> None:
    nbytes = 3 * 1408 * 2048 + (2 * 1408 + 2048) * 4  # a Qwen1.5-MoE-A2.7B expert stored int8, with its row scales
    page = mmap.PAGESIZE
    n = args.repeats

    def fresh():
        mm = mmap.mmap(-1, nbytes)
        t = time.perf_counter()
        np.frombuffer(mm, np.uint8)[::page] = 1
        took = time.perf_counter() - t
        mm.close()
        return took

    faults = [fresh() for _ in range(n)]
    with tempfile.TemporaryDirectory(prefix="moejax-probe-pages-") as tmp:
        path = os.path.join(tmp, "page")
        with open(path, "wb") as f:
            f.write(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).tobytes())
        buf = np.ones(nbytes, np.uint8)  # touched: its pages are mapped
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [buf], 0)  # the page cache now holds the file
            reads = []
            for _ in range(n):
                t = time.perf_counter()
                got = os.preadv(fd, [buf], 0)
                reads.append(time.perf_counter() - t)
                assert got == nbytes
        finally:
            os.close(fd)
    pages = -(-nbytes // page)
    print(f"{nbytes / 1e6:.2f} MB ({pages:,} pages of {page} bytes), median of {n}: a fresh mapping touched page by page "
          f"{1e3 * statistics.median(faults):.2f} ms ({1e6 * statistics.median(faults) / pages:.2f} us a fault); preadv "
          f"from the page cache into a mapped buffer {1e3 * statistics.median(reads):.2f} ms")


def probe_mxfp4_decode(args) -> None:
    import concurrent.futures

    from moejax.models import mxfp4
    from moejax.testing import random_checkpoint

    d, f = 2880, 2880
    rng = np.random.default_rng(0)
    scale = random_checkpoint.mxfp4_scale(random_checkpoint.STD)

    def expert():
        mats = []
        for rows, cols in ((2 * f, d), (d, f)):
            blocks = rng.integers(0, 256, (rows, cols // mxfp4.GROUP, mxfp4.GROUP // 2), np.uint8)
            scales = np.full((rows, cols // mxfp4.GROUP), scale, np.uint8)
            mats.append((blocks, scales, np.empty((rows, cols), mxfp4.DECODED)))
        return mats

    def decode(mats):
        for blocks, scales, out in mats:
            mxfp4.decode_into(blocks, scales, out)

    experts = [expert(), expert()]
    nbytes = sum(b.nbytes + s.nbytes for b, s, _ in experts[0])
    one = times(lambda: decode(experts[0]), args.repeats)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        two = times(lambda: list(pool.map(decode, experts)), args.repeats)
    print(f"one gpt-oss-20b expert, MXFP4 ({nbytes / 1e6:.1f} MB) -> bf16 ({sum(o.nbytes for *_, o in experts[0]) / 1e6:.1f} "
          f"MB), median of {args.repeats}: {1e3 * statistics.median(one):.1f} ms; two experts on two threads at once "
          f"{1e3 * statistics.median(two):.1f} ms ({1e3 * statistics.median(two) / 2:.1f} ms an expert)")


# ------------------------------------------------------------------------------------------------ routing study
def probe_delta_per_layer(args) -> None:
    import moejax
    from moejax.evaluation import perplexity, studies
    from moejax.experts import routing
    from moejax.runtime import simulate

    m = moejax.load("default")
    shard = os.path.join(REPO, "tests", "data", "corpus", studies.CALIBRATION_SHARD)
    with tempfile.TemporaryDirectory(prefix="moejax-probe-delta-") as tmp:
        ctx = types.SimpleNamespace(calibration_text=shard, max_tokens=None, model=m, context=1024, cfg=m.cfg,
                                    out=tmp)
        calib = studies.calibrate_delta(ctx)
    per_layer = [round(d, 6) for d in calib["per_layer"]]
    print(f"delta calibrated on {calib['tokens']:,} tokens of {studies.CALIBRATION_SHARD}: per layer "
          f"{', '.join(f'{d:.2f}' for d in per_layer)}; mean {calib['delta']:.3f}")
    text = perplexity.load_wikitext(WIKITEXT2_TEST)
    for lam in (0.3, 0.1):
        cells = []
        for label, delta in (("per-layer", per_layer), ("mean", calib["delta"])):
            policy = routing.make_policy("cache-prior", m.cfg.top_k, lam=lam, delta=delta)
            r = perplexity.wikitext_perplexity(m, text, context=1024, max_tokens=1023, routing=policy,
                                               cache=simulate.CacheConfig("0.5"))
            cells.append(f"{label} miss rate {r['miss_rate']:.4f} / perplexity {r['ppl']:.2f}")
        print(f"lambda {lam}, C = N/2, first 1,023 WikiText-2 test tokens: " + "; ".join(cells), flush=True)


PROBES = {"row-dot": (probe_row_dot, 20), "column-blocks": (probe_column_blocks, 20),
          "latent-values": (probe_latent_values, 50), "kv-attention": (probe_kv_attention, 20),
          "sampling-compile": (probe_sampling_compile, 1),
          "bucketed-compile": (probe_bucketed_compile, 1), "hub": (probe_hub, 5),
          "routing-scan": (probe_routing_scan, 9), "router-compile": (probe_router_compile, 3),
          "cache-pass": (probe_cache_pass, 9), "alternate-columns": (probe_alternate_columns, 20),
          "page-faults": (probe_page_faults, 20),
          "mxfp4-decode": (probe_mxfp4_decode, 20), "delta-per-layer": (probe_delta_per_layer, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="probe", required=True, metavar="PROBE")
    for name, (fn, repeats) in PROBES.items():
        p = sub.add_parser(name, help=(fn.__doc__ or name).strip().splitlines()[0] if fn.__doc__ else None)
        p.add_argument("--repeats", type=int, default=repeats, help=f"repeats where the probe names them ({repeats})")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    header(args.probe)
    PROBES[args.probe][0](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
