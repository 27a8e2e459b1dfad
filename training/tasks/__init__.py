"""The papers' tasks, all offline, one module per data family: generated (adding, copy),
bundled data sets (digits, permuted-digits, mnist1d), ucr, language modelling (lm) and a
user's .npz (classify).

``make_task(name, **options)`` returns a ``Task``: what the model must be built for
(kind, input size, outputs), the data (a training source and fixed validation and
test sets), the metric and the task's baseline.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import TASK_NAMES
from .bundled import (
    DIGITS_COUNT,
    DIGITS_SPLIT,
    MNIST1D_COUNT,
    MNIST1D_VAL,
    digits_task,
    mnist1d_task,
)
from .generated import (
    COPY_DATA,
    COPY_LENGTH,
    COPY_SYMBOLS,
    adding_batch,
    adding_task,
    copy_baseline,
    copy_batch,
    copy_task,
)
from .language import lm_task
from .task import SPLIT_SEED, Task, holdout, three_way
from .ucr import (
    fold_series,
    series_count,
    sktime_data,
    step_width,
    ucr_datasets,
    ucr_holdout,
    ucr_task,
)
from .user import USER_SPLIT, load_npz, user_task

__all__ = ["COPY_DATA", "COPY_LENGTH", "COPY_SYMBOLS", "SPLIT_SEED", "Task", "adding_batch",
           "copy_baseline", "copy_batch", "fold_series", "load_npz", "make_task",
           "step_width", "train_size", "ucr_datasets"]


def train_size(name: str, dataset: str | None = None, data: str | list[str] | None = None
               ) -> int | None:
    """Sequences in a fixed-data task's training split, without building the task (the
    presets cap their batch size with it): the task's own split run on its example count.
    None for generated tasks, lm and bad input (which make_task then reports)."""
    if name in ("digits", "permuted-digits"):
        return len(three_way(DIGITS_COUNT, DIGITS_SPLIT)[0])
    if name == "mnist1d":
        return len(holdout(MNIST1D_COUNT, MNIST1D_VAL)[0])
    if name == "ucr" and dataset in ucr_datasets():
        series = series_count(sktime_data() / dataset / f"{dataset}_TRAIN.ts")
        return len(ucr_holdout(series)[0])
    if name == "classify" and data is not None:
        total = 0
        for path in [data] if isinstance(data, str) else data:  # each file split on its own
            if not Path(path).is_file():
                return None
            try:
                with np.load(path, allow_pickle=False) as f:
                    total += len(three_way(len(f["y"]), USER_SPLIT)[0])
            except (OSError, ValueError, KeyError):
                return None
        return total
    return None


_BUILDERS = {
    "adding": (adding_task, ("seq_len",)),
    "copy": (copy_task, ("seq_len", "copy_loss", "copy_symbols")),
    "digits": (lambda: digits_task(False), ()),
    "permuted-digits": (lambda: digits_task(True), ()),
    "mnist1d": (mnist1d_task, ()),
    "ucr": (ucr_task, ("dataset", "point_by_point", "step_width", "val_fold")),
    "lm": (lm_task, ("corpus", "vocab_size", "bptt")),
    "classify": (user_task, ("data", "data_mix")),
}


def make_task(name: str, **options) -> Task:
    """Build a task; options a task does not take must be None (unset)."""
    if name not in _BUILDERS:
        raise ValueError(f"task must be one of {', '.join(TASK_NAMES)}; got {name!r}")
    builder, accepted = _BUILDERS[name]
    stray = sorted(k for k, v in options.items() if v is not None and k not in accepted)
    if stray:
        raise ValueError(f"option(s) {', '.join(stray)} do not apply to task {name!r}"
                         + (f" (it takes: {', '.join(accepted)})" if accepted else ""))
    return builder(**{k: v for k, v in options.items() if k in accepted and v is not None})
