"""The storage seam against a real S3 server (SeaweedFS on loopback: tests/objectstore.py)
and a local folder: the interface's contract on both, conditional writes that lose no
update, and the model repository in a bucket through the real commands (concurrent
exports taking distinct numbers, the manifest last, the gate, rollback, versions, and
the errors a bad location gets)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from orthornn.export.artifacts import remote, repository, rollback
from orthornn.export.artifacts.package import verify_package
from orthornn.export.artifacts.storage import Changed, Exists, open_store

from .. import objectstore
from ..cluster import ROOT, Replica

seaweedfs, s3_env = objectstore.seaweedfs, objectstore.s3_env


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "store"))
    server = request.getfixturevalue("s3_env")
    return open_store(f"{server.location()}/some/prefix")


def test_the_store_keeps_its_contract(store):
    with pytest.raises(FileNotFoundError):
        store.read("a/b.json")
    etag = store.write_if_absent("a/b.json", b"one")
    with pytest.raises(Exists):
        store.write_if_absent("a/b.json", b"two")
    blob = store.read("a/b.json")
    assert (blob.data, blob.etag) == (b"one", etag)
    assert store.read_if_changed("a/b.json", etag) is None  # unchanged: nothing read
    new = store.write_if_unchanged("a/b.json", b"three", etag)
    assert new != etag
    with pytest.raises(Changed):  # the ETag read is no longer the object's
        store.write_if_unchanged("a/b.json", b"four", etag)
    assert store.read_if_changed("a/b.json", etag).data == b"three"
    store.write("a/c/d.bin", bytes(range(256)))
    assert store.list() == ["a/b.json", "a/c/d.bin"]
    assert store.list("a/c/") == ["a/c/d.bin"] and store.list("zz") == []
    store.delete("a/b.json")
    store.delete("a/b.json")  # gone already: nothing to do
    with pytest.raises(Changed):  # a removed object is not the one read either
        store.write_if_unchanged("a/b.json", b"five", new)
    assert store.list() == ["a/c/d.bin"] and store.read("a/c/d.bin").data == bytes(range(256))
    with pytest.raises(ValueError, match="must be relative"):
        store.read("../outside")


def test_conditional_writes_lose_no_update(store):
    """Four writers appending to one record at once, 25 entries each (read -> change ->
    write-if-unchanged, retried): every entry is there once, and the writers' entries
    interleave (they did run at once)."""
    start = threading.Barrier(4)

    def writer(k: int) -> None:
        start.wait()
        for i in range(25):
            remote.update(store, "record.json", lambda data, k=k, i=i: [
                *(json.loads(data) if data else []), f"{k}-{i}"])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(writer, range(4)))
    entries = json.loads(store.read("record.json").data)
    assert sorted(entries) == sorted(f"{k}-{i}" for k in range(4) for i in range(25))
    switches = sum(a.split("-")[0] != b.split("-")[0] for a, b in itertools.pairwise(entries))
    assert switches >= 3


# -- the repository in a bucket, through the commands -------------------------------------

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    out = tmp_path_factory.mktemp("run") / "adding"
    train(TrainConfig(arch="svdrnn", task="adding", seq_len=6, hidden_size=8, steps=4,
                      batch_size=8, log_every=4, out=str(out)), progress=False)
    return out


def orthornn(*args: object, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orthornn", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_concurrent_exports_take_distinct_numbers_and_appear_whole(s3_env, run_dir, tmp_path):
    repo = f"{s3_env.location()}/repo"
    flags = [("dense", 18), ("dense", 19), ("factored", 18), ("factored", 19)]
    with ThreadPoolExecutor(4) as pool:  # four processes at once, one per mode and opset
        done = list(pool.map(lambda f: orthornn(
            "export", run_dir, "--repo", repo, "--name", "adder", "--mode", f[0],
            "--opset", f[1], "--no-progress"), flags))
    for result in done:
        assert result.returncode == 0, result.stderr[-2000:]
    printed = sorted(r.stdout.strip() for r in done)
    assert printed == [f"{repo}/adder/{v}" for v in (1, 2, 3, 4)]
    location = repository.model_location(repo, "adder")
    assert repository.versions(location) == [1, 2, 3, 4]
    with repository.local_model(location) as local:  # each version whole, and verifies
        made = {(m.mode, m.opset): m.version for m in
                (verify_package(local / str(v)) for v in (1, 2, 3, 4))}
    assert sorted(made) == sorted(flags) and sorted(made.values()) == [1, 2, 3, 4]
    history = repository.read_promotion(location)["history"]
    assert sorted(e["version"] for e in history) == [1, 2, 3, 4]  # no promotion lost
    assert not (ROOT / "s3:").exists() and not (tmp_path / "s3:").exists()

    listed = orthornn("versions", "--repo", repo, "--name", "adder")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split()[:2] for line in listed.stdout.splitlines()[1:5]]
    live = history[-1]["version"]
    assert rows == [[str(v), "promoted" if v == live else "published"] for v in (1, 2, 3, 4)]

    back = orthornn("rollback", "--repo", repo, "--name", "adder", "--to", "1" if live != 1
                    else "2")
    assert back.returncode == 0, back.stderr
    assert repository.promoted(location) == (1 if live != 1 else 2)
    again = orthornn("export", run_dir, "--repo", repo, "--name", "adder", "--no-progress")
    assert again.returncode == 0 and "already holds this checkpoint" in again.stderr
    assert again.stdout.strip() == f"{repo}/adder/{made['dense', 18]}"


def test_the_gate_judges_against_the_promoted_version_in_the_bucket(s3_env, run_dir):
    repo = f"{s3_env.location()}/repo"
    first = orthornn("export", run_dir, "--repo", repo, "--name", "m", "--no-progress")
    assert first.returncode == 0, first.stderr
    # the same weights and graph as 1 (another opset: a package of its own): the same MSE
    # to the bit (the factored graph's differs in its last bits under some CPUs' kernels,
    # and --tolerance 0 refused it on an AMD EPYC)
    passed = orthornn("export", run_dir, "--repo", repo, "--name", "m", "--opset", "19",
                      "--gate", "--min-metric", "10", "--no-progress")
    assert passed.returncode == 0, passed.stderr
    location = repository.model_location(repo, "m")
    with repository.local_model(location) as local:
        gate = verify_package(local / "2").evaluation["gate"]
    assert gate["passed"] and gate["against"] == 1
    refused = orthornn("export", run_dir, "--repo", repo, "--name", "m", "--mode", "factored",
                       "--gate", "--min-metric", "1e-9", "--no-progress")  # MSE <= 1e-9
    assert refused.returncode == 3, refused.stderr
    kept = [k for k in open_store(location).list("rejected/") if k.endswith("/gate.json")]
    assert len(kept) == 1 and f"{location}/{kept[0].rsplit('/', 1)[0]}" in refused.stderr
    assert repository.versions(location) == [1, 2] and repository.promoted(location) == 2
    assert rollback.rollback(location)["promoted"] == 1


def test_a_claimed_version_without_its_manifest_is_no_version(s3_env, run_dir):
    """An upload that died after its claim (and some files): readers never see it, and
    the next publish takes the next number, not the hole."""
    repo = f"{s3_env.location()}/repo"
    location = repository.model_location(repo, "m")
    store = open_store(location)
    store.write_if_absent("1/.claim", b"{}")
    store.write("1/model.onnx", b"half an upload")
    assert repository.versions(location) == []
    with repository.local_model(location) as local:
        assert not (local / "1").exists()
    done = orthornn("export", run_dir, "--repo", repo, "--name", "m", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{location}/2" and repository.versions(location) == [2]


@pytest.mark.parametrize("repo, message", [
    ("s3:/models/repo", "is not a URI (s3://BUCKET[/PREFIX], two slashes)"),
    ("gs://models/repo", "is a gs:// URI; a location is a local folder or s3://"),
    ("s3://Bad_Bucket/repo", "the bucket must be 3-63 lower-case letters"),
    ("s3://models//repo", "the prefix has an empty"),
])
def test_a_malformed_location_gets_one_line(run_dir, tmp_path, repo, message, capsys,
                                            monkeypatch):
    from orthornn.cli import main

    monkeypatch.chdir(tmp_path)  # in-process: the command's code and exit status, no import
    try:
        code = main(["export", str(run_dir), "--repo", repo, "--name", "m"])
    except SystemExit as exit:  # argparse's error
        code = exit.code
    stderr = capsys.readouterr().err
    assert code == 2 and message in stderr, stderr
    assert "Traceback" not in stderr and list(tmp_path.iterdir()) == []  # nothing written


def test_a_missing_bucket_or_refused_keys_get_one_line_before_any_work(s3_env, run_dir,
                                                                       monkeypatch):
    missing = orthornn("export", run_dir, "--repo", "s3://no-such-bucket/repo", "--name", "m")
    assert missing.returncode == 2, missing.stderr
    assert "--repo: s3://no-such-bucket/repo cannot be used: the bucket does not exist" \
        in missing.stderr
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    refused = orthornn("versions", "--repo", s3_env.location(), "--name", "m")
    assert refused.returncode == 2 and "the secret key is refused" in refused.stderr, \
        refused.stderr
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:1")  # no IMDS, anywhere
    keyless = orthornn("versions", "--repo", s3_env.location(), "--name", "m")
    assert keyless.returncode == 2 and "no credentials: set AWS_ACCESS_KEY_ID" in \
        keyless.stderr, keyless.stderr
    assert all("Traceback" not in r.stderr for r in (missing, refused, keyless))


# -- the service, serving a bucket's models from a mirror ---------------------------------

def _answer(url: str) -> int:
    r = httpx.post(f"{url}/predict", timeout=30,
                   json={"model": "adder", "inputs": [[[0.25, 0.0]] * 5 + [[0.5, 1.0]]]})
    assert r.status_code == 200, r.text
    return r.json()["version"]


def _send(url: str, model: str, sequence: list, ids) -> None:
    """One /predict of SEQUENCE to MODEL under each request id of IDS, each answered 200
    with its id echoed."""
    for rid in ids:
        r = httpx.post(f"{url}/predict", headers={"X-Request-Id": rid}, timeout=30,
                       json={"model": model, "inputs": [sequence]})
        assert r.status_code == 200 and r.headers["X-Request-Id"] == rid, r.text


def _until(what, expected, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while (got := what()) != expected:
        assert time.monotonic() < deadline, f"{got!r}, not {expected!r}, after {seconds} s"
        time.sleep(0.2)


def test_the_service_follows_the_bucket_and_keeps_serving_while_it_is_down(run_dir, tmp_path,
                                                                            monkeypatch):
    """``orthornn serve --repo s3://...``: versions published to the bucket are served from
    the mirror (the next poll swaps), a rollback written to the bucket (by the command, and
    by the repository API, which writes it there) moves the service too; with the S3
    server stopped the loaded version keeps answering, readiness stays 200 and the
    failures are counted. A SeaweedFS of its own: this test stops it."""
    with objectstore.SeaweedFS(tmp_path / "weed") as server:
        repo = f"s3://{server.shared}/repo"
        env = {**server.env}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        published = subprocess.run(
            [sys.executable, "-m", "orthornn", "export", str(run_dir), "--repo", repo,
             "--name", "adder", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
            timeout=300, env={**os.environ, **env})
        assert published.returncode == 0, published.stderr
        cache = tmp_path / "cache"
        replica = Replica(repo, env=env, args=["--repository-cache", str(cache),
                                               "--poll-interval-s", "0.2"])
        replica.start()
        try:
            # ready means the bucket's models are served (the mirror is made before the
            # models readiness waits for are taken from it)
            assert httpx.get(f"{replica.url}/v2/models/adder/ready", timeout=30).status_code \
                == 200
            assert _answer(replica.url) == 1
            assert (cache / "adder" / "1" / "manifest.json").is_file()  # served from here
            second = subprocess.run(
                [sys.executable, "-m", "orthornn", "export", str(run_dir), "--repo", repo,
                 "--name", "adder", "--mode", "factored", "--no-progress"], cwd=ROOT,
                capture_output=True, text=True, timeout=300, env={**os.environ, **env})
            assert second.returncode == 0, second.stderr
            _until(lambda: _answer(replica.url), 2)  # published to the bucket: swapped in
            back = subprocess.run(
                [sys.executable, "-m", "orthornn", "rollback", "--repo", repo, "--name",
                 "adder"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                env={**os.environ, **env})
            assert back.returncode == 0, back.stderr
            _until(lambda: _answer(replica.url), 1)
            forth = httpx.post(f"{replica.url}/v2/repository/models/adder/rollback",
                               json={"version": 2}, timeout=60)
            assert forth.status_code == 200, forth.text
            assert _answer(replica.url) == 2  # synced at once, not at the next poll
            location = repository.model_location(repo, "adder")
            assert repository.promoted(location) == 2  # written to the bucket, not the mirror
            # the rollout routes judge the bucket's versions (test_rollout_bucket.py runs one)
            refused = httpx.post(f"{replica.url}/v2/repository/models/adder/rollout/start",
                                 json={"candidate": 1}, timeout=60)
            assert refused.status_code == 409 and "without --gate" in refused.text

            server.stop()  # the store is gone: what is loaded keeps serving
            errors = 0.0
            deadline = time.monotonic() + 60
            while errors < 2:
                assert time.monotonic() < deadline, "no poll failure counted"
                assert _answer(replica.url) == 2
                ready = httpx.get(f"{replica.url}/v2/health/ready", timeout=30)
                assert ready.status_code == 200
                text = httpx.get(f"{replica.url}/metrics", timeout=30).text
                errors = next((float(line.split()[-1]) for line in text.splitlines()
                               if line.startswith("orthornn_repository_errors_total")), 0.0)
                time.sleep(0.2)
        finally:
            replica.stop()
        assert "cannot be read" in replica.output()  # logged once, the cause named


# -- captures on a bucket -----------------------------------------------------------------

LABELS_TOKEN = "labels-token-of-the-bucket-test"


def test_labels_on_a_bucket_are_objects_there_that_every_replica_follows(s3_env, tmp_path):
    """``--capture s3://...``: a batch of labels is one object in the bucket; the replica
    that answered takes a label for a request still in its spool or already uploaded;
    another replica, with its own spool, finds the first one's captures and labels by
    listing: it takes a label for what the first captured, never a second one."""
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    run, repo = tmp_path / "digits", tmp_path / "repo"
    train(TrainConfig(arch="svdrnn", task="digits", hidden_size=8, steps=2, batch_size=8,
                      log_every=2, out=str(run)), progress=False)
    assert orthornn("export", run, "--repo", repo, "--name", "digits",
                    "--no-progress").returncode == 0
    uri = f"{s3_env.location()}/labelled"
    store = open_store(uri)
    env = {**s3_env.env, "ORTHORNN_LABELS_TOKEN": LABELS_TOKEN}

    def replica(name: str, age: str) -> Replica:
        return Replica(repo, env=env, args=[
            "--capture", uri, "--capture-spool", str(tmp_path / f"spool-{name}"),
            "--capture-segment-age-s", age, "--capture-replica", name])

    def send(to: Replica, *ids: str) -> None:
        _send(to.url, "digits", [[0.5]] * 64, ids)

    def label(to: Replica, *ids: str) -> tuple[int, str]:
        r = httpx.post(f"{to.url}/v2/models/digits/labels", timeout=30,
                       headers={"Authorization": f"Bearer {LABELS_TOKEN}"},
                       json=[{"id": rid, "label": 3} for rid in ids])
        assert r.status_code in (200, 409, 422), r.text
        return r.status_code, r.text

    def labels_in_bucket() -> list[str]:
        return sorted(line["id"] for key in store.list("digits/labels/")
                      for line in map(json.loads, store.read(key).data.splitlines()))

    first, second = replica("a", "1"), replica("b", "60")
    with first, second:
        send(first, "up0", "up1")
        _until(lambda: sorted(k.rsplit("/", 1)[-1] for k in store.list("digits/1/"))[:1],
               ["a-1.jsonl"], 30)  # closed at 1 s and uploaded
        send(first, "spooled")  # in a's spool only, for a second
        assert label(first, "up0", "spooled")[0] == 200
        assert len(store.list("digits/labels/")) == 1  # one object a batch
        assert label(first, "up0")[0] == 409  # a label is given once
        _until(lambda: any(k.endswith("a-2.jsonl") for k in store.list("digits/1/")), True,
               30)
        # the other replica: a's captures and labels by listing the bucket
        assert label(second, "up1")[0] == 200
        status, text = label(second, "spooled")
        assert status == 409 and "already labelled" in text, text
        assert label(second, "never-sent")[0] == 422
        assert label(first, "up1")[0] == 409  # b's label, seen by a through the bucket
        send(first, "bulk")
        _until(lambda: any(k.endswith("a-3.jsonl") for k in store.list("digits/1/")), True,
               30)
    # in bulk, from the command line, into the bucket as well
    (tmp_path / "bulk.csv").write_text("id,label\nbulk,5\n")
    imported = orthornn("labels", "import", tmp_path / "bulk.csv", "--capture", uri,
                        "--repo", repo, "--name", "digits")
    assert imported.returncode == 0, imported.stderr
    again = orthornn("labels", "import", tmp_path / "bulk.csv", "--capture", uri,
                     "--repo", repo, "--name", "digits")
    assert again.returncode == 2 and "already labelled" in again.stderr, again.stderr
    assert labels_in_bucket() == ["bulk", "spooled", "up0", "up1"]
    assert "Traceback" not in first.output() + second.output()


def test_captures_go_to_the_bucket_and_the_commands_read_them_there(s3_env, run_dir,
                                                                    tmp_path):
    """``orthornn serve --capture s3://...``: segments close at their age and are uploaded,
    leaving only markers in the spool; a replica killed with its segment open leaves it to
    the next start on the same spool, which uploads it; SIGTERM uploads the last; every
    answered request's record is in the bucket once. retrain-trigger and monitor read the
    bucket as they read a folder holding the same objects."""
    repo, spool = tmp_path / "repo", tmp_path / "spool"
    assert orthornn("export", run_dir, "--repo", repo, "--name", "adder",
                    "--no-progress").returncode == 0
    uri = f"{s3_env.location()}/captures"
    store = open_store(uri)
    replica = Replica(repo, env=s3_env.env, args=[
        "--capture", uri, "--capture-spool", str(spool), "--capture-segment-age-s", "1",
        "--capture-replica", "r"])

    def send(first: int, count: int) -> list[str]:
        ids = [f"q{i}" for i in range(first, first + count)]
        _send(replica.url, "adder", [[0.25, 0.0]] * 5 + [[0.5, 1.0]], ids)
        return ids

    replica.start()
    try:
        sent = send(0, 10)
        captured = lambda: objectstore.captured_ids(store, "adder")  # noqa: E731
        _until(captured, sorted(sent), 30)  # closed at 1 s, uploaded
        assert {p.name.endswith(".uploaded") for p in spool.rglob("*.jsonl*")} == {True}
        assert all(p.stat().st_size == 0 for p in spool.rglob("*.uploaded"))
        sent += send(10, 5)
        replica.kill()  # at once: the segment is still open in the spool
        assert list(spool.rglob("*.jsonl.open"))
        replica.start()
        _until(captured, sorted(sent), 30)  # its start uploaded it
        sent += send(15, 3)
    finally:
        replica.stop()  # SIGTERM: the last segment closed and uploaded
    assert captured() == sorted(sent)  # each once
    assert not list(spool.rglob("*.jsonl")) and not list(spool.rglob("*.jsonl.open"))
    text = replica.output()
    assert "Traceback" not in text, text

    # the loop's commands on the bucket and on a folder of the same objects, alike
    day = next(k for k in store.list("adder/")).split("/")[2]
    store.write(f"adder/labels/{day}/r-9.jsonl",
                b"".join(json.dumps({"id": rid, "label": [0.5], "time": time.time(),
                                     "source": "api"}).encode() + b"\n" for rid in sent[:4]))
    folder = tmp_path / "copy"
    for key in store.list():
        (folder / key).parent.mkdir(parents=True, exist_ok=True)
        (folder / key).write_bytes(store.read(key).data)
    # and with the repository in a bucket too (--repo s3://...: the model mirrored)
    repo_uri = f"{s3_env.location()}/repo"
    objectstore.upload_model(repo / "adder", f"{repo_uri}/adder")
    for command in (["retrain-trigger", "--name", "adder", "--min-labels", "3",
                     "--cooldown", "0"],
                    ["monitor", "--name", "adder"],
                    ["capture", "dataset", "--name", "adder", "--out", "OUT"]):
        runs = [(uri, repo), (folder, repo), (uri, repo_uri), (folder, repo_uri)]
        done = [orthornn(*[str(tmp_path / "d.npz") if a == "OUT" else a for a in command],
                         "--capture", capture, "--repo", models) for capture, models in runs]
        first = done[0]
        if command[0] == "capture":  # a regression model's captures: refused, as read
            assert first.returncode == 2 and "is a regress model" in first.stderr
        else:  # 2: refused
            assert first.returncode in (0, 1) and "Traceback" not in first.stderr, \
                first.stderr
        for other, (capture, models) in zip(done[1:], runs[1:], strict=True):
            assert (other.returncode, other.stdout, other.stderr.splitlines()[-1:]) == \
                (first.returncode, first.stdout, first.stderr.splitlines()[-1:]), \
                (capture, models, other.stderr)
    assert "4 labels" in orthornn("retrain-trigger", "--repo", repo, "--name", "adder",
                                  "--min-labels", "3", "--cooldown", "0", "--capture",
                                  uri).stdout
    # labels judged against the bucket's repository as against the folder (the model's
    # task read from its manifest: a regression model takes none)
    labels = tmp_path / "labels.jsonl"
    labels.write_text(json.dumps({"id": sent[4], "label": [0.25]}) + "\n")
    refused = [orthornn("labels", "import", labels, "--capture", folder, "--repo", models,
                        "--name", "adder") for models in (repo, repo_uri)]
    assert [r.returncode for r in refused] == [2, 2]
    assert refused[0].stderr == refused[1].stderr and "(task regress) takes no labels" in \
        refused[1].stderr
