"""The labelled error rate of the captures and river's ADWIN over it
(``export.artifacts.loop.error_rate``), and ``orthornn monitor`` reporting it: the rates
against numpy's means of the planted streams, the change where the stream's rate was
planted to change."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from orthornn.export.artifacts.loop.captures import first_labels, read_records
from orthornn.export.artifacts.loop.error_rate import error_rates, predicted, streams

DAY = "2026-11-28"
T0 = 1_795_800_000.0


def _logits(rows: list[list[float]]) -> dict:
    a = np.asarray(rows, dtype="<f4")
    return {"dtype": "<f4", "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def _rates(capture: Path, repo: Path) -> list:
    """error_rates of model m as orthornn monitor reads them: the records and labels once."""
    return error_rates(read_records(capture, "m")[0], first_labels(capture, "m")[0], repo, "m")


def _write(capture: Path, version: int, wrong: list[bool], *, start: int = 0,
           classes: int = 3, labelled: bool = True) -> None:
    """One record per answer, in time order (class 0 given; the label says 0 when right),
    as /predict writes them; its label beside the captures."""
    folder = capture / "m" / str(version) / DAY
    folder.mkdir(parents=True, exist_ok=True)
    labels = capture / "m" / "labels" / DAY
    labels.mkdir(parents=True, exist_ok=True)
    with open(folder / f"r0-{start}.jsonl", "w") as records, \
            open(labels / "r0-1.jsonl", "a") as given:
        for i, w in enumerate(wrong, start):
            probabilities = [0.8] + [0.2 / (classes - 1)] * (classes - 1)
            records.write(json.dumps({
                "id": f"req-{i}", "time": T0 + i, "route": "/predict", "model": "m",
                "version": version, "inputs": [], "session": None, "position": None,
                "outputs": [{"label": "a", "index": 0, "probabilities": probabilities}]})
                + "\n")
            if labelled:
                given.write(json.dumps({"id": f"req-{i}", "label": 1 if w else 0,
                                        "time": T0 + i + 0.5, "source": "api"}) + "\n")


def test_the_class_an_answer_gave():
    assert predicted([{"probabilities": [0.1, 0.7, 0.2]}, {"index": 2},
                      {"top_k": [{"index": 4, "label": "e"}]}]) == [1, 2, 4]
    assert predicted({"logits": _logits([[0.0, 3.0], [5.0, 1.0]])}) == [1, 0]
    # a language model's answers and per-step logits are not one class a sequence
    assert predicted([{"next_tokens": [{"id": 3}]}]) is None
    assert predicted({"logits": _logits([[[0.0, 1.0]]])}) is None
    assert predicted("text") is None


def test_a_planted_rise_is_found_where_it_was_planted(tmp_path):
    rng = np.random.default_rng(0)
    wrong = list(rng.random(400) < 0.05) + list(rng.random(400) < 0.5)
    _write(tmp_path, 1, wrong)
    (rate,) = _rates(tmp_path, tmp_path / "no-repo")
    assert (rate.version, rate.labelled, rate.errors) == (1, 800, sum(wrong))
    assert rate.rate == pytest.approx(np.mean(wrong)) and rate.expected is None
    assert rate.rose and 400 <= rate.change_at < 550, rate  # within 150 answers of it
    # ADWIN's two parts, recomputed with numpy: the answers it dropped and those it kept
    assert 0 < _kept_width(rate, wrong) <= rate.change_at
    assert rate.before < 0.15 < 0.4 < rate.after
    assert "ROSE from" in rate.line()


def _kept_width(rate, wrong) -> int:
    """The width of the window ADWIN kept at its cut: the one split of the stream whose
    two parts' means are ``before`` and ``after`` (every answer from the cut on)."""
    at = rate.change_at + 1
    for width in range(1, at + 1):
        if np.mean(wrong[at - width:]) == pytest.approx(rate.after) and \
                np.mean(wrong[:at - width]) == pytest.approx(rate.before):
            return width
    raise AssertionError("no width gives both means")


def test_a_steady_rate_has_no_change_and_unlabelled_answers_do_not_count(tmp_path):
    rng = np.random.default_rng(1)
    wrong = list(rng.random(600) < 0.1)
    _write(tmp_path, 1, wrong)
    _write(tmp_path, 1, [True] * 200, start=600, labelled=False)  # never labelled
    (rate,) = _rates(tmp_path, tmp_path)
    assert rate.labelled == 600 and rate.errors == sum(wrong)
    assert rate.change_at is None and not rate.rose
    assert "ADWIN: no change" in rate.line()


def test_each_version_is_its_own_stream_and_a_retry_counts_once(tmp_path):
    _write(tmp_path, 1, [False] * 50)
    _write(tmp_path, 2, [True] * 30, start=50)
    # the same request captured again (a retry answered twice): its first answer counts
    extra = tmp_path / "m" / "2" / DAY / "r1-1.jsonl"
    extra.write_text((tmp_path / "m" / "2" / DAY / "r0-50.jsonl").read_text().splitlines()[0]
                     + "\n")
    found = streams(read_records(tmp_path, "m")[0], first_labels(tmp_path, "m")[0])
    assert {v: len(s) for v, s in found.items()} == {1: 50, 2: 30}
    assert [r.rate for r in _rates(tmp_path, tmp_path)] == [0.0, 1.0]


def test_monitor_reports_it_and_its_exit_code_counts_a_rise(tmp_path, capsys):
    from orthornn.cli import main

    rng = np.random.default_rng(2)
    _write(tmp_path / "cap", 1, list(rng.random(300) < 0.05) + list(rng.random(300) < 0.6))
    (tmp_path / "repo" / "m").mkdir(parents=True)
    args = ["monitor", "--capture", str(tmp_path / "cap"), "--name", "m", "--repo",
            str(tmp_path / "repo"), "--json", str(tmp_path / "m.json")]
    assert main(args) == 0  # without --exit-code: a report
    assert main([*args, "--exit-code"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("the labelled error rate of version 1 ROSE (ADWIN: ")
    assert any(line.startswith("labels: version 1: 600 labelled answers") for line in out)
    report = json.loads((tmp_path / "m.json").read_text())
    assert report["error_rate_rose"] and report["drift"] and not report["newest_drifts"]
    assert report["error_rates"][0]["labelled"] == 600
