"""Downstream tasks: MMLU, GSM8K, TruthfulQA (MC1/MC2) and NaturalQuestions-open, with any routing policy
and expert cache.

    from moejax.evaluation import tasks
    from moejax.runtime import simulate
    res = tasks.evaluate_task(model, "mmlu", limit=100, routing="cache-prior",
                              cache=simulate.CacheConfig(size="0.5"))
    res["accuracy"], res["miss_rate"]

Every prompt is plain text with the model's BOS token (``cfg.bos_token_id``, when it has one) in front.
A continuation is tokenised the way lm-evaluation-harness does it: the tokens that ``context +
continuation`` has beyond ``context``. Its score is the sum of its tokens' log-probabilities from one
teacher-forced forward over ``context + continuation[:-1]``.

- ``mmlu`` (Hendrycks et al.; paper §4: 5-shot): shots are the first ``shots`` rows of the subject's
  ``dev`` file, prompt ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"``
  + per shot ``"{question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: X\\n\\n"`` + the question ending in
  ``"Answer:"``. The prediction is the letter whose continuation (" A" .. " D") has the highest
  log-likelihood: one forward over the prompt when every letter is one token (reading the last position),
  one forward per letter otherwise. Reports micro ``accuracy``, per-subject accuracies and their mean.
  Order (what ``limit`` takes first): subjects round-robin in sorted name order, rows in file order.
- ``gsm8k`` (paper §4: 8-shot chain of thought, policy during generation only): exemplars are the first
  ``shots`` rows of ``train.jsonl`` as ``"Question: {q}\\nAnswer: {reasoning} The answer is N.\\n\\n"``
  (the ``#### N`` line becomes the last sentence, ``<<...>>`` calculator notes are removed); the test
  question ends in ``"Answer:"``. Greedy generation of ``max_new_tokens`` (256); with a cache the prompt
  is routed with the original policy (``prefill_routing="original"``) and the policy acts on the
  generated tokens, both sharing one cache. The text is cut at the first "\\n\\nQuestion:", "Question:"
  or "\\n\\n\\n"; the answer is the number after "The answer is", else the last number; exact numeric
  match against the number after ``####``. Order: ``test.jsonl`` file order.
- ``truthfulqa`` (Lin et al., MC1/MC2 of ``mc_task.json``): 0-shot prompt ``"Q: {question}\\nA:"``, each
  choice scored as the continuation ``" {choice}"``. MC1 = the true answer scores strictly above every
  false one (ties are wrong, as in the TruthfulQA reference code); MC2 = probability mass of the true
  answers normalised over all MC2 choices. ``accuracy`` = MC1. Each distinct choice string of a question
  is scored once (MC1 choices first, then the MC2-only ones); with a cache every scored continuation is a
  forward that moves the cache, in that order. Order: file order.
- ``nq_open`` (Lee et al.; exact match): prompt ``"Q: {question}?\\nA:"``, ``shots`` (default 0)
  exemplars ``"Q: {question}?\\nA: {first answer}\\n\\n"`` taken from the first rows of the same file and
  excluded from scoring (so scoring starts at row ``shots + 1``); greedy generation of 16 tokens cut at
  the first newline; exact match after SQuAD normalisation (lower case, no punctuation, no articles,
  single spaces) against any gold answer.

Generated text is decoded as ``generate`` shows it (WikiText spacing undone for wikitext-style models such
as the default one) before answers are extracted. Prompts are the standard ones, not WikiText-spaced.

Context: a prompt must leave room in ``cfg.max_position_embeddings`` for the scored continuation (minus
its last token) or for ``max_new_tokens``. When it does not, shots are dropped from the end (counted in
``shortened``); when even the 0-shot prompt does not fit it is cut from the left, BOS kept (``truncated``).

Expert cache: with ``routing``, ``cache`` or ``state`` one cache state stream runs through every forward
and generation of the evaluation in the order above (as ``perplexity.wikitext_perplexity`` carries it across
chunks) and the result gains ``miss_rate``, ``lifetime``, ``lifetime_std``, ``bytes_per_token`` and
``cache`` (``simulate.summarize``). Note: generation ends at the chunk of 16 decode steps in which a stop string
appears (GSM8K: the next question; NQ-open: a newline), so the cache sees at most 15 tokens past it; it is
bucketed (``decode.generate(bucketed=True)``: a bounded set of compiled programs for all prompt lengths).

The ``state`` given is copied, never changed (``Model.generate`` donates the arrays it gets); the final
state comes back with ``return_state=True``. ``seconds_per_example`` includes XLA compilation.

Batch 1 throughout. Without a cache (and without extra ``options``) the scoring forwards are right-padded
to a multiple of 64 tokens so XLA compiles a handful of shapes (causal attention and per-token routing
leave earlier positions unchanged); with a cache nothing is padded (padding tokens would be routed and
move the cache), so each distinct prompt length compiles once; before the compiled programs exhaust the
process's memory maps (XLA:CPU) they are dropped (``ProgramBudget``; ``compile_cache_clears`` counts it).
"""

from __future__ import annotations

import inspect
import os
import time
import warnings
from typing import Any, Iterator

from moejax.base import errors, paths
from moejax.base.typecheck import is_integer
from moejax.runtime import offload as offload_lib
from moejax.runtime import simulate as sim
from moejax.evaluation.tasks.common import Encoder, Request, Stream, TaskData, _file_in, _progress, read_jsonl
from moejax.evaluation.tasks.gsm8k import _math_problem, gsm8k_requests, run_gsm8k
from moejax.evaluation.tasks.mmlu import (_multiple_choice, _subject_of, check_mmlu_shots, interleave_subjects,
                                          load_mmlu_files, mmlu_requests, run_mmlu)
from moejax.evaluation.tasks.nq_open import _open_question, nq_open_requests, run_nq_open
from moejax.evaluation.tasks.truthfulqa import _truthful_question, read_truthfulqa, run_truthfulqa, truthfulqa_requests

TASKS = ("mmlu", "gsm8k", "truthfulqa", "nq_open")


def default_data(task: str) -> str | None:
    """The task's local copy when no ``data`` is given: ``$MOEJAX_DATA/{task}``, or None (HF ``datasets``)."""
    return paths.in_data_dir(task)


DEFAULT_FILES = {"gsm8k": "test.jsonl", "truthfulqa": "mc_task.json", "nq_open": "NQ-open.dev.jsonl"}


DEFAULT_SHOTS = {"mmlu": 5, "gsm8k": 8, "truthfulqa": 0, "nq_open": 0}


DEFAULT_MAX_NEW_TOKENS = {"gsm8k": 256, "nq_open": 16}


def shot_files(task: str, path: str) -> list[str]:
    """The files besides a task's data file ``path`` that ``load_task_files`` reads the shots from (gsm8k's
    ``train.jsonl`` beside it, MMLU's ``../dev/{subject}_dev.csv``): results are keyed by their contents too.
    A folder: none (its digest covers everything in it)."""
    if os.path.isdir(path):
        return []
    if task == "gsm8k":
        return [os.path.join(os.path.dirname(os.path.abspath(path)), "train.jsonl")]
    if task == "mmlu":
        folder = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        return [os.path.join(folder, "dev", f"{_subject_of(path, '_test.csv')}_dev.csv")]
    return []


def load_task_files(task: str, path: str, shots: int) -> TaskData:
    """Read ``task``'s examples (and few-shot pool) from a local file or folder."""
    if task == "mmlu":
        return load_mmlu_files(path)
    file = _file_in(path, DEFAULT_FILES[task])
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{task} data file {file} does not exist")
    if task == "truthfulqa":
        return TaskData(read_truthfulqa(file), [], [file])
    if task == "nq_open":
        rows = read_jsonl(file, _open_question)
        if shots >= len(rows):
            raise errors.UsageError(f"--shots {shots}: {file} holds {len(rows)} question(s), and the shots are taken "
                                    "from its first rows: none would be left to score")
        return TaskData(rows[shots:], rows[:shots], [file])
    train = os.path.join(os.path.dirname(file), "train.jsonl")
    pool: list = []
    if shots:
        if not os.path.isfile(train):
            raise FileNotFoundError(f"gsm8k few-shot exemplars: {train} does not exist (pass shots=0 or add it)")
        pool = read_jsonl(train, _math_problem, n=shots)
    return TaskData(read_jsonl(file, _math_problem), pool, [file] + ([train] if shots else []))


HF_SOURCES = {  # task -> (dataset name, config, splits)
    "mmlu": ("cais/mmlu", "all", ("test", "dev")),
    "gsm8k": ("gsm8k", "main", ("test", "train")),
    "truthfulqa": ("truthful_qa", "multiple_choice", ("validation",)),
    "nq_open": ("nq_open", None, ("validation",)),
}


def fetch_hf(task: str) -> dict[str, list]:
    """The task's splits from Hugging Face ``datasets`` (network needed): {split: [row dict]}."""
    import datasets

    name, config, splits = HF_SOURCES[task]
    args = (name, config) if config else (name,)
    return {split: list(datasets.load_dataset(*args, split=split)) for split in splits}


def parse_hf(task: str, rows: dict[str, list], shots: int) -> TaskData:
    """HF rows validated like the local files (errors name ``hf:NAME[split] row N``)."""
    name = HF_SOURCES[task][0]

    def parsed(split, parse, n=None):
        return [parse(r, f"hf:{name}[{split}] row {i}") for i, r in enumerate(rows[split][:n], 1)]

    if task == "mmlu":
        parts = {}
        for split in ("test", "dev"):
            grouped: dict[str, list] = {}
            for row in parsed(split, lambda r, where: _multiple_choice(
                    str(r.get("subject", "")), [r.get("question", "")] + list(r.get("choices", []))
                    + [r.get("answer", "")], where)):
                grouped.setdefault(row.subject, []).append(row)
            parts[split] = grouped
        return TaskData(interleave_subjects(parts["test"]), parts["dev"], [f"hf:{name}"])
    if task == "gsm8k":
        return TaskData(parsed("test", _math_problem), parsed("train", _math_problem, shots), [f"hf:{name}"])
    if task == "truthfulqa":
        return TaskData(parsed("validation", _truthful_question), [], [f"hf:{name}"])
    questions = parsed("validation", _open_question)
    return TaskData(questions[shots:], questions[:shots], [f"hf:{name}"])


def load_task(task: str, data: str | None = None, shots: int = 0) -> TaskData:
    """``data`` (file or folder), else ``$MOEJAX_DATA/{task}``, else HF ``datasets``, else an error naming both."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if data is not None:
        if not os.path.exists(data):
            raise FileNotFoundError(f"{task} data {data} does not exist")
        if not (os.path.isfile(data) or os.path.isdir(data)):  # a device (/dev/zero) or a pipe would never end
            raise OSError(f"{task} data {data} is neither a regular file nor a folder")
        return load_task_files(task, data, shots)
    path = default_data(task)
    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no {task} data at {path} (${paths.DATA_ENV}/{task}); pass data=PATH or unset "
                                    f"${paths.DATA_ENV} to fetch it with HF datasets")
        return load_task_files(task, path, shots)
    name, config, _ = HF_SOURCES[task]
    try:  # the usual recipe, where the network is there
        import datasets  # noqa: F401 - only to tell "not installed" from a failed download
    except ImportError:
        raise FileNotFoundError(f"no {task} data: pass --data PATH (or set ${paths.DATA_ENV}), or install HF "
                                f"datasets to fetch {name} ({paths.DATA_EXTRA})") from None
    try:
        rows = fetch_hf(task)
    except Exception as e:  # noqa: BLE001 - report the real cause, with the other way
        raise FileNotFoundError(f"the HF datasets copy of {task} ({name} {config or ''}) failed "
                                f"({type(e).__name__}: {e}); pass --data PATH") from e
    return parse_hf(task, rows, shots)


# What the task's Stream passes itself on each call (beside evaluate_task's own routing, cache, state and
# max_new_tokens, which never reach ``options``): an option may not name these.
STREAM_KEYWORDS = ("stop", "bucketed", "prefill_routing")


def _check_options(model, task: str, options: dict) -> None:
    """Each extra option must be a keyword of the model call the task makes (``forward`` for the scored
    tasks, ``generate`` for the generative ones), and not one the evaluation sets itself: a typo or a
    clash is named here instead of failing deep inside the first example."""
    method = "generate" if task in DEFAULT_MAX_NEW_TOKENS else "forward"
    params = inspect.signature(getattr(model, method)).parameters
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for name in options:
        if name in STREAM_KEYWORDS:
            raise TypeError(f"evaluate_task sets {name!r} itself on every {method} call")
        if not open_ended and name not in params:
            raise TypeError(f"evaluate_task got option {name!r}, which Model.{method} (the call {task} makes) "
                            f"does not take")


def _prepare(model, task: str, data: str | None, limit: int | None, shots: int | None,
             max_new_tokens: int | None, warn: bool = True) -> tuple[Encoder, TaskData, int, int]:
    """The checked arguments of a task evaluation, its examples (the first ``limit``) and its encoder:
    (encoder, data, shots, max_new_tokens)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    shots = DEFAULT_SHOTS[task] if shots is None else int(shots)
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if task == "truthfulqa" and shots:
        raise ValueError(f"truthfulqa is evaluated 0-shot (MC1/MC2); got shots={shots}")
    if limit is not None and (not is_integer(limit) or limit < 1):
        raise ValueError(f"limit must be an integer >= 1 or None, got {limit!r}")
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS.get(task, 0) if max_new_tokens is None else int(max_new_tokens)
    loaded = load_task(task, data, shots)
    if not loaded.examples:
        raise ValueError(f"no {task} examples to score in {', '.join(loaded.files)}")
    if task == "gsm8k" and len(loaded.shots) < shots:  # a short train file: say how many were really shown
        if warn:
            warnings.warn(f"gsm8k: {', '.join(loaded.files[1:])} holds {len(loaded.shots)} exemplar(s), fewer "
                          f"than shots={shots}: {len(loaded.shots)}-shot", stacklevel=3)
        shots = len(loaded.shots)
    if limit is not None:
        loaded.examples = loaded.examples[:limit]
    enc = Encoder(model)
    if task == "mmlu":  # a shot count the dev files cannot supply is refused before the first example
        check_mmlu_shots(loaded, shots)
    return enc, loaded, shots, max_new_tokens


def task_requests(task: str, enc: Encoder, data: TaskData, shots: int, max_new_tokens: int,
                  context: int) -> Iterator[Request]:
    """Every example's model work, in scoring order, as the task's run makes it."""
    if task == "mmlu":
        return mmlu_requests(enc, data, shots, context)
    if task == "gsm8k":
        return gsm8k_requests(enc, data, shots, max_new_tokens, context)
    if task == "truthfulqa":
        return truthfulqa_requests(enc, data, context)
    return nq_open_requests(enc, data, shots, max_new_tokens, context)


def longest_pass(model, task: str, data: str | None = None, *, limit: int | None = None, shots: int | None = None,
                 max_new_tokens: int | None = None) -> tuple[int, int]:
    """(positions, logit rows) of the largest model call the evaluation will make: what an offloaded one must
    hold beside its slots (a KV cache of that many positions; the float32 logits a scored pass returns).
    Builds every prompt, as the run will (tokenizing is seconds against the run's hours), so a budget is
    checked against the real longest prompt, not ``--context``, which the tasks do not read."""
    enc, loaded, shots, max_new_tokens = _prepare(model, task, data, limit, shots, max_new_tokens, warn=False)
    context = model.cfg.max_position_embeddings  # as Stream.context
    passes = [p for req in task_requests(task, enc, loaded, shots, max_new_tokens, context) for p in req.passes()]
    return max(p[0] for p in passes), max(p[1] for p in passes)


def evaluate_task(model, task: str, data: str | None = None, *, limit: int | None = None, routing=None,
                  cache=None, state=None, shots: int | None = None, max_new_tokens: int | None = None,
                  progress: bool = False, return_state: bool = False, **options) -> dict:
    """Accuracy of ``model`` on ``task`` (see the module docstring for each task's protocol).

    ``data``: a file or folder (default: ``$MOEJAX_DATA/{task}``, else HF ``datasets``); ``limit``: score
    the first N examples; ``shots`` / ``max_new_tokens``: override the task's defaults (``max_new_tokens``
    only matters for gsm8k and nq_open); ``routing`` / ``cache`` / ``state``: simulate the expert cache, one
    state carried through the whole evaluation (``return_state=True`` returns ``(result, final_state)``);
    ``options`` go unchanged to every ``model.forward`` / ``model.generate`` call."""
    enc, loaded, shots, max_new_tokens = _prepare(model, task, data, limit, shots, max_new_tokens)
    _check_options(model, task, options)
    stream = Stream(model, routing, cache, state, options)
    update, close = _progress(len(loaded.examples), task, progress)
    t0 = time.perf_counter()
    try:
        if task == "mmlu":
            res = run_mmlu(stream, enc, loaded, shots, update)
        elif task == "gsm8k":
            res = run_gsm8k(stream, enc, loaded, shots, max_new_tokens, update)
        elif task == "truthfulqa":
            res = run_truthfulqa(stream, enc, loaded, update)
        else:
            res = run_nq_open(stream, enc, loaded, shots, max_new_tokens, update)
    finally:
        close()
    seconds = time.perf_counter() - t0
    result: dict[str, Any] = {"task": task, "examples": res.pop("examples"), "accuracy": res.pop("accuracy"),
                              "shots": shots, "data": loaded.files, **res, "tokens": stream.tokens,
                              "compile_cache_clears": stream.programs.clears, "seconds": seconds,
                              "seconds_per_example": seconds / len(loaded.examples)}
    if stream.simulate:

        stats = sim.summarize(stream.state, model.params, model.cfg)
        result.update(miss_rate=stats["miss_rate"], lifetime=stats["lifetime_mean"],
                      lifetime_std=stats["lifetime_std"], bytes_per_token=stats.get("bytes_per_token"),
                      cache=stats)
    if stream.offload_calls:  # options={"offload": ...}: what the real paging moved, over every call
        result["offload"] = offload_lib.merge_summaries(stream.offload_calls)
    return (result, stream.state) if return_state else result
