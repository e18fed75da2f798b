"""Models named by a Hugging Face hub id (``moejax.models.hub``): real ``huggingface_hub`` downloads from a local
stand-in for the hub (``fake_hub``), into a cache of each test's own."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import huggingface_hub.constants as hub_constants
import numpy as np
import pytest
from support.hf_models import get_hf_model
from support.fake_hub import FakeHub

import moejax
from moejax import convert as convert_cli, generate as generate_cli
from moejax.evaluation import sweep_points
from moejax.models import hub
from moejax.models.checkpoint import CheckpointError
from moejax.runtime.simulate import CacheConfig

IDS = [3, 1, 4, 1, 5, 9, 2, 6]


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.fixture
def tiny() -> dict[str, bytes]:
    """A hub repository's files as a model repository holds them: the model, plus what moejax must not fetch
    (a pickled copy, an original-format folder, a README)."""
    files = _files(get_hf_model("olmoe").folder)
    files.update({"pytorch_model.bin": b"\x80\x04 not to be fetched", "README.md": b"# tiny", "LICENSE": b"terms",
                  "original/consolidated.safetensors": b"not to be fetched", "notes.json": b"{}"})
    return files


@pytest.fixture
def serve_hub(tmp_path, monkeypatch):
    """``serve_hub(repos, **options)`` -> a ``FakeHub`` that ``huggingface_hub`` (here and in child processes)
    talks to, with a cache in ``tmp_path/cache``."""
    hubs = []

    def start(repos, **options):
        fake = FakeHub(repos, **options)
        hubs.append(fake)
        monkeypatch.setattr(hub_constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        return fake

    yield start
    for fake in hubs:
        fake.close()


def _logits(model) -> np.ndarray:
    return np.asarray(model.forward(IDS).logits)


@pytest.mark.parametrize("model, expected", [
    ("org/name", ("org/name", None)), ("allenai/OLMoE-1B-7B-0924", ("allenai/OLMoE-1B-7B-0924", None)),
    ("org/name@v1.0", ("org/name", "v1.0")), ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
    ("default", None), ("name", None), ("/abs/org/name", None), ("./org/name", None), ("~/org/name", None),
    ("a/b/c", None), ("org--x/name", None), ("org/..", None), ("org/name@", None), ("-org/name", None),
    ("org/name.", None), ("org/name@../x", None)])
def test_repo_of_recognises_hub_ids_only(model, expected):
    assert hub.repo_of(model) == expected


def test_an_existing_folder_named_like_a_hub_id_is_the_folder(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub.repo_of("org/name") is None
    assert sweep_points.model_label("org/name") == str(tmp_path / "org" / "name")
    assert sweep_points.model_label("other/name") == "other/name"  # records name a hub model by its id


def test_hub_id_loads_the_model_and_fetches_only_what_moejax_reads(serve_hub, tiny):
    fake = serve_hub({"org/tiny": tiny})
    model = moejax.load("org/tiny")
    assert fake.fetched() == {"config.json", "generation_config.json", "model.safetensors", "README.md", "LICENSE"}
    np.testing.assert_array_equal(_logits(model), _logits(moejax.load(get_hf_model("olmoe").folder)))
    assert os.path.islink(os.path.join(model.path, "config.json"))  # read in place from the hub's cache
    commit = fake.commit("org/tiny")
    assert model.path.endswith(os.path.join("snapshots", commit))
    fake.requests.clear()
    again = moejax.load(f"org/tiny@{commit}")  # cached: asked, nothing downloaded again
    assert again.path == model.path and fake.fetched() == set()


def test_offload_pages_experts_from_the_hub_cache_in_place(serve_hub, tiny):
    """The snapshot's files are symlinks into the cache's blobs: the flash store maps them where they are."""
    serve_hub({"org/tiny": tiny})
    cache = CacheConfig(size="0.5")
    flash = moejax.load("org/tiny", offload="flash").generate(IDS, max_new_tokens=6, stop_at_eos=False, cache=cache)
    folder = moejax.load(get_hf_model("olmoe").folder, offload="flash")
    plain = folder.generate(IDS, max_new_tokens=6, stop_at_eos=False, cache=cache)
    assert flash.token_ids == plain.token_ids
    assert flash.stats["offload"]["bytes_moved"] == plain.stats["offload"]["bytes_moved"] > 0


def test_sharded_repository_fetches_the_index_and_its_shards(serve_hub, tmp_path):
    folder = tmp_path / "sharded"
    get_hf_model("mixtral").model.save_pretrained(folder, max_shard_size="40KB")
    files = _files(str(folder))
    shards = json.loads(files["model.safetensors.index.json"])["weight_map"].values()
    assert len(set(shards)) > 1
    files["consolidated.safetensors"] = b"a Mistral-format copy, not read"
    fake = serve_hub({"org/sharded": files})
    model = moejax.load("org/sharded")
    assert fake.fetched() == {"config.json", "generation_config.json", "model.safetensors.index.json", *shards}
    np.testing.assert_array_equal(_logits(model), _logits(moejax.load(str(folder))))


def test_offline_the_cached_snapshot_serves_and_a_missing_one_is_named(serve_hub, tiny, monkeypatch):
    fake = serve_hub({"org/tiny": tiny})
    path = moejax.load("org/tiny").path
    fake.requests.clear()
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert moejax.load("org/tiny").path == path and fake.requests == []
    with pytest.raises(CheckpointError, match=r"org/other .*not \(completely\) in the cache .*HF_HUB_OFFLINE is set"):
        moejax.load("org/other")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    fake.close()  # the hub goes away: the cache still serves
    assert moejax.load("org/tiny").path == path


@pytest.mark.parametrize("name, message", [
    ("org/none", r"org/none is not a folder here, and the Hugging Face hub has no model org/none"),
    ("org/gated", r"org/gated is gated: accept its terms .* HF_TOKEN"),
    ("org/pickles", r"only pickled weights \(pytorch_model.bin\) and no safetensors; moejax never unpickles"),
    ("org/tiny@v9", r"org/tiny has no revision 'v9'"),
    ("org/noconfig", r"org/noconfig has no config.json"),
])
def test_hub_refusals_are_named_before_any_weights_are_fetched(serve_hub, tiny, name, message):
    fake = serve_hub({"org/tiny": tiny, "org/gated": tiny, "org/noconfig": {"model.safetensors": b"x"},
                      "org/pickles": {"config.json": tiny["config.json"], "pytorch_model.bin": b"\x80"}},
                     gated={"org/gated"})
    with pytest.raises(CheckpointError, match=message):
        moejax.load(name)
    assert fake.fetched() <= {"config.json"}


def test_a_text_command_refuses_a_repository_without_a_tokenizer_before_fetching_its_weights(serve_hub, tiny):
    """evaluate and studies score text: a repository with no tokenizer.json is refused from the hub's listing,
    before gigabytes of weights come (it was fetched first, then refused)."""
    from moejax.runtime import api

    fake = serve_hub({"org/tiny": tiny, "org/texty": {**tiny, "tokenizer.json": b"{}"}})
    with pytest.raises(CheckpointError, match=r"org/tiny has no tokenizer.json: WikiText is scored as text"):
        api.text_model_folder("org/tiny", "WikiText is scored as text")
    assert fake.fetched() == set()
    folder = api.text_model_folder("org/texty", "WikiText is scored as text")
    assert os.path.isfile(os.path.join(folder, "tokenizer.json")) and "model.safetensors" in fake.fetched()


def test_a_download_that_cannot_fit_is_refused_before_it_starts(serve_hub, tiny, monkeypatch):
    fake = serve_hub({"org/tiny": tiny})
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    with pytest.raises(CheckpointError, match=r"needs [0-9.]+ [kM]B more in .*which has 1.0 kB free"):
        moejax.load("org/tiny")
    assert "model.safetensors" not in fake.fetched()


def test_a_dropped_download_leaves_no_partial_file(serve_hub, tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "1")
    serve_hub({"org/tiny": tiny}, cut={"model.safetensors": 1000})
    with pytest.raises(CheckpointError, match=r"downloading org/tiny .* failed .*the partial files were removed"):
        moejax.load("org/tiny")
    assert glob.glob(str(tmp_path / "cache" / "*" / "blobs" / "*.incomplete")) == []


def test_convert_reads_a_hub_id_and_carries_its_licence(serve_hub, tiny, tmp_path):
    serve_hub({"org/tiny": tiny})
    out = tmp_path / "converted"
    assert convert_cli.main(["hf-to-moejax", "org/tiny", str(out)]) == 0
    assert (out / "LICENSE").read_bytes() == b"terms" and (out / "README.md").read_bytes() == b"# tiny"
    np.testing.assert_array_equal(_logits(moejax.load(str(out))), _logits(moejax.load("org/tiny")))


def test_generate_cli_runs_a_hub_id(serve_hub, tiny, capsys):
    serve_hub({"org/tiny": tiny})
    common = ["--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]
    assert generate_cli.main(["--model", "org/tiny", *common]) == 0
    out, err = capsys.readouterr()
    by_id = json.loads(out)
    assert re.search(r"note: downloading org/tiny's weights \(1 file, [0-9.]+ [kM]?B\) from the Hugging Face hub", err)
    assert generate_cli.main(["--model", get_hf_model("olmoe").folder, *common]) == 0
    assert by_id["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert generate_cli.main(["--model", "org/none", *common]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: org/none is not a folder here") and "Traceback" not in "".join(err)


def test_ctrl_c_during_a_download_stops_at_once_and_removes_the_partial_file(serve_hub, tiny, tmp_path):
    fake = serve_hub({"org/tiny": tiny}, stall={"model.safetensors": 1000})
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen([sys.executable, "-m", "moejax.generate", "--model", "org/tiny", "--prompt-ids", "1,2"],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not glob.glob(str(cache / "*" / "blobs" / "*.incomplete")):
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
            time.sleep(0.05)
        child.send_signal(signal.SIGINT)
        start = time.monotonic()
        out, err = child.communicate(timeout=60)
        assert time.monotonic() - start < 10  # not waiting for the stalled download
    finally:
        child.kill()
        fake.close()
    assert child.returncode == 130 and out == "" and "Traceback" not in err
    assert glob.glob(str(cache / "*" / "blobs" / "*.incomplete")) == []
