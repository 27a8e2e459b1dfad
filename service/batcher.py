"""Dynamic batching for one model version.

Requests put their sequences on a queue; a worker takes everything that arrives within
``max_queue_delay_ms`` of the first waiting request (or until ``max_batch_size``
sequences are there), sorts the sequences by length and runs them in groups of at most
``max_batch_size`` whose longest sequence is at most twice their shortest, so padding
stays small. The graphs take ``lengths`` and padded steps never change a result, so an
answer does not depend on what it was batched with. While ``inference_workers`` batches
run, the next one gathers. More than ``max_queue_size`` waiting sequences: QueueFull (429).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class QueueFull(Exception):
    pass


@dataclass
class _Item:
    sequences: list[np.ndarray]
    post: Callable[[list[dict]], Any]
    future: asyncio.Future
    enqueued: float = field(default_factory=time.perf_counter)


def groups(lengths: list[int], max_batch_size: int) -> list[list[int]]:
    """Indices grouped for padded runs: by length (longest first), at most max_batch_size
    per group, the longest sequence of a group at most twice its shortest."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < max_batch_size and lengths[out[-1][0]] <= 2 * lengths[i]:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class Batcher:
    def __init__(self, run: Callable[[list[np.ndarray]], list[dict]], executor: Executor, *,
                 max_batch_size: int, max_queue_delay_ms: float, max_queue_size: int,
                 workers: int, enabled: bool = True, metrics=None, model: str = ""):
        self.run = run
        self.executor = executor
        self.max_batch_size = max_batch_size if enabled else 1 << 30
        self.delay = max_queue_delay_ms / 1000
        self.max_queue_size = max_queue_size
        self.enabled = enabled
        self.metrics = metrics
        self.model = model
        if metrics is not None:  # label children looked up once, not per request
            self._depth = metrics.queue_depth.labels(model)
            self._queue_hist = metrics.queue_duration.labels(model)
            self._inference_hist = metrics.inference_duration.labels(model)
            self._batch_hist = metrics.batch_size.labels(model)
        self.pending = 0  # sequences accepted and not yet taken into a batch
        self._workers = workers
        self._queue: asyncio.Queue[_Item] | None = None
        self._task: asyncio.Task | None = None
        self._slots: asyncio.Semaphore | None = None
        self._running: set[asyncio.Task] = set()
        self._submitted = 0  # batched requests inside submit(): queued, running or answered
        #: how many requests hold this model version (being parsed, or inside submit());
        #: the worker stops waiting for more when no other one can come
        self.holders: Callable[[], int] | None = None

    async def submit(self, sequences: list[np.ndarray], post: Callable[[list[dict]], Any]):
        """post(rows) runs in the inference thread on this request's output rows (one dict
        per sequence, in order); its result is returned."""
        if self.pending + len(sequences) > self.max_queue_size:
            raise QueueFull(f"the queue of model {self.model!r} is full "
                            f"({self.pending} sequences waiting); retry later")
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._workers)
        item = _Item(sequences, post, loop.create_future())
        self._add_pending(len(sequences))
        if not self.enabled:  # each request runs alone, still bounded by the same queue
            async with self._slots:
                self._add_pending(-len(sequences))
                self._observe_queue([item])
                outcome = (await loop.run_in_executor(self.executor, self._execute, [item]))[0]
            return self._unwrap(outcome)
        if self._task is None:
            self._queue = asyncio.Queue()
            self._task = loop.create_task(self._loop())
        self._queue.put_nowait(item)
        self._submitted += 1
        try:
            return self._unwrap(await item.future)
        finally:
            self._submitted -= 1

    @staticmethod
    def _unwrap(outcome):
        ok, value = outcome
        if not ok:
            raise value
        return value

    def _add_pending(self, n: int) -> None:
        self.pending += n
        if self.metrics is not None:
            self._depth.inc(n)

    def _observe_queue(self, items: list[_Item]) -> None:
        if self.metrics is not None:
            now = time.perf_counter()
            hist = self._queue_hist
            for item in items:
                hist.observe(now - item.enqueued)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            await self._slots.acquire()
            try:
                first = await queue.get()
            except asyncio.CancelledError:
                self._slots.release()
                raise
            items, count = [first], len(first.sequences)
            deadline = first.enqueued + self.delay
            while count < self.max_batch_size:
                if queue.empty():
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0 or (self.holders is not None
                                          and self.holders() <= self._submitted):
                        break  # the window is over, or no other request is on its way
                    try:
                        async with asyncio.timeout(remaining):
                            item = await queue.get()
                    except TimeoutError:
                        break
                else:
                    item = queue.get_nowait()
                items.append(item)
                count += len(item.sequences)
            self._add_pending(-count)
            self._observe_queue(items)
            task = loop.create_task(self._dispatch(items))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _dispatch(self, items: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        try:
            outcomes = await loop.run_in_executor(self.executor, self._execute, items)
        except BaseException as error:  # the executor itself failed: answer everyone
            outcomes = [(False, error)] * len(items)
        finally:
            self._slots.release()
        for item, outcome in zip(items, outcomes, strict=True):
            if not item.future.done():
                item.future.set_result(outcome)

    def _execute(self, items: list[_Item]) -> list[tuple[bool, Any]]:
        """In an inference thread: run every sequence of the items in length groups, then
        each item's post-processing. Returns (ok, result or exception) per item."""
        flat = [(k, j) for k, item in enumerate(items) for j in range(len(item.sequences))]
        seqs = [items[k].sequences[j] for k, j in flat]
        rows: list[dict | None] = [None] * len(seqs)
        failed: dict[int, BaseException] = {}
        for group in groups([len(s) for s in seqs], self.max_batch_size):
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
        outcomes: list[tuple[bool, Any]] = []
        offset = 0
        for k, item in enumerate(items):
            n = len(item.sequences)
            if k in failed:
                outcomes.append((False, failed[k]))
            else:
                try:
                    outcomes.append((True, item.post(rows[offset:offset + n])))
                except Exception as error:
                    outcomes.append((False, error))
            offset += n
        return outcomes

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
