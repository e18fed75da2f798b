"""Training data: the WikiText-style Wikipedia corpus, a byte-level BPE tokenizer, packed token shards.

    corpus (gzip text shards ``enwiki-2015-wikitext-style-NN.txt.gz`` in ``--corpus-dir``, default
            ``$MOEJAX_DATA/corpus``; a shard recompressed with xz, ``-NN.txt.xz``, a quarter smaller, reads the same)
      -> documents (an article starts at a ``" = Title = "`` line; streamed, never loaded whole)
      -> tokenizer.json (byte-level BPE trained with ``tokenizers``; ``<|endoftext|>`` is BOS and EOS)
      -> shard-NN.bin (uint16 token ids, every document preceded by ``<|endoftext|>``) + shard-NN.json

Everything is cached in a data folder (default ``~/.cache/moejax/data``); a shard is tokenized the first
time it is needed and written atomically. The last corpus shard is the validation split.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import lzma
import os
import re
from typing import Iterable, Iterator

import numpy as np

from moejax.base import atomic, errors, paths

EOS = "<|endoftext|>"
PAD = "<|padding|>"
SPECIAL_TOKENS = (EOS, PAD)
DEFAULT_VOCAB = 8192
DEFAULT_DATA_DIR = os.path.join(os.path.expanduser("~"), ".cache", "moejax", "data")
CORPUS_PATTERN = "enwiki-2015-wikitext-style-*.txt.gz"
CORPUS_PATTERNS = (CORPUS_PATTERN, "enwiki-2015-wikitext-style-*.txt.xz")
_TITLE = re.compile(r"^ = [^=].* = $")


# ------------------------------------------------------------------------------------------ corpus
def shard_name(path: str) -> str:
    """A shard's name without its compression (``enwiki-...-00``): what its token file is called."""
    return os.path.basename(path).split(".")[0]


def corpus_shards(corpus_dir: str) -> list[str]:
    """All corpus shard paths, sorted; the last one is the validation split."""
    found = {}
    for pattern in CORPUS_PATTERNS:
        for path in glob.glob(os.path.join(corpus_dir, pattern)):
            found.setdefault(shard_name(path), []).append(path)
    if not found:
        raise FileNotFoundError(f"no corpus shards ({' or '.join(CORPUS_PATTERNS)}) in {corpus_dir}")
    twice = sorted(name for name, ps in found.items() if len(ps) > 1)
    if twice:  # both would tokenize to the same .bin: which one is meant?
        raise ValueError(f"shard {twice[0]} is in {corpus_dir} twice (.txt.gz and .txt.xz): keep one")
    return sorted(ps[0] for ps in found.values())


def split_shards(corpus_dir: str) -> tuple[list[str], str]:
    """(training shards, validation shard)."""
    paths = corpus_shards(corpus_dir)
    if len(paths) < 2:
        raise ValueError(f"need at least 2 corpus shards in {corpus_dir} (the last is validation)")
    return paths[:-1], paths[-1]


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".xz"):
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_documents(path: str, max_chars: int | None = None) -> Iterator[str]:
    """Stream the articles of one shard (gzip, xz or plain text). A document starts at a ``" = Title = "``
    line (WikiText layout) and keeps its lines joined with newlines. ``max_chars`` stops early."""
    lines: list[str] = []
    seen = 0
    with _open_text(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if _TITLE.match(line) and any(x.strip() for x in lines):
                doc = "\n".join(lines).strip("\n") + "\n"
                yield doc
                seen += len(doc)
                if max_chars is not None and seen >= max_chars:
                    return
                lines = []
            lines.append(line)
    if any(x.strip() for x in lines):
        yield "\n".join(lines).strip("\n") + "\n"


# --------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB, min_frequency: int = 2):
    """A byte-level BPE ``tokenizers.Tokenizer``; ``<|endoftext|>`` (id 0) is prepended as BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)]),
    ])
    return tok


def tokenizer_config(model_max_length: int = 1024) -> dict:
    """``tokenizer_config.json``: what ``moejax.runtime.api.Tokenizer`` and transformers read."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS, "eos_token": EOS, "unk_token": EOS,
            "pad_token": PAD, "add_bos_token": True, "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False}


TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json")


def save_tokenizer(tok, folder: str, model_max_length: int = 1024) -> None:
    """The three tokenizer files, as one set (``atomic.together``), ``tokenizer.json`` last: it marks the set
    complete (a full disk could otherwise leave a set without ``special_tokens_map.json``, and every later run
    would fail on the missing file)."""
    os.makedirs(folder, exist_ok=True)
    with atomic.together():
        atomic.write_json(os.path.join(folder, "tokenizer_config.json"), tokenizer_config(model_max_length))
        atomic.write_json(os.path.join(folder, "special_tokens_map.json"),
                          {"bos_token": EOS, "eos_token": EOS, "unk_token": EOS, "pad_token": PAD})
        atomic.write_text(os.path.join(folder, "tokenizer.json"), tok.to_str(pretty=True))


def load_tokenizer(folder: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))


def tokenizer_sample(train_paths: list[str], chars_per_shard: int) -> Iterator[str]:
    for path in train_paths:
        yield from iter_documents(path, max_chars=chars_per_shard)


def ensure_tokenizer(data_dir: str, corpus_dir: str, vocab_size: int = DEFAULT_VOCAB,
                     chars_per_shard: int = 3_000_000, log=print):
    """Train the tokenizer on the first ``chars_per_shard`` characters of every training shard, once."""
    path = os.path.join(data_dir, "tokenizer.json")
    if os.path.isfile(path) and not all(os.path.isfile(os.path.join(data_dir, f)) for f in TOKENIZER_FILES):
        save_tokenizer(load_tokenizer(data_dir), data_dir)  # a set left incomplete (a writer not in that order)
    if not os.path.isfile(path):
        train_paths, _ = split_shards(corpus_dir)
        log(f"training a {vocab_size}-token byte-level BPE on {chars_per_shard / 1e6:.1f}M chars x "
            f"{len(train_paths)} shards ...")
        tok = train_tokenizer(tokenizer_sample(train_paths, chars_per_shard), vocab_size)
        save_tokenizer(tok, data_dir)
    return load_tokenizer(data_dir)


def tokenizer_hash(data_dir: str) -> str:
    with open(os.path.join(data_dir, "tokenizer.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


# -------------------------------------------------------------------------------------- packing
def encode_documents(tok, docs: Iterable[str], batch: int = 256) -> Iterator[np.ndarray]:
    """uint16 arrays, one per batch of documents: ``EOS doc EOS doc ...`` (the template adds the EOS)."""
    if tok.get_vocab_size() > 65535:
        raise ValueError("vocabulary too large for uint16 token files")
    buf: list[str] = []

    def flush():
        encs = tok.encode_batch(buf, add_special_tokens=True)
        return np.concatenate([np.asarray(e.ids, np.uint16) for e in encs])

    for doc in docs:
        buf.append(doc)
        if len(buf) == batch:
            yield flush()
            buf = []
    if buf:
        yield flush()


def tokenize_to_bin(tok, docs: Iterable[str], out_path: str) -> int:
    """Stream documents into a uint16 ``.bin`` file (written under a temporary name, then renamed)."""
    n = 0
    with atomic.atomic_file(out_path) as f:
        for arr in encode_documents(tok, docs):
            f.write(arr.tobytes())
            n += arr.size
    return n


def shard_bin(data_dir: str, shard_path: str, tok=None, max_chars: int | None = None, log=print) -> np.memmap:
    """The token memmap of one corpus shard, tokenizing it on first use."""
    name = shard_name(shard_path)
    suffix = "" if max_chars is None else f"-{max_chars}"
    out = os.path.join(data_dir, f"{name}{suffix}.bin")
    meta_path = out[:-4] + ".json"
    if not (os.path.isfile(out) and os.path.isfile(meta_path)):
        tok = tok or load_tokenizer(data_dir)
        log(f"tokenizing {os.path.basename(shard_path)} -> {out} ...")
        n = tokenize_to_bin(tok, iter_documents(shard_path, max_chars), out)
        atomic.write_json(meta_path, {"source": os.path.abspath(shard_path), "tokens": n, "max_chars": max_chars,
                                      "tokenizer": tokenizer_hash(data_dir)})
    return np.memmap(out, dtype=np.uint16, mode="r")


class TokenData:
    """Training and validation token streams over a cached data folder.

    Training sequences are windows of ``seq_len + 1`` tokens at multiples of ``seq_len`` inside each
    training shard; their order is a seeded permutation per shard and pass over the corpus (a run that
    wraps around sees each shard in a new order), shards in corpus order, so the whole stream is a pure
    function of (seed, position) and resuming needs only the position. Shards are tokenized lazily, when
    the stream reaches them."""

    def __init__(self, data_dir: str, corpus_dir: str,
                 vocab_size: int = DEFAULT_VOCAB, seq_len: int = 256, seed: int = 0,
                 val_max_chars: int | None = 4_000_000, tokenizer_chars_per_shard: int = 3_000_000, log=print):
        self.data_dir, self.corpus_dir, self.seq_len, self.seed, self.log = data_dir, corpus_dir, seq_len, seed, log
        os.makedirs(data_dir, exist_ok=True)
        self.tok = ensure_tokenizer(data_dir, corpus_dir, vocab_size, tokenizer_chars_per_shard, log)
        self.train_paths, self.val_path = split_shards(corpus_dir)
        self.val_max_chars = val_max_chars
        self._train: dict[int, tuple[np.memmap, np.ndarray]] = {}
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (shard, pass) -> order, passes > 0
        self._val = None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @property
    def eos_id(self) -> int:
        return self.tok.token_to_id(EOS)

    def _shard(self, i: int) -> tuple[np.memmap, np.ndarray]:
        if i not in self._train:
            arr = shard_bin(self.data_dir, self.train_paths[i], self.tok, log=self.log)
            n_seq = (arr.size - 1) // self.seq_len
            order = np.random.default_rng([self.seed, i]).permutation(n_seq)
            self._train[i] = (arr, order)
        return self._train[i]

    def order(self, i: int, epoch: int) -> np.ndarray:
        """Shard ``i``'s sequence order in pass ``epoch`` over the corpus (pass 0: ``_shard``'s)."""
        first = self._shard(i)[1]
        if epoch == 0:
            return first
        if (i, epoch) not in self._orders:
            if len(self._orders) >= 2 * len(self.train_paths):  # a pass or two is all a batch reaches
                self._orders.clear()
            self._orders[(i, epoch)] = np.random.default_rng([self.seed, i, epoch]).permutation(first.size)
        return self._orders[(i, epoch)]

    def batch(self, position: int, batch_size: int) -> tuple[np.ndarray, int]:
        """``batch_size`` training sequences [B, seq_len + 1] (int32) starting at stream ``position``;
        returns them and the next position. The stream wraps around after the last training shard, each
        shard then in a new order."""
        out = np.empty((batch_size, self.seq_len + 1), np.int32)
        n_shards = len(self.train_paths)
        for b in range(batch_size):
            pos, visited = position + b, 0  # shards visited in the stream, over every pass
            while pos >= (n_seq := self._shard(visited % n_shards)[1].size):
                pos -= n_seq
                visited += 1
            arr = self._shard(visited % n_shards)[0]
            start = int(self.order(visited % n_shards, visited // n_shards)[pos]) * self.seq_len
            out[b] = arr[start:start + self.seq_len + 1]
        return out, position + batch_size

    def val_tokens(self) -> np.ndarray:
        if self._val is None:
            self._val = shard_bin(self.data_dir, self.val_path, self.tok, max_chars=self.val_max_chars, log=self.log)
        return self._val

    def val_batches(self, n_seqs: int, batch_size: int) -> Iterator[np.ndarray]:
        """The first ``n_seqs`` non-overlapping validation windows [B, seq_len + 1], in order."""
        arr = self.val_tokens()
        n_seqs = min(n_seqs, (arr.size - 1) // self.seq_len)
        for s in range(0, n_seqs - n_seqs % batch_size, batch_size):
            yield np.stack([np.asarray(arr[(s + b) * self.seq_len:(s + b) * self.seq_len + self.seq_len + 1],
                                       np.int32) for b in range(batch_size)])


# ------------------------------------------------------------------------------------- leak check
def ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def ngram_overlap(train_text: str, test_text: str, n: int = 13) -> dict:
    """How many of the test text's word ``n``-grams also occur in ``train_text`` (whitespace words)."""
    test = ngrams(test_text.split(), n)
    train = ngrams(train_text.split(), n)
    shared = test & train
    return {"n": n, "test_ngrams": len(test), "train_ngrams": len(train), "shared": len(shared),
            "shared_fraction": len(shared) / max(1, len(test)),
            "examples": [" ".join(g) for g in sorted(shared)[:5]]}


def leak_check(corpus_dir: str, test_text: str, chars_per_shard: int = 5_000_000, n: int = 13) -> dict:
    """13-gram overlap between the WikiText-2 test text and a sample of every training shard."""
    test = ngrams(test_text.split(), n)
    shared: set = set()
    sampled_words = 0
    train_paths, _ = split_shards(corpus_dir)
    for path in train_paths:
        for doc in iter_documents(path, max_chars=chars_per_shard):
            words = doc.split()
            sampled_words += len(words)
            shared |= test & ngrams(words, n)
    return {"n": n, "test_ngrams": len(test), "sampled_train_words": sampled_words, "shared": len(shared),
            "shared_fraction": len(shared) / max(1, len(test)),
            "examples": [" ".join(g) for g in sorted(shared)[:5]]}


def corpus_folder(given: str | None, flag: str) -> str:
    """The training corpus folder: ``given`` (the command's ``flag``), else ``$MOEJAX_DATA/corpus``, else a usage
    error naming both."""
    folder = given or paths.corpus_dir()
    if not folder:
        raise errors.UsageError(f"no training corpus: pass {flag} FOLDER (shards {CORPUS_PATTERN}, the last held out "
                                f"for validation) or set ${paths.DATA_ENV} to a folder holding corpus/")
    return os.path.abspath(os.path.expanduser(folder))
