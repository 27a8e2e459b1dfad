"""The batchers of each loaded model version, attached by the registry's hooks (as MLServer
attaches adaptive batching when a model loads): the app passes ``Batching.attach`` as
``on_load`` and ``Batching.close`` as ``on_release``. The registry neither builds a
batcher nor knows what the answers need.

A version gets a batcher for its "model" graph, whose batch-level prepare step is
/predict's one softmax over the classify rows of a batch (``outputs.prepare_rows``, on the
rows of the requests that ask for it: ``submit(prepare=True)``), and one for its "steps"
graph (per-step outputs) when the package has it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor

from ..metrics import Metrics
from ..registry.batcher import Batcher
from ..registry.registry import ModelVersion
from ..settings import Settings
from ..tracing import open_tracing
from .outputs import prepare_rows


class Batching:
    def __init__(self, settings: Settings, metrics: Metrics, executor: Executor):
        self.settings = settings
        self.metrics = metrics
        self.executor = executor  # the inference threads, shared by every model
        # tracing on: the queue and inference spans (ValueError when the extra is missing)
        self.tracer = open_tracing(settings.tracing)

    def attach(self, mv: ModelVersion) -> None:
        """The on_load hook: MV's batchers (in the loading thread)."""
        runtime, spec, s = mv.runtime, mv.spec, self.settings

        def batcher(graph: str, prepare: Callable[[list[dict]], None] | None = None
                    ) -> Batcher:
            b = Batcher(lambda seqs: runtime.run_padded(spec, seqs, graph), self.executor,
                        max_batch_size=s.max_batch_size,
                        max_queue_delay_ms=s.max_queue_delay_ms,
                        max_queue_size=s.max_queue_size, workers=s.inference_workers,
                        enabled=s.batching, metrics=self.metrics, model=mv.name,
                        prepare=prepare, tracer=self.tracer)
            b.holders = mv.on_the_way  # a batch waits only for requests on their way
            return b
        mv.batcher = batcher("model", lambda rows: prepare_rows(spec, rows))
        if "steps" in runtime.inference_sessions:
            mv.steps_batcher = batcher("steps")

    @staticmethod
    async def close(mv: ModelVersion) -> None:
        """The on_release hook: wait until MV's batchers run nothing more (event loop)."""
        for b in mv.batchers:
            await b.close()
