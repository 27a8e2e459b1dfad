"""The drift reference of a package (``export.artifacts.loop.drift``), computed at export from
the run's validation split through the exported graph with onnxruntime, as the service
runs it: each validation sequence alone from the zero state (a language model's
validation stream cut into windows of the training length), its summaries, then the
calibration of the tests' thresholds. A version gated on captured traffic (``--gate-data``:
the newest labelled slice of what it will serve) adds that slice's sequences, so that
once it is promoted the monitor is calm on the traffic it adapted to, and alarms on the
next shift (issue 60, step 5)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..artifacts import package
from ..artifacts.loop import drift

if TYPE_CHECKING:
    import onnxruntime as ort
    from orthornn.training.tasks import Task


def validation_sequences(task: Task) -> list[np.ndarray]:
    """The validation split as the service would receive it: float sequences [T, d] cut
    to their lengths, or token-id rows of the language model's validation windows."""
    return split_sequences(task.val)


def split_sequences(data: Any) -> list[np.ndarray]:
    """A split (or a language model's token stream) as the service would receive it."""
    from orthornn.training.data import TokenStream

    if isinstance(data, TokenStream):
        return [row.astype(np.int64) for x, _ in data.windows() for row in x.numpy()]
    x = data.x.numpy().astype(np.float32)
    lengths = (np.full(len(x), x.shape[1]) if data.lengths is None
               else data.lengths.numpy())
    return [x[i, : int(n)] for i, n in enumerate(lengths)]


def build_reference(sess: ort.InferenceSession, task: Task, state_size: int,
                    captured: Task | None = None, **options: int | float) -> drift.Reference:
    """The package's drift reference from TASK's validation split through SESS (the
    exported full graph), and CAPTURED's test split (the captured slice the version was
    gated on) beside it; ValueError when there are too few sequences."""
    sequences = validation_sequences(task)
    split = "validation"
    if captured is not None:
        sequences += split_sequences(captured.test)
        split = "validation+gate_data"
    outputs, states = drift.run_graph(sess, package.output_name(task.kind), sequences)
    token_ids = None
    if task.kind == "lm":  # the most frequent tokens of the split, each counted apart
        counts = np.bincount(np.concatenate(sequences), minlength=task.input_size)
        token_ids = np.argsort(-counts, kind="stable")[: drift.TOKEN_BINS].astype(np.int64)
    projection = drift.projection_matrix(state_size)
    summaries = drift.summarize(task.kind, sequences, outputs, states, projection, token_ids)
    return drift.build(task.kind, summaries, projection, task.num_outputs, token_ids,
                       split=split, **options)  # type: ignore[arg-type]
