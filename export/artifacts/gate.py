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
#: --require-better-on-gate-data: how much better than the promoted version the candidate
#: must be on the held-out captured slice, in the metric's units (--gate-margin): two
#: accuracy points, so a retrain that learned nothing from the captures (its score on them
#: within noise of the incumbent's) is refused
GATE_MARGIN = 0.02


class GateRefused(Exception):  # an outcome (exit 3), not bad input
    """The candidate failed the gate; the message is one line naming both values and the
    rule; ``kept`` is where the rejected package was kept."""

    def __init__(self, message: str, kept: Path | str | None = None) -> None:
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


def check_better(metric: str, higher_is_better: bool, candidate: float,
                 incumbent: tuple[int, float] | None, margin: float) -> str:
    """Why the candidate is refused under --require-better-on-gate-data ('' when it
    passes): it must beat the promoted version's value by at least ``margin`` (drift was
    the trigger: a retrain must have learned the shifted inputs). No promoted version, or
    a broken one: nothing to beat."""
    if not math.isfinite(candidate):
        return f"candidate's {metric} is {candidate}: non-finite outputs or metric"
    if incumbent is None or not math.isfinite(incumbent[1]):
        return ""
    version, value = incumbent
    gain = candidate - value if higher_is_better else value - candidate
    if gain < margin - 1e-9:  # 0.6 - 0.5 is 0.0999...: a gain of exactly the margin passes
        return (f"candidate's {metric} {candidate:.6g} is not better than promoted version "
                f"{version}'s {value:.6g} by at least --gate-margin {margin:g} "
                f"(--require-better-on-gate-data: drift was the trigger)")
    return ""
