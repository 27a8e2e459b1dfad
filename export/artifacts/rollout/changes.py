"""What each change of a rollout's records decides, as pure functions of the records read
(a folder's writer calls them under the lock, a bucket's inside a conditional write): one
controller step, a rollout's end, the controller's lease."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from .analysis import combine, decide
from .plan import SHADOW, Phase, Plan

ROLLOUT = "rollout.json"
#: who controls a model's running rollout, until when (``take_lease``)
LEASE = ".rollout-controller.json"


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def stamp(t: dt.datetime) -> str:
    return t.isoformat(timespec="milliseconds")


def stage_record(plan: Plan, analysis: dict, outcome: str, now: dt.datetime) -> dict:
    return {"stage": plan.stage_name, "started": plan.stage_started, "ended": stamp(now),
            "outcome": outcome, **analysis}


def end(plan: Plan, state: Phase, reason: str, now: dt.datetime,
        broken: dict | None = None) -> Plan:
    """PLAN ended in STATE (the promotion, for PROMOTED, written by the caller)."""
    plan.state, plan.ended, plan.reason, plan.breach, plan.current, plan.finishing = \
        state, stamp(now), reason, broken, None, None
    return plan


def promotion_reason(plan: Plan, reason: str) -> str:
    """The promotion history's reason for a rollout's promotion (how a bucket's writer
    finds that it was written already)."""
    return f"rollout {plan.id}: {reason}"


def moved(record: dict, plan: Plan) -> str:
    """Why PLAN's candidate may not be promoted over RECORD (the promotion as it is now;
    '' when it may): it is no longer the version the rollout started from (a rollback, an
    export promoted another since)."""
    if record["version"] == plan.promoted:
        return ""
    last = record["history"][-1] if record["history"] else {}
    how = f" ({last.get('action')} at {last.get('time')})" if last else ""
    return (f"the promotion moved from version {plan.promoted} to {record['version']}{how} "
            f"since the rollout started")


def advance(plan: Plan, reports: Sequence[dict], now: dt.datetime) -> bool:
    """One step of a running PLAN from REPORTS, in place; whether it changed (to be
    written). A plan that passed its last stage comes back running with ``finishing``
    set: the caller promotes the candidate (unless the promotion moved) and ends it."""
    action, analysis = decide(plan, combine(plan, reports), now)
    if action == "wait":  # the analysis so far, for `orthornn rollout status`
        current = stage_record(plan, analysis, "running", now)
        before = plan.current or {}
        plan.current = current
        return {k: v for k, v in before.items() if k != "ended"} != \
            {k: v for k, v in current.items() if k != "ended"}
    if action == "rollback":
        broken = analysis.pop("breach")
        plan.analysis = [*plan.analysis, stage_record(plan, analysis, "breached", now)]
        end(plan, Phase.ROLLED_BACK, f"{plan.where()}: {broken['message']}", now, broken)
        return True
    plan.analysis = [*plan.analysis, stage_record(plan, analysis, "passed", now)]
    if plan.stage + 1 == len(plan.stages):
        done = ", ".join(f"{s}%" if s != SHADOW else str(s) for s in plan.stages)
        plan.current, plan.finishing = None, {"reason": f"passed {done}", "by_hand": False}
        return True
    plan.stage, plan.stage_started, plan.current = plan.stage + 1, stamp(now), None
    return True


def lease_change(data: bytes | None, owner: str, ttl_s: float, now: dt.datetime
                 ) -> dict | bool | None:
    """The controller's lease as read (DATA; None: none) -> False when another owner
    holds it unexpired, None when it is OWNER's with more than half its term left (not
    rewritten at every step), else the lease to write: OWNER's for TTL_S from NOW."""
    try:
        lease = json.loads(data or b"")
        holder, until = lease["owner"], dt.datetime.fromisoformat(lease["until"])
    except (ValueError, KeyError, TypeError):
        holder, until = None, now  # none, or unreadable: free
    if holder not in (None, owner) and until > now:
        return False
    if holder == owner and until - now > dt.timedelta(seconds=ttl_s / 2):
        return None
    return {"owner": owner, "until": stamp(now + dt.timedelta(seconds=ttl_s))}
