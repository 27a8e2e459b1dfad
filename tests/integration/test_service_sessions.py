"""Server-side sessions through the session store, over HTTP (in-process apps): chunks
applied exactly once by position (a retry answered again, a stale position 409 naming the
session's, racing chunks: one applies), replicas sharing one Redis continuing each other's
sessions, a replica loading a session's pinned version on demand (409 naming it when it is
gone or no longer verifies), a store that is down or stalled (503 with Retry-After for
sessions, stateless requests still answered), and `orthornn predict --stream` retrying a
chunk whose connection broke. Redis is a real redis-server (tests/cluster.py; skipped with
the reason where it is not installed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import time
import tracemalloc
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings

from orthornn.cli import main as cli

from ..cluster import CuttingProxy, RedisServer
from ..service_helpers import OWNER, LiveServer, make_repo, reference

SEQ = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0], [0.7, 0.0], [0.3, 1.0], [0.9, 0.0]]
POSITION = "orthornn-session-position"


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("sessions-repo"),
                     {"adding": [4, 5], "digits": [1]})


@pytest.fixture(params=["memory", "redis"])
def store_url(request, tmp_path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory"
        return
    with RedisServer(tmp_path / "redis") as server:
        yield server.url


@contextlib.contextmanager
def serving(repo: Path, store: str = "memory", reconcile_s: float = 1.0,
            **settings) -> Iterator[TestClient]:
    """An app (a replica) on REPO with the session store STORE, its reconcile task every
    RECONCILE_S."""
    settings.setdefault("keep_versions", 2)
    # generous, so that a loaded machine does not turn a slow Redis answer into a 503 (the
    # store-down test sets its own)
    settings.setdefault("session_store_timeout_s", 5.0)
    app = create_app(Settings(repo=repo, poll_interval_s=0, session_store=store,
                              **settings))
    app.state.dataplane.sessions.reconcile_interval_s = reconcile_s
    with TestClient(app, raise_server_exceptions=False, headers=OWNER) as c:
        app.state.registry.scanned.wait(60)
        assert app.state.registry.ready()
        yield c


def chunk(c: TestClient, sid: str, inputs: list, **body):
    return c.post("/predict", json={"model": "adding", "inputs": [inputs], "session": sid,
                                    **body})


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def value_of(package: Path, seq: list) -> float:
    """The whole sequence's answer, onnxruntime run directly on the package."""
    return float(reference(package, [np.array(seq, np.float32)])[0]["value"][0])


def metric(c: TestClient, name: str, labels: str = "") -> float | None:
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", c.get("/metrics").text, re.M)
    return None if found is None else float(found.group(1))


# -- exactly once, both stores ------------------------------------------------------------

#: another client's secret (of a secret's form: a weak one is refused before anything else)
OTHER_SECRET = "another-clients-secret-0123456789"


def test_a_retry_is_answered_again_and_a_stale_position_is_409(repo, store_url):
    with serving(repo, store_url) as c:
        first = chunk(c, "x", SEQ[:2], start=True, position=0, version=4)
        assert first.headers[POSITION] == "2"
        # a retried start (its answer lost): answered again, not opened twice
        again = chunk(c, "x", SEQ[:2], start=True, position=0, version=4)
        assert ok(again) == ok(first) and again.headers[POSITION] == "2"
        second = chunk(c, "x", SEQ[2:4], position=2)
        assert ok(second)["version"] == 4 and second.headers[POSITION] == "4"
        assert ok(second)["position"] == 4  # in the body too
        for _ in range(2):  # a retry of the last applied chunk: the same answer, no advance
            retry = chunk(c, "x", SEQ[2:4], position=2)
            assert ok(retry) == ok(second) and retry.headers[POSITION] == "4"
        for stale in (0, 3, 7):
            r = chunk(c, "x", SEQ[2:4], position=stale)
            assert r.status_code == 409 and r.headers[POSITION] == "4", r.text
            assert f"session 'x' is at position 4, not {stale}" in r.json()["error"]
        r = chunk(c, "x", SEQ[2:3], position=2)  # at the previous position, but shorter
        assert r.status_code == 409 and "had 2 steps, this one has 1" in r.json()["error"]
        assert "is at position 4" in r.json()["error"]
        # the final chunk, and its retry once the session has ended
        final = chunk(c, "x", SEQ[4:], position=4, end=True)
        assert final.headers[POSITION] == "6"
        assert ok(final)["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "4", SEQ), abs=1e-5)  # nothing applied twice
        assert ok(chunk(c, "x", SEQ[4:], position=4, end=True)) == ok(final)
        for body in ({"position": 6}, {}):  # ended: nothing more
            r = chunk(c, "x", SEQ[:1], **body)
            assert r.status_code == 404 and "session 'x' is not open" in r.json()["error"]
        assert metric(c, "orthornn_sessions_active") == 0
        # the id starts again, a new session
        assert ok(chunk(c, "x", SEQ[:1], start=True, position=0))["version"] == 5
        # without positions: arrival order, as ever
        ok(chunk(c, "x", SEQ[1:3]))
        assert ok(chunk(c, "x", SEQ[3:], end=True))["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "5", SEQ), abs=1e-5)
        # bad positions: 400 naming the field
        for body, message in (({"position": -1}, "position"), ({"position": "0"}, "position"),
                              ({"position": 2, "start": True}, "starts at position 0")):
            r = chunk(c, "y", SEQ[:1], **body)
            assert r.status_code == 400 and message in r.json()["error"], r.text
        r = c.post("/predict", json={"model": "adding", "inputs": [SEQ], "position": 0})
        assert r.status_code == 400 and "position: only with 'session'" in r.json()["error"]


def test_a_chunk_is_applied_once_when_redis_loses_its_reply(repo, tmp_path):
    """The Redis connection is cut after a chunk's write has applied and before its reply
    arrives; redis-py sends the write again on a new connection. With or without a
    position, the chunk is applied once (the write recognises itself by its stamp) and the
    session ends as the whole sequence does."""
    with (RedisServer(tmp_path / "redis") as server, CuttingProxy(server.port) as proxy,
          serving(repo, f"redis://127.0.0.1:{proxy.port}/0") as c):
        for sid, positions in (("plain", False), ("positioned", True)):
            at = {"position": 0} if positions else {}
            ok(chunk(c, sid, SEQ[:2], start=True, version=4, **at))
            cuts = proxy.cuts
            proxy.arm(b"EVAL")  # the advance's script (EVALSHA)
            at = {"position": 2} if positions else {}
            second = ok(chunk(c, sid, SEQ[2:4], **at))
            assert proxy.cuts == cuts + 1, "the reply was not cut"
            assert second["position"] == 4
            at = {"position": 4} if positions else {}
            final = ok(chunk(c, sid, SEQ[4:], end=True, **at))
            assert final["outputs"][0]["value"] == pytest.approx(
                value_of(repo / "adding" / "4", SEQ), abs=1e-5), sid


def test_racing_chunks_at_one_position_apply_once(repo, store_url):
    """Six chunks of different lengths claim position 1 at once (with Redis: from two
    replicas): exactly one applies; the others get 409 naming the position it left."""
    with contextlib.ExitStack() as stack:
        apps = [stack.enter_context(serving(repo, store_url))]
        if store_url != "memory":
            apps.append(stack.enter_context(serving(repo, store_url)))
        ok(chunk(apps[0], "race", SEQ[:1], start=True, position=0, version=4))
        rivals = [SEQ[1:1 + n] for n in range(1, 6)] + [SEQ[:1] * 6]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(
                lambda i: chunk(apps[i % len(apps)], "race", rivals[i], position=1),
                range(len(rivals))))
        won = [i for i, r in enumerate(answers) if r.status_code == 200]
        assert len(won) == 1, [r.text for r in answers]
        after = 1 + len(rivals[won[0]])
        for r in answers:
            if r.status_code != 200:
                assert r.status_code == 409, r.text
                assert f"session 'race' is at position {after}" in r.json()["error"]
        final = ok(chunk(apps[-1], "race", [[0.0, 0.0]], position=after, end=True))
        whole = SEQ[:1] + rivals[won[0]] + [[0.0, 0.0]]
        assert final["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "4", whole), abs=1e-5)


def test_the_inference_route_takes_sequence_position(repo):
    with serving(repo) as c:
        def infer(steps, **params):
            return c.post("/v2/models/adding/versions/4/infer", json={
                "inputs": [{"name": "x", "shape": [1, len(steps), 2], "datatype": "FP32",
                            "data": [v for s in steps for v in s]}],
                "parameters": {"sequence_id": 7, **params}})
        first = infer(SEQ[:3], sequence_start=True, sequence_position=0)
        assert first.status_code == 200 and first.headers[POSITION] == "3"
        again = infer(SEQ[:3], sequence_start=True, sequence_position=0)
        assert again.json() == first.json()
        r = infer(SEQ[3:], sequence_position=1)
        assert r.status_code == 409 and "sequence '7' is at position 3, not 1" in r.text
        r = infer(SEQ[3:], sequence_position=True)
        assert r.status_code == 400 and "parameters.sequence_position" in r.text
        last = infer(SEQ[3:], sequence_position=3, sequence_end=True)
        assert last.status_code == 200 and last.headers[POSITION] == "6"
        value = {o["name"]: o["data"] for o in last.json()["outputs"]}["value"][0]
        assert value == pytest.approx(value_of(repo / "adding" / "4", SEQ), abs=1e-5)


# -- a session belongs to whoever started it --------------------------------------------------

SECRET_HEADER = "orthornn-session-secret"


def unowned(c: TestClient) -> TestClient:
    """C without the secret its requests carry by default (OWNER): each request names
    its own."""
    c.headers.pop(SECRET_HEADER, None)
    return c


def traced() -> int:
    """Bytes of live Python objects (after a collection), as tracemalloc counts them:
    unlike the resident set it does not move with the C allocator's caching of a freed
    4 MiB body (a CI run saw the RSS of ten rejected starts grow 7 MiB, none of it live)."""
    import gc

    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_another_client_can_neither_continue_nor_end_nor_restart_a_session(repo, store_url):
    """Client A starts sensor-17 and is given its secret; client B (no secret, a wrong one,
    or one in the body) gets 404 for a chunk and for an end, as for an id never started,
    and 409 for a start (never a reset); A's session goes on from A's own state, unharmed,
    and ends as the whole sequence does. With Redis, through two replicas."""
    with contextlib.ExitStack() as stack:
        a = unowned(stack.enter_context(serving(repo, store_url)))
        b = unowned(stack.enter_context(serving(repo, store_url))) \
            if store_url != "memory" else a
        start = chunk(a, "sensor-17", SEQ[:2], start=True, version=4)
        secret = ok(start)["session_secret"]
        assert start.headers[SECRET_HEADER] == secret and len(secret) >= 32
        mine = {SECRET_HEADER: secret}
        never = chunk(b, "sensor-99", SEQ[2:3]).json()["error"]
        for headers, body in (({}, {}), ({SECRET_HEADER: OTHER_SECRET}, {}),
                              ({SECRET_HEADER: secret[:-1]}, {}),
                              ({}, {"session_secret": secret.upper()})):
            for extra in ({}, {"end": True}, {"position": 2}, {"position": 2, "end": True}):
                r = b.post("/predict", headers=headers, json={
                    "model": "adding", "inputs": [SEQ[2:3]], "session": "sensor-17",
                    **body, **extra})
                assert r.status_code == 404, r.text
                assert r.json()["error"] == never.replace("sensor-99", "sensor-17")
                assert POSITION not in r.headers and SECRET_HEADER not in r.headers
            for extra in ({}, {"position": 0}):  # a start on the open id: 409, no reset
                r = b.post("/predict", headers=headers, json={
                    "model": "adding", "inputs": [SEQ[:1]], "session": "sensor-17",
                    "start": True, **body, **extra})
                assert r.status_code == 409, r.text
                assert "session 'sensor-17' is already open" in r.json()["error"]
        # B's chunks applied nothing and ended nothing: A goes on from its own state
        second = a.post("/predict", headers=mine, json={
            "model": "adding", "inputs": [SEQ[2:4]], "session": "sensor-17", "position": 2})
        assert ok(second)["position"] == 4 and "session_secret" not in ok(second)
        assert SECRET_HEADER not in second.headers
        # the secret in the body works as the header does; both, differing: 400
        r = a.post("/predict", headers={SECRET_HEADER: "y" * 32}, json={
            "model": "adding", "inputs": [SEQ[4:]], "session": "sensor-17",
            "session_secret": secret})
        assert r.status_code == 400 and "give the secret once" in r.json()["error"]
        final = b.post("/predict", json={"model": "adding", "inputs": [SEQ[4:]],
                                         "session": "sensor-17", "end": True,
                                         "position": 4, "session_secret": secret})
        assert ok(final)["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "4", SEQ), abs=1e-5)
        # the retried final chunk: its owner's only
        assert ok(chunk(a, "sensor-17", SEQ[4:], end=True, position=4,
                        session_secret=secret)) == ok(final)
        r = chunk(b, "sensor-17", SEQ[4:], end=True, position=4)
        assert r.status_code == 404 and r.json()["error"] == never.replace("sensor-99",
                                                                           "sensor-17")
        # ended: the id is free again, for anyone (a new session, a new secret)
        again = chunk(b, "sensor-17", SEQ[:1], start=True, end=True)
        assert ok(again)["session_secret"] not in (secret, None)
        # a secret the client chose: used for its session, a retried start recognised
        chosen = "chosen-0123456789abcdefgh"
        first = chunk(a, "chosen", SEQ[:2], start=True, position=0, session_secret=chosen)
        assert ok(first)["session_secret"] == chosen
        assert ok(chunk(a, "chosen", SEQ[:2], start=True, position=0,
                        session_secret=chosen)) == ok(first)
        r = chunk(b, "chosen", SEQ[:2], start=True, position=0)
        assert r.status_code == 409, r.text
        ok(chunk(b, "chosen", SEQ[2:], end=True, session_secret=chosen))
        # (issue 59, finding 9: "a" * 22 was taken, and guessed by anyone) too short, too
        # few bits for hex (22 digits: 88), too little variety, not base64 or hex
        for bad in ("short", "x" * 21, "a" * 22, "0" * 22, "0" * 31 + "1", "." * 128,
                    "ab" * 20, "not a secret at all, with spaces", "é" * 30):
            r = chunk(a, "bad", SEQ[:1], start=True, session_secret=bad)
            assert r.status_code == 400 and "session_secret" in r.json()["error"], r.text
        r = chunk(a, "bad", SEQ[:1], start=True, session_secret="x" * 129)
        assert r.status_code == 400 and "session_secret" in r.text
        r = a.post("/predict", json={"model": "adding", "inputs": [SEQ],
                                     "session_secret": chosen})
        assert r.status_code == 400 and "only with 'session'" in r.json()["error"]


def test_another_client_cannot_take_an_oip_sequence(repo, store_url):
    """The same on the inference route with tritonclient's small integer ids
    (sequence_id 1): the start's answer gives the secret (a parameter and the header);
    later requests present it as the parameter session_secret or the header."""
    with serving(repo, store_url) as c:
        unowned(c)

        def infer(steps, headers=None, **params):
            return c.post("/v2/models/adding/versions/4/infer", headers=headers or {}, json={
                "inputs": [{"name": "x", "shape": [1, len(steps), 2], "datatype": "FP32",
                            "data": [v for s in steps for v in s]}],
                "parameters": {"sequence_id": 1, **params}})
        start = infer(SEQ[:2], sequence_start=True)
        assert start.status_code == 200, start.text
        secret = start.json()["parameters"]["session_secret"]
        assert start.headers[SECRET_HEADER] == secret
        for headers, params in (({}, {}), ({SECRET_HEADER: OTHER_SECRET}, {}),
                                ({}, {"session_secret": OTHER_SECRET})):
            for extra in ({}, {"sequence_end": True}, {"sequence_position": 2}):
                r = infer(SEQ[2:3], headers, **params, **extra)
                assert r.status_code == 404, r.text
                assert "session '1' is not open (never started" in r.json()["error"]
            r = infer(SEQ[:1], headers, sequence_start=True, **params)
            assert r.status_code == 409 and "already open" in r.json()["error"], r.text
        r = infer(SEQ[2:3], {SECRET_HEADER: secret}, session_secret=5)
        assert r.status_code == 400 and "parameters.session_secret" in r.text
        middle = infer(SEQ[2:4], {SECRET_HEADER: secret}, sequence_position=2)
        assert middle.status_code == 200 and middle.headers[POSITION] == "4"
        assert "parameters" not in middle.json()
        last = infer(SEQ[4:], sequence_end=True, session_secret=secret)
        assert last.status_code == 200 and last.headers[POSITION] == "6"
        value = {o["name"]: o["data"] for o in last.json()["outputs"]}["value"][0]
        assert value == pytest.approx(value_of(repo / "adding" / "4", SEQ), abs=1e-5)
        r = c.post("/v2/models/adding/versions/4/infer", json={
            "inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32",
                        "data": [0.0, 0.0]}], "parameters": {"session_secret": secret}})
        assert r.status_code == 400 and "only with sequence_id" in r.json()["error"]


def test_session_ids_have_one_bound_before_they_cost_memory(repo):
    """A sequence_id of 3 MiB (or of 129 characters, or an integer beyond 64 bits) gets
    400 and is never stored: the store stays empty, and ten such starts leave memory
    where it was; /predict's session has the same bound."""
    with serving(repo) as c:
        store = c.app.state.dataplane.sessions.store  # type: ignore[attr-defined]
        x = {"name": "x", "shape": [1, 1, 2], "datatype": "FP32", "data": [0.1, 0.0]}

        def start(sid) -> int:
            r = c.post("/v2/models/adding/versions/4/infer", json={
                "inputs": [x], "parameters": {"sequence_id": sid, "sequence_start": True}})
            assert r.status_code == 400, r.text[:300]
            assert "parameters.sequence_id" in r.json()["error"]
            return r.status_code
        huge = "s" * (3 << 20)  # (within the default body limit: 4 MiB for this model)
        start(huge)  # warm: first-request caches
        tracemalloc.start()
        try:
            before = traced()
            for i in range(10):
                start(f"{i}{huge[1:]}")
            grown = traced() - before
        finally:
            tracemalloc.stop()
        # the bound for all ten is 1 MiB; ten stored ids would be 30 MiB
        assert grown < 1 << 20, grown
        for sid in ("s" * 129, 2**64, -2**63 - 1):
            start(sid)
        assert asyncio.run(store.count()) == 0
        assert not store._open and not store._ended  # type: ignore[attr-defined]
        r = c.post("/v2/models/adding/versions/4/infer", json={
            "inputs": [x], "parameters": {"sequence_id": "s" * 128, "sequence_start": True,
                                          "sequence_end": True}})
        assert r.status_code == 200, r.text  # 128 characters: the bound itself
        r = chunk(c, "s" * 129, SEQ[:1], start=True)
        assert r.status_code == 400 and "session" in r.json()["error"]


def test_with_session_secrets_off_anyone_who_names_a_session_continues_it(repo, store_url):
    """session_secrets off (a trusted network): no secret is given or asked for; any
    client that names the session continues or ends it (the behaviour before secrets); a
    second start of an open id is still 409."""
    with serving(repo, store_url, session_secrets=False) as c:
        unowned(c)
        start = chunk(c, "shared", SEQ[:2], start=True, version=4)
        assert "session_secret" not in ok(start) and SECRET_HEADER not in start.headers
        ok(chunk(c, "shared", SEQ[2:4]))  # another client, no secret
        ok(chunk(c, "shared", SEQ[4:5], session_secret="anything"))  # ignored
        r = chunk(c, "shared", SEQ[:1], start=True)
        assert r.status_code == 409 and "already open" in r.json()["error"]
        final = ok(chunk(c, "shared", SEQ[5:], end=True))
        assert final["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "4", SEQ), abs=1e-5)
        r = c.post("/v2/models/adding/versions/4/infer", json={
            "inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32",
                        "data": [0.1, 0.0]}],
            "parameters": {"sequence_id": 3, "sequence_start": True}})
        assert r.status_code == 200 and "parameters" not in r.json()
        r = c.post("/v2/models/adding/versions/4/infer", json={
            "inputs": [{"name": "x", "shape": [1, 1, 2], "datatype": "FP32",
                        "data": [0.1, 0.0]}],
            "parameters": {"sequence_id": 3, "sequence_end": True}})
        assert r.status_code == 200, r.text


# -- replicas sharing one Redis -------------------------------------------------------------

def test_replicas_continue_each_others_sessions(repo, tmp_path):
    with RedisServer(tmp_path / "redis") as redis, serving(repo, redis.url) as a:
        with serving(repo, redis.url) as b:
            for positions in (True, False):
                sid = f"both-{positions}"
                for k in range(len(SEQ)):  # one step a chunk: position k
                    body = {"position": k} if positions else {}
                    answer = ok(chunk((a, b)[k % 2], sid, SEQ[k:k + 1], start=k == 0,
                                      end=k == len(SEQ) - 1, version=4, **body))
                assert answer["outputs"][0]["value"] == pytest.approx(
                    value_of(repo / "adding" / "4", SEQ), abs=1e-5)
            # a session b started outlives b
            ok(chunk(b, "orphan", SEQ[:2], start=True, position=0))
        final = ok(chunk(a, "orphan", SEQ[2:], position=2, end=True))
        assert final["version"] == 5 and final["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "5", SEQ), abs=1e-5)


@pytest.mark.parametrize("harm", ["gone", "corrupt"])
def test_a_replica_loads_a_sessions_version_on_demand(service_packages, tmp_path, harm):
    """Replica a serves versions 4 and 5, b only 5 (keep_versions=1). A session a starts on
    4 continues on b, which loads 4 for it (verified, counted) and releases it when the
    session ends. Once 4 is gone from the repository (or no longer verifies), b answers
    409 naming it and the session ends."""
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [4, 5]})
    with RedisServer(tmp_path / "redis") as redis, serving(repo, redis.url) as a, \
            serving(repo, redis.url, keep_versions=1, reconcile_s=0.05) as b:
        registry = b.app.state.registry
        assert registry.serving() == {"adding": [5]}
        ok(chunk(a, "pin", SEQ[:2], start=True, version=4, position=0))
        answer = ok(chunk(b, "pin", SEQ[2:4], position=2))
        assert answer["version"] == 4 and registry.kept() == {"adding": [4]}
        assert metric(b, "orthornn_session_version_loads_total",
                      '{model="adding",result="loaded"}') == 1
        assert re.search(r'orthornn_model_loaded\{[^}]*version="4"\} 1', b.get("/metrics").text)
        assert registry.serving() == {"adding": [5]}  # not served to requests without one
        r = b.post("/predict", json={"model": "adding", "version": 4, "inputs": [SEQ]})
        assert r.status_code == 404
        final = ok(chunk(b, "pin", SEQ[4:], position=4, end=True))
        assert final["outputs"][0]["value"] == pytest.approx(
            value_of(repo / "adding" / "4", SEQ), abs=1e-5)
        # no session on 4 any more: b releases it
        LiveServer.wait(lambda: 4 not in registry.kept().get("adding", []), timeout=10)
        assert not re.search(r'orthornn_model_loaded\{[^}]*version="4"\} 1',
                             b.get("/metrics").text)
        # version 4 harmed in the repository (a keeps it loaded and starts sessions on it)
        ok(chunk(a, "doomed", SEQ[:2], start=True, version=4, position=0))
        if harm == "gone":
            shutil.rmtree(repo / "adding" / "4")
            why = "which is no longer in the repository"
        else:
            onnx = repo / "adding" / "4" / "model.onnx"
            data = onnx.read_bytes()
            onnx.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # sha256 no longer matches
            why = "which no longer verifies"
        r = chunk(b, "doomed", SEQ[2:4], position=2)
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert "session 'doomed' runs on model 'adding' version 4" in error and why in error
        assert "the session has ended" in error
        r = chunk(a, "doomed", SEQ[2:4], position=2)
        assert r.status_code == 404  # ended for every replica
        result = "missing" if harm == "gone" else "refused"
        assert metric(b, "orthornn_session_version_loads_total",
                      f'{{model="adding",result="{result}"}}') == 1


# -- a store that is down or slow -------------------------------------------------------------

def test_a_store_down_or_stalled_is_503_and_stateless_requests_go_on(repo, tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        with serving(repo, redis.url, reconcile_s=0.05, session_store_timeout_s=0.3) as c:
            ok(chunk(c, "s", SEQ[:2], start=True, position=0))
            assert metric(c, "orthornn_session_store_up") == 1
            stateless = {"model": "adding", "inputs": [SEQ]}
            for trouble in ("stalled", "down"):
                if trouble == "stalled":
                    os.kill(redis.proc.pid, signal.SIGSTOP)
                else:
                    redis.stop()  # SIGKILL
                try:
                    for body in ({"position": 2}, {}, {"start": True, "position": 0}):
                        started = time.monotonic()
                        r = chunk(c, "s" if not body.get("start") else "t", SEQ[2:3],
                                  **body)
                        assert time.monotonic() - started < 3.0  # 0.3 s, and slack
                        assert r.status_code == 503, r.text
                        assert r.headers["retry-after"] == "1"
                        assert "session store" in r.json()["error"]
                    assert ok(c.post("/predict", json=stateless))["version"] == 5
                    assert c.get("/v2/health/ready").status_code == 200
                    LiveServer.wait(lambda: metric(c, "orthornn_session_store_up") == 0)
                finally:
                    if trouble == "stalled":
                        os.kill(redis.proc.pid, signal.SIGCONT)
                if trouble == "stalled":  # resumed: the session goes on where it was
                    ok(chunk(c, "s", SEQ[2:3], position=2))
            # a chunk after this replica's own write reads nothing: its advance fails
            assert sum(metric(c, "orthornn_session_store_errors_total",
                              f'{{operation="{op}",store="redis"}}') or 0
                       for op in ("get", "advance")) >= 2
            # Redis back, empty (no persistence): the session is not started afresh
            # (once the replica sees it up again: on a loaded machine its reconnection
            # outlasted the restart, and the chunk was a 503 of the store still down)
            redis.start()
            LiveServer.wait(lambda: metric(c, "orthornn_session_store_up") == 1)
            r = chunk(c, "s", SEQ[3:4], position=3)
            assert r.status_code == 404 and "session 's' is not open" in r.json()["error"]
            assert ok(chunk(c, "s", SEQ[:1], start=True, position=0))["session"] == "s"
    finally:
        redis.stop()


# -- the client ----------------------------------------------------------------------------

def test_predict_stream_retries_a_chunk_whose_connection_broke(repo, tmp_path, capsys,
                                                              monkeypatch):
    """`orthornn predict --stream` sends positions; a chunk whose answer is lost after the
    service applied it, and one whose connection failed before it got there, are each sent
    once more at the same position: the lines are those of an undisturbed run."""
    x = np.array([SEQ, SEQ[::-1]], np.float32)
    np.savez(tmp_path / "s.npz", x=x)
    args = ["predict", "--model", "adding", "--version", "4", "--stream", "--verbose",
            "--chunk-size", "2", str(tmp_path / "s.npz")]
    with LiveServer(repo=repo, keep_versions=2) as srv:
        assert cli([*args[:1], "--url", srv.url, *args[1:]]) == 0
        clean = capsys.readouterr().out.splitlines()
        sent = [json.loads(line) for line in clean]
        assert [r["steps"] for r in sent] == [[0, 2], [2, 4], [4, 6]] * 2
        for i in (0, 1):
            assert sent[3 * i + 2]["output"]["value"] == pytest.approx(
                value_of(repo / "adding" / "4", x[i].tolist()), abs=1e-5)
        real = urllib.request.urlopen
        calls: list[dict] = []

        def flaky(request, timeout=None):
            calls.append(json.loads(request.data))
            n = len(calls)
            if n in (2, 6):  # applied, then the connection breaks before the answer
                with real(request, timeout=timeout) as response:
                    response.read()
                raise ConnectionResetError(104, "Connection reset by peer (test)")
            if n == 4:  # refused before it got there
                raise urllib.error.URLError(ConnectionRefusedError(111, "refused (test)"))
            return real(request, timeout=timeout)
        monkeypatch.setattr(urllib.request, "urlopen", flaky)
        assert cli([*args[:1], "--url", srv.url, *args[1:]]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines == clean
        assert [c["position"] for c in calls] == [0, 2, 2, 4, 4, 0, 0, 2, 4]
        assert [c["start"] for c in calls] == [True, False, False, False, False, True,
                                               True, False, False]
        # two tries fail in a row: the error, not a third try
        monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: (_ for _ in ()).throw(
            urllib.error.URLError(ConnectionRefusedError(111, "refused"))))
        assert cli([*args[:1], "--url", srv.url, *args[1:]]) == 2
        assert "cannot reach" in capsys.readouterr().err
