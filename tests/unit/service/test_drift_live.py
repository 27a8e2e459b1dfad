"""The service's live drift monitor (service.loop.drift): what a window counts, when it is
tested, and the gauges it sets, against the reference's own scores of the same window."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from orthornn.export.artifacts.loop import drift
from orthornn.service.loop.drift import Drift
from orthornn.service.metrics import Metrics
from orthornn.service.registry.runtime import Chunk

from ...service_helpers import wait_until

WINDOW = 20


@pytest.fixture
def version(tmp_path):
    """A loaded classify version (3 classes, state 4, float inputs [T, 2]) whose package
    holds a reference of 100 synthetic sequences."""
    rng = np.random.default_rng(0)
    seqs = [rng.normal(size=(int(rng.integers(3, 8)), 2)) for _ in range(100)]
    logits = [rng.normal(size=3) for _ in seqs]
    states = rng.normal(size=(100, 4))
    projection = drift.projection_matrix(4)
    summaries = drift.summarize("classify", seqs, logits, states, projection)
    reference = drift.build("classify", summaries, projection, 3, window=WINDOW, rounds=200)
    drift.write(reference, tmp_path / "reference.npz")
    return SimpleNamespace(name="m", version=1, path=tmp_path, released=False,
                           manifest=SimpleNamespace(reference="reference.npz"),
                           spec=SimpleNamespace(output_name="logits", task="classify")), \
        reference


def answers(n, shift=0.0, seed=1):
    rng = np.random.default_rng(seed)
    seqs = [rng.normal(shift, 1, size=(5, 2)).astype(np.float32) for _ in range(n)]
    rows = [{"logits": rng.normal(size=3).astype(np.float32),
             "state": rng.normal(shift, 1, size=4).astype(np.float32)} for _ in range(n)]
    return seqs, rows


def gauge(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_a_full_window_is_tested_off_the_request_path_into_the_gauges(version):
    mv, reference = version
    metrics = Metrics()
    d = Drift(metrics)
    seqs, rows = answers(WINDOW + 5, shift=3.0)
    chunks = [Chunk(s, None) for s in seqs[:5]]  # chunks of sessions: never counted
    d.observe(mv, chunks, rows[:5])
    assert d.monitor(mv).pending == []
    for i in range(5, WINDOW + 5, 2):  # requests of two sequences (a request's most)
        d.observe(mv, seqs[i:i + 2], rows[i:i + 2])
    m = d.monitor(mv)
    wait_until(lambda: m.windows == 1, what="the window's test")
    expected = reference.scores(reference.summarize(
        seqs[5:], [r["logits"] for r in rows[5:]], np.stack([r["state"] for r in rows[5:]])))
    assert m.last == pytest.approx(expected)
    for test, score in expected.items():
        assert gauge(metrics, "orthornn_drift_score", model="m", version="1",
                     test=test) == pytest.approx(score)
    assert expected["inputs"] >= 1 and m.alarms == 1  # inputs shifted by 3 sd
    assert gauge(metrics, "orthornn_drift_detected", model="m", version="1") == 1
    d.close()


def test_windows_past_the_interval_only_are_tested(version):
    mv, _ = version
    d = Drift(Metrics(), interval_s=3600)
    seqs, rows = answers(3 * WINDOW)
    for i in range(0, 3 * WINDOW, 2):
        d.observe(mv, seqs[i:i + 2], rows[i:i + 2])
    m = d.monitor(mv)
    wait_until(lambda: m.windows == 1, what="the first window's test")
    assert m.skipped == 2 and m.pending == []  # the next two filled within the hour
    d.close()


def test_a_smaller_window_setting_scales_the_mmd_threshold_only(version):
    _, reference = version
    small = reference.thresholds_for(WINDOW // 2)
    for test in ("inputs", "classes", "entropy"):
        assert small[test] == reference.thresholds[test]
    half = reference.half  # the MMD's null grows as 1/window + 3/half
    ratio = (2 / WINDOW + 3 / half) / (1 / WINDOW + 3 / half)
    assert small["state"] == pytest.approx(reference.thresholds["state"] * ratio)


def test_a_window_spans_requests_so_that_two_cannot_fake_drift(version):
    """Issue 59, finding 7: two requests of 200 out-of-distribution sequences each made a
    window drift (and the retraining trigger fire). A request adds at most
    per_request(window) sequences (a window spans MIN_REQUESTS requests at least)."""
    mv, _ = version
    d = Drift(Metrics())
    seqs, rows = answers(10 * WINDOW, shift=3.0)
    d.observe(mv, seqs[:5 * WINDOW], rows[:5 * WINDOW])
    d.observe(mv, seqs[5 * WINDOW:], rows[5 * WINDOW:])
    m = d.monitor(mv)
    assert len(m.pending) == 2 * drift.per_request(WINDOW) < WINDOW and m.windows == 0
    for k in range(drift.MIN_REQUESTS - 2):  # shifted traffic from enough requests alarms
        d.observe(mv, seqs[2 * k:2 * k + 2], rows[2 * k:2 * k + 2])
    wait_until(lambda: m.windows == 1, what="the window's test")
    assert m.alarms == 1
    d.close()
