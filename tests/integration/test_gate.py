"""Retraining that cannot make the service worse: the evaluation and lineage a package
carries, the gate of `orthornn export --gate`, promotion, `orthornn versions` and
`orthornn rollback`. Real commands on real runs and files; the live swaps under load are
in test_promotion_live.py."""

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from orthornn.export.artifacts import gate, repository, rollback
from orthornn.export.artifacts.gate import GateRefused
from orthornn.export.builder.evaluation import rebuild_task, score
from orthornn.export.builder.exporter import export_run
from orthornn.training import checkpoint
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

from orthornn import __version__
from tests.helpers import orthornn_here as orthornn

ROOT = Path(__file__).resolve().parents[2]


def adding(out: Path, steps: int, **kw) -> Path:
    train(TrainConfig(arch="svdrnn", task="adding", seq_len=6, hidden_size=8, steps=steps,
                      batch_size=16, log_every=max(1, steps // 2), optimizer="adam", lr=0.02,
                      out=str(out), **kw), progress=False)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """weak: 4 steps (worse than the adding baseline 0.167); strong: 300 steps (far below);
    nan: strong's weights with one made NaN; digits: a classifier (accuracy)."""
    root = tmp_path_factory.mktemp("promotion-runs")
    adding(root / "weak", 4)
    adding(root / "strong", 300)
    shutil.copytree(root / "strong", root / "nan")
    weights = checkpoint.load_weights(root / "nan" / "model.safetensors", "cpu")
    name = next(k for k, v in weights.items() if v.dtype.is_floating_point and v.ndim == 2)
    weights[name] = weights[name].clone()
    weights[name][0, 0] = math.nan
    from safetensors.torch import save_file

    save_file(weights, root / "nan" / "model.safetensors")
    train(TrainConfig(arch="rnn", task="permuted-digits", hidden_size=16, steps=30,
                      batch_size=64, log_every=15, out=str(root / "digits")), progress=False)
    return root


def test_evaluation_is_the_test_metric_of_summary_json(runs, tmp_path):
    """Through onnxruntime, the same number the trainer reports with torch (within the
    difference of the two runtimes)."""
    for run, name in ((runs / "strong", "adder"), (runs / "digits", "digits")):
        path = export_run(run, tmp_path / "repo", name)
        evaluation = json.loads((path / "manifest.json").read_text())["evaluation"]
        summary = json.loads((run / "summary.json").read_text())
        metric = summary["metric"]
        assert evaluation["metric"] == metric and evaluation["split"] == "test"
        assert evaluation["value"] == pytest.approx(summary["test"][metric], rel=1e-4, abs=1e-6)
        task = rebuild_task(json.loads((run / "config.json").read_text()))
        assert evaluation["examples"] == len(task.test)
        assert evaluation["higher_is_better"] is (metric == "accuracy")
        assert len(evaluation["data_fingerprint"]) == 64


def test_lineage_is_recorded(runs, tmp_path):
    repo = tmp_path / "repo"
    first = export_run(runs / "weak", repo, "adder")
    second = export_run(runs / "strong", repo, "adder")
    one, two = (json.loads((p / "manifest.json").read_text())["lineage"]
                for p in (first, second))
    assert one["parent"] is None and two["parent"] == 1  # the promoted version then
    assert one["orthornn_version"] == __version__
    # the same data, other options: the same data fingerprint, another config hash
    assert one["train_data_fingerprint"] == two["train_data_fingerprint"]
    assert one["config_sha256"] != two["config_sha256"]
    revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
    assert two["source_revision"].startswith(revision)
    assert two["created"].endswith("+00:00")
    # a plain export promotes what it publishes (the newest goes live, as before)
    assert repository.read_promotion(repo / "adder")["version"] == 2
    assert [e["action"] for e in repository.read_promotion(repo / "adder")["history"]] == \
        ["publish", "publish"]


def test_data_that_cannot_be_rebuilt_still_exports_without_evaluation(tmp_path):
    import numpy as np

    data = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.normal(size=(40, 5, 2)).astype(np.float32), y=rng.integers(0, 2, 40))
    train(TrainConfig(arch="rnn", task="classify", data=str(data), hidden_size=4, steps=2,
                      batch_size=8, log_every=1, out=str(tmp_path / "run")), progress=False)
    data.unlink()  # the user's file is gone
    path = export_run(tmp_path / "run", tmp_path / "repo", "mine")
    manifest = json.loads((path / "manifest.json").read_text())
    assert "cannot be rebuilt" in manifest["evaluation"]["absent"]
    assert manifest["lineage"]["train_data_fingerprint"] is None
    with pytest.raises(GateRefused, match="no evaluation to gate on"):
        export_run(tmp_path / "run", tmp_path / "repo2", "mine", gated=True)


def _mse(package: Path, test) -> float:
    """A regress package's test MSE written out, not evaluation.score: onnxruntime's
    outputs of its model.onnx on the whole split, mean((y_hat - y)^2) in float64."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(package / "model.onnx"),
                                providers=["CPUExecutionProvider"])
    x, y = test.x.numpy(), test.y.numpy()
    assert test.lengths is None  # the adding task: full-length sequences
    (pred,) = sess.run(["value"], {"x": x, "lengths": np.full(len(x), x.shape[1], np.int64)})
    assert pred.shape == y.shape == (1000, 1)  # no broadcasting
    return float(np.mean((pred.astype(np.float64) - y) ** 2))


def test_gate_promotes_a_better_candidate_and_refuses_a_worse_one(runs, tmp_path):
    repo = tmp_path / "repo"
    export_run(runs / "weak", repo, "adder")  # version 1, ungated
    second = export_run(runs / "strong", repo, "adder", gated=True)
    assert second.name == "2" and repository.promoted(repo / "adder") == 2
    assert repository.read_promotion(repo / "adder")["history"][-1]["action"] == "promote"
    test = rebuild_task(json.loads((runs / "strong" / "config.json").read_text())).test
    strong, weak = _mse(second, test), _mse(repo / "adder" / "1", test)
    assert strong < weak  # MSE: the independent scores agree with the gate's choice
    for path, value in ((second, strong), (repo / "adder" / "1", weak)):
        evaluation = json.loads((path / "manifest.json").read_text())["evaluation"]
        assert evaluation["value"] == pytest.approx(value, rel=1e-5)

    # the weak run again, gated: worse than the task's baseline ...
    with pytest.raises(GateRefused, match=r"must beat the task's baseline 0\.166667"):
        export_run(runs / "weak", repo, "adder", gated=True, mode="factored")
    # ... and with a looser absolute threshold, worse than version 2 on the same data
    with pytest.raises(GateRefused) as refused:
        export_run(runs / "weak", repo, "adder", gated=True, mode="factored", min_metric=1.0)
    message = str(refused.value)
    # the gate's numbers are the independent scores (up to summation order)
    gate_weak, gate_strong = (float(x) for x in re.search(
        r"candidate's mse (\S+) is worse than promoted version 2's (\S+) ", message).groups())
    assert gate_weak == pytest.approx(weak, rel=1e-5)
    assert gate_strong == pytest.approx(strong, rel=1e-5)
    assert "worse than promoted version 2" in message and "--tolerance 0" in message
    assert repository.versions(repo / "adder") == [1, 2]  # nothing published
    assert repository.promoted(repo / "adder") == 2
    kept = refused.value.kept
    assert kept.parent == repo / "adder" / "rejected"
    assert json.loads((kept / "gate.json").read_text())["refused"] == message
    # ... unless the tolerance allows the difference
    allowed = export_run(runs / "weak", repo, "adder", gated=True, mode="factored",
                         min_metric=1.0, tolerance=weak - strong + 1e-6)
    assert allowed.name == "3" and repository.promoted(repo / "adder") == 3


def test_gate_thresholds_follow_the_metrics_direction(runs, tmp_path):
    repo = tmp_path / "repo"
    with pytest.raises(GateRefused, match=r"must meet --min-metric 0\.001 \(lower is better\)"):
        export_run(runs / "strong", repo, "adder", gated=True, min_metric=0.001)
    assert repository.versions(repo / "adder") == []
    assert export_run(runs / "strong", repo, "adder", gated=True, min_metric=0.2).name == "1"
    # accuracy: higher is better
    with pytest.raises(GateRefused, match=r"must meet --min-metric 0\.999 \(higher is better\)"):
        export_run(runs / "digits", repo, "digits", gated=True, min_metric=0.999)
    assert export_run(runs / "digits", repo, "digits", gated=True, min_metric=0.05).name == "1"


def test_non_finite_outputs_fail_the_gate(runs, tmp_path):
    with pytest.raises(GateRefused, match="candidate's mse is nan: non-finite"):
        export_run(runs / "nan", tmp_path / "repo", "adder", gated=True)
    assert repository.versions(tmp_path / "repo" / "adder") == []
    assert len(repository.rejected(tmp_path / "repo" / "adder")) == 1


def test_gate_rules():
    t = gate.Threshold(0.167, "the task's baseline", strict=True)
    assert gate.check("mse", False, 0.05, t, (1, 0.06), 0.0) == ""
    assert "must beat the task's baseline" in gate.check("mse", False, 0.167, t, None, 0.0)
    assert "worse than promoted version 1's 0.04" in gate.check("mse", False, 0.05, t,
                                                                  (1, 0.04), 0.0)
    assert gate.check("mse", False, 0.05, t, (1, 0.04), 0.02) == ""
    assert gate.check("accuracy", True, 0.9, None, (4, 0.9), 0.0) == ""  # equal: no worse
    assert "non-finite" in gate.check("accuracy", True, math.inf, None, None, 0.0)
    assert gate.check("mse", False, 0.1, None, (1, math.nan), 0.0) == ""  # a NaN incumbent


def test_cli_gate_versions_and_rollback(runs, tmp_path):
    repo = tmp_path / "repo"
    assert orthornn("export", runs / "weak", "--repo", repo, "--name", "adder",
                    "--no-progress").returncode == 0
    assert orthornn("export", runs / "strong", "--repo", repo, "--name", "adder", "--gate",
                    "--no-progress").returncode == 0
    refused = orthornn("export", runs / "nan", "--repo", repo, "--name", "adder", "--gate",
                       "--no-progress")
    assert refused.returncode == 3, refused.stderr
    assert refused.stderr.count("\n") == 1 and "refused by the gate: candidate's mse is nan" \
        in refused.stderr
    listing = orthornn("versions", "--repo", repo, "--name", "adder")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[1].split()[:2] == ["1", "published"] and lines[2].split()[:2] == ["2",
                                                                                  "promoted"]
    assert "rejected" in lines[3] and "mse=nan" in lines[3]
    assert "refused: candidate's mse is nan" in lines[4]
    assert "promote  -> 2 (was 1)" in listing.stdout

    back = orthornn("rollback", "--repo", repo, "--name", "adder")
    assert back.returncode == 0 and "version 1 is promoted (was 2)" in back.stdout
    assert repository.promoted(repo / "adder") == 1
    assert repository.versions(repo / "adder") == [1, 2]  # nothing deleted
    forth = orthornn("rollback", "--repo", repo, "--name", "adder", "--to", "2")
    assert forth.returncode == 0 and repository.promoted(repo / "adder") == 2


@pytest.mark.parametrize("args, message", [
    (["rollback", "--name", "adder"], "missing --repo"),
    (["rollback", "--repo", "{repo}", "--name", "nope"], "no model 'nope'"),
    (["rollback", "--repo", "{repo}", "--name", "adder", "--to", "x"],
     "--to must be a version number"),
    (["rollback", "--repo", "{repo}", "--name", "adder", "--to", "9"],
     "version 9 is not in"),
    (["rollback", "--repo", "{repo}", "--name", "adder", "--to", "1"],
     "version 1 does not verify"),
    (["versions", "--repo", "{repo}"], "missing --name"),
    (["export", "{run}", "--repo", "{repo}", "--name", "adder", "--gate", "--tolerance", "-1"],
     "tolerance must be a finite number >= 0"),
    (["export", "{run}", "--repo", "{repo}", "--name", "adder", "--min-metric", "x"],
     "--min-metric must be a number"),
    (["export", "{run}", "--repo", "{repo}", "--name", "adder", "--min-metric", "0.1"],
     "apply only with --gate"),
])
def test_bad_flags_exit_2_with_one_line(runs, tmp_path, args, message):
    repo = tmp_path / "repo"
    export_run(runs / "weak", repo, "adder")
    export_run(runs / "strong", repo, "adder")
    (repo / "adder" / "1" / "model.onnx").write_bytes(b"damaged")  # version 1 fails to verify
    result = orthornn(*[a.format(repo=repo, run=runs / "strong") for a in args])
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    if "does not verify" in message or "is not in" in message:
        assert "versions it could use: none" in result.stderr  # 1 is damaged, 2 is current
    assert repository.promoted(repo / "adder") == 2


def test_rollback_goes_back_one_step_at_a_time(runs, tmp_path):
    repo = tmp_path / "repo"
    for mode in ("dense", "factored"):
        export_run(runs / "weak", repo, "adder", mode=mode)
    export_run(runs / "strong", repo, "adder")
    assert rollback.rollback(repo / "adder")["promoted"] == 2
    assert rollback.rollback(repo / "adder")["promoted"] == 1  # not forth to 3 again
    with pytest.raises(ValueError, match="nothing to roll back to: version 1 is the oldest; "
                                         "versions it could use: 2, 3"):
        rollback.rollback(repo / "adder")
    assert torch.isfinite(torch.tensor(score(repo / "adder" / "1", rebuild_task(json.loads(
        (runs / "weak" / "config.json").read_text())))))


def test_evaluation_of_the_copied_portion_variant_is_its_test_metric(tmp_path):
    """The copy task in DizzyRNN's form scores only the copied steps: so does the
    exported graph's evaluation (summary.json's figure, within the two runtimes)."""
    train(TrainConfig(arch="dizzyrnn", task="copy", seq_len=5, hidden_size=8, steps=3,
                      batch_size=8, log_every=3, copy_loss="copied", copy_symbols=10,
                      out=str(tmp_path / "run")), progress=False)
    path = export_run(tmp_path / "run", tmp_path / "repo", "copier")
    evaluation = json.loads((path / "manifest.json").read_text())["evaluation"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert evaluation["metric"] == "cross_entropy"
    assert evaluation["value"] == pytest.approx(summary["test"]["cross_entropy"], rel=1e-4)
