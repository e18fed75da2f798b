"""NaturalQuestions-open (Lee et al.): data, prompt, greedy answer, SQuAD-normalised exact match."""

from __future__ import annotations

import dataclasses
import re
import string
from typing import Any, Iterator

import numpy as np

from moejax.base import errors
from moejax.evaluation.tasks.common import (Encoder, Request, N_SAMPLES, Stream, Tally, TaskData, _generation_budget,
    _need_str, fit_prompt)

@dataclasses.dataclass(frozen=True)
class OpenQuestion:
    """One NQ-open row: any of ``answers`` is right."""

    question: str
    answers: tuple[str, ...]


def _open_question(obj: Any, where: str) -> OpenQuestion:
    if not isinstance(obj, dict):
        raise errors.Failure(f"{where}: expected a JSON object, got {type(obj).__name__}")
    question = _need_str(obj, "question", where)
    if "answer" not in obj:
        raise errors.Failure(f"{where}: missing field 'answer'")
    answers = obj["answer"]
    if isinstance(answers, str):
        answers = [answers]
    if (not isinstance(answers, (list, tuple)) or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)):
        raise errors.Failure(f"{where}: field 'answer' must be a non-empty list of strings, got {answers!r}")
    return OpenQuestion(question, tuple(answers))


def _nq_question(question: str) -> str:
    return f"Q: {question.rstrip().rstrip('?')}?\nA:"


def nq_prompt(row: OpenQuestion, shots: list[OpenQuestion]) -> str:
    return "".join(f"{_nq_question(s.question)} {s.answers[0]}\n\n" for s in shots) + _nq_question(row.question)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers) -> bool:
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(a) for a in answers)


def nq_open_requests(enc: Encoder, data: TaskData, shots: int, max_new_tokens: int,
                     context: int) -> Iterator[Request]:
    """Each question's prompt (the most exemplars that leave ``max_new_tokens`` of ``context``)."""
    budget = _generation_budget(context, max_new_tokens)
    for row in data.examples:
        p = fit_prompt(enc, lambda k: nq_prompt(row, data.shots[:k]), shots, budget)  # noqa: B023
        yield Request(row, p, max_new_tokens=max_new_tokens)


def run_nq_open(stream: Stream, enc: Encoder, data: TaskData, shots: int, max_new_tokens: int, bar) -> dict:
    tally, correct, samples = Tally(), [], []
    for req in nq_open_requests(enc, data, shots, max_new_tokens, stream.context):
        row, p = req.row, req.prompt
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
