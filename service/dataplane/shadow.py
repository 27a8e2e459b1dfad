"""Shadow runs of a rollout's candidate (``registry.rollouts``): after a request's answer
has been computed from the promoted version, the candidate runs on the same sequences in
a task of its own, and only the comparison is kept. The client's answer never waits for
it, and it is skipped (and counted) when the promoted version's queue already holds a full
batch."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import numpy as np
from orthornn.export.artifacts.scoring import log_softmax, softmax

from ..errors import NotFound, ServiceError
from ..registry.registry import ModelVersion, Registry
from ..registry.spec import ModelSpec

#: the request's sequences as a version takes them (its own input checks)
Sequences = Callable[[ModelSpec], list]

#: regression: the candidate "agrees" when within this share of the promoted value's size
REGRESS_AGREEMENT = 0.1


def compare(task: str, promoted: np.ndarray, candidate: np.ndarray) -> tuple[float, float]:
    """(agreement in [0, 1], difference) of one sequence's outputs (logits or values):
    classify: the same top-1 class, mean |p_candidate - p_promoted| over the classes;
    lm and seq2seq: the share of positions with the same top-1 token, mean KL(promoted ||
    candidate) per position; regress: |difference| within ``REGRESS_AGREEMENT`` of the
    promoted value's size, mean |difference|. ValueError: non-finite candidate outputs."""
    a, b = promoted.astype(np.float64), candidate.astype(np.float64)
    if not np.isfinite(b).all():
        raise ValueError("non-finite outputs")
    if task == "regress":
        difference = float(np.mean(np.abs(a - b)))
        scale = max(float(np.mean(np.abs(a))), 1e-3)
        return float(difference <= REGRESS_AGREEMENT * scale), difference
    if task == "classify":
        p, q = softmax(a), softmax(b)
        return float(p.argmax(-1) == q.argmax(-1)), float(np.mean(np.abs(p - q)))
    lp, lq = log_softmax(a), log_softmax(b)
    agreement = float(np.mean(lp.argmax(-1) == lq.argmax(-1)))
    return agreement, float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


class Shadows:
    def __init__(self, registry: Registry):
        self.registry = registry
        self.rollouts = registry.rollouts
        self._tasks: set[asyncio.Task] = set()  # running shadow runs (kept referenced)

    def after(self, mv: ModelVersion, make_sequences: Sequences, outputs: list[np.ndarray]) -> None:
        """Maybe shadow a request MV answered with OUTPUTS (one array per sequence);
        ``make_sequences(spec)`` gives its sequences as the candidate takes them (checked
        against the candidate's own input spec: a refusal is a candidate failure)."""
        candidate = self.rollouts.shadow_of(mv.name, mv.version)
        if candidate is None:
            return
        batcher = mv.batcher
        if batcher.pending >= batcher.max_batch_size:  # busy: the client's work comes first
            self.rollouts.skipped(mv.name)
            return
        task = asyncio.get_running_loop().create_task(
            self._run(mv.name, mv.spec.task, candidate, make_sequences, outputs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, name: str, task: str, candidate: int, make_sequences: Sequences,
                   outputs: list[np.ndarray]) -> None:
        try:
            cmv = self.registry.acquire(name, candidate)
        except NotFound:  # not loaded on this replica yet
            return
        try:
            start = time.perf_counter()
            try:
                seqs = make_sequences(cmv.spec)
                rows = await cmv.batcher.submit(
                    seqs, lambda rows: [r[cmv.spec.output_name] for r in rows])
            except ServiceError as error:
                if error.status == 429 or error.status == 503:  # its queue is full: skipped
                    self.rollouts.skipped(name)
                else:
                    self.rollouts.shadow_failed(name)
                return
            except Exception:  # the candidate failed to run
                self.rollouts.shadow_failed(name)
                return
            self.rollouts.time(name, candidate, time.perf_counter() - start)
            for promoted_out, candidate_out in zip(outputs, rows, strict=True):
                try:
                    agreement, difference = compare(task, promoted_out, candidate_out)
                except ValueError:
                    self.rollouts.shadow_failed(name)
                    return
                self.rollouts.compared(name, agreement, difference)
        finally:
            self.registry.release(cmv)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
