"""The chart's retraining job for a language model (retraining.fromCaptures with
trainConfig.task lm), run by /bin/sh with the real ``orthornn``: the script as the chart
renders it, its paths pointed at this test's files, on the captures of
tests/unit/export/test_gate_data_lm.py (version 1 learned sentences in one word order; the
captured traffic is the same words reversed, labelled with their next tokens).

The job writes the labelled captures as text corpora, trains on the original corpus plus
the captured one (``--corpus`` twice, from the chart's train.yaml and flags), and the gate
publishes version 2 only after judging it on the original test split and on the held-out
captured corpus: version 2's manifest names what it learned from and how the gate decided.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from orthornn.export.builder.exporter import export_run
from orthornn.training.config import TrainConfig, read_config_file
from orthornn.training.trainer import train

from ..cluster import ROOT
from ..system.test_deploy import CHART, RELEASE, SECRETS, _retraining_scripts, one, run, tool
from ..unit.export.test_gate_data_lm import _capture, _sentence

# the chart's values (a values file): a tiny LSTM
# language model (test_gate_data_lm's recipe) retrained on every scheduled run (no
# trigger), judged with --tolerance 1 (perplexity) on the original test split and no worse
# on the held-out captured corpus
VALUES = {"capture": {"enabled": True},
          "retraining": {"enabled": True, "modelName": "m", "gate": {"tolerance": 1},
                         "fromCaptures": {"enabled": True},
                         "trainConfig": {"arch": "lstm", "task": "lm", "vocab_size": 20,
                                         "bptt": 8, "hidden_size": 16, "batch_size": 8,
                                         "steps": 150, "log_every": 50, "optimizer": "adam",
                                         "lr": 0.02, "device": "cpu"}}}


def _render(values: dict, tmp_path) -> tuple[dict, ...]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    args = [tool("helm"), "template", RELEASE, str(CHART), "--namespace", "ml", "-f", str(path)]
    for item in SECRETS:
        args += ["--set", item]
    result = run(args)
    assert result.returncode == 0, result.stderr
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def test_the_charts_lm_job_learns_from_the_captured_corpus(tmp_path):
    sh = shutil.which("sh")
    if sh is None:
        pytest.skip("no POSIX sh")
    original = tmp_path / "original.txt"
    original.write_text("\n\n".join(" ".join(_sentence(i)) for i in range(40)) + "\n")
    repo, captures, runs = tmp_path / "repo", tmp_path / "captures", tmp_path / "runs"
    runs.mkdir()
    values = json.loads(json.dumps(VALUES))
    values["retraining"]["trainConfig"]["corpus"] = str(original)
    docs = _render(values, tmp_path)
    config = tmp_path / "train.yaml"
    config.write_text(one(docs, "ConfigMap", "-train")["data"]["train.yaml"])
    assert yaml.safe_load(config.read_text())["corpus"] == str(original)

    # version 1: the chart's train.yaml on the original corpus alone (what a first run does)
    train(TrainConfig(**{**read_config_file(config), "out": str(tmp_path / "v1")}),
          progress=False)
    v1 = export_run(tmp_path / "v1", repo, "m")
    vocab = (v1 / "vocab.txt").read_text().splitlines()
    segments = _capture(captures, vocab)  # 60 labelled records of version 1

    script, env = _retraining_scripts(docs)["Job"]
    for path, here in (("/config/train.yaml", config), ("/runs", runs)):
        script = script.replace(path, str(here))
    shim = tmp_path / "bin" / "orthornn"  # the image's console script: this checkout's
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\ncd "{ROOT}" && exec "{sys.executable}" -m orthornn "$@"\n')
    shim.chmod(0o755)
    result = subprocess.run(
        [sh, "-ec", script], capture_output=True, text=True, timeout=240,
        env={**os.environ, **env, "ORTHORNN_REPO": str(repo),
             "ORTHORNN_CAPTURES": str(captures), "HOME": str(tmp_path),
             "MPLCONFIGDIR": str(tmp_path / "matplotlib"),
             "PATH": f"{shim.parent}{os.pathsep}{os.environ['PATH']}"})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]

    # the data set: the older 48 labelled sequences to learn from, the newest 12 held out
    assert "m: train 48 sequences, holdout 12" in out, out[-3000:]
    assert (f"wrote {runs}/captured.txt (48), {runs}/captured-holdout.txt (12)") in out
    # the run: the original corpus first (its vocabulary), then the captured one
    (run,) = [p for p in runs.iterdir() if p.is_dir()]
    assert json.loads((run / "config.json").read_text())["train"]["corpus"] == [
        str(original), f"{runs}/captured.txt"]
    # the gate passed it: version 2 published and promoted (export prints its path)
    assert f"{repo}/m/2" in result.stdout.splitlines(), out[-3000:]
    assert "refused" not in out
    assert json.loads((repo / "m" / "promotion.json").read_text())["version"] == 2
    v2 = repo / "m" / "2"
    assert (v2 / "vocab.txt").read_text().splitlines() == vocab  # the first corpus's
    manifest = json.loads((v2 / "manifest.json").read_text())
    assert manifest["task"] == "lm"
    assert manifest["lineage"]["captures"] == {"segments": segments, "labels": 48}
    assert manifest["lineage"]["parent"] == 1
    evaluation = manifest["evaluation"]
    assert evaluation["metric"] == "perplexity"
    assert evaluation["splits"]["gate_data"]["file"] == f"{runs}/captured-holdout.txt"
    gate = evaluation["gate"]
    assert gate["passed"] and gate["against"] == 1
    decided = gate["gate_data"]
    assert not decided["require_better"]  # a scheduled run, not drift
    # version 1 never saw the reversed order; version 2 learned it from the captures
    assert decided["candidate"] < 0.5 * decided["incumbent"], decided
    print(f"lm job: held-out captured perplexity {decided['incumbent']:.4g} (v1) -> "
          f"{decided['candidate']:.4g} (v2); test split {evaluation['value']:.4g}")
