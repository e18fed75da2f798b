"""Text post-processing for models trained on WikiText-style text.

WikiText (and the corpus the default model was trained on) is Moses-tokenized: ``1 @,@ 000``,
``self @-@ governed``, spaces before punctuation, ``( x )``, ``" x "``, ``John 's``, ``do n't``.
``wikitext_detokenize`` undoes that spacing for display. It only changes spaces (and the ``@x@``
markers), so it is safe to apply to any text; ``generate`` applies it when the checkpoint's
``generation_config.json`` says ``"text_style": "wikitext"``.
"""

from __future__ import annotations

import re

TEXT_STYLE_KEY = "text_style"
WIKITEXT = "wikitext"

_RULES: list[tuple[re.Pattern, str]] = [
    (re.compile(r" @(-|,|\.)@ "), r"\1"),  # 1 @,@ 000 -> 1,000 ; self @-@ governed -> self-governed
    (re.compile(r" @(-|,|\.)@"), r"\1"),
    (re.compile(r"@(-|,|\.)@ "), r"\1"),
    (re.compile(r" (n't)\b"), r"\1"),  # do n't -> don't
    (re.compile(r" ('(?:s|re|ve|ll|d|m|S|RE|VE|LL|D|M))\b"), r"\1"),  # John 's -> John's
    (re.compile(r"(?<=s) '(?= |$)"), "'"),  # plural possessive: the players ' union -> the players' union
    (re.compile(r" ([.,;:!?%])(?=\s|$|[\"')\]])"), r"\1"),  # spaces before punctuation
    (re.compile(r"([(\[{]) "), r"\1"),  # ( x -> (x
    (re.compile(r" ([)\]}])"), r"\1"),  # x ) -> x)
    (re.compile(r"\$ (?=\d)"), "$"),  # $ 5 -> $5
    (re.compile(r"(\d) (?=%)"), r"\1"),
]
_HEADING = re.compile(r"^ ?(=+) (.*?) (=+) ?$")


def _quotes(line: str) -> str:
    """Pair up straight double quotes: ``say " hello there " now`` -> ``say "hello there" now``."""
    parts = line.split('"')
    if len(parts) < 3:
        return line
    out = [parts[0]]
    for i, part in enumerate(parts[1:], start=1):
        opening = i % 2 == 1
        if opening:
            if i == len(parts) - 1:  # unmatched quote at the end: leave it alone
                out.append('"' + part)
                continue
            out.append('"' + part.lstrip(" "))
        else:
            out[-1] = out[-1].rstrip(" ")
            out.append('"' + part)
    return "".join(out)


def wikitext_detokenize_line(line: str) -> str:
    if _HEADING.match(line):
        m = _HEADING.match(line)
        return f"{m.group(1)} {m.group(2)} {m.group(3)}"
    text = line.lstrip(" ")
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    text = _quotes(text)
    text = re.sub(r" ([.,;:!?])(?=\s|$)", r"\1", text)  # punctuation freed by the quote pass
    return text.rstrip(" ")


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText spacing line by line (a single leading space of each line is dropped too)."""
    lines = text.split("\n")
    out = []
    for line in lines:
        stripped = line[1:] if line.startswith(" ") else line
        out.append(wikitext_detokenize_line(stripped))
    return "\n".join(out)


def is_wikitext_style(generation_config: dict | None) -> bool:
    return bool(generation_config) and generation_config.get(TEXT_STYLE_KEY) == WIKITEXT
