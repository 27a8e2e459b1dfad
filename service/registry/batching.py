"""The batchers of each loaded model version, attached by the registry's hooks (as MLServer
attaches adaptive batching when a model loads): the app passes ``Batching.attach`` as
``on_load`` and ``Batching.close`` as ``on_release``.

A version gets a batcher for its "model" graph, whose batch-level prepare step
(``prepare_rows``: one softmax over the classify rows of a batch, one log-softmax per
language-model row, in the inference thread) runs on the rows of the requests that ask for
it (``ModelVersion.infer(probabilities=True)``), and one for its "steps" graph (per-step
outputs) when the package has it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from functools import partial
from typing import Any, Protocol

import numpy as np
from orthornn.export.artifacts.scoring import log_softmax, softmax

from ..metrics import Metrics
from ..settings import Settings
from ..tracing import open_tracing
from .batcher import Batcher
from .catalog import ModelVersion
from .spec import ModelSpec

#: added to a row by prepare_rows: a classify row's probabilities (a list) and most likely
#: class; a language model's log-probabilities of every step's next token [T, V]
PROBABILITIES, INDEX, LOG_PROBABILITIES = "_probabilities", "_index", "_log_probabilities"


def prepare_rows(spec: ModelSpec, rows: list[dict]) -> None:
    """Once per batch, in the inference thread: every classify row's probabilities and most
    likely class, from one softmax over the batch instead of one per row; every language
    model row's log-probabilities (the heavy part of its answer, kept off the event loop)."""
    if not rows:
        return
    if spec.task == "classify":
        p = softmax(np.stack([r[spec.output_name] for r in rows]).astype(np.float64))
        for row, probabilities, index in zip(rows, p.tolist(), p.argmax(axis=-1).tolist(),
                                             strict=True):
            row[PROBABILITIES], row[INDEX] = probabilities, index
    elif spec.task == "lm":
        for row in rows:
            row[LOG_PROBABILITIES] = log_softmax(row[spec.output_name].astype(np.float64))


class Recorder(Protocol):
    """Capture, as the batchers see it (``service.loop.capture.Capture``)."""

    def recorder(self, spec: ModelSpec, model: str, version: int, graph: str, timed: bool
                 ) -> Callable[[list[Any]], None]: ...


class Batching:
    def __init__(self, settings: Settings, metrics: Metrics, executor: Executor,
                 capture: Recorder | None = None):
        self.settings = settings
        self.metrics = metrics
        self.executor = executor  # the inference threads, shared by every model
        self.capture = capture  # on: each batcher records its batches' sampled requests
        # tracing on: the queue and inference spans (ValueError when the extra is missing)
        self.tracer = open_tracing(settings.tracing)

    def attach(self, mv: ModelVersion) -> None:
        """The on_load hook: MV's batchers (in the loading thread)."""
        runtime, spec, s = mv.runtime, mv.spec, self.settings

        def batcher(graph: str, prepare: bool) -> Batcher:
            b = Batcher(partial(runtime.run_padded, spec, graph=graph), self.executor,
                        max_batch_size=s.max_batch_size,
                        max_queue_delay_ms=s.max_queue_delay_ms,
                        max_queue_size=s.max_queue_size, workers=s.inference_workers,
                        enabled=s.batching, metrics=self.metrics, model=mv.name,
                        prepare=partial(prepare_rows, spec) if prepare else None,
                        tracer=self.tracer,
                        record=None if self.capture is None else self.capture.recorder(
                            spec, mv.name, mv.version, graph,
                            spec.output_name in runtime.per_step[graph]),
                        # the per-step outputs of a sequence's step, when the graph has any
                        step_bytes=4 * spec.output_size if runtime.per_step[graph] else 0,
                        max_output_bytes=s.max_lm_output_bytes)
            b.holders = mv.on_the_way  # a batch waits only for requests on their way
            return b
        mv.batcher = batcher("model", prepare=True)
        if "steps" in runtime.inference_sessions:
            mv.steps_batcher = batcher("steps", prepare=False)

    @staticmethod
    async def close(mv: ModelVersion) -> None:
        """The on_release hook: wait until MV's batchers run nothing more (event loop)."""
        for b in mv.batchers:
            await b.close()
