"""Downstream tasks (moejax.evaluation.tasks): metrics by hand, prompt formats, data loading and its errors, the HF
fallback, context fitting, and the expert-cache state carried through a whole evaluation.

Most tests drive a fake model whose next-token scores the test chooses (so every expected accuracy is
computed by hand); two tests run the default model on tiny fixtures to tie the harness to the real
``Model.forward`` / ``Model.generate`` and the simulated cache."""

from __future__ import annotations

import math
import os
import re
import sys
import types

import jax
import numpy as np
import pytest

from moejax.runtime import decode, offload, simulate
from moejax.evaluation import tasks
from moejax.evaluation.tasks import common, gsm8k, mmlu, nq_open, truthfulqa

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "tasks")
V = 512  # fake vocabulary size


# ------------------------------------------------------------------------------------------ fake model
class FakeTokenizer:
    """Splits text into pieces (default: ``" word"``, ``"word"`` or one whitespace character); ids on first
    sight, 0 is BOS. Decoding joins the pieces, so encode/decode round-trips exactly."""

    def __init__(self, pattern: str = r" ?[^\s]+|\s"):
        self.pattern = re.compile(pattern)
        self.pieces = ["<bos>"]
        self.ids = {"<bos>": 0}

    def id(self, piece: str) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
            assert len(self.pieces) <= V
        return self.ids[piece]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [self.id(p) for p in self.pattern.findall(text)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.pieces[i] for i in ids if i != 0)


class FakeModel:
    """Model-like object. ``next_scores(prefix_text)`` gives {piece: log-prob} for the next token (other
    pieces get probability ~0; an empty dict means uniform); ``reply(prompt_text)`` is what ``generate``
    produces. Every call is recorded; the fake "router state" counts the tokens fed, call by call."""

    def __init__(self, next_scores=None, reply=None, context: int = 1024, tokenizer=None):
        self.tokenizer = tokenizer or FakeTokenizer()
        self.next_scores = next_scores or (lambda prefix: {})
        self.reply = reply or (lambda prompt: "")
        self.cfg = types.SimpleNamespace(max_position_embeddings=context, bos_token_id=0, vocab_size=V, top_k=2)
        self.params, self.path, self.generation_config = {}, "fake-model", {}
        self.calls: list[tuple[str, list[int], dict]] = []

    def router_state(self, routing=None, cache=None) -> dict:
        return {"tokens": 0, "fed": (), "policy": routing, "cache": cache}

    @staticmethod
    def _advance(state: dict | None, routing, n: int) -> dict | None:
        if state is None:
            return None
        policy = routing if routing is not None else state["policy"]
        return {**state, "tokens": state["tokens"] + n, "fed": state["fed"] + (n,), "policy": policy}

    def forward(self, ids, *, state=None, routing=None, **kw):
        ids = [int(i) for i in ids]
        self.calls.append(("forward", ids, {"state": state, "routing": routing, **kw}))
        logits = np.zeros((len(ids), V))
        for t in range(len(ids)):
            scores = self.next_scores(self.tokenizer.decode(ids[: t + 1]))
            if scores:
                logits[t] = -1e9
                for piece, s in scores.items():
                    logits[t, self.tokenizer.id(piece)] = s
        return types.SimpleNamespace(logits=logits, state=self._advance(state, routing, len(ids)))

    def generate(self, prompt_ids, max_new_tokens: int = 64, *, state=None, routing=None, **kw):
        ids = [int(i) for i in prompt_ids]
        self.calls.append(("generate", ids, {"state": state, "routing": routing, "max_new_tokens": max_new_tokens,
                                             **kw}))
        tokens = self.tokenizer.encode(self.reply(self.tokenizer.decode(ids)), add_special_tokens=False)
        tokens = tokens[:max_new_tokens]
        fed = len(ids) + len(tokens) - 1
        return types.SimpleNamespace(token_ids=tokens, stats={"fed_tokens": fed},
                                     router_state=self._advance(state, routing, fed))


@pytest.fixture
def fake_summary(monkeypatch):
    """simulate.summarize for the fake state: reports the tokens the state has seen."""
    monkeypatch.setattr(simulate, "summarize", lambda state, params, cfg: {
        "miss_rate": 0.25, "lifetime_mean": 3.0, "lifetime_std": 1.0, "bytes_per_token": 7.0,
        "tokens": state["tokens"]})


# --------------------------------------------------------------------------------- metrics by hand
def test_number_extraction_and_match():
    assert gsm8k.extract_number("so 3 + 2 = 5 apples. The answer is 5.") == "5"
    assert gsm8k.extract_number("The answer is $1,205.") == "1205"
    assert gsm8k.extract_number("the answer is: -3.5 degrees") == "-3.5"
    assert gsm8k.extract_number("first 12, then 7 and finally 1,000.") == "1000"  # last number
    assert gsm8k.extract_number("The answer is 4. Then 9") == "4"  # the stated answer beats the last number
    assert gsm8k.extract_number("no digits here") is None
    assert gsm8k.numbers_match("18.00", "18") and gsm8k.numbers_match("1205", "1,205")
    assert not gsm8k.numbers_match("17", "18") and not gsm8k.numbers_match(None, "18")
    text = " 5 apples.\n\nQuestion: next\nAnswer: 6"
    assert gsm8k.cut_at_stops(text) == " 5 apples."
    assert gsm8k.cut_at_stops("a Question: b\n\n\nc") == "a "
    assert gsm8k.cut_at_stops("x\n\n\ny Question:") == "x"
    assert gsm8k.cut_at_stops("no stop") == "no stop"


def test_squad_normalization_and_exact_match():
    assert nq_open.normalize_answer("The  Beatles!") == "beatles"
    assert nq_open.normalize_answer("An apple, a day.") == "apple day"
    assert nq_open.normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert nq_open.exact_match("the Beatles.", ["Beatles"])
    assert nq_open.exact_match("8", ["eight", "8"])
    assert not nq_open.exact_match("Beatles band", ["The Beatles"])


def test_mc1_and_mc2_by_hand():
    scores = [math.log(0.5), math.log(0.2), math.log(0.3)]
    assert truthfulqa.mc2_score(scores, (1, 0, 1)) == pytest.approx(0.8)
    # unnormalised log-likelihoods: only their ratios matter
    assert truthfulqa.mc2_score([s - 40.0 for s in scores], (0, 1, 0)) == pytest.approx(0.2)
    assert truthfulqa.mc1_correct(scores, (1, 0, 0))
    assert not truthfulqa.mc1_correct(scores, (0, 0, 1))
    assert not truthfulqa.mc1_correct([-1.0, -1.0], (1, 0))  # a tie is not a win


def test_log_softmax_at():
    logits = np.array([[0.0, math.log(3.0)], [5.0, 5.0]])
    np.testing.assert_allclose(common.log_softmax_at(logits, [0, 1], [1, 0]), [math.log(0.75), math.log(0.5)])


# ------------------------------------------------------------------------------------------- prompts
def test_prompt_formats():
    row = mmlu.MultipleChoice("high_school_physics", "What is g?", ("1", "9.8", "3", "4"), 1)
    shot = mmlu.MultipleChoice("high_school_physics", "Unit of force?", ("N", "J", "W", "Pa"), 0)
    assert mmlu.mmlu_prompt(row, [shot]) == (
        "The following are multiple choice questions (with answers) about high school physics.\n\n"
        "Unit of force?\nA. N\nB. J\nC. W\nD. Pa\nAnswer: A\n\n"
        "What is g?\nA. 1\nB. 9.8\nC. 3\nD. 4\nAnswer:")
    train = common.read_jsonl(os.path.join(FIXTURES, "gsm8k", "train.jsonl"), gsm8k._math_problem)
    assert gsm8k.gsm8k_exemplar(train[1]) == (
        "Question: A box holds 3 rows of 4 eggs. How many eggs are in the box?\n"
        "Answer: There are 3 rows.\nEach row has 4 eggs, so 3 * 4 = 12 eggs. The answer is 12.\n\n")
    q = gsm8k.MathProblem("How many?", "#### 2", "2")
    assert gsm8k.gsm8k_prompt(q, train[:1]) == gsm8k.gsm8k_exemplar(train[0]) + "Question: How many?\nAnswer:"
    assert truthfulqa.truthfulqa_prompt(truthfulqa.TruthfulQuestion("Is it?", ("a",), (1,), ("a",), (1,))) == "Q: Is it?\nA:"
    nq = [nq_open.OpenQuestion("who wrote hamlet", ("Shakespeare",)), nq_open.OpenQuestion("what is 2+2?", ("4",))]
    assert nq_open.nq_prompt(nq[1], nq[:1]) == "Q: who wrote hamlet?\nA: Shakespeare\n\nQ: what is 2+2?\nA:"


def test_continuation_tokens_follow_running_text():
    enc = common.Encoder(FakeModel(tokenizer=FakeTokenizer(r"[^\s]+|\s")))
    # " A" after "Answer:" is two pieces here: " " and "A"
    assert [enc.tok.pieces[i] for i in enc.continuation("Answer:", " A")] == [" ", "A"]
    assert enc.prompt("x y")[0] == 0


# ---------------------------------------------------------------------------------------- data loading
def test_mmlu_order_is_round_robin_over_sorted_subjects_and_limit_takes_the_first():
    data = tasks.load_task("mmlu", os.path.join(FIXTURES, "mmlu"))
    assert [(r.subject, r.question[:12]) for r in data.examples] == [
        ("abstract_algebra", "What is the "), ("astronomy", "Which planet"), ("virology", "What does a "),
        ("astronomy", "What is the "), ("virology", "Which of the"), ("astronomy", "Which of the")]
    assert [r.answer for r in data.examples] == [3, 1, 0, 2, 1, 2]
    assert data.examples[5].question == "Which of these is a gas giant, by mass?"
    assert sorted(data.shots) == ["abstract_algebra", "astronomy", "virology"]
    assert data.shots["abstract_algebra"][1].choices == ("True", "False", "Only sometimes", "Never")
    one = tasks.load_task("mmlu", os.path.join(FIXTURES, "mmlu", "test", "virology_test.csv"))
    assert [r.subject for r in one.examples] == ["virology"] * 2 and len(one.shots["virology"]) == 2


def test_the_real_datasets_parse_where_moejax_data_names_a_copy_of_them():
    """The full files (``$MOEJAX_DATA``: set it to a folder holding the real datasets to run this)."""
    if not (os.environ.get("MOEJAX_DATA") and os.path.isdir(tasks.default_data("mmlu"))):
        pytest.skip("$MOEJAX_DATA names no copy of the real datasets")
    mmlu = tasks.load_task("mmlu")
    assert len(mmlu.examples) == 14042 and len({r.subject for r in mmlu.examples[:57]}) == 57
    assert all(len(v) == 5 for v in mmlu.shots.values())
    gsm = tasks.load_task("gsm8k", shots=8)
    assert len(gsm.examples) == 1319 and len(gsm.shots) == 8 and gsm.examples[0].gold == "18"
    assert len(tasks.load_task("truthfulqa").examples) == 817
    nq = tasks.load_task("nq_open", shots=2)
    assert len(nq.examples) == 3608 and nq.shots[0].answers == ("14 December 1972 UTC", "December 1972")


MALFORMED = [
    ("gsm8k", "test.jsonl", '{"question": "a", "answer": "#### 1"}\n{bad json\n', "line 2", "invalid JSON"),
    ("gsm8k", "test.jsonl", '{"question": "a", "answer": "#### 1"}\n\n{"question": "b"}\n', "line 3",
     "missing field 'answer'"),
    ("gsm8k", "test.jsonl", '{"question": "a", "answer": "no final line"}\n', "line 1", "####"),
    ("gsm8k", "test.jsonl", '{"question": "a", "answer": "#### many"}\n', "line 1", "not a number"),
    ("nq_open", "NQ-open.dev.jsonl", '{"question": "q", "answer": ["a"]}\n{"question": "q", "answer": []}\n',
     "line 2", "non-empty list"),
    ("nq_open", "NQ-open.dev.jsonl", '["q", "a"]\n', "line 1", "expected a JSON object"),
    ("truthfulqa", "mc_task.json", '[{"question": "q", "mc1_targets": {"a": 1, "b": 1}, "mc2_targets": {"a": 1}}]',
     "entry 1", "exactly one true"),
    ("truthfulqa", "mc_task.json", '[{"question": "q", "mc1_targets": {"a": 1}, "mc2_targets": {"a": 1}},\n'
     ' {"question": "r", "mc1_targets": {"a": 1}, "mc2_targets": {"a": 2}}]', "entry 2", "0 or 1"),
    ("truthfulqa", "mc_task.json", '[{"question": "q", "mc1_targets": {"a": 1}}]', "entry 1",
     "missing field 'mc2_targets'"),
    ("truthfulqa", "mc_task.json", '[\n{"question": "q",\n oops}]', "line 3", "invalid JSON"),
    ("mmlu", "test/s_test.csv", "question,choice0,choice1,choice2,choice3,answer\nq,a,b,c,d,0\nq2,a,b,c,1\n",
     "line 3", "6 columns"),
    ("mmlu", "test/s_test.csv", "q,a,b,c,d,E\n", "line 1", "out of range"),
    ("mmlu", "test/s_test.csv", '"multi\nline q",a,b,c,d,0\nq,a,b,c,d,9\n', "line 3", "out of range"),
    ("mmlu", "test/s_test.csv", ",a,b,c,d,0\n", "line 1", "empty question"),
]


@pytest.mark.parametrize("task,name,content,line,what", MALFORMED)
def test_malformed_files_name_file_and_line(tmp_path, task, name, content, line, what):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        tasks.load_task(task, str(tmp_path))
    message = str(err.value)
    assert str(path) in message and f"{line}:" in message and what in message, message


def test_data_path_errors(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        tasks.load_task("gsm8k", missing)
    (tmp_path / "mmlu").mkdir()
    with pytest.raises(FileNotFoundError, match="no test/ folder"):
        tasks.load_task("mmlu", str(tmp_path / "mmlu"))
    (tmp_path / "gsm").mkdir()
    (tmp_path / "gsm" / "test.jsonl").write_text('{"question": "a", "answer": "#### 1"}\n')
    assert len(tasks.load_task("gsm8k", str(tmp_path / "gsm"), shots=0).examples) == 1
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "gsm" / "train.jsonl"))):
        tasks.load_task("gsm8k", str(tmp_path / "gsm"), shots=2)
    with pytest.raises(FileNotFoundError, match="mc_task.json"):
        tasks.load_task("truthfulqa", str(tmp_path))
    with pytest.raises(ValueError, match="unknown task"):
        tasks.load_task("squad")
    # one MMLU test file; its dev file would be ../dev/s_dev.csv
    (tmp_path / "m" / "test").mkdir(parents=True)
    (tmp_path / "m" / "test" / "s_test.csv").write_text("q,a,b,c,d,A\n")
    single = str(tmp_path / "m" / "test" / "s_test.csv")
    model = FakeModel(_mmlu_scores)
    assert tasks.evaluate_task(model, "mmlu", single, shots=0)["examples"] == 1
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "m" / "dev" / "s_dev.csv"))):
        tasks.evaluate_task(model, "mmlu", single, shots=1)
    (tmp_path / "m" / "dev").mkdir()
    (tmp_path / "m" / "dev" / "s_dev.csv").write_text("q0,a,b,c,d,B\n")
    assert tasks.evaluate_task(model, "mmlu", single, shots=1)["mean_shots"] == 1.0
    with pytest.raises(ValueError, match="2 shots asked but .*s_dev.csv has 1 rows"):
        tasks.evaluate_task(model, "mmlu", single, shots=2)


def test_argument_errors():
    model = FakeModel()
    with pytest.raises(ValueError, match="0-shot"):
        tasks.evaluate_task(model, "truthfulqa", os.path.join(FIXTURES, "truthfulqa"), shots=3)
    with pytest.raises(ValueError, match="limit"):
        tasks.evaluate_task(model, "nq_open", os.path.join(FIXTURES, "nq_open"), limit=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        tasks.evaluate_task(model, "nq_open", os.path.join(FIXTURES, "nq_open"), max_new_tokens=5000)
    with pytest.raises(ValueError, match="unknown task"):
        tasks.evaluate_task(model, "wikitext")
    model.tokenizer = None
    with pytest.raises(ValueError, match="no tokenizer"):
        tasks.evaluate_task(model, "mmlu", os.path.join(FIXTURES, "mmlu"))


# ------------------------------------------------------------------------------- HF datasets fallback
def _fake_datasets(calls: list) -> types.ModuleType:
    rows = {
        ("cais/mmlu", "test"): [{"question": "2+2?", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
                                {"question": "Sky?", "subject": "astro", "choices": ["b", "g", "r", "y"], "answer": 0}],
        ("cais/mmlu", "dev"): [{"question": "1+1?", "subject": "math", "choices": ["2", "3", "4", "5"], "answer": 0},
                               {"question": "Sun?", "subject": "astro", "choices": ["s", "p", "m", "c"], "answer": 0}],
        ("gsm8k", "test"): [{"question": "1+1?", "answer": "1+1=2\n#### 2"}],
        ("gsm8k", "train"): [{"question": "2+2?", "answer": "2+2=4\n#### 4"}] * 10,
        ("truthful_qa", "validation"): [{"question": "Can pigs fly?",
                                         "mc1_targets": {"choices": ["no", "yes"], "labels": [1, 0]},
                                         "mc2_targets": {"choices": ["no", "yes"], "labels": [1, 0]}}],
        ("nq_open", "validation"): [{"question": "capital of france", "answer": ["Paris"]}],
    }
    module = types.ModuleType("datasets")

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return rows[(name, split)]

    module.load_dataset = load_dataset
    return module


def test_hf_datasets_fallback_when_the_local_copy_is_missing(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "datasets", _fake_datasets(calls))
    monkeypatch.delenv("MOEJAX_DATA", raising=False)
    mmlu = tasks.load_task("mmlu")
    assert [(r.subject, r.answer) for r in mmlu.examples] == [("astro", 0), ("math", 1)]
    assert mmlu.shots["math"][0].question == "1+1?" and mmlu.files == ["hf:cais/mmlu"]
    assert ("cais/mmlu", "all", "test") in calls and ("cais/mmlu", "all", "dev") in calls
    assert len(tasks.load_task("gsm8k", shots=8).shots) == 8 and ("gsm8k", "main", "train") in calls
    tqa = tasks.load_task("truthfulqa").examples[0]
    assert tqa.mc1_choices == ("no", "yes") and tqa.mc1_labels == (1, 0)
    assert ("truthful_qa", "multiple_choice", "validation") in calls
    model = FakeModel(reply=lambda prompt: " Paris\nQ:")
    res = tasks.evaluate_task(model, "nq_open")
    assert res["accuracy"] == 1.0 and res["data"] == ["hf:nq_open"] and ("nq_open", None, "validation") in calls


def test_without_local_data_a_failed_or_missing_hf_copy_names_both_ways_to_give_the_data(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEJAX_DATA", raising=False)
    broken = types.ModuleType("datasets")

    def offline(*args, **kw):
        raise ConnectionError("no network")

    broken.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", broken)
    with pytest.raises(FileNotFoundError, match="HF datasets copy of gsm8k.*no network.*pass --data PATH"):
        tasks.load_task("gsm8k")
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(FileNotFoundError, match=re.escape("pass --data PATH (or set $MOEJAX_DATA)") + ".*"
                       + re.escape("pip install 'moejax[data]'")):
        tasks.load_task("gsm8k")
    missing = str(tmp_path / "missing")
    monkeypatch.setenv("MOEJAX_DATA", missing)  # named, so never a download in its place
    with pytest.raises(FileNotFoundError, match=re.escape(os.path.join(missing, "gsm8k"))):
        tasks.load_task("gsm8k")
    monkeypatch.delenv("MOEJAX_DATA")
    bad = types.ModuleType("datasets")
    bad.load_dataset = lambda *a, split=None: [{"question": "q", "answer": "no number"}]
    monkeypatch.setitem(sys.modules, "datasets", bad)
    with pytest.raises(ValueError, match=re.escape("hf:gsm8k[test] row 1")):
        tasks.load_task("gsm8k")


# ------------------------------------------------------------------------------- tasks on a fake model
MMLU_PICKS = {  # question -> the letter the fake model prefers (4 right, 2 wrong)
    "What is the order of the group Z_4?": "D", "Which planet is closest to the Sun?": "B",
    "What does a virus need to replicate?": "A", "What is the Moon?": "C",
    "Which of these is a virus?": "D", "Which of these is a gas giant, by mass?": "A",
}


def _last_question(prefix: str) -> str:
    return prefix.rsplit("\n\n", 1)[-1].split("\n", 1)[0]


def _mmlu_scores(prefix: str) -> dict:
    if prefix.endswith("Answer:"):
        pick = MMLU_PICKS.get(_last_question(prefix), "A")
        return {f" {x}": (math.log(0.7) if x == pick else math.log(0.1)) for x in "ABCD"}
    return {}


def test_mmlu_letter_scoring_by_hand():
    model = FakeModel(_mmlu_scores)
    res = tasks.evaluate_task(model, "mmlu", os.path.join(FIXTURES, "mmlu"), shots=2)
    assert res["task"] == "mmlu" and res["examples"] == 6 and res["shots"] == 2
    assert res["accuracy"] == pytest.approx(4 / 6)
    assert {s: v["accuracy"] for s, v in res["subjects"].items()} == pytest.approx(
        {"abstract_algebra": 1.0, "astronomy": 2 / 3, "virology": 0.5})
    assert res["subject_mean_accuracy"] == pytest.approx((1.0 + 2 / 3 + 0.5) / 3)
    assert res["predicted_letters"] == {"A": 2, "B": 1, "C": 1, "D": 2}
    assert res["multi_token_letters"] == 0 and res["shortened"] == 0 and res["mean_shots"] == 2.0
    assert "miss_rate" not in res and "state" not in res
    # single-token letters: one forward per question, over the prompt (right-padded to 64 without a cache)
    forwards = [c for c in model.calls if c[0] == "forward"]
    assert len(forwards) == 6
    first = tasks.load_task("mmlu", os.path.join(FIXTURES, "mmlu"))
    expected = model.tokenizer.encode(mmlu.mmlu_prompt(first.examples[0], first.shots["abstract_algebra"][:2]))
    assert forwards[0][1][: len(expected)] == expected and len(forwards[0][1]) % 64 == 0
    assert res["tokens"] == sum(len(model.tokenizer.encode(mmlu.mmlu_prompt(r, first.shots[r.subject][:2])))
                                for r in first.examples)


def test_mmlu_limit_and_progress(capsys):
    limited = tasks.evaluate_task(FakeModel(_mmlu_scores), "mmlu", os.path.join(FIXTURES, "mmlu"), limit=2, shots=1,
                                  progress=True)
    assert limited["examples"] == 2 and sorted(limited["subjects"]) == ["abstract_algebra", "astronomy"]
    assert "mmlu" in capsys.readouterr().err and limited["seconds_per_example"] > 0


def test_mmlu_multi_token_letters_sum_log_likelihoods():
    def scores(prefix):
        if prefix.endswith("Answer:"):
            return {" ": 0.0}
        if prefix.endswith("Answer: "):
            pick = MMLU_PICKS[_last_question(prefix)]
            return {x: (math.log(0.7) if x == pick else math.log(0.1)) for x in "ABCD"}
        return {}

    model = FakeModel(scores, tokenizer=FakeTokenizer(r"[^\s]+|\s"))
    res = tasks.evaluate_task(model, "mmlu", os.path.join(FIXTURES, "mmlu"), shots=0)
    assert res["accuracy"] == pytest.approx(4 / 6) and res["multi_token_letters"] == 6
    forwards = [c for c in model.calls if c[0] == "forward"]
    assert len(forwards) == 4 * 6  # one per letter: prompt + " " (the continuation minus its last token)


def _truthful_scores(prefix: str) -> dict:
    if prefix.endswith("clear day?\nA:"):
        return {" blue": math.log(0.5), " green": math.log(0.1), " red": math.log(0.1), " light": math.log(0.3)}
    if prefix.endswith("clear day?\nA: light"):
        return {" blue": 0.0}
    if prefix.endswith("fly?\nA:"):
        return {" no": math.log(0.2), " yes": math.log(0.6), " not": math.log(0.2)}
    if prefix.endswith("fly?\nA: not"):
        return {" without": 0.0}
    if prefix.endswith("fly?\nA: not without"):
        return {" help": 0.0}
    return {}


def test_truthfulqa_mc1_mc2_by_hand():
    model = FakeModel(_truthful_scores)
    res = tasks.evaluate_task(model, "truthfulqa", os.path.join(FIXTURES, "truthfulqa"))
    # Q1: blue .5 beats green/red .1 (MC1 right), MC2 = (.5 + .3) / 1.0; Q2: yes .6 beats no .2 (MC1 wrong),
    # MC2 = (.2 + .2) / 1.0
    assert res["mc1"] == res["accuracy"] == pytest.approx(0.5)
    assert res["mc2"] == pytest.approx((0.8 + 0.4) / 2)
    assert res["examples"] == 2 and res["shots"] == 0
    # each distinct choice once, MC1 choices first: 4 forwards for Q1, 3 for Q2
    assert len([c for c in model.calls if c[0] == "forward"]) == 7


def _gsm8k_reply(prompt: str) -> str:
    question = prompt.rsplit("Question: ", 1)[-1]
    if question.startswith("Tom"):
        return " 3 + 2 = 5 apples. The answer is 5.\n\nQuestion: What is 7 + 1?\nAnswer: The answer is 8."
    if question.startswith("A book"):
        return " Both cost $1,205 in all\n\n\nQuestion: 3"
    return " She has 2 pears. The answer is 2."


def test_gsm8k_generation_extraction_and_samples():
    model = FakeModel(reply=_gsm8k_reply)
    res = tasks.evaluate_task(model, "gsm8k", os.path.join(FIXTURES, "gsm8k"), shots=2, chunk=4)
    assert res["accuracy"] == pytest.approx(2 / 3) and res["examples"] == 3 and res["no_answer"] == 0
    assert [s["prediction"] for s in res["samples"]] == ["5", "1205", "2"]
    assert [s["correct"] for s in res["samples"]] == [True, True, False]
    assert res["samples"][0]["generation"] == " 3 + 2 = 5 apples. The answer is 5."
    assert res["samples"][1]["gold"] == "1205" and res["max_new_tokens"] == 256
    name, ids, kw = model.calls[0]
    train = common.read_jsonl(os.path.join(FIXTURES, "gsm8k", "train.jsonl"), gsm8k._math_problem)
    test = common.read_jsonl(os.path.join(FIXTURES, "gsm8k", "test.jsonl"), gsm8k._math_problem)
    assert name == "generate" and ids == model.tokenizer.encode(gsm8k.gsm8k_prompt(test[0], train))
    assert kw["max_new_tokens"] == 256 and kw["chunk"] == 4  # options passed through
    assert "prefill_routing" not in kw and kw["state"] is None  # no cache: plain generation


def test_nq_open_shots_come_from_the_first_rows_and_are_not_scored():
    def reply(prompt):
        q = prompt.rsplit("Q: ", 1)[-1]
        return {"what": " Paris.\nQ: more", "whic": " the Beatles!\n", "how ": " six legs"}[q[:4]]

    model = FakeModel(reply=reply)
    res = tasks.evaluate_task(model, "nq_open", os.path.join(FIXTURES, "nq_open"), shots=1)
    assert res["examples"] == 3 and res["accuracy"] == pytest.approx(2 / 3)
    assert [s["prediction"] for s in res["samples"]] == ["Paris.", "the Beatles!", "six legs"]
    assert model.calls[0][1] == model.tokenizer.encode(
        "Q: who wrote the novel frankenstein?\nA: Mary Shelley\n\nQ: what is the capital city of france?\nA:")
    assert model.calls[0][2]["max_new_tokens"] == 16
    assert tasks.evaluate_task(FakeModel(reply=reply), "nq_open", os.path.join(FIXTURES, "nq_open"),
                               shots=1, limit=1)["examples"] == 1


def test_prompts_drop_shots_then_truncate_from_the_left_to_fit_the_context():
    data = tasks.load_task("mmlu", os.path.join(FIXTURES, "mmlu"))
    row, pool = data.examples[0], data.shots["abstract_algebra"]
    tok = FakeTokenizer()
    one_shot = tok.encode(mmlu.mmlu_prompt(row, pool[:1]))
    two_shot = tok.encode(mmlu.mmlu_prompt(row, pool[:2]))
    assert len(one_shot) < len(two_shot)
    model = FakeModel(_mmlu_scores, context=len(one_shot), tokenizer=tok)
    res = tasks.evaluate_task(model, "mmlu", os.path.join(FIXTURES, "mmlu"), shots=2, limit=1)
    assert res["shortened"] == 1 and res["truncated"] == 0 and res["mean_shots"] == 1.0
    assert model.calls[0][1] == one_shot and res["accuracy"] == 1.0

    zero_shot = tok.encode(mmlu.mmlu_prompt(row, []))
    model = FakeModel(_mmlu_scores, context=10, tokenizer=tok)
    res = tasks.evaluate_task(model, "mmlu", os.path.join(FIXTURES, "mmlu"), shots=2, limit=1)
    assert res["shortened"] == 1 and res["truncated"] == 1 and res["mean_shots"] == 0.0
    assert model.calls[0][1] == [0] + zero_shot[-9:]  # BOS kept, the start of the prompt cut

    # generation leaves room for max_new_tokens
    test = common.read_jsonl(os.path.join(FIXTURES, "gsm8k", "test.jsonl"), gsm8k._math_problem)
    train = common.read_jsonl(os.path.join(FIXTURES, "gsm8k", "train.jsonl"), gsm8k._math_problem)
    one = len(tok.encode(gsm8k.gsm8k_prompt(test[0], train[:1])))
    model = FakeModel(reply=_gsm8k_reply, context=one + 20, tokenizer=tok)
    with pytest.warns(UserWarning, match="fewer than shots=8: 2-shot"):  # the fixture's train file has 2
        res = tasks.evaluate_task(model, "gsm8k", os.path.join(FIXTURES, "gsm8k"), limit=1, max_new_tokens=20)
    assert res["shortened"] == 1 and res["mean_shots"] == 1.0 and len(model.calls[0][1]) == one
    assert res["shots"] == 2  # the record says what was shown, not what was asked


def test_cache_state_is_carried_through_every_call_in_order(fake_summary):
    model = FakeModel(_truthful_scores)
    res, state = tasks.evaluate_task(model, "truthfulqa", os.path.join(FIXTURES, "truthfulqa"),
                                     routing="cache-prior", cache="cfg", return_state=True)
    forwards = [c for c in model.calls if c[0] == "forward"]
    assert [len(ids) for _, ids, _ in forwards] == list(state["fed"])  # every call, in order, no padding
    for (_, _, kw), fed_before in zip(forwards, range(len(forwards))):
        assert kw["state"]["fed"] == state["fed"][:fed_before]  # each call got the previous call's state
    assert all(kw["routing"] is None for _, _, kw in forwards)  # the policy travels in the state
    assert state["policy"] == "cache-prior" and state["cache"] == "cfg"
    assert res["tokens"] == state["tokens"] == res["cache"]["tokens"] == sum(state["fed"])
    assert (res["miss_rate"], res["lifetime"], res["lifetime_std"], res["bytes_per_token"]) == (0.25, 3.0, 1.0, 7.0)
    assert "state" not in res and "_state" not in res

    # generation: the prompt is routed with the original policy, and a given state is continued
    model = FakeModel(reply=_gsm8k_reply)
    start = {"tokens": 100, "fed": (100,), "policy": "lru-original", "cache": None}
    res, end = tasks.evaluate_task(model, "gsm8k", os.path.join(FIXTURES, "gsm8k"), shots=0, state=start,
                                   return_state=True)
    assert all(kw["prefill_routing"] == "original" for _, _, kw in model.calls)
    assert model.calls[0][2]["state"] == start and end["policy"] == "lru-original"
    assert end["tokens"] == 100 + res["tokens"] and len(end["fed"]) == 4
    # a given state with routing=: that policy on the given cache
    _, end = tasks.evaluate_task(FakeModel(reply=_gsm8k_reply), "gsm8k", os.path.join(FIXTURES, "gsm8k"),
                                 shots=0, state=start, routing="max-rank", return_state=True)
    assert end["policy"].kind == "max-rank" and end["tokens"] > 100


def test_program_budget_clears_compiled_programs_before_the_maps_run_out(monkeypatch):
    real_regions = common._mapped_regions()
    assert real_regions is None or real_regions > 0
    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(1))
    monkeypatch.setattr(common, "_mapped_regions", lambda: 100)
    budget = common.ProgramBudget(budget=150)
    budget.before(("forward", 10))
    budget.before(("forward", 11))
    assert cleared == []
    monkeypatch.setattr(common, "_mapped_regions", lambda: 200)
    budget.before(("forward", 11))  # a shape already compiled: nothing to make room for
    assert cleared == []
    budget.before(("forward", 12))
    assert len(cleared) == 1 and budget.shapes == {("forward", 12)} and budget.clears == 1
    monkeypatch.setattr(common, "_mapped_regions", lambda: None)  # no /proc: count shapes instead
    budget = common.ProgramBudget(budget=150, fallback_shapes=2)
    for n in range(3):
        budget.before(("generate", n, 16))
    assert len(cleared) == 2 and budget.clears == 1


# --------------------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def default_model():
    import moejax

    return moejax.load("default")


@pytest.mark.numerics
def test_default_model_mmlu_original_routing_with_cache_equals_no_cache(default_model):
    m = default_model
    folder = os.path.join(FIXTURES, "mmlu")
    plain = tasks.evaluate_task(m, "mmlu", folder, shots=0, limit=2)
    cached, state = tasks.evaluate_task(m, "mmlu", folder, shots=0, limit=2, routing="original",
                                        cache=simulate.CacheConfig(size="0.5"), return_state=True)
    assert cached["accuracy"] == plain["accuracy"]
    assert cached["predicted_letters"] == plain["predicted_letters"]
    prompts = [
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "What is the order of the group Z_4?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer:",
        "The following are multiple choice questions (with answers) about astronomy.\n\n"
        "Which planet is closest to the Sun?\nA. Venus\nB. Mercury\nC. Mars\nD. Earth\nAnswer:",
    ]
    tokens = sum(1 + len(m.tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    assert plain["tokens"] == cached["tokens"] == tokens
    cfg = m.cfg
    assert cached["cache"]["accesses"] == cfg.top_k * tokens * cfg.n_moe_layers  # both examples, one stream
    assert 0.0 < cached["miss_rate"] < 1.0 and cached["lifetime"] > 0 and cached["bytes_per_token"] > 0
    assert simulate.summarize(state, m.params, cfg) == cached["cache"]
    # Without a cache the pass is right-padded to a multiple of 64 (one program per bucket): exactly the
    # padded forward's real rows. Versus the unpadded pass a bf16 model is NOT bit-identical: XLA:CPU picks
    # its matmul kernel (and each row's summation order) from the shape, and on AVX2 the 1-ulp bf16
    # differences flip near-tied top-k choices (measured on this model: logits up to 0.07 apart below 64
    # tokens and 1.7 at 1,000, argmax agreement >= 98 %). That the padding itself never
    # reaches the real tokens is checked in float32 in test_default_model.
    ids = common.Encoder(m).prompt(prompts[0])
    padded = np.zeros(common.padded_length(len(ids), m.cfg.max_position_embeddings, m.cfg.rope_long_after), int)
    padded[: len(ids)] = ids
    np.testing.assert_array_equal(common.Stream(m).logits(ids), m.forward(padded).logits[: len(ids)])
    unpadded = m.forward(ids).logits
    assert np.mean(common.Stream(m).logits(ids).argmax(-1) == unpadded.argmax(-1)) >= 0.9


def test_default_model_gsm8k_generation_carries_the_cache_like_chained_generate_calls(default_model, tmp_path):
    m = default_model
    row = '{"question": "Tom has 3 apples and buys 2 more. How many apples does he have?", "answer": "#### 5"}\n'
    (tmp_path / "test.jsonl").write_text(row * 2)  # same prompt twice: one compiled shape
    routing, cache = "cache-prior", simulate.CacheConfig(size="0.5")
    res, state = tasks.evaluate_task(m, "gsm8k", str(tmp_path), shots=0, max_new_tokens=3, routing=routing,
                                     cache=cache, return_state=True)
    ids = common.Encoder(m).prompt("Question: Tom has 3 apples and buys 2 more. How many apples does he have?"
                                  "\nAnswer:")
    chained = common.own_state(m.router_state(routing, cache))  # committed, as evaluate_task carries it
    generated = []
    for _ in range(2):
        out = m.generate(ids, max_new_tokens=3, state=chained, prefill_routing="original", bucketed=True,
                         stop=gsm8k.GSM8K_STOPS)
        chained = out.router_state
        generated.append(len(out.token_ids))
    assert simulate.summarize(chained, m.params, m.cfg) == res["cache"]
    assert res["tokens"] == sum(len(ids) + g - 1 for g in generated)
    assert res["cache"]["accesses"] == m.cfg.top_k * res["tokens"] * m.cfg.n_moe_layers
    assert res["examples"] == 2 and len(res["samples"]) == 2
    more = tasks.evaluate_task(m, "gsm8k", str(tmp_path), shots=0, max_new_tokens=3, state=state, limit=1)
    assert more["cache"]["tokens"] == res["cache"]["tokens"] + more["tokens"]
    # generate donates (deletes) arrays of the state it gets; the caller's state is left intact
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(state) if isinstance(x, jax.Array))
    assert simulate.summarize(state, m.params, m.cfg) == res["cache"]


def test_task_with_offload_reports_what_the_paging_moved_over_every_call(default_model):
    """``offload=`` pages the experts for real in every forward of the task; the result gains one ``offload``
    summary over all of them (as WikiText's chunks get one), where before it had none."""
    m = default_model
    res = tasks.evaluate_task(m, "mmlu", os.path.join(FIXTURES, "mmlu"), shots=0, limit=2, routing="original",
                              cache=simulate.CacheConfig(size="0.5"), offload=offload.OffloadConfig())
    off = res["offload"]
    assert off["paging"] == "host" and off["chunks"] == 2 and off["tokens"] == res["tokens"]
    pages = off["prefill_pages"] + off["demand_loads"] + off["prefetch_loads"]
    assert pages > 0 and off["bytes_moved"] == pages * off["expert_bytes"]
    assert off["bytes_per_token"] == off["bytes_moved"] / res["tokens"]
    plain = tasks.evaluate_task(m, "mmlu", os.path.join(FIXTURES, "mmlu"), shots=0, limit=2, routing="original",
                                cache=simulate.CacheConfig(size="0.5"))
    assert "offload" not in plain and plain["predicted_letters"] == res["predicted_letters"]


@pytest.mark.parametrize("task, kw", [("mmlu", {"shots": 2}), ("truthfulqa", {}),
                                      ("gsm8k", {"shots": 2, "max_new_tokens": 30}),
                                      ("nq_open", {"shots": 1, "max_new_tokens": 5})])
def test_longest_pass_is_the_largest_call_the_evaluation_makes(task, kw):
    """What an offloaded evaluation's fit check counts (``tasks.longest_pass``, used by ``evaluate --task ...
    --offload``): the positions and logit rows of the largest call the run really makes — a scored forward
    holds and returns every position; a generation holds ``decode.kv_bucket(decode.kv_rows(prompt, new))``
    positions, as in-jit paging allocates them (the host pager: ``kv_bucket(prompt + new + 1)``, never more),
    and returns no logits. Not ``--context``, which tasks do not read."""
    model = FakeModel(_mmlu_scores if task == "mmlu" else _truthful_scores, reply=_gsm8k_reply, context=160)
    data = os.path.join(FIXTURES, task)
    got = tasks.longest_pass(model, task, data, **kw)
    tasks.evaluate_task(model, task, data, tag="x", **kw)  # with an option forwards run unpadded, as when paging
    sizes = [(len(ids), len(ids)) if kind == "forward" else
             (decode.kv_bucket(decode.kv_rows(len(ids), c["max_new_tokens"])), 0) for kind, ids, c in model.calls]
    assert got == (max(s[0] for s in sizes), max(s[1] for s in sizes))
    host = [decode.kv_bucket(len(ids) + c["max_new_tokens"] + 1) for kind, ids, c in model.calls if kind != "forward"]
    assert got[0] >= max(host, default=0)
    assert got[0] > 8 and (got[1] > 0) == (task in ("mmlu", "truthfulqa"))
    # in-jit paging's cache holds whole chunks of new tokens: 96 + 2 chunks of 16 + 1 = 129 rows, a bucket of 256
    # (the host pager's 96 + 18 + 1 = 115 would fit in 128)
    gen = common.Request(None, common.FittedPrompt(np.zeros(96, np.int32), "", 0, False), max_new_tokens=18)
    assert gen.passes() == [(256, 0)]
    # a shorter context cuts the prompts, and the longest pass with them
    short = FakeModel(context=48)
    assert tasks.longest_pass(short, task, data, **kw)[0] <= max(48, decode.kv_bucket(48))


def test_evaluate_fits_an_offloaded_task_to_its_longest_pass():
    """``evaluate --task mmlu --offload`` checks the cache's fit beside the task's longest pass, not beside
    ``--context`` (1,024 positions, which the task does not read: a longer prompt would outgrow the plan)."""
    from moejax.evaluation import evaluate as ev

    model, data = FakeModel(_mmlu_scores, context=160), os.path.join(FIXTURES, "mmlu")
    argv = ["--model", "m", "--task", "mmlu", "--data", data, "--shots", "2"]
    offloaded, plain = ev.build_parser().parse_args(argv + ["--offload"]), ev.build_parser().parse_args(argv)
    offloaded.context = plain.context = 1024  # what main sets before the fit check
    longest = tasks.longest_pass(model, "mmlu", data, shots=2)
    assert ev.pass_size(offloaded, model) == longest and longest[0] < 160
    assert ev.pass_size(plain, model) == (1024, 1024)  # nothing is paged: the figure decides nothing
