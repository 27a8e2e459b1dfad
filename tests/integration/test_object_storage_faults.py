"""A connection to the object store cut in the middle (tests/cluster.py's CuttingProxy
between the client and a real SeaweedFS): an upload cut leaves no partial version
visible and no record half-written; a reply lost after the store applied a conditional
write (obstore retries, and meets a 412) is that write, done once; a download cut leaves
no partial version in a replica's mirror, which keeps serving and catches up."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from orthornn.export.artifacts import repository
from orthornn.export.artifacts.storage import open_store

from .. import objectstore
from ..cluster import CuttingProxy
from ..service_helpers import LiveServer

seaweedfs = objectstore.seaweedfs


@pytest.fixture
def proxy(seaweedfs, monkeypatch):
    """The S3 gateway behind a cutting proxy, the proxy the endpoint of this process."""
    with CuttingProxy(seaweedfs.ports["s3"]) as cutting:
        for key, value in seaweedfs.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{cutting.port}")
        yield cutting


def _copy(package: Path):
    def build(tmp: Path, version: int) -> None:
        for f in package.iterdir():
            shutil.copyfile(f, tmp / f.name)
    return build


def _path(uri: str, key: str) -> bytes:
    """The request path of KEY under URI (path-style: /BUCKET/PREFIX/KEY)."""
    return f"/{uri[len('s3://'):]}/{key}".encode()


def test_a_cut_upload_is_no_version_and_a_lost_reply_is_one_write(proxy, seaweedfs,
                                                                 service_packages):
    stage = service_packages / "adding" / "1"
    repo = f"{seaweedfs.location()}/repo"
    uri = f"{repo}/adding"
    # every try of version 1's manifest cut halfway: the export fails, and no reader sees
    # a version (its files are there, its manifest is not)
    proxy.arm(b"PUT " + _path(uri, "1/manifest.json"), where="request", times=None)
    with pytest.raises(OSError, match=r"manifest\.json"):
        repository.publish(repo, "adding", _copy(stage))
    proxy.disarm()
    assert proxy.cuts >= 1
    assert repository.versions(uri) == []
    assert "1/model.onnx" in open_store(uri).list()  # uploaded before the manifest
    with repository.local_model(uri) as mirror:
        assert not [p for p in mirror.iterdir() if p.name.isdigit()]
    # the next export takes the next number and is whole
    assert repository.publish(repo, "adding", _copy(stage)) == f"{uri}/2"
    with repository.local_model(uri) as mirror:
        assert sorted(p.name for p in (mirror / "2").iterdir()) == \
            sorted(p.name for p in stage.iterdir())
        for f in stage.iterdir():
            assert (mirror / "2" / f.name).read_bytes() == f.read_bytes()
    # the manifest's create applied, its reply lost: obstore's retry meets a 412, which
    # is this write's own object (its nonce): published, not refused
    cuts = proxy.cuts
    proxy.arm(b"PUT " + _path(uri, "3/manifest.json"))
    assert repository.publish(repo, "adding", _copy(stage)) == f"{uri}/3"
    assert proxy.cuts == cuts + 1 and repository.versions(uri) == [2, 3]

    # a record's every write cut halfway: the change fails, the record is the old one
    repository.promote(uri, 2, "publish", "first")
    before = repository.read_promotion(uri)
    proxy.arm(b"PUT " + _path(uri, "promotion.json"), where="request", times=None)
    with pytest.raises(OSError, match=r"promotion\.json"):
        repository.promote(uri, 3, "promote", "cut")
    proxy.disarm()
    assert repository.read_promotion(uri) == before
    # a record's write applied, its reply lost: the change is in the history once
    cuts = proxy.cuts
    proxy.arm(b"PUT " + _path(uri, "promotion.json"))
    repository.promote(uri, 3, "promote", "once")
    assert proxy.cuts == cuts + 1
    history = repository.read_promotion(uri)["history"]
    assert [e["reason"] for e in history] == ["first", "once"]
    assert history[-1]["previous"] == 2


def test_a_cut_download_leaves_no_partial_version_and_the_replica_catches_up(
        proxy, seaweedfs, service_packages, tmp_path):
    stage = service_packages / "adding"
    repo = f"{seaweedfs.location()}/repo"
    uri = f"{repo}/adding"
    repository.publish(repo, "adding", _copy(stage / "1"))
    repository.promote(uri, 1, "publish", "first")
    cache = tmp_path / "cache"
    failed: list[str] = []
    answered: list[int] = []
    stop = threading.Event()
    with LiveServer(repo=repo, repository_cache=str(cache), poll_interval_s=0.2) as server:
        def load() -> None:  # a client all along: every request answered
            with httpx.Client(base_url=server.url, timeout=30) as client:
                while not stop.is_set():
                    r = client.post("/predict", json={"model": "adding",
                                                      "inputs": [[[0.5, 1.0], [0.2, 0.0]]]})
                    if r.status_code == 200:
                        answered.append(r.json()["version"])
                    else:
                        failed.append(r.text)
        client = threading.Thread(target=load)
        client.start()
        try:
            # version 2's model cut after 100 bytes at every try: never in the mirror
            proxy.arm(b"GET " + _path(uri, "2/model.onnx"), keep=100, times=None)
            repository.publish(repo, "adding", _copy(stage / "2"))
            repository.promote(uri, 2, "promote", "second")

            def polls_failed() -> float:
                text = httpx.get(server.url + "/metrics").text
                return next((float(line.split()[-1]) for line in text.splitlines()
                             if line.startswith("orthornn_repository_errors_total")), 0.0)
            server.wait(lambda: polls_failed() >= 2 and proxy.cuts >= 2, timeout=60)
            assert not (cache / "adding" / "2").exists()
            assert not [p.name for p in (cache / "adding").iterdir()
                        if p.name.startswith(".tmp")]  # no half-built version left
            assert httpx.get(server.url + "/v2/health/ready").status_code == 200
            proxy.disarm()  # the next poll downloads it whole and swaps
            server.wait(lambda: answered[-1:] == [2], timeout=60)
        finally:
            stop.set()
            client.join(timeout=60)
    assert not failed, failed[:3]
    assert answered.count(1) > 0 and answered[-1] == 2


def test_a_rollout_the_bucket_cannot_take_is_a_409_naming_it(proxy, seaweedfs,
                                                             service_packages, tmp_path):
    """The repository API's rollout start while every write of the plan is cut: a 409
    whose body names the bucket, no 500, and no plan in the bucket."""
    repo = f"{seaweedfs.location()}/repo"
    uri = f"{repo}/adding"
    for v in (1, 2):
        repository.publish(repo, "adding", _copy(service_packages / "adding" / str(v)))
    gated = open_store(uri)
    manifest = json.loads(gated.read("2/manifest.json").data)
    manifest["evaluation"] = {**(manifest["evaluation"] or {}), "gate": {"passed": True}}
    gated.write("2/manifest.json", json.dumps(manifest).encode())  # what export --gate wrote
    repository.promote(uri, 1, "publish", "first")
    with LiveServer(repo=repo, repository_cache=str(tmp_path / "cache")) as server:
        proxy.arm(b"PUT " + _path(uri, "rollout.json"), where="request", times=None)
        r = httpx.post(server.url + "/v2/repository/models/adding/rollout/start",
                       json={"candidate": 2, "shadow": 0}, timeout=120)
        proxy.disarm()
    assert r.status_code == 409, r.text
    assert f"cannot be written in {repo} now" in r.json()["error"]
    assert "rollout.json" not in open_store(uri).list()
