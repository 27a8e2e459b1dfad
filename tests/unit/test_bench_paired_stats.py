"""The paired load benches' ratio and interval (bench/load/client.py, ``mean_ratio``): the
geometric mean of the rounds' ratios, and a 95% interval over the processes' means
(Student's t) when there are 3 or more, else over the rounds (normal), checked against
scipy's own t interval."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("bench_client",
                                               ROOT / "bench" / "load" / "client.py")
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_the_interval_is_over_the_processes_means():
    rng = np.random.default_rng(0)
    # 6 processes of 10 rounds: each process its own offset, the rounds little noise
    offsets = rng.normal(0, 0.02, 6)
    logs = np.concatenate([o + rng.normal(-0.03, 0.005, 10) for o in offsets])
    processes = [k for k in range(6) for _ in range(10)]
    ratio, (low, high) = bench.mean_ratio(list(np.exp(logs)), processes)
    means = [logs[k * 10:(k + 1) * 10].mean() for k in range(6)]
    expected = stats.t.interval(0.95, 5, loc=np.mean(means), scale=stats.sem(means))
    assert ratio == pytest.approx(np.exp(logs.mean()), abs=5e-4)
    assert (low, high) == pytest.approx(tuple(np.exp(expected)), abs=5e-4)
    # taken as 60 independent rounds, the interval would be several times narrower
    _, (r_low, r_high) = bench.mean_ratio(list(np.exp(logs)))
    assert (high - low) > 2 * (r_high - r_low)


def test_with_fewer_than_three_processes_the_rounds_decide():
    ratios = [0.95, 0.97, 0.99, 0.96]
    logs = np.log(ratios)
    half = 1.96 * np.std(logs, ddof=1) / np.sqrt(4)
    for processes in (None, [0, 0, 1, 1]):
        ratio, interval = bench.mean_ratio(ratios, processes)
        assert ratio == pytest.approx(np.exp(logs.mean()), abs=5e-4)
        assert interval == pytest.approx([np.exp(logs.mean() - half),
                                          np.exp(logs.mean() + half)], abs=5e-4)
