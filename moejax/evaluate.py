"""Language-modelling evaluation: WikiText-2 perplexity with any routing policy and expert cache.

    python -m moejax.evaluate --model default --task wikitext [--context 1024] [--max-tokens N] [--json]
    python -m moejax.evaluate --model PATH --routing cache-prior --lam 0.5 --cache-size 0.5

Protocol (paper §4.2, DESIGN §2): the raw test text (``test.txt`` is the rows joined by blank lines) is
tokenised as one string and cut into consecutive chunks of ``context - 1`` tokens; each chunk gets the
model's BOS token in front, so every text token is predicted exactly once and the totals give
perplexity per token, per word (whitespace-separated words of the raw text) and bits per byte (UTF-8).
The routing policy and the expert cache act on every token in order: token t routes with the cache
state left by token t−1, carried across chunks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import numpy as np

from moejax import api, cli_options

SHARED_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
WIKITEXT_TEST = os.path.join(SHARED_DATA, "wikitext-2-raw-v1", "test.txt")


def load_wikitext(path: str | None = None) -> str:
    """WikiText-2 raw test text from ``path``, the repository's ``../shared/data`` copy, or HF datasets."""
    path = path or os.environ.get("MOEJAX_WIKITEXT") or WIKITEXT_TEST
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if path != WIKITEXT_TEST:
        raise FileNotFoundError(f"WikiText file {path} does not exist")
    try:  # the usual recipe, where the network is there
        import datasets

        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
        return "\n\n".join(rows)
    except Exception as e:  # noqa: BLE001 - report the real cause with the local path we looked for
        raise FileNotFoundError(f"no WikiText-2 test text at {path} and the HF datasets copy failed ({e}); "
                                "pass --data PATH/TO/test.txt") from e


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


def expert_usage(counts: np.ndarray) -> dict:
    """Per-layer share of routed tokens per expert and usage entropy (bits; uniform = log2 N)."""
    shares = counts / np.maximum(counts.sum(-1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(shares > 0, shares * np.log2(shares), 0.0), axis=-1)
    n = counts.shape[-1]
    return {"entropy_bits": ent.tolist(), "entropy_max_bits": math.log2(n),
            "normalized_entropy": (ent / math.log2(n)).tolist(), "share": shares.tolist(),
            "dead_experts": int((counts == 0).sum()), "max_share_over_uniform": float(shares.max() * n)}


def wikitext_perplexity(model: api.Model, text: str, context: int = 1024, max_tokens: int | None = None,
                        routing=None, cache=None, progress: bool = False) -> dict[str, Any]:
    """Perplexity of ``text`` (see module docstring); cache metrics when a routing policy or cache is given."""
    if model.tokenizer is None:
        raise ValueError(f"{model.path} has no tokenizer.json: WikiText evaluation needs one")
    if max_tokens is not None:
        ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)[:max_tokens]
        text = model.tokenizer.decode(ids, skip_special_tokens=False)  # the text actually scored
    else:
        ids = np.asarray(model.tokenizer.encode(text, add_special_tokens=False), np.int32)
    bos = model.cfg.bos_token_id
    chunks = chunk_tokens(ids, context, bos)
    simulate = routing is not None or cache is not None
    state = model.router_state(routing, cache) if simulate else None
    nll_sum, n_pred = 0.0, 0
    counts = np.zeros((model.cfg.n_moe_layers, model.cfg.n_experts), np.int64)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(ids), desc="wikitext", unit="tok", file=sys.stderr)
    for chunk in chunks:
        out = model.forward(chunk, state=state) if simulate else model.forward(chunk)
        if simulate:
            state = out.state
        nll = token_nll(out.logits, chunk)
        nll_sum += float(nll.sum())
        n_pred += len(nll)
        for layer in range(counts.shape[0]):
            e = out.experts[layer]
            np.add.at(counts[layer], e[e >= 0], 1)
        if bar:
            bar.update(len(nll))
    if bar:
        bar.close()
    n_text_tokens = len(ids)
    # without a BOS the first token of each chunk is not predicted: scale by the mean NLL
    total_nll = nll_sum if n_pred == n_text_tokens else nll_sum / max(n_pred, 1) * n_text_tokens
    words = len(text.split())
    n_bytes = len(text.encode("utf-8"))
    result: dict[str, Any] = {
        "task": "wikitext", "context": context, "chunks": len(chunks), "tokens": n_text_tokens,
        "predicted_tokens": n_pred, "words": words, "bytes": n_bytes,
        "nll_per_token": nll_sum / max(n_pred, 1),
        "ppl": math.exp(nll_sum / max(n_pred, 1)),
        "ppl_word": math.exp(total_nll / max(words, 1)),
        "bits_per_byte": total_nll / math.log(2) / max(n_bytes, 1),
        "expert_usage": expert_usage(counts),
    }
    if simulate:
        from moejax import simulate as sim

        stats = sim.summarize(state, model.params, model.cfg)
        result.update(miss_rate=stats["miss_rate"], lifetime=stats["lifetime_mean"],
                      lifetime_std=stats["lifetime_std"], bytes_per_token=stats.get("bytes_per_token"),
                      cache=stats)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moejax.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=api.DEFAULT_MODEL_NAME)
    p.add_argument("--task", choices=["wikitext"], default="wikitext")
    p.add_argument("--data", help="path to the task's data file (default: ../shared/data copy)")
    p.add_argument("--context", type=int, default=1024, help="chunk length in tokens, BOS included")
    p.add_argument("--max-tokens", type=int, default=None, help="score only the first N text tokens")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    cli_options.add_routing_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from moejax.checkpoint import CheckpointError
    from moejax.config import UnsupportedModelError
    from moejax.trace import json_safe

    args = build_parser().parse_args(argv)
    try:
        model = api.load(args.model)
        routing = cache = None
        if cli_options.cache_requested(args):
            routing, cache = cli_options.policy_from_args(args, model.cfg.top_k), cli_options.cache_from_args(args)
            cache.capacity(model.cfg)
        text = load_wikitext(args.data)
        res = wikitext_perplexity(model, text, args.context, args.max_tokens, routing, cache,
                                  progress=not (args.json or args.no_progress))
    except (CheckpointError, UnsupportedModelError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_safe(res)))
    else:
        print(f"wikitext  context {res['context']}  tokens {res['tokens']}  words {res['words']}")
        print(f"ppl/token {res['ppl']:.2f}  ppl/word {res['ppl_word']:.2f}  bits/byte {res['bits_per_byte']:.4f}")
        usage = res["expert_usage"]
        print("expert usage entropy (bits, max %.2f): %s" % (
            usage["entropy_max_bits"], " ".join(f"{e:.2f}" for e in usage["entropy_bits"])))
        if "miss_rate" in res:
            print(f"miss rate {res['miss_rate']:.4f}  lifetime {res['lifetime']:.2f} tokens  "
                  f"bytes/token {res['bytes_per_token']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
