"""A rollout's analysis, pure: the tallies replicas count per stage, their sum across
replicas (``combine``), the measurements of a stage (``analyse``), the first threshold
they break (``breach``) and what the controller does next (``decide``)."""

from __future__ import annotations

import bisect
import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from .plan import SHADOW, Plan

#: compute-time histogram bounds (s): 100 us to about 50 s, 25% apart, so that replicas'
#: p99 can be added exactly (sums of counts), unlike averaged quantiles
LATENCY_BOUNDS = tuple(1e-4 * 1.25 ** i for i in range(60))


@dataclass
class Side:
    """One version's requests, errors and compute-time histogram within a stage."""

    requests: int = 0
    errors: int = 0
    latency: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    seconds: float = 0.0  # the sum of the times counted in ``latency``

    def add(self, other: Side) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.latency = [a + b for a, b in zip(self.latency, other.latency, strict=True)]
        self.seconds += other.seconds

    def time(self, seconds: float) -> None:
        self.latency[bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1
        self.seconds += seconds

    def p99(self) -> float | None:
        total = sum(self.latency)
        if not total:
            return None
        rank, seen = math.ceil(0.99 * total), 0
        for i, count in enumerate(self.latency):
            seen += count
            if seen >= rank:
                return LATENCY_BOUNDS[min(i, len(LATENCY_BOUNDS) - 1)]
        return None  # unreachable


@dataclass
class Tally:
    """What replicas measure in one stage: the shadow comparisons (``compared``, the sum
    of their agreement and of their difference), the shadow runs that failed or were
    skipped (a busy queue), and each version's live requests."""

    compared: int = 0
    agreement: float = 0.0
    difference: float = 0.0
    shadow_failures: int = 0
    skipped: int = 0
    candidate: Side = field(default_factory=Side)
    promoted: Side = field(default_factory=Side)

    def add(self, other: Tally) -> None:
        self.compared += other.compared
        self.agreement += other.agreement
        self.difference += other.difference
        self.shadow_failures += other.shadow_failures
        self.skipped += other.skipped
        self.candidate.add(other.candidate)
        self.promoted.add(other.promoted)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Tally:
        try:
            sides = {k: Side(int(d[k]["requests"]), int(d[k]["errors"]),
                             [int(c) for c in d[k]["latency"]], float(d[k]["seconds"]))
                     for k in ("candidate", "promoted")}
            tally = cls(int(d["compared"]), float(d["agreement"]), float(d["difference"]),
                        int(d["shadow_failures"]), int(d["skipped"]), **sides)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a replica's tally is malformed: {error!r}") from None
        if any(len(s.latency) != len(LATENCY_BOUNDS) + 1 for s in (tally.candidate,
                                                                   tally.promoted)):
            raise ValueError("a replica's tally has a latency histogram of another size")
        return tally


def combine(plan: Plan, reports: Sequence[dict]) -> dict[int, Tally]:
    """The replicas' tallies of PLAN's rollout, added per stage index. A report is
    {"rollout": id, "stages": {"0": tally, ...}} (``/v2/repository/models/N/rollout``'s
    "report"); reports of another rollout are left out."""
    total: dict[int, Tally] = {}
    for report in reports:
        if not isinstance(report, dict) or report.get("rollout") != plan.id:
            continue
        for index, tally in (report.get("stages") or {}).items():
            total.setdefault(int(index), Tally()).add(Tally.from_dict(tally))
    return total


def analyse(plan: Plan, tallies: dict[int, Tally]) -> dict:
    """The measurements of PLAN's current stage (the candidate's, the stage's own) against
    the promoted version's (all stages so far: at 100% it receives no new requests)."""
    stage = tallies.get(plan.stage, Tally())
    baseline = Side()
    for index, tally in tallies.items():
        if index <= plan.stage:
            baseline.add(tally.promoted)
    shadow_runs = stage.compared + stage.shadow_failures
    candidate = stage.candidate
    if plan.stage_name == SHADOW:
        requests, errors = shadow_runs, stage.shadow_failures
    else:  # the live requests routed to it (the shadow runs on the others add failures)
        requests = candidate.requests + shadow_runs
        errors = candidate.errors + stage.shadow_failures
    error_rate = errors / requests if requests else None
    promoted_rate = baseline.errors / baseline.requests if baseline.requests else 0.0
    p99_candidate = candidate.p99()
    p99_promoted = baseline.p99()
    return {
        "requests": requests, "compared": stage.compared, "skipped": stage.skipped,
        "agreement": stage.agreement / stage.compared if stage.compared else None,
        "mean_difference": stage.difference / stage.compared if stage.compared else None,
        "errors": errors, "error_rate": error_rate, "promoted_error_rate": promoted_rate,
        "p99_candidate_s": p99_candidate, "p99_promoted_s": p99_promoted,
        "latency_ratio": p99_candidate / p99_promoted
        if p99_candidate is not None and p99_promoted else None,
        "latency_samples": min(sum(candidate.latency), sum(baseline.latency)),
    }


def breach(plan: Plan, analysis: dict) -> dict | None:
    """The first threshold the analysis breaks, {"rule", "value", "threshold", "message"},
    or None. A rule is judged once it has ``min_requests`` samples; failures are judged
    sooner when they already break the rule whatever the remaining samples bring."""
    t, n = plan.thresholds, plan.min_requests
    errors, requests = analysis["errors"], analysis["requests"]
    excess = t.max_error_rate + analysis["promoted_error_rate"]
    if requests and (requests >= n or errors > excess * n) and \
            analysis["error_rate"] > excess:
        return _broken("max_error_rate", analysis["error_rate"] -
                       analysis["promoted_error_rate"], t.max_error_rate,
                       f"error rate {analysis['error_rate']:.3g} ({errors} of {requests}) is "
                       f"above the promoted version's {analysis['promoted_error_rate']:.3g} "
                       f"by more than max_error_rate {t.max_error_rate:g}")
    if analysis["compared"] >= n and analysis["agreement"] < t.min_agreement:
        return _broken("min_agreement", analysis["agreement"], t.min_agreement,
                       f"top-1 agreement {analysis['agreement']:.3g} over "
                       f"{analysis['compared']} shadowed requests is below min_agreement "
                       f"{t.min_agreement:g}")
    ratio = analysis["latency_ratio"]
    if ratio is not None and analysis["latency_samples"] >= n and \
            ratio > t.max_latency_ratio:
        return _broken("max_latency_ratio", ratio, t.max_latency_ratio,
                       f"p99 compute time {analysis['p99_candidate_s'] * 1000:.3g} ms is "
                       f"{ratio:.3g}x the promoted version's, above max_latency_ratio "
                       f"{t.max_latency_ratio:g}")
    return None


def _broken(rule: str, value: float, threshold: float, message: str) -> dict:
    return {"rule": rule, "value": value, "threshold": threshold, "message": message}


def decide(plan: Plan, tallies: dict[int, Tally], now: dt.datetime) -> tuple[str, dict]:
    """("wait" | "advance" | "rollback", the analysis, with "breach" when one)."""
    analysis = analyse(plan, tallies)
    broken = breach(plan, analysis)
    if broken is not None:
        return "rollback", {**analysis, "breach": broken}
    elapsed = (now - dt.datetime.fromisoformat(plan.stage_started)).total_seconds()
    enough = analysis["requests"] >= plan.min_requests
    return ("advance" if elapsed >= plan.interval_s and enough else "wait"), analysis
