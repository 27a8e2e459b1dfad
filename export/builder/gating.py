"""The gate of ``export --gate`` on a candidate's evaluation (the rules themselves:
``export.artifacts.gate``): the threshold (--min-metric or the task's baseline), the
promoted version scored on the same test split through its own graph, and with
--gate-data the same on the held-out captured slice (--require-better-on-gate-data: better
by the margin)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..artifacts import gate, package
from . import evaluation

if TYPE_CHECKING:
    from orthornn.training.tasks import Task


def _threshold(min_metric: float | None, config: dict) -> gate.Threshold | None:
    """--min-metric, else the run's task baseline (a model must beat the trivial one)."""
    if min_metric is not None:
        return gate.Threshold(float(min_metric), "--min-metric", strict=False)
    if config.get("baseline") is not None:
        return gate.Threshold(float(config["baseline"]), "the task's baseline", strict=True)
    return None


def _gate(record: dict, task: Task | None, absent: str | None, config: dict, model_dir: Path,
          parent: int | None, min_metric: float | None, tolerance: float) -> str:
    """Why the candidate is refused ('' if it passes): the gate's rules on its evaluation
    and on the promoted version's, scored on the same test split."""
    if task is None:
        return f"no evaluation to gate on: {absent}"
    incumbent = _incumbent(model_dir, parent, evaluation.original(task))
    refusal = gate.check(record["metric"], record["higher_is_better"], record["value"],
                         _threshold(min_metric, config), incumbent, tolerance)
    split = "the original test split" if task.test_parts else "the test split"
    return f"on {split}: {refusal}" if refusal and record.get("splits") else refusal


def _incumbent(model_dir: Path, parent: int | None, task: Task) -> tuple[int, float] | None:
    """(version, score) of the promoted version on ``task``'s test split, through its graph."""
    if parent is None:
        return None
    try:
        return parent, evaluation.score(model_dir / str(parent), task)
    except (ValueError, package.PackageError) as error:
        raise ValueError(f"cannot compare with promoted version {parent}: {error}") from None


def _gate_on_held(record: dict, held: Task, model_dir: Path, parent: int | None,
                  tolerance: float, require_better: bool, margin: float) -> tuple[str, dict]:
    """The gate on the held-out captured slice (--gate-data): (why refused or '', what was
    compared, for the evaluation's "gate" record)."""
    value = record["splits"]["gate_data"]["value"]
    incumbent = _incumbent(model_dir, parent, held)
    metric, higher = record["metric"], record["higher_is_better"]
    refusal = gate.check(metric, higher, value, None, incumbent, tolerance)
    if not refusal and require_better:
        refusal = gate.check_better(metric, higher, value, incumbent, margin)
    where = f"on the held-out captured slice (--gate-data {record['splits']['gate_data']['file']})"
    outcome = {"candidate": value, "incumbent": None if incumbent is None else incumbent[1],
               "require_better": require_better, "margin": margin if require_better else None}
    return (f"{where}: {refusal}" if refusal else ""), outcome


def judge(record: dict, task: Task | None, absent: str | None, config: dict, model_dir: Path,
          parent: int | None, held: Task | None, min_metric: float | None, tolerance: float,
          require_better: bool, margin: float) -> tuple[str, dict]:
    """(why the candidate is refused or '', its evaluation RECORD with the passed gate
    recorded in it: what ``orthornn rollout start`` checks)."""
    refusal = _gate(record, task, absent, config, model_dir, parent, min_metric, tolerance)
    outcome: dict = {"passed": True, "against": parent}
    if not refusal and held is not None:
        refusal, outcome["gate_data"] = _gate_on_held(
            record, held, model_dir, parent, tolerance, require_better, margin)
    return refusal, (record if refusal else {**record, "gate": outcome})
