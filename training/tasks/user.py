"""A user's classification data: an .npz with x, y and optional lengths and labels, or
several of them (``--data ORIGINAL --data CAPTURED``): each file is split on its own
(USER_SPLIT) and the splits are concatenated, the first file's rows first; every file must
agree on the feature size d and the class names. Provenance arrays a file may carry
(``orthornn capture dataset``'s ids, times, segments, versions) are not read here;
``provenance`` reads the segments for the lineage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from orthornn.export.artifacts.vocabulary import sidecar

from ..data import Split
from .task import Task, classification, split_fixed

USER_SPLIT = (0.8, 0.1)  # a user's .npz: train, validation; the test set is the rest


def load_npz(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list]:
    """A user's data: x [N, T, d] float (padded when ``lengths`` [N] is given), y [N]
    integer class ids, optional ``labels`` [C]."""
    x, y, lengths, labels, _ = _load(path)
    return x, y, lengths, labels


def _load(path: str | Path
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list, bool]:
    """load_npz, and whether the file named its classes (an array ``labels``)."""
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
            labels, "labels" in arrays)


def data_files(data: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The data option as a list of paths (one value, or several)."""
    if data is None:
        return []
    return [str(data)] if isinstance(data, str | Path) else [str(p) for p in data]


def _padded(split: Split, steps: int) -> Split:
    """split with x zero-padded to ``steps`` steps and explicit lengths."""
    n, t = split.x.shape[:2]
    lengths = split.lengths if split.lengths is not None else torch.full((n,), t, dtype=torch.long)
    x = split.x if t == steps else torch.cat(
        [split.x, split.x.new_zeros(n, steps - t, split.x.shape[2])], dim=1)
    return Split(x, split.y, lengths)


def concatenate(splits: list[Split]) -> Split:
    """One split of several, in order: x padded to the longest, lengths kept (or made) when
    the step counts differ or any split has them."""
    if len(splits) == 1:
        return splits[0]
    steps = max(s.x.shape[1] for s in splits)
    if all(s.lengths is None and s.x.shape[1] == steps for s in splits):
        return Split(torch.cat([s.x for s in splits]), torch.cat([s.y for s in splits]))
    padded = [_padded(s, steps) for s in splits]
    return Split(torch.cat([s.x for s in padded]), torch.cat([s.y for s in padded]),
                 torch.cat([s.lengths for s in padded]))  # type: ignore[misc]


def user_task(data: str | list[str] | None = None, data_mix: float | None = None) -> Task:
    paths = data_files(data)
    if not paths:
        raise ValueError("task 'classify' needs --data FILE (an .npz with x and y)")
    parts: list[tuple[Split, Split, Split]] = []
    labels: list[str] = []
    for i, path in enumerate(paths):
        x, y, lengths, named, explicit = _load(path)
        if i == 0:
            labels, d = named, x.shape[2]
        else:
            if x.shape[2] != d:
                raise ValueError(f"data {path!r}: feature size d = {x.shape[2]} differs from "
                                 f"{paths[0]!r}'s d = {d}; every --data file must agree")
            if explicit and named != labels:
                raise ValueError(f"data {path!r}: class names {named} differ from "
                                 f"{paths[0]!r}'s {labels}; every --data file must agree")
            if int(y.max()) >= len(labels):
                raise ValueError(f"data {path!r}: class id {int(y.max())} is outside "
                                 f"{paths[0]!r}'s {len(labels)} classes")
        parts.append(split_fixed(x, y, USER_SPLIT, lengths))
    train, val, test = (concatenate([p[k] for p in parts]) for k in range(3))
    options: dict = {"data": str(data) if isinstance(data, str | Path) else paths}
    if data_mix is not None:
        options["data_mix"] = float(data_mix)
    task = classification("classify", train, val, test, labels, options)
    if len(paths) > 1:
        task.train_parts = [len(p[0]) for p in parts]
        task.test_parts = [len(p[2]) for p in parts]
    return task


def provenance(files: str | list[str] | None) -> dict | None:
    """What a run learned from labelled captures, for the lineage: the capture segments
    (paths relative to the capture folder) of every data file that ``orthornn capture
    dataset`` wrote (an .npz's ``segments`` array, a text corpus's sidecar FILE.json), and
    how many labelled sequences those files hold. None when no file has segments."""
    segments: set[str] = set()
    labelled, found = 0, False
    for path in data_files(files):
        captured = _captured(path)
        if captured is not None:
            segments.update(captured[0])
            labelled += captured[1]
            found = True
    if not found:
        return None
    return {"segments": sorted(segments), "labels": labelled}


def _captured(path: str) -> tuple[list[str], int] | None:
    """(segments, labelled sequences) of a file from captures; None for another file (the
    data itself is checked where it is loaded)."""
    side = sidecar(path)
    try:
        if side.is_file():  # a text corpus's provenance
            value = json.loads(side.read_text())
            return [str(s) for s in value["segments"]], len(value["ids"])
        with np.load(path, allow_pickle=False) as f:
            if "segments" not in f.files:
                return None
            return [str(s) for s in f["segments"]], len(f["y"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
