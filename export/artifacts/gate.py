"""The evaluation gate of ``orthornn export --gate``: a candidate goes live only if it
meets the absolute threshold and is no worse than the version it would replace, both
measured on the candidate's test split through each one's own graph (as TFX's
Evaluator blesses a model against its serving baseline). Torch-free: the decision only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

#: exit status of a refused candidate (2 is bad input)
REFUSED_EXIT = 3


class GateRefused(Exception):  # an outcome (exit 3), not bad input
    """The candidate failed the gate; the message is one line naming both values and the
    rule; ``kept`` is where the rejected package was kept."""

    def __init__(self, message: str, kept: Path | None = None) -> None:
        super().__init__(message)
        self.kept = kept


@dataclass(frozen=True)
class Threshold:
    value: float
    source: str  # "--min-metric" or "the task's baseline"
    strict: bool  # the baseline must be beaten; --min-metric met


def check(metric: str, higher_is_better: bool, candidate: float, threshold: Threshold | None,
          incumbent: tuple[int, float] | None, tolerance: float) -> str:
    """Why the candidate is refused ('' when it passes). incumbent: (version, its value on
    the same data) of the version it would replace, or None (the first version)."""
    if not math.isfinite(candidate):
        return f"candidate's {metric} is {candidate}: non-finite outputs or metric"

    def worse(a: float, b: float) -> bool:
        return a < b if higher_is_better else a > b

    if threshold is not None:
        meets = not worse(candidate, threshold.value)
        if threshold.strict:
            meets = meets and candidate != threshold.value
        if not meets:
            rule = "must beat" if threshold.strict else "must meet"
            return (f"candidate's {metric} {candidate:.6g} {rule} {threshold.source} "
                    f"{threshold.value:.6g} ({'higher' if higher_is_better else 'lower'} "
                    f"is better)")
    if incumbent is not None:
        version, value = incumbent
        if not math.isfinite(value):
            return ""  # a broken incumbent never protects itself
        bound = value - tolerance if higher_is_better else value + tolerance
        if worse(candidate, bound):
            return (f"candidate's {metric} {candidate:.6g} is worse than promoted version "
                    f"{version}'s {value:.6g} by more than --tolerance {tolerance:g} on the "
                    f"same data")
    return ""
