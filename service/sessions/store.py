"""Where server-side sessions live: one typed interface (``SessionStore``), two stores.

``MemoryStore`` (``session_store = "memory"``, the default) keeps the sessions in this
process: a session belongs to the replica that started it. ``RedisStore``
(``session_store = "redis://[:PASSWORD@]HOST[:PORT][/DB]"``) keeps them in a Redis that
the replicas share, so any replica behind a load balancer continues any session, and one
that dies loses none.

A session's record holds its model and pinned version, the state after the chunks applied
so far and their number of time steps (``position``), and the state and position before
the last applied chunk (``previous_*``), from which a retried chunk is answered again
without advancing twice. Chunks are applied exactly once by compare-and-set:
``advance(sid, expected_position, state, steps)`` applies only while the stored position
is still ``expected_position`` (in Redis one Lua script, so two replicas racing on one
session cannot both apply), and otherwise raises ``PositionConflict`` naming the current
position.

``finish`` is ``advance`` that also ends the session: the ended record stays readable
(``get``, with ``ended``) until its idle timeout, so that a retried final chunk is answered
again, but it is no longer open: it counts against no limit, pins no version, and its id
may start again.

Idle sessions expire by themselves (Redis's own key TTL; lazily in memory): no replica
sweeps. The maximum number of sessions and ``versions_in_use`` count only live sessions
(not ended ones); the memory store counts its expiries (``orthornn_session_expiries``),
Redis expires keys without telling anyone.

Redis data layout, under ``session_key_prefix`` P (default "orthornn:"):

* ``P session:<id>``: a hash. ``model`` (str), ``version`` (int), ``position`` (int),
  ``state`` (float32 little-endian bytes; absent before the first chunk),
  ``previous_position`` (int; absent before the first chunk), ``previous_state`` (bytes;
  absent when the state before the last chunk was the initial one), ``last_used`` (ms since
  the epoch, Redis TIME), ``ended`` ("1" once ``finish`` ended it; absent while open). Its
  TTL is the idle timeout, renewed by ``create``/``advance``/``finish``.
* ``P sessions``: a sorted set of the open session ids, scored by their expiry time (ms,
  Redis TIME), the same instant as the hash's PEXPIREAT. Every script first removes the
  members whose score has passed, so ZCARD is the number of live sessions across replicas;
  ``finish`` removes the id at once (the ended hash lives on until its TTL).

A Redis that is down, unreachable or slow answers no call later than
``session_store_timeout_s``: the call raises ``StoreUnavailable`` (503, Retry-After).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..errors import (
    PositionConflict,
    SessionExists,
    SessionLimit,
    StoreUnavailable,
    UnknownSession,
)
from ..settings import check_store_url, redact

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..settings import Settings

log = logging.getLogger("orthornn.service")


@dataclass(frozen=True, eq=False)
class SessionRecord:
    """One session as the store holds it. ``state`` is None before the first chunk;
    ``previous_state``/``previous_position`` are the state and position before the last
    applied chunk (``previous_position`` None before the first chunk, ``previous_state``
    None when that chunk started from the initial state). ``last_used``: seconds since the
    epoch of the last create or advance. ``ended``: ``finish`` ended it (readable until its
    idle timeout, open no more)."""

    id: str
    model: str
    version: int
    state: np.ndarray | None
    position: int
    previous_state: np.ndarray | None
    previous_position: int | None
    last_used: float
    ended: bool = False


class SessionStore(Protocol):
    """The interface both stores implement; every method may raise ``StoreUnavailable``
    (503) when the store cannot be reached in time."""

    kind: str  # "memory" or "redis"

    async def create(self, sid: str, model: str, version: int) -> SessionRecord:
        """Open a session at position 0 with no state (replacing an ended record of SID).
        SessionExists (409) when SID is open, SessionLimit (429) when the store holds
        max_sessions live sessions."""
        ...

    async def get(self, sid: str) -> SessionRecord:
        """The record, an ended one too (``ended``) until its idle timeout; UnknownSession
        (404) when there is none (never started, deleted or expired). Does not renew the
        idle expiry."""
        ...

    async def advance(self, sid: str, expected_position: int, state: np.ndarray,
                      steps: int) -> SessionRecord:
        """Compare-and-set: when the session is at EXPECTED_POSITION, previous_* := the
        current state and position, state := STATE, position += STEPS, idle expiry
        renewed; the new record. Otherwise PositionConflict (409) carrying the current
        position; UnknownSession (404) when not open (an ended session included)."""
        ...

    async def finish(self, sid: str, expected_position: int, state: np.ndarray,
                     steps: int) -> SessionRecord:
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


# -- shared pieces ---------------------------------------------------------------------------

def _state_bytes(state: np.ndarray) -> bytes:
    array = np.asarray(state)
    if array.ndim != 1:
        raise ValueError(f"a session state is a vector; got shape {array.shape}")
    return np.ascontiguousarray(array, dtype="<f4").tobytes()


def _state(raw: bytes | None) -> np.ndarray | None:
    return None if raw is None else np.frombuffer(raw, dtype="<f4").astype(np.float32)


def _check_counts(expected_position: int, steps: int) -> None:
    for name, value in (("expected_position", expected_position), ("steps", steps)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0; got {value!r}")


def _unknown(sid: str, idle_timeout_s: float) -> UnknownSession:
    return UnknownSession(f"session {sid!r} is not open (never started, ended, or idle for "
                          f"over {idle_timeout_s:g} s); start it with \"start\": true")


def _exists(sid: str) -> SessionExists:
    return SessionExists(f"session {sid!r} is already open; end it first or use another id")


def _limit(sid: str, max_sessions: int) -> SessionLimit:
    return SessionLimit(f"session {sid!r}: the service holds the maximum of {max_sessions} "
                        f"open sessions (all replicas); retry later")


def _position_conflict(sid: str, expected: int, position: int) -> PositionConflict:
    return PositionConflict(
        f"session {sid!r} is at position {position}, not {expected}: another chunk was "
        f"applied first (or this one already was); continue from position {position}",
        position)


class _Timed:
    """Latency and error metrics by operation (``orthornn_session_store_*``)."""

    kind = "memory"
    metrics: Metrics | None = None

    @contextlib.contextmanager
    def _timed(self, operation: str):
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


# -- in this process -----------------------------------------------------------------------

class MemoryStore(_Timed):
    """Sessions in this process's memory. Expiry is lazy: each call first drops the
    sessions idle for longer than the timeout (they are kept in order of last use, so only
    the expired ones are looked at). Every method runs without awaiting, so each is atomic
    on the event loop."""

    kind = "memory"

    def __init__(self, *, max_sessions: int, idle_timeout_s: float,
                 metrics: Metrics | None = None, clock=time.monotonic):
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.metrics = metrics
        self._clock = clock
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
        self._open.pop(record.id, None)
        table = self._ended if record.ended else self._open
        table[record.id] = (record, self._clock() + self.idle_timeout_s)
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
            raise _unknown(sid, self.idle_timeout_s)
        return found[0]

    async def create(self, sid: str, model: str, version: int) -> SessionRecord:
        with self._timed("create"):
            self._prune()
            if sid in self._open:
                raise _exists(sid)
            if len(self._open) >= self.max_sessions:
                raise _limit(sid, self.max_sessions)
            self._ended.pop(sid, None)
            return self._put(SessionRecord(sid, model, int(version), None, 0, None, None,
                                           time.time()))

    async def get(self, sid: str) -> SessionRecord:
        with self._timed("get"):
            return self._copy(self._record(sid, ended=True))

    async def advance(self, sid: str, expected_position: int, state: np.ndarray,
                      steps: int) -> SessionRecord:
        return self._advance("advance", sid, expected_position, state, steps)

    async def finish(self, sid: str, expected_position: int, state: np.ndarray,
                     steps: int) -> SessionRecord:
        return self._advance("finish", sid, expected_position, state, steps, ended=True)

    def _advance(self, operation: str, sid: str, expected_position: int, state: np.ndarray,
                 steps: int, ended: bool = False) -> SessionRecord:
        _check_counts(expected_position, steps)
        new_state = _state(_state_bytes(state))
        with self._timed(operation):
            current = self._record(sid)
            if current.position != expected_position:
                raise _position_conflict(sid, expected_position, current.position)
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


# -- in Redis ------------------------------------------------------------------------------

# Each script starts by reading Redis's clock (ms) and dropping the expired ids from the
# index; KEYS[1] is the session's hash (where there is one), the index is the last key.
_NOW_AND_PRUNE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[#KEYS], '-inf', now)
"""

# create: KEYS = {hash, index}; ARGV = {id, model, version, max_sessions, ttl_ms}
# -> {'open'} | {'full'} | {'ok', now_ms}; an ended session's hash is replaced
CREATE_LUA = _NOW_AND_PRUNE + """
local exists = redis.call('EXISTS', KEYS[1]) == 1
if exists and redis.call('HEXISTS', KEYS[1], 'ended') == 0 then return {'open'} end
if redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[4]) then return {'full'} end
if exists then redis.call('DEL', KEYS[1]) end
local expires = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'model', ARGV[2], 'version', ARGV[3], 'position', 0,
           'last_used', now)
redis.call('PEXPIREAT', KEYS[1], expires)
redis.call('ZADD', KEYS[2], expires, ARGV[1])
return {'ok', now}
"""

# advance (compare-and-set), and finish (ARGV[6] = 1: the session ends, out of the index):
# KEYS = {hash, index}; ARGV = {id, expected_position, state bytes, steps, ttl_ms, finish}
# -> {'gone'} | {'conflict', position} | {'ok', HGETALL of the updated hash}
ADVANCE_LUA = _NOW_AND_PRUNE + """
local position = redis.call('HGET', KEYS[1], 'position')
if not position or redis.call('HEXISTS', KEYS[1], 'ended') == 1 then return {'gone'} end
position = tonumber(position)
if position ~= tonumber(ARGV[2]) then return {'conflict', position} end
local state = redis.call('HGET', KEYS[1], 'state')
if state then
  redis.call('HSET', KEYS[1], 'previous_state', state)
else
  redis.call('HDEL', KEYS[1], 'previous_state')
end
local expires = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'previous_position', position, 'state', ARGV[3],
           'position', position + tonumber(ARGV[4]), 'last_used', now)
redis.call('PEXPIREAT', KEYS[1], expires)
if ARGV[6] == '1' then
  redis.call('HSET', KEYS[1], 'ended', 1)
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('ZADD', KEYS[2], expires, ARGV[1])
end
return {'ok', redis.call('HGETALL', KEYS[1])}
"""

# count: KEYS = {index} -> live sessions
COUNT_LUA = _NOW_AND_PRUNE + """
return redis.call('ZCARD', KEYS[1])
"""

# versions in use: KEYS = {index}; ARGV = {prefix of the session hashes}
# -> {model, version, model, version, ...} without repeats
VERSIONS_LUA = _NOW_AND_PRUNE + """
local seen, out = {}, {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local mv = redis.call('HMGET', ARGV[1] .. id, 'model', 'version')
  if mv[1] and mv[2] then
    local pair = mv[1] .. '\\n' .. mv[2]
    if not seen[pair] then
      seen[pair] = true
      out[#out + 1] = mv[1]
      out[#out + 1] = mv[2]
    end
  end
end
return out
"""


class RedisStore(_Timed):
    """Sessions in a Redis shared by the replicas (redis-py's asyncio client). Each call is
    bounded by ``timeout_s`` (the connect and socket timeouts, and the whole call, one
    reconnect included); a Redis error or timeout is ``StoreUnavailable`` (503)."""

    kind = "redis"

    def __init__(self, url: str, *, prefix: str = "orthornn:", max_sessions: int,
                 idle_timeout_s: float, timeout_s: float = 0.5,
                 metrics: Metrics | None = None):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        check_store_url(url)
        self.url = redact(url)
        self.prefix = prefix
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._ttl_ms = max(1, round(idle_timeout_s * 1000))
        self._down = False  # the last call failed (failures are logged once per outage)
        self._index = f"{prefix}sessions"
        # one immediate reconnect (a pooled connection to a Redis that restarted), no
        # backoff: the whole call stays within timeout_s. No socket timeout: _call bounds
        # every call, and with one redis-py sends through asyncio.wait_for, which on Python
        # 3.11 loses a cancellation that arrives as the send completes (CPython gh-86296):
        # the reconcile task then never ended and shutdown hung.
        self._client = aioredis.from_url(
            url, socket_timeout=None, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1), decode_responses=False)
        self._create = self._client.register_script(CREATE_LUA)
        self._advance = self._client.register_script(ADVANCE_LUA)
        self._count = self._client.register_script(COUNT_LUA)
        self._versions = self._client.register_script(VERSIONS_LUA)

    def _key(self, sid: str) -> str:
        return f"{self.prefix}session:{sid}"

    @contextlib.asynccontextmanager
    async def _call(self, operation: str) -> AsyncIterator[None]:
        from redis.exceptions import RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        with self._timed(operation):
            try:
                async with asyncio.timeout(self.timeout_s):
                    yield
            except (RedisError, OSError, TimeoutError) as e:
                self._failed(operation)
                why = "no answer" if isinstance(e, TimeoutError | RedisTimeout) \
                    else f"{type(e).__name__}: {e}"
                # once per outage (the reconcile task calls every second): then debug
                log.log(logging.DEBUG if self._down else logging.WARNING,
                        "session store %s: %s failed (%s)%s", self.url, operation, why,
                        "" if self._down else "; until it answers again, further failures "
                        "are logged at debug level (counted in "
                        "orthornn_session_store_errors_total)")
                self._down = True
                # the client's message names no host (the log does)
                raise StoreUnavailable(
                    f"the session store is unavailable ({why} within {self.timeout_s:g} s); "
                    f"retry shortly") from None
            else:
                if self._down:
                    self._down = False
                    log.warning("session store %s answers again", self.url)

    def _from_hash(self, sid: str, fields: Mapping) -> SessionRecord:
        previous = fields.get(b"previous_position")
        return SessionRecord(
            id=sid, model=fields[b"model"].decode(), version=int(fields[b"version"]),
            state=_state(fields.get(b"state")), position=int(fields[b"position"]),
            previous_state=_state(fields.get(b"previous_state")),
            previous_position=None if previous is None else int(previous),
            last_used=int(fields[b"last_used"]) / 1000, ended=b"ended" in fields)

    async def create(self, sid: str, model: str, version: int) -> SessionRecord:
        async with self._call("create"):
            reply = await self._create(keys=[self._key(sid), self._index],
                                       args=[sid, model, int(version), self.max_sessions,
                                             self._ttl_ms])
        if reply[0] == b"open":
            raise _exists(sid)
        if reply[0] == b"full":
            raise _limit(sid, self.max_sessions)
        return SessionRecord(sid, model, int(version), None, 0, None, None,
                             int(reply[1]) / 1000)

    async def get(self, sid: str) -> SessionRecord:
        async with self._call("get"):
            fields = await self._client.hgetall(self._key(sid))
        if not fields:
            raise _unknown(sid, self.idle_timeout_s)
        return self._from_hash(sid, fields)

    async def advance(self, sid: str, expected_position: int, state: np.ndarray,
                      steps: int) -> SessionRecord:
        return await self._step("advance", sid, expected_position, state, steps)

    async def finish(self, sid: str, expected_position: int, state: np.ndarray,
                     steps: int) -> SessionRecord:
        return await self._step("finish", sid, expected_position, state, steps)

    async def _step(self, operation: str, sid: str, expected_position: int,
                    state: np.ndarray, steps: int) -> SessionRecord:
        _check_counts(expected_position, steps)
        data = _state_bytes(state)
        async with self._call(operation):
            reply = await self._advance(keys=[self._key(sid), self._index],
                                        args=[sid, int(expected_position), data, int(steps),
                                              self._ttl_ms, int(operation == "finish")])
        if reply[0] == b"gone":
            raise _unknown(sid, self.idle_timeout_s)
        if reply[0] == b"conflict":
            raise _position_conflict(sid, expected_position, int(reply[1]))
        flat = reply[1]
        return self._from_hash(sid, dict(zip(flat[::2], flat[1::2], strict=True)))

    async def delete(self, sid: str) -> bool:
        async with self._call("delete"), self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(sid))
            pipe.zrem(self._index, sid)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def count(self) -> int:
        async with self._call("count"):
            return int(await self._count(keys=[self._index]))

    async def versions_in_use(self) -> dict[str, set[int]]:
        async with self._call("versions_in_use"):
            flat = await self._versions(keys=[self._index], args=[f"{self.prefix}session:"])
        out: dict[str, set[int]] = {}
        for model, version in zip(flat[::2], flat[1::2], strict=True):
            out.setdefault(model.decode(), set()).add(int(version))
        return out

    async def ping(self) -> None:
        async with self._call("ping"):
            await self._client.ping()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()


def open_store(settings: Settings, metrics: Metrics | None = None) -> SessionStore:
    """The store SETTINGS.session_store names (ValueError naming the field when it is
    neither "memory" nor a Redis URL)."""
    value = settings.session_store
    if check_store_url(value) is None:
        return MemoryStore(max_sessions=settings.max_sessions,
                           idle_timeout_s=settings.session_idle_timeout_s, metrics=metrics)
    return RedisStore(value, prefix=settings.session_key_prefix,
                      max_sessions=settings.max_sessions,
                      idle_timeout_s=settings.session_idle_timeout_s,
                      timeout_s=settings.session_store_timeout_s, metrics=metrics)
