"""Training is repeatable: the same command with the same seed gives the same weights'
bytes, at any thread count (training/reproducibility.py says how), and summary.json
records what determines them. Real `orthornn train` processes: MKL reads its mode once
per process."""

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from orthornn.training.reproducibility import idle_cores, pick_threads, usable_cores

import orthornn

ROOT = Path(__file__).resolve().parents[2]


def train(out: Path, *flags: str, env: dict | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "orthornn", "train", "--task", "permuted-digits", "--hidden", "16",
         "--steps", "12", "--log-every", "6", "--batch-size", "32", "--no-progress",
         "--out", str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    summary["sha256"] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
                         for name in ("model.safetensors", "last.safetensors")}
    return summary


# scornn: MKL's gemm in the Cayley solve and input map; lstm: oneDNN's LSTM kernel (off
# while training), the two that differed by thread count before.
@pytest.mark.parametrize("arch", ["scornn", "lstm"])
def test_same_bytes_twice_and_at_one_and_two_threads(tmp_path, arch):
    with ThreadPoolExecutor(2) as pool:  # the one-thread runs side by side, a core each
        one, again = pool.map(lambda run: train(tmp_path / run, "--arch", arch, "--threads",
                                                "1"), ("one", "again"))
    two = train(tmp_path / "two", "--arch", arch, "--threads", "2")
    assert one["sha256"] == again["sha256"] == two["sha256"]
    assert one["test"] == two["test"]
    numerics = two["numerics"]
    assert numerics["threads"] == 2 and one["numerics"]["threads"] == 1
    assert numerics["torch"].startswith("2.") and numerics["mkl_cbwr"] == orthornn.MKL_CBWR
    assert numerics["deterministic"] is True and numerics["onednn"] is False


def test_without_the_reproducible_mode_threads_change_the_bytes(tmp_path):
    """The control: the test above can fail. MKL's default mode sums gemms in a
    thread-dependent order, so 1 and 2 threads train different scoRNN weights."""
    free = {"MKL_CBWR": "AUTO"}
    one = train(tmp_path / "one", "--arch", "scornn", "--threads", "1", env=free)
    two = train(tmp_path / "two", "--arch", "scornn", "--threads", "2", env=free)
    assert one["numerics"]["mkl_cbwr"] == "AUTO"
    assert one["sha256"] != two["sha256"]


def test_threads_default_to_the_idle_cores():
    assert pick_threads(3) == 3  # --threads wins
    assert 1 <= pick_threads(None) <= usable_cores()
    idle = idle_cores(0.05)
    assert idle is None or 0 <= idle <= os.cpu_count()


def test_threads_flag_is_validated(tmp_path):
    result = subprocess.run([sys.executable, "-m", "orthornn", "train", "--threads", "0",
                             "--out", str(tmp_path / "r")], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2
    assert "threads must be an integer in [1, 1024], got 0" in result.stderr
    assert not (tmp_path / "r").exists()
