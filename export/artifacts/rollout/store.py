"""A rollout's plan in the repository: REPO/<name>/rollout.json, beside promotion.json.
Starting a rollout, one controller step (``step``), ending it by hand, and the
controller's lease. What each decides is a pure function of the records as read
(``changes``: ``advance``, ``end``, ``lease_change``); a folder writes under the model's one
lock, replaced crash-safe (``records``), a bucket by conditional writes
(``bucket_records``)."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Sequence
from pathlib import Path

from orthornn.export.artifacts import records
from orthornn.export.artifacts.numbers import is_integer
from orthornn.export.artifacts.repository import (
    Location,
    last_name,
    live_version,
    local_model,
    promote,
    read_promotion,
    versions,
)
from orthornn.export.artifacts.storage import is_object_uri, open_store

from . import bucket_records
from .changes import (
    LEASE,
    ROLLOUT,
    advance,
    end,
    lease_change,
    moved,
    promotion_reason,
    stamp,
    utc_now,
)
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


def read_plan(model_dir: Location) -> Plan | None:
    """The rollout of model_dir (running or finished), or None; ValueError when the file
    cannot be read."""
    if is_object_uri(str(model_dir)):
        return bucket_records.read_plan(open_store(str(model_dir)))
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


def start(model_dir: Location, candidate: int, *, shadow: float = 0.1,
          steps: str | Sequence[int] = DEFAULT_STEPS, interval_s: float = 60.0,
          min_requests: int = 100, thresholds: Thresholds | None = None) -> Plan:
    """Write a new running plan for CANDIDATE (verified, passed the gate, not the promoted
    version); RolloutError (nothing written) otherwise."""
    from orthornn.export.artifacts.package import (  # onnxruntime: only when it runs
        PackageError,
        verify_package,
    )

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
    with local_model(model_dir, lambda v: v == candidate) as folder:
        why = gate_refusal(folder, candidate)
        if why:
            raise RolloutError(f"candidate: {why}", 409, "candidate")
        try:
            verify_package(folder / str(candidate))
        except PackageError as error:
            raise RolloutError(f"candidate: version {candidate} does not verify: {error}",
                               409, "candidate") from None

    def new_plan(current: Plan | None) -> Plan:
        """The running plan, from the promotion and the plan as they are now."""
        promoted_version = _base(model_dir, on_disk, candidate)
        if current is not None and current.running:
            raise RolloutError(f"a rollout of version {current.candidate} is already "
                               f"running for {name!r}; abort or promote it first", 409)
        now = stamp(utc_now())
        past = [] if current is None else [*current.past, current.summary()]
        return Plan(id=uuid.uuid4().hex[:12], model=name, candidate=candidate,
                    promoted=promoted_version, state=Phase.RUNNING,
                    stages=([SHADOW] if shadow > 0 else []) + stages, stage=0,
                    stage_started=now, started=now, shadow=shadow,
                    interval_s=float(interval_s), min_requests=min_requests,
                    thresholds=thresholds, past=past)

    name = last_name(model_dir)
    if is_object_uri(str(model_dir)):
        return bucket_records.replace_plan(open_store(str(model_dir)), new_plan)
    model_dir = Path(model_dir)
    with records.locked(model_dir):
        try:
            current = read_plan(model_dir)
        except ValueError:
            current = None  # an unreadable plan is replaced
        plan = new_plan(current)
        _write(model_dir, plan)
    return plan


def _base(model_dir: Location, on_disk: list[int], candidate: int) -> int:
    """The promoted version a rollout of CANDIDATE starts from; RolloutError when none."""
    try:
        promoted_version = read_promotion(model_dir)["version"]
    except ValueError as error:
        raise RolloutError(str(error), 409) from None
    live = live_version(on_disk, promoted_version)
    if promoted_version is None or live != promoted_version:
        raise RolloutError(f"candidate: model {last_name(model_dir)!r} has no promoted version to "
                           f"compare with; promote one first (orthornn export --gate)", 409,
                           "candidate")
    if candidate == promoted_version:
        raise RolloutError(f"candidate: version {candidate} is already promoted", 409,
                           "candidate")
    return promoted_version


def _moved_folder(model_dir: Path, plan: Plan) -> str:
    """Why PLAN's candidate may not be promoted over the promotion as it is now ('' when
    it may; its unreadable record is a reason too). Under the lock."""
    try:
        return moved(read_promotion(model_dir), plan)
    except ValueError as error:
        return str(error)


def _promote_folder(model_dir: Path, plan: Plan, now: dt.datetime, why: str) -> Plan:
    """PLAN's ``finishing`` done under the lock: the candidate promoted, or the rollout
    aborted when the promotion moved since it started (WHY, ``_moved_folder``: never over
    another writer's promotion, a person's rollback); then the plan written."""
    reason = (plan.finishing or {})["reason"]
    if why:
        end(plan, Phase.ABORTED, f"not promoted: {why}", now)
    else:
        promote(model_dir, plan.candidate, "promote", promotion_reason(plan, reason))
        end(plan, Phase.PROMOTED, reason, now)
    _write(model_dir, plan)
    return plan


def step(model_dir: Location, reports: Sequence[dict],
         now: dt.datetime | None = None) -> Plan | None:
    """One controller step: combine REPORTS (the replicas'), decide, and write the plan
    when the stage advances, the candidate is promoted, or a threshold breaks. The plan as
    it is now (None: no rollout). The current stage's analysis so far is the plan's
    ``current`` (written when it changed)."""
    now = now or utc_now()
    if is_object_uri(str(model_dir)):
        return bucket_records.step(open_store(str(model_dir)),
                                   lambda plan: advance(plan, reports, now), now)
    model_dir = Path(model_dir)
    with records.locked(model_dir):
        plan = read_plan(model_dir)
        if plan is None or not plan.running:
            return plan
        if not advance(plan, reports, now):
            return plan
        if plan.finishing:
            return _promote_folder(model_dir, plan, now, _moved_folder(model_dir, plan))
        _write(model_dir, plan)
        return plan


def end_by_hand(model_dir: Location, action: str) -> Plan:
    """Promote the candidate now (ACTION "promote") or stop the rollout ("abort": the
    promoted version stays); RolloutError when no rollout is running."""
    now = utc_now()
    name = last_name(model_dir)

    def ended(plan: Plan | None) -> Plan:
        """PLAN ended by hand (a promotion as ``finishing``); RolloutError if not running."""
        if plan is None or not plan.running:
            raise RolloutError(f"no rollout is running for {name!r}"
                               + (f" (the last one: {plan.state})" if plan else ""), 409)
        if action == "promote":
            plan.finishing = {"reason": f"promoted by hand {plan.where()}", "by_hand": True}
            return plan
        return end(plan, Phase.ABORTED, f"aborted by hand {plan.where()}", now)

    if is_object_uri(str(model_dir)):
        return bucket_records.end_by_hand(open_store(str(model_dir)), ended, now)
    model_dir = Path(model_dir)
    with records.locked(model_dir):
        try:
            plan = ended(read_plan(model_dir))
        except ValueError as error:
            raise RolloutError(str(error), 409) from None
        if plan.finishing:
            why = _moved_folder(model_dir, plan)
            if why:
                raise RolloutError(f"version {plan.candidate} is not promoted: {why}; "
                                   f"abort this rollout and start another", 409)
            return _promote_folder(model_dir, plan, now, why)
        _write(model_dir, plan)
        return plan


def take_lease(model_dir: Location, owner: str, ttl_s: float,
               now: dt.datetime | None = None) -> bool:
    """Whether OWNER controls model_dir's rollouts for the next TTL_S seconds: the lease
    is free, expired or already OWNER's (then renewed). Two controllers (two writable
    replicas, or one and ``orthornn rollout run``) never both step one rollout."""
    now = now or utc_now()
    if is_object_uri(str(model_dir)):
        return bucket_records.take_lease(open_store(str(model_dir)),
                                         lambda data: lease_change(data, owner, ttl_s, now))
    path = Path(model_dir) / LEASE
    with records.locked(model_dir):
        try:
            data: bytes | None = path.read_bytes()
        except OSError:
            data = None
        lease = lease_change(data, owner, ttl_s, now)
        if isinstance(lease, dict):
            records.replace_json(path, lease)
    return lease is not False


def rolled_back(plan: Plan | None) -> dict[int, dict]:
    """The candidates whose rollout was rolled back, in PLAN (a model's rollout.json) or
    the rollouts before it, with its summary (``orthornn versions``)."""
    if plan is None:
        return {}
    return {p["candidate"]: p for p in [*plan.past, plan.summary()]
            if p.get("state") == Phase.ROLLED_BACK}
