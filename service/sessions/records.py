"""A session's record, and the pieces both stores share (``memory``, ``redis``): in a
module of their own, so that neither store imports ``store`` (which opens either)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PositionConflict, SessionExists, SessionLimit, UnknownSession

if TYPE_CHECKING:
    from ..metrics import Metrics


@dataclass(frozen=True, eq=False)
class SessionRecord:
    """One session as the store holds it. ``state`` is None before the first chunk;
    ``previous_state``/``previous_position`` are the state and position before the last
    applied chunk (``previous_position`` None before the first chunk, ``previous_state``
    None when that chunk started from the initial state). ``last_used``: seconds since the
    epoch of the last create or advance. ``ended``: ``finish`` ended it (readable until its
    idle timeout, open no more). ``stamp``: changes with every write (see ``advance``).
    ``secret``: the SHA-256 (hex) of the secret its start gave out (``owners``; None for a
    session started without one, ``session_secrets`` off)."""

    id: str
    model: str
    version: int
    state: np.ndarray | None
    position: int
    previous_state: np.ndarray | None
    previous_position: int | None
    last_used: float
    ended: bool = False
    stamp: str | None = None
    secret: str | None = None


class StaleRecord(Exception):
    """``advance``/``finish`` given a record's stamp: the session was written since that
    record (another replica advanced it, or it ended and started again). Never an answer:
    the caller reads the session again."""


# -- shared by the stores: their messages, their metrics --------------------------------

def check_counts(expected_position: int, steps: int) -> None:
    for name, value in (("expected_position", expected_position), ("steps", steps)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0; got {value!r}")


def unknown(sid: str, idle_timeout_s: float) -> UnknownSession:
    return UnknownSession(f"session {sid!r} is not open (never started, ended, or idle for "
                          f"over {idle_timeout_s:g} s); start it with \"start\": true")


def exists(sid: str) -> SessionExists:
    return SessionExists(f"session {sid!r} is already open; end it first or use another id")


def limit(sid: str, max_sessions: int) -> SessionLimit:
    return SessionLimit(f"session {sid!r}: the service holds the maximum of {max_sessions} "
                        f"open sessions (all replicas); retry later")


def position_conflict(sid: str, expected: int, position: int) -> PositionConflict:
    return PositionConflict(
        f"session {sid!r} is at position {position}, not {expected}: another chunk was "
        f"applied first (or this one already was); continue from position {position}",
        position)


class Timed:
    """Latency and error metrics by operation (``orthornn_session_store_*``)."""

    kind = "memory"
    metrics: Metrics | None = None

    @contextlib.contextmanager
    def _timed(self, operation: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.metrics is not None:
                self.metrics.session_store_duration.labels(self.kind, operation).observe(
                    time.perf_counter() - start)

    def _failed(self, operation: str) -> None:
        if self.metrics is not None:
            self.metrics.session_store_errors.labels(self.kind, operation).inc()
