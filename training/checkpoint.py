"""Run directories: what training writes and what export reads.

    RUN_DIR/model.safetensors   the best model by validation metric
    RUN_DIR/config.json         everything needed to rebuild the model and its data
    RUN_DIR/vocab.txt           language models: one token per line
    RUN_DIR/summary.json        final test metrics, parameter count, wall time
    RUN_DIR/metrics.jsonl       the training log
    RUN_DIR/last.safetensors + trainer_state.pt   what --resume continues from

Every file is written by ``export.artifacts.records.atomic_write`` (a temporary name in
RUN_DIR, fsynced, renamed into place), so a reader never sees a half-written file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from orthornn.export.artifacts.records import atomic_write, write_json
from orthornn.models import build_model
from safetensors.torch import load_file, save_file

FORMAT = "orthornn-run/1"


__all__ = ["atomic_write", "write_json"]  # the run's writers, re-exported


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def save_weights(path: Path, model: torch.nn.Module) -> None:
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    atomic_write(path, lambda tmp: save_file(state, tmp, metadata={"format": FORMAT}))


def load_weights(path: Path, device: str = "cpu") -> dict:
    return load_file(path, device=device)


def save_torch(path: Path, obj) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def read_run_config(run_dir: str | Path) -> dict:
    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} is not a run directory (no config.json)")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an orthornn run config (format {FORMAT})")
    return config


def build_from_config(config: dict) -> torch.nn.Module:
    spec = dict(config["model"])
    options = spec.pop("options")
    return build_model(spec.pop("arch"), spec.pop("task"), **spec, **options)


def load_model(run_dir: str | Path, weights: str = "model.safetensors"):
    """(model in eval mode, run config) rebuilt from a run directory."""
    run_dir = Path(run_dir)
    config = read_run_config(run_dir)
    model = build_from_config(config)
    path = run_dir / weights
    if not path.is_file():
        raise ValueError(f"{str(run_dir)!r} has no {weights}")
    model.load_state_dict(load_weights(path))
    return model.eval(), config


def read_vocabulary(run_dir: str | Path, config: dict) -> list[str] | None:
    name = config.get("vocabulary_file")
    if not name:
        return None
    return (Path(run_dir) / name).read_text().split("\n")[:-1]
