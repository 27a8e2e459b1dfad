"""The drift reference an export records (export.artifacts.loop.drift, export.builder.reference):
its summaries against a numpy recomputation from the validation split through onnxruntime,
the tests' statistics against scipy's own functions, the package hash that covers the file,
and packages without one (exported before it) that still load, with drift off."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import onnxruntime as ort
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.loop import drift, drift_statistics
from orthornn.export.artifacts.package import PackageError, verify_package
from orthornn.service.http.app import create_app
from orthornn.service.settings import Settings
from orthornn.training.tasks import make_task
from scipy.stats import chi2, chi2_contingency, ks_2samp, kstwobign

from ..service_helpers import publish_copy


@pytest.fixture(scope="module")
def digits(service_packages):
    return service_packages / "digits" / "1"


def test_the_summaries_are_the_validation_splits_through_the_graph(digits):
    manifest = json.loads((digits / "manifest.json").read_text())
    assert manifest["reference"] == "reference.npz"
    reference = drift.read(digits / "reference.npz")
    val = make_task("digits").val
    x = val.x.numpy().astype(np.float32)  # [269, 64, 1], every sequence whole
    sess = ort.InferenceSession(str(digits / "model.onnx"), providers=["CPUExecutionProvider"])
    logits, state = sess.run(["logits", "state"],
                             {"x": x, "lengths": np.full(len(x), 64, dtype=np.int64)})
    s = reference.summaries
    assert s["inputs"].shape == (269, 3)  # length, mean, variance of the one channel
    np.testing.assert_array_equal(s["inputs"][:, 0], 64)
    np.testing.assert_allclose(s["inputs"][:, 1], x[:, :, 0].mean(1), rtol=1e-6)
    np.testing.assert_allclose(s["inputs"][:, 2], x[:, :, 0].var(1), rtol=1e-5, atol=1e-9)
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_array_equal(s["classes"], p.argmax(1))
    np.testing.assert_allclose(s["entropy"], -(p * np.log(p)).sum(1), rtol=1e-6)
    rng = np.random.default_rng(43)  # the seeded projection, 8 dimensions
    projection = rng.standard_normal((state.shape[1], 8)) / math.sqrt(8)
    np.testing.assert_allclose(reference.projection, projection)
    np.testing.assert_allclose(s["projected"], state.astype(np.float64) @ projection,
                               rtol=1e-5, atol=1e-6)
    meta = reference.meta
    assert meta["split"] == "validation" and meta["window"] == 200 and meta["alpha"] == 0.01
    for test in ("inputs", "classes", "entropy"):  # never below the nominal threshold
        assert reference.thresholds[test] >= -math.log10(0.01 / 4)
    assert reference.thresholds["state"] > 0


def test_the_statistics_are_scipys():
    """The tests' numpy statistics (the service has no scipy) against scipy's."""
    rng = np.random.default_rng(0)
    reference, window = rng.normal(size=(1, 269, 2)), rng.normal(0.3, 1, size=(1, 200, 2))
    window[0, :50, 1] = reference[0, :50, 1]  # ties across the samples
    for j in range(2):
        exact = ks_2samp(reference[0, :, j], window[0, :, j])
        assert drift_statistics.ks_statistic(reference[..., j], window[..., j])[0] == \
            pytest.approx(exact.statistic, abs=1e-12)
        # Stephens' scaling of the asymptotic distribution, against scipy's exact p-value
        assert drift_statistics.ks_mlog10p(reference[..., j], window[..., j])[0] == \
            pytest.approx(-math.log10(exact.pvalue), rel=0.05)
    lam = np.array([0.2, 0.6, 1.0, 1.7, 4.0, 9.0])  # both series of the distribution
    np.testing.assert_allclose(drift_statistics.kolmogorov_mlog10(lam),
                               -kstwobign.logsf(lam) / math.log(10), rtol=1e-9, atol=1e-12)
    a, b = rng.integers(0, 30, (4, 6)), rng.integers(0, 30, (4, 6))
    a[:, 3] = b[:, 3] = 0  # an empty class: out of the table
    expected = [-math.log10(chi2_contingency(np.stack([x, y])[:, (x + y) > 0],
                                             correction=False).pvalue)
                for x, y in zip(a, b, strict=True)]
    np.testing.assert_allclose(drift_statistics.chi2_mlog10p(a, b), expected, rtol=1e-9)
    stat, dof = np.array([0.5, 30.0, 900.0]), np.array([1, 9, 4])  # both branches, deep tail
    np.testing.assert_allclose(drift_statistics.chi2_mlog10_sf(stat, dof),
                               -chi2.logsf(stat, dof) / math.log(10), rtol=1e-9)
    # MMD^2 (biased, Gaussian kernel): the formula written out
    x, y, h = rng.normal(size=(5, 3)), rng.normal(size=(7, 3)), 1.3

    def k(u, v):
        return np.exp(-((u[:, None] - v[None]) ** 2).sum(-1) / (2 * h * h)).mean()
    assert drift_statistics.mmd2(x, y, h) == pytest.approx(k(x, x) + k(y, y) - 2 * k(x, y))


def test_the_package_hash_covers_the_reference(digits, tmp_path):
    package = shutil.copytree(digits, tmp_path / "p")
    data = bytearray((package / "reference.npz").read_bytes())
    data[-40] ^= 1
    (package / "reference.npz").write_bytes(bytes(data))
    with pytest.raises(PackageError, match=r"sha256 mismatch for 'reference\.npz'"):
        verify_package(package)
    manifest = json.loads((package / "manifest.json").read_text())
    del manifest["files"]["reference.npz"]
    (package / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageError, match="no sha256 for reference"):
        verify_package(package)


def without_reference(package, dest):
    """PACKAGE as exported before the reference: no file, no manifest field."""
    shutil.copytree(package, dest)
    (dest / "reference.npz").unlink()
    manifest = json.loads((dest / "manifest.json").read_text())
    del manifest["reference"], manifest["files"]["reference.npz"]
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


def test_a_package_without_a_reference_still_loads_and_measures_no_drift(digits, tmp_path):
    old = without_reference(digits, tmp_path / "old")
    assert verify_package(old).reference is None
    repo = tmp_path / "repo"
    publish_copy(old, repo / "digits", 1)
    app = create_app(Settings(repo=repo, poll_interval_s=0, drift_window=20))
    with TestClient(app) as c:
        app.state.registry.scanned.wait(60)
        seqs = make_task("digits").test.x.numpy()[:10]
        for _ in range(3):
            r = c.post("/predict", json={"model": "digits", "inputs": seqs.tolist()})
            assert r.status_code == 200
        monitor = app.state.dataplane.drift.monitors[("digits", 1)]
        assert monitor.reference is None and monitor.pending == [] and monitor.windows == 0
        assert 'orthornn_drift_score{' not in c.get("/metrics").text


def test_the_mmd_null_is_mmd2_of_each_calibration_draw():
    """The calibration's MMD null (one kernel matrix, the draws as row counts) equals the
    live formula, drift.mmd2, run on each draw's rows: the same halves and windows drawn
    from the same seed, with repeats."""
    rng = np.random.default_rng(5)
    n, rounds = 120, 40
    states = rng.normal(size=(n, drift.PROJECTION))
    bandwidth = drift_statistics.median_distance(states)
    found = drift.calibrate(("state",), {"projected": states}, bandwidth, 1, rounds=rounds)
    draw = np.random.default_rng(drift.SEED)  # the calibration's draws, again
    orders = np.stack([draw.permutation(n) for _ in range(rounds)])
    a, b = orders[:, :n // 2], orders[:, n // 2:]
    drawn = np.take_along_axis(b, draw.integers(n - n // 2, size=(rounds, drift.WINDOW)), 1)
    null = [drift_statistics.mmd2(states[drawn[r]], states[a[r, :drift.MAX_KERNEL]], bandwidth)
            for r in range(rounds)]
    assert found["null_quantiles"]["state"] == pytest.approx(
        [float(np.quantile(null, q)) for q in (0.5, 0.9, 0.99)], rel=1e-9, abs=1e-12)
