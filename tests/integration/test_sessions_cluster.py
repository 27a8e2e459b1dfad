"""Sessions shared by replicas, end to end: three ``orthornn serve`` replicas on one
repository, one real redis-server as their session store, behind a real haproxy
(round-robin), each a process of its own (tests/cluster.py). Every request goes through the
load balancer unless a test says otherwise, so consecutive chunks of one session land on
different replicas.

Every chunk's answer is checked against onnxruntime run directly on the package over the
prefix the session has consumed (the tolerance of tests/unit/service/test_streaming.py), and a
session's last answer against the whole sequence sent at once. Chunks name their
``position``, and a client retries a chunk at most once, with the same position, on a
connection error, 502 or 503 (after a short pause): a chunk applied before the failure is
answered again, never applied twice.

The cluster is started once for the module; the tests run in file order and leave it
whole (the killed replica restarted, Redis back) for the next.
"""

from __future__ import annotations

import itertools
import random
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from .. import cluster
from ..cluster import HAProxy, RedisServer, Replica

pytestmark = pytest.mark.skipif(
    cluster.program("redis-server") is None or cluster.program("haproxy") is None,
    reason=f"needs redis-server and haproxy on PATH or in /usr/sbin; {cluster.INSTALL_HINT}")

ATOL = 1e-5  # tests/unit/service/test_streaming.py's tolerance
STEPS, FEATURES, HIDDEN = 12, 2, 8  # sequences of 12 steps; the packages' max_length
RETRY_ON = (502, 503)
# a client pauses before its retry: haproxy has then marked a killed replica down (two
# failed checks, 100 ms apart). At once, the retry could meet the killed replica too (a
# server connection haproxy reused): two failures of one chunk, the faster the chunks go
# the likelier
RETRY_PAUSE_S = 0.3
# haproxy's health checks and a 2-core machine shared by five processes: a store call
# may wait longer than the default 0.5 s without anything being wrong
STORE_TIMEOUT_S = "2"


# -- the cluster ----------------------------------------------------------------------------

@dataclass
class Cluster:
    repo: Path
    stage: Path
    redis: RedisServer
    replicas: list[Replica]
    lb: HAProxy

    @property
    def url(self) -> str:
        return self.lb.url

    def all_up(self) -> dict[str, str]:
        return {f"r{i}": "UP" for i in range(len(self.replicas))}


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> Path:
    """A staging repository: dense (svdrnn classifier, 3 classes), factored (the same run
    exported in factored mode), swap 1 and 2 (two seeds: they answer differently)."""
    cluster.require("redis-server")
    cluster.require("haproxy")
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    root = tmp_path_factory.mktemp("cluster-packages")
    rng = np.random.default_rng(0)
    np.savez(root / "data.npz", x=rng.normal(size=(12, STEPS, FEATURES)).astype(np.float32),
             y=rng.integers(0, 3, size=12))
    for seed in (0, 1):
        train(TrainConfig(arch="svdrnn", task="classify", data=str(root / "data.npz"),
                          hidden_size=HIDDEN, steps=1, batch_size=4, log_every=1, seed=seed,
                          out=str(root / f"run{seed}")), progress=False)
    stage = root / "stage"
    export_run(root / "run0", stage, "dense")
    export_run(root / "run0", stage, "factored", mode="factored")
    export_run(root / "run0", stage, "swap")
    export_run(root / "run1", stage, "swap")
    return stage


@pytest.fixture(scope="module")
def cluster_(packages, tmp_path_factory) -> Iterator[Cluster]:
    from ..service_helpers import make_repo

    work = tmp_path_factory.mktemp("cluster")
    repo = make_repo(packages, work / "repo", {"dense": [1], "factored": [1], "swap": [1]})
    with RedisServer(work / "redis") as redis:
        common = ["--poll-interval-s", "0.2", "--session-store-timeout-s", STORE_TIMEOUT_S]
        # the store by flag on one replica, by ORTHORNN_SESSION_STORE on the others
        made = [Replica(repo, args=["--session-store", redis.url, *common])]
        made += [Replica(repo, env={"ORTHORNN_SESSION_STORE": redis.url}, args=common)
                 for _ in range(2)]
        try:
            with ThreadPoolExecutor(len(made)) as pool:
                list(pool.map(Replica.start, made))
            with HAProxy(work / "haproxy", [r.port for r in made], check_ms=100) as lb:
                c = Cluster(repo, packages, redis, made, lb)
                lb.wait_states(c.all_up(), timeout=30)
                yield c
        finally:
            for replica in made:
                replica.kill()


# -- references -----------------------------------------------------------------------------

_references: dict[tuple[Path, bytes], np.ndarray] = {}


def prefix_probabilities(package: Path, seq: np.ndarray) -> np.ndarray:
    """[T, classes]: row t - 1 is the prediction after the prefix seq[:t] (onnxruntime on
    the package, each prefix run alone)."""
    from ..service_helpers import reference, softmax

    key = (package, seq.tobytes())
    if key not in _references:
        runs = reference(package, [seq[:t] for t in range(1, len(seq) + 1)])
        _references[key] = np.stack([softmax(r["logits"].astype(np.float64)) for r in runs])
    return _references[key]


def sequence(rng: np.random.Generator) -> np.ndarray:
    # rounded: the JSON numbers the client sends are the float32 the reference runs on
    return rng.normal(size=(STEPS, FEATURES)).round(3).astype(np.float32)


def chunking(rng: random.Random, length: int = STEPS, most: int = 3) -> list[tuple[int, int]]:
    """A random split of [0, LENGTH) into chunks of 1 .. MOST steps, as (start, end)."""
    bounds, t = [0], 0
    while t < length:
        t = min(length, t + rng.randint(1, most))
        bounds.append(t)
    return list(itertools.pairwise(bounds))


# -- one session, chunk by chunk --------------------------------------------------------------

@dataclass
class Stream:
    """One session's sequence in chunks, and the answers it got: per chunk (version,
    probabilities, position after it)."""

    sid: str
    model: str
    seq: np.ndarray
    bounds: list[tuple[int, int]]
    route: str = "predict"  # or "infer" (the Open Inference Protocol's sequence parameters)
    answers: list[tuple[int, list[float], int | None]] = field(default_factory=list)
    retries: int = 0
    statuses: list[int] = field(default_factory=list)  # every status it was answered
    # the session's secret, chosen by the client and sent with every chunk (its start too)
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    def request(self, k: int) -> tuple[str, dict]:
        a, b = self.bounds[k]
        start, end = k == 0, k == len(self.bounds) - 1
        part = self.seq[a:b]
        if self.route == "predict":
            return "/predict", {"model": self.model, "session": self.sid, "start": start,
                                "end": end, "position": a, "inputs": [part.tolist()],
                                "session_secret": self.secret}
        return f"/v2/models/{self.model}/infer", {
            "inputs": [{"name": "x", "shape": [1, *part.shape], "datatype": "FP32",
                        "data": part.ravel().tolist()}],
            "parameters": {"sequence_id": self.sid, "sequence_start": start,
                           "sequence_end": end, "sequence_position": a,
                           "session_secret": self.secret}}

    def record(self, response: httpx.Response) -> None:
        from ..service_helpers import softmax

        body = response.json()
        position = response.headers.get("orthornn-session-position")
        position = None if position is None else int(position)
        if self.route == "predict":
            self.answers.append((body["version"], body["outputs"][0]["probabilities"],
                                 position))
        else:
            (logits,) = [o["data"] for o in body["outputs"] if o["name"] == "logits"]
            self.answers.append((int(body["model_version"]),
                                 softmax(np.asarray(logits, np.float64)).tolist(), position))

    def check(self, package: Path, version: int) -> None:
        """Every answer: on VERSION, the package's prediction after the prefix consumed,
        and the position after the chunk."""
        assert len(self.answers) == len(self.bounds), (self.sid, self.statuses)
        ref = prefix_probabilities(package, self.seq)
        for (a, b), (got_version, probs, position) in zip(self.bounds, self.answers,
                                                          strict=True):
            assert got_version == version, (self.sid, a, got_version, version)
            np.testing.assert_allclose(probs, ref[b - 1], atol=ATOL,
                                       err_msg=f"{self.sid} chunk [{a}, {b})")
            assert position in (None, b), (self.sid, a, b, position)


def send(client: httpx.Client, base: str, stream: Stream, k: int) -> httpx.Response:
    """Chunk K of STREAM, retried once (the same body: the same position, after
    RETRY_PAUSE_S) on a connection error, 502 or 503; the last response (or the second
    connection error, raised)."""
    path, body = stream.request(k)
    for attempt in (0, 1):
        if attempt:
            time.sleep(RETRY_PAUSE_S)
        try:
            response = client.post(base + path, json=body)
        except httpx.TransportError:
            if attempt:
                raise
            stream.retries += 1
            continue
        stream.statuses.append(response.status_code)
        if response.status_code in RETRY_ON and not attempt:
            stream.retries += 1
            continue
        return response
    raise AssertionError("unreachable")


def play(stream: Stream, base: Callable[[int], str], *,
         before: Callable[[int], None] | None = None, pause: float = 0.0) -> Stream:
    """Send every chunk of STREAM in order (chunk k to BASE(k)), each at most retried once;
    BEFORE(k) runs before chunk k. AssertionError on any other answer than 200."""
    with httpx.Client(timeout=60) as client:
        for k in range(len(stream.bounds)):
            if before is not None:
                before(k)
            response = send(client, base(k), stream, k)
            assert response.status_code == 200, (stream.sid, k, response.status_code,
                                                  response.text[:500])
            stream.record(response)
            if pause:
                time.sleep(pause)
    return stream


def streams(model: str, count: int, seed: int, **options) -> list[Stream]:
    rng, cut = np.random.default_rng(seed), random.Random(seed)
    tag = uuid.uuid4().hex[:6]
    return [Stream(f"{model}-{seed}-{tag}-{i}", model, sequence(rng), chunking(cut), **options)
            for i in range(count)]


def run_all(items: list[Stream], work: Callable[[Stream], Stream]) -> None:
    with ThreadPoolExecutor(len(items)) as pool:
        for future in [pool.submit(work, s) for s in items]:
            future.result()


def whole(base: str, model: str, seq: np.ndarray, version: int) -> list[float]:
    """The answer to the whole sequence sent at once (no session)."""
    r = httpx.post(base + "/predict", json={"model": model, "version": version,
                                            "inputs": [seq.tolist()]}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["outputs"][0]["probabilities"]


def metric(replica: Replica, name: str, **labels: str) -> float:
    """The sum of NAME's samples with LABELS on REPLICA's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(replica.url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


# -- the tests ------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["dense", "factored"])
def test_chunked_sessions_equal_the_whole_sequence(cluster_, model):
    """Sessions in random chunkings, concurrently, through the load balancer (so across
    replicas), on /predict and on the inference route: every chunk's answer is the
    prediction after its prefix, the last one the whole sequence's answer."""
    items = streams(model, 4, seed=1) + streams(model, 2, seed=2, route="infer")
    run_all(items, lambda s: play(s, lambda k: cluster_.url))
    package = cluster_.repo / model / "1"
    for s in items:
        s.check(package, 1)
        assert s.retries == 0, (s.sid, s.statuses)
        np.testing.assert_allclose(s.answers[-1][1], whole(cluster_.url, model, s.seq, 1),
                                   atol=ATOL)


def test_a_retried_chunk_is_answered_again_not_applied_twice(cluster_):
    """The same chunk sent twice (the second time through another replica) answers the
    same and moves the session once; an older position is 409 naming the session's."""
    (s,) = streams("dense", 1, seed=3)
    s.bounds = [(0, 4), (4, 7), (7, 12)]
    with httpx.Client(base_url=cluster_.url, timeout=60) as client:
        for k in range(3):
            path, body = s.request(k)
            first = client.post(path, json=body)
            again = client.post(path, json=body)
            assert first.status_code == again.status_code == 200, (first.text, again.text)
            assert first.json() == again.json()
            assert first.headers["orthornn-session-position"] == \
                again.headers["orthornn-session-position"] == str(s.bounds[k][1])
            s.record(first)
            if k == 1:  # a chunk at position 0 now: neither the session's nor the last
                path, stale = s.request(0)
                r = client.post(path, json={**stale, "start": False})
                assert r.status_code == 409, r.text
                assert "position 7" in r.json()["error"], r.text
                assert r.headers["orthornn-session-position"] == "7"
    s.check(cluster_.repo / "dense" / "1", 1)


def test_a_killed_replica_loses_no_session(cluster_):
    """SIGKILL of one replica while sessions stream through the load balancer, then its
    restart: every chunk is answered with at most one retry, every session completes
    with the right answers, and the restarted replica serves sessions again."""
    items = streams("dense", 8, seed=4)
    victim = cluster_.replicas[1]
    total = sum(len(s.bounds) for s in items)
    sent, lock = [0], threading.Lock()
    killed, restarted = threading.Event(), threading.Event()

    def before(stream: Stream):
        def hook(k: int) -> None:
            with lock:
                sent[0] += 1
            if k == len(stream.bounds) // 2:  # the second half after the restart
                assert restarted.wait(90), "the replica did not come back"
        return hook

    def control() -> None:
        deadline = time.monotonic() + 60
        while sent[0] < total // 4:  # a quarter of the chunks sent: kill it
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert victim.kill() is not None
        killed.set()
        victim.start()
        cluster_.lb.wait_states(cluster_.all_up(), timeout=30)
        restarted.set()

    with ThreadPoolExecutor(1) as pool:
        controller = pool.submit(control)
        run_all(items, lambda s: play(s, lambda k: cluster_.url, before=before(s),
                                      pause=0.01))
        controller.result()
    assert killed.is_set()
    package = cluster_.repo / "dense" / "1"
    for s in items:
        s.check(package, 1)
        np.testing.assert_allclose(s.answers[-1][1], whole(cluster_.url, "dense", s.seq, 1),
                                   atol=ATOL)
    # the restarted replica answered chunks of the sessions begun before it died
    assert metric(victim, "orthornn_requests_total", model="dense", status="200") > 0, \
        victim.output()[-3000:]


def test_a_hot_swap_leaves_every_session_on_its_version(cluster_):
    """Sessions started on version 1; version 2 is published and taken by every replica,
    and one replica is restarted (it then serves version 2 only). The sessions go on, each
    chunk on another replica in turn (and through the load balancer): every answer is
    version 1's, on every replica (the restarted one loads it on demand); sessions started
    after the swap are version 2's."""
    repo, stage = cluster_.repo, cluster_.stage
    v1, v2 = repo / "swap" / "1", stage / "swap" / "2"
    items = streams("swap", 6, seed=5)
    assert not np.allclose(prefix_probabilities(v1, items[0].seq),
                           prefix_probabilities(v2, items[0].seq), atol=1e-3)
    half = {s.sid: len(s.bounds) // 2 for s in items}
    swapped = threading.Event()

    def before(stream: Stream):
        def hook(k: int) -> None:
            if k == half[stream.sid]:
                assert swapped.wait(90), "the swap did not finish"
        return hook

    targets = [cluster_.url, *(r.url for r in cluster_.replicas)]

    def base(stream: Stream) -> Callable[[int], str]:
        offset = items.index(stream)
        return lambda k: cluster_.url if k < half[stream.sid] else \
            targets[(k + offset) % len(targets)]

    def swap() -> None:
        # the first half of every session's chunks answered, on version 1
        deadline = time.monotonic() + 60
        while any(len(s.answers) < half[s.sid] for s in items):
            assert time.monotonic() < deadline, [s.statuses for s in items]
            time.sleep(0.01)
        from ..service_helpers import publish_copy

        publish_copy(v2, repo / "swap", 2)
        for replica in cluster_.replicas:
            wait_version(replica.url, "swap", 2)
        restarted = cluster_.replicas[2]
        restarted.stop()
        restarted.start()
        cluster_.lb.wait_states(cluster_.all_up(), timeout=30)
        assert metric(restarted, "orthornn_model_loaded", model="swap", version="1") == 0
        swapped.set()

    with ThreadPoolExecutor(1) as pool:
        swapper = pool.submit(swap)
        run_all(items, lambda s: play(s, base(s), before=before(s)))
        swapper.result()
    for s in items:
        s.check(v1, 1)
    # the restarted replica had only version 2: it loaded version 1 for the sessions
    assert metric(cluster_.replicas[2], "orthornn_session_version_loads_total", model="swap",
                  result="loaded") >= 1
    # new sessions (and requests without one) get version 2, on every replica
    fresh = streams("swap", 3, seed=6)
    run_all(fresh, lambda s: play(s, lambda k: targets[(k + fresh.index(s)) % 4]))
    for s in fresh:
        s.check(repo / "swap" / "2", 2)
        np.testing.assert_allclose(s.answers[-1][1], whole(cluster_.url, "swap", s.seq, 2),
                                   atol=ATOL)


def wait_version(url: str, model: str, version: int, timeout: float = 30.0) -> None:
    """Until URL answers MODEL's requests without a version with VERSION."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(url + "/predict", json={"model": model, "inputs": [[[0.0, 0.0]]]},
                       timeout=10)
        if r.status_code == 200 and r.json()["version"] == version:
            return
        assert time.monotonic() < deadline, (url, r.status_code, r.text[:300])
        time.sleep(0.1)


def test_redis_down_gives_503_never_a_wrong_answer(cluster_):
    """Redis killed while sessions stream: their requests get 503 with Retry-After (never
    500, never a wrong 200), requests without a session keep working; once Redis is back
    (empty: nothing was persisted), the old sessions are 404 and new sessions work."""
    items = streams("dense", 6, seed=7)
    total = sum(len(s.bounds) for s in items)
    answered = [0]
    back = threading.Event()  # set just before Redis restarts
    failures: list[str] = []
    refused: list[httpx.Response] = []

    def work(stream: Stream) -> Stream:
        with httpx.Client(base_url=cluster_.url, timeout=60) as client:
            k = 0
            deadline = time.monotonic() + 60
            while k < len(stream.bounds) and time.monotonic() < deadline:
                path, body = stream.request(k)
                try:
                    r = client.post(path, json=body)
                except httpx.TransportError as error:
                    failures.append(f"{stream.sid} chunk {k}: {error!r}")
                    return stream
                stream.statuses.append(r.status_code)
                if r.status_code == 200:
                    stream.record(r)
                    answered[0] += 1
                    k += 1
                    time.sleep(0.02)
                elif r.status_code == 503:
                    refused.append(r)
                    time.sleep(0.05)  # the same chunk again, at the same position
                elif r.status_code == 404 and back.is_set():
                    return stream  # Redis came back empty: the session is gone
                else:
                    failures.append(f"{stream.sid} chunk {k}: {r.status_code} {r.text[:300]}")
                    return stream
        return stream

    stateless: list[httpx.Response] = []

    def control() -> None:
        deadline = time.monotonic() + 60
        while answered[0] < total // 3:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        cluster_.redis.stop()
        seq = items[0].seq
        outage_end = time.monotonic() + 2.0
        while time.monotonic() < outage_end or not refused:
            stateless.append(httpx.post(cluster_.url + "/predict", json={
                "model": "dense", "version": 1, "inputs": [seq.tolist()]}, timeout=30))
            time.sleep(0.05)
            assert time.monotonic() < deadline, "no session request was refused"
        back.set()  # from now on an old session may be 404 (Redis restarts empty)
        cluster_.redis.start()

    with ThreadPoolExecutor(1) as pool:
        controller = pool.submit(control)
        run_all(items, work)
        controller.result()
    assert not failures, failures
    assert refused, "no 503 while Redis was down"
    for r in refused:
        assert r.headers.get("retry-after"), (r.headers, r.text)
        assert "session store" in r.json()["error"], r.text
    package = cluster_.repo / "dense" / "1"
    for s in items:  # every 200 is the right answer for the prefix consumed
        ref = prefix_probabilities(package, s.seq)
        for (a, b), (version, probs, _) in zip(s.bounds, s.answers, strict=False):
            assert version == 1
            np.testing.assert_allclose(probs, ref[b - 1], atol=ATOL, err_msg=f"{s.sid} {a}")
    ref = prefix_probabilities(package, items[0].seq)[-1]
    assert stateless and all(r.status_code == 200 for r in stateless), \
        [(r.status_code, r.text[:200]) for r in stateless if r.status_code != 200]
    for r in stateless:
        np.testing.assert_allclose(r.json()["outputs"][0]["probabilities"], ref, atol=ATOL)
    # Redis is back: every replica opens sessions again (its client reconnects at once or
    # after a 503 or two)
    for replica in cluster_.replicas:
        (probe,) = streams("dense", 1, seed=8)
        probe.bounds = [(0, STEPS)]
        deadline = time.monotonic() + 10
        with httpx.Client(timeout=30) as client:
            while (r := send(client, replica.url, probe, 0)).status_code == 503:
                assert time.monotonic() < deadline, r.text
                time.sleep(0.1)
        assert r.status_code == 200, r.text
    fresh = streams("dense", 4, seed=9)
    run_all(fresh, lambda s: play(s, lambda k: cluster_.url))
    for s in fresh:
        s.check(package, 1)
        assert s.retries == 0, (s.sid, s.statuses)



def test_the_streaming_benchmark_compares_the_stores(tmp_path):
    """bench/load/streaming.py --parts stores at a toy size: both stores measured, no errors,
    Redis's memory per session counted (its numbers are not checked)."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "bench_streaming", cluster.ROOT / "bench" / "load" / "streaming.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "streaming.json"
    assert bench.main(["--history", "40", "--chunk", "4", "--hidden", "8", "--features", "2",
                       "--parts", "stores", "--sessions", "4", "8", "--concurrency", "4",
                       "--store-seconds", "0.3", "--store-rounds", "1",
                       "--out", str(out)]) == 0
    stores = json.loads(out.read_text())["stores"]
    rows = {(r["store"], r["sessions"]): r for r in stores["rows"]}
    assert set(rows) == {(s, n) for s in ("memory", "redis") for n in (4, 8)}
    assert all(r["errors"] == 0 and r["chunks"] > 0 for r in rows.values()), rows
    assert rows["redis", 8]["redis_bytes_per_session"] > 0
    assert set(stores["redis_over_memory"]) == {"4", "8"}
