"""Sessions in a Redis the replicas share: any replica continues any session, and one that
dies loses none (the reasoning: docs/design.md, "Sessions in Redis")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..addresses import check_store_url, redact
from ..errors import StoreUnavailable
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

log = logging.getLogger("orthornn.service")

# Each script starts by reading Redis's clock (ms) and dropping the expired ids from the
# index; KEYS[1] is the session's hash (where there is one), the index is the last key
# (the ended ids' set, where there is one, is the one before it).
_NOW_AND_PRUNE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[#KEYS], '-inf', now)
"""

# create: KEYS = {hash, ended, index}; ARGV = {id, model, version, max_sessions, ttl_ms,
# stamp, secret digest or ''} -> {'open'} | {'full'} | {'ok', now_ms}; an ended session's
# hash is replaced
CREATE_LUA = _NOW_AND_PRUNE + """
local exists = redis.call('EXISTS', KEYS[1]) == 1
if exists and redis.call('HEXISTS', KEYS[1], 'ended') == 0 then return {'open'} end
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[4]) then return {'full'} end
if exists then redis.call('DEL', KEYS[1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
local expires = now + tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'model', ARGV[2], 'version', ARGV[3], 'position', 0,
           'last_used', now, 'stamp', ARGV[6])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'secret', ARGV[7]) end
redis.call('PEXPIREAT', KEYS[1], expires)
redis.call('ZADD', KEYS[3], expires, ARGV[1])
return {'ok', now}
"""

# advance (compare-and-set), and finish (ARGV[6] = 1: the session ends, out of the index,
# into the ended set, whose oldest beyond max_ended are deleted):
# KEYS = {hash, ended, index}; ARGV = {id, expected_position, state bytes, steps, ttl_ms,
# finish, new stamp, expected stamp or '', max_ended, prefix of the session hashes}
# -> {'gone'} | {'stale'} | {'conflict', position} | {'ok', HGETALL of the updated hash};
# the same write sent again (its new stamp already the record's) -> {'ok', HGETALL}
ADVANCE_LUA = _NOW_AND_PRUNE + """
if redis.call('HGET', KEYS[1], 'stamp') == ARGV[7] then
  -- this very write has applied: a retry of it (redis-py re-sends a command whose reply a
  -- broken connection lost), so its answer again, not a conflict that would re-run it
  return {'ok', redis.call('HGETALL', KEYS[1])}
end
local position = redis.call('HGET', KEYS[1], 'position')
if not position or redis.call('HEXISTS', KEYS[1], 'ended') == 1 then return {'gone'} end
if ARGV[8] ~= '' and redis.call('HGET', KEYS[1], 'stamp') ~= ARGV[8] then
  return {'stale'}
end
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
           'position', position + tonumber(ARGV[4]), 'last_used', now, 'stamp', ARGV[7])
redis.call('PEXPIREAT', KEYS[1], expires)
if ARGV[6] ~= '1' then
  redis.call('ZADD', KEYS[3], expires, ARGV[1])
  return {'ok', redis.call('HGETALL', KEYS[1])}
end
redis.call('HSET', KEYS[1], 'ended', 1)
redis.call('ZREM', KEYS[3], ARGV[1])
local record = redis.call('HGETALL', KEYS[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZADD', KEYS[2], expires, ARGV[1])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[9])
if excess > 0 then
  local oldest = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #oldest, 2 do
    local key = ARGV[10] .. oldest[i]
    if redis.call('HEXISTS', key, 'ended') == 1 then redis.call('DEL', key) end
  end
end
return {'ok', record}
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


def _stamp() -> str:
    return os.urandom(8).hex()


def _state(raw: bytes | None) -> np.ndarray | None:
    return None if raw is None else state_from_bytes(raw)


class RedisStore(Timed):
    """Sessions in a Redis shared by the replicas (redis-py's asyncio client). Each call is
    bounded by ``timeout_s`` (the connect and socket timeouts, and the whole call, one
    reconnect included); a Redis error or timeout is ``StoreUnavailable`` (503). The
    advances and finishes of one turn of the event loop share one pipeline: a round trip
    can cost the service more CPU than a chunk's share of its batch, and the chunks of a
    batch all write at once."""

    kind = "redis"
    remote = True  # a read is a round trip

    def __init__(self, url: str, *, prefix: str = "orthornn:", max_sessions: int,
                 idle_timeout_s: float, timeout_s: float = 0.5, max_ended: int = 10_000,
                 metrics: Metrics | None = None):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        check_store_url(url)
        self.url = redact(url)
        self.prefix = prefix
        self.max_sessions = max_sessions
        self.max_ended = max_ended
        self.idle_timeout_s = idle_timeout_s
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._ttl_ms = max(1, round(idle_timeout_s * 1000))
        self._down = False  # the last call failed (failures are logged once per outage)
        self._index = f"{prefix}sessions"
        self._ended = f"{prefix}ended"
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
        # advances queued in this turn of the event loop, and the pipelines sending them
        self._queued: list[tuple[list, asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()

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
        stamp = fields.get(b"stamp")
        secret = fields.get(b"secret")
        return SessionRecord(
            id=sid, model=fields[b"model"].decode(), version=int(fields[b"version"]),
            state=_state(fields.get(b"state")), position=int(fields[b"position"]),
            previous_state=_state(fields.get(b"previous_state")),
            previous_position=None if previous is None else int(previous),
            last_used=int(fields[b"last_used"]) / 1000, ended=b"ended" in fields,
            stamp=None if stamp is None else stamp.decode(),
            secret=None if secret is None else secret.decode())

    async def create(self, sid: str, model: str, version: int,
                     secret: str | None = None) -> SessionRecord:
        stamp = _stamp()
        async with self._call("create"):
            reply = await self._create(keys=[self._key(sid), self._ended, self._index],
                                       args=[sid, model, int(version), self.max_sessions,
                                             self._ttl_ms, stamp, secret or ""])
        if reply[0] == b"open":
            raise exists(sid)
        if reply[0] == b"full":
            raise limit(sid, self.max_sessions)
        return SessionRecord(sid, model, int(version), None, 0, None, None,
                             int(reply[1]) / 1000, stamp=stamp, secret=secret)

    async def get(self, sid: str) -> SessionRecord:
        async with self._call("get"):
            fields = await self._client.hgetall(self._key(sid))
        if not fields:
            raise unknown(sid, self.idle_timeout_s)
        return self._from_hash(sid, fields)

    async def advance(self, sid: str, expected_position: int, state: np.ndarray,
                      steps: int, stamp: str | None = None) -> SessionRecord:
        return await self._step("advance", sid, expected_position, state, steps, stamp)

    async def finish(self, sid: str, expected_position: int, state: np.ndarray,
                     steps: int, stamp: str | None = None) -> SessionRecord:
        return await self._step("finish", sid, expected_position, state, steps, stamp)

    async def _step(self, operation: str, sid: str, expected_position: int,
                    state: np.ndarray, steps: int, stamp: str | None) -> SessionRecord:
        check_counts(expected_position, steps)
        data = state_bytes(state)
        async with self._call(operation):
            reply = await self._queue_advance(
                [self._key(sid), self._ended, self._index, sid, int(expected_position), data,
                 int(steps), self._ttl_ms, int(operation == "finish"), _stamp(), stamp or "",
                 self.max_ended, f"{self.prefix}session:"])
        if reply[0] == b"gone":
            raise unknown(sid, self.idle_timeout_s)
        if reply[0] == b"stale":
            raise StaleRecord(sid)
        if reply[0] == b"conflict":
            raise position_conflict(sid, expected_position, int(reply[1]))
        flat = reply[1]
        return self._from_hash(sid, dict(zip(flat[::2], flat[1::2], strict=True)))

    def _queue_advance(self, keys_and_args: list) -> asyncio.Future:
        """ADVANCE_LUA on KEYS_AND_ARGS (its three keys first), sent in one pipeline with the
        others queued in this turn of the event loop: the chunks of one batch end in one
        turn, and their writes then cost one write and one read of the socket, not one
        each. The future is the reply; a caller that gives up cancels it."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queued.append((keys_and_args, future))
        if len(self._queued) == 1:
            loop.call_soon(self._send_queued)
        return future

    def _send_queued(self) -> None:
        queued, self._queued = self._queued, []
        task = asyncio.get_running_loop().create_task(self._pipeline(queued))
        self._sending.add(task)  # referenced until done
        task.add_done_callback(self._sending.discard)

    async def _pipeline(self, queued: list[tuple[list, asyncio.Future]]) -> None:
        from redis.exceptions import NoScriptError

        try:
            async with asyncio.timeout(self.timeout_s):
                replies = await self._evalsha_all([k for k, _ in queued])
                if any(isinstance(r, NoScriptError) for r in replies):  # Redis restarted
                    await self._client.script_load(ADVANCE_LUA)
                    again = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
                    for i, reply in zip(again, await self._evalsha_all(
                            [queued[i][0] for i in again]), strict=True):
                        replies[i] = reply
        except Exception as error:  # every caller fails as its own call would
            for _, future in queued:
                if not future.done():
                    future.set_exception(error)
            return
        except BaseException:  # cancelled (the store closes)
            for _, future in queued:
                future.cancel()
            raise
        for (_, future), reply in zip(queued, replies, strict=True):
            if not future.done():
                if isinstance(reply, Exception):
                    future.set_exception(reply)
                else:
                    future.set_result(reply)

    async def _evalsha_all(self, calls: list[list]) -> list:
        pipe = self._client.pipeline(transaction=False)
        for keys_and_args in calls:
            pipe.evalsha(self._advance.sha, 3, *keys_and_args)
        return await pipe.execute(raise_on_error=False)

    async def delete(self, sid: str) -> bool:
        async with self._call("delete"), self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(sid))
            pipe.zrem(self._index, sid)
            pipe.zrem(self._ended, sid)
            deleted, _, _ = await pipe.execute()
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
        for task in list(self._sending):
            task.cancel()
        with contextlib.suppress(Exception):
            await self._client.aclose()
