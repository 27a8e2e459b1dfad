"""The two-split gate (`orthornn export --gate --gate-data HOLDOUT.npz
[--require-better-on-gate-data]`) and the lineage of a version that learned from captures.

The data: three classes whose class signal is on input channel 1 in the original data and
on channel 0 in the "captured" (shifted) data. A model trained on the original data alone
is near chance on the shifted inputs; one trained on both learns them. Every value the
gate compares is recomputed here with onnxruntime and numpy on each version's own graph.
"""

import json

import numpy as np
import onnxruntime as ort
import pytest
from orthornn.export.artifacts import gate
from orthornn.export.builder.exporter import export_run
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

from tests.helpers import orthornn_here as orthornn

LABELS = np.array(["a", "b", "c"])
SEGMENTS = ["m/1/2026-11-27/r-0.jsonl", "m/1/2026-11-27/r-1.jsonl"]


def _data(path, n, shifted, seed, segments=None):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(scale=0.7, size=(n, 5, 2)).astype(np.float32)
    x[:, :, 0 if shifted else 1] += (y[:, None] - 1) * 2.0
    arrays = {"x": x, "y": y, "labels": LABELS}
    if segments is not None:  # what `orthornn capture dataset` adds
        arrays.update(segments=np.array(segments), ids=np.array([f"r{i}" for i in range(n)]),
                      times=np.arange(n, dtype=np.float64), versions=np.ones(n, np.int64))
    np.savez(path, **arrays)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """original: v1, the incumbent; again: the original data only, another seed (learned
    nothing from the captures); captured: original plus captured data."""
    root = tmp_path_factory.mktemp("gate-data")
    original = _data(root / "original.npz", 300, False, 0)
    captured = _data(root / "captured.npz", 150, True, 1, SEGMENTS)
    _data(root / "holdout.npz", 100, True, 2, ["m/1/2026-11-28/r-0.jsonl"])
    common = dict(arch="rnn", task="classify", hidden_size=8, steps=60, batch_size=32,
                  log_every=20, optimizer="adam", lr=0.03)
    for name, data, seed in (("original", str(original), 0), ("again", str(original), 1),
                             ("captured", [str(original), str(captured)], 0)):
        train(TrainConfig(data=data, seed=seed, out=str(root / name), **common),
              progress=False)
    return root


def _accuracy(package, x, y) -> float:
    """The package's accuracy on (x, y) through its model.onnx, in numpy."""
    sess = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    out = sess.get_outputs()[0].name
    (logits,) = sess.run([out], {"x": x, "lengths": np.full(len(x), x.shape[1], np.int64)})
    return float((logits.argmax(-1) == y).mean())


def _original_test(root):
    """The original file's test rows (USER_SPLIT: the permutation's last 10%)."""
    import torch

    with np.load(root / "original.npz") as f:
        x, y = f["x"], f["y"]
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(2018)).numpy()
    test = order[int(len(y) * 0.8) + int(len(y) * 0.1):]
    return x[test], y[test]


def test_the_gate_judges_both_splits_through_each_graph(runs, tmp_path):
    repo = tmp_path / "repo"
    v1 = export_run(runs / "original", repo, "m")
    v2 = export_run(runs / "captured", repo, "m", gated=True,
                    gate_data=runs / "holdout.npz", require_better=True)
    with np.load(runs / "holdout.npz") as f:
        hx, hy = f["x"], f["y"]
    tx, ty = _original_test(runs)
    manifest = json.loads((v2 / "manifest.json").read_text())
    evaluation = manifest["evaluation"]
    # the headline value is the ORIGINAL test split, not the combined one
    assert evaluation["value"] == pytest.approx(_accuracy(v2, tx, ty))
    assert evaluation["examples"] == len(ty) == 30
    splits = evaluation["splits"]
    assert splits["test"]["value"] == pytest.approx(_accuracy(v2, tx, ty))
    assert splits["gate_data"]["value"] == pytest.approx(_accuracy(v2, hx, hy))
    assert splits["gate_data"]["examples"] == 100
    outcome = evaluation["gate"]["gate_data"]
    assert outcome["incumbent"] == pytest.approx(_accuracy(v1, hx, hy))
    assert outcome["candidate"] - outcome["incumbent"] >= gate.GATE_MARGIN
    assert outcome["incumbent"] < 0.6 < outcome["candidate"]  # v1 never saw the shift
    # lineage: the captured file's segments and its labelled records (not the holdout's)
    assert manifest["lineage"]["captures"] == {"segments": SEGMENTS, "labels": 150}
    assert "captures" not in json.loads((v1 / "manifest.json").read_text())["lineage"]
    listing = orthornn("versions", "--repo", repo, "--name", "m", code=0).stdout
    (row,) = [line for line in listing.splitlines() if line.startswith("2 ")]
    assert row.split()[-3:] == ["150", "labels/2", "seg"]
    (row,) = [line for line in listing.splitlines() if line.startswith("1 ")]
    assert row.split()[-1] == "-"


def test_a_candidate_that_learned_nothing_from_the_captures_is_refused(runs, tmp_path):
    """Trained on the original data only: on the shifted slice it is as bad as the
    incumbent. --tolerance 1 lets any value pass the no-worse rules, so only
    --require-better-on-gate-data can refuse it; without that flag it passes."""
    repo = tmp_path / "repo"
    v1 = export_run(runs / "original", repo, "m")
    with np.load(runs / "holdout.npz") as f:
        hx, hy = f["x"], f["y"]
    incumbent = _accuracy(v1, hx, hy)
    result = orthornn("export", runs / "again", "--repo", repo, "--name", "m", "--gate",
                      "--tolerance", "1", "--gate-data", runs / "holdout.npz",
                      "--require-better-on-gate-data", "--no-progress", code=3)
    (line,) = result.stderr.strip().splitlines()
    (kept,) = (repo / "m" / "rejected").iterdir()
    candidate = _accuracy(kept, hx, hy)
    assert candidate - incumbent < gate.GATE_MARGIN
    assert (f"on the held-out captured slice (--gate-data {runs / 'holdout.npz'}): "
            f"candidate's accuracy {candidate:.6g} is not better than promoted version 1's "
            f"{incumbent:.6g} by at least --gate-margin 0.02") in line
    assert not (repo / "m" / "2").exists()
    # the same candidate without the drift rule: no worse beyond the tolerance, published
    orthornn("export", runs / "again", "--repo", repo, "--name", "m", "--gate", "--tolerance",
             "1", "--gate-data", runs / "holdout.npz", "--no-progress", code=0)
    assert (repo / "m" / "2").is_dir()


def test_worse_on_either_split_is_refused_naming_it(runs, tmp_path):
    """The captured-data candidate as the incumbent: the original-only one is worse on the
    captured slice (refused there); and a wide margin refuses even the better one."""
    repo = tmp_path / "repo"
    export_run(runs / "captured", repo, "m")
    line = orthornn("export", runs / "original", "--repo", repo, "--name", "m", "--gate",
                    "--tolerance", "0.05", "--gate-data", runs / "holdout.npz",
                    "--no-progress", code=3).stderr
    assert "on the held-out captured slice" in line and "by more than --tolerance 0.05" in line
    repo2 = tmp_path / "repo2"
    export_run(runs / "original", repo2, "m")
    line = orthornn("export", runs / "captured", "--repo", repo2, "--name", "m", "--gate",
                    "--tolerance", "1", "--gate-data", runs / "holdout.npz",
                    "--require-better-on-gate-data", "--gate-margin", "0.9",
                    "--no-progress", code=3).stderr
    assert "by at least --gate-margin 0.9" in line


def test_gate_data_bad_input_is_one_line(runs, tmp_path):
    repo = tmp_path / "repo"
    export_run(runs / "original", repo, "m")
    cases = [
        (["--gate-data", runs / "holdout.npz"], "apply only with --gate"),
        (["--gate", "--require-better-on-gate-data"], "needs --gate-data HOLDOUT"),
        (["--gate", "--gate-data", runs / "holdout.npz", "--gate-margin", "0.1"],
         "--gate-margin applies only with --require-better-on-gate-data"),
        (["--gate", "--gate-data", tmp_path / "nope.npz"], "must be an existing .npz"),
    ]
    wide = tmp_path / "wide.npz"
    np.savez(wide, x=np.zeros((20, 5, 3), np.float32), y=np.zeros(20, np.int64), labels=LABELS)
    cases.append((["--gate", "--gate-data", wide], "feature size d = 3; the run's is 2"))
    for flags, message in cases:
        err = orthornn("export", runs / "again", "--repo", repo, "--name", "m",
                       "--no-progress", *flags, code=2).stderr
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_check_better_rule():
    assert gate.check_better("accuracy", True, 0.80, (1, 0.78), 0.02) == ""
    assert "not better" in gate.check_better("accuracy", True, 0.79, (1, 0.78), 0.02)
    assert gate.check_better("mse", False, 0.5, (1, 0.6), 0.1) == ""
    assert "not better" in gate.check_better("mse", False, 0.55, (1, 0.6), 0.1)
    assert gate.check_better("accuracy", True, 0.1, None, 0.02) == ""  # nothing to beat
    assert "non-finite" in gate.check_better("accuracy", True, float("nan"), (1, 0.5), 0.02)
