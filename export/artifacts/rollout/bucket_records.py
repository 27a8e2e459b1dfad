"""A rollout's records in a bucket, where there is no lock: rollout.json, promotion.json
and the controller's lease are each replaced by read -> change -> write-if-unchanged
(``remote.update``), from the top again when another writer got there first; the
decisions are ``store``'s, the same as in a folder (docs/design.md, "Storage").

A rollout's end by promotion touches two objects, which no write can change at once. It
is written in three steps, each conditional: the plan gets ``finishing`` (the decision:
from then on no other writer can end it otherwise), the promotion is written unless it
moved since the rollout started (once: the history is searched for it first), and the
plan is ended. Whoever next reads a plan that is still ``finishing`` (a writer killed
between the steps) completes it first (``settle``): the same outcome as under a lock.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable

from orthornn.export.artifacts import remote
from orthornn.export.artifacts.repository import PROMOTION, promotion_of, with_entry
from orthornn.export.artifacts.storage import Store

from .changes import LEASE, ROLLOUT, end, moved, promotion_reason
from .plan import Phase, Plan, RolloutError


class _Finishing(Exception):
    """The plan read is ``finishing``: settle it, then change it again."""


class _Moved(Exception):
    """The promotion moved since the rollout started: the candidate is not promoted."""


def _plan(store: Store, data: bytes | None) -> Plan | None:
    if data is None:
        return None
    try:
        return Plan.from_dict(json.loads(data))
    except ValueError as error:
        raise ValueError(f"{store.uri}/{ROLLOUT} cannot be read: {error}") from None


def read_plan(store: Store) -> Plan | None:
    try:
        return _plan(store, store.read(ROLLOUT).data)
    except FileNotFoundError:
        return None


def _update(store: Store, change: Callable[[Plan | None], Plan | None], now: dt.datetime,
            unreadable_is_none: bool = False) -> Plan | None:
    """rollout.json replaced by CHANGE(the plan as read), unless CHANGE returns None (then
    nothing is written: the plan as read is returned); a ``finishing`` plan is settled
    first. UNREADABLE_IS_NONE: an unreadable plan reads as none (``start`` replaces it)."""
    seen: list[Plan | None] = []

    def on_bytes(data: bytes | None) -> dict | None:
        try:
            plan = _plan(store, data)
        except ValueError:
            if not unreadable_is_none:
                raise
            plan = None
        if plan is not None and plan.finishing:
            raise _Finishing
        seen[:] = [plan]
        new = change(plan)
        return None if new is None else new.to_dict()

    while True:
        try:
            written = remote.update(store, ROLLOUT, on_bytes)
        except _Finishing:
            settle(store, now)
            continue
        return seen[0] if written is None else Plan.from_dict(written)


def settle(store: Store, now: dt.datetime) -> Plan | None:
    """Complete a ``finishing`` plan (promote unless the promotion moved, then end it);
    the plan as it is then. A promotion by hand whose promotion moved is put back to
    running and refused (RolloutError), as in a folder."""
    plan = read_plan(store)
    if plan is None or not plan.finishing:
        return plan
    reason, by_hand = plan.finishing["reason"], plan.finishing.get("by_hand", False)
    note = promotion_reason(plan, reason)

    def promoting(data: bytes | None) -> dict | None:
        try:
            record = promotion_of(None if data is None else json.loads(data),
                                  f"{store.uri}/{PROMOTION}")
        except ValueError as error:
            raise _Moved(str(error)) from None
        if any(e.get("reason") == note and e.get("version") == plan.candidate
               for e in record["history"]):
            return None  # written already, by a writer that did not end the plan
        why = moved(record, plan)
        if why:
            raise _Moved(why)
        return with_entry(record, plan.candidate, "promote", note, now)

    try:
        remote.update(store, PROMOTION, promoting)
        state, why = Phase.PROMOTED, ""
    except _Moved as error:
        state, why = Phase.ABORTED, str(error)

    def ending(data: bytes | None) -> dict | None:
        current = _plan(store, data)
        if current is None or current.id != plan.id or not current.finishing:
            return None  # another reader settled it
        if why and by_hand:
            current.finishing = None  # still running: the person aborts it, or not
        elif why:
            end(current, state, f"not promoted: {why}", now)
        else:
            end(current, state, reason, now)
        return current.to_dict()

    remote.update(store, ROLLOUT, ending)
    if why and by_hand:
        raise RolloutError(f"version {plan.candidate} is not promoted: {why}; abort this "
                           f"rollout and start another", 409)
    return read_plan(store)


def replace_plan(store: Store, new_plan: Callable[[Plan | None], Plan]) -> Plan:
    """``start``: rollout.json replaced by NEW_PLAN(the plan as read; an unreadable one
    reads as none)."""
    plan = _update(store, new_plan, dt.datetime.now(dt.UTC), unreadable_is_none=True)
    assert plan is not None
    return plan


def step(store: Store, advance: Callable[[Plan], bool], now: dt.datetime) -> Plan | None:
    """One controller step: ADVANCE(the running plan) changes it in place and says whether
    to write it; a plan that passed its last stage is settled."""

    def stepped(plan: Plan | None) -> Plan | None:
        if plan is None or not plan.running:
            return None
        return plan if advance(plan) else None

    plan = _update(store, stepped, now)
    return settle(store, now) if plan is not None and plan.finishing else plan


def end_by_hand(store: Store, ended: Callable[[Plan | None], Plan], now: dt.datetime) -> Plan:
    """A promotion (``finishing``, then settled) or an abort by hand."""
    try:
        plan = _update(store, ended, now)
    except ValueError as error:
        raise RolloutError(str(error), 409) from None
    assert plan is not None
    if plan.finishing:
        settled = settle(store, now)
        assert settled is not None
        return settled
    return plan


def take_lease(store: Store, change: Callable[[bytes | None], dict | bool | None]) -> bool:
    """Whether the lease is the caller's: CHANGE (``store.lease_change``) of the lease as
    read, written if unchanged since (else decided again from the new one)."""
    held: list[bool] = []

    def on_bytes(data: bytes | None) -> dict | None:
        lease = change(data)
        held[:] = [lease is not False]
        return lease if isinstance(lease, dict) else None

    remote.update(store, LEASE, on_bytes)
    return held[0]
