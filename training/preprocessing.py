"""How a task's inputs were preprocessed, recorded in the run's config.json (the export
copies it into the package manifest): the transform from raw values to the model's
inputs, and per-feature statistics of the model's inputs over the training set (padded
steps excluded; generated tasks: a fixed sample of their generator). The service uses
the statistics to notice inputs far outside what the model was trained on."""

from __future__ import annotations

import torch

from .tasks import Task

GENERATED_SAMPLE = 1024
SAMPLE_SEED = 4242


def _rounded(values: torch.Tensor) -> list[float]:
    return [float(f"{v:.6g}") for v in values.tolist()]


def input_statistics(task: Task) -> dict | None:
    """Per-feature count, mean, std, min and max of the model inputs seen in training
    (None for token inputs)."""
    if task.kind == "lm":
        return None
    if task.sample is not None:
        split = task.sample(GENERATED_SAMPLE, torch.Generator().manual_seed(SAMPLE_SEED))
        source = f"{GENERATED_SAMPLE} generated training sequences"
    else:
        split = task.train
        source = f"training set ({len(split)} sequences)"
    x = split.x.float()
    if split.lengths is not None:
        mask = torch.arange(x.shape[1])[None, :] < split.lengths[:, None]
        values = x[mask]
    else:
        values = x.reshape(-1, x.shape[-1])
    values = values.double()
    return {"source": source, "count": int(values.shape[0]),
            "mean": _rounded(values.mean(0)), "std": _rounded(values.std(0, correction=0)),
            "min": _rounded(values.amin(0)), "max": _rounded(values.amax(0))}


def input_preprocessing(task: Task) -> dict | None:
    """{"transform": ... or None, "training_range": statistics}; None for token inputs."""
    stats = input_statistics(task)
    if stats is None:
        return None
    return {"transform": task.transform, "training_range": stats}
