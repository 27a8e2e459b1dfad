"""The session store (service/sessions/store.py): one contract, run against MemoryStore and
against RedisStore on a real redis-server (tests/cluster.py); what only a shared store can
do (replicas racing on one session, one session limit for all, prefixes, a Redis that dies
or stalls) against Redis; and the load-balancer fixture (haproxy) proven on tiny backends
and on `orthornn serve` replicas."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import signal
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from orthornn.service import request
from orthornn.service.errors import (
    ClientError,
    Conflict,
    NotFound,
    Overloaded,
    PositionConflict,
    ServiceError,
    SessionExists,
    SessionLimit,
    StoreUnavailable,
    UnknownSession,
    VersionGone,
)
from orthornn.service.metrics import Metrics
from orthornn.service.sessions.manager import Sessions
from orthornn.service.sessions.memory import MemoryStore
from orthornn.service.sessions.redis import RedisStore
from orthornn.service.sessions.store import SessionStore, StaleRecord, open_store
from orthornn.service.settings import Settings
from pydantic import ValidationError

from .. import cluster
from ..cluster import HAProxy, RedisServer, TinyBackend, replicas

redis_server = cluster.redis_server  # the fixture: a fresh redis-server per test

MODEL = "adding"


def vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


@pytest.fixture(params=["memory", "redis"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def url(kind, tmp_path) -> str:
    """The session_store value of the kind under test ("memory" or a fresh Redis's URL)."""
    if kind == "memory":
        yield "memory"
        return
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


@contextlib.asynccontextmanager
async def stores(url: str, metrics: Metrics | None = None
                 ) -> AsyncIterator[Callable[..., SessionStore]]:
    """make(**settings) -> a store opened by open_store on SESSION_STORE = URL (each one
    a replica's own client); all closed at the end."""
    opened: list[SessionStore] = []

    def make(**settings) -> SessionStore:
        values = {"repo": Path("/models"), "session_store": url, **settings}
        opened.append(open_store(Settings(**values), metrics))
        return opened[-1]
    try:
        yield make
    finally:
        for store in opened:
            await store.close()


def run(coro):
    return asyncio.run(coro)


# -- the contract, both stores ---------------------------------------------------------------

def test_open_store_picks_the_store(url, kind):
    async def main():
        async with stores(url) as make:
            store = make(session_key_prefix="x:", session_store_timeout_s=0.25)
            assert store.kind == kind
            assert isinstance(store, MemoryStore if kind == "memory" else RedisStore)
            if isinstance(store, RedisStore):
                assert (store.prefix, store.timeout_s) == ("x:", 0.25)
            await store.ping()
    run(main())


def test_the_store_keeps_a_digest_of_the_secret_and_a_bounded_number_of_ended(url, kind):
    """A session's record keeps the digest its start gave (never the secret itself: the
    store is given only the digest), an ended one too; at most max_ended_sessions ended
    records are kept, the oldest ended dropped first, while open sessions are untouched and
    an id ended and started again is not counted as ended."""
    from orthornn.service.sessions import owners

    async def main():
        async with stores(url) as make:
            store = make(max_ended_sessions=3)
            secret = owners.new_secret()
            record = await store.create("owned", MODEL, 4, owners.digest(secret))
            assert record.secret == owners.digest(secret) != secret
            assert (await store.get("owned")).secret == owners.digest(secret)
            assert owners.matches(record.secret, owners.digest(secret))
            assert not owners.matches(record.secret, owners.digest("another"))
            assert not owners.matches(None, owners.digest(secret))
            ended = await store.finish("owned", 0, vec(1.0), 1)
            assert ended.ended and ended.secret == owners.digest(secret)
            await store.create("open", MODEL, 4)
            for i in range(6):
                await store.create(f"e{i}", MODEL, 4)
                await store.finish(f"e{i}", 0, vec(float(i)), 1)
                if i == 0:  # e0 ends and starts again: open, no more among the ended
                    await store.create("e0", MODEL, 4)
            for sid in ("owned", "e1", "e2"):  # the oldest ended: dropped
                with pytest.raises(UnknownSession):
                    await store.get(sid)
            for sid in ("e3", "e4", "e5"):
                assert (await store.get(sid)).ended
            assert not (await store.get("e0")).ended
            assert not (await store.get("open")).ended
            assert await store.count() == 2
            if kind == "redis":
                assert store._client is not None  # the ended set holds three ids
                assert await store._client.zcard(store._ended) == 3
            none = make(max_ended_sessions=0, session_key_prefix="none:")
            await none.create("x", MODEL, 4)
            assert (await none.finish("x", 0, vec(1.0), 1)).ended  # answered, then dropped
            with pytest.raises(UnknownSession):
                await none.get("x")
    run(main())


def test_create_get_delete(url):
    async def main():
        async with stores(url) as make:
            store = make()
            record = await store.create("s1", MODEL, 4)
            assert (record.id, record.model, record.version, record.position) == \
                ("s1", MODEL, 4, 0)
            assert record.state is None and record.previous_state is None
            assert record.previous_position is None
            assert abs(record.last_used - time.time()) < 5
            got = await store.get("s1")
            assert (got.model, got.version, got.position, got.state) == (MODEL, 4, 0, None)
            with pytest.raises(SessionExists) as again:
                await store.create("s1", MODEL, 5)
            assert isinstance(again.value, Conflict) and again.value.status == 409
            assert "'s1' is already open" in str(again.value)
            assert await store.count() == 1
            assert await store.versions_in_use() == {MODEL: {4}}
            assert await store.delete("s1") is True
            assert await store.delete("s1") is False
            with pytest.raises(UnknownSession) as gone:
                await store.get("s1")
            assert isinstance(gone.value, NotFound) and gone.value.status == 404
            assert await store.count() == 0 and await store.versions_in_use() == {}
            await store.create("s1", MODEL, 5)  # an ended id can start again
            assert (await store.get("s1")).version == 5
    run(main())


def test_advance_applies_and_keeps_the_previous_state(url):
    async def main():
        async with stores(url) as make:
            store = make()
            await store.create("s", MODEL, 1)
            first = vec(0.5, -1.25, 3e-8, 7.0)
            r1 = await store.advance("s", 0, first, 3)
            assert r1.position == 3 and r1.previous_position == 0
            assert r1.previous_state is None  # the first chunk started from the initial state
            assert r1.state.dtype == np.float32
            np.testing.assert_array_equal(r1.state, first)
            second = vec(1.0, 2.0, -0.0, np.float32(1) / 3)
            r2 = await store.advance("s", 3, second, 2)
            assert (r2.position, r2.previous_position) == (5, 3)
            np.testing.assert_array_equal(r2.state, second)  # bit for bit: float32 bytes
            np.testing.assert_array_equal(r2.previous_state, first)
            assert r2.last_used >= r1.last_used
            got = await store.get("s")
            assert (got.position, got.previous_position, got.version) == (5, 3, 1)
            np.testing.assert_array_equal(got.state, second)
            np.testing.assert_array_equal(got.previous_state, first)
            # a record is the caller's: changing its arrays changes nothing stored
            got.state[:] = 9
            np.testing.assert_array_equal((await store.get("s")).state, second)
            # a float64 state is stored as float32; a matrix is refused
            r3 = await store.advance("s", 5, np.array([0.1, 0.2, 0.3, 0.4]), 1)
            assert r3.state.dtype == np.float32 and r3.position == 6
            with pytest.raises(ValueError, match="vector"):
                await store.advance("s", 6, np.zeros((2, 2), np.float32), 1)
            with pytest.raises(ValueError, match="steps"):
                await store.advance("s", 6, first, -1)
            with pytest.raises(UnknownSession):
                await store.advance("nope", 0, first, 1)
    run(main())


def test_a_stale_position_is_a_conflict_naming_the_current_one(url):
    async def main():
        async with stores(url) as make:
            store = make()
            await store.create("s", MODEL, 1)
            await store.advance("s", 0, vec(1, 2), 3)
            with pytest.raises(PositionConflict) as stale:
                await store.advance("s", 0, vec(8, 9), 3)  # a retry of the same chunk
            assert stale.value.status == 409 and isinstance(stale.value, Conflict)
            assert stale.value.position == 3
            assert "is at position 3, not 0" in str(stale.value)
            with pytest.raises(PositionConflict, match="at position 3, not 7"):
                await store.advance("s", 7, vec(8, 9), 1)
            record = await store.get("s")  # unchanged: nothing applied twice
            assert record.position == 3 and record.previous_position == 0
            np.testing.assert_array_equal(record.state, vec(1, 2))
    run(main())


def test_concurrent_advances_at_one_position_apply_once(url, kind):
    """Eight chunks claim position 0 at once: one applies, seven get PositionConflict; with
    Redis also from two replicas (two clients of their own)."""
    async def race(on: list[SessionStore], sid: str):
        await on[0].create(sid, MODEL, 1)
        results = await asyncio.gather(
            *(on[i % len(on)].advance(sid, 0, vec(i, i), 2) for i in range(8)),
            return_exceptions=True)
        won = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
        lost = [r for r in results if isinstance(r, BaseException)]
        assert len(won) == 1, results
        assert all(isinstance(e, PositionConflict) and e.position == 2 for e in lost), lost
        ((i, _),) = won
        final = await on[-1].get(sid)
        assert final.position == 2 and final.previous_position == 0
        np.testing.assert_array_equal(final.state, vec(i, i))

    async def main():
        async with stores(url) as make:
            one = make()
            await race([one], "one")
            if kind == "redis":
                await race([one, make()], "two")
    run(main())


def test_idle_sessions_expire_and_free_the_limit_and_their_versions(url, kind):
    """Idle expiry is the store's own (Redis TTL, lazy in memory): an expired session is
    gone, counts no more against max_sessions and pins no version; a session in use stays.

    Turn by turn, "busy" is advanced and "old" only read, until "old" has expired: no
    sleep guessed at either deadline. The memory store runs on an injected clock, a turn
    0.25 s of it (exact); Redis on its own clock, polled: "old" goes no earlier than its
    timeout, and "busy", advanced at every turn, stays unless one turn (a 50 ms pause and
    two calls) takes the whole 1 s."""
    async def main():
        async with stores(url) as make:
            now = [0.0]
            if kind == "memory":
                store = MemoryStore(max_sessions=2, idle_timeout_s=1.0,
                                    clock=lambda: now[0])
            else:
                store = make(session_idle_timeout_s=1.0, max_sessions=2)
            created = time.monotonic()
            await store.create("old", MODEL, 1)
            await store.create("busy", MODEL, 2)
            assert await store.versions_in_use() == {MODEL: {1, 2}}
            with pytest.raises(SessionLimit) as full:
                await store.create("third", MODEL, 3)
            assert isinstance(full.value, Overloaded) and full.value.status == 429
            assert full.value.headers == {"Retry-After": "1"}
            assert "maximum of 2 open sessions" in str(full.value)
            turns = 0
            while True:
                if kind == "memory":
                    now[0] += 0.25
                else:
                    assert time.monotonic() - created < 30, "old never expired"
                    await asyncio.sleep(0.05)
                await store.advance("busy", turns, vec(1), 1)  # renews busy's idle expiry
                turns += 1
                try:
                    await store.get("old")  # a read does not
                except UnknownSession as gone:
                    assert "idle for over 1 s" in str(gone)
                    break
            if kind == "memory":  # gone on the turn its idle time reached 1 s, not before
                assert turns == 4 and now[0] == 1.0
            else:  # Redis's clock and this one run at one rate: not before 1 s
                assert time.monotonic() - created >= 0.95
            assert await store.count() == 1
            assert await store.versions_in_use() == {MODEL: {2}}
            with pytest.raises(UnknownSession, match="idle for over 1 s"):
                await store.get("old")
            with pytest.raises(UnknownSession):
                await store.advance("old", 0, vec(1), 1)
            await store.create("third", MODEL, 3)
            assert await store.versions_in_use() == {MODEL: {2, 3}}
            assert (await store.get("busy")).position == turns
    run(main())


def test_a_stamped_advance_applies_only_to_that_record(url):
    """Every write gives the record a new stamp; advance/finish given a stamp apply only
    while the session is still that very record: not after another write, nor to a
    session ended or started again at the same position (StaleRecord); an ended one is
    UnknownSession as without a stamp."""
    async def main():
        async with stores(url) as make:
            store = make()
            created = await store.create("s", MODEL, 1)
            first = await store.advance("s", 0, vec(1), 2, created.stamp)
            assert created.stamp and first.stamp and first.stamp != created.stamp
            assert (await store.get("s")).stamp == first.stamp
            second = await store.advance("s", 2, vec(2), 1)  # another replica's write
            with pytest.raises(StaleRecord):
                await store.advance("s", 3, vec(9), 1, first.stamp)
            assert (await store.get("s")).position == 3  # nothing applied
            assert (await store.advance("s", 3, vec(3), 1, second.stamp)).position == 4
            await store.delete("s")
            again = await store.create("s", MODEL, 2)  # the same id and position, anew
            with pytest.raises(StaleRecord):
                await store.advance("s", 0, vec(9), 1, created.stamp)
            ended = await store.finish("s", 0, vec(4), 1, again.stamp)
            assert ended.ended
            with pytest.raises(UnknownSession):
                await store.advance("s", 1, vec(5), 1, ended.stamp)
    run(main())


# -- what only a shared store does --------------------------------------------------------------

def test_two_replicas_share_one_session_limit(redis_server):
    async def main():
        async with stores(redis_server.url) as make:
            a, b = make(max_sessions=3), make(max_sessions=3)
            await a.create("a1", MODEL, 1)
            await a.create("a2", MODEL, 1)
            await b.create("b1", MODEL, 2)
            for store in (a, b):
                with pytest.raises(SessionLimit):
                    await store.create("more", MODEL, 1)
            assert await a.count() == await b.count() == 3
            assert await a.versions_in_use() == {MODEL: {1, 2}}
            assert await a.delete("b1")  # a session ends on the other replica
            with pytest.raises(UnknownSession):
                await b.get("b1")
            await a.create("a3", MODEL, 1)
            await a.delete("a1"), await a.delete("a2"), await a.delete("a3")
            # racing creates of many replicas: exactly max_sessions get in
            results = await asyncio.gather(
                *((a, b)[i % 2].create(f"r{i}", MODEL, 1) for i in range(10)),
                return_exceptions=True)
            assert sum(not isinstance(r, BaseException) for r in results) == 3, results
            assert all(isinstance(r, SessionLimit) for r in results
                       if isinstance(r, BaseException))
            # one session continued by the other replica
            sid = next(f"r{i}" for i, r in enumerate(results) if not isinstance(r, Exception))
            await a.advance(sid, 0, vec(1, 2), 4)
            record = await b.advance(sid, 4, vec(3, 4), 1)
            assert record.position == 5
            np.testing.assert_array_equal(record.previous_state, vec(1, 2))
    run(main())


def test_the_advances_of_one_turn_share_one_pipeline(redis_server):
    """Advances and finishes started in one turn of the event loop (the chunks of one
    batch) reach Redis in one pipeline, each with its own answer: applied, a conflict, a
    session gone, a stale stamp."""
    async def main():
        async with stores(redis_server.url) as make:
            store = make()
            for i in range(5):
                await store.create(f"s{i}", MODEL, 1)
            old = await store.advance("s4", 0, vec(1), 1)
            await store.advance("s4", 1, vec(2), 1)
            sent: list[int] = []
            evalsha_all = store._evalsha_all

            async def counted(calls):
                sent.append(len(calls))
                return await evalsha_all(calls)
            store._evalsha_all = counted
            results = await asyncio.gather(
                store.advance("s0", 0, vec(1), 2), store.finish("s1", 0, vec(2), 3),
                store.advance("s2", 0, vec(3), 1), store.advance("s2", 0, vec(4), 1),
                store.advance("s3", 7, vec(5), 1), store.advance("nope", 0, vec(6), 1),
                store.advance("s4", 2, vec(7), 1, old.stamp), return_exceptions=True)
            assert sent == [7]
            s0, s1, s2, s2_again, s3, nope, s4 = results
            assert (s0.position, s1.position, s1.ended, s2.position) == (2, 3, True, 1)
            assert isinstance(s2_again, PositionConflict) and s2_again.position == 1
            assert isinstance(s3, PositionConflict) and s3.position == 0
            assert isinstance(nope, UnknownSession) and isinstance(s4, StaleRecord)
            np.testing.assert_array_equal((await store.get("s2")).state, vec(3))
    run(main())


def test_key_prefixes_isolate_deployments(redis_server):
    import redis

    async def main():
        async with stores(redis_server.url) as make:
            blue = make(session_key_prefix="blue:", max_sessions=1)
            green = make(session_key_prefix="green:", max_sessions=1)
            await blue.create("s", MODEL, 1)
            await green.create("s", MODEL, 2)  # same id, same Redis, another deployment
            assert (await blue.get("s")).version == 1 and (await green.get("s")).version == 2
            with pytest.raises(SessionLimit):
                await blue.create("t", MODEL, 1)
            await blue.advance("s", 0, vec(1), 1)
            assert (await green.get("s")).position == 0
            assert await green.delete("s") and (await blue.get("s")).position == 1
    run(main())
    keys = sorted(redis.Redis(port=redis_server.port).keys())
    assert keys == [b"blue:session:s", b"blue:sessions"], keys  # green's index: empty, gone


def test_the_redis_layout(redis_server):
    """The documented layout: a hash per session (state as float32 little-endian bytes) with
    the idle timeout as its TTL, and the index sorted set scored by the same expiry."""
    import redis

    async def main():
        async with stores(redis_server.url) as make:
            store = make(session_idle_timeout_s=30)
            await store.create("s", MODEL, 7)
            await store.advance("s", 0, vec(1.5, -2), 3)
            await store.advance("s", 3, vec(4, 8), 2)
    run(main())
    raw = redis.Redis(port=redis_server.port)
    fields = raw.hgetall("orthornn:session:s")
    assert set(fields) == {b"model", b"version", b"position", b"state", b"previous_state",
                           b"previous_position", b"last_used", b"stamp"}
    assert len(fields[b"stamp"]) == 16 and int(fields[b"stamp"], 16) >= 0
    assert (fields[b"model"], fields[b"version"], fields[b"position"],
            fields[b"previous_position"]) == (b"adding", b"7", b"5", b"3")
    assert fields[b"state"] == np.array([4, 8], "<f4").tobytes()
    assert fields[b"previous_state"] == np.array([1.5, -2], "<f4").tobytes()
    assert 29_000 < raw.pttl("orthornn:session:s") <= 30_000
    ((member, score),) = raw.zrange("orthornn:sessions", 0, -1, withscores=True)
    assert member == b"s"
    assert abs(score - (int(fields[b"last_used"]) + 30_000)) < 1
    assert abs(score / 1000 - 30 - time.time()) < 5


def _unavailable_within(bound: float, started: float, error: StoreUnavailable) -> None:
    assert time.monotonic() - started < bound
    assert isinstance(error, ServiceError) and error.status == 503
    assert error.headers == {"Retry-After": "1"}
    assert "session store" in str(error) and "retry" in str(error)


STORE_CALLS: list[tuple[str, Callable]] = [
    ("create", lambda s: s.create("new", MODEL, 1)),
    ("get", lambda s: s.get("s")),
    ("advance", lambda s: s.advance("s", 0, vec(1), 1)),
    ("delete", lambda s: s.delete("s")),
    ("count", lambda s: s.count()),
    ("versions_in_use", lambda s: s.versions_in_use()),
    ("ping", lambda s: s.ping()),
]


def test_a_dead_redis_is_503_within_the_timeout_and_a_restarted_one_serves(redis_server):
    """redis-server killed: every call raises StoreUnavailable (503, Retry-After) within the
    bound, counted in orthornn_session_store_errors; started again on the same port
    (empty: no persistence), the same clients open new sessions."""
    metrics = Metrics()

    async def main():
        async with stores(redis_server.url, metrics) as make:
            store = make(session_store_timeout_s=0.3)
            await store.create("s", MODEL, 1)
            redis_server.stop()  # SIGKILL
            for name, call in STORE_CALLS:
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as down:
                    await call(store)
                _unavailable_within(2.0, started, down.value)
                assert metrics.registry.get_sample_value(
                    "orthornn_session_store_errors_total",
                    {"store": "redis", "operation": name}) == 1, name
            redis_server.start()
            record = await store.create("after", MODEL, 2)
            assert record.position == 0 and await store.count() == 1
            await store.advance("after", 0, vec(1), 1)
    run(main())
    assert metrics.registry.get_sample_value(
        "orthornn_session_store_duration_seconds_count",
        {"store": "redis", "operation": "advance"}) == 2


def test_a_stalled_redis_is_503_within_the_timeout(redis_server):
    """redis-server stopped (SIGSTOP: connections open, nothing answers) is the slow case:
    StoreUnavailable within the bound, never a hang. Resumed, the calls answer again, each
    its own answer (no reply of a timed-out call is taken for another's). A call that timed
    out may still have been applied once Redis resumes: a client retrying such a chunk meets
    PositionConflict, and previous_* answer it again."""
    async def main():
        async with stores(redis_server.url) as make:
            store = make(session_store_timeout_s=0.3)
            await store.create("s", MODEL, 1)
            os.kill(redis_server.proc.pid, signal.SIGSTOP)
            try:
                for _, call in STORE_CALLS:
                    started = time.monotonic()
                    with pytest.raises(StoreUnavailable) as slow:
                        await call(store)
                    _unavailable_within(2.0, started, slow.value)
                    assert "no answer within 0.3 s" in str(slow.value)
                fresh = make(session_store_timeout_s=0.3)  # a new client, a new connection
                started = time.monotonic()
                with pytest.raises(StoreUnavailable) as slow:
                    await fresh.get("s")
                _unavailable_within(2.0, started, slow.value)
            finally:
                os.kill(redis_server.proc.pid, signal.SIGCONT)
            for client in (store, fresh):
                sid = f"t-{id(client)}"
                assert (await client.create(sid, MODEL, 9)).position == 0
                assert (await client.advance(sid, 0, vec(1, 2), 3)).position == 3
                record = await client.get(sid)
                assert (record.version, record.position) == (9, 3)
                assert 9 in (await client.versions_in_use())[MODEL]
                assert await client.count() >= 2
                await client.ping()
    run(main())


def test_a_cancelled_store_call_is_cancelled(redis_server):
    """Cancelling a task inside a Redis call (a client that went away, shutdown cancelling
    the reconcile task) raises CancelledError in it, wherever the call is. With a socket
    timeout, redis-py sends through asyncio.wait_for, which on Python 3.11 returns the
    send's result instead when the cancel arrives as the send completes (CPython gh-86296):
    about half of these cancels were lost, and a lost one hung shutdown."""
    async def main():
        async with stores(redis_server.url) as make:
            store = make()
            await store.create("s", MODEL, 1)
            delays = itertools.cycle([i * 2e-5 for i in range(20)])  # 0 to 0.4 ms
            cancelled = lost = 0
            while cancelled < 300:
                task = asyncio.ensure_future(store.get("s"))
                await asyncio.sleep(next(delays))
                if not task.cancel():  # already answered: not a cancel
                    await task
                    continue
                cancelled += 1
                try:
                    await task
                    lost += 1
                except asyncio.CancelledError:
                    pass
            assert lost == 0, f"{lost} of {cancelled} cancels were lost"
            assert (await store.get("s")).version == 1  # the client still answers
    run(main())


def test_closing_sessions_ends_the_reconcile_task_even_if_a_cancel_is_lost():
    """Sessions.close() returns although the store swallows the reconcile task's
    cancellation (as a library may): the task also stops at its next turn."""
    class Swallowing(MemoryStore):
        swallowed = 0
        inside = False  # the reconcile task has entered versions_in_use

        async def versions_in_use(self):
            self.inside = True
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                if self.swallowed:
                    raise
                self.swallowed += 1  # once, as a library's race does
            return {}

    class NoVersions:
        def retain(self, in_use, since):
            return []

    async def main():
        store = Swallowing(max_sessions=4, idle_timeout_s=60)
        sessions = Sessions(store, NoVersions(),  # type: ignore[arg-type]
                            reconcile_interval_s=0.01)
        sessions.start()
        deadline = time.monotonic() + 10
        while not store.inside:  # until the task is inside versions_in_use, in its sleep:
            assert time.monotonic() < deadline  # each poll is one turn of the loop, so the
            await asyncio.sleep(0)  # task has not left that 50 ms sleep when close() cancels
        started = time.monotonic()
        await asyncio.wait_for(sessions.close(), 5)
        assert time.monotonic() - started < 1.0  # the turn it was in, and no more
        assert store.swallowed == 1
    run(main())


def test_a_password_protected_redis(tmp_path):
    with RedisServer(tmp_path / "redis", password="s3cret-pass") as server:
        async def main():
            async with stores(server.url) as make:
                store = make()
                await store.create("s", MODEL, 1)
                assert (await store.get("s")).version == 1
                assert "s3cret" not in store.url and ":***@" in store.url
                wrong = make(session_store=server.url.replace("s3cret-pass", "wrong"))
                with pytest.raises(StoreUnavailable) as refused:
                    await wrong.get("s")
                assert "s3cret" not in str(refused.value)
        run(main())


# -- the manager's cached records: one round trip per chunk, the answers of a read each time --

@dataclass
class FakeVersion:
    name: str
    version: int
    retired: bool = False


class NoRollouts:
    def ended_on_failures(self, name, version):
        return None


class FakeRegistry:
    """Versions 1 and 2 of MODEL loaded (1 the default); what Sessions asks of a registry."""

    def __init__(self):
        self.versions = {v: FakeVersion(MODEL, v) for v in (1, 2)}
        self.rollouts = NoRollouts()

    def route(self, name, key):  # no rollout: new sessions start on the default version
        return None

    def acquire(self, name, version=None):
        if name != MODEL:
            raise NotFound(f"no model {name!r}")
        return self.versions[1 if version is None else version]

    def session_version(self, name, version):
        return self.versions.get(version) if name == MODEL else None

    def load_session_version(self, name, version):
        raise VersionGone(f"version {version} of {name!r}")

    def keep(self, mv): ...

    def release(self, mv): ...

    def retain(self, in_use, since): ...


def toy_chunk(inputs: list[float]):
    """A chunk of a toy recurrence: state (sum, count) scaled by the version, so that an
    answer shows which version and which state it came from. 99 fails on version 1."""
    async def run(mv, state):
        if 99 in inputs and mv.version == 1:
            raise ClientError("version 1 takes no 99")
        h = np.zeros(2, np.float32) if state is None else state
        new = np.array([h[0] + mv.version * sum(inputs), h[1] + len(inputs)], np.float32)
        return [float(x) for x in new], new, len(inputs)
    return run


#: the secret the script's client chose for its sessions (sent with every chunk)
SECRET = "script-client-secret-0123456789"

# (replica, session, inputs, options) in order; ("delete", replica, session) ends one
# from that replica's store; ("sleep", seconds) lets sessions expire
SCRIPT: list[tuple] = [
    ("a", "s", [1, 2], {"start": True, "position": 0}),
    ("a", "s", [3], {"position": 2}),          # from a's cached record
    ("b", "s", [4], {}),                       # b reads it
    ("a", "s", [5], {}),                       # a's record is stale: read, applied at 4
    ("a", "s", [6], {"position": 4}),          # a retry of the chunk at 4
    ("b", "s", [6], {"position": 3}),          # stale: 409
    ("b", "s", [7, 8], {"position": 5}),
    ("a", "s", [9], {"position": 7}),
    ("b", "s", [1], {"position": 8}),
    ("a", "s", [2], {"position": 8}),          # a's cache at 8: a retry of b's chunk
    ("a", "s", [2], {"version": 2}),           # another version: 409
    ("a", "s", [2], {"model": "other"}),       # another model: 400
    ("b", "s", [3], {"position": 9, "end": True}),
    ("a", "s", [4], {}),                       # a's record says open: ended (404)
    ("a", "s", [3], {"position": 9}),          # a retry of the final chunk
    ("a", "s", [4], {"start": True, "position": 0, "version": 2}),  # started again
    ("a", "s2", [1], {"start": True}),
    ("delete", "b", "s2"),
    ("b", "s2", [1], {"start": True, "version": 2}),
    ("a", "s2", [5], {}),                      # a's record: version 1, position 1: stale
    ("a", "s3", [1], {"start": True}),
    ("delete", "b", "s3"),
    ("b", "s3", [1], {"start": True, "version": 2}),
    ("a", "s3", [99], {}),                     # fails on a's cached version only
    ("a", "s4", [1], {"start": True}),
    ("a", "s4", [99], {}),                     # fails on the session's version: 400
    ("a", "s4", [2], {}),
    ("delete", "b", "s4"),
    ("a", "s4", [3], {}),                      # deleted by b: 404
    ("a", "s5", [1], {"start": True}),
    ("sleep", 2.4),
    ("a", "s5", [2], {"position": 1}),         # expired: 404
    ("a", "s", [5], {}),                       # expired too (started anew at 16)
]


async def play_script(stores_by_replica: dict[str, SessionStore]) -> tuple[list, list]:
    """SCRIPT's outcomes on two Sessions (replicas a and b) over STORES_BY_REPLICA, and the
    store reads each chunk made."""
    replicas = {name: Sessions(store, FakeRegistry())  # type: ignore[arg-type]
                for name, store in stores_by_replica.items()}
    reads = [0]
    for store in set(stores_by_replica.values()):
        get = store.get

        async def counted(sid, get=get):
            reads[0] += 1
            return await get(sid)
        store.get = counted
    outcomes, per_chunk = [], []
    for step in SCRIPT:
        if step[0] == "sleep":
            await asyncio.sleep(step[1])
            continue
        if step[0] == "delete":
            await stores_by_replica[step[1]].delete(step[2])
            continue
        replica, sid, inputs, options = step
        options = dict(options)
        before = reads[0]
        with request.opened() as held:
            try:
                applied = await replicas[replica].chunk(
                    sid, options.pop("model", MODEL), toy_chunk(inputs),
                    secret=options.pop("secret", SECRET), **options)
                outcomes.append(("ok", applied, (held.model, held.version)))
            except ServiceError as e:
                outcomes.append((type(e).__name__, e.status, str(e),
                                 getattr(e, "position", None), (held.model, held.version)))
        per_chunk.append(reads[0] - before)
    return outcomes, per_chunk


def test_replicas_answer_from_cached_records_as_from_reads(url, kind):
    """Two replicas (two Sessions over one store) alternate on sessions, with and without
    positions, retries, another version, ends, deletes, sessions started again at the same
    position, expiry: every answer (and the version a request held) is the same whether a
    replica computes a chunk from the record its last write returned (a remote store) or
    reads the store every time; the cached run reads far less."""
    async def main(remote: bool) -> tuple[list, int]:
        async with stores(url) as make:
            if kind == "memory":  # one store for both replicas, its reads made to count
                shared = make(session_idle_timeout_s=2)
                pair = {"a": shared, "b": shared}
            else:
                pair = {r: make(session_idle_timeout_s=2) for r in "ab"}
            for store in pair.values():
                store.remote = remote
            return await play_script(pair)
    cached, cached_reads = run(main(remote=True))
    fresh, fresh_reads = run(main(remote=False))
    assert cached == fresh
    statuses = [o[0] for o in fresh]
    assert statuses.count("PositionConflict") == statuses.count("StateConflict") == 1
    assert statuses.count("UnknownSession") == 4 and statuses.count("ClientError") == 2
    assert (fresh[3][1].position, fresh[3][1].answer) == (5, [15, 5])  # a's stale record
    assert (fresh[9][1].position, fresh[9][1].answer) == (9, [41, 9])  # a retry of b's
    assert fresh[14][1] == fresh[12][1]  # the final chunk answered again
    assert (fresh[18][1].version, fresh[18][1].position) == (2, 2)  # s2 anew, on 2
    assert fresh[21][1].version == 2 and fresh[23][0] == "ClientError"
    starts = {i for i, step in enumerate(s for s in SCRIPT if s[0] in "ab")
              if step[3].get("start")}
    assert all(fresh_reads[i] == 1 for i in range(len(fresh)) if i not in starts)
    # a chunk after this replica's own write or read of the session: no read
    assert [cached_reads[i] for i in (1, 6, 12, 24)] == [0, 0, 0, 0]
    assert sum(cached_reads) < sum(fresh_reads)

# -- the setting ------------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    "", "redis", "Memory", "http://cache:6379", "memcached://cache:11211", "redis://",
    "redis://:6379", "redis://cache:port", "redis://cache:70000", "redis://cache:0",
    "redis://cache:6379/db1", "redis://cache:6379/0?socket_timeout=1", "redis://:hunter2@/0",
])
def test_bad_session_store_values_name_the_field(value):
    with pytest.raises(ValueError) as bad:
        Settings(repo="/models", session_store=value)
    assert isinstance(bad.value, ValidationError)
    assert "session_store" in str(bad.value)
    (error,) = bad.value.errors()
    assert error["loc"] == ("session_store",)
    message = error["msg"]  # what `orthornn serve` prints (commands.settings_from_args)
    assert "session_store" in message and "redis://[:PASSWORD@]HOST[:PORT][/DB]" in message
    assert '"memory"' in message and "hunter2" not in message
    # open_store checks the value too (settings made without validation)
    with pytest.raises(ValueError, match=r"^session_store: .*allowed: \"memory\""):
        open_store(Settings.model_construct(repo=Path("/models"), session_store=value,
                                            max_sessions=1, session_idle_timeout_s=1,
                                            session_key_prefix="p:",
                                            session_store_timeout_s=0.5))


@pytest.mark.parametrize("value", ["memory", "redis://cache", "redis://cache:6380/2",
                                   "redis://:pw@cache:6379/0", "rediss://user:pw@cache:6380",
                                   "redis://[::1]:6379"])
def test_good_session_store_values(value):
    assert Settings(repo="/models", session_store=value).session_store == value


def test_session_store_settings_from_the_environment_and_flags(monkeypatch):
    from orthornn.service.commands.serve import settings_from_args

    from orthornn.cli import build_parser

    monkeypatch.setenv("ORTHORNN_SESSION_STORE", "redis://:pw@cache:6379/1")
    settings = Settings(repo="/models")
    assert settings.session_store == "redis://:pw@cache:6379/1"
    assert (settings.session_key_prefix, settings.session_store_timeout_s) == ("orthornn:", 0.5)
    args = build_parser().parse_args(["serve", "--repo", "/m", "--session-store", "memory",
                                      "--session-key-prefix", "blue:",
                                      "--session-store-timeout-s", "0.2"])
    settings = settings_from_args(args)
    assert (settings.session_store, settings.session_key_prefix,
            settings.session_store_timeout_s) == ("memory", "blue:", 0.2)
    bad = build_parser().parse_args(["serve", "--repo", "/m", "--session-store", "redis:/x"])
    with pytest.raises(ValueError, match="session_store"):
        settings_from_args(bad)
    for field, value in (("session_key_prefix", "has space"),
                         ("session_store_timeout_s", 0)):
        with pytest.raises(ValidationError, match=field):
            Settings(repo="/models", **{field: value})


# -- the load balancer --------------------------------------------------------------------

def test_haproxy_round_robins_over_healthy_backends(tmp_path):
    with TinyBackend("a") as a, TinyBackend("b") as b, \
            HAProxy(tmp_path / "haproxy", [a.port, b.port], check_ms=100) as lb:
        lb.wait_states({"r0": "UP", "r1": "UP"})
        answers = [httpx.get(lb.url + "/x", timeout=5).text for _ in range(10)]
        assert sorted(answers) == ["a"] * 5 + ["b"] * 5
        assert all(x != y for x, y in itertools.pairwise(answers)), answers
        assert (a.hits, b.hits) == (5, 5)
        b.ready = False  # its health check fails: haproxy takes it out
        lb.wait_states({"r0": "UP", "r1": "DOWN"})
        assert {httpx.get(lb.url + "/x", timeout=5).text for _ in range(4)} == {"a"}
        b.ready = True
        lb.wait_states({"r0": "UP", "r1": "UP"})
        assert lb.proc.poll() is None
        pid = lb.proc.pid
    assert lb.proc.poll() is not None  # killed by its PID
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_serve_replicas_behind_haproxy(service_packages, tmp_path, redis_server):
    """The fixture the multi-replica tests build on: two `orthornn serve` processes given
    the shared store's setting, behind haproxy; both answer; one killed (SIGKILL), haproxy
    marks it down and every request is still answered."""
    from ..service_helpers import make_repo

    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    env = {"ORTHORNN_SESSION_STORE": redis_server.url}
    with replicas(repo, 2, env=env) as (r0, r1), \
            HAProxy(tmp_path / "haproxy", [r0.port, r1.port], check_ms=100) as lb:
        lb.wait_states({"r0": "UP", "r1": "UP"})
        body = {"model": "digits", "inputs": [[0.1, 0.2, 0.3]]}
        answers = [httpx.post(lb.url + "/predict", json=body, timeout=30)
                   for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert len({a.text for a in answers}) == 1
        assert r1.kill() == -signal.SIGKILL
        for _ in range(4):  # at once: a refused connection is redispatched to r0
            assert httpx.post(lb.url + "/predict", json=body, timeout=30).status_code == 200
        lb.wait_states({"r0": "UP", "r1": "DOWN"})
        assert r0.stop() == 0  # SIGTERM: drained and exited cleanly
        assert "Traceback" not in r0.output() + r1.output()


def test_idle_sessions_expire_and_10000_sessions_leave_memory_flat():
    """The memory store (the default): an idle session expires (counted), and rounds of
    10,000 sessions, started, advanced and ended, leave memory flat (ended records stay
    readable for a retried final chunk until their idle timeout, then go)."""
    metrics = Metrics()
    now = [0.0]
    store = MemoryStore(max_sessions=20_000, idle_timeout_s=10, clock=lambda: now[0])
    timed = MemoryStore(max_sessions=1, idle_timeout_s=10, metrics=metrics,
                        clock=lambda: now[0])

    async def rounds():
        await timed.create("idle", "m", 1)
        now[0] += 5
        assert await timed.count() == 1
        now[0] += 6
        assert await timed.count() == 0 and await timed.versions_in_use() == {}
        assert metrics.registry.get_sample_value("orthornn_session_expiries_total",
                                                 {"model": "m"}) == 1
        state = np.zeros(64, np.float32)
        # traced from the second round, measured from its end: the tables it sized (and
        # re-allocated under tracing) do not count, the two rounds after it must not grow
        for round_ in range(4):
            if round_ == 1:
                tracemalloc.start()
            if round_ == 2:
                gc.collect()
                before = tracemalloc.get_traced_memory()[0]
            for i in range(10_000):
                await store.create(f"s{i}", "m", 1)
            for i in range(10_000):
                await store.finish(f"s{i}", 0, state, 3)
            assert await store.count() == 0
            now[0] += 11  # the ended records' idle timeout
        assert await store.count() == 0
        with pytest.raises(UnknownSession):
            await store.get("s0")
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return grown
    grown = asyncio.run(rounds())
    assert grown < 256 * 1024, grown  # two more rounds of 10,000 sessions: flat
