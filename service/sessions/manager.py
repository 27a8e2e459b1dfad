"""Server-side sessions: exactly-once chunks on the session store, pinned versions, owners
(the reasoning: docs/design.md, "Server-side sessions")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

from .. import request
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
from . import owners
from .cache import RecordCache
from .records import StaleRecord, exists, unknown

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..registry.registry import ModelVersion, Registry
    from .records import SessionRecord
    from .store import SessionStore

log = logging.getLogger("orthornn.service")
R = TypeVar("R")
#: one chunk of a session: (model version, the state it continues from) -> (answer, the
#: state after the chunk, its time steps)
ChunkRun = Callable[["ModelVersion", "np.ndarray | None"],
                    Awaitable[tuple[R, np.ndarray, int]]]


@dataclass(frozen=True)
class Applied(Generic[R]):
    """A chunk's answer, the version that answered it and the session's position after
    it (time steps consumed); ``secret``: the session's secret, in the answer to its start
    (None otherwise, and with secrets off)."""

    answer: R
    model: str
    version: int
    position: int
    secret: str | None = None


def _hold(mv: ModelVersion | None) -> None:
    """The request's scope names MV (None: no version) as the version it holds."""
    scope = request.current()
    scope.model, scope.version = (None, None) if mv is None else (mv.name, mv.version)


class Sessions:
    """The server-side sessions of a service, kept in STORE (``service.sessions.store``);
    REGISTRY loads and keeps the versions they are pinned to. ``reconcile`` (every
    ``reconcile_interval_s``, from ``start``) tells the registry which versions open
    sessions use (``versions_in_use``), so the others are released, and updates the
    ``orthornn_sessions_active`` and ``orthornn_session_store_up`` gauges. SECRETS: a
    session belongs to whoever started it (see the module's docstring); off, anyone who
    names a session continues it."""

    #: compare-and-set conflicts (another replica applied a chunk first) a chunk without a
    #: position is re-run for before it gets 409
    CAS_ATTEMPTS = 4

    def __init__(self, store: SessionStore, registry: Registry, *,
                 metrics: Metrics | None = None, reconcile_interval_s: float = 1.0,
                 secrets: bool = True):
        self.store, self.registry, self.metrics = store, registry, metrics
        self.secrets = secrets
        self.reconcile_interval_s = reconcile_interval_s
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        self._records = RecordCache(store.max_sessions if store.remote else 0)
        self._task: asyncio.Task | None = None
        self._closing = False

    # -- one chunk ------------------------------------------------------------------------

    async def chunk(self, sid: str, model: str, run: ChunkRun[R], *,
                    version: int | None = None, start: bool = False, end: bool = False,
                    position: int | None = None, what: str = "session",
                    secret: str | None = None) -> Applied[R]:
        """Apply one chunk to session SID of MODEL: ``run`` answers it from the session's
        state (on the session's version) and gives the state after it. START opens the
        session (on VERSION, default: the model's default version), END ends it after
        this chunk; POSITION (time steps the client believes the session has consumed)
        makes the chunk exactly-once (see the module's docstring). WHAT names the session
        in messages ("session", or "sequence" on the inference route). The request's
        scope is told the version the chunk holds: it is counted under it, failed or not.
        SECRET: the one the client presents (with START, one it chose: else the service
        draws one); the answer to a start gives the session's (``Applied.secret``)."""
        owners.check_id(sid, "session" if what == "session" else f"{what}_id")
        owners.check_secret(secret, "session_secret")
        if position is not None and start and position != 0:
            raise ClientError(f"position: a {what} starts at position 0; got {position} with "
                              f"its start")
        given = None  # the secret the answer to a start gives
        if self.secrets and start:
            given = owners.new_secret() if secret is None else \
                owners.chosen(secret, "session_secret")
            secret = given
        owner = owners.digest(secret) if self.secrets else None
        async with self._locked(sid):  # one chunk at a time per session on this replica
            if start:
                started = await self._start(sid, model, version, run, end, position, what,
                                            owner)
                if started is not None:
                    return replace(started, secret=given)
                # a retried start (the session is open, the chunk names position 0, its
                # owner's secret): answered like any chunk at that position
            cached = self._records.get(sid)
            done = None
            if cached is not None and cached.model == model and \
                    version in (None, cached.version) and \
                    position in (None, cached.position) and self._owns(cached, owner):
                done = await self._from_cached(cached, run, end)
            if done is None:
                done = await self._from_store(sid, model, version, run, end, position, what,
                                              owner)
        applied, mv = done
        if end and mv.retired:  # a version no longer served: released now if unused
            await self.reconcile()
        return replace(applied, secret=given)

    def _owns(self, record: SessionRecord, owner: str | None) -> bool:
        """Whether OWNER (a secret's digest) is RECORD's (always, with secrets off)."""
        return not self.secrets or owners.matches(record.secret, owner)

    async def _from_cached(self, record: SessionRecord, run: ChunkRun[R], end: bool,
                           ) -> tuple[Applied[R], ModelVersion] | None:
        """The chunk applied at the cached RECORD's position without a read; None when it
        must be decided from a fresh read (the session changed since, or its version is
        not loaded here)."""
        mv = self.registry.session_version(record.model, record.version)
        if mv is None or self.registry.rollouts.ended_on_failures(record.model, record.version):
            return None
        try:
            _hold(mv)
            try:
                answer, state, steps = await run(mv, record.state)
            except Exception:
                _hold(None)
                if (await self._read(record.id)).stamp != record.stamp:
                    return None  # not the session's record: its version may differ
                _hold(mv)
                raise
            write = self.store.finish if end else self.store.advance
            try:
                new = await write(record.id, record.position, state, steps, record.stamp)
            except (StaleRecord, PositionConflict, UnknownSession):
                self._records.drop(record.id)
                _hold(None)
                return None
            return await self._applied(record, mv, new, answer, end), mv
        finally:
            self._release(mv)

    async def _from_store(self, sid: str, model: str, version: int | None, run: ChunkRun[R],
                          end: bool, position: int | None, what: str,
                          owner: str | None) -> tuple[Applied[R], ModelVersion]:
        for attempt in range(self.CAS_ATTEMPTS):
            record = await self._read(sid)
            if not self._owns(record, owner):  # as for an id never started
                raise unknown(sid, self.store.idle_timeout_s)
            self._check(record, model, version, position, what)
            mv = await self._version(record, what)
            try:
                _hold(mv)
                try:
                    return await self._apply(record, mv, run, end, position, what), mv
                except _Conflict as conflict:
                    if position is not None or attempt == self.CAS_ATTEMPTS - 1:
                        raise conflict.error from None
                    _hold(None)  # another replica applied a chunk first: read again
            finally:
                self._release(mv)
        raise AssertionError("unreachable")  # the last attempt returns or raises

    async def _start(self, sid: str, model: str, version: int | None, run: ChunkRun[R],
                     end: bool, position: int | None, what: str,
                     owner: str | None) -> Applied[R] | None:
        """Open SID (owned by OWNER, a secret's digest) and apply its first chunk; None
        when it is open already, by OWNER, and the chunk names position 0 (a retried
        start). A failed first chunk opens nothing."""
        if version is None:  # a rollout's canary places new sessions by their id
            version = self.registry.route(model, sid.encode())
        mv = self.registry.acquire(model, version)
        try:
            _hold(mv)
            try:
                record = await self.store.create(sid, model, mv.version, owner)
            except SessionExists:
                if position is None or not await self._opened_by(sid, owner):
                    raise exists(sid) from None  # never a reset
                _hold(None)
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

    async def _opened_by(self, sid: str, owner: str | None) -> bool:
        """Whether open session SID is OWNER's (a retried start may go on as a chunk)."""
        try:
            return self._owns(await self._read(sid), owner)
        except UnknownSession:  # ended or expired since: not a retry of its start
            return False

    async def _read(self, sid: str) -> SessionRecord:
        """SID's record from the store, kept (while open) for its next chunk."""
        try:
            record = await self.store.get(sid)
        except UnknownSession:
            self._records.drop(sid)
            raise
        self._records.put(record)
        return record

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
        has not loaded it (in a thread); VersionGone (409 naming it) ends the session, as
        does a rollout of its version rolled back on errors."""
        failed = self.registry.rollouts.ended_on_failures(record.model, record.version)
        if failed is not None:
            await self._forget(record.id, record.model)
            await self._refresh_count()
            raise VersionGone(f"{what} {record.id!r} runs on {failed}; the {what} has ended: "
                              f"start a new one")
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
                self._records.drop(sid)
                raise _Conflict(error) from None
            except UnknownSession:  # ended or expired while this chunk ran
                self._records.drop(sid)
                raise UnknownSession(f"session {sid!r} ended while this request ran") \
                    from None
            return await self._applied(record, mv, new, answer, end)
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

    async def _applied(self, record: SessionRecord, mv: ModelVersion, new: SessionRecord,
                       answer: R, end: bool) -> Applied[R]:
        """The answer of a chunk the store applied (NEW: the session's record after it)."""
        self._records.put(new)  # an ended one is dropped
        if end:
            self._count("session_ends", record.model)
            await self._refresh_count()
        return Applied(answer, mv.name, mv.version, new.position)

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
        self._records.drop(sid)
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
        async def loop() -> None:
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

    def __init__(self, error: PositionConflict):
        super().__init__(str(error))
        self.error = error

