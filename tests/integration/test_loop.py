"""The loop, unattended, with real processes (issue 43's acceptance): two ``orthornn serve``
replicas capturing every request into one folder, clients that shift, labels given back
through the labels route, the chart's retraining script (trigger, captured data set,
training, the two-split gate, the rollout controller) run by /bin/sh with the real
``orthornn``, while clients keep sending. In folders, and with the repository and the
captures in buckets of a real SeaweedFS (the chart's bucket values; version 1 and the blind
candidate trained once for both).

Digits as 8 rows of 8 pixels (sklearn's, bundled). Version 1 learns the original digits;
then the clients send inverted digits (1 - x), on which version 1 is near chance:

1. before the shift the job runs and does nothing (no drift, too few labels);
2. after it, labels of the shifted requests flow back, the job's trigger fires on drift,
   the job trains on the original data plus the labelled captures, the gate passes the
   candidate on both the original test split and the held-out captured slice, and the
   rollout promotes it on live traffic; no request fails meanwhile;
3. through the service, on inverted digits no model trained on, accuracy rises by at
   least 10 points; on the original test split it falls by at most 1 point;
4. a candidate trained on the original data only (it learned nothing from the captures)
   is refused by the gate on the captured slice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import yaml
from orthornn.export.artifacts import repository
from orthornn.export.artifacts.storage import open_store

from .. import objectstore
from ..cluster import ROOT, Replica
from ..pace import Pace
from ..service_helpers import wait_until
from ..system.test_deploy import _retraining_scripts, one, render

seaweedfs, s3_env = objectstore.seaweedfs, objectstore.s3_env

pytestmark = pytest.mark.timeout(900)

TOKEN = "labels-token-of-the-loop-test"
# version 1 and every retraining: an LSTM baseline on rows of digits, the job's train.yaml.
# Measured on this test's capture (docs/retraining.md, "The loop, end to end"): v1 0.9834
# on the test split; the retrain with 10% of each batch captured 0.9890 (seeds 1 and 2 of
# it 0.9834 and 0.9779; 8% 0.9890, 12% 0.9834), with 15% 0.9724, below the gate's 0.9734
# (the inverted digits take capacity from the original ones)
TRAIN = {"arch": "lstm", "task": "classify", "hidden_size": 64, "epochs": 40,
         "batch_size": 32, "lr": 0.01, "schedule": "cosine", "optimizer": "adam"}
CHART = ("retraining.enabled=true", "capture.enabled=true",
         "retraining.trigger.enabled=true", "retraining.trigger.minLabels=1000",
         "retraining.trigger.cooldownHours=0", "retraining.fromCaptures.enabled=true",
         "retraining.fromCaptures.dataMix=0.1",
         "retraining.trainConfig.task=classify", "retraining.gate.tolerance=0.01",
         "retraining.rollout.enabled=true", "retraining.rollout.shadow=0",
         "retraining.rollout.steps={50,100}", "retraining.rollout.intervalSeconds=2",
         "retraining.rollout.minRequests=20", "retraining.rollout.timeoutSeconds=300",
         # on 2 cores shared with the other tests, a p99 over 20 requests is one slow batch:
         # the candidate was rolled back at "3.81x the promoted version's" compute time in
         # two CI runs of 2026-12-02; the latency rule is test_rollout_live's (also 50)
         "retraining.rollout.maxLatencyRatio=50")


def orthornn(*args: object, code: int = 0, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "orthornn", *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, **(env or {})})
    assert result.returncode == code, (result.stdout + result.stderr)[-3000:]
    return result


def digits() -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """Every digit as [8 rows, 8 pixels] in [0, 1], and the train/validation/test indices
    the classify task splits an .npz into."""
    from orthornn.training.tasks.task import three_way
    from orthornn.training.tasks.user import USER_SPLIT
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = (data.images / 16.0).astype(np.float32), data.target.astype(np.int64)
    return x, y, tuple(np.asarray(i) for i in three_way(len(y), USER_SPLIT))


class Clients:
    """Client threads posting single digits round-robin to the replicas until stopped
    (paced: tests/pace.py), each with its X-Request-Id; every answer kept by id."""

    def __init__(self, urls: list[str], inputs: np.ndarray, threads: int = 3):
        self.urls, self.inputs, self.threads = urls, inputs, threads
        self.done = threading.Event()
        self.answers: list[tuple[int, int | None]] = []
        self.failures: list[str] = []

    def _run(self, k: int) -> None:
        pace = Pace()
        with httpx.Client(timeout=60) as client:
            i = k
            while not self.done.is_set():
                pace.wait()
                body = {"model": "digits", "inputs": [self.inputs[i % len(self.inputs)].tolist()]}
                try:
                    r = client.post(self.urls[i % len(self.urls)] + "/predict", json=body,
                                    headers={"X-Request-Id": f"load-{k}-{i}"})
                    i += self.threads
                    self.answers.append((r.status_code, r.json().get("version")))
                except Exception as error:  # any failure is the test's: kept
                    self.failures.append(repr(error))  # a client thread never dies silently
                    continue
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text[:200]}")

    def __enter__(self) -> Clients:
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(self.threads)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        for t in self._threads:
            t.join(timeout=60)


def send(urls: list[str], ids: list[str], x: np.ndarray) -> list[dict]:
    """One /predict per sequence, ids as X-Request-Id, alternating the replicas, one after
    another: the captures' times follow the order sent, so the labelled rows the job trains
    on and the slice it holds out are the same in every run (sent 4 at a time, they were
    not, and the retrain's accuracy on the original digits moved by two points with them:
    docs/retraining.md); the answers in order (each must be a 200). A kept-alive
    connection to each replica: a client of its own per request cost more CPU than the
    request itself."""
    answers = []
    clients = [httpx.Client(base_url=url, timeout=60) for url in urls]
    try:
        for i in range(len(x)):
            r = clients[i % len(urls)].post("/predict", headers={"X-Request-Id": ids[i]},
                                            json={"model": "digits", "inputs": [x[i].tolist()]})
            assert r.status_code == 200, r.text
            answers.append(r.json())
    finally:
        for client in clients:
            client.close()
    return answers


def accuracy(answers: list[dict], y: np.ndarray) -> float:
    return float(np.mean([a["outputs"][0]["index"] == t for a, t in zip(answers, y, strict=True)]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The original digits (an .npz), the job's train.yaml, version 1's run, and beside it a
    candidate that will never see a capture (a quarter of the budget: it is refused
    whatever it scores on the original digits); trained once for both variants, a thread
    each (two runs that each took both cores took ten times as long)."""
    work = tmp_path_factory.mktemp("loop-runs")
    x, y, _ = digits()
    original = work / "original.npz"
    np.savez(original, x=x, y=y, labels=np.array([str(c) for c in range(10)]))
    config = work / "train.yaml"
    config.write_text(yaml.safe_dump({**TRAIN, "data": str(original)}))
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(orthornn, "train", "--config", config, "--no-progress", "--out",
                            work / run, "--seed", seed, "--threads", 1, *extra)
                for run, seed, extra in (("v1", 0, ()), ("blind", 1, ("--epochs", 10)))]
        for job in jobs:
            job.result()
    return work


class Store:
    """Where the loop keeps its repository and captures: folders, or (BUCKET) prefixes of
    a SeaweedFS's bucket, served through the chart's bucket values; what the test reads of
    them, alike for both."""

    def __init__(self, tmp_path, server: objectstore.SeaweedFS | None):
        self.server = server
        if server is None:
            self.repo, self.captures = tmp_path / "repo", tmp_path / "captures"
            self.env: dict[str, str] = {}
            self.values: tuple[str, ...] = ()
        else:
            root = server.location()
            self.repo, self.captures, self.env = f"{root}/repo", f"{root}/captures", server.env
            self.values = (f"modelRepository.uri={self.repo}", f"capture.uri={self.captures}",
                           f"modelRepository.endpoint={server.endpoint}",
                           "modelRepository.existingSecret=s3-keys")
        self.model = repository.model_location(self.repo, "digits")

    def replica_args(self, tmp_path, i: int) -> list[str]:
        if self.server is None:
            return ["--capture", str(self.captures)]
        # a segment a second: what a replica answered reaches the bucket (and the other
        # replica's labels route) within about two seconds
        return ["--capture", self.captures, "--capture-spool", str(tmp_path / f"spool-{i}"),
                "--capture-segment-age-s", "1",
                "--repository-cache", str(tmp_path / f"cache-{i}")]

    def uploaded(self, ids: list[str]) -> None:
        """(A bucket:) until every one of IDS is in an uploaded segment."""
        if self.server is not None:
            store, wanted = open_store(self.captures), set(ids)
            wait_until(lambda: wanted <= set(objectstore.captured_ids(store, "digits")),
                       timeout=60, interval=0.5, what="the captures uploaded")

    def versions(self) -> list[int]:
        return repository.versions(self.model)

    def manifest(self, version: int) -> dict:
        return json.loads(open_store(str(self.model)).read(f"{version}/manifest.json").data)

    def promoted(self) -> int | None:
        return repository.promoted(self.model)

    def rejected(self) -> list[dict]:
        store = open_store(str(self.model))
        return [json.loads(store.read(k).data) for k in store.list(f"{repository.REJECTED}/")
                if k.endswith("/manifest.json")]


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_the_loop_unattended(where, trained, tmp_path, request):
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    x, y, (train_idx, _, test_idx) = digits()
    store = Store(tmp_path, request.getfixturevalue("s3_env") if where == "bucket" else None)
    repo, runs = store.repo, tmp_path / "runs"
    runs.mkdir()
    original, config = trained / "original.npz", trained / "train.yaml"
    orthornn("export", trained / "v1", "--repo", repo, "--name", "digits", "--no-progress",
             env=store.env)

    # the chart's retraining script, its paths pointed at this test's files
    docs = render(*CHART, *store.values, f"retraining.trainConfig.data={original}")
    assert yaml.safe_load(one(docs, "ConfigMap", "-train")["data"]["train.yaml"])["task"] \
        == "classify"
    script, env = _retraining_scripts(docs)["Job"]
    assert (env["ORTHORNN_REPO"], env["ORTHORNN_CAPTURES"]) == \
        ((str(repo), str(store.captures)) if where == "bucket" else ("/models", "/captures"))
    for path, here in (("/config/train.yaml", config), ("/runs", runs),
                       ("/tmp/retrain-reason", tmp_path / "reason")):
        script = script.replace(path, str(here))
    shim = tmp_path / "bin" / "orthornn"  # the image's console script: this checkout's
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\ncd "{ROOT}" && exec "{sys.executable}" -m orthornn "$@"\n')
    shim.chmod(0o755)

    replicas = [Replica(repo, env={"ORTHORNN_LABELS_TOKEN": TOKEN, **store.env},
                        args=[*store.replica_args(tmp_path, i), "--capture-sample", "1",
                              "--capture-replica", f"r{i}", "--poll-interval-s", "0.2",
                              "--rollout-controller", "off"]) for i in range(2)]
    urls = [r.url for r in replicas]

    def job() -> str:
        result = subprocess.run(
            [sh, "-ec", script], capture_output=True, text=True, timeout=600,
            env={**os.environ, **env, **store.env, "ORTHORNN_REPO": str(repo),
                 "ORTHORNN_CAPTURES": str(store.captures),
                 "ORTHORNN_ROLLOUT_REPLICAS": ",".join(urls),
                 "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"})
        out = result.stdout + result.stderr
        with open(tmp_path / "job.log", "a") as log:  # what the Job's pod would log
            log.write(out)
        assert result.returncode == 0, out[-4000:]
        return out

    try:
        for replica in replicas:
            replica.start()
        # 1. the original digits: version 1's accuracy on the test split, a window of 221
        # sequences of the reference's kind; the job finds nothing to do
        extra = train_idx[-40:]
        before_test = send(urls, [f"test-{i}" for i in test_idx], x[test_idx])
        send(urls, [f"orig-{i}" for i in extra], x[extra])
        assert {a["version"] for a in before_test} == {1}
        store.uploaded([f"orig-{i}" for i in extra])
        out = job()
        assert "retraining: nothing to do for digits" in out, out[-3000:]
        assert store.versions() == [1]

        # 2. the clients shift to inverted digits; the labelling system answers for those
        # of the training split's first 400 (the test split's stay unlabelled: evaluation)
        shifted = np.concatenate([train_idx[:400], test_idx])
        order = np.random.default_rng(0).permutation(len(shifted))
        ids = [f"shift-{i}" for i in shifted[order]]
        answers = dict(zip(ids, send(urls, ids, 1.0 - x[shifted[order]]), strict=True))
        before_shifted = [answers[f"shift-{i}"] for i in test_idx]
        labelled = [{"id": f"shift-{i}", "label": int(y[i])} for i in train_idx[:400]]
        store.uploaded(ids)  # a bucket: the other replica's answers labelled there too
        for k in range(0, len(labelled), 100):
            r = httpx.post(urls[k // 100 % 2] + "/v2/models/digits/labels", timeout=60,
                           json=labelled[k:k + 100],
                           headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.json()["accepted"] == 100, r.text

        # 3. the job, while the clients keep sending inverted digits to both replicas
        with Clients(urls, 1.0 - x[train_idx[400:600]]) as load:
            out = job()
        assert "orthornn retrain-trigger: fires: drift detected" in out, out[-3000:]
        assert not load.failures, load.failures[:5]
        assert len(load.answers) >= 40 and {s for s, _ in load.answers} == {200}
        # the canary served both
        assert {v for _, v in load.answers} == {1, 2}, (len(load.answers), out[-3000:])
        manifest = store.manifest(2)
        with np.load(runs / "captured.npz") as f:
            learned, segments = len(f["y"]), sorted(str(s) for s in f["segments"])
        # every replica's segments of the shift taught it (the names they keep once closed)
        assert {s.split("/")[-1].split("-")[0] for s in segments} == {"r0", "r1"}
        with np.load(runs / "captured.npz") as f:
            train_ids, train_times = set(map(str, f["ids"])), f["times"]
        with np.load(runs / "captured-holdout.npz") as f:
            held_out, held_ids, held_times = len(f["y"]), set(map(str, f["ids"])), f["times"]
        assert learned + held_out == 400  # every label joined, the newest slice held out
        # train and holdout are disjoint, by id, and the holdout is the newest slice
        assert not train_ids & held_ids and len(train_ids | held_ids) == 400
        assert train_times.max() <= held_times.min()
        assert manifest["lineage"]["captures"] == {"segments": segments, "labels": learned}
        gate = manifest["evaluation"]["gate"]
        assert gate["passed"] and gate["gate_data"]["require_better"]
        # the candidate beat the incumbent on the captured slice, by the margin at least
        assert gate["gate_data"]["candidate"] >= gate["gate_data"]["incumbent"] \
            + gate["gate_data"]["margin"], gate
        assert store.promoted() == 2

        # 4. through the service again, now answered by version 2
        after_test = send(urls, [f"after-test-{i}" for i in test_idx], x[test_idx])
        after_shifted = send(urls, [f"after-shift-{i}" for i in test_idx], 1.0 - x[test_idx])
        assert {a["version"] for a in after_test + after_shifted} == {2}
        v1 = accuracy(before_test, y[test_idx]), accuracy(before_shifted, y[test_idx])
        v2 = accuracy(after_test, y[test_idx]), accuracy(after_shifted, y[test_idx])
        print(f"loop: test split {v1[0]:.4f} -> {v2[0]:.4f}, inverted {v1[1]:.4f} -> "
              f"{v2[1]:.4f}, {len(load.answers)} requests during the job, gate {gate}")
        assert v2[1] >= v1[1] + 0.10, (v1, v2)  # learned the shifted inputs
        assert v2[0] >= v1[0] - 0.01, (v1, v2)  # and kept the original ones

        # 5. a candidate that learned nothing from the captures: refused on the captured slice
        refused = orthornn("export", trained / "blind", "--repo", repo, "--name", "digits",
                           "--gate", "--gate-data", runs / "captured-holdout.npz",
                           "--require-better-on-gate-data", "--tolerance", "0.01",
                           "--no-progress", code=3, env=store.env)
        assert "refused by the gate" in refused.stderr, refused.stderr
        # whichever split it names (version 2 may also beat it on the original one), on
        # the captured slice it is near chance, far below version 2: refused against either
        # (not "below version 1 + the margin": two scores near chance on 80 sequences, the
        # order of which the seed decides)
        (kept,) = store.rejected()
        blind = kept["evaluation"]["splits"]["gate_data"]["value"]
        print(f"loop: the blind candidate {blind:.4f} on the captured slice")
        assert blind < gate["gate_data"]["candidate"] - 0.5, (blind, gate)
        assert store.promoted() == 2
    finally:
        for replica in replicas:
            replica.kill()
