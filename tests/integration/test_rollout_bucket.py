"""Rollouts with the repository in a bucket (export/artifacts/rollout/bucket_records.py),
against a real SeaweedFS: the controller's lease taken over after its expiry and never
before, in a folder and in a bucket; the commands; and a rollout's promotion, written in
three conditional steps, completed once by whoever reads it next when its writer died
between two of them."""

from __future__ import annotations

import datetime as dt
import json
import threading
from pathlib import Path

import httpx
import pytest
from orthornn.export.artifacts import remote, repository, rollback, rollout
from orthornn.export.artifacts.storage import open_store

from .. import objectstore
from ..helpers import orthornn_here
from ..service_helpers import LiveServer, gated, make_repo

seaweedfs, s3_env = objectstore.seaweedfs, objectstore.s3_env
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def folder_model(service_packages, tmp_path) -> Path:
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1, 2, 3]})
    for v in (1, 2, 3):
        gated(repo / "adding", v)
    repository.promote(repo / "adding", 1, "publish", "first")
    return repo / "adding"


@pytest.fixture
def bucket_model(s3_env, folder_model) -> str:
    return objectstore.upload_model(folder_model, f"{s3_env.location()}/repo/adding")


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


@pytest.mark.parametrize("where", ["folder", "bucket"])
def test_a_lease_is_taken_over_after_its_expiry_never_before(where, request):
    location = request.getfixturevalue(f"{where}_model")
    assert rollout.take_lease(location, "a", 10, at(0))
    assert not rollout.take_lease(location, "b", 10, at(9.999))  # a's until t=10
    assert rollout.take_lease(location, "a", 10, at(6))  # past half its term: until t=16
    assert not rollout.take_lease(location, "b", 10, at(15.999))
    assert rollout.take_lease(location, "b", 10, at(16.001))  # a stopped renewing
    assert not rollout.take_lease(location, "a", 10, at(16.002))
    # eight controllers at once over b's expired lease: exactly one gets it
    won: list[str] = []
    start = threading.Barrier(8)

    def contend(owner: str) -> None:
        start.wait()
        if rollout.take_lease(location, owner, 10, at(30)):
            won.append(owner)
    threads = [threading.Thread(target=contend, args=(f"c{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1, won
    assert not rollout.take_lease(location, "b", 10, at(30.5))


def test_the_rollout_commands_on_a_bucket(bucket_model):
    repo = bucket_model.rsplit("/", 1)[0]
    flags = ["--repo", repo, "--name", "adding"]
    started = orthornn_here("rollout", "start", *flags, "--candidate", "2", "--shadow", "0",
                            "--steps", "50,100", code=0)
    assert "of version 2 started (canary 50%)" in started.stdout
    status = json.loads(orthornn_here("rollout", "status", *flags, "--json", code=0).stdout)
    assert (status["state"], status["candidate"], status["promoted"]) == ("running", 2, 1)
    busy = orthornn_here("rollout", "start", *flags, "--candidate", "3", code=2)
    assert "already running" in busy.stderr
    orthornn_here("rollout", "promote", *flags, code=0)
    record = repository.read_promotion(bucket_model)
    assert record["version"] == 2
    assert record["history"][-1]["reason"] == f"rollout {status['id']}: promoted by hand " \
                                              f"at 50%"
    orthornn_here("rollout", "start", *flags, "--candidate", "3", "--shadow", "0", code=0)
    aborted = orthornn_here("rollout", "abort", *flags, code=0)
    assert "aborted: aborted by hand at 5%" in aborted.stdout
    assert repository.promoted(bucket_model) == 2
    plan = rollout.read_plan(bucket_model)
    assert [p["state"] for p in plan.past] == ["promoted"] and plan.state == "aborted"
    unreadable = open_store(bucket_model)
    unreadable.write(rollout.ROLLOUT, b"{")
    broken = orthornn_here("rollout", "status", *flags, code=2)
    assert f"{bucket_model}/rollout.json cannot be read" in broken.stderr


def _passed(plan: rollout.Plan) -> dict:
    """The reports of one stage that passes (the last: the candidate is promoted)."""
    tally = rollout.Tally(candidate=rollout.Side(1, 0), promoted=rollout.Side(1, 0))
    return {"rollout": plan.id, "stages": {str(plan.stage): tally.to_dict()}}


def _killed_after_finishing(location: str, plan: rollout.Plan, reason: str,
                            by_hand: bool = False) -> None:
    """rollout.json as a controller leaves it when killed after its first write of the
    end: the decision (``finishing``), with the promotion not written yet."""
    def finishing(data: bytes | None) -> dict:
        current = rollout.Plan.from_dict(json.loads(data or b""))
        current.finishing = {"reason": reason, "by_hand": by_hand}
        return current.to_dict()
    remote.update(open_store(location), rollout.ROLLOUT, finishing)


def _entries(location: str, reason: str) -> list[dict]:
    return [e for e in repository.read_promotion(location)["history"] if e["reason"] == reason]


def test_a_promotion_whose_writer_died_midway_is_completed_once(bucket_model):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    plan = rollout.start(bucket_model, 2, shadow=0, steps="100", interval_s=0.001,
                         min_requests=1)
    # killed after the decision: the next step completes it, and promotes once
    _killed_after_finishing(bucket_model, plan, "passed 100%")
    assert rollout.read_plan(bucket_model).running  # still routed as it was meanwhile
    done = rollout.step(bucket_model, [], later)
    assert (done.state, done.reason, done.finishing) == ("promoted", "passed 100%", None)
    assert len(_entries(bucket_model, f"rollout {plan.id}: passed 100%")) == 1
    assert repository.promoted(bucket_model) == 2
    # killed after the promotion, before the plan's end: an abort by hand finds it ended
    plan = rollout.start(bucket_model, 3, shadow=0, steps="100", interval_s=0.001,
                         min_requests=1)
    _killed_after_finishing(bucket_model, plan, "passed 100%")
    repository.promote(bucket_model, 3, "promote", f"rollout {plan.id}: passed 100%")
    with pytest.raises(rollout.RolloutError, match=r"no rollout is running .*promoted"):
        rollout.end_by_hand(bucket_model, "abort")
    assert len(_entries(bucket_model, f"rollout {plan.id}: passed 100%")) == 1
    assert rollout.read_plan(bucket_model).state == "promoted"
    # the promotion moved between the decision and its write (a person's rollback): the
    # candidate is not promoted over it
    plan = rollout.start(bucket_model, 1, shadow=0, steps="100", interval_s=0.001,
                         min_requests=1)
    _killed_after_finishing(bucket_model, plan, "passed 100%")
    rollback.rollback(bucket_model, 2)
    done = rollout.step(bucket_model, [_passed(plan)], later)
    assert done.state == "aborted"
    assert done.reason.startswith("not promoted: the promotion moved from version 3 to 2")
    assert repository.promoted(bucket_model) == 2


def test_a_controller_promotes_on_a_bucket_and_a_moved_promotion_refuses_by_hand(
        bucket_model):
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    plan = rollout.start(bucket_model, 2, shadow=0, steps="100", interval_s=0.001,
                         min_requests=1)
    done = rollout.step(bucket_model, [_passed(plan)], later)
    assert (done.state, done.reason) == ("promoted", "passed 100%")
    assert _entries(bucket_model, f"rollout {plan.id}: passed 100%")[0]["previous"] == 1
    # a promotion by hand over a promotion that moved: refused, the rollout still running
    plan = rollout.start(bucket_model, 3, shadow=0, steps="100", interval_s=0.001,
                         min_requests=1)
    rollback.rollback(bucket_model, 1)
    with pytest.raises(rollout.RolloutError, match="not promoted: the promotion moved"):
        rollout.end_by_hand(bucket_model, "promote")
    now = rollout.read_plan(bucket_model)
    assert now.running and now.finishing is None and now.id == plan.id
    assert repository.promoted(bucket_model) == 1


def test_a_replica_serving_a_bucket_runs_a_rollout_started_through_its_api(bucket_model,
                                                                          tmp_path):
    """`serve --repo s3://... --rollout-controller on`: the admin API writes the plan to
    the bucket, the replica routes by it (from its mirror), steps it from its own tallies
    under the bucket's lease, and the promotion lands in the bucket."""
    repo = bucket_model.rsplit("/", 1)[0]
    seq = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]
    with LiveServer(repo=repo, repository_cache=str(tmp_path / "cache"),
                    rollout_controller="on") as server:
        assert server.app.state.registry.policy.controls_rollouts
        # two seeds of a tiny model disagree: the rules on agreement and latency are off
        r = httpx.post(server.url + "/v2/repository/models/adding/rollout/start",
                       json={"candidate": 2, "shadow": 0.5, "steps": [50, 100],
                             "interval_s": 0.2, "min_requests": 3, "min_agreement": 0,
                             "max_latency_ratio": 1000})
        assert r.status_code == 200, r.text
        assert rollout.read_plan(bucket_model).running  # in the bucket, not only the mirror

        def promoted() -> bool:
            for i in range(8):
                httpx.post(server.url + "/predict",
                           json={"model": "adding", "inputs": [seq[:i % 3 + 1]]})
            return repository.promoted(bucket_model) == 2
        server.wait(promoted, timeout=60)
    plan = rollout.read_plan(bucket_model)
    assert plan.state == "promoted" and plan.finishing is None
    assert [a["stage"] for a in plan.analysis] == ["shadow", 50, 100]
    assert open_store(bucket_model).read(rollout.LEASE).data  # the controller's lease
