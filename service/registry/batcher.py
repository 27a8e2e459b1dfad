"""Dynamic batching for one model version (the reasoning: docs/design.md, "Dynamic
batching")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import QueueFull
from ..metrics import Metrics
from ..tracing import Tracer

log = logging.getLogger("orthornn.service")


@dataclass
class _Item:
    sequences: list[np.ndarray]
    future: asyncio.Future
    prepare: bool = False  # its rows go through the batcher's prepare step
    enqueued: float = field(default_factory=time.perf_counter)
    context: Any = None  # tracing on: the request's context (its span), for its spans
    tag: Any = None  # capture samples it: its part in the batch's record (the recorder's)


def groups(lengths: list[int], max_batch_size: int, step_bytes: int = 0,
           max_output_bytes: int = 0) -> list[list[int]]:
    """Indices grouped for padded runs: by length (longest first), at most max_batch_size
    per group, the longest sequence of a group at most twice its shortest, and (with
    STEP_BYTES, the per-step outputs a sequence's step makes) a group's padded outputs
    (B x T x STEP_BYTES) within MAX_OUTPUT_BYTES (one sequence always: its request was
    checked against the same budget)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < max_batch_size and lengths[out[-1][0]] <= 2 * lengths[i] \
                and not (max_output_bytes and (len(out[-1]) + 1) * lengths[out[-1][0]]
                         * step_bytes > max_output_bytes):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def output_bytes(sequences: list[np.ndarray], step_bytes: int) -> int:
    """The per-step outputs SEQUENCES make, padded to their longest (as their request's
    budget check counts them)."""
    return len(sequences) * max(len(s) for s in sequences) * step_bytes if step_bytes else 0


class Batcher:
    def __init__(self, run: Callable[[list[np.ndarray]], list[dict]], executor: Executor, *,
                 max_batch_size: int, max_queue_delay_ms: float, max_queue_size: int,
                 workers: int, enabled: bool = True, metrics: Metrics | None = None,
                 model: str = "",
                 prepare: Callable[[list[dict]], None] | None = None,
                 tracer: Tracer | None = None,
                 record: Callable[[list[tuple[Any, list, list[dict], float]]], None] | None
                 = None, step_bytes: int = 0, max_output_bytes: int = 0):
        self.run = run
        # a batch's per-step outputs are bounded like a request's (max_lm_output_bytes):
        # requests within it one by one were batched into gigabytes (16 of 61 MiB: +3.9 GiB)
        self.step_bytes, self.max_output_bytes = step_bytes, max_output_bytes
        # capture on: the batch's tagged requests (tag, sequences, rows, compute seconds),
        # written in the inference thread before their answers go back
        self.record = record
        self.tracer = tracer  # None: tracing off
        self.prepare = prepare  # once per batch, on the rows of submit(prepare=True)
        self.executor = executor
        self.enabled = enabled
        # batching off: one request per run (its own sequences still run together)
        self.max_batch_size = max_batch_size if enabled else 1 << 30
        self.delay = max_queue_delay_ms / 1000 if enabled else 0.0
        self.max_queue_size = max_queue_size
        self.metrics = metrics
        self.model = model
        if metrics is not None:  # label children looked up once, not per request
            self._depth = metrics.queue_depth.labels(model)
            self._queue_hist = metrics.queue_duration.labels(model)
            self._inference_hist = metrics.inference_duration.labels(model)
            self._batch_hist = metrics.batch_size.labels(model)
        self._workers = workers
        self._lock = threading.Lock()  # guards _queue, pending and _jobs (loop and threads)
        self._queue: deque[_Item] = deque()
        self.pending = 0  # sequences queued and not yet taken into a batch
        self._jobs = 0  # drain jobs submitted to the executor and not finished
        # event loop only:
        self._idle = asyncio.Event()  # no job running (close() waits for it)
        self._idle.set()
        self._timer: asyncio.TimerHandle | None = None  # the end of the first one's window
        self._submitted = 0  # requests inside submit(): queued, running or answered
        #: how many requests hold this model version and will submit (being parsed, or
        #: inside submit()); a batch waits for more only while one of them is on its way
        self.holders: Callable[[], int] | None = None

    async def submit(self, sequences: list[np.ndarray], *, prepare: bool = False,
                     tag: Any = None) -> list[dict]:
        """This request's output rows (one dict per sequence, in order). PREPARE: the
        batch's prepare step runs on them, once for the rows of all its requests that ask
        for it. TAG: the request is recorded with its batch (``record``)."""
        loop = asyncio.get_running_loop()
        item = _Item(sequences, loop.create_future(), prepare, tag=tag)
        if self.tracer is not None:
            item.context = self.tracer.context()
        with self._lock:
            if self.pending + len(sequences) > self.max_queue_size:
                raise QueueFull(f"the queue of model {self.model!r} is full "
                                f"({self.pending} sequences waiting); retry later")
            self._queue.append(item)
            self.pending += len(sequences)
        if self.metrics is not None:
            self._depth.inc(len(sequences))
        self._submitted += 1
        try:
            if not self._start_scheduled:  # at the end of this turn of the event loop
                self._start_scheduled = True
                loop.call_soon(self._scheduled_start, loop)
            ok, value = await item.future
        finally:
            self._submitted -= 1
        if not ok:
            raise value
        return value

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        """(Event loop.) Start drain jobs, one per batch queued, while worker slots are
        free and the queue should not wait: the batch is full, no other request is on its
        way, or the first waiting request's window is over (a timer comes back then).
        Waiting happens here, on the event loop, never in an inference thread."""
        with self._lock:
            if self._jobs >= self._workers or not self._queue:
                return
            if self.pending < self.max_batch_size and self.holders is not None \
                    and self.holders() > self._submitted:
                remaining = self._queue[0].enqueued + self.delay - time.perf_counter()
                if remaining > 0:
                    if self._timer is None:
                        self._timer = loop.call_later(remaining, self._window_over, loop)
                    return
            batches = -(-self.pending // self.max_batch_size) if self.enabled \
                else len(self._queue)
            starting = min(self._workers - self._jobs, max(batches, 1))
            self._jobs += starting
        self._idle.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for started in range(starting):
            try:
                self.executor.submit(self._drain, loop)
            except RuntimeError as error:  # the executor is shut down
                with self._lock:  # the slots of the jobs that did not start, bar this one
                    self._jobs -= starting - started - 1
                if started:  # a job runs, and finishes the queue in its own thread
                    with self._lock:
                        self._jobs -= 1
                else:  # nothing will run
                    self._drain_failed(error)
                return

    # Starting at the end of the event loop's turn, not at the first submit: the requests
    # read in one turn are parsed one after another, and a job started at the first of
    # them would take it nearly alone (the inference thread wakes within the 0.2 ms switch
    # interval), the others forming the next batches. On the harness's /predict at
    # concurrency 32 batches grew from 4 to 24 sequences, and served requests by half.
    _start_scheduled = False

    def _scheduled_start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._start_scheduled = False
        self._start(loop)

    def _window_over(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._start(loop)

    def _drain_failed(self, error: BaseException) -> None:
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
            taken, self.pending = self.pending, 0
            self._jobs -= 1
        if self.metrics is not None:
            self._depth.dec(taken)
        for item in items:
            if not item.future.done():
                item.future.set_result((False, error))
        self._job_done()

    # -- the inference threads --------------------------------------------------------

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """A job in the executor: run the next batch, then queue itself again behind the
        other models' jobs while requests wait (each model gets its turn on a thread).
        The requests that arrived while a batch ran form the next one at once."""
        while True:
            with self._lock:
                items = self._take()
                if not items:  # checked and counted under one lock: no request strands
                    self._jobs -= 1
                    break
            tracer = self.tracer
            started = time.perf_counter() if tracer is not None else 0.0
            try:
                self._observe_taken(items)
                outcomes = self._execute(items)
            except BaseException as error:  # answer everyone, then go on
                outcomes = [(False, error)] * len(items)
            if tracer is None:
                self._call(loop, self._deliver, items, outcomes)
            else:  # the spans after the answers are on their way
                ended = time.perf_counter()
                self._call(loop, self._deliver, items, outcomes)
                self._trace(tracer, items, outcomes, started, ended)
            try:
                self.executor.submit(self._drain, loop)
                return
            except RuntimeError:  # the executor is shutting down: finish the queue here
                continue
        self._call(loop, self._job_done)

    def _trace(self, tracer: Tracer, items: list[_Item], outcomes: list[tuple[bool, Any]],
               started: float, ended: float) -> None:
        """The queue and inference spans of a batch (a failure here never stops the job)."""
        try:
            tracer.batch(self.model,
                         [(item.context, item.enqueued, None if ok else value)
                          for item, (ok, value) in zip(items, outcomes, strict=True)],
                         sum(len(item.sequences) for item in items), started, ended)
        except Exception:
            log.exception("tracing: the spans of a batch of model %r failed", self.model)

    @staticmethod
    def _call(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any
              ) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for answers
            loop.call_soon_threadsafe(callback, *args)

    def _take(self) -> list[_Item]:
        """(Under the lock.) The next batch: queued requests, at most max_batch_size
        sequences and max_output_bytes of per-step outputs (the first request whatever its
        size)."""
        queue = self._queue
        items: list[_Item] = []
        count = size = 0
        budget, step = self.max_output_bytes, self.step_bytes
        while queue and (not items or (
                self.enabled and count + len(queue[0].sequences) <= self.max_batch_size
                and not (budget and size + output_bytes(queue[0].sequences, step) > budget))):
            item = queue.popleft()
            items.append(item)
            count += len(item.sequences)
            if budget:
                size += output_bytes(item.sequences, step)
        self.pending -= count
        return items

    def _observe_taken(self, items: list[_Item]) -> None:
        if self.metrics is not None:
            now = time.perf_counter()
            for item in items:
                self._depth.dec(len(item.sequences))
                self._queue_hist.observe(now - item.enqueued)

    def _execute(self, items: list[_Item]) -> list[tuple[bool, Any]]:
        """Run every sequence of the items in length groups, then the prepare step. Returns
        (ok, its rows or an exception) per item."""
        flat = [(k, j) for k, item in enumerate(items) for j in range(len(item.sequences))]
        seqs = [items[k].sequences[j] for k, j in flat]
        rows: list[dict | None] = [None] * len(seqs)
        failed: dict[int, BaseException] = {}
        for group in groups([len(s) for s in seqs], self.max_batch_size, self.step_bytes,
                            self.max_output_bytes):
            start = time.perf_counter()
            try:
                out = self.run([seqs[i] for i in group])
            except Exception as error:
                for i in group:
                    failed.setdefault(flat[i][0], error)
                continue
            if self.metrics is not None:
                self._inference_hist.observe(time.perf_counter() - start)
                self._batch_hist.observe(len(group))
            for i, row in zip(group, out, strict=True):
                rows[i] = row
        wanted = [r for (k, _), r in zip(flat, rows, strict=True)
                  if r is not None and items[k].prepare]
        if self.prepare is not None and wanted:
            self.prepare(wanted)
        outcomes: list[tuple[bool, Any]] = []
        offset = 0
        for k, item in enumerate(items):
            n = len(item.sequences)
            if k in failed:
                outcomes.append((False, failed[k]))
            else:  # a request that did not fail has every row filled
                outcomes.append((True, rows[offset:offset + n]))
            offset += n
        if self.record is not None:
            self._record(items, outcomes)
        return outcomes

    def _record(self, items: list[_Item], outcomes: list[tuple[bool, Any]]) -> None:
        """The batch's tagged requests that did not fail, to the recorder (which counts
        its own failures; one here never fails the batch). A request cancelled meanwhile
        (its client went away) is left out: it will not be answered. (Its future's state,
        read from this thread, can change just after: such a record precedes an answer
        never sent, as one does when the server is killed between the two.)"""
        now = time.perf_counter()
        captured = [(item.tag, item.sequences, value, now - item.enqueued)
                    for item, (ok, value) in zip(items, outcomes, strict=True)
                    if ok and item.tag is not None and not item.future.done()]
        if captured:
            try:
                self.record(captured)  # type: ignore[misc]
            except Exception:
                log.exception("capture: the record of a batch of model %r failed", self.model)

    # -- back on the event loop -------------------------------------------------------

    @staticmethod
    def _deliver(items: list[_Item], outcomes: list[tuple[bool, Any]]) -> None:
        for item, outcome in zip(items, outcomes, strict=True):
            if not item.future.done():  # not cancelled (the client went away)
                item.future.set_result(outcome)

    def _job_done(self) -> None:
        self._start(asyncio.get_running_loop())  # anything queued meanwhile (normally none)
        with self._lock:
            idle = self._jobs == 0
        if idle:
            self._idle.set()

    async def close(self) -> None:
        """Wait until no batch runs (queued requests are answered first)."""
        if self._timer is not None or self._start_scheduled:  # start what waits now
            self._window_over(asyncio.get_running_loop())
        with self._lock:
            idle = self._jobs == 0
        if not idle:
            await self._idle.wait()
