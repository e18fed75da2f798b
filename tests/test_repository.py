"""The repository speaks of the product only: no work-log labels, no design document outside it.

A comment, docstring, test or script says why something is so and, for a measured figure, which benchmark
command shows it; it does not date itself by a work session, an issue number or a stop, and a file name says
what the file holds. The design lives in ``docs/design.md``; nothing points at a copy elsewhere. These tests
read every file git tracks (text files only: a file with a NUL byte or invalid UTF-8 is data, not prose).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# The patterns are built from pieces so that this file, which is tracked too, does not match them itself.
_SESSION, _ISSUE, _STOP = "sess" + "ion", "iss" + "ue", "st" + "op"
#: work-log labels in a file's text: "<session> 12", "<sessions> 33-34", "<issue> 14", "<issue> #67", "<stop> 3".
#: Run over every tracked text file (the WikiText-2 copy, the tokenizers and the results included), none of them
#: hits legitimate text; "<stop> N" ends at a word boundary, so that "stop 1e-3" or "stop 10x" does not match.
LABELS = (re.compile(r"(?i)\b" + _SESSION + r"s? \d+"),
          re.compile(r"(?i)\b" + _ISSUE + r" ?#?\d+"),
          re.compile(r"(?i)\b" + _STOP + r" \d+\b"))
#: the same in a file's path: "gpu_<issue>14.sh", "results-s31.json", "h200-2026-11-27-s18/", any "<session>"
LABEL_IN_NAME = re.compile(r"(?i)" + _ISSUE + r"\d+|[-_]s\d{2}\b|" + _SESSION)

#: a design document outside the repository: "<DESIGN> §2", "<DESIGN>.md §3" (``docs/design.md`` is spelled in
#: lower case, so a case-sensitive match on the upper-case name finds only the outside one)
OUTSIDE_DESIGN = re.compile("DES" + r"IGN(?:\.md)?\s*§|" + "DES" + r"IGN\.md")
#: the data folder beside a checkout, which only a lent GPU machine's set-up has
BESIDE = re.compile(re.escape("/".join(("..", "shared"))))


def _may_name_the_folder_beside(path: str) -> bool:
    """The device scripts at the top of bench/ set up a lent GPU machine: ``device_env.sh`` unpacks the carried
    data beside the checkout there, ``gpu_default_model.sh --prepare`` reads the training corpus from it by
    default. Nothing else (the package, the tests, the Python benchmarks, the docs, recorded results) may assume
    a folder outside the checkout."""
    return os.path.dirname(path) == "bench" and path.endswith(".sh")


def _tracked_texts():
    """(path relative to the root, text) for every tracked file that is text; skips where this is no git checkout."""
    try:
        root = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (or no git): the tracked files are unknown")
    for path in sorted(p for p in listed.decode("utf-8", "surrogateescape").split("\0") if p):
        try:
            with open(os.path.join(root, path), "rb") as f:
                data = f.read()
        except (FileNotFoundError, IsADirectoryError):  # deleted in the working tree, or a submodule
            yield path, None
            continue
        if b"\0" in data:
            yield path, None
            continue
        try:
            yield path, data.decode("utf-8")
        except UnicodeDecodeError:
            yield path, None


def _excerpt(line: str, start: int, end: int, around: int = 60) -> str:
    """The match with some of the line either side (a results file's line can be thousands of characters)."""
    head, tail = max(0, start - around), min(len(line), end + around)
    return ("..." if head else "") + line[head:tail].strip() + ("..." if tail < len(line) else "")


def _first_match(line: str, patterns) -> tuple[int, int] | None:
    spans = [m.span() for m in (p.search(line) for p in patterns) if m]
    return min(spans) if spans else None


def _report(what: str, hits: list[tuple[str, int, str]]) -> str:
    lines = [f"{len(hits)} {what}:"]
    lines += [f"  {path}:{n}: {text}" if n else f"  {path} (its name)" for path, n, text in hits[:200]]
    if len(hits) > 200:
        lines.append(f"  ... and {len(hits) - 200} more")
    return "\n".join(lines)


def test_no_tracked_file_carries_a_work_log_label():
    """No tracked file's name or text carries a work session, an issue number or a stop as a label."""
    hits = []
    for path, text in _tracked_texts():
        if LABEL_IN_NAME.search(path):
            hits.append((path, 0, path))
        for n, line in enumerate((text or "").splitlines(), 1):
            span = _first_match(line, LABELS)
            if span:
                hits.append((path, n, _excerpt(line, *span)))
    assert not hits, _report("work-log labels (say what and why, and cite the benchmark command, not a day)", hits)


def test_no_tracked_file_cites_a_design_document_outside_the_repository():
    """Design references name ``docs/design.md``; only the bench/ device scripts name the folder beside the
    checkout."""
    hits = []
    for path, text in _tracked_texts():
        patterns = (OUTSIDE_DESIGN,) if _may_name_the_folder_beside(path) else (OUTSIDE_DESIGN, BESIDE)
        for n, line in enumerate((text or "").splitlines(), 1):
            span = _first_match(line, patterns)
            if span:
                hits.append((path, n, _excerpt(line, *span)))
    assert not hits, _report("references outside the repository (docs/design.md §N; data from an option or "
                             "$MOEJAX_DATA)", hits)
