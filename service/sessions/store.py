"""Where server-side sessions live: one typed interface (``SessionStore``), two stores
(the reasoning: docs/design.md, "The session stores")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..addresses import check_store_url
from .records import SessionRecord, StaleRecord

__all__ = ["SessionRecord", "SessionStore", "StaleRecord", "open_store"]

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..settings import Settings


class SessionStore(Protocol):
    """The interface both stores implement; every method may raise ``StoreUnavailable``
    (503) when the store cannot be reached in time."""

    kind: str  # "memory" or "redis"
    #: reads cost a round trip (another process): worth not repeating
    remote: bool
    max_sessions: int
    #: ended records kept at most (the oldest ended are dropped first)
    max_ended: int
    idle_timeout_s: float

    async def create(self, sid: str, model: str, version: int,
                     secret: str | None = None) -> SessionRecord:
        """Open a session at position 0 with no state (replacing an ended record of SID),
        owned by SECRET (the digest of its secret, ``owners.digest``; kept in the record).
        SessionExists (409) when SID is open, SessionLimit (429) when the store holds
        max_sessions live sessions."""
        ...

    async def get(self, sid: str) -> SessionRecord:
        """The record, an ended one too (``ended``) until its idle timeout; UnknownSession
        (404) when there is none (never started, deleted or expired). Does not renew the
        idle expiry."""
        ...

    async def advance(self, sid: str, expected_position: int, state: np.ndarray,
                      steps: int, stamp: str | None = None) -> SessionRecord:
        """Compare-and-set: when the session is at EXPECTED_POSITION, previous_* := the
        current state and position, state := STATE, position += STEPS, idle expiry
        renewed; the new record. Otherwise PositionConflict (409) carrying the current
        position; UnknownSession (404) when not open (an ended session included). With
        STAMP (a record's ``stamp``), StaleRecord unless the session is still that record."""
        ...

    async def finish(self, sid: str, expected_position: int, state: np.ndarray,
                     steps: int, stamp: str | None = None) -> SessionRecord:
        """``advance``, and the session ends: the record (``ended``) stays readable by
        ``get`` until its idle timeout, but counts no more, pins no version, and SID may
        be created again."""
        ...

    async def delete(self, sid: str) -> bool:
        """End a session (an ended record goes too); whether it was open."""
        ...

    async def count(self) -> int:
        """Live sessions (all replicas sharing the store)."""
        ...

    async def versions_in_use(self) -> dict[str, set[int]]:
        """model -> versions pinned by live sessions."""
        ...

    async def ping(self) -> None:
        """StoreUnavailable unless the store answers."""
        ...

    async def close(self) -> None:
        ...


def open_store(settings: Settings, metrics: Metrics | None = None) -> SessionStore:
    """The store SETTINGS.session_store names (ValueError naming the field when it is
    neither "memory" nor a Redis URL)."""
    from .memory import MemoryStore
    from .redis import RedisStore

    value = settings.session_store
    if check_store_url(value) is None:
        return MemoryStore(max_sessions=settings.max_sessions,
                           max_ended=settings.max_ended_sessions,
                           idle_timeout_s=settings.session_idle_timeout_s, metrics=metrics)
    return RedisStore(value, prefix=settings.session_key_prefix,
                      max_sessions=settings.max_sessions,
                      max_ended=settings.max_ended_sessions,
                      idle_timeout_s=settings.session_idle_timeout_s,
                      timeout_s=settings.session_store_timeout_s, metrics=metrics)
