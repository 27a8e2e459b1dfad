"""The retraining loop against a running `orthornn serve` process, under load: a
healthy candidate passes the gate and is swapped in, a damaged one is refused while the
service keeps answering byte for byte the same, and a rollback returns to the previous
version; none of it fails a request."""

import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from orthornn.training import checkpoint

from tests.helpers import orthornn as run_orthornn
from tests.pace import Pace
from tests.service_helpers import free_port, wait_ready

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--arch", "svdrnn", "--task", "adding", "--seq-len", "6", "--hidden", "8",
          "--batch-size", "16", "--optimizer", "adam", "--lr", "0.02", "--no-progress"]
BODY = {"model": "adder", "inputs": [[[0.5, 1], [0.2, 0], [0.3, 1], [0.1, 0]]]}


def orthornn(*args, code: int = 0) -> subprocess.CompletedProcess:
    return run_orthornn(*args, code=code)


class Load:
    """Clients posting BODY in a loop (paced: tests/pace.py): every answer's (version, raw
    bytes), and every failure."""

    def __init__(self, url: str, clients: int = 2):
        self.url, self.answers, self.failures = url, [], []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.run) for _ in range(clients)]

    def run(self):
        pace = Pace()
        with httpx.Client(timeout=30) as http:
            while not self.done.is_set():
                pace.wait()
                try:
                    r = http.post(self.url + "/predict", json=BODY)
                except httpx.HTTPError as error:
                    self.failures.append(repr(error))
                    continue
                if r.status_code != 200:
                    self.failures.append(f"{r.status_code} {r.text}")
                    continue
                self.answers.append((r.json()["version"], r.json()["outputs"]))

    def wait_for(self, version: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(v == version for v, _ in self.answers[-4:]):
                return
            time.sleep(0.1)
        raise AssertionError(f"the service never answered from version {version}")

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        for t in self.threads:
            t.join(timeout=60)


def metric(text: str, name: str, **labels) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.timeout(600)
def test_gate_promotion_refusal_and_rollback_under_load(tmp_path):
    runs, repo = tmp_path / "runs", tmp_path / "repo"
    orthornn("train", *COMMON, "--steps", "300", "--log-every", "100", "--out", runs / "v1")
    assert orthornn("export", runs / "v1", "--repo", repo, "--name", "adder").stdout.strip() \
        == str(repo / "adder" / "1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "orthornn", "serve", "--repo", repo,
                             "--port", str(port), "--poll-interval-s", "0.2",
                             "--log-level", "warning"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(proc, url)
        with Load(url) as load:
            # 1. a healthy candidate, the same run trained further, passes and goes live
            orthornn("train", "--resume", "--out", runs / "v1", "--steps", "600",
                     "--select", "last")
            passed = orthornn("export", runs / "v1", "--repo", repo, "--name", "adder",
                              "--gate")
            assert passed.stdout.strip() == str(repo / "adder" / "2")
            load.wait_for(2)
            meta = httpx.get(url + "/v2/models/adder").json()
            assert meta["parameters"]["promoted"] == "2"
            version2 = httpx.get(url + "/v2/models/adder/versions/2").json()["parameters"]
            manifest = json.loads((repo / "adder" / "2" / "manifest.json").read_text())
            assert version2["evaluation"] == manifest["evaluation"]
            assert version2["lineage"]["parent"] == 1

            # 2. a damaged candidate (non-finite weights) is refused; answers stay the same
            before = [out for v, out in load.answers[-4:] if v == 2]
            shutil.copytree(runs / "v1", runs / "nan")
            weights = checkpoint.load_weights(runs / "nan" / "model.safetensors", "cpu")
            name = next(k for k, v in weights.items() if v.ndim == 2)
            weights[name] = weights[name].clone().fill_(math.nan)
            from safetensors.torch import save_file

            save_file(weights, runs / "nan" / "model.safetensors")
            refused = orthornn("export", runs / "nan", "--repo", repo, "--name", "adder",
                               "--gate", code=3)
            assert "refused by the gate: candidate's mse is nan" in refused.stderr
            time.sleep(1.0)  # five repository scans
            after = [out for v, out in load.answers[-20:]]
            assert before and all(out == before[0] for out in after)  # byte-identical
            listing = orthornn("versions", "--repo", repo, "--name", "adder").stdout
            assert "rejected" in listing and "mse=nan" in listing

            # 3. a rollback returns to version 1
            assert "version 1 is promoted (was 2)" in orthornn(
                "rollback", "--repo", repo, "--name", "adder").stdout
            load.wait_for(1)
        assert not load.failures, load.failures[:5]
        assert {v for v, _ in load.answers} == {1, 2}
        assert httpx.get(url + "/v2/models/adder").json()["parameters"]["promoted"] == "1"
        text = httpx.get(url + "/metrics").text
        assert metric(text, "orthornn_model_promotions_total", model="adder",
                      action="rollback") == 1
        assert metric(text, "orthornn_model_promotions_total", model="adder",
                      action="promote") == 1
        value = metric(text, "orthornn_model_evaluation", model="adder", version="1",
                       metric="mse")
        one = json.loads((repo / "adder" / "1" / "manifest.json").read_text())["evaluation"]
        assert value == pytest.approx(one["value"])
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
