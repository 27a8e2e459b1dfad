"""The UCR/UEA classification sets sktime ships, with their official splits and the
Spectral-RNN appendix's folding of a series into steps."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..data import Split
from .task import Task, classification, holdout

UCR_VAL = 0.2  # of the official training set held out (Spectral-RNN appendix)


def ucr_holdout(n: int, fold: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) indices of a training split of n series: fold FOLD of the
    ``ucr_folds(n)`` disjoint validation blocks (fold 0: the appendix's one split)."""
    return holdout(n, _val_count(n), fold)


def _val_count(n: int) -> int:
    return max(1, round(UCR_VAL * n))  # one series at least, however small


def ucr_folds(n: int) -> int:
    """Disjoint validation blocks a training split of n series holds (5 at 20%)."""
    return n // _val_count(n)


def sktime_data() -> Path:
    import sktime

    return Path(sktime.__file__).parent / "datasets" / "data"


def ucr_datasets() -> list[str]:
    """Equal-length UCR/UEA classification sets that sktime ships in the package."""
    names = []
    for folder in sorted(sktime_data().iterdir()):
        train = folder / f"{folder.name}_TRAIN.ts"
        if not (train.is_file() and (folder / f"{folder.name}_TEST.ts").is_file()):
            continue
        header = train.read_text(errors="replace")[:20000].lower()
        header = header[: header.find("@data")]
        if "@classlabel true" in header and "@equallength false" not in header:
            names.append(folder.name)
    return names


def step_width(length: int) -> int:
    """n_i: the largest divisor of L not above sqrt(L) (Spectral-RNN appendix)."""
    return max(d for d in range(1, math.isqrt(length) + 1) if length % d == 0)


def fold_series(x: np.ndarray, point_by_point: bool, width: int | None = None) -> np.ndarray:
    """[N, channels, L] -> [N, L / n_i, channels n_i] (or [N, L, channels]); with WIDTH,
    [N, ceil(L / WIDTH), channels WIDTH], the series first padded at its end by repeating
    its last value up to a multiple of WIDTH (a prime L, such as ArrowHead's 251, has only
    n_i = 1; 252 allows 2, 3, 4, 6, 7, ...)."""
    n, channels, length = x.shape
    if width is None:
        width = 1 if point_by_point else step_width(length)
    steps = -(-length // width)
    if steps * width != length:
        x = np.pad(x, ((0, 0), (0, 0), (0, steps * width - length)), mode="edge")
    x = x.reshape(n, channels, steps, width).transpose(0, 2, 1, 3)
    return x.reshape(n, steps, channels * width)


def ucr_task(dataset: str | None = None, point_by_point: bool = False,
             step_width: int | None = None, val_fold: int | None = None) -> Task:
    """A bundled UCR/UEA set with its official train/test split; 20% of train (fixed,
    seeded) is held out for validation, as in the Spectral-RNN appendix. STEP_WIDTH: the
    points fed per step (``fold_series``; default the appendix's n_i). VAL_FOLD: which of
    the training split's disjoint 20% blocks validates (default 0, the appendix's split;
    a recipe search scores every fold: cross-validation on the training split)."""
    from sktime.datasets import load_from_tsfile

    available = ucr_datasets()
    if dataset is None:
        raise ValueError(f"task 'ucr' needs --dataset NAME (dataset), one of: "
                         f"{', '.join(available)}")
    if dataset not in available:
        raise ValueError(f"dataset must be one of the UCR/UEA sets bundled with sktime: "
                         f"{', '.join(available)}; got {dataset!r}")
    if step_width is not None and (point_by_point or isinstance(step_width, bool)
                                   or not isinstance(step_width, int) or step_width < 1):
        raise ValueError(f"step_width must be a positive integer, and not with point_by_point "
                         f"(which is step_width 1); got {step_width!r}"
                         + (" with point_by_point" if point_by_point else ""))
    root = sktime_data() / dataset
    arrays = {}
    for part in ("TRAIN", "TEST"):
        x, y = load_from_tsfile(str(root / f"{dataset}_{part}.ts"), return_data_type="numpy3D")
        arrays[part] = (np.asarray(x, dtype=np.float32), np.asarray(y).astype(str))
    labels = sorted({str(v) for part in arrays.values() for v in part[1]})
    index = {label: i for i, label in enumerate(labels)}

    def split(part):
        x, y = arrays[part]
        if step_width is not None and step_width > x.shape[-1]:
            raise ValueError(f"step_width must be at most the series' length "
                             f"{x.shape[-1]}; got {step_width}")
        return Split(torch.tensor(fold_series(x, point_by_point, step_width)),
                     torch.tensor([index[v] for v in y]))
    train_all, test = split("TRAIN"), split("TEST")
    folds = ucr_folds(len(train_all))
    if val_fold is not None and (isinstance(val_fold, bool) or not isinstance(val_fold, int)
                                 or not 0 <= val_fold < folds):
        raise ValueError(f"val_fold must be an integer from 0 to {folds - 1} ({dataset}'s "
                         f"training split holds {folds} validation blocks); got {val_fold!r}")
    train, val = ucr_holdout(len(train_all), val_fold or 0)
    return classification("ucr", train_all.take(train), train_all.take(val),
                           test, labels, {"dataset": dataset, "point_by_point": point_by_point,
                            "step_width": step_width, "val_fold": val_fold})


def series_count(path: Path) -> int:
    """Series in a .ts file: the non-empty lines after @data."""
    lines = path.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().lower() == "@data")
    return sum(1 for line in lines[start + 1:] if line.strip() and not line.startswith("#"))
