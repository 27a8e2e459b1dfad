"""Retraining on live data, as the chart runs it: the retraining container's script
(retraining.trigger and retraining.fromCaptures on), rendered by helm and run by /bin/sh
with the real `orthornn` on PATH, over real files: a repository whose version 1 learned
the original data, and a capture folder of labelled requests whose inputs shifted (the
class signal moved to another input channel, where version 1 is near chance).

The trigger runs `orthornn monitor --exit-code` against version 1's reference and fires
on drift; the job writes the captures as a data set, trains on the original data plus
them, and the gate judges both splits (--tolerance 0.05 on the original split, and
--require-better-on-gate-data on the captured one). Version 2 is
promoted; its accuracy on the held-out slice is recomputed here with onnxruntime."""

import base64
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import orjson
import pytest
import yaml
from orthornn.export.artifacts import repository
from orthornn.export.builder.exporter import export_run
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

from tests.helpers import ROOT
from tests.system.test_deploy import LIVE, _retraining_scripts, one, render

LABELS = ["a", "b", "c"]
TRAIN = dict(arch="rnn", task="classify", hidden_size=8, steps=60, batch_size=32,
             log_every=20, optimizer="adam", lr=0.03)


def _data(n, shifted, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.normal(scale=0.7, size=(n, 5, 2)).astype(np.float32)
    x[:, :, 0 if shifted else 1] += (y[:, None] - 1) * 2.0
    return x, y


def _encoded(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(a.tobytes()).decode()}


def _capture(root, x, y, start: float) -> None:
    """Version 1's answered /predict requests, one a second from START, as capture writes
    them (DIR/m/1/<day>/<replica>-<n>.jsonl), and a label for each a minute after the
    last (DIR/m/labels/<day>/)."""
    day = dt.datetime.fromtimestamp(start, dt.UTC).strftime("%Y-%m-%d")
    folder = root / "m" / "1" / day
    folder.mkdir(parents=True)
    with open(folder / "pod-a-1.jsonl", "wb") as f:
        for i, seq in enumerate(x):
            out = [{"label": "a", "index": 0, "probabilities": [1.0, 0.0, 0.0]}]
            f.write(orjson.dumps({"id": f"req-{i}", "time": start + i, "route": "/predict",
                                  "model": "m", "version": 1, "inputs": [_encoded(seq)],
                                  "outputs": out, "session": None, "position": None,
                                  "compute_ms": 0.1}) + b"\n")
    labels = root / "m" / "labels" / day
    labels.mkdir(parents=True)
    with open(labels / "pod-a-1.jsonl", "wb") as f:
        for i, label in enumerate(y):
            f.write(orjson.dumps({"id": f"req-{i}", "label": int(label),
                                  "time": start + len(y) + 60, "source": "api"}) + b"\n")


def _accuracy(package, x, y) -> float:
    sess = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = sess.run([sess.get_outputs()[0].name],
                         {"x": x, "lengths": np.full(len(x), x.shape[1], np.int64)})
    return float((logits.argmax(-1) == y).mean())


def test_the_chart_retrains_on_drifted_captures_and_the_gate_promotes(tmp_path):
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    x, y = _data(2000, False, 0)  # validation 200 sequences: the drift reference's window
    original = tmp_path / "original.npz"
    np.savez(original, x=x, y=y, labels=np.array(LABELS))
    repo, captures, runs = tmp_path / "repo", tmp_path / "captures", tmp_path / "runs"
    train(TrainConfig(data=str(original), out=str(tmp_path / "v1"), **TRAIN), progress=False)
    v1 = export_run(tmp_path / "v1", repo, "m")
    sx, sy = _data(500, True, 1)
    _capture(captures, sx, sy, start=time.time() - 3600)
    runs.mkdir()

    sets = (*LIVE, "retraining.modelName=m", "retraining.trigger.minLabels=1000",
            "retraining.trigger.cooldownHours=0", "retraining.gate.tolerance=0.05",
            f"retraining.trainConfig.data={original}",
            *(f"retraining.trainConfig.{k}={v}" for k, v in TRAIN.items()))
    docs = render(*sets)
    config = tmp_path / "train.yaml"
    values = yaml.safe_load(one(docs, "ConfigMap", "-train")["data"]["train.yaml"])
    values["lr"] = float(values["lr"])  # helm --set keeps 0.03 a string; a values file would not
    config.write_text(yaml.safe_dump(values))
    script, env = _retraining_scripts(docs)["Job"]
    for path, here in (("/config/train.yaml", config), ("/runs", runs),
                       ("/tmp/retrain-reason", tmp_path / "reason")):
        script = script.replace(path, str(here))
    shim = tmp_path / "bin" / "orthornn"  # the image's console script: this checkout's
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\ncd "{ROOT}" && exec "{sys.executable}" -m orthornn "$@"\n')
    shim.chmod(0o755)
    result = subprocess.run(
        [sh, "-ec", script], capture_output=True, text=True, timeout=600,
        env={**os.environ, **env, "ORTHORNN_REPO": str(repo),
             "ORTHORNN_CAPTURES": str(captures),
             "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "orthornn retrain-trigger: fires: drift detected" in out, out[-4000:]
    assert (tmp_path / "reason").read_text() == "drift\n"

    v2 = repo / "m" / "2"
    assert repository.promoted(repo / "m") == 2, out
    manifest = json.loads((v2 / "manifest.json").read_text())
    with np.load(runs / "captured.npz") as f:
        learned = len(f["y"])
        segments = sorted(str(s) for s in f["segments"])
    with np.load(runs / "captured-holdout.npz") as f:
        hx, hy = f["x"], f["y"]
    assert manifest["lineage"]["captures"] == {"segments": segments, "labels": learned}
    assert learned + len(hy) == 500
    gate = manifest["evaluation"]["gate"]["gate_data"]
    assert gate["require_better"] is True
    assert gate["candidate"] == pytest.approx(_accuracy(v2, hx, hy))
    assert gate["incumbent"] == pytest.approx(_accuracy(v1, hx, hy))
    assert gate["candidate"] >= gate["incumbent"] + 0.1  # it learned the shifted inputs
