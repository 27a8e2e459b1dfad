"""promotion.json and rollout.json under concurrent writers and killed writers
(export/artifacts/records.py): every writer holds the model's one lock, re-reads under it,
and replaces the file crash-safe; in a bucket (export/artifacts/remote.py,
rollout/bucket.py) every writer re-reads and writes only if unchanged since. Writers are
processes of their own (tests/promotion_writer.py), as the export CronJob, a person's
rollback, the admin API and the rollout controller are."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from orthornn.export.artifacts import records, remote, repository, rollback, rollout
from orthornn.export.artifacts.storage import open_store

from .. import objectstore
from ..service_helpers import gated, make_repo

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = [1, 2, 3, 4]
seaweedfs, s3_env = objectstore.seaweedfs, objectstore.s3_env


@pytest.fixture
def folder_model(service_packages, tmp_path) -> Path:
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": VERSIONS})
    for v in VERSIONS:
        gated(repo / "adding", v)
    repository.promote(repo / "adding", 1, "publish", "first")
    return repo / "adding"


@pytest.fixture(params=["folder", "bucket"])
def location(request, folder_model) -> Path | str:
    """The model in a folder, or the same versions in a bucket (s3://.../adding)."""
    if request.param == "folder":
        return folder_model
    return objectstore.upload_model(
        folder_model, f"{request.getfixturevalue('s3_env').location()}/adding")


def writer(role: str, model_dir: Path | str, rounds: int, seed: int,
           tag: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.promotion_writer", role,
                             str(model_dir), str(rounds), str(seed), tag], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def started(procs: list[subprocess.Popen]) -> None:
    """The start barrier: every writer ready (imported, its first write next), then all
    let go at once."""
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        assert json.loads(proc.stdout.readline()) == {"ready": True}
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def test_concurrent_writers_lose_no_action_and_keep_a_valid_order(location):
    """Five processes at once (two promoting as export does, two rolling back, one
    starting rollouts that the controller finishes), 200 rounds in all: the history holds
    every action that completed, each from the promotion the one before it left. In a
    folder and in a bucket."""
    model_dir = location
    roles = [("promote", 40), ("promote", 40), ("rollback", 40), ("rollback", 40),
             ("rollout", 40)]
    procs = [writer(role, model_dir, rounds, seed, f"w{seed}")
             for seed, (role, rounds) in enumerate(roles)]
    started(procs)
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        done.extend(json.loads(line) for line in out.splitlines())
    done = [d for d in done if "action" in d]
    record = repository.read_promotion(model_dir)
    history = record["history"]
    # the writers ran at once, not one after another: the two promoting writers' entries
    # alternate many times (else this test could pass without the lock doing anything)
    promoters = [e["reason"].split(":")[0] for e in history
                 if e["reason"].startswith(("w0:", "w1:"))]
    switches = sum(a != b for a, b in itertools.pairwise(promoters))
    assert switches >= 10, f"the writers interleaved {switches} times"
    # every entry continues from the one before it: no write was lost or overwritten
    assert history[0]["action"] == "publish" and history[0]["previous"] is None
    for before, entry in itertools.pairwise(history):
        assert entry["previous"] == before["version"], (before, entry)
    assert record["version"] == history[-1]["version"]
    # every completed action is there once, as its writer saw it
    promoted = [d for d in done if d["action"] == "promote"]
    by_reason = {e["reason"]: e for e in history if e["action"] == "promote"}
    for d in promoted:
        entry = by_reason.pop(d["tag"])
        assert (entry["version"], entry["previous"]) == (d["version"], d["previous"])
    for seed in (0, 1):  # each writer's own actions in its order
        mine = [int(e["reason"].split(":")[1]) for e in history
                if e["reason"].startswith(f"w{seed}:")]
        assert mine == sorted(mine) and len(mine) == 40
    rollbacks = Counter((d["previous"], d["version"]) for d in done if d["action"] == "rollback")
    assert rollbacks == Counter((e["previous"], e["version"]) for e in history
                                if e["action"] == "rollback")
    assert sum(rollbacks.values()) > 0
    for e in history:
        if e["action"] == "rollback":
            assert e["reason"] == f"rolled back from version {e['previous']}"
    # a rollout promotes only over the version it started from, else it stops
    rollouts = [d for d in done if d["action"] == "rollout"]
    finished = {d["id"]: d for d in rollouts if d["state"] == "promoted"}
    assert by_reason.keys() == {f"rollout {i}: passed 100%" for i in finished}
    for rid, d in finished.items():
        entry = by_reason[f"rollout {rid}: passed 100%"]
        assert (entry["version"], entry["previous"]) == (d["version"], d["previous"])
    for d in rollouts:
        if d["state"] == "aborted":
            assert d["reason"].startswith("not promoted: the promotion moved"), d
    assert len(history) == 1 + len(promoted) + sum(rollbacks.values()) + len(finished)
    assert rollout.read_plan(model_dir).state in ("promoted", "aborted")
    if isinstance(model_dir, Path):
        assert not list(model_dir.glob(".*.tmp"))


def _raw_plan(model_dir: Path | str) -> dict | None:
    """rollout.json as JSON (the kill loop writes raw JSON, not a plan), None if none."""
    if isinstance(model_dir, Path):
        path = model_dir / rollout.ROLLOUT
        return json.loads(path.read_text()) if path.exists() else None
    return remote.read_record(open_store(model_dir), rollout.ROLLOUT)


def test_a_writer_killed_anywhere_leaves_the_old_file_or_the_new(location):
    """SIGKILL at random points of a writer looping over promotion.json and rollout.json:
    after each kill both files parse and hold a state a write completed; the next writer
    takes the lock (the dead one's is gone) and carries on from it. In a folder and in a
    bucket (where a killed writer's request is all or nothing)."""
    model_dir = location
    rng = random.Random(7)
    length = len(repository.read_promotion(model_dir)["history"])
    rounds = -1
    for kill in range(30):
        proc = writer("loop", model_dir, 0, kill, f"k{kill}")
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        time.sleep(rng.uniform(0.005, 0.08))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        record = repository.read_promotion(model_dir)  # raises on an empty or partial file
        history = record["history"]
        assert len(history) >= length and record["version"] in VERSIONS
        assert record["version"] == history[-1]["version"]
        for before, entry in itertools.pairwise(history):
            assert entry["previous"] == before["version"]
        length = len(history)
        plan = _raw_plan(model_dir)  # never partial
        if plan is not None:
            assert plan["padding"] == "x" * 4096
            if plan["id"].startswith(f"k{kill}-"):
                rounds = max(rounds, plan["round"])
    assert length > 10  # the writers did write between the kills
    repository.promote(model_dir, 2, "rollback", "after the kills")
    assert repository.read_promotion(model_dir)["history"][-1]["reason"] == "after the kills"
    if isinstance(model_dir, Path):
        assert not list(model_dir.glob(".*.tmp"))  # the killed writers' temporary files


def test_an_atomic_write_syncs_the_file_then_renames_then_syncs_the_folder(tmp_path,
                                                                         monkeypatch):
    """The order that makes a replace durable (a crash of the node leaves the old file or
    the new one): fsync of the temporary file, then the rename over the target, then fsync
    of the folder that holds the new name."""
    calls: list[tuple[str, str]] = []
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace
    paths: dict[int, str] = {}

    def opened(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        paths[fd] = str(path)
        return fd

    def fsync(fd):
        calls.append(("fsync", paths.get(fd, "?")))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)
    monkeypatch.setattr(records.os, "open", opened)
    monkeypatch.setattr(records.os, "fsync", fsync)
    monkeypatch.setattr(records.os, "replace", replace)
    target = tmp_path / "promotion.json"
    records.write_json(target, {"version": 1})
    assert [kind for kind, _ in calls] == ["fsync", "replace", "fsync"], calls
    tmp = calls[0][1]
    assert Path(tmp).parent == tmp_path and Path(tmp).name.endswith(".tmp")
    assert calls[1][1] == f"{tmp} -> {target}"
    assert calls[2][1] == str(tmp_path)
    assert json.loads(target.read_text()) == {"version": 1}


def test_the_lock_excludes_threads_and_is_reentrant(tmp_path):
    """The service writes from several threads (the admin API, the rollout controller):
    the lock excludes them as it excludes processes, and the rollout's final promotion
    takes it again inside its own."""
    inside, overlaps = [], []

    def work() -> None:
        for _ in range(50):
            with records.locked(tmp_path):
                inside.append(1)
                if len(inside) > 1:
                    overlaps.append(1)
                with records.locked(tmp_path):  # re-entered
                    assert records.holds(tmp_path)
                inside.pop()
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps and not records.holds(tmp_path)


def test_an_unreadable_promotion_is_kept_aside_when_replaced(folder_model):
    model_dir = folder_model
    (model_dir / "promotion.json").write_text("")
    with pytest.raises(ValueError, match="cannot be read"):
        rollback.rollback(model_dir)  # which step back: unknown
    done = rollback.rollback(model_dir, 3)  # a named version repairs it
    assert done == {"model": "adding", "promoted": 3, "previous": None}
    (kept,) = model_dir.glob("promotion.json.unreadable-*")
    assert kept.read_text() == ""
    assert "kept as promotion.json.unreadable-" in \
        repository.read_promotion(model_dir)["history"][-1]["reason"]
    assert os.stat(model_dir / "promotion.json").st_size > 0
