"""The drift reference of a package (``export.artifacts.loop.drift``), computed at export from
the run's validation split through the exported graph with onnxruntime, as the service
runs it: each validation sequence alone from the zero state (a language model's
validation stream cut into windows of the training length), its summaries, then the
calibration of the tests' thresholds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..artifacts import package
from ..artifacts.loop import drift

if TYPE_CHECKING:
    import onnxruntime as ort
    from orthornn.training.tasks import Task


def validation_sequences(task: Task) -> list[np.ndarray]:
    """The validation split as the service would receive it: float sequences [T, d] cut
    to their lengths, or token-id rows of the language model's validation windows."""
    from orthornn.training.data import TokenStream

    data = task.val
    if isinstance(data, TokenStream):
        return [row.astype(np.int64) for x, _ in data.windows() for row in x.numpy()]
    x = data.x.numpy().astype(np.float32)
    lengths = (np.full(len(x), x.shape[1]) if data.lengths is None
               else data.lengths.numpy())
    return [x[i, : int(n)] for i, n in enumerate(lengths)]


def build_reference(sess: ort.InferenceSession, task: Task, state_size: int,
                    **options: int | float) -> drift.Reference:
    """The package's drift reference from TASK's validation split through SESS (the
    exported full graph); ValueError when the split is too small."""
    sequences = validation_sequences(task)
    outputs, states = drift.run_graph(sess, package.output_name(task.kind), sequences)
    token_ids = None
    if task.kind == "lm":  # the most frequent tokens of the split, each counted apart
        counts = np.bincount(np.concatenate(sequences), minlength=task.input_size)
        token_ids = np.argsort(-counts, kind="stable")[: drift.TOKEN_BINS].astype(np.int64)
    projection = drift.projection_matrix(state_size)
    summaries = drift.summarize(task.kind, sequences, outputs, states, projection, token_ids)
    return drift.build(task.kind, summaries, projection, task.num_outputs, token_ids,
                       **options)  # type: ignore[arg-type]
