"""What a run measures: the task's loss, the metrics of a fixed split, whether a
checkpoint improves on the kept one, and which checkpoint a run keeps (``--select``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data import Split, TokenStream, model_input
from .tasks import COPY_LENGTH, Task


def task_loss(kind: str, out: torch.Tensor, y: torch.Tensor,
              scored_steps: int | None = None) -> torch.Tensor:
    """The task's loss; ``scored_steps`` (seq2seq): only the last that many steps count
    (the copy task's copied portion, DizzyRNN sec. 6; Task.scored_steps)."""
    if kind == "regress":
        return F.mse_loss(out, y)
    if kind == "classify":
        return F.cross_entropy(out, y)
    if scored_steps is not None:
        out, y = out[:, -scored_steps:], y[:, -scored_steps:]
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))  # seq2seq, lm


@torch.no_grad()
def evaluate(model, task: Task, data: Split | TokenStream, batch_size: int, device) -> dict:
    """Metrics of the task on a fixed split: loss and the task metric (and the copy
    task's accuracy on the copied symbols)."""
    model.eval()
    total, count, correct, copied = 0.0, 0, 0, 0
    if isinstance(data, TokenStream):
        state = None
        for x, y in data.windows():
            out, state = model(x.to(device), h0=state, return_state=True)
            total += F.cross_entropy(out.flatten(0, 1), y.to(device).flatten(),
                                     reduction="sum").item()
            count += y.numel()
        model.train()
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}
    for batch in data.batches(batch_size):
        x, y = model_input(batch.x, model, device), model_input(batch.y, model, device)
        lengths = None if batch.lengths is None else batch.lengths.to(device)
        out = model(x, lengths=lengths)
        total += task_loss(task.kind, out, y, task.scored_steps).item() * len(y)
        count += len(y)
        if task.kind == "classify":
            correct += (out.argmax(-1) == y).sum().item()
        elif task.kind == "seq2seq":
            copied += (out[:, -COPY_LENGTH:].argmax(-1) == y[:, -COPY_LENGTH:]).sum().item()
    model.train()
    metrics = {"loss": total / count}
    if task.kind == "classify":
        metrics["accuracy"] = correct / count
    elif task.kind == "regress":
        metrics["mse"] = metrics["loss"]
    elif task.kind == "seq2seq":
        metrics["cross_entropy"] = metrics["loss"]
        metrics["copy_accuracy"] = copied / (count * COPY_LENGTH)
    return metrics


def improves(candidate: tuple[float, float], best: tuple[float, float] | None,
             higher_is_better: bool) -> bool:
    """Whether (metric, validation loss) beats the kept model's: a better metric, or the
    same metric with a lower loss (ties are frequent on small validation sets)."""
    if best is None:
        return True
    if candidate[0] != best[0]:
        return candidate[0] > best[0] if higher_is_better else candidate[0] < best[0]
    return candidate[1] < best[1]


#: validation splits smaller than this cannot rank checkpoints: one series is 1/N of
#: accuracy (7 series on ArrowHead: steps of 0.14), so --select auto keeps the last one.
MIN_SELECT_SIZE = 50


def resolve_select(select: str, val) -> str:
    """'best' or 'last' for --select: auto is best unless the validation split is a fixed
    set of fewer than MIN_SELECT_SIZE sequences."""
    if select != "auto":
        return select
    if isinstance(val, Split) and len(val) < MIN_SELECT_SIZE:
        return "last"
    return "best"


def gate_values(model) -> dict:
    """The scalar gates a and b2 (sgornn, fastrnn), for metrics.jsonl."""
    gates = getattr(getattr(model, "layer", None), "gates", None)
    if gates is None:
        return {}
    with torch.no_grad():
        a, b2 = gates()
    return {"gate_a": a.item(), "gate_b2": b2.item()}
