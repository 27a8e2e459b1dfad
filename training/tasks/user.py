"""A user's classification data: an .npz with x, y and optional lengths and labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .task import Task, classification, split_fixed

USER_SPLIT = (0.8, 0.1)  # a user's .npz: train, validation; the test set is the rest


def load_npz(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list]:
    """A user's data: x [N, T, d] float (padded when ``lengths`` [N] is given), y [N]
    integer class ids, optional ``labels`` [C]."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data must be an existing .npz file; {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"data {str(path)!r} is not a readable .npz file ({error})") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise ValueError(f"data file must hold arrays 'x' and 'y'; missing {key!r}")
    x, y = arrays["x"], arrays["y"]
    if x.ndim == 2:
        x = x[..., None]
    if x.ndim != 3 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"data x must be a numeric array [N, T, d] (or [N, T]); got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("data x holds NaN or infinite values")
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"data y must be integer class ids [N] with N = {len(x)}; "
                         f"got {y.dtype} {y.shape}")
    if len(y) < 10:
        raise ValueError(f"data must hold at least 10 sequences, got {len(y)}")
    if y.min() < 0:
        raise ValueError("data y class ids must be >= 0")
    lengths = None
    if "lengths" in arrays:
        lengths = arrays["lengths"]
        if lengths.shape != (len(x),) or not np.issubdtype(lengths.dtype, np.integer) \
                or lengths.min() < 1 or lengths.max() > x.shape[1]:
            raise ValueError(f"data lengths must be integers [N] in [1, {x.shape[1]}]")
        lengths = torch.tensor(lengths, dtype=torch.long)
    classes = int(y.max()) + 1
    labels = [str(v) for v in arrays["labels"]] if "labels" in arrays else \
        [str(i) for i in range(classes)]
    if len(labels) < max(classes, 2):
        raise ValueError(f"data labels must name every class (>= {max(classes, 2)}), "
                         f"got {len(labels)}")
    return (torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long), lengths,
            labels)


def user_task(data: str | None = None) -> Task:
    if data is None:
        raise ValueError("task 'classify' needs --data FILE (an .npz with x and y)")
    x, y, lengths, labels = load_npz(data)
    train, val, test = split_fixed(x, y, USER_SPLIT, lengths)
    return classification("classify", train, val, test, labels, {"data": str(data)})
