"""State carried across requests: client-held state tokens and server-side sessions.

A recurrent model's answer to a chunk of a sequence depends on the chunks before it only
through the hidden state after them. The service hands that state out (``return_state``)
as an opaque JSON value that names the model version that made it, and continues from it
(``states``); any replica serving that version can answer the next chunk. A state from
another model or version, of the wrong size or with non-finite numbers is refused: a
state is never applied to weights it was not made by.

Sessions keep the state in the service instead (``session``: ID), in the session store
(``service.sessions.store``: this process's memory, or a Redis the replicas share). A
session is pinned to the version it started on, on whichever replica continues it (the
registry keeps that version loaded while sessions use it, and a replica that lacks it
loads it on demand). A chunk is applied exactly once: the store's compare-and-set
advances the session's position (time steps consumed) only from the position the chunk
was computed at. A chunk may name that position (``position``): at the session's position
it is applied; at the position before the last applied chunk it is a retry of that chunk,
answered again from the state before it without advancing; at any other, 409 naming the
session's position. Without a position, chunks apply in arrival order: one at a time per
session within a replica (an asyncio lock, first come, first served), re-run on a
compare-and-set conflict with another replica.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from ..errors import (
    ClientError,
    PositionConflict,
    ServiceError,
    SessionExists,
    StateConflict,
    StoreUnavailable,
    UnknownSession,
    VersionGone,
)

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..registry.registry import ModelVersion, Registry
    from .store import SessionRecord, SessionStore

log = logging.getLogger("orthornn.service")
R = TypeVar("R")
#: one chunk of a session: (model version, the state it continues from) -> (answer, the
#: state after the chunk, its time steps)
ChunkRun = Callable[["ModelVersion", "np.ndarray | None"],
                    Awaitable[tuple[R, np.ndarray, int]]]


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

@contextlib.contextmanager
def served_by(mv: ModelVersion) -> Iterator[None]:
    """An error raised inside is counted under MV (its ``served``; a bug's 500 too)."""
    try:
        yield
    except Exception as error:
        if getattr(error, "served", None) is None:
            error.served = (mv.name, mv.version)  # type: ignore[attr-defined]
        raise


@dataclass(frozen=True)
class Applied(Generic[R]):
    """A chunk's answer, the version that answered it and the session's position after
    it (time steps consumed)."""

    answer: R
    model: str
    version: int
    position: int


class Sessions:
    """The server-side sessions of a service, kept in STORE (``service.sessions.store``);
    REGISTRY loads and keeps the versions they are pinned to. ``reconcile`` (every
    ``reconcile_interval_s``, from ``start``) tells the registry which versions open
    sessions use (``versions_in_use``), so the others are released, and updates the
    ``orthornn_sessions_active`` and ``orthornn_session_store_up`` gauges."""

    #: compare-and-set conflicts (another replica applied a chunk first) a chunk without a
    #: position is re-run for before it gets 409
    CAS_ATTEMPTS = 4

    def __init__(self, store: SessionStore, registry: Registry, *,
                 metrics: Metrics | None = None, reconcile_interval_s: float = 1.0):
        self.store, self.registry, self.metrics = store, registry, metrics
        self.reconcile_interval_s = reconcile_interval_s
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._task: asyncio.Task | None = None
        self._closing = False

    # -- one chunk ------------------------------------------------------------------------

    async def chunk(self, sid: str, model: str, run: ChunkRun[R], *,
                    version: int | None = None, start: bool = False, end: bool = False,
                    position: int | None = None, what: str = "session") -> Applied[R]:
        """Apply one chunk to session SID of MODEL: ``run`` answers it from the session's
        state (on the session's version) and gives the state after it. START opens the
        session (on VERSION, default: the model's default version), END ends it after
        this chunk; POSITION (time steps the client believes the session has consumed)
        makes the chunk exactly-once (see the module's docstring). WHAT names the session
        in messages ("session", or "sequence" on the inference route)."""
        if position is not None and start and position != 0:
            raise ClientError(f"position: a {what} starts at position 0; got {position} with "
                              f"its start")
        async with self._locked(sid):  # one chunk at a time per session on this replica
            if start:
                started = await self._start(sid, model, version, run, end, position, what)
                if started is not None:
                    return started
                # a retried start (the session is open, the chunk names position 0):
                # answered like any chunk at that position
            for attempt in range(self.CAS_ATTEMPTS):
                record = await self.store.get(sid)
                self._check(record, model, version, position, what)
                mv = await self._version(record, what)
                try:
                    with served_by(mv):
                        try:
                            applied = await self._apply(record, mv, run, end, position,
                                                        what)
                        except _Conflict as conflict:
                            if position is not None or attempt == self.CAS_ATTEMPTS - 1:
                                raise conflict.error from None
                            continue  # another replica applied a chunk first: read again
                    break
                finally:
                    self._release(mv)
        if end and mv.retired:  # a version no longer served: released now if unused
            await self.reconcile()
        return applied

    async def _start(self, sid: str, model: str, version: int | None, run: ChunkRun[R],
                     end: bool, position: int | None, what: str) -> Applied[R] | None:
        """Open SID and apply its first chunk; None when it is open already and the chunk
        names position 0 (a retried start). A failed first chunk opens nothing."""
        mv = self.registry.acquire(model, version)
        try:
            with served_by(mv):
                try:
                    record = await self.store.create(sid, model, mv.version)
                except SessionExists:
                    if position is None:
                        raise
                    return None
                self.registry.keep(mv)  # pinned from now on, wherever it continues
                self._count("session_starts", model)
                ok = False
                try:
                    applied = await self._apply(record, mv, run, end, position, what)
                    ok = True
                except _Conflict as conflict:  # another replica took it at once
                    raise conflict.error from None
                finally:
                    if not ok:  # a failed first chunk opens nothing
                        await self._forget(sid, model)
                    await self._refresh_count()
        finally:
            self._release(mv)
        if end and mv.retired:
            await self.reconcile()
        return applied

    def _check(self, record: SessionRecord, model: str, version: int | None,
               position: int | None, what: str) -> None:
        sid = record.id
        retry = position is not None and position == record.previous_position
        if record.ended and not retry:  # ended: only its last chunk is answered again
            raise UnknownSession(f"session {sid!r} is not open (ended); start it with "
                                 f"\"start\": true")  # as the store says it
        if record.model != model:
            raise ClientError(f"{what} {sid!r} belongs to model {record.model!r}, not "
                              f"{model!r}")
        if version is not None and version != record.version:
            raise StateConflict(f"{what} {sid!r} runs on version {record.version}, not "
                                f"{version}")

    async def _version(self, record: SessionRecord, what: str) -> ModelVersion:
        """The session's pinned version, held for one chunk: loaded here if this replica
        has not loaded it (in a thread); VersionGone (409 naming it) ends the session."""
        mv = self.registry.session_version(record.model, record.version)
        if mv is not None:
            return mv
        try:
            return await asyncio.to_thread(self.registry.load_session_version,
                                           record.model, record.version)
        except VersionGone as gone:
            await self._forget(record.id, record.model)
            await self._refresh_count()
            raise VersionGone(f"{what} {record.id!r} runs on {gone}; the {what} has ended: "
                              f"start a new one") from None

    async def _apply(self, record: SessionRecord, mv: ModelVersion, run: ChunkRun[R],
                     end: bool, position: int | None, what: str) -> Applied[R]:
        sid = record.id
        if position is None or position == record.position:
            answer, state, steps = await run(mv, record.state)
            try:
                if end:
                    new = await self.store.finish(sid, record.position, state, steps)
                else:
                    new = await self.store.advance(sid, record.position, state, steps)
            except PositionConflict as error:
                raise _Conflict(error) from None
            except UnknownSession:  # ended or expired while this chunk ran
                raise UnknownSession(f"session {sid!r} ended while this request ran") \
                    from None
            if end:
                self._count("session_ends", record.model)
                await self._refresh_count()
            return Applied(answer, mv.name, mv.version, new.position)
        if position == record.previous_position:  # a retry of the last applied chunk
            answer, _, steps = await run(mv, record.previous_state)
            applied = record.position - record.previous_position
            if steps != applied:
                raise PositionConflict(
                    f"{what} {sid!r} is at position {record.position}; the chunk applied at "
                    f"position {position} had {applied} steps, this one has {steps}: not a "
                    f"retry of it", record.position)
            return Applied(answer, mv.name, mv.version, record.position)
        raise PositionConflict(
            f"{what} {sid!r} is at position {record.position}, not {position}; continue from "
            f"position {record.position}", record.position)

    # -- helpers -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _locked(self, sid: str) -> AsyncIterator[None]:
        lock, waiting = self._locks.setdefault(sid, (asyncio.Lock(), [0]))
        waiting[0] += 1
        try:
            async with lock:
                yield
        finally:
            waiting[0] -= 1
            if not waiting[0]:
                del self._locks[sid]

    def _release(self, mv: ModelVersion) -> None:
        self.registry.release(mv)

    async def _forget(self, sid: str, model: str) -> None:
        """End SID after a failure (best effort: a store that is down keeps it until its
        idle timeout)."""
        with contextlib.suppress(ServiceError):
            if await self.store.delete(sid):
                self._count("session_ends", model)

    def _count(self, name: str, model: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).labels(model).inc()

    async def _refresh_count(self) -> None:
        """The sessions gauge now, where counting costs nothing (in memory); with Redis the
        reconcile task updates it every second."""
        if self.metrics is not None and self.store.kind == "memory":
            with contextlib.suppress(ServiceError):
                self.metrics.sessions_active.set(await self.store.count())

    # -- the versions sessions use ---------------------------------------------------------

    async def reconcile(self) -> None:
        """Tell the registry which versions open sessions use (all replicas' sessions, as
        the store counts them), so the others are released; a store that does not answer
        changes nothing (the versions the last answer named stay kept)."""
        since = time.monotonic()
        try:
            in_use = await self.store.versions_in_use()
            count = await self.store.count()
        except StoreUnavailable:
            if self.metrics is not None:
                self.metrics.session_store_up.set(0)
            return
        self.registry.retain(in_use, since)
        if self.metrics is not None:
            self.metrics.session_store_up.set(1)
            self.metrics.sessions_active.set(count)

    def start(self) -> None:
        """Start the reconcile task (on the running event loop)."""
        async def loop():
            while not self._closing:  # as well as the cancel: a library may swallow one
                try:
                    await self.reconcile()
                except Exception:  # never let the task die silently
                    log.exception("session reconcile failed")
                await asyncio.sleep(self.reconcile_interval_s)
        self._task = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.store.close()


class _Conflict(Exception):
    """The store's compare-and-set refused a chunk (another one was applied first)."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error

