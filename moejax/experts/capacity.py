"""How large an expert cache is: a count of experts, a fraction or percentage of them, or the memory the cached
experts may occupy (``6GiB``), resolved to slots per layer or for the one global pool."""

from __future__ import annotations

import fractions
import math
import re

from moejax.base.memory import format_bytes
from moejax.experts.cache import SCOPES

BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTE_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)


def parse_byte_size(spec) -> int | None:
    """``"6GiB"`` / ``"1.5 GB"`` / ``"800MiB"`` as a number of bytes (binary and decimal units, any case);
    None when ``spec`` is not a memory size (a count or fraction of experts). An unknown unit is an error."""
    m = _BYTE_SIZE.match(str(spec))
    if m is None:
        return None
    unit = m.group(2).lower()
    if unit not in BYTE_UNITS:
        raise ValueError(f"cache size {spec!r}: unknown unit {m.group(2)!r}; a memory size takes one of "
                         "B, kB, MB, GB, TB, KiB, MiB, GiB, TiB")
    return int(fractions.Fraction(m.group(1)) * BYTE_UNITS[unit])  # exact: a float overflowed for 400 digits


def slot_sets(n_layers: int, scope: str) -> int:
    """How many sets of slots a cache has: one per MoE layer, or the one global pool."""
    return n_layers if scope == "layer" else 1


def capacity_limit(n_experts: int, n_layers: int, scope: str) -> int:
    """The most slots one set can have: N per layer, L·N in the global pool."""
    return n_experts if scope == "layer" else n_experts * n_layers


def parse_capacity(spec, n_experts: int, n_layers: int = 1, scope: str = "layer",
                   expert_bytes: int | None = None) -> int:
    """Cache capacity as a count of experts.

    "6" (no decimal point) is a count; "0.5" / "1.0" (decimal point) is a fraction of N per layer, or of
    L·N for the global pool; "5%" is a percentage of the same. Rounded half up; must land in [1, limit].
    "6GiB" (a memory size) is what the cached experts may occupy in all, ``expert_bytes`` each: per layer
    ⌊bytes / (L · expert_bytes)⌋ slots, for the global pool ⌊bytes / expert_bytes⌋, at most the limit
    (a budget above every expert caches them all); below one expert per slot set it is an error.
    """
    if scope not in SCOPES:
        raise ValueError(f"unknown cache scope {scope!r}; expected one of {SCOPES}")
    limit = capacity_limit(n_experts, n_layers, scope)
    what = "N" if scope == "layer" else "L*N"
    if str(spec).strip().lower() == "auto":
        raise ValueError("cache size 'auto' is the most device slots the free memory holds: only a model loaded "
                         "for offloading resolves it (Model.resolve_cache)")
    budget = parse_byte_size(spec)
    if budget is not None:
        return _capacity_of_bytes(spec, budget, limit, slot_sets(n_layers, scope), expert_bytes)
    frac, count = _count_or_fraction(spec)
    if count is None:
        if not (math.isfinite(frac) and 0.0 < frac <= 1.0):
            raise ValueError(f"cache size fraction {spec!r} must be in (0, 1] of {what}={limit}")
        count = int(math.floor(frac * limit + 0.5))
        if count < 1:
            raise ValueError(f"cache size {spec!r} of {what}={limit} rounds to 0 experts")
    if not 1 <= count <= limit:
        raise ValueError(f"cache size {spec!r} must be between 1 and {what}={limit} experts")
    return count


def _count_or_fraction(spec) -> tuple[float | None, int | None]:
    """A size that is not a memory size: (fraction, None) for '0.5' / '5%', (None, count) for '6'."""
    text = str(spec).strip()
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100.0, None
        if "." in text or "e" in text.lower():
            return float(text), None
        return None, int(text)
    except ValueError:
        raise ValueError(f"cache size {spec!r} is not a count ('6'), a fraction ('0.5'), a percentage ('5%') "
                         "or a memory size ('6GiB')") from None


def check_size(spec) -> None:
    """What of a cache size can be checked before a model is known: its form, and that it is positive
    (``parse_capacity`` then checks it against N, and a memory size against the experts' bytes)."""
    if str(spec).strip().lower() == "auto":
        return
    budget = parse_byte_size(spec)
    frac, count = (None, budget) if budget is not None else _count_or_fraction(spec)
    if not (count is not None and count > 0 or frac is not None and math.isfinite(frac) and frac > 0):
        raise ValueError(f"cache size {spec!r} must be positive: a count ('6'), a fraction of N ('0.5'), a "
                         "percentage ('5%') or a memory size ('6GiB')")


def _capacity_of_bytes(spec, budget: int, limit: int, sets: int, expert_bytes: int | None) -> int:
    """Slots per set (a layer's, or the one global pool) that ``budget`` bytes hold over ``sets`` sets."""
    if expert_bytes is None:
        raise ValueError(f"cache size {spec!r} is a memory size: it needs the size of one expert, which only a "
                         "loaded model knows (give a count or a fraction of N here)")
    one = sets * int(expert_bytes)
    count = budget // one
    if count < 1:
        per = (f"one expert per MoE layer ({sets} × {format_bytes(expert_bytes)})" if sets > 1
               else f"one expert ({format_bytes(one)})")
        raise ValueError(f"cache size {spec!r} holds less than {per}: give at least {format_bytes(one)}")
    return int(min(count, limit))
