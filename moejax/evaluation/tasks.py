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

import contextlib
import csv
import dataclasses
import json
import os
import re
import string
import sys
import time
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

import numpy as np

from moejax.base import errors, paths, textproc
from moejax.experts import routing as routing_lib
from moejax.runtime import decode, simulate as sim

TASKS = ("mmlu", "gsm8k", "truthfulqa", "nq_open")

DEFAULT_DATA = {task: os.path.join(paths.SHARED_DATA, task) for task in TASKS}
DEFAULT_FILES = {"gsm8k": "test.jsonl", "truthfulqa": "mc_task.json", "nq_open": "NQ-open.dev.jsonl"}
DEFAULT_SHOTS = {"mmlu": 5, "gsm8k": 8, "truthfulqa": 0, "nq_open": 0}
DEFAULT_MAX_NEW_TOKENS = {"gsm8k": 256, "nq_open": 16}
LETTERS = "ABCD"
PAD_MULTIPLE = 64
GSM8K_STOPS = ("\n\nQuestion:", "Question:", "\n\n\n")
N_SAMPLES = 3  # generations kept in the result for inspection


# ----------------------------------------------------------------------------------------------- records
@dataclasses.dataclass(frozen=True)
class MultipleChoice:
    """One MMLU row: ``answer`` is the index (0-3) of the right choice."""

    subject: str
    question: str
    choices: tuple[str, ...]
    answer: int


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One GSM8K row: ``solution`` is the reference answer text, ``gold`` the number after ``####``."""

    question: str
    solution: str
    gold: str


@dataclasses.dataclass(frozen=True)
class TruthfulQuestion:
    """One TruthfulQA question with its MC1 and MC2 choices and 0/1 labels (file order kept)."""

    question: str
    mc1_choices: tuple[str, ...]
    mc1_labels: tuple[int, ...]
    mc2_choices: tuple[str, ...]
    mc2_labels: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class OpenQuestion:
    """One NQ-open row: any of ``answers`` is right."""

    question: str
    answers: tuple[str, ...]


@dataclasses.dataclass
class TaskData:
    """What a task evaluates: examples in scoring order, the few-shot pool, and where they came from."""

    examples: list
    shots: Any  # mmlu: {subject: [MultipleChoice]}; gsm8k / nq_open: list; truthfulqa: []
    files: list[str]
    shot_source: dict[str, str] = dataclasses.field(default_factory=dict)  # mmlu: subject -> dev path


# ------------------------------------------------------------------------------------- row validation
def _need_str(obj: dict, field: str, where: str) -> str:
    if field not in obj:
        raise ValueError(f"{where}: missing field {field!r}")
    value = obj[field]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {field!r} must be a non-empty string, got {value!r}")
    return value


def gsm8k_gold(solution: str, where: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, commas removed."""
    if "####" not in solution:
        raise ValueError(f"{where}: answer has no '#### N' final line")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if normalize_number(gold) is None:
        raise ValueError(f"{where}: final answer {gold!r} after '####' is not a number")
    return gold


def _math_problem(obj: Any, where: str) -> MathProblem:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    question, solution = _need_str(obj, "question", where), _need_str(obj, "answer", where)
    return MathProblem(question, solution, gsm8k_gold(solution, where))


def _open_question(obj: Any, where: str) -> OpenQuestion:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    question = _need_str(obj, "question", where)
    if "answer" not in obj:
        raise ValueError(f"{where}: missing field 'answer'")
    answers = obj["answer"]
    if isinstance(answers, str):
        answers = [answers]
    if (not isinstance(answers, (list, tuple)) or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)):
        raise ValueError(f"{where}: field 'answer' must be a non-empty list of strings, got {answers!r}")
    return OpenQuestion(question, tuple(answers))


def _mc_targets(obj: dict, field: str, where: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``{choice: label}`` (mc_task.json) or ``{"choices": [...], "labels": [...]}`` (HF datasets)."""
    if field not in obj:
        raise ValueError(f"{where}: missing field {field!r}")
    t = obj[field]
    if isinstance(t, dict) and set(t) == {"choices", "labels"}:
        if len(t["choices"]) != len(t["labels"]):
            raise ValueError(f"{where}: {field} has {len(t['choices'])} choices but {len(t['labels'])} labels")
        pairs = list(zip(t["choices"], t["labels"]))
    elif isinstance(t, dict):
        pairs = list(t.items())
    else:
        raise ValueError(f"{where}: {field} must be an object of choice -> 0/1 label, got {type(t).__name__}")
    if not pairs:
        raise ValueError(f"{where}: {field} has no choices")
    for choice, label in pairs:
        if not isinstance(choice, str) or not choice.strip():
            raise ValueError(f"{where}: {field} has an empty or non-string choice {choice!r}")
        if label not in (0, 1):
            raise ValueError(f"{where}: {field} label of {choice!r} must be 0 or 1, got {label!r}")
    labels = tuple(int(label) for _, label in pairs)
    if sum(labels) == 0:
        raise ValueError(f"{where}: {field} has no true answer (label 1)")
    if field == "mc1_targets" and sum(labels) != 1:
        raise ValueError(f"{where}: mc1_targets must have exactly one true answer, got {sum(labels)}")
    return tuple(c for c, _ in pairs), labels


def _truthful_question(obj: Any, where: str) -> TruthfulQuestion:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    question = _need_str(obj, "question", where)
    mc1, mc2 = _mc_targets(obj, "mc1_targets", where), _mc_targets(obj, "mc2_targets", where)
    return TruthfulQuestion(question, mc1[0], mc1[1], mc2[0], mc2[1])


def _mmlu_answer(value: Any, where: str) -> int:
    text = str(value).strip()
    if text.upper() in tuple(LETTERS):
        return LETTERS.index(text.upper())
    if text in ("0", "1", "2", "3"):
        return int(text)
    raise ValueError(f"{where}: answer {value!r} is out of range (expected 0-3 or A-D)")


def _multiple_choice(subject: str, row: list, where: str) -> MultipleChoice:
    if len(row) != 6:
        raise ValueError(f"{where}: expected 6 columns (question, 4 choices, answer), got {len(row)}")
    if not str(row[0]).strip():
        raise ValueError(f"{where}: empty question")
    return MultipleChoice(subject, str(row[0]), tuple(str(c) for c in row[1:5]), _mmlu_answer(row[5], where))


# ---------------------------------------------------------------------------------------- file readers
@contextlib.contextmanager
def _open_text(path: str, newline: str | None = None):
    """A data file opened as UTF-8 text; bytes that are not UTF-8 become a ``Failure`` naming the file."""
    with open(path, encoding="utf-8", newline=newline) as f:
        try:
            yield f
        except UnicodeDecodeError as e:
            raise errors.Failure(f"{path} is not UTF-8 text ({e.reason} at byte {e.start} of a read)") from None


def read_jsonl(path: str, parse: Callable[[Any, str], Any], n: int | None = None) -> list:
    """Rows of a JSON-lines file through ``parse(obj, where)``; blank lines skipped; stops after ``n``."""
    rows = []
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if n is not None and len(rows) >= n:
                break
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            rows.append(parse(obj, where))
    return rows


def read_mmlu_csv(path: str, subject: str) -> list[MultipleChoice]:
    """An MMLU csv (optional ``question,choice0..choice3,answer`` header; answer 0-3 or A-D)."""
    rows: list[MultipleChoice] = []
    with _open_text(path, newline="") as f:
        reader = csv.reader(f)
        start = 1
        try:
            for row in reader:
                where = f"{path}, line {start}"
                start = reader.line_num + 1
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if not rows and [c.strip().lower() for c in row[:1] + row[-1:]] == ["question", "answer"]:
                    continue  # header
                rows.append(_multiple_choice(subject, row, where))
        except csv.Error as e:
            raise ValueError(f"{path}, line {reader.line_num}: malformed CSV ({e})") from None
    return rows


def read_truthfulqa(path: str) -> list[TruthfulQuestion]:
    """``mc_task.json``: a JSON list of ``{question, mc1_targets, mc2_targets}``."""
    with _open_text(path) as f:
        try:
            items = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {e.lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON list of questions, got {type(items).__name__}")
    return [_truthful_question(obj, f"{path}, entry {i}") for i, obj in enumerate(items, 1)]


def _subject_of(filename: str, suffix: str) -> str:
    base = os.path.basename(filename)
    return base[: -len(suffix)] if base.endswith(suffix) else os.path.splitext(base)[0]


def interleave_subjects(by_subject: dict[str, list]) -> list:
    """Round-robin over sorted subjects (row 1 of every subject, then row 2, ...): a small ``limit``
    still covers many subjects."""
    names = sorted(by_subject)
    longest = max((len(by_subject[s]) for s in names), default=0)
    return [by_subject[s][i] for i in range(longest) for s in names if i < len(by_subject[s])]


def load_mmlu_files(path: str) -> TaskData:
    """A folder with ``test/`` and ``dev/`` csvs (``{subject}_test.csv`` / ``{subject}_dev.csv``), or one
    ``{subject}_test.csv`` whose dev file is ``../dev/{subject}_dev.csv``."""
    if os.path.isdir(path):
        test_dir, dev_dir = os.path.join(path, "test"), os.path.join(path, "dev")
        if not os.path.isdir(test_dir):
            raise FileNotFoundError(f"MMLU folder {path} has no test/ folder of {{subject}}_test.csv files")
        tests = sorted(os.path.join(test_dir, f) for f in os.listdir(test_dir) if f.endswith(".csv"))
        if not tests:
            raise FileNotFoundError(f"MMLU folder {test_dir} has no .csv files")
        files = [test_dir, dev_dir]
    else:
        folder = os.path.dirname(os.path.abspath(path))
        tests, dev_dir, files = [path], os.path.join(os.path.dirname(folder), "dev"), [path]
    by_subject, dev, dev_paths = {}, {}, {}
    for test in tests:
        subject = _subject_of(test, "_test.csv")
        by_subject[subject] = read_mmlu_csv(test, subject)
        dev_paths[subject] = os.path.join(dev_dir, f"{subject}_dev.csv")
        if os.path.isfile(dev_paths[subject]):
            dev[subject] = read_mmlu_csv(dev_paths[subject], subject)
            if dev_paths[subject] not in files and dev_dir not in files:
                files.append(dev_paths[subject])
    return TaskData(interleave_subjects(by_subject), dev, files, dev_paths)


def _file_in(path: str, name: str) -> str:
    return os.path.join(path, name) if os.path.isdir(path) else path


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
        return TaskData(rows[shots:], rows[:shots], [file])
    train = os.path.join(os.path.dirname(file), "train.jsonl")
    pool: list = []
    if shots:
        if not os.path.isfile(train):
            raise FileNotFoundError(f"gsm8k few-shot exemplars: {train} does not exist (pass shots=0 or add it)")
        pool = read_jsonl(train, _math_problem, n=shots)
    return TaskData(read_jsonl(file, _math_problem), pool, [file] + ([train] if shots else []))


# ---------------------------------------------------------------------------------- HF datasets fallback
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
    """``data`` (file or folder), else the repository's ``../shared/data`` copy, else HF ``datasets``."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if data is not None:
        if not os.path.exists(data):
            raise FileNotFoundError(f"{task} data {data} does not exist")
        return load_task_files(task, data, shots)
    path = DEFAULT_DATA[task]
    if os.path.exists(path):
        return load_task_files(task, path, shots)
    try:  # the usual recipe, where the network is there
        rows = fetch_hf(task)
    except Exception as e:  # noqa: BLE001 - report the real cause with the local path we looked for
        name, config, _ = HF_SOURCES[task]
        raise FileNotFoundError(f"no {task} data at {path} and the HF datasets copy ({name} {config or ''}) failed "
                                f"({type(e).__name__}: {e}); pass data=PATH") from e
    return parse_hf(task, rows, shots)


# ------------------------------------------------------------------------------------------------ prompts
def mmlu_header(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_question(row: MultipleChoice, with_answer: bool) -> str:
    """``question\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:`` (+ `` X\\n\\n`` for a shot)."""
    text = row.question + "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, row.choices))
    return text + "\nAnswer:" + (f" {LETTERS[row.answer]}\n\n" if with_answer else "")


def mmlu_prompt(row: MultipleChoice, shots: list[MultipleChoice]) -> str:
    return mmlu_header(row.subject) + "".join(mmlu_question(s, True) for s in shots) + mmlu_question(row, False)


def gsm8k_exemplar(row: MathProblem) -> str:
    """``Question: q\\nAnswer: reasoning The answer is N.\\n\\n`` (calculator notes removed)."""
    reasoning = re.sub(r"<<[^>]*>>", "", row.solution.rsplit("####", 1)[0]).strip()
    return f"Question: {row.question}\nAnswer: {reasoning} The answer is {row.gold}.\n\n"


def gsm8k_prompt(row: MathProblem, shots: list[MathProblem]) -> str:
    return "".join(gsm8k_exemplar(s) for s in shots) + f"Question: {row.question}\nAnswer:"


def truthfulqa_prompt(row: TruthfulQuestion) -> str:
    return f"Q: {row.question}\nA:"


def _nq_question(question: str) -> str:
    return f"Q: {question.rstrip().rstrip('?')}?\nA:"


def nq_prompt(row: OpenQuestion, shots: list[OpenQuestion]) -> str:
    return "".join(f"{_nq_question(s.question)} {s.answers[0]}\n\n" for s in shots) + _nq_question(row.question)


# ------------------------------------------------------------------------------------------------ metrics
_NUMBER = r"-?\$?\d(?:[\d,]*\d)?(?:\.\d+)?"


def normalize_number(text: str | None) -> Decimal | None:
    """``"$1,234.50"`` -> Decimal("1234.50"); None when it is not a number."""
    if text is None:
        return None
    cleaned = text.strip().replace("$", "").replace(",", "").rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def cut_at_stops(text: str, stops: tuple[str, ...] = GSM8K_STOPS) -> str:
    """``text`` up to the earliest stop string."""
    return decode.cut_at_stops(text, stops)


def extract_number(text: str) -> str | None:
    """The number after "The answer is", else the last number in ``text`` (commas, $ and a final . removed)."""
    m = re.search(r"the answer is\s*:?\s*(" + _NUMBER + ")", text, re.IGNORECASE)
    if m:
        found = m.group(1)
    else:
        numbers = re.findall(_NUMBER, text)
        if not numbers:
            return None
        found = numbers[-1]
    return found.replace("$", "").replace(",", "").rstrip(".")


def numbers_match(prediction: str | None, gold: str) -> bool:
    a, b = normalize_number(prediction), normalize_number(gold)
    return a is not None and b is not None and a == b


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers) -> bool:
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(a) for a in answers)


def mc1_correct(scores: list[float], labels: tuple[int, ...]) -> bool:
    """The single true choice scores strictly above every false one."""
    true = [s for s, y in zip(scores, labels) if y]
    false = [s for s, y in zip(scores, labels) if not y]
    return not false or true[0] > max(false)


def mc2_score(scores: list[float], labels: tuple[int, ...]) -> float:
    """Probability mass of the true choices, normalised over all choices (scores are log-likelihoods)."""
    s = np.asarray(scores, np.float64)
    p = np.exp(s - s.max())
    return float(p[np.asarray(labels, bool)].sum() / p.sum())


def log_softmax_at(logits: np.ndarray, positions, ids) -> np.ndarray:
    """log p(ids[i] | position positions[i]) from raw logits [T, V], in float64."""
    z = np.asarray(logits[np.asarray(positions)], np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return logp[np.arange(len(ids)), np.asarray(ids)]


# ------------------------------------------------------------------------------------ model interaction
def _mapped_regions() -> int | None:
    """Memory regions this process has mapped (Linux), None where /proc is not there."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _map_budget() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 32765


class ProgramBudget:
    """Drops XLA's compiled programs (``jax.clear_caches``) before they exhaust the process's memory maps.

    Without padding every prompt length is its own program, and on XLA:CPU one program with a simulated
    cache maps ~700 regions (a cached generation ~1,600): a 100-example MMLU run with a cache used to die
    in LLVM ("Cannot allocate memory") at the kernel's ``vm.max_map_count`` (65,530). So when a new shape
    is about to compile and the process holds more than half that many regions (or, without /proc, after
    ``fallback_shapes`` new shapes), the caches are cleared; the lengths that come back compile again."""

    def __init__(self, budget: int | None = None, fallback_shapes: int = 32):
        self.budget = budget or _map_budget()
        self.fallback_shapes = fallback_shapes
        self.shapes: set = set()
        self.clears = 0

    def before(self, key) -> None:
        if key in self.shapes:
            return
        regions = _mapped_regions()
        full = regions > self.budget if regions is not None else len(self.shapes) >= self.fallback_shapes
        if full:
            import gc

            import jax

            jax.clear_caches()
            gc.collect()
            self.shapes.clear()
            self.clears += 1
        self.shapes.add(key)


def own_state(state):
    """A committed copy of a router state. ``Model.generate`` donates the state it is given, so the
    caller's stays valid; and committed arrays match the states the model hands back, so the second
    call does not compile again (a fresh state's arrays are uncommitted, which is another jit key)."""
    import jax

    def copy(x):
        return jax.device_put(x, x.sharding, may_alias=False) if isinstance(x, jax.Array) else x

    return jax.tree_util.tree_map(copy, state)


def resolve_policy(model, routing):
    """A routing policy from a policy or a kind name (as ``Model.forward`` reads ``routing=``)."""
    if routing is None or isinstance(routing, str):

        return routing_lib.make_policy(routing or "original", model.cfg.top_k)
    return routing


def padded_length(n_tokens: int, context: int, rope_long_after: int) -> int:
    """Length a pass of ``n_tokens`` is right-padded to: a multiple of ``PAD_MULTIPLE`` (one compiled program
    per bucket instead of one per prompt length), never past the context, and never across a longrope
    model's switch to its long factors (the rope of the real tokens would change)."""
    limit = max(context, n_tokens)
    if n_tokens <= rope_long_after:
        limit = min(limit, rope_long_after)
    return min(-(-n_tokens // PAD_MULTIPLE) * PAD_MULTIPLE, limit)


class Stream:
    """Every forward and generation of one evaluation, in order, carrying the expert-cache state."""

    def __init__(self, model, routing=None, cache=None, state=None, options: dict | None = None):
        self.model, self.options = model, dict(options or {})
        self.simulate = routing is not None or cache is not None or state is not None
        self.state = None
        if self.simulate:
            if state is None:
                state = model.router_state(routing, cache)
            elif routing is not None:  # the given cache, with ``routing``'s policy
                state = {**state, "policy": resolve_policy(model, routing)}
            self.state = own_state(state)
        self.tokens = 0  # tokens fed to the model (their routing moved the cache)
        self.context = model.cfg.max_position_embeddings
        self.programs = ProgramBudget()

    def _cache_kwargs(self) -> dict:
        return {"state": self.state} if self.simulate else {}

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """Teacher-forced logits [T, V]; right-padded to a multiple of 64 when no cache is simulated."""
        ids = np.asarray(ids, np.int32)
        self.tokens += len(ids)
        if self.simulate or self.options:  # an option might care about every token: no padding either
            self.programs.before(("forward", len(ids)))
            out = self.model.forward(ids, **self._cache_kwargs(), **self.options)
            if self.simulate:
                self.state = out.state
            return out.logits
        padded = padded_length(len(ids), self.context, getattr(self.model.cfg, "rope_long_after", self.context))
        self.programs.before(("forward", padded))
        full = np.zeros(padded, np.int32)
        full[: len(ids)] = ids
        return self.model.forward(full).logits[: len(ids)]

    def generate(self, ids: np.ndarray, max_new_tokens: int, prefill_routing=None, stop=()) -> list[int]:
        """Greedy generation (unless options say otherwise) up to a ``stop`` string; the cache state goes on
        from the result."""
        # bucketed: a few programs for all prompt lengths, instead of two compilations per length
        kw = {"max_new_tokens": max_new_tokens, "stop": stop, "bucketed": True, **self._cache_kwargs()}
        if self.simulate and prefill_routing is not None:
            kw["prefill_routing"] = prefill_routing
        self.programs.before(("generate", len(ids), max_new_tokens))
        result = self.model.generate(np.asarray(ids, np.int32), **kw, **self.options)
        if self.simulate:
            self.state = result.router_state
        # what the model ran: the last generated token is never fed, and a stop's chunk runs to its end
        self.tokens += result.stats["fed_tokens"]
        return list(result.token_ids)


class Encoder:
    """Prompt and continuation token ids for the model's tokenizer and BOS."""

    def __init__(self, model):
        if model.tokenizer is None:
            raise ValueError(f"{model.path} has no tokenizer.json: task evaluation needs one")

        self.tok, self.bos = model.tokenizer, model.cfg.bos_token_id
        style = textproc.is_wikitext_style(getattr(model, "generation_config", None))
        self._render = textproc.wikitext_detokenize if style else str

    def render(self, tokens) -> str:
        """Generated text as the user would read it (WikiText spacing undone for wikitext-style models)."""
        return self._render(self.tok.decode(tokens))

    def text(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, text: str) -> np.ndarray:
        return np.asarray(([] if self.bos is None else [self.bos]) + self.text(text), np.int32)

    def continuation(self, context: str, continuation: str) -> list[int]:
        """The tokens of ``context + continuation`` beyond those of ``context`` (lm-eval-harness), so the
        continuation is tokenised as it would appear in running text."""
        whole, ctx = self.text(context + continuation), self.text(context)
        if len(whole) > len(ctx) and whole[: len(ctx)] == ctx:
            return whole[len(ctx):]
        return self.text(continuation)


@dataclasses.dataclass
class FittedPrompt:
    ids: np.ndarray
    text: str
    shots: int
    truncated: bool


def fit_prompt(enc: Encoder, build: Callable[[int], str], shots: int, budget: int) -> FittedPrompt:
    """The prompt with the most shots (``shots`` down to 0) of at most ``budget`` tokens; 0-shot cut from
    the left (BOS kept) when even that is too long."""
    if budget < 2:
        raise ValueError(f"no room for a prompt: {budget} tokens left in the context")
    for k in range(shots, -1, -1):
        text = build(k)
        ids = enc.prompt(text)
        if len(ids) <= budget:
            return FittedPrompt(ids, text, k, False)
    head = [] if enc.bos is None else [enc.bos]
    ids = np.asarray(head + ids[len(ids) - (budget - len(head)):].tolist(), np.int32)
    return FittedPrompt(ids, text, 0, True)


def score_continuations(stream: Stream, prompt: np.ndarray, continuations: list[list[int]]) -> list[float]:
    """Sum of log-probs of each continuation after ``prompt``; one forward in all when every
    continuation is one token, else one forward over ``prompt + continuation[:-1]`` each, in order."""
    if all(len(c) == 1 for c in continuations):
        logits = stream.logits(prompt)
        last = len(prompt) - 1
        return log_softmax_at(logits, [last] * len(continuations), [c[0] for c in continuations]).tolist()
    scores = []
    for cont in continuations:
        ids = np.concatenate([prompt, np.asarray(cont[:-1], np.int32)])
        logits = stream.logits(ids)
        positions = np.arange(len(prompt) - 1, len(ids))
        scores.append(float(log_softmax_at(logits, positions, cont).sum()))
    return scores


# ---------------------------------------------------------------------------------------------- tasks
@dataclasses.dataclass
class Tally:
    """Counters every task reports."""

    shots_used: list = dataclasses.field(default_factory=list)
    shortened: int = 0
    truncated: int = 0

    def add(self, p: FittedPrompt, asked: int) -> None:
        self.shots_used.append(p.shots)
        self.shortened += p.shots < asked
        self.truncated += p.truncated

    def summary(self) -> dict:
        return {"shortened": self.shortened, "truncated": self.truncated,
                "mean_shots": float(np.mean(self.shots_used)) if self.shots_used else 0.0}


def run_mmlu(stream: Stream, enc: Encoder, data: TaskData, shots: int, bar) -> dict:
    tally, correct = Tally(), []
    subjects: dict[str, list[bool]] = {}
    predicted = dict.fromkeys(LETTERS, 0)
    multi_token = 0
    for row in data.examples:
        where = data.shot_source.get(row.subject, f"the dev split of {row.subject}")
        if shots and row.subject not in data.shots:
            raise FileNotFoundError(f"mmlu {row.subject}: no dev file {where} for the {shots}-shot prompt "
                                    "(pass shots=0)")
        pool = data.shots.get(row.subject, [])
        if len(pool) < shots:
            raise ValueError(f"mmlu {row.subject}: {shots} shots asked but {where} has {len(pool)} rows")
        conts = [enc.continuation(mmlu_prompt(row, pool[:shots]), f" {letter}") for letter in LETTERS]
        extra = max(len(c) for c in conts) - 1
        p = fit_prompt(enc, lambda k: mmlu_prompt(row, pool[:k]), shots, stream.context - extra)
        if p.shots != shots:
            conts = [enc.continuation(p.text, f" {letter}") for letter in LETTERS]
        multi_token += any(len(c) > 1 for c in conts)
        tally.add(p, shots)
        pred = int(np.argmax(score_continuations(stream, p.ids, conts)))
        predicted[LETTERS[pred]] += 1
        correct.append(pred == row.answer)
        subjects.setdefault(row.subject, []).append(pred == row.answer)
        bar(1)
    per_subject = {s: {"accuracy": float(np.mean(v)), "examples": len(v)} for s, v in sorted(subjects.items())}
    return {"accuracy": float(np.mean(correct)), "examples": len(correct), "subjects": per_subject,
            "subject_mean_accuracy": float(np.mean([v["accuracy"] for v in per_subject.values()])),
            "predicted_letters": predicted, "multi_token_letters": multi_token, **tally.summary()}


def _generation_budget(stream: Stream, max_new_tokens: int) -> int:
    if max_new_tokens < 1 or max_new_tokens > stream.context - 2:
        raise ValueError(f"max_new_tokens must be in 1..{stream.context - 2} (context {stream.context}), "
                         f"got {max_new_tokens}")
    return stream.context - max_new_tokens


def run_gsm8k(stream: Stream, enc: Encoder, data: TaskData, shots: int, max_new_tokens: int, bar) -> dict:
    tally, correct, samples, no_answer = Tally(), [], [], 0
    budget = _generation_budget(stream, max_new_tokens)
    for row in data.examples:
        p = fit_prompt(enc, lambda k: gsm8k_prompt(row, data.shots[:k]), shots, budget)
        tally.add(p, shots)
        tokens = stream.generate(p.ids, max_new_tokens, prefill_routing="original", stop=GSM8K_STOPS)
        text = cut_at_stops(enc.render(tokens))
        pred = extract_number(text)
        no_answer += pred is None
        ok = numbers_match(pred, row.gold)
        correct.append(ok)
        if len(samples) < N_SAMPLES:
            samples.append({"question": row.question, "generation": text, "prediction": pred,
                            "gold": row.gold, "correct": ok})
        bar(1)
    return {"accuracy": float(np.mean(correct)), "examples": len(correct), "max_new_tokens": max_new_tokens,
            "no_answer": no_answer, "samples": samples, **tally.summary()}


def run_truthfulqa(stream: Stream, enc: Encoder, data: TaskData, bar) -> dict:
    tally, mc1, mc2 = Tally(), [], []
    for row in data.examples:
        context = truthfulqa_prompt(row)
        choices = list(dict.fromkeys(row.mc1_choices + row.mc2_choices))  # distinct, MC1 ones first
        conts = [enc.continuation(context, f" {c}") for c in choices]
        extra = max(len(c) for c in conts) - 1
        p = fit_prompt(enc, lambda k: context, 0, stream.context - extra)
        tally.add(p, 0)
        score = dict(zip(choices, score_continuations(stream, p.ids, conts)))
        mc1.append(mc1_correct([score[c] for c in row.mc1_choices], row.mc1_labels))
        mc2.append(mc2_score([score[c] for c in row.mc2_choices], row.mc2_labels))
        bar(1)
    return {"accuracy": float(np.mean(mc1)), "mc1": float(np.mean(mc1)), "mc2": float(np.mean(mc2)),
            "examples": len(mc1), **tally.summary()}


def run_nq_open(stream: Stream, enc: Encoder, data: TaskData, shots: int, max_new_tokens: int, bar) -> dict:
    tally, correct, samples = Tally(), [], []
    budget = _generation_budget(stream, max_new_tokens)
    for row in data.examples:
        p = fit_prompt(enc, lambda k: nq_prompt(row, data.shots[:k]), shots, budget)
        tally.add(p, shots)
        text = enc.render(stream.generate(p.ids, max_new_tokens, stop=("\n",))).split("\n", 1)[0].strip()
        ok = exact_match(text, row.answers)
        correct.append(ok)
        if len(samples) < N_SAMPLES:
            samples.append({"question": row.question, "prediction": text, "answers": list(row.answers),
                            "correct": ok})
        bar(1)
    return {"accuracy": float(np.mean(correct)), "examples": len(correct), "max_new_tokens": max_new_tokens,
            "samples": samples, **tally.summary()}


def _progress(total: int, task: str, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    if not enabled:
        return (lambda n: None), (lambda: None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=task, unit="ex", file=sys.stderr)
    return bar.update, bar.close


def evaluate_task(model, task: str, data: str | None = None, *, limit: int | None = None, routing=None,
                  cache=None, state=None, shots: int | None = None, max_new_tokens: int | None = None,
                  progress: bool = False, return_state: bool = False, **options) -> dict:
    """Accuracy of ``model`` on ``task`` (see the module docstring for each task's protocol).

    ``data``: a file or folder (default: ``../shared/data/{task}``, else HF ``datasets``); ``limit``: score
    the first N examples; ``shots`` / ``max_new_tokens``: override the task's defaults (``max_new_tokens``
    only matters for gsm8k and nq_open); ``routing`` / ``cache`` / ``state``: simulate the expert cache, one
    state carried through the whole evaluation (``return_state=True`` returns ``(result, final_state)``);
    ``options`` go unchanged to every ``model.forward`` / ``model.generate`` call."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    shots = DEFAULT_SHOTS[task] if shots is None else int(shots)
    if shots < 0:
        raise ValueError(f"shots must be >= 0, got {shots}")
    if task == "truthfulqa" and shots:
        raise ValueError(f"truthfulqa is evaluated 0-shot (MC1/MC2); got shots={shots}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS.get(task, 0) if max_new_tokens is None else int(max_new_tokens)
    enc = Encoder(model)
    loaded = load_task(task, data, shots)
    if not loaded.examples:
        raise ValueError(f"no {task} examples to score in {', '.join(loaded.files)}")
    if limit is not None:
        loaded.examples = loaded.examples[:limit]
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
    return (result, stream.state) if return_state else result
