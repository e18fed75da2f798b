"""GSM8K (paper §4: 8-shot chain of thought, policy during generation only): data, prompt, answer extraction."""

from __future__ import annotations

import dataclasses
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Iterator

import numpy as np

from moejax.base import errors
from moejax.runtime import decode
from moejax.evaluation.tasks.common import (Encoder, Request, N_SAMPLES, Stream, Tally, TaskData, _generation_budget,
    _need_str, fit_prompt)

GSM8K_STOPS = ("\n\nQuestion:", "Question:", "\n\n\n")


@dataclasses.dataclass(frozen=True)
class MathProblem:
    """One GSM8K row: ``solution`` is the reference answer text, ``gold`` the number after ``####``."""

    question: str
    solution: str
    gold: str


def gsm8k_gold(solution: str, where: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, commas removed."""
    if "####" not in solution:
        raise errors.Failure(f"{where}: answer has no '#### N' final line")
    gold = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if normalize_number(gold) is None:
        raise errors.Failure(f"{where}: final answer {gold!r} after '####' is not a number")
    return gold


def _math_problem(obj: Any, where: str) -> MathProblem:
    if not isinstance(obj, dict):
        raise errors.Failure(f"{where}: expected a JSON object, got {type(obj).__name__}")
    question, solution = _need_str(obj, "question", where), _need_str(obj, "answer", where)
    return MathProblem(question, solution, gsm8k_gold(solution, where))


def gsm8k_exemplar(row: MathProblem) -> str:
    """``Question: q\\nAnswer: reasoning The answer is N.\\n\\n`` (calculator notes removed)."""
    reasoning = re.sub(r"<<[^>]*>>", "", row.solution.rsplit("####", 1)[0]).strip()
    return f"Question: {row.question}\nAnswer: {reasoning} The answer is {row.gold}.\n\n"


def gsm8k_prompt(row: MathProblem, shots: list[MathProblem]) -> str:
    return "".join(gsm8k_exemplar(s) for s in shots) + f"Question: {row.question}\nAnswer:"


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


def gsm8k_requests(enc: Encoder, data: TaskData, shots: int, max_new_tokens: int, context: int) -> Iterator[Request]:
    """Each question's prompt (the most exemplars that leave ``max_new_tokens`` of ``context``)."""
    budget = _generation_budget(context, max_new_tokens)
    for row in data.examples:
        p = fit_prompt(enc, lambda k: gsm8k_prompt(row, data.shots[:k]), shots, budget)  # noqa: B023
        yield Request(row, p, max_new_tokens=max_new_tokens)


def run_gsm8k(stream: Stream, enc: Encoder, data: TaskData, shots: int, max_new_tokens: int, bar) -> dict:
    tally, correct, samples, no_answer = Tally(), [], [], 0
    for req in gsm8k_requests(enc, data, shots, max_new_tokens, stream.context):
        row, p = req.row, req.prompt
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
