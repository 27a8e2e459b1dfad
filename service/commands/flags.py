"""What the commands' flags share: a number read from a flag's text, within its bounds,
with the error naming the flag (one rule for every command; exit 2 by ``orthornn.cli``)."""

from __future__ import annotations

import math


def number(flag: str, text: str, low: float = -math.inf, high: float = math.inf,
           integer: bool = False) -> float:
    """TEXT as a number (an integer when INTEGER) in [LOW, HIGH]; ValueError naming FLAG."""
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = math.nan
    if not (low <= value <= high):  # NaN fails too
        kind = "an integer" if integer else "a number"
        bounds = "" if (low, high) == (-math.inf, math.inf) else f" in [{low:g}, {high:g}]"
        raise ValueError(f"{flag} must be {kind}{bounds}; got {text!r}")
    return value
