"""Rollouts on live traffic, torch-free: the plan in the repository, the tallies replicas
measure, and the analysis that advances, promotes or rolls back a candidate.

REPO/<name>/rollout.json (beside promotion.json; both written under the model's one lock,
replaced crash-safe: ``records``):

    {"id": "...", "candidate": 4, "promoted": 3, "state": "running",
     "stages": ["shadow", 5, 25, 50, 100], "stage": 1, "stage_started": ISO-8601,
     "shadow": 0.1, "interval_s": 60, "min_requests": 100,
     "thresholds": {"min_agreement": 0.95, "max_error_rate": 0.01, "max_latency_ratio": 1.5},
     "analysis": [{"stage": "shadow", "outcome": "passed", ...}, ...],
     "reason": null, "breach": null, "past": [...the earlier rollouts, summarised...]}

A stage is "shadow" (the candidate also runs on a fraction of the requests the promoted
version answers, and its answers are only compared) or a canary percentage (new requests
and new sessions go to the candidate by that weight, from a hash of their routing key).
Every replica reads the plan at each repository scan, as it reads promotion.json, and
counts a ``Tally`` per stage; a controller (``orthornn rollout run``, or the service itself
when it may write the repository) adds the replicas' tallies (``combine``), and ``decide``
says whether the stage waits, advances, or breaks a threshold. ``control`` applies that to
the plan: the last step promotes the candidate (promotion.json), a breach stops the
rollout and leaves the promoted version untouched. The promotion is made only over the
version the rollout started from: when another writer (a rollback, an export) changed the
promotion since, the rollout stops (aborted, the reason says so) instead of overriding it.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
import math
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import records
from .repository import live_version, promote, read_promotion, versions

ROLLOUT = "rollout.json"
RUNNING, PROMOTED, ROLLED_BACK, ABORTED = "running", "promoted", "rolled_back", "aborted"
SHADOW = "shadow"
DEFAULT_STEPS = (5, 25, 50, 100)
#: rollout exit status is 2 for bad input, as every command; these are the rules' names
RULES = ("min_agreement", "max_error_rate", "max_latency_ratio")
#: compute-time histogram bounds (s): 100 us to about 50 s, 25% apart, so that replicas'
#: p99 can be added exactly (sums of counts), unlike averaged quantiles
LATENCY_BOUNDS = tuple(1e-4 * 1.25 ** i for i in range(60))


class RolloutError(ValueError):
    """Bad input to a rollout command (exit 2, or a 4xx): the message names the field.
    ``status``: the HTTP status the admin API answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Thresholds:
    """When a rollout stops: the candidate's top-1 agreement with the promoted version
    below ``min_agreement``; its error rate above the promoted version's by more than
    ``max_error_rate``; its p99 compute time over the promoted version's above
    ``max_latency_ratio``."""

    min_agreement: float = 0.9
    max_error_rate: float = 0.01
    max_latency_ratio: float = 2.0

    def __post_init__(self) -> None:
        for name, low, high in (("min_agreement", 0.0, 1.0), ("max_error_rate", 0.0, 1.0),
                                ("max_latency_ratio", 1.0, 1000.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    not math.isfinite(value) or not low <= value <= high:
                raise RolloutError(f"--{name.replace('_', '-')} must be a number in "
                                   f"[{low:g}, {high:g}]; got {value!r}")


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


def combine(plan: dict, reports: Sequence[dict]) -> dict[int, Tally]:
    """The replicas' tallies of PLAN's rollout, added per stage index. A report is
    {"rollout": id, "stages": {"0": tally, ...}} (``/v2/repository/models/N/rollout``'s
    "report"); reports of another rollout are left out."""
    total: dict[int, Tally] = {}
    for report in reports:
        if not isinstance(report, dict) or report.get("rollout") != plan["id"]:
            continue
        for index, tally in (report.get("stages") or {}).items():
            total.setdefault(int(index), Tally()).add(Tally.from_dict(tally))
    return total


def weight(plan: dict | None) -> int:
    """The candidate's share of new requests, in percent (0 in shadow or when not
    running)."""
    if plan is None or plan["state"] != RUNNING:
        return 0
    stage = plan["stages"][plan["stage"]]
    return 0 if stage == SHADOW else int(stage)


def bucket(key: bytes) -> float:
    """Where a routing key falls in [0, 100): the same key always lands on the same
    version of a stage, on every replica (a retry included)."""
    return zlib.crc32(key) % 10000 / 100


# -- the analysis --------------------------------------------------------------------------

def analyse(plan: dict, tallies: dict[int, Tally]) -> dict:
    """The measurements of PLAN's current stage (the candidate's, the stage's own) against
    the promoted version's (all stages so far: at 100% it receives no new requests)."""
    stage = tallies.get(plan["stage"], Tally())
    baseline = Side()
    for index, tally in tallies.items():
        if index <= plan["stage"]:
            baseline.add(tally.promoted)
    shadow_runs = stage.compared + stage.shadow_failures
    candidate = stage.candidate
    if plan["stages"][plan["stage"]] == SHADOW:
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


def breach(plan: dict, analysis: dict) -> dict | None:
    """The first threshold the analysis breaks, {"rule", "value", "threshold", "message"},
    or None. A rule is judged once it has ``min_requests`` samples; failures are judged
    sooner when they already break the rule whatever the remaining samples bring."""
    t, n = plan["thresholds"], plan["min_requests"]
    errors, requests = analysis["errors"], analysis["requests"]
    excess = t["max_error_rate"] + analysis["promoted_error_rate"]
    if requests and (requests >= n or errors > excess * n) and \
            analysis["error_rate"] > excess:
        return _broken("max_error_rate", analysis["error_rate"] -
                       analysis["promoted_error_rate"], t["max_error_rate"],
                       f"error rate {analysis['error_rate']:.3g} ({errors} of {requests}) is "
                       f"above the promoted version's {analysis['promoted_error_rate']:.3g} "
                       f"by more than --max-error-rate {t['max_error_rate']:g}")
    if analysis["compared"] >= n and analysis["agreement"] < t["min_agreement"]:
        return _broken("min_agreement", analysis["agreement"], t["min_agreement"],
                       f"top-1 agreement {analysis['agreement']:.3g} over "
                       f"{analysis['compared']} shadowed requests is below --min-agreement "
                       f"{t['min_agreement']:g}")
    ratio = analysis["latency_ratio"]
    if ratio is not None and analysis["latency_samples"] >= n and \
            ratio > t["max_latency_ratio"]:
        return _broken("max_latency_ratio", ratio, t["max_latency_ratio"],
                       f"p99 compute time {analysis['p99_candidate_s'] * 1000:.3g} ms is "
                       f"{ratio:.3g}x the promoted version's, above --max-latency-ratio "
                       f"{t['max_latency_ratio']:g}")
    return None


def _broken(rule: str, value: float, threshold: float, message: str) -> dict:
    return {"rule": rule, "value": value, "threshold": threshold, "message": message}


def decide(plan: dict, tallies: dict[int, Tally], now: dt.datetime) -> tuple[str, dict]:
    """("wait" | "advance" | "rollback", the analysis, with "breach" when one)."""
    analysis = analyse(plan, tallies)
    broken = breach(plan, analysis)
    if broken is not None:
        return "rollback", {**analysis, "breach": broken}
    elapsed = (now - _time(plan["stage_started"])).total_seconds()
    enough = analysis["requests"] >= plan["min_requests"]
    return ("advance" if elapsed >= plan["interval_s"] and enough else "wait"), analysis


# -- the plan in the repository ------------------------------------------------------------

def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _stamp(t: dt.datetime) -> str:
    return t.isoformat(timespec="milliseconds")


def _time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


def read_plan(model_dir: str | Path) -> dict | None:
    """The rollout of model_dir (running or finished), or None; ValueError when the file
    cannot be read."""
    path = Path(model_dir) / ROLLOUT
    try:
        plan = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} cannot be read: {error}") from None
    if not isinstance(plan, dict) or plan.get("state") not in (RUNNING, PROMOTED, ROLLED_BACK,
                                                                ABORTED):
        raise ValueError(f"{str(path)!r} is not a rollout plan")
    return plan


def _write(model_dir: Path, plan: dict) -> None:
    """Replace rollout.json crash-safe; the caller holds the model's lock."""
    assert records.holds(model_dir), "rollout.json is written under the model's lock"
    records.replace_json(model_dir / ROLLOUT, plan)


def parse_steps(text: str | Sequence[int]) -> list[int]:
    """--steps: canary percentages, increasing, ending at 100."""
    try:
        steps = [int(s) for s in (text.split(",") if isinstance(text, str) else text)]
    except ValueError:
        raise RolloutError(f"--steps must be comma-separated percentages such as 5,25,50,100; "
                           f"got {text!r}") from None
    if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)) or \
            steps[-1] != 100:
        raise RolloutError(f"--steps must be increasing percentages in (0, 100] ending at 100 "
                           f"(e.g. 5,25,50,100); got {text!r}")
    return steps


def passed_gate(model_dir: Path, version: int) -> str:
    """Why VERSION may not be rolled out ('' when it passed the gate: its manifest records
    a passed gate, or the promotion history a gated promotion of it)."""
    try:
        manifest = json.loads((model_dir / str(version) / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        return f"its manifest cannot be read ({error})"
    gate = (manifest.get("evaluation") or {}).get("gate") or {}
    if gate.get("passed") is True:
        return ""
    history = read_promotion(model_dir)["history"]
    if any(e.get("version") == version and e.get("action") == "promote" for e in history):
        return ""
    return (f"version {version} was published without --gate; publish the run again with "
            f"`orthornn export --gate --rollout` (or --gate --no-promote)")


def start(model_dir: str | Path, candidate: int, *, shadow: float = 0.1,
          steps: str | Sequence[int] = DEFAULT_STEPS, interval_s: float = 60.0,
          min_requests: int = 100, thresholds: Thresholds | None = None) -> dict:
    """Write a new running plan for CANDIDATE (verified, passed the gate, not the promoted
    version); RolloutError (nothing written) otherwise."""
    from .package import PackageError, verify_package

    model_dir = Path(model_dir)
    thresholds = thresholds or Thresholds()
    stages_ = parse_steps(steps)
    for flag, value, low, high in (("--shadow", shadow, 0.0, 1.0),
                                   ("--interval", interval_s, 0.001, 7 * 86400.0)):
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not math.isfinite(value) or not low <= value <= high:
            raise RolloutError(f"{flag} must be a number in [{low:g}, {high:g}]; got "
                               f"{value!r}")
    if isinstance(min_requests, bool) or not isinstance(min_requests, int) or \
            not 1 <= min_requests <= 10**9:
        raise RolloutError(f"--min-requests must be an integer >= 1; got {min_requests!r}")
    on_disk = versions(model_dir)
    if isinstance(candidate, bool) or not isinstance(candidate, int) or \
            candidate not in on_disk:
        raise RolloutError(f"--candidate: version {candidate!r} is not in "
                           f"{str(model_dir)!r} (versions: {on_disk or 'none'})", 404)
    _base(model_dir, on_disk, candidate)  # refused early, before the slow checks
    why = passed_gate(model_dir, candidate)
    if why:
        raise RolloutError(f"--candidate: {why}", 409)
    try:
        verify_package(model_dir / str(candidate))
    except PackageError as error:
        raise RolloutError(f"--candidate: version {candidate} does not verify: {error}",
                           409) from None
    with records.locked(model_dir):  # the promotion and the plan as they are now
        promoted_version = _base(model_dir, on_disk, candidate)
        try:
            current = read_plan(model_dir)
        except ValueError:
            current = None  # an unreadable plan is replaced
        if current is not None and current["state"] == RUNNING:
            raise RolloutError(f"a rollout of version {current['candidate']} is already "
                               f"running for {model_dir.name!r}; `orthornn rollout abort` or "
                               f"`promote` it first", 409)
        now = _stamp(_now())
        plan = {"id": uuid.uuid4().hex[:12], "model": model_dir.name, "candidate": candidate,
                "promoted": promoted_version, "state": RUNNING,
                "stages": ([SHADOW] if shadow > 0 else []) + stages_, "stage": 0,
                "stage_started": now, "started": now, "ended": None, "shadow": shadow,
                "interval_s": float(interval_s), "min_requests": min_requests,
                "thresholds": asdict(thresholds), "analysis": [], "reason": None,
                "breach": None, "past": _past(current)}
        _write(model_dir, plan)
    return plan


def _base(model_dir: Path, on_disk: list[int], candidate: int) -> int:
    """The promoted version a rollout of CANDIDATE starts from; RolloutError when none."""
    try:
        promoted_version = read_promotion(model_dir)["version"]
    except ValueError as error:
        raise RolloutError(str(error), 409) from None
    live = live_version(on_disk, promoted_version)
    if promoted_version is None or live != promoted_version:
        raise RolloutError(f"--candidate: model {model_dir.name!r} has no promoted version "
                           f"to compare with; promote one first (orthornn export --gate)", 409)
    if candidate == promoted_version:
        raise RolloutError(f"--candidate: version {candidate} is already promoted", 409)
    return promoted_version


def _past(plan: dict | None) -> list[dict]:
    if plan is None:
        return []
    summary = {k: plan.get(k) for k in ("id", "candidate", "promoted", "state", "started",
                                        "ended", "reason", "breach")}
    return [*plan.get("past", []), summary]


def _stage_record(plan: dict, analysis: dict, outcome: str, now: dt.datetime) -> dict:
    return {"stage": plan["stages"][plan["stage"]], "started": plan["stage_started"],
            "ended": _stamp(now), "outcome": outcome, **analysis}


def _finish(model_dir: Path, plan: dict, state: str, reason: str, now: dt.datetime,
            breach_: dict | None = None) -> dict:
    """End PLAN (the caller holds the lock); PROMOTED promotes the candidate first."""
    plan = {**plan, "state": state, "ended": _stamp(now), "reason": reason, "breach": breach_,
            "current": None}
    if state == PROMOTED:
        promote(model_dir, plan["candidate"], "promote", f"rollout {plan['id']}: {reason}")
    _write(model_dir, plan)
    return plan


def _moved(model_dir: Path, plan: dict) -> str:
    """Why PLAN's candidate may not be promoted now ('' when it may): the promotion is no
    longer the version the rollout started from (a rollback, an export promoted another
    since), or it cannot be read. Under the lock."""
    try:
        now = read_promotion(model_dir)
    except ValueError as error:
        return str(error)
    if now["version"] == plan["promoted"]:
        return ""
    last = now["history"][-1] if now["history"] else {}
    how = f" ({last.get('action')} at {last.get('time')})" if last else ""
    return (f"the promotion moved from version {plan['promoted']} to {now['version']}{how} "
            f"since the rollout started")


def control(model_dir: str | Path, reports: Sequence[dict],
            now: dt.datetime | None = None) -> dict | None:
    """One step of the controller: combine REPORTS (the replicas'), decide, and write the
    plan when the stage advances, the candidate is promoted, or a threshold breaks. The
    plan as it is now (None: no rollout). The current stage's analysis so far is the
    plan's "current" (written when it changed)."""
    model_dir = Path(model_dir)
    now = now or _now()
    with records.locked(model_dir):
        plan = read_plan(model_dir)
        if plan is None or plan["state"] != RUNNING:
            return plan
        action, analysis = decide(plan, combine(plan, reports), now)
        if action == "wait":  # the analysis so far, for `orthornn rollout status`
            current = _stage_record(plan, analysis, "running", now)
            before = plan.get("current") or {}
            plan["current"] = current
            if {k: v for k, v in before.items() if k != "ended"} != \
                    {k: v for k, v in current.items() if k != "ended"}:
                _write(model_dir, plan)
            return plan
        if action == "rollback":
            broken = analysis.pop("breach")
            plan["analysis"] = [*plan["analysis"],
                                _stage_record(plan, analysis, "breached", now)]
            stage = plan["stages"][plan["stage"]]
            where = "in shadow" if stage == SHADOW else f"at {stage}%"
            return _finish(model_dir, plan, ROLLED_BACK, f"{where}: {broken['message']}",
                           now, broken)
        plan["analysis"] = [*plan["analysis"], _stage_record(plan, analysis, "passed", now)]
        if plan["stage"] + 1 == len(plan["stages"]):
            moved = _moved(model_dir, plan)
            if moved:  # never over another writer's promotion (a person's rollback)
                return _finish(model_dir, plan, ABORTED, f"not promoted: {moved}", now)
            done = ", ".join(f"{s}%" if s != SHADOW else s for s in plan["stages"])
            return _finish(model_dir, plan, PROMOTED, f"passed {done}", now)
        plan = {**plan, "stage": plan["stage"] + 1, "stage_started": _stamp(now),
                "current": None}
        _write(model_dir, plan)
        return plan


def end_by_hand(model_dir: str | Path, action: str) -> dict:
    """``orthornn rollout promote`` (the candidate now) or ``abort`` (the promoted version
    stays); RolloutError when no rollout is running."""
    model_dir = Path(model_dir)
    now = _now()
    with records.locked(model_dir):
        try:
            plan = read_plan(model_dir)
        except ValueError as error:
            raise RolloutError(str(error), 409) from None
        if plan is None or plan["state"] != RUNNING:
            raise RolloutError(f"no rollout is running for {model_dir.name!r}"
                               + (f" (the last one: {plan['state']})" if plan else ""), 409)
        stage = plan["stages"][plan["stage"]]
        where = "in shadow" if stage == SHADOW else f"at {stage}%"
        if action == "promote":
            moved = _moved(model_dir, plan)
            if moved:
                raise RolloutError(f"version {plan['candidate']} is not promoted: {moved}; "
                                   f"`orthornn rollout abort` this rollout and start another",
                                   409)
            return _finish(model_dir, plan, PROMOTED, f"promoted by hand {where}", now)
        return _finish(model_dir, plan, ABORTED, f"aborted by hand {where}", now)


def rolled_back(plan: dict | None) -> dict[int, dict]:
    """The candidates whose rollout was rolled back, in PLAN (a model's rollout.json) or
    the rollouts before it, with its summary (``orthornn versions``)."""
    if plan is None:
        return {}
    return {p["candidate"]: p for p in [*plan.get("past", []), plan]
            if p.get("state") == ROLLED_BACK}
