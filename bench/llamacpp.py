"""llama.cpp (CPU) as the anchor: convert a Hugging Face MoE folder to GGUF and time ``llama-bench`` on it
under a memory budget. A bench-side helper only; moejax itself never imports it.

    python bench/llamacpp.py HF_DIR [--gguf PATH] [--outtype bf16] [--limit-gb 12] [--n-gen 16]
        [--n-prompt 0] [--threads 2] [--reps 1] [--no-drop-caches] [--timeout S] [--out JSON]

prints one JSON object (see ``bench``). The GGUF defaults to ``<HF_DIR>.<outtype>.gguf`` beside the folder and
is converted only when missing or older than the folder's config.json. llama.cpp is looked up in
``$MOEJAX_LLAMA_CPP`` or /work/llama.cpp (its ``build/bin/llama-bench`` must exist); when it is not built
the script prints how to build it and exits 2.

Library (stdlib + subprocess; ``memlimit`` from this folder)::

    import llamacpp
    llamacpp.convert_to_gguf(hf_dir, "/work/scale/m.gguf")        # adds a tokenizer first if there is none
    r = llamacpp.bench("/work/scale/m.gguf", n_gen=16, limit_bytes=12 << 30)
    r["tg_tokens_per_s"], r["peak_rss_bytes"], r["read_bytes"]

What llama-bench does (this version; see tools/llama-bench/llama-bench.cpp): it loads the model once (with
mmap, and ``llama_mmap`` maps with MAP_POPULATE + MADV_WILLNEED, i.e. the whole GGUF is faulted in at load),
then runs one test per kind asked: a prompt test (``-p N``: one warm-up batch of N tokens, then ``reps``
timed batches) and a generation test (``-n N``: one warm-up token, then ``reps`` timed runs of N tokens,
random token ids, batch 1). Its tokens/s are the timed runs only. Our ``read_bytes``/``peak_rss_bytes``/
``wall_s`` cover the whole process: load + warm-up + timed runs (+ the other test when both are asked).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (bench/common.py)
import memlimit  # noqa: E402  (bench/memlimit.py)

DEFAULT_LLAMA_CPP = "/work/llama.cpp"
DEFAULT_TEXT = common.WIKITEXT2_TEST
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

BUILD_HELP = """\
llama.cpp is not built. Build it (CPU, ~20 minutes on 2 busy cores) with:

    cd /work && pip download --no-deps --no-binary :all: llama-cpp-python -d /work/llama-src
    tar xzf /work/llama-src/llama_cpp_python-*.tar.gz -C /work/llama-src
    mv /work/llama-src/llama_cpp_python-*/vendor/llama.cpp /work/llama.cpp && rm -rf /work/llama-src
    cd /work/llama.cpp
    cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DCMAKE_BUILD_TYPE=Release
    nice -n 10 cmake --build build -j2 --target llama-bench llama-cli
    pip install --no-deps sentencepiece   # (not gguf-py: the converter uses its own copy)

(or point MOEJAX_LLAMA_CPP at a llama.cpp folder that has build/bin/llama-bench)."""


# ------------------------------------------------------------------------------------------- location

def find_llama_cpp() -> str | None:
    """The llama.cpp folder ($MOEJAX_LLAMA_CPP, else /work/llama.cpp) if build/bin/llama-bench is there."""
    d = os.environ.get("MOEJAX_LLAMA_CPP") or DEFAULT_LLAMA_CPP
    d = os.path.abspath(os.path.expanduser(d))
    return d if os.path.isfile(os.path.join(d, "build", "bin", "llama-bench")) else None


def _require_llama_cpp(llama_dir: str | None) -> str:
    d = llama_dir or find_llama_cpp()
    if d is None:
        raise FileNotFoundError(BUILD_HELP)
    return d


# ------------------------------------------------------------------------------------------- tokenizer

def ensure_tokenizer(hf_dir: str, vocab_size: int = 1000, text_path: str | None = None,
                     text_bytes: int = 1 << 20) -> list[str]:
    """Give ``hf_dir`` a tokenizer if it has none (llama.cpp's converter needs one). Returns the files written.

    moejax's random checkpoints have no tokenizer. This trains a small byte-level BPE (``tokenizers``) on the
    first ``text_bytes`` of ``text_path`` (default: the WikiText-2 copy in tests/data) and saves it with
    ``transformers.PreTrainedTokenizerFast.save_pretrained`` into a temporary folder, then copies ONLY
    tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``hf_dir`` (config.json and the
    weights are never touched). The converter pads the vocabulary to the config's vocab_size. Nothing is
    done when tokenizer.json or tokenizer.model already exists.
    """
    if any(os.path.exists(os.path.join(hf_dir, f)) for f in ("tokenizer.json", "tokenizer.model")):
        return []
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise FileNotFoundError(f"{hf_dir}: no config.json (not a Hugging Face model folder)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text_path = text_path or os.path.normpath(DEFAULT_TEXT)
    if os.path.isfile(text_path):
        with open(text_path, encoding="utf-8", errors="replace") as f:
            text = f.read(text_bytes)
    else:  # no corpus here: any text will do for a tokenizer that only has to exist
        text = (memlimit.__doc__ or "") + (__doc__ or "")
    lines = [ln for ln in text.splitlines() if ln.strip()]

    specials = ["<|endoftext|>", "<|padding|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[0],
                                   unk_token=None, pad_token=specials[1])
    written = []
    with tempfile.TemporaryDirectory(prefix=".moejax-tok-", dir=hf_dir) as tmp:
        fast.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            src = os.path.join(tmp, name)
            if not os.path.isfile(src):
                continue  # e.g. transformers 5 may not write special_tokens_map.json
            dst = os.path.join(hf_dir, name)
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
            written.append(dst)
    if not any(w.endswith("tokenizer.json") for w in written):
        raise RuntimeError(f"save_pretrained wrote no tokenizer.json into {hf_dir}")
    return written


# ------------------------------------------------------------------------------------------ conversion

# Runs llama.cpp's convert_hf_to_gguf.py with get_vocab_base_pre() patched to return "default": the hash of
# our small tokenizer's pre-tokenizer is not in the converter's table ("BPE pre-tokenizer was not
# recognized"). In this llama.cpp the method lives on TextModel in conversion/base.py; older versions had
# it on a class inside convert_hf_to_gguf.py itself. Every class that defines it is patched. Families whose
# converter reads a sentencepiece tokenizer.model (ERNIE-4.5) get the BPE vocabulary path instead when the
# folder has only the tokenizer.json written here (token ids are all a speed benchmark needs).
_CONVERT_WRAPPER = r"""
import importlib, importlib.util, inspect, os, pkgutil, runpy, sys
llama_dir = sys.argv[1]
script = os.path.join(llama_dir, "convert_hf_to_gguf.py")
sys.path.insert(0, llama_dir)
if "NO_LOCAL_GGUF" not in os.environ:
    sys.path.insert(1, os.path.join(llama_dir, "gguf-py"))
def default_pre(self, tokenizer):
    return "default"
def bpe_without_sentencepiece(original):
    def vocab(self, *args, **kwargs):
        if not (self.dir_model / "tokenizer.model").is_file() and (self.dir_model / "tokenizer.json").is_file():
            return self._set_vocab_gpt2()
        return original(self, *args, **kwargs)
    return vocab
def patch(mod):
    n = 0
    for _, cls in inspect.getmembers(mod, inspect.isclass):
        if cls.__module__ != mod.__name__:
            continue
        if "get_vocab_base_pre" in vars(cls):
            cls.get_vocab_base_pre = default_pre
            n += 1
        if "_set_vocab_sentencepiece" in vars(cls):
            cls._set_vocab_sentencepiece = bpe_without_sentencepiece(cls._set_vocab_sentencepiece)
    return n
sys.argv = [script] + sys.argv[2:]
if os.path.isfile(os.path.join(llama_dir, "conversion", "base.py")):
    import conversion
    n = 0
    for m in pkgutil.iter_modules(conversion.__path__):
        src = os.path.join(conversion.__path__[0], m.name + ".py")
        if os.path.isfile(src) and "def get_vocab_base_pre" in open(src, encoding="utf-8").read():
            n += patch(importlib.import_module("conversion." + m.name))
    if not n:
        sys.exit("moejax wrapper: get_vocab_base_pre not found in llama.cpp's conversion package")
    runpy.run_path(script, run_name="__main__")
else:
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = mod
    spec.loader.exec_module(mod)
    if not patch(mod):
        sys.exit("moejax wrapper: get_vocab_base_pre not found in convert_hf_to_gguf.py")
    mod.main()
"""


def default_gguf_path(hf_dir: str, outtype: str = "bf16") -> str:
    return os.path.abspath(hf_dir).rstrip(os.sep) + f".{outtype}.gguf"


def convert_to_gguf(hf_dir: str, out_path: str | None = None, outtype: str = "bf16",
                    llama_dir: str | None = None, force: bool = False, timeout: float | None = None) -> dict:
    """Convert ``hf_dir`` to a GGUF at ``out_path`` with llama.cpp's converter (tokenizer added if missing).

    Skipped when ``out_path`` exists and is newer than ``hf_dir/config.json`` (unless ``force``). Written to
    ``out_path + ".tmp"`` and renamed when complete; the tmp file is removed on failure. Returns
    {"path", "converted" (bool), "seconds", "bytes", "tokenizer_written", "cmd"}.
    """
    llama_dir = _require_llama_cpp(llama_dir)
    out_path = os.path.abspath(out_path or default_gguf_path(hf_dir, outtype))
    cfg = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg):
        raise FileNotFoundError(f"{hf_dir}: no config.json")
    if (not force and os.path.isfile(out_path)
            and os.path.getmtime(out_path) > os.path.getmtime(cfg)):
        return {"path": out_path, "converted": False, "seconds": 0.0, "bytes": os.path.getsize(out_path),
                "tokenizer_written": [], "cmd": None}
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(hf_dir)):
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors / *.bin weights (the converter would write a GGUF "
                                "without tensors)")
    written = ensure_tokenizer(hf_dir)
    tmp = out_path + ".tmp"
    cmd = [sys.executable, "-c", _CONVERT_WRAPPER, llama_dir, os.path.abspath(hf_dir),
           "--outfile", tmp, "--outtype", outtype]
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or not os.path.isfile(tmp):
            raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {p.returncode}) for {hf_dir}:\n"
                               + (p.stdout + p.stderr)[-4000:])
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"path": out_path, "converted": True, "seconds": time.perf_counter() - t0,
            "bytes": os.path.getsize(out_path), "tokenizer_written": written,
            "cmd": " ".join(shlex.quote(c) for c in cmd[:2]) + " <wrapper> " + " ".join(map(shlex.quote, cmd[3:]))}


# ------------------------------------------------------------------------------------------------ bench

_LOAD_FLAGS: dict[str, list[str]] = {}


def _mmap_flags(binary: str) -> list[str]:
    """Flags that ask llama-bench for mmap loading (its default anyway), by what this build understands."""
    if binary not in _LOAD_FLAGS:
        try:
            h = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
            text = h.stdout + h.stderr
        except (OSError, subprocess.TimeoutExpired):
            text = ""
        if "--load-mode" in text:      # newer: -lm auto|none|mmap|... (auto = mmap on CPU)
            _LOAD_FLAGS[binary] = ["-lm", "mmap"]
        elif "--mmap" in text:         # older: -mmp 0|1
            _LOAD_FLAGS[binary] = ["-mmp", "1"]
        else:
            _LOAD_FLAGS[binary] = []
    return _LOAD_FLAGS[binary]


def bench(gguf: str, threads: int = 2, n_gen: int = 16, n_prompt: int = 0, limit_bytes: int | None = None,
          drop_caches: bool = True, reps: int = 1, llama_dir: str | None = None, extra_args=(),
          timeout: float | None = None) -> dict:
    """Run ``llama-bench -m GGUF -t T -p P -n N -r R -o json`` (mmap loading) through memlimit.run_measured.

    Returns a dict with:
      tg_tokens_per_s / tg_stddev  llama-bench's generation rate over the ``reps`` timed runs (n_gen > 0)
      pp_tokens_per_s / pp_stddev  its prompt rate (n_prompt > 0)
      wall_s, peak_rss_bytes, read_bytes, cgroup_peak_bytes, oom_killed, returncode: the whole process
          (memlimit fields; read_bytes = storage reads, page cache hits excluded; ``drop_caches`` makes the
          start cold). They cover model load (mmap with MAP_POPULATE: the whole GGUF is read once when
          cold, and under a budget smaller than the file it is read through once and evicted again), the
          warm-up (1 generated token; a full n_prompt batch for the prompt test) and the timed runs.
      read_bytes_per_gen_token     read_bytes / (n_gen * reps): everything, load and warm-up included,
          charged to the timed tokens (an upper bound on the per-token streaming)
      read_bytes_after_load_per_token  max(0, read_bytes - gguf_bytes) / (n_gen * reps + 1): estimate of the
          per-token storage traffic once the load's single pass is taken off (warm-up token counted; only
          when n_prompt == 0; meaningful for cold starts)
      gguf_bytes, cmd (list), cmd_str, llama_bench (the parsed JSON records), stderr_tail on failure
    """
    llama_dir = _require_llama_cpp(llama_dir)
    if n_gen <= 0 and n_prompt <= 0:
        raise ValueError("bench: need n_gen > 0 or n_prompt > 0")
    binary = os.path.join(llama_dir, "build", "bin", "llama-bench")
    gguf = os.path.abspath(gguf)
    if not os.path.isfile(gguf):
        raise FileNotFoundError(gguf)
    cmd = [binary, "-m", gguf, "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps),
           "-o", "json"] + _mmap_flags(binary) + [str(a) for a in extra_args]
    r = memlimit.run_measured(cmd, limit_bytes=limit_bytes, drop_caches=drop_caches, timeout=timeout)
    gguf_bytes = os.path.getsize(gguf)
    out = {
        "gguf": gguf, "gguf_bytes": gguf_bytes, "threads": threads, "n_gen": n_gen, "n_prompt": n_prompt,
        "reps": reps, "limit_bytes": limit_bytes, "drop_caches": drop_caches,
        "returncode": r["returncode"], "oom_killed": r["oom_killed"], "timed_out": r["timed_out"],
        "wall_s": r["wall_s"], "peak_rss_bytes": r["peak_rss_bytes"], "read_bytes": r["read_bytes"],
        "major_faults": r["major_faults"], "user_s": r["user_s"], "sys_s": r["sys_s"],
        "cgroup_peak_bytes": r["cgroup_peak_bytes"], "cgroup_failcnt": r["cgroup_failcnt"],
        "tg_tokens_per_s": None, "tg_stddev": None, "pp_tokens_per_s": None, "pp_stddev": None,
        "read_bytes_per_gen_token": (r["read_bytes"] / (n_gen * reps)) if n_gen > 0 else None,
        "read_bytes_after_load_per_token": (max(0, r["read_bytes"] - gguf_bytes) / (n_gen * reps + 1)
                                            if n_gen > 0 and n_prompt == 0 else None),
        "cmd": cmd, "cmd_str": " ".join(shlex.quote(c) for c in cmd),
        "llama_bench": None,
    }
    records = None
    s = r["stdout"] or ""
    i = s.find("[")
    if i >= 0:
        try:
            records = json.loads(s[i:])
        except ValueError:
            records = None
    if records is not None:
        out["llama_bench"] = records
        for rec in records:
            kind = "tg" if rec.get("n_gen", 0) > 0 and rec.get("n_prompt", 0) == 0 else \
                   "pp" if rec.get("n_prompt", 0) > 0 and rec.get("n_gen", 0) == 0 else None
            if kind:
                out[f"{kind}_tokens_per_s"] = rec.get("avg_ts")
                out[f"{kind}_stddev"] = rec.get("stddev_ts")
    if r["returncode"] != 0 or records is None:
        out["stderr_tail"] = (r["stderr"] or "")[-4000:]
    return out


# ------------------------------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("hf_dir", help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--gguf", default=None, help="GGUF path (default: <HF_DIR>.<outtype>.gguf)")
    p.add_argument("--outtype", default="bf16", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--limit-gb", type=float, default=None, help="memory budget in GiB (cgroup v1; root)")
    p.add_argument("--n-gen", type=int, default=16)
    p.add_argument("--n-prompt", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--no-drop-caches", action="store_true", help="keep the page cache (warm start)")
    p.add_argument("--timeout", type=float, default=None, help="kill llama-bench after this many seconds")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    llama_dir = find_llama_cpp()
    if llama_dir is None:
        print(BUILD_HELP, file=sys.stderr)
        return 2
    conv = convert_to_gguf(args.hf_dir, args.gguf, outtype=args.outtype, llama_dir=llama_dir)
    if conv["converted"]:
        print(f"converted {args.hf_dir} -> {conv['path']} in {conv['seconds']:.0f} s", file=sys.stderr)
    res = bench(conv["path"], threads=args.threads, n_gen=args.n_gen, n_prompt=args.n_prompt,
                limit_bytes=None if args.limit_gb is None else int(args.limit_gb * 2**30),
                drop_caches=not args.no_drop_caches, reps=args.reps, llama_dir=llama_dir, timeout=args.timeout)
    res["conversion"] = conv
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if res["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
