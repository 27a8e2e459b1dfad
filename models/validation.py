"""Argument checks shared by every public entry of `models`.

Each check raises ValueError naming the option and the allowed values, so a bad
configuration fails at build time with a message a user can act on.
"""

from __future__ import annotations

from collections.abc import Iterable


def check_int(name: str, value, low: int, high: int | None = None) -> int:
    """`value` must be an integer in [low, high] (high=None: no upper bound)."""
    allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {allowed}, got {value}")
    return value


def check_float(name: str, value, low: float, high: float | None = None, *,
                low_open: bool = False) -> float:
    """`value` must be a finite number in [low, high] ((low, high] with low_open)."""
    bracket = "(" if low_open else "["
    allowed = (f"in {bracket}{low}, {high}]" if high is not None
               else f"{'>' if low_open else '>='} {low}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}") from None
    too_low = number <= low if low_open else number < low
    if number != number or too_low or (high is not None and number > high):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")
    return number


def check_choice(name: str, value, choices: Iterable[str]) -> str:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_even(name: str, value: int, why: str) -> int:
    if value % 2:
        raise ValueError(f"{name} must be even ({why}), got {value}")
    return value
