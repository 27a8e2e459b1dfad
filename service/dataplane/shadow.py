"""Shadow runs of a rollout's candidate (``registry.rollouts``): after a request's answer
has been computed from the promoted version, the candidate runs on the same sequences in
a task of its own, and only the comparison is kept. The client's answer never waits for
it, and it is skipped (and counted) when the promoted version's queue already holds a full
batch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from orthornn.export.artifacts.scoring import log_softmax, softmax

from .. import request
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


@dataclass
class _Work:
    """One shadowed request: its sequences as a version takes them, and what the
    promoted version answered (one array per sequence)."""

    make_sequences: Sequences
    outputs: list[np.ndarray]


class Shadows:
    """Shadow work is gathered per candidate into batches of up to ``max_batch_size``
    sequences, sent at most ``WINDOW_S`` after the first: a shadow answer is never
    awaited, so it can wait for a full batch, where a run per request would cost an
    onnxruntime call each."""

    WINDOW_S = 0.05

    def __init__(self, registry: Registry):
        self.registry = registry
        self.rollouts = registry.rollouts
        self._tasks: set[asyncio.Task] = set()  # running shadow runs (kept referenced)
        self._gathered: dict[tuple[str, str, int], list[_Work]] = {}  # (model, task, candidate)
        self._timers: dict[tuple[str, str, int], asyncio.TimerHandle] = {}

    def after(self, mv: ModelVersion, make_sequences: Sequences,
              outputs: list[np.ndarray]) -> None:
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
        key = (mv.name, mv.spec.task, candidate)
        gathered = self._gathered.setdefault(key, [])
        gathered.append(_Work(make_sequences, outputs))
        if sum(len(w.outputs) for w in gathered) >= batcher.max_batch_size:
            self._send(key)
        elif key not in self._timers:
            self._timers[key] = asyncio.get_running_loop().call_later(
                self.WINDOW_S, self._send, key)

    def _send(self, key: tuple[str, str, int]) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        work = self._gathered.pop(key, [])
        if work:
            task = asyncio.get_running_loop().create_task(self._run(*key, work))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, name: str, task: str, candidate: int, work: list[_Work]) -> None:
        with request.opened():  # a scope of its own: the candidate is not the request's
            await self._shadow(name, task, candidate, work)

    async def _shadow(self, name: str, task: str, candidate: int, work: list[_Work]) -> None:
        try:
            cmv = self.registry.acquire(name, candidate)
        except NotFound:  # not loaded on this replica yet
            return
        try:
            seqs, taken = [], []
            for w in work:
                try:
                    mine = w.make_sequences(cmv.spec)
                except ServiceError:  # the candidate refuses this input
                    self.rollouts.shadow_failed(name)
                    continue
                seqs += mine
                taken.append(w)
            if not seqs:
                return
            try:
                rows = await cmv.infer(seqs)
            except ServiceError as error:
                for _ in taken:
                    if error.status in (429, 503):  # its queue is full: skipped
                        self.rollouts.skipped(name)
                    else:
                        self.rollouts.shadow_failed(name)
                return
            except Exception:  # the candidate failed to run
                for _ in taken:
                    self.rollouts.shadow_failed(name)
                return
            seconds = request.current().compute_s or 0.0
            at = 0
            for w in taken:
                mine = [r[cmv.spec.output_name] for r in rows[at:at + len(w.outputs)]]
                at += len(w.outputs)
                self.rollouts.time(name, candidate, seconds)
                try:
                    compared = [compare(task, p, c)
                                for p, c in zip(w.outputs, mine, strict=True)]
                except ValueError:
                    self.rollouts.shadow_failed(name)
                    continue
                for agreement, difference in compared:
                    self.rollouts.compared(name, agreement, difference)
        finally:
            self.registry.release(cmv)

    async def close(self) -> None:
        for key in list(self._timers):
            self._timers.pop(key).cancel()
        self._gathered.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
