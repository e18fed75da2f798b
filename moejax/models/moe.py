"""The routed experts of a MoE layer: the router's logits, and every exact way of computing
sum_k weights[t, k] * E_experts[t, k](x_t) (gathered, dense, sorted, grouped, switched over one buffer per
expert, sharded over devices, capacity-limited for training), plus the shared experts. They all give the
same result; ``routed_experts`` picks one by shape and layout."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from moejax.models import layout
from moejax.models.config import ModelConfig
from moejax.models.ops import dense_mlp, glu


SORTED_MIN_TOKENS = 64  # below this the dense einsum is within ~1.5x of the sorted path (one MoE layer of tests/data/cpu-default-model)


EXPERT_BIASES = ("gate_bias", "up_bias", "down_bias")  # GPT-OSS's, [N, F], [N, F], [N, D]: resident, never paged


def expert_biases(p: dict, experts: jax.Array | None = None, bias_ids: jax.Array | None = None,
                  n: int | None = None) -> dict | None:
    """GPT-OSS's expert biases as tables aligned with the ids that ``experts`` uses (None for the other families).

    They are 17 KB an expert against its 49.8 MB of matrices (gpt-oss-20b), so they stay on the device beside
    the router and are never paged: ``experts`` naming the layer's own experts read the layer's tables;
    ``experts`` naming slots (an offloaded cache's buffers) read tables of ``n`` rows built from ``bias_ids``
    [T, K], the real experts those slots hold (scattered to their slots; rows of unused slots are zero)."""
    if "down_bias" not in p:
        return None
    tables = {k: p[k] for k in EXPERT_BIASES}
    if bias_ids is None:
        return tables
    flat, real = experts.reshape(-1), jnp.maximum(bias_ids.reshape(-1), 0)
    at = jnp.where(flat >= 0, flat, n)  # invalid assignments land in a dummy row
    return {k: jnp.zeros((n + 1, t.shape[-1]), t.dtype).at[at].set(t[real])[:n] for k, t in tables.items()}


def _gate_up_bias(b: dict | None, e) -> tuple:
    """Expert ``e``'s (gate_up bias [2F], down bias [D]) of aligned tables (``expert_biases``), or (None, None)."""
    if b is None:
        return None, None
    return jnp.concatenate([b["gate_bias"][e], b["up_bias"][e]]), b["down_bias"][e]


def routed_experts(p: dict, cfg: ModelConfig, x: jax.Array, experts: jax.Array, weights: jax.Array,
                   bias_ids: jax.Array | None = None):
    """Σ_k weights[t,k] · E_{experts[t,k]}(x_t) over T tokens. Invalid slots (id < 0) must carry weight 0.
    ``bias_ids``: where ``experts`` are slot ids, the real experts they hold (GPT-OSS's biases: ``expert_biases``).

    Picks the exact path by shape (all give the same result; measured in docs/benchmarks.md#evaluation-speed): one token
    gathers the K chosen experts' weights; from ``SORTED_MIN_TOKENS`` tokens on, when N > 2K, the CPU sorts
    the T·K assignments by expert and runs each expert on its own tokens only (``sorted_routed_experts``: on
    the default model 2.1x faster than dense at T = 128, 2.8x at 1024); otherwise every expert runs on every
    token (``dense_routed_experts``: at most twice the needed work when N ≤ 2K, and for a few tokens it costs
    little and compiles faster). Off the CPU many tokens also take the dense path, in chunks of tokens
    (``dense_chunk_rows``): the sorted path's loop of ~T·K/64 sequential small products per layer ran the
    H200's teacher-forced pass at 0.40x transformers' grouped GEMM (``bench/bench_teacher_forced.py``), where
    N/K times the work in one large product costs a GPU less than the loop."""
    held = p.get("experts")
    n = held.n_experts if held is not None else p["gate"].shape[0]
    biases = expert_biases(p, experts, bias_ids, n)
    if isinstance(held, layout.ExpertShards):  # spread over devices: each computes its own
        return sharded_routed_experts(held, cfg, x, experts, weights, biases)
    if held is not None:  # serving layout (layout.ExpertList): every path reads the experts in place
        return switched_routed_experts(held, cfg, x, experts, weights, biases=biases)
    p = {**{k: p[k] for k in ("gate", "up", "down")}, **(biases or {})}
    T, K = experts.shape
    if T == 1:
        return gathered_routed_experts(p, cfg, x, experts, weights)
    if T >= SORTED_MIN_TOKENS and n > 2 * K:
        chunk = dense_chunk_rows(n, p["gate"].shape[-1])
        return jax.lax.platform_dependent(
            x, experts, weights, cpu=lambda *a: sorted_routed_experts(p, cfg, *a),
            default=lambda *a: dense_routed_experts(p, cfg, *a, chunk_rows=chunk))
    return dense_routed_experts(p, cfg, x, experts, weights)


def dense_chunk_rows(n_experts: int, ff: int, budget_bytes: int = 1 << 28) -> int:
    """Tokens per chunk of the dense path off the CPU: the [rows, N, F] float32 intermediate within
    ``budget_bytes`` (256 MiB), a power of two in [64, 4096]."""
    rows = max(1, budget_bytes // (n_experts * ff * 4))
    return int(min(4096, max(64, 1 << (rows.bit_length() - 1))))


def _expert_mlp_act(act, x: jax.Array, g: jax.Array, u: jax.Array, d: jax.Array, gb=None, ub=None,
                    db=None) -> jax.Array:
    """One expert's gated MLP on rows x [R, D]: glu(x g (+ gb), x u (+ ub)) @ d (+ db)."""
    y = glu(act, _plus(x @ g, gb), _plus(x @ u, ub)) @ d
    return _plus(y, db)


def _plus(y: jax.Array, b) -> jax.Array:
    """``y + b`` in y's dtype (a bias, as HF adds it after the product is rounded), or y."""
    return y if b is None else y + b.astype(y.dtype)


def gathered_routed_experts(p: dict, cfg: ModelConfig, x, experts, weights):
    """One token (decode): gather the K chosen experts' weights (and biases), nothing else is read."""
    ids = jnp.maximum(experts[0], 0)
    g, u, d = p["gate"][ids], p["up"][ids], p["down"][ids]  # [K, D, F], [K, F, D]
    gb, ub, db = (p[k][ids] if k in p else None for k in EXPERT_BIASES)
    h = glu(cfg.expert_act, _plus(jnp.einsum("td,kdf->tkf", x, g), gb), _plus(jnp.einsum("td,kdf->tkf", x, u), ub))
    y = _plus(jnp.einsum("tkf,kfd->tkd", h, d), db)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


def dense_routed_experts(p: dict, cfg: ModelConfig, x, experts, weights, chunk_rows: int | None = None):
    """Every expert on every token, combined with a [T, N] matrix: N/K times the work, but one big
    einsum: the reference the sparse path is tested against, and the fastest for a few tokens.
    ``chunk_rows``: more tokens than that run as a sequence of chunks (padded), bounding the [rows, N, F]
    intermediate."""
    T, n = x.shape[0], p["gate"].shape[0]
    if chunk_rows is not None and T > chunk_rows:
        nc = -(-T // chunk_rows)
        pad = nc * chunk_rows - T

        def chunks(a, fill):
            a = jnp.concatenate([a, jnp.full((pad, *a.shape[1:]), fill, a.dtype)]) if pad else a
            return a.reshape(nc, chunk_rows, *a.shape[1:])

        y = jax.lax.map(lambda c: dense_routed_experts(p, cfg, *c),
                        (chunks(x, 0), chunks(experts, -1), chunks(weights, 0)))
        return y.reshape(nc * chunk_rows, -1)[:T]
    ids = jnp.maximum(experts, 0)
    combine = jnp.zeros((T, n), weights.dtype)
    combine = combine.at[jnp.arange(T)[:, None], ids].add(jnp.where(experts >= 0, weights, 0))
    gb, ub, db = (p.get(k) for k in EXPERT_BIASES)
    h = glu(cfg.expert_act, _plus(jnp.einsum("td,edf->tef", x, p["gate"]), gb),
            _plus(jnp.einsum("td,edf->tef", x, p["up"]), ub))
    y = jnp.einsum("tef,efd,te->td", h, p["down"], combine.astype(h.dtype))
    return y if db is None else y + (combine.astype(h.dtype) @ db.astype(h.dtype))


def sorted_block_rows(T: int, K: int, n: int) -> int:
    """Rows per block of the sorted layout: about half the mean number of assignments per expert, a power
    of two in [8, 64] (smaller blocks waste fewer padding rows, larger ones make better matmuls; on the
    CPU-trained model in tests/data/cpu-default-model at T = 1024 every size from 8 to 128 ran within 10 %)."""
    half_mean = max(1, (T * K) // (2 * n))
    return int(min(64, max(8, 1 << (half_mean - 1).bit_length())))


def sorted_routed_experts(p: dict, cfg: ModelConfig, x, experts, weights, block_rows: int | None = None):
    """Exact sparse dispatch with static shapes (no capacity, nothing dropped).

    The T·K assignments are sorted by expert; each expert's run of rows is padded to a multiple of
    ``block_rows`` so every block belongs to one expert; a loop over the blocks runs each block through its
    expert (the weights are read in place, never gathered into a copy), and blocks past the last used one
    are skipped. Σ_e ceil(count_e / B) ≤ (T·K + N·(B-1)) / B bounds the number of blocks statically.
    Invalid slots (id < 0) sort last and land in a dummy row. Results are combined in float32.

    Under ``jax.vmap`` with expert weights shared by every lane (a sweep over routing policies, a training
    batch) the mapped axis is folded into the tokens: one sort over all lanes' assignments, each expert's
    weights read once per block for all lanes (mapping the loop instead would turn its skip into a select
    and gather a copy of the weights per lane and block: 9x slower at 4 lanes on the default model)."""
    stack = {k: p[k] for k in ("gate", "up", "down", *EXPERT_BIASES) if k in p}
    return _sorted_dispatch_op(cfg.expert_act, block_rows)(stack, x, experts, weights)


def lane_folding(plain, again):
    """``plain(w, x, experts, weights)`` as a ``custom_vmap`` whose batching rule folds the mapped axis into
    the tokens when the weights ``w`` are shared by every lane (a sweep over routing policies, a training
    batch): one dispatch over all lanes' assignments, each expert's weights read once for all lanes
    (mapping the dispatch instead would gather a copy of the weights per lane, or turn a ``lax.switch`` into
    running every expert). ``again()`` is what the folded call runs (the final op, so an outer vmap folds
    its lanes in as well); weights that differ per lane map ``plain``."""
    op = jax.custom_batching.custom_vmap(plain)

    @op.def_vmap
    def _fold_lanes(axis_size, in_batched, w, x, experts, weights):
        w_b, x_b, e_b, g_b = in_batched
        if any(jax.tree.leaves(w_b)):  # weights differ per lane: nothing to share, map the plain function
            axes = (jax.tree.map(lambda b: 0 if b else None, w_b), *(0 if b else None for b in (x_b, e_b, g_b)))
            return jax.vmap(plain, in_axes=axes)(w, x, experts, weights), True
        lanes = [a if b else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, b in ((x, x_b), (experts, e_b),
                                                                                      (weights, g_b))]
        x, experts, weights = (a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in lanes)
        y = again()(w, x, experts, weights)
        return y.reshape(axis_size, -1, y.shape[-1]), True

    return op


@functools.lru_cache(maxsize=None)
def _sorted_dispatch_op(act, block_rows: int | None):
    """``_sorted_dispatch`` with the lane-folding batching rule and a reverse-mode rule (``custom_vmap``
    alone has none): the backward pass is the plain function's own VJP."""

    def plain(w, x, experts, weights):
        return _sorted_dispatch(act, w, x, experts, weights, block_rows)

    folding = lane_folding(plain, lambda: op)  # op, not plain: an outer vmap folds its lanes in as well

    def fwd(w, x, experts, weights):
        return folding(w, x, experts, weights), (w, x, experts, weights)

    def bwd(res, g):
        w, x, experts, weights = res
        _, pull = jax.vjp(lambda w, x, weights: plain(w, x, experts, weights), w, x, weights)
        dw, dx, dweights = pull(g)
        return dw, dx, None, dweights

    op = jax.custom_vjp(folding)
    op.defvjp(fwd, bwd)
    return op


def _sorted_dispatch(act, p: dict, x, experts, weights, block_rows: int | None):
    """The sorted layout itself (see ``sorted_routed_experts``); ``p`` holds the stacked gate/up/down (and
    GPT-OSS's biases)."""
    T, K = experts.shape
    n, D = p["gate"].shape[0], x.shape[-1]
    B = block_rows or sorted_block_rows(T, K, n)
    A = T * K
    nb = (A + n * (B - 1)) // B
    flat = experts.reshape(-1)
    key = jnp.where(flat >= 0, flat, n)  # invalid sort last
    order = jnp.argsort(key, stable=True)
    sorted_e = key[order]
    counts = jnp.zeros(n + 1, jnp.int32).at[key].add(1)[:n]
    blocks = (counts + B - 1) // B
    blocks_end = jnp.cumsum(blocks)
    first_row = (blocks_end - blocks) * B
    first_sorted = jnp.cumsum(counts) - counts
    e = jnp.minimum(sorted_e, n - 1)
    row = jnp.where(sorted_e < n, first_row[e] + jnp.arange(A) - first_sorted[e], nb * B)
    tok = order // K
    xin = jnp.zeros((nb * B + 1, D), x.dtype).at[row].set(x[tok])[:-1].reshape(nb, B, D)
    block_expert = jnp.minimum(jnp.searchsorted(blocks_end, jnp.arange(nb), side="right"), n - 1)
    used = blocks_end[-1]

    def run_block(b, out):
        def compute(o):
            ex = block_expert[b]
            w = [jax.lax.dynamic_index_in_dim(p[k], ex, 0, keepdims=False) for k in ("gate", "up", "down",
                                                                                    *EXPERT_BIASES) if k in p]
            return jax.lax.dynamic_update_index_in_dim(o, _expert_mlp_act(act, xin[b], *w).astype(o.dtype), b, 0)
        return jax.lax.cond(b < used, compute, lambda o: o, out)

    y = jax.lax.fori_loop(0, nb, run_block, jnp.zeros((nb, B, D), x.dtype)).reshape(nb * B, D)
    y = jnp.concatenate([y, jnp.zeros((1, D), y.dtype)])
    w = jnp.where(flat >= 0, weights.reshape(-1), 0)[order].astype(jnp.float32)
    out = jnp.zeros((T, D), jnp.float32).at[tok].add(y[row].astype(jnp.float32) * w[:, None])
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------- expert parallelism
def sharded_routed_experts(shards: layout.ExpertShards, cfg: ModelConfig, x, experts, weights, biases=None):
    """``routed_experts`` with the experts split over the devices of ``shards.mesh`` (expert parallelism):
    every device holds N / devices experts and the (replicated) tokens, runs the assignments that fall on
    its own experts through the usual exact paths (the others masked as dropped slots), and the devices'
    shares are summed in float32 (``psum``); the result is replicated. The same model as one device up to
    the order of that sum. ``biases`` (GPT-OSS's tables, ``expert_biases``) are spread as the experts are."""
    from jax.sharding import PartitionSpec as P

    axis = shards.axis

    def local(stacks, x, experts, weights):
        n_local = stacks["gate"].shape[0]
        ids = experts - jax.lax.axis_index(axis) * n_local
        mine = (experts >= 0) & (ids >= 0) & (ids < n_local)
        y = routed_experts(stacks, cfg, x, jnp.where(mine, ids, -1), jnp.where(mine, weights, 0).astype(weights.dtype))
        return jax.lax.psum(y.astype(jnp.float32), axis)

    spread, whole = P(axis), P()
    stacks = {**shards.stacks(), **(biases or {})}
    out = jax.shard_map(local, mesh=shards.mesh, in_specs=(jax.tree.map(lambda _: spread, stacks), whole, whole, whole),
                        out_specs=whole, check_vma=False)(stacks, x, experts, weights)
    return out.astype(x.dtype)


# ------------------------------------------------------------------------------- serving-layout experts
def switched_routed_experts(experts_list: layout.ExpertList, cfg: ModelConfig, x, experts, weights,
                            block_rows: int | None = None, biases: dict | None = None):
    """``routed_experts`` for the serving layout: each expert's matrices are their own buffers and
    ``lax.switch`` on the expert id hands them to the matmuls, so nothing is gathered or copied and the
    bytes read are those of the experts chosen (in their stored dtype).

    One token (decode): a loop over its K experts. More tokens: the T·K assignments are sorted by expert
    and a loop over the experts runs each one's rows in chunks of ``block_rows`` (a dynamic number of
    chunks: an unused expert costs nothing, a used one is read once per chunk). Exact; results are
    combined in float32. Under ``jax.vmap`` with shared weights the mapped axis is folded into the tokens
    (a mapped ``lax.switch`` would run every expert on every lane). Not differentiable (the chunk loop has
    a traced trip count): training uses the canonical layout. ``biases``: GPT-OSS's bias tables aligned with
    the list (``expert_biases``)."""
    return _switched_op(cfg.expert_act, block_rows)((experts_list, biases), x, experts, weights)


#: chunk sizes of the grouped loop: multiples of 8 outside ``layout.SLOW_BF16_ROWS`` (64 rows of a bf16 expert ran
#: at half the speed of 72 or 80: the OLMoE-1B-7B-shaped teacher-forced pass took 1.9 s a 1,024-token chunk with
#: 64-row chunks, 1.42-1.54 s with any of 48-120; ``python bench/bench_row_counts.py``)
GROUPED_BLOCKS = (8, 16, 24, 32, 48, 56, 72, 80, 96, 112, 128)


def grouped_block_rows(T: int, K: int, n: int) -> int:
    """Rows per chunk of the grouped loop: room for an expert's assignments at the mean plus two standard
    deviations (an expert's count is about Poisson), split into as few chunks of at most 128 rows as that needs,
    each rounded up to the next ``GROUPED_BLOCKS`` size. Most experts then run in one or two chunks with little
    padding, and no chunk has a row count XLA:CPU's matmul library runs at half speed."""
    mean = T * K / n
    need = mean + 2 * math.sqrt(mean)
    per_chunk = need / math.ceil(need / GROUPED_BLOCKS[-1])
    return next(b for b in GROUPED_BLOCKS if b >= per_chunk - 1e-9)


def _expert_rows(act, rows: jax.Array, gate_up: jax.Array, down: jax.Array, gate_up_bias=None,
                 down_bias=None, product=layout.nt_dot) -> jax.Array:
    """One serving-layout expert on rows [R, D] -> [R, D] float32; rounded after each matmul (and bias) to the
    rows' dtype as the canonical path (and Hugging Face) round. ``product(x, w)`` is x @ w.T: ``layout.nt_dot``
    on one expert's matrices, or ``layout.nt_dot_at`` bound to expert e of a stacked list's [N, ., .] stacks
    (read in place for one row on the CPU): the same arithmetic either way."""
    f = gate_up.shape[-2] // 2
    gu = _plus(product(rows, gate_up).astype(rows.dtype), gate_up_bias)
    h = glu(act, gu[:, :f], gu[:, f:])
    return _plus(product(h, down).astype(rows.dtype), down_bias).astype(jnp.float32)


def _stacked_expert_rows(act, rows: jax.Array, el: layout.ExpertList, e, gate_up_bias=None,
                         down_bias=None) -> jax.Array:
    """``_expert_rows`` of expert ``e`` (traced) of a stacked list."""
    return _expert_rows(act, rows, el.gate_up, el.down, gate_up_bias, down_bias,
                        product=lambda x, stack: layout.nt_dot_at(x, stack, e))


@functools.partial(jax.jit, static_argnums=0)
def _expert_rows_once(act, rows: jax.Array, gate_up: jax.Array, down: jax.Array, gate_up_bias=None,
                      down_bias=None) -> jax.Array:
    """``_expert_rows`` behind ``jit``, for ``_expert_branches``: ``lax.switch`` traces one branch per expert in
    every MoE layer's program (64 experts x 8 layers x 2 programs for the default model), and a branch that
    calls this reuses one trace for all of them (the default model's first ``generate`` spent 4.3 s of its 11
    tracing the same expert computation again and again). XLA inlines the call: the same arithmetic."""
    return _expert_rows(act, rows, gate_up, down, gate_up_bias, down_bias)


def _expert_branches(act, n: int) -> list:
    """``lax.switch`` branches: expert e's computation on (rows, ExpertList, bias tables or None); branch n
    returns zeros. A stacked list needs none: ``_one_expert`` indexes it."""
    def one(e):
        return lambda rows, el, b: _expert_rows_once(act, rows, *el.expert(e), *_gate_up_bias(b, e))

    def none(rows, el, b):
        return jnp.zeros((rows.shape[0], el.down[0].shape[0]), jnp.float32)

    return [one(e) for e in range(n)] + [none]


#: one expert's bytes up to which the grouped (many-token) loop copies the expert out of its list and runs one
#: shared computation on the copy, instead of computing inside a ``lax.switch`` branch per expert. XLA compiles
#: every branch separately: the default model's prompt program held 8 x 64 expert computations and took ~5 s
#: of the first ``generate``'s ~17 s to compile; with the copy the loop body is compiled once per layer, and
#: at this size the copy (once per chunk of rows) costs nothing measurable (bench/bench_teacher_forced.py).
#: Larger experts (every real model's: OLMoE 12.6 MB, Mixtral 352 MB) keep the in-place branches. Decode
#: (one row) keeps its branches at every size: a copy per expert and token slowed the default model's decode.
COPY_EXPERT_MAX_BYTES = 1 << 20


def copies_experts(el: layout.ExpertList) -> bool:
    """Whether the grouped loop runs ``el``'s experts on a copy (``COPY_EXPERT_MAX_BYTES``)."""
    return layout.matrix_nbytes(el.gate_up[0]) + layout.matrix_nbytes(el.down[0]) <= COPY_EXPERT_MAX_BYTES


def _expert_copy(el: layout.ExpertList, e):
    """Expert ``e``'s ``(gate_up, down)`` (traced ``e`` in [0, N)): a ``lax.switch`` whose branches only hand
    out a buffer, so XLA copies it instead of compiling a computation per expert."""
    return jax.lax.switch(e, [functools.partial(lambda i, el: el.expert(i), i) for i in range(el.n_experts)], el)


def _one_expert(act, branches: list | None, el: layout.ExpertList, x, e, biases=None):
    """Expert ``e``'s output on one token's row (``_expert_branches``, or the stack indexed; zeros for ``e`` < 0):
    the one computation ``one_token_expert_sum`` and ``one_token_expert_rows`` share, so their rows are the same
    bits."""
    if el.stacked:
        def compute(x, el, e, biases):
            return _stacked_expert_rows(act, x, el, e, *_gate_up_bias(biases, e))

        return jax.lax.cond(e >= 0, compute, lambda x, el, e, biases: jnp.zeros((x.shape[0], x.shape[-1]),
                                                                                 jnp.float32), x, el, e, biases)
    return jax.lax.switch(jnp.where(e >= 0, e, len(branches) - 1), branches, x, el, biases)


def one_token_expert_sum(act, el: layout.ExpertList, x, experts, weights, early_rows=None, early=None,
                         biases: dict | None = None):
    """One token's Σ_k weights[0,k] · E_{experts[0,k]}(x), a float32 sum in k order rounded to x's dtype
    (``switched_routed_experts`` for T = 1). ``early_rows`` [K, D] / ``early`` [K]: outputs computed before
    (``one_token_expert_rows``, e.g. while the other experts were still being paged in) are taken for the
    positions ``early`` marks, whose ``experts`` entry is then -1; the sum is the same, bit for bit.
    ``biases``: GPT-OSS's bias tables aligned with ``el`` (``expert_biases``)."""
    branches = None if el.stacked else _expert_branches(act, el.n_experts)

    def body(k, acc):
        y = _one_expert(act, branches, el, x, experts[0, k], biases)
        if early_rows is not None:
            y = jnp.where(early[k], early_rows[k][None], y)
        return acc + y * weights[0, k].astype(jnp.float32)

    out = jax.lax.fori_loop(0, experts.shape[1], body, jnp.zeros((1, x.shape[-1]), jnp.float32))
    return out.astype(x.dtype)


def one_token_expert_rows(act, el: layout.ExpertList, x, experts, biases: dict | None = None):
    """Each of one token's K expert outputs [K, D] float32 (zero where ``experts[0,k]`` < 0), as
    ``one_token_expert_sum`` computes them: the part of the sum that can run before the rest is ready."""
    K = experts.shape[1]
    branches = None if el.stacked else _expert_branches(act, el.n_experts)

    def body(k, rows):
        return rows.at[k].set(_one_expert(act, branches, el, x, experts[0, k], biases)[0])

    return jax.lax.fori_loop(0, K, body, jnp.zeros((K, x.shape[-1]), jnp.float32))


def _switched_sorted_rows(act, el: layout.ExpertList, x, experts, B: int, biases: dict | None = None):
    """The grouped loop of ``_switched_grouped``: every valid assignment's expert output, float32, in
    expert-sorted order (invalid ones zero, at the end). Returns (rows [T·K, D], order, tokens of the rows)."""
    T, K = experts.shape
    n, D = el.n_experts, x.shape[-1]
    A = T * K
    flat = experts.reshape(-1)
    key = jnp.where(flat >= 0, flat, n)  # invalid sort last and belong to no expert
    order = jnp.argsort(key, stable=True)
    counts = jnp.zeros(n + 1, jnp.int32).at[key].add(1)
    starts = jnp.cumsum(counts) - counts
    tok = order // K
    xs = jnp.concatenate([x[tok], jnp.zeros((B, D), x.dtype)])  # a chunk may read past the last row
    if el.stacked:
        def expert_on(e, rows):
            return _stacked_expert_rows(act, rows, el, e, *_gate_up_bias(biases, e))
    elif copies_experts(el):
        def expert_on(e, rows):
            return _expert_rows(act, rows, *_expert_copy(el, e), *_gate_up_bias(biases, e))
    else:
        branches = _expert_branches(act, n)[:n]

        def expert_on(e, rows):
            return jax.lax.switch(e, branches, rows, el, biases)

    def per_expert(e, y):
        start_e, end_e = starts[e], starts[e] + counts[e]

        def chunk(j, y):
            start = start_e + j * B
            rows = jax.lax.dynamic_slice_in_dim(xs, start, B)
            out = expert_on(e, rows)
            keep = (start + jnp.arange(B) < end_e)[:, None]  # rows past this expert's run are the next's
            return jax.lax.dynamic_update_slice_in_dim(
                y, jnp.where(keep, out, jax.lax.dynamic_slice_in_dim(y, start, B)), start, 0)

        return jax.lax.fori_loop(0, (counts[e] + B - 1) // B, chunk, y)

    y = jax.lax.fori_loop(0, n, per_expert, jnp.zeros((A + B, D), jnp.float32))[:A]
    return y, order, tok


def _combine_sorted(y, order, tok, experts, weights, dtype):
    """Σ_k weights · rows per token, rows ``y`` in the expert-sorted ``order`` (float32 sums, in that order)."""
    T, D = experts.shape[0], y.shape[-1]
    w = jnp.where(experts.reshape(-1) >= 0, weights.reshape(-1), 0)[order].astype(jnp.float32)
    out = jnp.zeros((T, D), jnp.float32).at[tok].add(y * w[:, None])
    return out.astype(dtype)


def _switched_grouped(act, el: layout.ExpertList, x, experts, weights, block_rows: int | None, biases=None):
    T, K = experts.shape
    B = block_rows or grouped_block_rows(T, K, el.n_experts)
    y, order, tok = _switched_sorted_rows(act, el, x, experts, B, biases)
    return _combine_sorted(y, order, tok, experts, weights, x.dtype)


def switched_expert_rows(el: layout.ExpertList, cfg: ModelConfig, x, experts, block_rows: int,
                         biases: dict | None = None):
    """Each assignment's expert output [T·K, D] float32, in assignment order (row t·K + k), zero where
    ``experts`` < 0. Rows computed in several calls over disjoint assignments (different expert lists: slots,
    staging buffers) add up exactly, and ``combine_expert_rows`` then sums them per token in the order
    ``switched_routed_experts`` does, so the result is that of one call over all the experts (given the same
    ``block_rows``: a row's arithmetic is that of the chunk size)."""
    y, order, _ = _switched_sorted_rows(cfg.expert_act, el, x, experts, block_rows, biases)
    return jnp.zeros_like(y).at[order].set(y)


def combine_expert_rows(rows, experts, weights, dtype):
    """``switched_routed_experts``'s weighted sum of per-assignment ``rows`` [T·K, D] (assignment order)
    for the assignments' real expert ids ``experts`` [T, K]: sorted by expert id as it sorts them."""
    flat = experts.reshape(-1)
    order = jnp.argsort(jnp.where(flat >= 0, flat, jnp.iinfo(jnp.int32).max), stable=True)
    return _combine_sorted(rows[order], order, order // experts.shape[1], experts, weights, dtype)


@functools.lru_cache(maxsize=None)
def _switched_op(act, block_rows: int | None):
    """The serving-layout dispatch with the lane-folding batching rule (``lane_folding``); its weights are the
    pair (ExpertList, bias tables or None)."""

    def plain(w, x, experts, weights):
        el, biases = w
        if experts.shape[0] == 1:
            return one_token_expert_sum(act, el, x, experts, weights, biases=biases)
        return _switched_grouped(act, el, x, experts, weights, block_rows, biases)

    op = lane_folding(plain, lambda: op)
    return op


def queue_positions(a: jax.Array, n: int) -> jax.Array:
    """Each entry's place in its value's queue, in order: ``a`` [M] int in [0, n) -> [M], 0 for the first
    entry with its value, 1 for the second... One stable sort, not the running count of a one-hot [M, n]
    matrix: 2x faster on the CPU at a 64x1024 batch, top-8 of 64, and no [M, n] intermediate (134 MB there)."""
    order = jnp.argsort(a, stable=True)
    counts = jnp.bincount(a, length=n)
    starts = jnp.cumsum(counts) - counts
    ranked = jnp.arange(a.shape[0], dtype=a.dtype) - starts[a[order]].astype(a.dtype)
    return jnp.zeros_like(a).at[order].set(ranked)


def capacity_experts(p: dict, cfg: ModelConfig, x: jax.Array, experts: jax.Array, weights: jax.Array,
                     capacity: int) -> tuple[jax.Array, jax.Array]:
    """Capacity-based sparse MoE over S tokens (training; drops assignments past the capacity): x [S, D], experts/weights [S, K].

    Assignments are queued per expert, first choices of all tokens before second choices (Switch
    priority); each expert takes at most ``capacity`` of them, computed as one batched matmul over
    [N, capacity, D]. Returns (output [S, D], fraction of assignments dropped). With
    ``capacity >= S`` nothing is dropped and the result equals ``routed_experts``."""
    S, K = experts.shape
    N, D = cfg.n_experts, x.shape[-1]
    a = experts.T.reshape(-1)  # [K*S], k-major
    tok = jnp.tile(jnp.arange(S), K)
    w = weights.T.reshape(-1)
    pos = queue_positions(a, N)
    keep = pos < capacity
    slot = jnp.where(keep, a * capacity + pos, N * capacity)  # dropped -> a dummy slot
    xin = jnp.zeros((N * capacity + 1, D), x.dtype).at[slot].set(x[tok])[:-1].reshape(N, capacity, D)
    gb, ub, db = (p[k][:, None] if k in p else None for k in EXPERT_BIASES)
    h = glu(cfg.expert_act, _plus(jnp.einsum("ecd,edf->ecf", xin, p["gate"]), gb),
            _plus(jnp.einsum("ecd,edf->ecf", xin, p["up"]), ub))
    y = _plus(jnp.einsum("ecf,efd->ecd", h, p["down"]), db).reshape(N * capacity, D)
    y = jnp.concatenate([y, jnp.zeros((1, D), y.dtype)])
    contrib = y[slot] * (w * keep).astype(y.dtype)[:, None]
    return jnp.zeros((S, D), y.dtype).at[tok].add(contrib), jnp.mean(~keep)


def router_logits(p: dict, x: jax.Array) -> jax.Array:
    """[T, N] float32 router logits (DeepSeek computes them in float32; equal for fp32 weights), + GPT-OSS's bias."""
    z = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)
    return z + p["router_bias"].astype(jnp.float32) if "router_bias" in p else z


def shared_experts(p: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return combine_shared(*shared_expert_parts(p, cfg, x))


def shared_expert_parts(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple:
    """The shared experts' MLP output and their sigmoid gate (Qwen2-MoE; None without one), apart: a caller that
    computes them early (the host pager) applies the gate where ``shared_experts`` would, so that XLA fuses the
    product into the same sum and rounds it the same way."""
    gate = jax.nn.sigmoid(x @ p["shared_gate"]) if "shared_gate" in p else None
    return dense_mlp(p["shared"], cfg, x), gate


def combine_shared(y: jax.Array, gate) -> jax.Array:
    return y if gate is None else gate * y
