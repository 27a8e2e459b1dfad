"""State carried across requests: client-held state tokens and server-side sessions.

A recurrent model's answer to a chunk of a sequence depends on the chunks before it only
through the hidden state after them. The service hands that state out (``return_state``)
as an opaque JSON value that names the model version that made it, and continues from it
(``states``); any replica serving that version can answer the next chunk. A state from
another model or version, of the wrong size or with non-finite numbers is refused: a
state is never applied to weights it was not made by.

Sessions keep the state in the service instead (``session``: ID). A session is pinned to
the version it started on: it holds that version (the registry keeps it loaded across hot
swaps) until it ends, or idles out, and requests on one session are applied one at a time
in arrival order (an asyncio lock, whose waiters are woken first come, first served).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .errors import ClientError, Conflict, NotFound, Overloaded

if TYPE_CHECKING:
    from .registry import ModelVersion


class StateConflict(Conflict):
    """A state or session of another model version (409)."""


def encode_state(name: str, version: int, state: np.ndarray) -> dict:
    """The opaque state value of one sequence: {"model", "version", "data": base64 of the
    float32 little-endian state vector}."""
    data = np.ascontiguousarray(state, dtype="<f4").tobytes()
    return {"model": name, "version": version, "data": base64.b64encode(data).decode()}


def json_type(value) -> str:
    """The JSON type of a parsed value, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def check_state(value, where: str) -> None:
    """ClientError (400) naming the field when VALUE is not shaped like a state a response
    returned: an object with exactly model, version (an integer) and data (a string)."""
    if not isinstance(value, dict) or set(value) != {"model", "version", "data"}:
        raise ClientError(f"{where}: must be a state exactly as a response returned it "
                          f"(an object with model, version and data)")
    version = value["version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise ClientError(f"{where}.version must be an integer (the version that made the "
                          f"state); got {json_type(version)}")
    if not isinstance(value["data"], str):
        raise ClientError(f"{where}.data must be a string (the base64 state an earlier answer "
                          f"returned); got {json_type(value['data'])}")


def state_version(states: list, model: str, field_name: str = "states") -> int | None:
    """The version every state of a request for MODEL names (None for no states), checked
    before any version is looked up: ClientError (400) when a state is malformed,
    StateConflict (409) when one belongs to another model (whatever versions are loaded
    here) or the states disagree on the version."""
    versions = set()
    for i, s in enumerate(states):
        where = f"{field_name}[{i}]"
        check_state(s, where)
        if s["model"] != model:
            raise StateConflict(f"{where}: a state of model {s['model']!r} (version "
                                f"{s['version']}) cannot continue on model {model!r}: a "
                                f"state only continues the model version that made it")
        versions.add(s["version"])
    if len(versions) > 1:
        raise StateConflict(f"{field_name}: the states come from different versions "
                            f"{sorted(versions)}; one request continues one version")
    return versions.pop() if versions else None


def decode_state(value, name: str, version: int, size: int, where: str) -> np.ndarray:
    """A state vector [size] from an opaque state value, checked against the model version
    about to continue from it."""
    check_state(value, where)
    if value["model"] != name or value["version"] != version:
        raise StateConflict(f"{where}: a state of model {value['model']!r} version "
                            f"{value['version']!r} cannot continue on model {name!r} version "
                            f"{version}: a state only continues the version that made it")
    try:
        raw = base64.b64decode(value["data"].encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ClientError(f"{where}.data: not valid base64") from None
    if len(raw) != 4 * size:
        raise ClientError(f"{where}.data: the state of this model has {size} numbers; "
                          f"got {len(raw) / 4:g}")
    state = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(state).all():
        raise ClientError(f"{where}.data: the state holds non-finite numbers (NaN or inf)")
    return state


# -- server-side sessions -----------------------------------------------------------------

class SessionLimit(Overloaded):
    """Too many open sessions (429)."""


class UnknownSession(NotFound):
    """A session that is not open (404)."""


@dataclass(eq=False)
class Session:
    id: str
    model: str
    mv: ModelVersion  # held while the session lives
    state: np.ndarray | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False


class Sessions:
    """The open sessions of a service. ``hold(mv)`` / ``release(mv)`` pin a model version
    (the registry's session hold); ``metrics`` counts starts, ends and expiries."""

    def __init__(self, *, max_sessions: int, idle_timeout_s: float, hold, release,
                 metrics=None):
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._hold, self._release = hold, release
        self.metrics = metrics
        self._open: dict[str, Session] = {}
        self._sweeper: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._open)

    def start(self, session_id: str, model: str, version: int | None) -> Session:
        """Open a session on a model's version (default: the promoted, else the newest)."""
        if session_id in self._open:
            raise Conflict(f"session {session_id!r} is already open; end it first or use "
                           f"another id")
        if len(self._open) >= self.max_sessions:
            raise SessionLimit(f"session {session_id!r}: the service holds the maximum of "
                               f"{self.max_sessions} open sessions; retry later")
        mv = self._hold(model, version)
        session = self._open[session_id] = Session(session_id, model, mv)
        self._count("session_starts", model)
        self._gauge()
        return session

    def get(self, session_id: str, model: str) -> Session:
        session = self._open.get(session_id)
        if session is None:
            raise UnknownSession(f"session {session_id!r} is not open (never started, "
                                 f"ended, or idle for over {self.idle_timeout_s:g} s); start "
                                 f"it with \"start\": true")
        if session.model != model:
            raise ClientError(f"session {session_id!r} belongs to model {session.model!r}, "
                              f"not {model!r}")
        return session

    def end(self, session: Session, reason: str = "session_ends") -> None:
        if session.closed:
            return
        session.closed = True
        if self._open.get(session.id) is session:
            del self._open[session.id]
        self._release(session.mv)
        self._count(reason, session.model)
        self._gauge()

    def expire(self, now: float | None = None) -> int:
        """End the sessions idle for longer than the timeout (not those in a request)."""
        now = time.monotonic() if now is None else now
        idle = [s for s in self._open.values()
                if now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
        for session in idle:
            self.end(session, "session_expiries")
        return len(idle)

    def start_sweeper(self) -> None:
        async def sweep():
            while True:
                await asyncio.sleep(min(1.0, self.idle_timeout_s / 4))
                self.expire()
        self._sweeper = asyncio.get_running_loop().create_task(sweep())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for session in list(self._open.values()):
            self.end(session, "session_ends")

    def _count(self, name: str, model: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).labels(model).inc()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.sessions_active.set(len(self._open))
