"""Training on several data sets (`orthornn train --task classify --data A --data B
[--data-mix F]`): each file split on its own and the splits concatenated, the files'
agreement on d and the class names, and the mix of each batch."""

import numpy as np
import pytest
import torch
from orthornn.training.config import TrainConfig, check_data
from orthornn.training.data import MixedSampler, Split
from orthornn.training.tasks import make_task, train_size

from tests.helpers import orthornn_here as orthornn

LABELS = np.array(["a", "b", "c"])


def _npz(path, n, steps, d=2, labels=LABELS, seed=0, lengths=False, segments=None):
    rng = np.random.default_rng(seed)
    arrays = {"x": rng.normal(size=(n, steps, d)).astype(np.float32),
              "y": rng.integers(0, 3, n), "labels": labels}
    if lengths:
        arrays["lengths"] = rng.integers(1, steps + 1, n)
    if segments is not None:
        arrays["segments"] = np.array(segments)
    np.savez(path, **arrays)
    return path


def _reference_split(path, steps):
    """The file's (train, val, test) rows by the documented rule, in numpy: torch's seeded
    permutation (seed 2018) cut at 80% and 10%, x zero-padded to STEPS with lengths."""
    with np.load(path) as f:
        x, y = f["x"], f["y"]
        lengths = f["lengths"] if "lengths" in f.files else np.full(len(y), x.shape[1])
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(2018)).numpy()
    a, b = int(len(y) * 0.8), int(len(y) * 0.8) + int(len(y) * 0.1)
    x = np.concatenate([x, np.zeros((len(y), steps - x.shape[1], x.shape[2]), np.float32)], 1)
    return [(x[i], y[i], lengths[i]) for i in (order[:a], order[a:b], order[b:])]


def test_data_twice_gives_exactly_the_concatenated_splits(tmp_path):
    first = _npz(tmp_path / "a.npz", 50, 5)
    second = _npz(tmp_path / "b.npz", 30, 7, seed=1, lengths=True)
    task = make_task("classify", data=[str(first), str(second)])
    ref = list(zip(_reference_split(first, 7), _reference_split(second, 7), strict=True))
    for split, (a, b) in zip((task.train, task.val, task.test), ref, strict=True):
        np.testing.assert_array_equal(split.x.numpy(), np.concatenate([a[0], b[0]]))
        np.testing.assert_array_equal(split.y.numpy(), np.concatenate([a[1], b[1]]))
        np.testing.assert_array_equal(split.lengths.numpy(), np.concatenate([a[2], b[2]]))
    assert task.train_parts == [40, 24] and task.test_parts == [5, 3]
    assert task.labels == list(LABELS) and task.max_length == 7
    assert train_size("classify", data=[str(first), str(second)]) == 64
    # one file: the task as before (no parts, no lengths made up)
    alone = make_task("classify", data=str(first))
    assert alone.train_parts is None and alone.train.lengths is None
    assert alone.options == {"data": str(first)}


def test_every_file_must_agree_on_d_and_the_class_names(tmp_path):
    first = _npz(tmp_path / "a.npz", 20, 4)
    wide = _npz(tmp_path / "wide.npz", 20, 4, d=3)
    renamed = _npz(tmp_path / "renamed.npz", 20, 4, labels=np.array(["a", "b", "z"]))
    with pytest.raises(ValueError, match=r"wide\.npz.*feature size d = 3.*d = 2"):
        make_task("classify", data=[str(first), str(wide)])
    with pytest.raises(ValueError, match=r"renamed\.npz.*class names.*'z'.*differ"):
        make_task("classify", data=[str(first), str(renamed)])
    with pytest.raises(ValueError, match=r"data_mix.*two or more"):
        check_data(str(first), 0.5)
    for bad in (0, 1, 1.5, True):
        with pytest.raises(ValueError, match=r"data_mix must be a number in \(0, 1\)"):
            check_data([str(first), str(first)], bad)
    with pytest.raises(ValueError, match="data must be a path or a list"):
        check_data([], None)


def test_mixed_batches_draw_the_share_from_each_pool():
    """F of each batch from the rows after the first file's; each pool is read in passes:
    within one pass no row repeats, and a pass reads every row of its pool."""
    split = Split(torch.arange(130.0).view(130, 1, 1), torch.arange(130))
    sampler = MixedSampler(split, first=100, batch_size=10, mix=0.3, seed=5)
    assert sampler.counts == (7, 3) and sampler.per_epoch == 13
    rows = [sampler.batch(step).y.numpy() for step in range(30)]
    assert all((r >= 100).sum() == 3 and len(r) == 10 for r in rows)
    captured = np.concatenate([r[r >= 100] for r in rows])  # 90 draws: three passes of 30
    for p in range(3):
        assert sorted(captured[30 * p:30 * (p + 1)]) == list(range(100, 130))
    original = np.concatenate([r[r < 100] for r in rows])[:100]  # one pass of 100
    assert sorted(original) == list(range(100))
    # the same seed gives the same batches; ranks split each batch (rank_share)
    again = MixedSampler(split, 100, 10, 0.3, 5)
    assert all((again.batch(s).y.numpy() == rows[s]).all() for s in range(30))
    halves = [MixedSampler(split, 100, 10, 0.3, 5, rank=r, world=2).batch(4).y.numpy()
              for r in (0, 1)]
    assert sorted(np.concatenate(halves)) == sorted(rows[4])


def test_the_command_line_takes_data_twice_and_keeps_one_as_a_path(tmp_path):
    import argparse

    from orthornn.training.cli import add_train_parser, resolve_args

    first = _npz(tmp_path / "a.npz", 40, 4)
    second = _npz(tmp_path / "b.npz", 20, 4, seed=1, segments=["m/1/d/r-0.jsonl"])

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    one = parser.parse_args(["train", "--task", "classify", "--data", str(first),
                             "--out", "x"])
    two = parser.parse_args(["train", "--task", "classify", "--data", str(first),
                             "--data", str(second), "--data-mix", "0.25", "--out", "x"])
    assert resolve_args(one)[0].data == str(first)
    config = resolve_args(two)[0]
    assert config.data == [str(first), str(second)] and config.data_mix == 0.25
    assert isinstance(config, TrainConfig)
    bad = orthornn("train", "--arch", "rnn", "--task", "classify", "--data", first,
                   "--data-mix", "0.5", "--out", tmp_path / "r", code=2).stderr
    assert "data_mix (--data-mix) needs two or more --data files" in bad
