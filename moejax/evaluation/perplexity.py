"""WikiText-2 perplexity with any routing policy, expert cache or offloading (paper §4.2, docs/design.md §2).

The raw test text (``test.txt`` is the rows joined by blank lines) is tokenised as one string and cut into
consecutive chunks of ``context - 1`` tokens; each chunk gets the model's BOS token in front, so every text
token is predicted exactly once and the totals give perplexity per token, per word (whitespace-separated
words of the raw text) and bits per byte (UTF-8). The routing policy and the expert cache act on every
token in order: token t routes with the cache state left by token t−1, carried across chunks. The sweep
engine (``sweep``) and the command line (``evaluate``) build on these functions.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import numpy as np

from moejax.base import errors, paths
from moejax.base.typecheck import is_integer
from moejax.models import gating
from moejax.runtime import api, simulate
from moejax.runtime import offload as offload_lib

def load_wikitext(path: str | None = None) -> str:
    """WikiText-2 raw test text from ``path``, else ``paths.wikitext_test()`` (``$MOEJAX_WIKITEXT`` or
    ``$MOEJAX_DATA``), else the Hugging Face ``datasets`` copy."""
    path = path or paths.wikitext_test()
    if path is None:
        return hf_wikitext("test", "WikiText-2 test text", "--data PATH/TO/wikitext-2-raw-v1/test.txt")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise errors.Failure(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        if not text.strip():
            raise errors.Failure(f"{path} holds no text to score")
        return text
    if os.path.exists(path):  # a folder, a device, a pipe: never read (/dev/zero would fill memory)
        raise errors.Failure(f"WikiText file {path} is not a regular file")
    raise FileNotFoundError(f"WikiText file {path} does not exist")


def hf_wikitext(split: str, wanted: str, option: str) -> str:
    """WikiText-2 raw ``split`` through HF ``datasets`` (the usual recipe where the network is), its rows joined
    by blank lines, or an error naming both ways to give the text: ``wanted`` is what the caller needs it for,
    ``option`` the command-line option that gives it instead."""
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"no {wanted}: pass {option} (or set ${paths.DATA_ENV}), or install HF datasets "
                                f"to fetch it ({paths.DATA_EXTRA})") from None
    try:
        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)["text"]
    except Exception as e:  # noqa: BLE001 - report the real cause, with the other way
        raise FileNotFoundError(f"the HF datasets copy of WikiText-2's {split} split failed ({type(e).__name__}: "
                                f"{e}); pass {option}") from e
    return "\n\n".join(rows)


def chunk_tokens(ids: np.ndarray, context: int, bos: int | None) -> list[np.ndarray]:
    """Consecutive chunks; with a BOS each chunk is [BOS] + context-1 text tokens (all predicted)."""
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    step = context - 1 if bos is not None else context
    chunks = [ids[i:i + step] for i in range(0, len(ids), step)]
    if bos is not None:
        return [np.concatenate([[bos], c]).astype(np.int32) for c in chunks]
    return [c.astype(np.int32) for c in chunks if len(c) > 1]


def token_nll(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Negative log-likelihood (nats) of ids[1:] under logits[:-1]."""
    z = logits[:-1].astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -logp[np.arange(len(ids) - 1), ids[1:]]


def expert_counts(experts: np.ndarray, n_experts: int) -> np.ndarray:
    """How often each expert was chosen, per layer [L, N], in one pass's ``experts`` [L, T, K] (-1 = none)."""
    e = np.asarray(experts)
    return np.stack([np.bincount(layer[layer >= 0], minlength=n_experts) for layer in e]).astype(np.int64)


REUSE_FIELDS = ("reused", "chosen", "pairs_sharing", "pairs")


def reuse_counts(experts: np.ndarray) -> np.ndarray:
    """Temporal locality of one pass's routing, per layer [L, 4] (``REUSE_FIELDS``), over consecutive tokens
    t-1, t of ``experts`` [L, T, K] (ids, -1 = none): the experts token t chose that token t-1 also chose,
    the experts token t chose, the pairs that share at least one expert, and the pairs. Summed over passes,
    it is what an LRU cache of a few experts can exploit (the papers' premise)."""
    e = np.asarray(experts)
    if e.shape[1] < 2:
        return np.zeros((e.shape[0], len(REUSE_FIELDS)), np.int64)
    prev, cur = e[:, :-1, :, None], e[:, 1:, None, :]
    reused = ((prev == cur) & (cur >= 0)).any(axis=2).sum(-1)  # [L, T-1]: token t's experts seen at t-1
    chosen = (e[:, 1:] >= 0).sum(-1)
    return np.stack([reused.sum(-1), chosen.sum(-1), (reused > 0).sum(-1),
                     np.full(e.shape[0], e.shape[1] - 1)], axis=-1).astype(np.int64)


def expert_usage(counts: np.ndarray, reuse: np.ndarray | None = None) -> dict:
    """Per-layer share of routed tokens per expert and usage entropy (bits; uniform = log2 N); with ``reuse``
    (summed ``reuse_counts``) also the consecutive-token reuse: ``reuse`` = the share of a token's experts
    that the previous token also chose, ``reuse_any`` = the share of consecutive tokens that share an
    expert, and ``reuse_independent`` = the first for tokens routed independently with these usage shares
    (K·Σ share², = K/N when uniform): reuse above it is temporal locality, not imbalance."""
    shares = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(shares > 0, shares * np.log2(shares), 0.0), axis=-1)
    n = counts.shape[-1]
    usage = {"entropy_bits": ent.tolist(), "entropy_max_bits": math.log2(n),
             "normalized_entropy": (ent / math.log2(n)).tolist(), "share": shares.tolist(),
             "dead_experts": int((counts == 0).sum()), "max_share_over_uniform": float(shares.max() * n)}
    if reuse is not None and reuse[:, 3].sum() > 0:
        reused, chosen, sharing, pairs = (reuse[:, i].astype(np.float64) for i in range(4))
        k = chosen / np.maximum(pairs, 1)  # experts per token (K; less where some were dropped)
        usage.update(reuse=(reused / np.maximum(chosen, 1)).tolist(),
                     reuse_any=(sharing / np.maximum(pairs, 1)).tolist(),
                     reuse_independent=(k * (shares ** 2).sum(-1)).tolist())
    return usage


def _perplexity(mean_nll: float, per: str) -> float:
    """e^mean_nll; a ``gating.NonFiniteError`` where that is past the largest float (a mean NLL over ~709 nats:
    random or broken weights), instead of Python's bare OverflowError or an infinite result."""
    if not mean_nll < math.log(sys.float_info.max):
        raise gating.NonFiniteError(f"the perplexity per {per} overflows: the mean negative log-likelihood is "
                                    f"{mean_nll:.4g} nats per {per} (e^{mean_nll:.4g} is past the largest float); "
                                    "the model's predictions are far off (random or damaged weights?)")
    return math.exp(mean_nll)


def perplexity_result(text: str, ids: np.ndarray, context: int, n_chunks: int, nll_sum: float, n_pred: int,
                      counts: np.ndarray, reuse: np.ndarray | None = None) -> dict[str, Any]:
    """Perplexity per token / word and bits per byte from the summed NLL of the ``n_pred`` predicted tokens
    of ``ids`` (the tokens of ``text``), plus expert usage from the per-layer selection ``counts`` [L, N]
    and consecutive-token ``reuse`` [L, 4] (``reuse_counts``)."""
    n_text_tokens = len(ids)
    # without a BOS the first token of each chunk is not predicted: scale by the mean NLL
    total_nll = nll_sum if n_pred == n_text_tokens else nll_sum / max(n_pred, 1) * n_text_tokens
    words = len(text.split())
    n_bytes = len(text.encode("utf-8"))
    return {
        "task": "wikitext", "context": context, "chunks": n_chunks, "tokens": n_text_tokens,
        "predicted_tokens": n_pred, "words": words, "bytes": n_bytes,
        "nll_per_token": nll_sum / max(n_pred, 1),
        "ppl": _perplexity(nll_sum / max(n_pred, 1), "token"),
        "ppl_word": _perplexity(total_nll / max(words, 1), "word"),
        "bits_per_byte": total_nll / math.log(2) / max(n_bytes, 1),
        "expert_usage": expert_usage(counts, reuse),
    }


def wikitext_perplexity(model: api.Model, text: str, context: int = 1024, max_tokens: int | None = None,
                        routing=None, cache=None, progress: bool = False, offload=None) -> dict[str, Any]:
    """Perplexity of ``text`` (see module docstring); cache metrics when a routing policy or cache is given;
    ``offload`` (``offload.OffloadConfig``) pages the experts for real (``result["offload"]``)."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer.json: WikiText evaluation needs one")
    if max_tokens is not None and (not is_integer(max_tokens) or max_tokens < 1):
        raise ValueError(f"max_tokens must be an integer >= 1 or None, got {max_tokens!r}")
    if max_tokens is not None:
        ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)[:max_tokens]
        text = model.tokenizer.decode(ids, skip_special_tokens=False)  # the text actually scored
    else:
        ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)
    return perplexity_of_ids(model, text, ids, context, routing, cache, progress, offload)


def perplexity_of_ids(model: api.Model, text: str, ids: np.ndarray, context: int, routing=None, cache=None,
                      progress: bool = False, offload=None) -> dict[str, Any]:
    """``wikitext_perplexity`` of already tokenised ``ids`` (``text``: what they decode to)."""
    if not is_integer(context) or context < 2:
        raise ValueError(f"context must be an integer >= 2, got {context!r}")
    least = 1 if model.cfg.bos_token_id is not None else 2  # BOS predicts the first token
    if len(ids) < least:  # nothing to predict: a perplexity of 1 would read as a perfect model
        raise ValueError(f"the text has {len(ids)} token(s): nothing to predict, no perplexity")
    model.cfg.check_context(context)
    bos = model.cfg.bos_token_id
    chunks = chunk_tokens(ids, context, bos)
    simulating = routing is not None or cache is not None or offload is not None
    state = model.router_state(routing, cache) if simulating else None
    extra = {} if offload is None else {"offload": offload}
    nll_sum, n_pred = 0.0, 0
    counts = np.zeros((model.cfg.n_moe_layers, model.cfg.n_experts), np.int64)
    reuse = np.zeros((model.cfg.n_moe_layers, len(REUSE_FIELDS)), np.int64)
    offload_chunks = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc="wikitext", unit="tok", file=sys.stderr)
    for chunk in chunks:
        out = model.forward(chunk, state=state, **extra) if simulating else model.forward(chunk)
        if simulating:
            state = out.state
        if offload is not None:
            offload_chunks.append((len(chunk), out.stats["offload"]))
        nll = token_nll(out.logits, chunk)
        nll_sum += float(nll.sum())
        n_pred += len(nll)
        counts += expert_counts(out.experts, model.cfg.n_experts)
        reuse += reuse_counts(out.experts)
        if bar:
            bar.update(len(nll))
    if bar:
        bar.close()
    result: dict[str, Any] = perplexity_result(text, ids, context, len(chunks), nll_sum, n_pred, counts, reuse)
    if simulating:
        stats = simulate.summarize(state, model.params, model.cfg)
        result.update(miss_rate=stats["miss_rate"], lifetime=stats["lifetime_mean"],
                      lifetime_std=stats["lifetime_std"], bytes_per_token=stats.get("bytes_per_token"),
                      cache=stats)
    if offload_chunks:
        result["offload"] = offload_lib.merge_summaries(offload_chunks)
    return result
