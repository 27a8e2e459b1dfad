"""`orthornn retrain-trigger`: its decisions over a hand-built capture folder (label lines
with their times) and a repository whose manifests carry hand-set times: no version yet,
the cooldown after the last version published or refused, drift (a stand-in for
`orthornn monitor --exit-code`, and the real command line's exit statuses), and the count
of labels since the promoted version was published."""

import datetime as dt
import json
import sys
from pathlib import Path

import pytest
from orthornn.export.artifacts import repository
from orthornn.export.artifacts.loop import trigger as trigger_decision
from orthornn.export.artifacts.loop.trigger import decide
from orthornn.service.commands import trigger as trigger_cli

from tests.helpers import orthornn_here as orthornn

NOW = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC).timestamp()
HOUR = 3600.0


def _version(model_dir: Path, number: int | str, hours_ago: float, folder: str = "") -> None:
    path = model_dir / folder / str(number)
    path.mkdir(parents=True)
    created = dt.datetime.fromtimestamp(NOW - hours_ago * HOUR, dt.UTC).isoformat()
    (path / "manifest.json").write_text(json.dumps({"created": created}))


def _labels(capture: Path, model: str, hours_ago: list[float]) -> None:
    """One label line per time, in the label store's layout (DIR/<model>/labels/<day>/)."""
    day = capture / model / "labels" / "2026-11-28"
    day.mkdir(parents=True, exist_ok=True)
    with (day / "replica-0.jsonl").open("a") as f:
        for i, h in enumerate(hours_ago):
            f.write(json.dumps({"id": f"req-{len(hours_ago)}-{i}", "label": 1,
                                "time": NOW - h * HOUR, "source": "api"}) + "\n")


def _never() -> tuple[int, str]:
    raise AssertionError("the drift check must not run here")


@pytest.fixture
def setting(tmp_path):
    """v1 published 100 h ago, v2 (promoted) 50 h ago; 3 labels before v2, 4 after."""
    capture, model_dir = tmp_path / "captures", tmp_path / "repo" / "m"
    _version(model_dir, 1, 100)
    _version(model_dir, 2, 50)
    repository.promote(model_dir, 2, "promote")
    _labels(capture, "m", [80, 70, 60, 40, 30, 20, 1])
    return capture, model_dir


def test_labels_since_the_promoted_version_fire_at_min_labels(setting):
    capture, model_dir = setting
    for min_labels, fire in ((4, True), (5, False)):
        d = decide(capture, model_dir, min_labels=min_labels, cooldown_hours=24, drift=False,
                   drift_check=_never, now=NOW)
        assert (d.fire, d.reason) == (fire, "labels" if fire else "none")
        assert "4 labels" in d.message and "promoted version 2" in d.message
    # rolled back to v1 (published 100 h ago): every label since then counts, all 7
    repository.promote(model_dir, 1, "rollback")
    for min_labels, fire in ((7, True), (8, False)):
        d = decide(capture, model_dir, min_labels=min_labels, cooldown_hours=24, drift=False,
                   drift_check=_never, now=NOW)
        assert d.fire == fire and "7 labels" in d.message and "version 1" in d.message


def test_drift_fires_first_and_says_so(setting):
    capture, model_dir = setting
    d = decide(capture, model_dir, min_labels=1, cooldown_hours=24, drift=True,
               drift_check=lambda: (1, "window 7 drifts"), now=NOW)
    assert (d.fire, d.reason) == (True, "drift") and "window 7 drifts" in d.message
    d = decide(capture, model_dir, min_labels=100, cooldown_hours=24, drift=True,
               drift_check=lambda: (0, "no drift"), now=NOW)
    assert (d.fire, d.reason) == (False, "none") and d.message.startswith("nothing to do: no drift")
    # the monitor could not tell (exit 2): the labels still decide, and the line says why
    d = decide(capture, model_dir, min_labels=4, cooldown_hours=24, drift=True,
               drift_check=lambda: (2, "too few captures"), now=NOW)
    assert (d.fire, d.reason) == (True, "labels")
    assert "drift not measured (orthornn monitor exit 2: too few captures)" in d.message


def test_the_cooldown_after_the_last_version_published_or_refused(setting):
    capture, model_dir = setting
    drifting = lambda: (1, "drift")  # noqa: E731
    # v2 is 50 h old: a cooldown of 60 h holds everything back, 40 h does not
    d = decide(capture, model_dir, min_labels=1, cooldown_hours=60, drift=True,
               drift_check=_never, now=NOW)
    assert (d.fire, d.reason) == (False, "none")
    assert "version 2 was published 50.0 h ago, within the --cooldown of 60 h" in d.message
    until = dt.datetime.fromtimestamp(NOW + 10 * HOUR, dt.UTC).isoformat(timespec="seconds")
    assert f"(until {until})" in d.message
    assert decide(capture, model_dir, min_labels=1, cooldown_hours=40, drift=True,
                  drift_check=drifting, now=NOW).fire
    # a candidate the gate refused 5 h ago starts the cooldown too
    _version(model_dir, "20261128T070000Z-abc", 5, folder="rejected")
    d = decide(capture, model_dir, min_labels=1, cooldown_hours=6, drift=True,
               drift_check=_never, now=NOW)
    assert not d.fire and "candidate 20261128T070000Z-abc was refused by the gate 5.0 h" \
        in d.message
    assert decide(capture, model_dir, min_labels=1, cooldown_hours=4.9, drift=True,
                  drift_check=drifting, now=NOW).fire


def test_no_version_yet_fires_to_train_the_first(tmp_path):
    d = decide(tmp_path / "absent", tmp_path / "repo" / "m", min_labels=1, cooldown_hours=24,
               drift=True, drift_check=_never, now=NOW)
    assert (d.fire, d.reason) == (True, "first")


def test_the_command_line_exit_statuses_and_reason_file(setting, tmp_path, monkeypatch):
    capture, model_dir = setting
    repo, reason = model_dir.parent, tmp_path / "reason"
    monkeypatch.setattr(trigger_decision.time, "time", lambda: NOW)
    base = ["retrain-trigger", "--capture", capture, "--repo", repo, "--name", "m",
            "--reason-file", reason, "--cooldown", "1"]
    out = orthornn(*base, "--no-drift", "--min-labels", "4", code=0).stdout
    assert out.startswith("orthornn retrain-trigger: fires: 4 labels") and \
        reason.read_text() == "labels\n"
    out = orthornn(*base, "--no-drift", "--min-labels", "5", code=1).stdout
    assert out.startswith("orthornn retrain-trigger: nothing to do") and \
        reason.read_text() == "none\n"
    assert len(out.strip().splitlines()) == 1
    # drift through the monitor's exit status: a stand-in module answers 1 (drift)
    calls = []

    def fake_run(argv, **kwargs):
        calls.append(argv)
        import subprocess

        return subprocess.CompletedProcess(argv, 1, "window 3: drift detected\n", "")

    monkeypatch.setattr(trigger_cli.subprocess, "run", fake_run)
    orthornn(*base, "--min-labels", "100", code=0)
    assert reason.read_text() == "drift\n"
    assert calls == [[sys.executable, "-m", "orthornn", "monitor", "--capture", str(capture),
                      "--name", "m", "--repo", str(repo), "--exit-code"]]
    for flags, message in ((["--min-labels", "0"], "--min-labels must be an integer"),
                           (["--cooldown", "-1"], "--cooldown must be a number"),
                           (["--cooldown", "nan"], "--cooldown must be a number")):
        err = orthornn(*base, *flags, code=2).stderr
        assert message in err and len(err.strip().splitlines()) == 1
    err = orthornn("retrain-trigger", "--capture", tmp_path / "none", "--repo", repo, "--name",
                   "m", code=2).stderr
    assert "is not a folder" in err
