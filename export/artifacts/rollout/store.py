"""A rollout's plan in the repository: REPO/<name>/rollout.json, beside promotion.json,
both written under the model's one lock and replaced crash-safe (``records``). Starting a
rollout, one controller step (``step``), ending it by hand, and the controller's lease."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from pathlib import Path

from orthornn.export.artifacts import records
from orthornn.export.artifacts.numbers import is_integer
from orthornn.export.artifacts.repository import live_version, promote, read_promotion, versions

from .analysis import combine, decide
from .plan import (
    DEFAULT_STEPS,
    SHADOW,
    Phase,
    Plan,
    RolloutError,
    Thresholds,
    check_number,
    parse_steps,
)

ROLLOUT = "rollout.json"
#: who controls a model's running rollout, until when (``take_lease``)
LEASE = ".rollout-controller.json"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _stamp(t: dt.datetime) -> str:
    return t.isoformat(timespec="milliseconds")


def read_plan(model_dir: str | Path) -> Plan | None:
    """The rollout of model_dir (running or finished), or None; ValueError when the file
    cannot be read."""
    path = Path(model_dir) / ROLLOUT
    try:
        return Plan.from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"{str(path)!r} cannot be read: {error}") from None


def _write(model_dir: Path, plan: Plan) -> None:
    """Replace rollout.json crash-safe; the caller holds the model's lock."""
    assert records.holds(model_dir), "rollout.json is written under the model's lock"
    records.replace_json(model_dir / ROLLOUT, plan.to_dict())


def gate_refusal(model_dir: Path, version: int) -> str | None:
    """Why VERSION may not be rolled out, or None when it passed the gate (its manifest
    records a passed gate, or the promotion history a gated promotion of it)."""
    try:
        manifest = json.loads((model_dir / str(version) / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        return f"its manifest cannot be read ({error})"
    gate = (manifest.get("evaluation") or {}).get("gate") or {}
    if gate.get("passed") is True:
        return None
    history = read_promotion(model_dir)["history"]
    if any(e.get("version") == version and e.get("action") == "promote" for e in history):
        return None
    return (f"version {version} was published without --gate; publish the run again with "
            f"`orthornn export --gate --rollout` (or --gate --no-promote)")


def start(model_dir: str | Path, candidate: int, *, shadow: float = 0.1,
          steps: str | Sequence[int] = DEFAULT_STEPS, interval_s: float = 60.0,
          min_requests: int = 100, thresholds: Thresholds | None = None) -> Plan:
    """Write a new running plan for CANDIDATE (verified, passed the gate, not the promoted
    version); RolloutError (nothing written) otherwise."""
    from orthornn.export.artifacts.package import (  # onnxruntime: only when it runs
        PackageError,
        verify_package,
    )

    model_dir = Path(model_dir)
    thresholds = thresholds or Thresholds()
    stages = parse_steps(steps)
    check_number("shadow", shadow, 0.0, 1.0)
    check_number("interval_s", interval_s, 0.001, 7 * 86400.0)
    if not is_integer(min_requests) or not 1 <= min_requests <= 10**9:
        raise RolloutError(f"min_requests must be an integer >= 1; got {min_requests!r}",
                           field="min_requests")
    on_disk = versions(model_dir)
    if not is_integer(candidate) or candidate not in on_disk:
        raise RolloutError(f"candidate: version {candidate!r} is not in {str(model_dir)!r} "
                           f"(versions: {on_disk or 'none'})", 404, "candidate")
    _base(model_dir, on_disk, candidate)  # refused early, before the slow checks
    why = gate_refusal(model_dir, candidate)
    if why:
        raise RolloutError(f"candidate: {why}", 409, "candidate")
    try:
        verify_package(model_dir / str(candidate))
    except PackageError as error:
        raise RolloutError(f"candidate: version {candidate} does not verify: {error}",
                           409, "candidate") from None
    with records.locked(model_dir):  # the promotion and the plan as they are now
        promoted_version = _base(model_dir, on_disk, candidate)
        try:
            current = read_plan(model_dir)
        except ValueError:
            current = None  # an unreadable plan is replaced
        if current is not None and current.running:
            raise RolloutError(f"a rollout of version {current.candidate} is already "
                               f"running for {model_dir.name!r}; abort or promote it first",
                               409)
        now = _stamp(_now())
        past = [] if current is None else [*current.past, current.summary()]
        plan = Plan(id=uuid.uuid4().hex[:12], model=model_dir.name, candidate=candidate,
                    promoted=promoted_version, state=Phase.RUNNING,
                    stages=([SHADOW] if shadow > 0 else []) + stages, stage=0,
                    stage_started=now, started=now, shadow=shadow,
                    interval_s=float(interval_s), min_requests=min_requests,
                    thresholds=thresholds, past=past)
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
        raise RolloutError(f"candidate: model {model_dir.name!r} has no promoted version to "
                           f"compare with; promote one first (orthornn export --gate)", 409,
                           "candidate")
    if candidate == promoted_version:
        raise RolloutError(f"candidate: version {candidate} is already promoted", 409,
                           "candidate")
    return promoted_version


def _stage_record(plan: Plan, analysis: dict, outcome: str, now: dt.datetime) -> dict:
    return {"stage": plan.stage_name, "started": plan.stage_started, "ended": _stamp(now),
            "outcome": outcome, **analysis}


def _finish(model_dir: Path, plan: Plan, state: Phase, reason: str, now: dt.datetime,
            broken: dict | None = None) -> Plan:
    """End PLAN (the caller holds the lock); PROMOTED promotes the candidate first."""
    plan.state, plan.ended, plan.reason, plan.breach, plan.current = \
        state, _stamp(now), reason, broken, None
    if state == Phase.PROMOTED:
        promote(model_dir, plan.candidate, "promote", f"rollout {plan.id}: {reason}")
    _write(model_dir, plan)
    return plan


def _moved(model_dir: Path, plan: Plan) -> str:
    """Why PLAN's candidate may not be promoted now ('' when it may): the promotion is no
    longer the version the rollout started from (a rollback, an export promoted another
    since), or it cannot be read. Under the lock."""
    try:
        now = read_promotion(model_dir)
    except ValueError as error:
        return str(error)
    if now["version"] == plan.promoted:
        return ""
    last = now["history"][-1] if now["history"] else {}
    how = f" ({last.get('action')} at {last.get('time')})" if last else ""
    return (f"the promotion moved from version {plan.promoted} to {now['version']}{how} "
            f"since the rollout started")


def step(model_dir: str | Path, reports: Sequence[dict],
         now: dt.datetime | None = None) -> Plan | None:
    """One controller step: combine REPORTS (the replicas'), decide, and write the plan
    when the stage advances, the candidate is promoted, or a threshold breaks. The plan as
    it is now (None: no rollout). The current stage's analysis so far is the plan's
    ``current`` (written when it changed)."""
    model_dir = Path(model_dir)
    now = now or _now()
    with records.locked(model_dir):
        plan = read_plan(model_dir)
        if plan is None or not plan.running:
            return plan
        action, analysis = decide(plan, combine(plan, reports), now)
        if action == "wait":  # the analysis so far, for `orthornn rollout status`
            current = _stage_record(plan, analysis, "running", now)
            before = plan.current or {}
            plan.current = current
            if {k: v for k, v in before.items() if k != "ended"} != \
                    {k: v for k, v in current.items() if k != "ended"}:
                _write(model_dir, plan)
            return plan
        if action == "rollback":
            broken = analysis.pop("breach")
            plan.analysis = [*plan.analysis, _stage_record(plan, analysis, "breached", now)]
            return _finish(model_dir, plan, Phase.ROLLED_BACK,
                           f"{plan.where()}: {broken['message']}", now, broken)
        plan.analysis = [*plan.analysis, _stage_record(plan, analysis, "passed", now)]
        if plan.stage + 1 == len(plan.stages):
            moved = _moved(model_dir, plan)
            if moved:  # never over another writer's promotion (a person's rollback)
                return _finish(model_dir, plan, Phase.ABORTED, f"not promoted: {moved}", now)
            done = ", ".join(f"{s}%" if s != SHADOW else str(s) for s in plan.stages)
            return _finish(model_dir, plan, Phase.PROMOTED, f"passed {done}", now)
        plan.stage, plan.stage_started, plan.current = plan.stage + 1, _stamp(now), None
        _write(model_dir, plan)
        return plan


def end_by_hand(model_dir: str | Path, action: str) -> Plan:
    """Promote the candidate now (ACTION "promote") or stop the rollout ("abort": the
    promoted version stays); RolloutError when no rollout is running."""
    model_dir = Path(model_dir)
    now = _now()
    with records.locked(model_dir):
        try:
            plan = read_plan(model_dir)
        except ValueError as error:
            raise RolloutError(str(error), 409) from None
        if plan is None or not plan.running:
            raise RolloutError(f"no rollout is running for {model_dir.name!r}"
                               + (f" (the last one: {plan.state})" if plan else ""), 409)
        if action == "promote":
            moved = _moved(model_dir, plan)
            if moved:
                raise RolloutError(f"version {plan.candidate} is not promoted: {moved}; "
                                   f"abort this rollout and start another", 409)
            return _finish(model_dir, plan, Phase.PROMOTED, f"promoted by hand "
                           f"{plan.where()}", now)
        return _finish(model_dir, plan, Phase.ABORTED, f"aborted by hand {plan.where()}", now)


def take_lease(model_dir: str | Path, owner: str, ttl_s: float,
               now: dt.datetime | None = None) -> bool:
    """Whether OWNER controls model_dir's rollouts for the next TTL_S seconds: the lease
    is free, expired or already OWNER's (then renewed). Two controllers (two writable
    replicas, or one and ``orthornn rollout run``) never both step one rollout."""
    model_dir = Path(model_dir)
    now = now or _now()
    path = model_dir / LEASE
    with records.locked(model_dir):
        try:
            lease = json.loads(path.read_text())
            holder, until = lease["owner"], dt.datetime.fromisoformat(lease["until"])
        except (OSError, ValueError, KeyError, TypeError):
            holder, until = None, now  # none, or unreadable: free
        if holder not in (None, owner) and until > now:
            return False
        if holder == owner and until - now > dt.timedelta(seconds=ttl_s / 2):
            return True  # renewed at half its term: not a write and two fsyncs per step
        records.replace_json(path, {"owner": owner,
                                    "until": _stamp(now + dt.timedelta(seconds=ttl_s))})
    return True


def rolled_back(plan: Plan | None) -> dict[int, dict]:
    """The candidates whose rollout was rolled back, in PLAN (a model's rollout.json) or
    the rollouts before it, with its summary (``orthornn versions``)."""
    if plan is None:
        return {}
    return {p["candidate"]: p for p in [*plan.past, plan.summary()]
            if p.get("state") == Phase.ROLLED_BACK}
