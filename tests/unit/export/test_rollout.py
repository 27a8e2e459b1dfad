"""Rollouts (export/artifacts/rollout/, the service's part, the commands): the rules
against hand-computed values and numpy, the plan's life in a real repository, bad input,
and one in-process service that runs its rollout itself (a writable repository)."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
from orthornn.export.artifacts import rollout
from orthornn.export.artifacts.repository import promote, read_promotion
from orthornn.export.artifacts.rollout import LATENCY_BOUNDS, Side, Tally
from orthornn.service.registry.controller import Controller

from ...helpers import orthornn_here as run_orthornn
from ...service_helpers import SECRET, LiveServer, gated, make_repo

NOW = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)


def plan_of(stages=("shadow", 5, 100), stage=0, min_requests=10, interval_s=10.0,
            **thresholds) -> rollout.Plan:
    return rollout.Plan(id="p", model="m", candidate=2, promoted=1,
                        state=rollout.Phase.RUNNING, stages=list(stages), stage=stage,
                        stage_started=NOW.isoformat(), started=NOW.isoformat(), shadow=0.1,
                        interval_s=interval_s, min_requests=min_requests,
                        thresholds=rollout.Thresholds(**thresholds))


def side(requests=0, errors=0, times=()) -> Side:
    s = Side(requests, errors)
    for t in times:
        s.time(t)
    return s


def later(seconds: float) -> dt.datetime:
    return NOW + dt.timedelta(seconds=seconds)


# -- the rules -------------------------------------------------------------------------------

def test_p99_of_histograms_added_across_replicas_is_numpys_p99_to_a_bucket():
    rng = np.random.default_rng(0)
    times = rng.lognormal(mean=-5, sigma=1.0, size=5000)
    a, b = side(times=times[:1800]), side(times=times[1800:])
    a.add(b)
    reference = np.percentile(times, 99, method="inverted_cdf")
    i = LATENCY_BOUNDS.index(a.p99())
    assert LATENCY_BOUNDS[i - 1] < reference <= LATENCY_BOUNDS[i]


def test_tallies_round_trip_and_add_per_stage_only_for_their_rollout():
    t = Tally(3, 2.5, 0.3, 1, 4, side(7, 1, [0.01]), side(9, 0, [0.02, 0.03]))
    report = {"rollout": "p", "stages": {"0": t.to_dict(), "1": t.to_dict()}}
    other = {"rollout": "q", "stages": {"0": t.to_dict()}}
    total = rollout.combine(plan_of(), [report, report, other])
    assert sorted(total) == [0, 1]
    assert total[0].compared == 6 and total[0].agreement == 5.0
    assert total[0].promoted.requests == 18 and sum(total[0].promoted.latency) == 4
    with pytest.raises(ValueError, match="malformed"):
        rollout.combine(plan_of(), [{"rollout": "p", "stages": {"0": {"compared": 1}}}])


def test_the_stage_waits_for_its_interval_and_requests_then_advances():
    plan = plan_of(min_requests=10, interval_s=10)
    good = {0: Tally(12, 12.0, 0.1, 0, 0, side(), side(50, 0))}
    assert rollout.decide(plan, good, later(5))[0] == "wait"  # too early
    assert rollout.decide(plan, good, later(11))[0] == "advance"
    few = {0: Tally(4, 4.0, 0.0, 0, 0, side(), side(50, 0))}
    assert rollout.decide(plan, few, later(60))[0] == "wait"  # too few requests


def test_agreement_below_the_threshold_rolls_back_with_the_measured_value():
    plan = plan_of(min_agreement=0.9)
    action, analysis = rollout.decide(plan, {0: Tally(20, 16.0, 2.0, 0, 0)}, later(1))
    assert action == "rollback"
    assert analysis["breach"]["rule"] == "min_agreement"
    assert analysis["breach"]["value"] == pytest.approx(0.8)
    assert analysis["mean_difference"] == pytest.approx(0.1)


def test_error_rate_is_the_candidates_above_the_promoted_versions():
    plan = plan_of(stage=1, max_error_rate=0.05)
    # canary: 6 of 60 candidate requests failed, 5 of 100 promoted ones: 0.10 - 0.05
    tallies = {0: Tally(promoted=side(50, 2)), 1: Tally(candidate=side(60, 6),
                                                        promoted=side(50, 3))}
    action, analysis = rollout.decide(plan, tallies, later(1))
    assert action == "wait" and analysis["error_rate"] == pytest.approx(0.1)
    assert analysis["promoted_error_rate"] == pytest.approx(0.05)  # all stages so far
    tallies[1].candidate = side(60, 7)
    action, analysis = rollout.decide(plan, tallies, later(1))
    assert action == "rollback" and analysis["breach"]["rule"] == "max_error_rate"
    assert analysis["breach"]["value"] == pytest.approx(7 / 60 - 0.05)


def test_failures_that_already_break_the_rule_roll_back_before_min_requests():
    plan = plan_of(stage=1, min_requests=100, max_error_rate=0.01)
    one = {1: Tally(candidate=side(1, 1))}
    assert rollout.decide(plan, one, later(1))[0] == "wait"  # 1 error could be the 1%
    two = {1: Tally(candidate=side(2, 2))}
    assert rollout.decide(plan, two, later(1))[0] == "rollback"  # > 1% of 100 whatever


def test_latency_ratio_is_p99_over_p99():
    plan = plan_of(stage=1, min_requests=10, max_latency_ratio=2.0)
    slow = {1: Tally(candidate=side(20, 0, [0.05] * 20), promoted=side(20, 0, [0.01] * 20))}
    action, analysis = rollout.decide(plan, slow, later(1))
    assert action == "rollback" and analysis["breach"]["rule"] == "max_latency_ratio"
    bound = LATENCY_BOUNDS[np.searchsorted(LATENCY_BOUNDS, 0.05)]
    assert analysis["latency_ratio"] == pytest.approx(
        bound / LATENCY_BOUNDS[np.searchsorted(LATENCY_BOUNDS, 0.01)])


def _crc32(data: bytes) -> int:
    """CRC-32 (ISO-HDLC, reflected polynomial 0xEDB88320) bit by bit, without zlib."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_routing_keys_fall_within_the_weight_in_proportion_and_always_the_same_way():
    keys = [f"session-{i}".encode() for i in range(20000)]
    share = np.mean([rollout.bucket(k) < 25 for k in keys])
    assert abs(share - 0.25) < 0.015
    # Every replica (another process) routes a key the same way: the documented hash
    # (docs/retraining.md: CRC-32, 10,000 buckets) and literal values, never a hash a
    # process salts (Python's hash()) or a changed salt.
    assert _crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value
    assert [rollout.bucket(k) for k in keys[:200]] == [_crc32(k) % 10000 / 100
                                                       for k in keys[:200]]
    assert [rollout.bucket(k) for k in keys[:4]] == [43.44, 41.58, 62.44, 67.86]


# -- the plan in a repository ------------------------------------------------------------------

@pytest.fixture
def repo(service_packages, tmp_path) -> Path:
    repo = make_repo(service_packages, tmp_path / "repo", {"adding": [1, 2, 3]})
    promote(repo / "adding", 1, "publish", "first")
    gated(repo / "adding", 2)
    return repo


def orthornn(*args: object, code: int = 0) -> subprocess.CompletedProcess:
    return run_orthornn(*args, code=code)


def report(plan: rollout.Plan, stage: int, compared: int = 0, agreement: float = 1.0,
           candidate: Side | None = None) -> dict:
    tally = Tally(compared, agreement * compared, 0.0, 0, 0, candidate or Side(),
                  side(compared, 0))
    return {"rollout": plan.id, "stages": {str(stage): tally.to_dict()}}


def test_control_walks_every_stage_then_promotes_in_promotion_json(repo):
    model_dir = repo / "adding"
    plan = rollout.start(model_dir, 2, shadow=0.2, steps="50,100", interval_s=1,
                         min_requests=5)
    t = dt.datetime.fromisoformat(plan.stage_started)
    for stage in range(3):
        tallies = report(plan, stage, compared=5, candidate=side(5, 0))
        assert rollout.step(model_dir, [tallies], t + dt.timedelta(seconds=0.5)).stage \
            == stage  # the interval is not over
        t += dt.timedelta(seconds=1.5)
        plan = rollout.step(model_dir, [tallies], t)
    assert plan.state == "promoted" and plan.reason == "passed shadow, 50%, 100%"
    assert [a["stage"] for a in rollout.read_plan(model_dir).analysis] == ["shadow", 50, 100]
    record = read_promotion(model_dir)
    assert record["version"] == 2 and record["history"][-1]["action"] == "promote"


def test_plan_round_trips_through_rollout_json_as_it_was_written(repo):
    """rollout.json is a public file: the typed plan writes the same keys and values."""
    model_dir = repo / "adding"
    plan = rollout.start(model_dir, 2, shadow=0.2, steps="50,100", interval_s=1)
    raw = json.loads((model_dir / "rollout.json").read_text())
    assert raw["state"] == "running" and raw["stages"] == ["shadow", 50, 100]
    assert raw["thresholds"] == {"min_agreement": 0.9, "max_error_rate": 0.01,
                                 "max_latency_ratio": 2.0}
    assert rollout.Plan.from_dict(raw) == plan and plan.to_dict() == raw
    for broken in ({}, {**raw, "state": "rolled-back"}, {**raw, "stage": 3},
                   {**raw, "thresholds": {"min_agreement": 2}}):
        (model_dir / "rollout.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=r"rollout\.json' cannot be read: not a rollout"):
            rollout.read_plan(model_dir)


def test_one_controller_steps_a_rollout_at_a_time(repo):
    """Two controllers (two writable replicas, or one and `rollout run`): the lease makes
    the first the only one to step, until it lapses; then the other takes over."""
    model_dir = repo / "adding"
    plan = rollout.start(model_dir, 2, shadow=0, steps="50,100", interval_s=3600)
    first, second = Controller(model_dir, ttl_s=3600), Controller(model_dir, ttl_s=3600)
    assert first.step([report(plan, 0)])[1] is True
    now, stepped = second.step([report(plan, 0)])
    assert stepped is False and now == rollout.read_plan(model_dir)
    lease = (model_dir / rollout.LEASE).read_bytes()
    assert first.step([])[1] is True  # the holder keeps it: not rewritten before half its term
    assert (model_dir / rollout.LEASE).read_bytes() == lease
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=2)  # the first one's lease lapsed
    assert rollout.take_lease(model_dir, second.owner, 60, later)
    assert not rollout.take_lease(model_dir, first.owner, 60, later)


@pytest.mark.parametrize("action", ["abort", "promote"])
def test_abort_and_promote_by_hand_at_every_stage(repo, action):
    model_dir = repo / "adding"
    for stage in range(3):
        promote(model_dir, 1, "rollback", "the test starts over")
        plan = rollout.start(model_dir, 2, shadow=0.2, steps="50,100", interval_s=1,
                             min_requests=1)
        t = dt.datetime.fromisoformat(plan.stage_started)
        for k in range(stage):
            t += dt.timedelta(seconds=2)
            plan = rollout.step(model_dir, [report(plan, k, 1, candidate=side(1))], t)
        assert plan.stage == stage
        out = orthornn("rollout", action, "--repo", repo, "--name", "adding").stdout
        where = "in shadow" if stage == 0 else f"at {plan.stages[stage]}%"
        assert f"by hand {where}" in out
        expected = 1 if action == "abort" else 2
        assert read_promotion(model_dir)["version"] == expected
    orthornn("rollout", action, "--repo", repo, "--name", "adding", code=2)  # none running


def test_bad_input_is_one_line_exit_2_and_leaves_the_plan_alone(repo):
    model_dir = repo / "adding"
    base = ["rollout", "start", "--repo", repo, "--name", "adding"]
    broken = repo / "adding" / "4"
    shutil.copytree(repo / "adding" / "2", broken)
    (broken / "model.onnx").write_bytes(b"not a graph")
    cases = [(["--candidate", "9"], "--candidate: version 9 is not in"),
             (["--candidate", "3"], "published without --gate"),
             (["--candidate", "1"], "already promoted"),
             (["--candidate", "4"], "does not verify"),
             (["--candidate", "2", "--min-agreement", "1.5"], "--min-agreement must be"),
             (["--candidate", "2", "--max-error-rate", "x"], "--max-error-rate must be"),
             (["--candidate", "2", "--max-latency-ratio", "0.5"], "--max-latency-ratio"),
             (["--candidate", "2", "--shadow", "2"], "--shadow must be"),
             (["--candidate", "2", "--steps", "50,25,100"], "--steps must be"),
             (["--candidate", "2", "--min-requests", "0"], "--min-requests must be")]
    for flags, message in cases:
        done = orthornn(*base, *flags, code=2)
        assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, \
            done.stderr
        assert not (model_dir / "rollout.json").exists()
    orthornn(*base, "--candidate", "2")
    before = (model_dir / "rollout.json").read_bytes()
    done = orthornn(*base, "--candidate", "2", code=2)
    assert "already running" in done.stderr
    assert (model_dir / "rollout.json").read_bytes() == before
    assert "--replicas" in orthornn("rollout", "run", "--repo", repo, "--name", "adding",
                                    code=2).stderr


def test_export_rollout_flags_need_the_gate(service_packages, tmp_path):
    done = orthornn("export", tmp_path, "--repo", tmp_path / "r", "--name", "x", "--rollout",
                    code=2)
    assert "--rollout and --no-promote apply only with --gate" in done.stderr


# -- one service running its own rollout -------------------------------------------------------

def test_one_writable_replica_runs_its_rollout_and_ends_failed_sessions(repo):
    """The admin API starts a canary; the service (a writable repository: the controller
    is on) routes new sessions by weight; a rollback on errors ends the candidate's
    sessions with 409 naming why, and new requests return to the promoted version."""
    model_dir = repo / "adding"
    with LiveServer(repo=repo) as server:
        base = server.url
        bad = httpx.post(base + "/v2/repository/models/adding/rollout/start",
                         json={"candidate": 2, "max_error_rate": 3})
        # the API's error names its field, not the command's flag
        assert bad.status_code == 400 and "max_error_rate must be" in bad.json()["error"]
        assert "--" not in bad.json()["error"]
        r = httpx.post(base + "/v2/repository/models/adding/rollout/start",
                       json={"candidate": 2, "shadow": 0, "steps": [50, 100],
                             "interval_s": 600, "min_requests": 1000})
        assert r.status_code == 200, r.text
        assert httpx.post(base + "/v2/repository/models/adding/rollout/start",
                          json={"candidate": 2}).status_code == 409
        server.wait(lambda: server.app.state.registry.rollouts.running("adding") is not None)
        meta = httpx.get(base + "/v2/models/adding").json()["parameters"]["rollout"]
        assert meta["state"] == "running" and meta["weight"] == 50
        sessions: dict[int, list[str]] = {1: [], 2: []}
        seq = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]
        for i in range(24):  # new sessions are placed by weight, from their id
            sid = f"s{i}"
            r = httpx.post(base + "/predict", json={"model": "adding", "session": sid,
                                                    "start": True, "inputs": [seq],
                                                    "session_secret": SECRET})
            assert r.status_code == 200, r.text
            sessions[r.json()["version"]].append(sid)
            assert (rollout.bucket(sid.encode()) < 50) == (r.json()["version"] == 2)
        assert sessions[1] and sessions[2]
        status = httpx.get(base + "/v2/repository/models/adding/rollout").json()
        assert status["report"]["stages"]["0"]["candidate"]["requests"] == len(sessions[2])
        # a breach on errors, as `orthornn rollout run` would write it from the replicas'
        plan = rollout.read_plan(model_dir)
        failing = report(plan, 0, candidate=side(1000, 600))
        assert rollout.step(model_dir, [failing]).state == "rolled_back"
        server.wait(lambda: server.app.state.registry.rollouts.running("adding") is None)
        for version, ids in sessions.items():
            r = httpx.post(base + "/predict", json={"model": "adding", "session": ids[0],
                                                    "inputs": [seq], "session_secret": SECRET})
            if version == 2:
                assert r.status_code == 409 and "rolled back" in r.json()["error"], r.text
            else:
                assert r.status_code == 200 and r.json()["version"] == 1
        for i in range(10):
            r = httpx.post(base + "/predict", json={"model": "adding", "inputs": [seq[:i % 3 + 1]]})
            assert r.json()["version"] == 1
        text = httpx.get(base + "/metrics").text
        assert "orthornn_rollout_stage{" not in text  # the series ends with the rollout
    listing = orthornn("versions", "--repo", repo, "--name", "adding").stdout
    assert "rolled_back" in listing and "error rate" in listing
    assert read_promotion(model_dir)["version"] == 1


def test_one_writable_replica_promotes_on_its_own_measurements(repo):
    """No controller process: the service advances and promotes from its own tallies."""
    model_dir = repo / "adding"
    # two seeds of a tiny model disagree: the rules on agreement and latency are off here
    rollout.start(model_dir, 2, shadow=0.5, steps="50,100", interval_s=0.2, min_requests=3,
                  thresholds=rollout.Thresholds(min_agreement=0, max_latency_ratio=1000))
    seq = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]
    with LiveServer(repo=repo) as server:
        assert server.app.state.registry.policy.controls_rollouts

        def promoted() -> bool:
            for i in range(8):
                httpx.post(server.url + "/predict",
                           json={"model": "adding", "inputs": [seq[:i % 3 + 1]]})
            return read_promotion(model_dir)["version"] == 2
        server.wait(promoted, timeout=60)
    plan = rollout.read_plan(model_dir)
    assert plan.state == "promoted"
    assert [a["stage"] for a in plan.analysis] == ["shadow", 50, 100]
    assert plan.analysis[0]["compared"] >= 3


def test_shadow_runs_compare_the_two_versions_outputs_on_the_same_inputs(repo):
    """Every inference request shadowed (fraction 1): the tallies' mean difference is the
    mean |candidate - promoted| of the two versions' own answers to the same inputs, and
    the client always gets the promoted version's."""
    model_dir = repo / "adding"
    rollout.start(model_dir, 2, shadow=1.0, steps="100", interval_s=3600, min_requests=10**6,
                  thresholds=rollout.Thresholds(min_agreement=0, max_latency_ratio=1000))
    rng = np.random.default_rng(3)
    seqs = [np.stack([rng.uniform(size=n), np.arange(n) < 2], 1).round(3).tolist()
            for n in (2, 4, 6, 5, 3, 6)]
    with LiveServer(repo=repo, rollout_controller="off") as server:
        server.wait(lambda: server.app.state.registry.rollouts.running("adding") is not None)

        def infer(seq: list, version: str = "") -> tuple[float, str]:
            path = "/v2/models/adding" + (f"/versions/{version}" if version else "") + "/infer"
            r = httpx.post(server.url + path, json={"inputs": [{
                "name": "x", "datatype": "FP32", "shape": [1, len(seq), 2],
                "data": [x for step in seq for x in step]}]})
            assert r.status_code == 200, r.text
            (value,) = [o["data"][0] for o in r.json()["outputs"] if o["name"] == "value"]
            return value, r.json()["model_version"]
        differences = []
        for seq in seqs:
            promoted, served = infer(seq)
            assert served == "1"
            differences.append(abs(infer(seq, "2")[0] - promoted))

        def tally() -> dict:
            report = httpx.get(server.url + "/v2/repository/models/adding/rollout").json()
            return report["report"]["stages"]["0"]
        server.wait(lambda: tally()["compared"] == len(seqs))
        assert tally()["difference"] / len(seqs) == pytest.approx(np.mean(differences),
                                                                  rel=1e-4, abs=1e-6)
        assert tally()["shadow_failures"] == 0


def test_only_requests_the_rollout_placed_count_and_never_a_clients_4xx(repo):
    """The probe replayed: 4xx on /v2/models/adding/versions/2/infer (the candidate named
    in the URL) rolled back a rollout at 100% on max_error_rate. Now requests that name
    their version (URL or body), continue states, or fail on the client's fault (a bad
    body, a wrong shape, a missing model or session) are not counted; the ones the
    rollout placed are, by their routing key. The controller runs (a writable repository)
    and the rollout stays running, until the candidate refuses a placed request the
    promoted version takes: that 4xx is the candidate's, and rolls it back."""
    model_dir = repo / "adding"
    # the candidate narrows its input: at most 3 steps (the promoted version takes 6)
    manifest = json.loads((model_dir / "2" / "manifest.json").read_text())
    manifest["input_spec"]["max_length"] = 3
    (model_dir / "2" / "manifest.json").write_text(json.dumps(manifest))
    plan = rollout.start(model_dir, 2, shadow=0, steps="50,100", interval_s=3600,
                         min_requests=2, thresholds=rollout.Thresholds(min_agreement=0,
                                                                   max_latency_ratio=1000))
    seq = [[0.5, 1.0], [0.25, 0.0], [0.1, 1.0]]
    x = {"name": "x", "datatype": "FP32", "shape": [1, 3, 2],
         "data": [v for step in seq for v in step]}
    to_candidate = next(f"k{i}" for i in range(100) if rollout.bucket(f"k{i}".encode()) < 50)
    to_promoted = next(f"k{i}" for i in range(100) if rollout.bucket(f"k{i}".encode()) >= 50)
    sid_on_promoted = next(f"s{i}" for i in range(100) if rollout.bucket(f"s{i}".encode()) >= 50)
    with LiveServer(repo=repo) as server:
        base = server.url
        assert server.app.state.registry.policy.controls_rollouts
        server.wait(lambda: server.app.state.registry.rollouts.running("adding") is not None)

        def tally() -> dict:
            report = httpx.get(base + "/v2/repository/models/adding/rollout").json()["report"]
            stage = report["stages"].get("0", {})
            return {k: (stage[k]["requests"], stage[k]["errors"]) if stage else (0, 0)
                    for k in ("candidate", "promoted")}

        def post(path: str, body: dict | bytes, key: str | None = None) -> int:
            headers = {"X-Routing-Key": key} if key else {}
            if isinstance(body, bytes):
                return httpx.post(base + path, content=body, headers=headers).status_code
            return httpx.post(base + path, json=body, headers=headers).status_code
        explicit = "/v2/models/adding/versions/2/infer"
        for _ in range(3):  # the candidate named in the URL: 4xx and 200 alike
            assert post(explicit, b"{not json") == 400
            assert post(explicit, {"inputs": [{**x, "shape": [1, 2, 2]}]}) == 400
            assert post(explicit, {"inputs": [x]}) == 200
            assert post("/v2/models/adding/versions/1/infer", {"inputs": [x]}) == 200
            # named in the body, on /predict; and a client's 4xx on either version
            assert post("/predict", {"model": "adding", "version": 2, "inputs": [seq]}) == 200
            assert post("/predict", {"model": "adding", "version": 2, "inputs": [[[1.0]]]}) \
                == 400
            for key in (to_candidate, to_promoted):  # routed, but the client's fault
                assert post("/predict", {"model": "adding", "inputs": [[[1.0, 2.0, 3.0]]]},
                            key) == 400
                assert post("/v2/models/adding/infer", {"inputs": [{**x, "datatype": "INT8"}]},
                            key) == 400
                assert post("/predict", {"model": "adding", "session": "nobody",
                                         "inputs": [seq]}, key) == 404
            assert post("/predict", {"model": "nope", "inputs": [seq]}, to_candidate) == 404
            # a session started on the candidate by name, its id placing it elsewhere
            sid = f"{sid_on_promoted}-{_}"
            if rollout.bucket(sid.encode()) >= 50:
                assert post("/predict", {"model": "adding", "session": sid, "start": True,
                                         "version": 2, "inputs": [seq],
                                         "session_secret": SECRET}) == 200
        assert tally() == {"candidate": (0, 0), "promoted": (0, 0)}
        # what the rollout placed counts: by key, on the version the key falls on
        assert post("/predict", {"model": "adding", "inputs": [seq]}, to_candidate) == 200
        assert post("/v2/models/adding/infer", {"inputs": [x]}, to_promoted) == 200
        assert post("/v2/models/adding/infer", {"inputs": [x]}, to_candidate) == 200
        assert tally() == {"candidate": (2, 0), "promoted": (1, 0)}
        # the controller judged these two (its plan holds their tally) and left it running
        server.wait(lambda: (rollout.read_plan(model_dir).current or {}).get("requests") == 2)
        plan = rollout.read_plan(model_dir)
        assert plan.state == "running" and plan.stage == 0, plan
        assert plan.current["errors"] == 0 and plan.current["requests"] == 2
        # a 4xx that is the candidate's: it refuses what the promoted version takes
        longer = [*seq, [0.3, 0.0]]
        assert post("/predict", {"model": "adding", "inputs": [longer]}, to_promoted) == 200
        assert post("/predict", {"model": "adding", "version": 2, "inputs": [longer]}) == 400
        assert tally() == {"candidate": (2, 0), "promoted": (2, 0)}
        assert post("/predict", {"model": "adding", "inputs": [longer]}, to_candidate) == 400
        server.wait(lambda: rollout.read_plan(model_dir).state == "rolled_back")
        final = rollout.read_plan(model_dir)
        assert final.breach["rule"] == "max_error_rate"
        assert (final.analysis[-1]["requests"], final.analysis[-1]["errors"]) == (3, 1)


def test_ids_no_header_can_hold_are_refused_and_never_roll_back_a_rollout(repo, tmp_path):
    """Issue 59, finding 2, replayed: with capture on, an OIP ``id`` holding "€" was a 500
    (the X-Request-Id answer header could not be encoded), one holding a newline or NUL a
    dropped connection; both were captured; 30 of them routed to the candidate rolled it
    back (error rate 1). Now each is a 400 naming the field, on a connection that stays
    open, nothing of it is captured, and the candidate's tally stays empty."""
    model_dir = repo / "adding"
    rollout.start(model_dir, 2, shadow=0, steps="50,100", interval_s=3600, min_requests=2,
                  thresholds=rollout.Thresholds(min_agreement=0, max_latency_ratio=1000))
    x = {"name": "x", "datatype": "FP32", "shape": [1, 2, 2], "data": [0.5, 1.0, 0.25, 0.0]}
    keys = [f"k{i}" for i in range(400) if rollout.bucket(f"k{i}".encode()) < 50][:30]
    captures = tmp_path / "captures"
    bad_ids = ["\u20ac", "a\nb", "a\r\nX-Evil: 1", "a\x00b", "with space", "x" * 129, ""]
    with LiveServer(repo=repo, capture=captures, capture_replica="r0") as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        server.wait(lambda: server.app.state.registry.rollouts.running("adding") is not None)
        for i, key in enumerate(keys):
            rid = bad_ids[i % len(bad_ids)]
            r = client.post("/v2/models/adding/infer", json={"id": rid, "inputs": [x]},
                            headers={"X-Routing-Key": key})
            assert r.status_code == 400, (rid, r.status_code, r.text)
            assert r.json()["error"] == ("id: 1 to 128 printable ASCII characters, no "
                                         "spaces"), r.text
            assert "x-request-id" not in r.headers
        report = client.get("/v2/repository/models/adding/rollout").json()["report"]
        stage = report["stages"].get("0")
        assert stage is None or (stage["candidate"]["requests"], stage["candidate"]["errors"]) \
            == (0, 0), stage
        assert rollout.read_plan(model_dir).state == "running"
        # a good id on the same connection: answered, echoed, captured under it
        r = client.post("/v2/models/adding/infer", json={"id": "order-40", "inputs": [x]},
                        headers={"X-Routing-Key": keys[0]})
        assert r.status_code == 200 and r.json()["id"] == "order-40", r.text
    from orthornn.export.artifacts.loop.captures import read_records

    records, torn = read_records(captures, "adding")
    assert [record["id"] for record in records] == ["order-40"] and torn == 0, records
