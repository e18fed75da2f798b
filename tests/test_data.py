"""Corpus streaming, tokenizer training, packed token shards, validation split, leak check, textproc."""

from __future__ import annotations

import gzip
import json
import lzma
import os
import shutil

import numpy as np
import pytest

from moejax.base import textproc
from moejax.runtime.api import Tokenizer
from moejax.training import data
from support.train_fixtures import write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return os.path.dirname(write_corpus(str(tmp_path_factory.mktemp("corpus")))[0])


@pytest.fixture(scope="module")
def token_data(corpus, tmp_path_factory):
    return data.TokenData(str(tmp_path_factory.mktemp("data")), corpus, vocab_size=300, seq_len=16, seed=0,
                          val_max_chars=None, log=lambda s: None)


def test_documents_split_at_titles(corpus):
    docs = list(data.iter_documents(os.path.join(corpus, "enwiki-2015-wikitext-style-00.txt.gz")))
    assert len(docs) == 40
    # a document runs from its title line to the line before the next title (the shard's leading blank
    # line stays with the first one)
    assert docs[0].startswith(" \n = Article 0 0 = ")
    assert all(d.startswith(" = Article 0 ") for d in docs[1:])
    assert docs[3].startswith(" = Article 0 3 = ")
    assert " = = " in "".join(docs)  # section headings stay inside their article
    assert sum(len(d) for d in data.iter_documents(os.path.join(corpus, "enwiki-2015-wikitext-style-00.txt.gz"),
                                                   max_chars=1000)) < sum(len(d) for d in docs)


def test_tokenizer_roundtrip_and_bos(tmp_path):
    text = ["The river was built in 1850 , with 1 @,@ 200 people .", "Héllo wörld — ünïcode"] * 50
    tok = data.train_tokenizer(text, vocab_size=320)
    assert tok.get_vocab_size() <= 320
    assert tok.token_to_id(data.EOS) == 0
    enc = tok.encode(text[0])
    assert enc.ids[0] == 0 and 0 not in enc.ids[1:]  # <|endoftext|> prepended as BOS
    assert tok.decode(enc.ids) == text[0]
    assert tok.decode(tok.encode(text[1]).ids) == text[1]  # byte level: any text round-trips
    data.save_tokenizer(tok, str(tmp_path))
    t = Tokenizer(str(tmp_path))  # what moejax.load uses
    assert t.encode(text[0]) == enc.ids
    assert t.decode(enc.ids) == text[0]
    cfg = json.load(open(tmp_path / "tokenizer_config.json"))
    assert cfg["bos_token"] == cfg["eos_token"] == data.EOS


def test_transformers_tokenizer_agrees(tmp_path):
    from transformers import AutoTokenizer

    tok = data.train_tokenizer(["The city was founded in 1900 ."] * 20, vocab_size=300)
    data.save_tokenizer(tok, str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    s = "The city was founded in 1901 ."
    assert hf(s)["input_ids"] == tok.encode(s).ids
    assert hf.eos_token == data.EOS and hf.eos_token_id == 0


def test_shards_are_packed_with_eos_boundaries(token_data, corpus):
    arr = token_data._shard(0)[0]
    assert arr.dtype == np.uint16
    assert int((np.asarray(arr) == token_data.eos_id).sum()) == 40  # one EOS before each document
    assert arr[0] == token_data.eos_id
    text = token_data.tok.decode(np.asarray(arr[: 200]).tolist())
    assert text.startswith(" \n = Article 0 0 = ")
    # cached: a second TokenData reuses the tokenizer and the .bin
    again = data.TokenData(token_data.data_dir, corpus, 300, 16, 0, val_max_chars=None, log=lambda s: None)
    np.testing.assert_array_equal(again._shard(0)[0], arr)


def test_validation_is_the_last_shard(token_data, corpus):
    train_paths, val_path = data.split_shards(corpus)
    assert val_path.endswith("-02.txt.gz") and len(train_paths) == 2
    val = np.asarray(token_data.val_tokens())
    assert token_data.tok.decode(val[:20].tolist()).startswith(" \n = Article 2 0 = ")
    b = next(token_data.val_batches(4, 2))
    assert b.shape == (2, 17)
    np.testing.assert_array_equal(b[0], val[:17])
    np.testing.assert_array_equal(b[1], val[16:33])
    for path in (0, 1):  # training batches never contain the validation shard's text
        assert "Article 2" not in token_data.tok.decode(np.asarray(token_data._shard(path)[0]).tolist())


def test_batches_are_windows_and_deterministic(token_data):
    b, nxt = token_data.batch(0, 5)
    assert b.shape == (5, 17) and nxt == 5 and b.dtype == np.int32
    arr, order = token_data._shard(0)
    np.testing.assert_array_equal(b[2], arr[order[2] * 16: order[2] * 16 + 17])
    b2, _ = token_data.batch(3, 2)
    np.testing.assert_array_equal(b2, b[3:5])  # position is all the state there is
    n0 = order.size
    cross, _ = token_data.batch(n0 - 1, 2)  # crosses into shard 1
    arr1, order1 = token_data._shard(1)
    np.testing.assert_array_equal(cross[1], arr1[order1[0] * 16: order1[0] * 16 + 17])
    other = data.TokenData(token_data.data_dir, token_data.corpus_dir, 300, 16, seed=1, val_max_chars=None,
                           log=lambda s: None)
    assert not np.array_equal(other.batch(0, 5)[0], b)


def test_a_second_pass_over_the_corpus_reorders_each_shard(token_data):
    """A run that wraps around (the GPU machine carries one shard of the corpus) must not repeat the first
    pass batch for batch; the stream stays a pure function of the position."""
    sizes = [token_data._shard(i)[1].size for i in range(len(token_data.train_paths))]
    total = sum(sizes)
    first, _ = token_data.batch(0, sizes[0])
    second, _ = token_data.batch(total, sizes[0])
    assert not np.array_equal(first, second)
    key = lambda rows: sorted(map(bytes, rows.astype(np.int32)))  # noqa: E731
    assert key(first) == key(second)  # the same sequences, another order
    fresh = data.TokenData(token_data.data_dir, token_data.corpus_dir, 300, 16, seed=0, val_max_chars=None,
                           log=lambda s: None)
    np.testing.assert_array_equal(fresh.batch(total + 3, 4)[0], token_data.batch(total + 3, 4)[0])
    np.testing.assert_array_equal(fresh.order(0, 2), token_data.order(0, 2))


def test_ngram_overlap():
    test = "a b c d e f g h i j k l m n o p"
    r = data.ngram_overlap("x y " + test[:27] + " z", test, n=13)  # the first 14 words copied
    assert r["test_ngrams"] == 4 and r["shared"] == 2
    assert data.ngram_overlap("q r s t", test, n=13)["shared"] == 0


@pytest.mark.parametrize("raw,expected", [
    (" The team won 1 @,@ 000 games in the 2004 @-@ 05 season , scoring 3 @.@ 5 goals ( per game ) . ",
     "The team won 1,000 games in the 2004-05 season, scoring 3.5 goals (per game)."),
    ('He said " hello there " and left .', 'He said "hello there" and left.'),
    ("John 's dog does n't bark ; the players ' union", "John's dog doesn't bark; the players' union"),
    ("It cost $ 5 or 10 % of it !", "It cost $5 or 10% of it!"),
    (" = = Early life = = ", "= = Early life = ="),
    ("line one .\n second line : yes", "line one.\nsecond line: yes"),
])
def test_wikitext_detokenize(raw, expected):
    assert textproc.wikitext_detokenize(raw) == expected


def test_text_style_marker():
    assert textproc.is_wikitext_style({"text_style": "wikitext"})
    assert not textproc.is_wikitext_style({}) and not textproc.is_wikitext_style(None)


def test_xz_shards_read_like_gzip(corpus, tmp_path):
    """A corpus recompressed with xz (a quarter smaller: what fits a 64 MiB device call) gives the same
    documents (so the same tokens) in the same shard order as its gzip original; one shard in both forms is
    refused rather than read twice."""
    for name in sorted(os.listdir(corpus)):
        src = os.path.join(corpus, name)
        if name.startswith("enwiki-2015-wikitext-style-01"):  # a mixed corpus: 00 and 02 stay gzip
            with gzip.open(src, "rb") as f, lzma.open(tmp_path / name.replace(".gz", ".xz"), "wb") as g:
                shutil.copyfileobj(f, g)
        else:
            shutil.copy(src, tmp_path / name)
    assert [os.path.basename(p) for p in data.corpus_shards(str(tmp_path))] == [
        "enwiki-2015-wikitext-style-00.txt.gz", "enwiki-2015-wikitext-style-01.txt.xz",
        "enwiki-2015-wikitext-style-02.txt.gz"]
    docs = lambda folder, ext: list(data.iter_documents(os.path.join(folder, f"enwiki-2015-wikitext-style-01.txt.{ext}")))
    assert docs(str(tmp_path), "xz") == docs(corpus, "gz") and len(docs(corpus, "gz")) > 1
    shutil.copy(os.path.join(corpus, "enwiki-2015-wikitext-style-01.txt.gz"), tmp_path)
    with pytest.raises(ValueError, match="style-01 is in .* twice"):
        data.corpus_shards(str(tmp_path))
