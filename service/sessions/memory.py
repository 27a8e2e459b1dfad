"""Sessions in this process's memory (``session_store = "memory"``, the default): a session
belongs to the replica that started it."""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from .encoding import state_bytes, state_from_bytes
from .records import (
    SessionRecord,
    StaleRecord,
    Timed,
    check_counts,
    exists,
    limit,
    position_conflict,
    unknown,
)

if TYPE_CHECKING:
    from ..metrics import Metrics


class MemoryStore(Timed):
    """Sessions in this process's memory. Expiry is lazy: each call first drops the
    sessions idle for longer than the timeout (they are kept in order of last use, so only
    the expired ones are looked at). Every method runs without awaiting, so each is atomic
    on the event loop."""

    kind = "memory"
    remote = False  # a read costs nothing

    def __init__(self, *, max_sessions: int, idle_timeout_s: float,
                 max_ended: int = 10_000, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions = max_sessions
        self.max_ended = max_ended
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics
        self._clock = clock
        self._stamps = itertools.count()
        # id -> (record, expiry on the clock); oldest use first; open and ended records
        self._open: OrderedDict[str, tuple[SessionRecord, float]] = OrderedDict()
        self._ended: OrderedDict[str, tuple[SessionRecord, float]] = OrderedDict()

    def _prune(self) -> None:
        now = self._clock()
        for table in (self._open, self._ended):
            while table:
                sid, (record, expires) = next(iter(table.items()))
                if expires > now:
                    break
                del table[sid]
                if table is self._open and self.metrics is not None:
                    self.metrics.session_expiries.labels(record.model).inc()

    def _put(self, record: SessionRecord) -> SessionRecord:
        record = replace(record, stamp=str(next(self._stamps)))
        self._open.pop(record.id, None)
        self._ended.pop(record.id, None)
        table = self._ended if record.ended else self._open
        table[record.id] = (record, self._clock() + self.idle_timeout_s)
        while len(self._ended) > self.max_ended:  # the oldest ended first
            self._ended.popitem(last=False)
        return self._copy(record)

    @staticmethod
    def _copy(record: SessionRecord) -> SessionRecord:
        """A record whose arrays the caller may change without changing the store."""
        return replace(record,
                       state=None if record.state is None else record.state.copy(),
                       previous_state=None if record.previous_state is None
                       else record.previous_state.copy())

    def _record(self, sid: str, ended: bool = False) -> SessionRecord:
        """SID's open record (or its ended one, when ENDED); UnknownSession otherwise."""
        self._prune()
        found = self._open.get(sid) or (self._ended.get(sid) if ended else None)
        if found is None:
            raise unknown(sid, self.idle_timeout_s)
        return found[0]

    async def create(self, sid: str, model: str, version: int,
                     secret: str | None = None) -> SessionRecord:
        with self._timed("create"):
            self._prune()
            if sid in self._open:
                raise exists(sid)
            if len(self._open) >= self.max_sessions:
                raise limit(sid, self.max_sessions)
            self._ended.pop(sid, None)
            return self._put(SessionRecord(sid, model, int(version), None, 0, None, None,
                                           time.time(), secret=secret))

    async def get(self, sid: str) -> SessionRecord:
        with self._timed("get"):
            return self._copy(self._record(sid, ended=True))

    async def advance(self, sid: str, expected_position: int, state: np.ndarray,
                      steps: int, stamp: str | None = None) -> SessionRecord:
        return self._advance("advance", sid, expected_position, state, steps, stamp)

    async def finish(self, sid: str, expected_position: int, state: np.ndarray,
                     steps: int, stamp: str | None = None) -> SessionRecord:
        return self._advance("finish", sid, expected_position, state, steps, stamp,
                             ended=True)

    def _advance(self, operation: str, sid: str, expected_position: int, state: np.ndarray,
                 steps: int, stamp: str | None, ended: bool = False) -> SessionRecord:
        check_counts(expected_position, steps)
        new_state = state_from_bytes(state_bytes(state))
        with self._timed(operation):
            current = self._record(sid)
            if stamp is not None and stamp != current.stamp:
                raise StaleRecord(sid)
            if current.position != expected_position:
                raise position_conflict(sid, expected_position, current.position)
            return self._put(replace(
                current, state=new_state, position=current.position + int(steps),
                previous_state=current.state, previous_position=current.position,
                last_used=time.time(), ended=ended))

    async def delete(self, sid: str) -> bool:
        with self._timed("delete"):
            self._prune()
            self._ended.pop(sid, None)
            return self._open.pop(sid, None) is not None

    async def count(self) -> int:
        with self._timed("count"):
            self._prune()
            return len(self._open)

    async def versions_in_use(self) -> dict[str, set[int]]:
        with self._timed("versions_in_use"):
            self._prune()
            out: dict[str, set[int]] = {}
            for record, _ in self._open.values():
                out.setdefault(record.model, set()).add(record.version)
            return out

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._open.clear()
        self._ended.clear()
