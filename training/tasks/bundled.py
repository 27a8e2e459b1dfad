"""Data sets bundled with packages: scikit-learn's 8x8 digits (and its permuted variant)
and MNIST-1D from the mnist1d package's own generator."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ..data import Split
from .task import SPLIT_SEED, Task, classification, holdout, split_fixed

DIGITS_COUNT = 1797  # scikit-learn's bundled 8x8 digits (load_digits)
DIGITS_SPLIT = (0.7, 0.15)  # train, validation; the test set is the rest
MNIST1D_COUNT = 4000  # training sequences of mnist1d's generator at its default arguments
MNIST1D_VAL = 500  # of them held out for validation


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits as its ``load_digits`` reads them (the pixels
    [1797, 64] in 0-16, the classes), from the file scikit-learn ships, without importing
    scikit-learn: its import (scipy.stats among it) took 2.8 s of every train and export
    of a digits task, a third of a short one."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("No module named 'sklearn'", name="sklearn")
    data = np.loadtxt(Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz",
                      delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def digits_task(permuted: bool) -> Task:
    """scikit-learn's bundled 8x8 digits, read pixel by pixel (T = 64), scaled to [0, 1];
    the permuted variant applies one fixed seeded permutation of the 64 pixels."""
    pixels, classes = load_digits()
    x = torch.tensor(pixels, dtype=torch.float32) / 16
    if permuted:
        x = x[:, torch.randperm(64, generator=torch.Generator().manual_seed(SPLIT_SEED))]
    splits = split_fixed(x.unsqueeze(-1), torch.tensor(classes), DIGITS_SPLIT)
    name = "permuted-digits" if permuted else "digits"
    task = classification(name, *splits, [str(i) for i in range(10)], {})
    task.transform = {"kind": "affine", "offset": [0.0], "scale": [16.0],
                      "description": "scikit-learn's pixel values 0-16 divided by 16 (inputs "
                                     "in [0, 1])" + (", pixels in a fixed permuted order"
                                                     if permuted else "")}
    return task


def mnist1d_task() -> Task:
    """MNIST-1D generated offline by the mnist1d package's own generator (its default
    arguments: 4000 training and 1000 test sequences of length 40); 500 training
    sequences held out for validation."""
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())  # generation only, never its download
    x = torch.tensor(data["x"], dtype=torch.float32).unsqueeze(-1)
    y = torch.tensor(data["y"], dtype=torch.long)
    whole = Split(x, y)
    train, val = holdout(len(y), MNIST1D_VAL)
    test = Split(torch.tensor(data["x_test"], dtype=torch.float32).unsqueeze(-1),
                 torch.tensor(data["y_test"], dtype=torch.long))
    return classification("mnist1d", whole.take(train), whole.take(val), test,
                           [str(i) for i in range(10)], {})
