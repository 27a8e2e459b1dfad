"""The session store (service/sessions/store.py): one contract, run against MemoryStore and
against RedisStore on a real redis-server (tests/cluster.py); what only a shared store can
do (replicas racing on one session, one session limit for all, prefixes, a Redis that dies
or stalls) against Redis; and the load-balancer fixture (haproxy) proven on tiny backends
and on `orthornn serve` replicas."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from orthornn.service.errors import (
    Conflict,
    NotFound,
    Overloaded,
    PositionConflict,
    ServiceError,
    SessionExists,
    SessionLimit,
    StoreUnavailable,
    UnknownSession,
)
from orthornn.service.metrics import Metrics
from orthornn.service.sessions.manager import Sessions
from orthornn.service.sessions.store import (
    MemoryStore,
    RedisStore,
    SessionStore,
    open_store,
)
from orthornn.service.settings import Settings
from pydantic import ValidationError

from . import cluster
from .cluster import HAProxy, RedisServer, TinyBackend, replicas

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


def test_idle_sessions_expire_and_free_the_limit_and_their_versions(url):
    """Idle expiry is the store's own (Redis TTL, lazy in memory): an expired session is
    gone, counts no more against max_sessions and pins no version; a session in use stays."""
    async def main():
        async with stores(url) as make:
            store = make(session_idle_timeout_s=1.0, max_sessions=2)
            await store.create("old", MODEL, 1)
            await store.create("busy", MODEL, 2)
            assert await store.versions_in_use() == {MODEL: {1, 2}}
            with pytest.raises(SessionLimit) as full:
                await store.create("third", MODEL, 3)
            assert isinstance(full.value, Overloaded) and full.value.status == 429
            assert full.value.headers == {"Retry-After": "1"}
            assert "maximum of 2 open sessions" in str(full.value)
            await asyncio.sleep(0.6)
            await store.advance("busy", 0, vec(1), 1)  # renews busy's idle expiry
            await store.get("old")  # a read does not
            await asyncio.sleep(0.6)  # old: idle 1.2 s (expired), busy: 0.6 s
            assert await store.count() == 1
            assert await store.versions_in_use() == {MODEL: {2}}
            with pytest.raises(UnknownSession, match="idle for over 1 s"):
                await store.get("old")
            with pytest.raises(UnknownSession):
                await store.advance("old", 0, vec(1), 1)
            await store.create("third", MODEL, 3)
            assert await store.versions_in_use() == {MODEL: {2, 3}}
            assert (await store.get("busy")).position == 1
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
                           b"previous_position", b"last_used"}
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

        async def versions_in_use(self):
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
        await asyncio.sleep(0.03)  # inside versions_in_use (it sleeps 50 ms of every 60)
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
    from orthornn.service.cli import settings_from_args

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
    from .service_helpers import make_repo

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
