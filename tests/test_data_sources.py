"""Where a command's data comes from: its own option, else the folder ``$MOEJAX_DATA`` names (or
``$MOEJAX_WIKITEXT``), else Hugging Face ``datasets``, else one line naming those ways. Nothing outside the
installed package is assumed: a clone with nothing beside it runs every command the user gives data to."""

from __future__ import annotations

import gzip
import lzma
import os
import subprocess
import sys
import types

import pytest
from support.commands import run_main

import moejax
from moejax.base import paths
from moejax.evaluation import evaluate, perplexity, studies
from moejax.training import train, train_prior

PACKAGE = os.path.dirname(os.path.abspath(moejax.__file__))


@pytest.fixture
def no_local_data(monkeypatch):
    monkeypatch.delenv("MOEJAX_DATA", raising=False)
    monkeypatch.delenv("MOEJAX_WIKITEXT", raising=False)


def _datasets(load_dataset) -> types.ModuleType:
    module = types.ModuleType("datasets")
    module.load_dataset = load_dataset
    return module


def test_no_package_file_names_a_folder_beside_the_checkout():
    """The package reads data a user names; it never looks in a folder beside its own checkout (a sibling
    ``shared`` folder, say)."""
    beside = ("..", "shared")  # the two names, kept apart so that this file does not name the folder itself
    named = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith((".py", ".json", ".md", ".txt")):
                with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                    text = f.read()
                if "/".join(beside) in text or "shared/data" in text:
                    named.append(os.path.relpath(os.path.join(root, name), PACKAGE))
    assert named == []


def test_the_default_wikitext_is_moejax_wikitext_then_moejax_data(tmp_path, monkeypatch, no_local_data):
    assert paths.wikitext_test() is None  # nothing named: the HF copy
    data = tmp_path / "data"
    (data / "wikitext-2-raw-v1").mkdir(parents=True)
    (data / "wikitext-2-raw-v1" / "test.txt").write_text(" = A = \n\n from the data folder \n")
    monkeypatch.setenv("MOEJAX_DATA", str(data))
    assert perplexity.load_wikitext() == " = A = \n\n from the data folder \n"
    own = tmp_path / "own.txt"
    own.write_text(" = B = \n")
    monkeypatch.setenv("MOEJAX_WIKITEXT", str(own))
    assert perplexity.load_wikitext() == " = B = \n"
    assert perplexity.load_wikitext(str(data / "wikitext-2-raw-v1" / "test.txt")).endswith("data folder \n")
    monkeypatch.setenv("MOEJAX_WIKITEXT", str(tmp_path / "gone.txt"))  # named: never a download in its place
    with pytest.raises(FileNotFoundError, match="gone.txt does not exist"):
        perplexity.load_wikitext()


def test_without_a_local_copy_wikitext_comes_from_hf_datasets_or_an_error_naming_both_ways(monkeypatch,
                                                                                            no_local_data):
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return {"text": [" = A = ", " text "]}

    monkeypatch.setitem(sys.modules, "datasets", _datasets(load_dataset))
    assert perplexity.load_wikitext() == " = A = \n\n text " and calls == [("wikitext", "wikitext-2-raw-v1", "test")]

    def offline(*args, **kw):
        raise ConnectionError("no network")

    monkeypatch.setitem(sys.modules, "datasets", _datasets(offline))
    with pytest.raises(FileNotFoundError, match="ConnectionError: no network.*pass --data PATH"):
        perplexity.load_wikitext()
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(FileNotFoundError, match=r"pass --data .*\$MOEJAX_DATA.*pip install 'moejax\[data\]'"):
        perplexity.load_wikitext()


def test_evaluate_with_no_data_anywhere_says_how_to_give_it_in_one_line(capsys, monkeypatch, no_local_data):
    monkeypatch.setitem(sys.modules, "datasets", None)
    ran = run_main(evaluate.main, capsys, "--model", "default", "--task", "wikitext", "--max-tokens", "16")
    assert ran.returncode == 1 and "Traceback" not in ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and "--data" in lines[0] and "pip install 'moejax[data]'" in lines[0]


def test_the_delta_study_calibrates_on_its_option_then_the_data_folder_then_hf(tmp_path, monkeypatch,
                                                                                no_local_data):
    assert studies.calibration_source(None) == "hf:wikitext-2-raw-v1/train"
    monkeypatch.setenv("MOEJAX_DATA", str(tmp_path / "data"))
    assert studies.calibration_source(None) == str(tmp_path / "data" / "corpus" / studies.CALIBRATION_SHARD)
    assert studies.calibration_source("mine.txt") == "mine.txt"
    text = " = Held out = \n\n Some text the evaluation never scores . \n"
    for name, opener in (("a.txt", open), ("a.txt.gz", gzip.open), ("a.txt.xz", lzma.open)):
        with opener(tmp_path / name, "wt", encoding="utf-8") as f:
            f.write(text)
        assert studies.read_calibration_text(str(tmp_path / name), 14) == text[:14]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        studies.read_calibration_text(str(tmp_path / "gone.gz"), 10)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(FileNotFoundError, match=r"--calibration-text PATH.*pip install 'moejax\[data\]'"):
        studies.read_calibration_text("hf:wikitext-2-raw-v1/train", 10)
    monkeypatch.setitem(sys.modules, "datasets", _datasets(lambda *a, split=None: {"text": ["abc", "def"]}))
    assert studies.read_calibration_text("hf:wikitext-2-raw-v1/train", 6) == "abc\n\nd"


def test_training_without_a_corpus_names_the_option_and_the_variable_and_creates_nothing(tmp_path, capsys,
                                                                                         no_local_data):
    ran = run_main(train.main, capsys, "--out", tmp_path / "run", "--config", "tiny", "--data-dir", tmp_path / "d")
    assert ran.returncode == 2 and "--corpus-dir FOLDER" in ran.stderr and "$MOEJAX_DATA" in ran.stderr
    ran = run_main(train_prior.main, capsys, "--out", tmp_path / "priors", "--model", "default", "--shards", "0")
    assert ran.returncode == 2 and "--corpus FOLDER" in ran.stderr and "$MOEJAX_DATA" in ran.stderr
    assert sorted(os.listdir(tmp_path)) == []


def test_a_bare_clone_runs_the_tests_on_the_data_it_ships():
    """Every file the tests read ships in ``tests/data`` (tracked, so a clone has it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    tracked = subprocess.run(["git", "ls-files", "tests/data"], cwd=os.path.dirname(here), capture_output=True,
                             text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = set(tracked.stdout.split())
    for shipped in ("tests/data/wikitext-2-raw-v1/test.txt", "tests/data/corpus/" + studies.CALIBRATION_SHARD,
                    "tests/data/README.md"):
        assert shipped in files
