"""A tiny WikiText-style corpus and a prepared data folder, shared by test_data and test_train."""

from __future__ import annotations

import gzip
import os
import random

WORDS = ("the city river king army church school war team song album film station village county "
         "north south first second new old large small early late").split()
VERBS = "was is became built won played released founded moved served".split()


def synthetic_doc(rng: random.Random, title: str) -> str:
    lines = [" ", f" = {title} = ", " "]
    for _ in range(rng.randint(2, 4)):
        sents = []
        for _ in range(rng.randint(2, 5)):
            a, b, c = rng.choice(WORDS), rng.choice(VERBS), rng.choice(WORDS)
            year = rng.randint(1800, 2015)
            sents.append(f"The {a} {b} the {c} in {year} , with 1 @,@ {rng.randint(100, 999)} people .")
        lines.append(" " + " ".join(sents) + " ")
        lines.append(" ")
        if rng.random() < 0.5:
            lines.append(f" = = {rng.choice(WORDS).title()} = = ")
            lines.append(" ")
    return "\n".join(lines) + "\n"


def write_corpus(folder: str, n_shards: int = 3, docs_per_shard: int = 40, seed: int = 0) -> list[str]:
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for s in range(n_shards):
        path = os.path.join(folder, f"enwiki-2015-wikitext-style-{s:02d}.txt.gz")
        with gzip.open(path, "wt", encoding="utf-8") as f:
            for d in range(docs_per_shard):
                f.write(synthetic_doc(rng, f"Article {s} {d}"))
        paths.append(path)
    return paths
