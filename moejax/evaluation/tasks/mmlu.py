"""MMLU (Hendrycks et al.; paper §4: 5-shot): data, prompt, letter log-likelihood scoring (``tasks`` docstring)."""

from __future__ import annotations

import csv
import dataclasses
import os
from typing import Any, Iterator

import numpy as np

from moejax.base import errors
from moejax.evaluation.tasks.common import (Encoder, Request, Stream, Tally, TaskData, _open_text, fit_prompt,
    score_continuations)

LETTERS = "ABCD"


@dataclasses.dataclass(frozen=True)
class MultipleChoice:
    """One MMLU row: ``answer`` is the index (0-3) of the right choice."""

    subject: str
    question: str
    choices: tuple[str, ...]
    answer: int


def _mmlu_answer(value: Any, where: str) -> int:
    text = str(value).strip()
    if text.upper() in tuple(LETTERS):
        return LETTERS.index(text.upper())
    if text in ("0", "1", "2", "3"):
        return int(text)
    raise errors.Failure(f"{where}: answer {value!r} is out of range (expected 0-3 or A-D)")


def _multiple_choice(subject: str, row: list, where: str) -> MultipleChoice:
    if len(row) != 6:
        raise errors.Failure(f"{where}: expected 6 columns (question, 4 choices, answer), got {len(row)}")
    if not str(row[0]).strip():
        raise errors.Failure(f"{where}: empty question")
    return MultipleChoice(subject, str(row[0]), tuple(str(c) for c in row[1:5]), _mmlu_answer(row[5], where))


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
            raise errors.Failure(f"{path}, line {reader.line_num}: malformed CSV ({e})") from None
    return rows


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


def mmlu_header(subject: str) -> str:
    return f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_question(row: MultipleChoice, with_answer: bool) -> str:
    """``question\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:`` (+ `` X\\n\\n`` for a shot)."""
    text = row.question + "".join(f"\n{letter}. {choice}" for letter, choice in zip(LETTERS, row.choices))
    return text + "\nAnswer:" + (f" {LETTERS[row.answer]}\n\n" if with_answer else "")


def mmlu_prompt(row: MultipleChoice, shots: list[MultipleChoice]) -> str:
    return mmlu_header(row.subject) + "".join(mmlu_question(s, True) for s in shots) + mmlu_question(row, False)


def check_mmlu_shots(data: TaskData, shots: int) -> None:
    """Every subject's dev file supplies the ``shots`` asked, checked before any work."""
    for subject in dict.fromkeys(row.subject for row in data.examples):
        where = data.shot_source.get(subject, f"the dev split of {subject}")
        if shots and subject not in data.shots:
            raise FileNotFoundError(f"mmlu {subject}: no dev file {where} for the {shots}-shot prompt "
                                    "(pass shots=0)")
        if len(data.shots.get(subject, [])) < shots:
            raise ValueError(f"mmlu {subject}: {shots} shots asked but {where} has {len(data.shots[subject])} rows")


def _letters(enc: Encoder, prompt: str) -> list[list[int]]:
    return [enc.continuation(prompt, f" {letter}") for letter in LETTERS]


def mmlu_requests(enc: Encoder, data: TaskData, shots: int, context: int) -> Iterator[Request]:
    """Each example's prompt (the most shots that fit ``context``) and the four letters' continuations, tokenised
    after the prompt itself (the room they need taken from the 0-shot prompt, which ends the same way)."""
    check_mmlu_shots(data, shots)
    for row in data.examples:
        pool = data.shots.get(row.subject, [])
        build = lambda k: mmlu_prompt(row, pool[:k])  # noqa: B023, E731
        extra = max(len(c) for c in _letters(enc, build(0))) - 1
        p = fit_prompt(enc, build, shots, context - extra)
        conts = _letters(enc, p.text)
        if max(len(c) for c in conts) - 1 > extra:  # the letters tokenise longer after the shots: refit
            p = fit_prompt(enc, build, p.shots, context - (max(len(c) for c in conts) - 1))
            conts = _letters(enc, p.text)
        yield Request(row, p, continuations=conts)


def run_mmlu(stream: Stream, enc: Encoder, data: TaskData, shots: int, bar) -> dict:
    tally, correct = Tally(), []
    subjects: dict[str, list[bool]] = {}
    predicted = dict.fromkeys(LETTERS, 0)
    multi_token = 0
    for req in mmlu_requests(enc, data, shots, stream.context):
        row, p, conts = req.row, req.prompt, req.continuations
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
