"""The batcher on its own (no HTTP): which requests run together, in what order, and that
every request gets its own answer or its own error."""

import asyncio
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import numpy as np
import pytest
from orthornn.service.errors import QueueFull
from orthornn.service.registry.batcher import Batcher

from ...service_helpers import wait_until_async


class Model:
    """A fake run(): records each call's sequence count; answers 2 * the sequence; the
    first call can be held until released; ON_CALL (if any) runs first in each call."""

    def __init__(self, hold_first: bool = False, delay: float = 0.0, on_call=None):
        self.calls: list[int] = []
        self.release = threading.Event()
        self.started = threading.Event()
        if not hold_first:
            self.release.set()
        self.delay = delay
        self.on_call = on_call

    def __call__(self, seqs):
        if self.on_call is not None:
            self.on_call()
        self.started.set()
        self.release.wait(30)
        time.sleep(self.delay)
        self.calls.append(len(seqs))
        return [{"y": 2 * s} for s in seqs]


def seq(v: float) -> np.ndarray:
    return np.full((3, 1), v, dtype=np.float32)


def batcher(model, executor, **kw) -> Batcher:
    options = {"max_batch_size": 32, "max_queue_delay_ms": 0, "max_queue_size": 64,
               "workers": 1, **kw}
    b = Batcher(model, executor, **options)
    b.holders = lambda: b._submitted  # nobody else is on the way unless a test says so
    return b


def own(rows):
    return [float(r["y"][0, 0]) for r in rows]


async def ask(b: Batcher, sequences: list) -> list[float]:
    """One request: its sequences' answers (the model's 2 * s, first element)."""
    return own(await b.submit(sequences))


async def _started(model):
    await wait_until_async(model.started.is_set, what="the model's first call")


async def _queued(b: Batcher, sequences: int):
    """Until SEQUENCES sequences wait in B's queue (their requests' tasks have run)."""
    await wait_until_async(lambda: b.pending == sequences,
                           what=lambda: f"{sequences} sequences queued, not {b.pending}")


def test_requests_that_arrive_while_a_batch_runs_form_the_next_batch():
    async def main():
        model = Model(hold_first=True)
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool)
            first = asyncio.ensure_future(ask(b, [seq(1)]))
            await _started(model)  # the first request runs alone, held
            rest = [asyncio.ensure_future(ask(b, [seq(v)])) for v in range(2, 7)]
            await _queued(b, 5)
            model.release.set()
            answers = await asyncio.gather(first, *rest)
        assert answers == [[2.0 * v] for v in range(1, 7)]
        assert model.calls == [1, 5]
    asyncio.run(main())


class Immediate(Executor):
    """Runs a job at once in the caller's thread: an inference thread that wakes the
    moment a job is handed to it (the worst case for batching)."""

    def __init__(self):
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):
        self.jobs += 1
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def test_the_requests_of_one_event_loop_turn_form_one_batch():
    """A job starts at the end of the turn, not at the first submit: even an inference
    thread that wakes at once finds every request queued in the turn."""
    async def main():
        model = Model()
        b = batcher(model, Immediate())
        answers = await asyncio.gather(*(ask(b, [seq(v)]) for v in range(8)))
        assert answers == [[2.0 * v] for v in range(8)]
        assert model.calls == [8]
        # the next turn's requests: the next batch
        assert await asyncio.gather(ask(b, [seq(1)]), ask(b, [seq(2)])) \
            == [[2.0], [4.0]] and model.calls == [8, 2]
    asyncio.run(main())


def test_a_turns_burst_starts_a_job_per_batch_on_free_workers():
    async def main():
        model = Model(hold_first=True)
        with ThreadPoolExecutor(3) as pool:
            b = batcher(model, pool, max_batch_size=4, workers=3)
            jobs = []
            submit = pool.submit
            pool.submit = lambda *a, **k: jobs.append(1) or submit(*a, **k)
            burst = [asyncio.ensure_future(ask(b, [seq(v)])) for v in range(9)]
            await _started(model)
            assert len(jobs) == 3  # three batches of at most 4: three workers
            model.release.set()
            answers = await asyncio.gather(*burst)
        assert answers == [[2.0 * v] for v in range(9)]
        assert sorted(model.calls) == [1, 4, 4]
    asyncio.run(main())


def test_close_starts_what_is_queued_in_this_turn_and_waits_for_it():
    async def main():
        model = Model()
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool)
            request = asyncio.ensure_future(ask(b, [seq(1)]))
            await asyncio.sleep(0)  # queued; its job starts at the end of the turn
            await b.close()  # (not through wait_for: its task would start after the job)
            assert request.done() and await request == [2.0]
    asyncio.run(main())


def test_max_batch_size_bounds_every_run():
    async def main():
        model = Model(hold_first=True)
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool, max_batch_size=4)
            first = asyncio.ensure_future(ask(b, [seq(0)]))
            await _started(model)
            rest = [asyncio.ensure_future(ask(b, [seq(v), seq(-v)]))
                    for v in range(1, 6)]
            await _queued(b, 10)
            model.release.set()
            answers = await asyncio.gather(first, *rest)
        assert answers == [[0.0]] + [[2.0 * v, -2.0 * v] for v in range(1, 6)]
        assert model.calls[0] == 1 and max(model.calls) <= 4 and sum(model.calls) == 11
    asyncio.run(main())


def test_a_lone_request_does_not_wait_for_the_window():
    async def main():
        with ThreadPoolExecutor(1) as pool:
            b = batcher(Model(), pool, max_queue_delay_ms=20_000)
            start = time.perf_counter()
            assert await ask(b, [seq(1)]) == [2.0]
            return time.perf_counter() - start
    assert asyncio.run(main()) < 10  # not the 20 s window: nobody else was on the way


def test_the_window_waits_for_a_request_still_on_its_way():
    async def main():
        model = Model()
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool, max_queue_delay_ms=20_000)
            on_the_way = [1]
            b.holders = lambda: b._submitted + on_the_way[0]
            first = asyncio.ensure_future(ask(b, [seq(1)]))
            await asyncio.sleep(0.1)
            assert not first.done()  # waiting for the second one
            on_the_way[0] = 0
            second = asyncio.ensure_future(ask(b, [seq(2)]))
            answers = await asyncio.gather(first, second)
        assert answers == [[2.0], [4.0]] and model.calls == [2]
    asyncio.run(main())


def test_models_take_turns_on_one_inference_thread():
    """b's request, queued while a's first batch runs, runs right after that batch, not
    after the 19 requests of a's queued ahead of it: after each batch a model's job queues
    itself again, behind the other models' jobs."""
    async def main():
        busy = Model(hold_first=True, delay=0.02)
        other = Model(on_call=lambda: before_b.append(len(busy.calls)))
        before_b: list[int] = []  # a's batches done when b's ran
        with ThreadPoolExecutor(1) as pool:
            a = batcher(busy, pool, max_batch_size=1)
            b = batcher(other, pool)
            stream = [asyncio.ensure_future(ask(a, [seq(v)])) for v in range(20)]
            await _started(busy)  # a's first batch runs (held), the other 19 wait
            b_request = asyncio.ensure_future(ask(b, [seq(7)]))
            await wait_until_async(lambda: b._jobs == 1, what="b's job handed to the thread")
            busy.release.set()
            done_b = await b_request
            await asyncio.gather(*stream)
        assert done_b == [14.0]
        assert before_b == [1]  # b did not wait for a's whole queue: one batch of it
        assert busy.calls == [1] * 20
    asyncio.run(main())


def test_batching_off_runs_each_request_alone():
    async def main():
        model = Model(hold_first=True)
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool, enabled=False)
            first = asyncio.ensure_future(ask(b, [seq(0)]))
            await _started(model)
            two = asyncio.ensure_future(ask(b, [seq(1), seq(2)]))
            three = asyncio.ensure_future(ask(b, [seq(3), seq(4), seq(5)]))
            await _queued(b, 5)
            model.release.set()
            answers = await asyncio.gather(first, two, three)
        assert answers == [[0.0], [2.0, 4.0], [6.0, 8.0, 10.0]]
        assert model.calls == [1, 2, 3]  # a request's own sequences still run together
    asyncio.run(main())


def test_a_full_queue_refuses_and_recovers():
    async def main():
        model = Model(hold_first=True)
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool, max_queue_size=2)
            first = asyncio.ensure_future(ask(b, [seq(0)]))
            await _started(model)  # taken: the queue is empty again
            queued = asyncio.ensure_future(ask(b, [seq(1), seq(2)]))
            await _queued(b, 2)
            with pytest.raises(QueueFull, match="queue of model"):
                await ask(b, [seq(3)])
            model.release.set()
            await asyncio.gather(first, queued)
            assert b.pending == 0
            assert await ask(b, [seq(4), seq(5)]) == [8.0, 10.0]
    asyncio.run(main())


def test_errors_reach_only_their_own_requests():
    calls = []

    def run(seqs):
        calls.append(len(seqs))
        if any(s.shape[0] == 7 for s in seqs):
            raise ValueError("bad group")
        return [{"y": s} for s in seqs]

    async def main():
        with ThreadPoolExecutor(1) as pool:
            b = batcher(run, pool, max_queue_delay_ms=20_000)
            b.holders = lambda: 3  # the window stays open until all three are queued
            results = await asyncio.gather(
                ask(b, [np.ones((7, 1), np.float32)]),  # a length group of its own
                ask(b, [seq(9)]), ask(b, [seq(4)]), return_exceptions=True)
        assert isinstance(results[0], ValueError)
        assert results[1:] == [[9.0], [4.0]]  # this run answers s itself
        assert sorted(calls) == [1, 2]  # one batch, two length groups
    asyncio.run(main())


def test_a_shut_down_executor_answers_with_its_error_and_close_returns():
    async def main():
        pool = ThreadPoolExecutor(1)
        pool.shutdown()
        b = batcher(Model(), pool)
        with pytest.raises(RuntimeError, match="shutdown"):
            await ask(b, [seq(1)])
        await asyncio.wait_for(b.close(), 5)
    asyncio.run(main())


def test_close_waits_for_the_running_batch():
    async def main():
        model = Model(hold_first=True)
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool)
            request = asyncio.ensure_future(ask(b, [seq(1)]))
            await _started(model)
            closing = asyncio.ensure_future(b.close())
            await asyncio.sleep(0.05)
            assert not closing.done()
            model.release.set()
            await asyncio.wait_for(closing, 5)
            assert await request == [2.0]
    asyncio.run(main())


def test_a_batch_waiting_for_its_window_does_not_hold_the_inference_thread():
    async def main():
        with ThreadPoolExecutor(1) as pool:
            a_model, b_model = Model(), Model()
            a = batcher(a_model, pool, max_queue_delay_ms=20_000)
            on_the_way = [1]
            a.holders = lambda: a._submitted + on_the_way[0]
            waiting = asyncio.ensure_future(ask(a, [seq(1)]))
            # queued, and waiting for its window: a timer on the event loop, no job
            await wait_until_async(lambda: a._timer is not None, what="a's window open")
            assert a._jobs == 0
            b = batcher(b_model, pool)
            assert await asyncio.wait_for(ask(b, [seq(3)]), 5) == [6.0]
            assert not waiting.done()  # still in its window, on the event loop
            on_the_way[0] = 0
            assert await ask(a, [seq(2)]) == [4.0]
            assert await waiting == [2.0] and a_model.calls == [2]
    asyncio.run(main())


class Interrupt(BaseException):
    pass


def test_a_failing_batch_answers_its_requests_and_the_model_keeps_serving():
    calls = []

    def run(seqs):
        calls.append(len(seqs))
        if len(calls) == 1:
            raise Interrupt("not an Exception")
        return [{"y": 2 * s} for s in seqs]

    async def main():
        with ThreadPoolExecutor(1) as pool:
            b = batcher(run, pool)
            with pytest.raises(Interrupt):
                await ask(b, [seq(1)])
            assert await ask(b, [seq(2)]) == [4.0]
            await asyncio.wait_for(b.close(), 5)
    asyncio.run(main())


def test_the_prepare_step_runs_once_per_batch_on_the_rows_that_ask_for_it():
    """/predict asks for the batch-level prepare step (one softmax over the batch); the Open
    Inference Protocol's requests, batched with them, do not, and their rows are left as
    the model gave them."""
    prepared: list[list[float]] = []

    def prepare(rows):
        prepared.append([float(r["y"][0, 0]) for r in rows])
        for r in rows:
            r["prepared"] = True

    def marks(rows):
        return [bool(r.get("prepared")) for r in rows]

    async def main():
        model = Model()
        b = batcher(model, Immediate(), prepare=prepare)
        answers = await asyncio.gather(b.submit([seq(1), seq(2)], prepare=True),
                                       b.submit([seq(3)]), b.submit([seq(4)], prepare=True))
        answers = [marks(rows) for rows in answers]
        assert model.calls == [4]  # one batch
        assert prepared == [[2.0, 4.0, 8.0]]  # once, on the rows that asked for it
        assert answers == [[True, True], [False], [True]]
        assert marks(await b.submit([seq(5)])) == [False]
        assert prepared == [[2.0, 4.0, 8.0]]  # a batch that does not ask: never called
    asyncio.run(main())


def test_a_batchs_tagged_requests_are_recorded_once_before_any_answer_goes_back():
    """Capture's hook: one call per batch with the tagged requests that did not fail (tag,
    sequences, rows, compute time), in the inference thread, before the answers are
    delivered; untagged requests and a failed length group's are not in it; a recorder
    that raises fails no request."""
    calls: list[tuple[list, bool, str]] = []
    futures: list[asyncio.Future] = []

    def run(seqs):
        if any(s.shape[0] == 7 for s in seqs):
            raise ValueError("bad group")
        return [{"y": 2 * s} for s in seqs]

    def record(captured):
        answered = any(f.done() for f in futures)
        calls.append(([(tag, own(rows), compute > 0) for tag, _, rows, compute in captured],
                      answered, threading.current_thread().name))
        if len(calls) == 2:
            raise RuntimeError("a broken recorder")

    async def main():
        with ThreadPoolExecutor(1, thread_name_prefix="infer") as pool:
            b = batcher(run, pool, record=record, max_queue_delay_ms=20_000)
            b.holders = lambda: 4
            tasks = [asyncio.ensure_future(b.submit(s, tag=t)) for s, t in (
                ([seq(1), seq(2)], "a"), ([seq(3)], None),
                ([np.ones((7, 1), np.float32)], "failed"), ([seq(4)], "d"))]
            futures.extend(tasks)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert [own(r) for r in results if not isinstance(r, Exception)] == \
                [[2.0, 4.0], [6.0], [8.0]] and isinstance(results[2], ValueError)
            b.holders = lambda: 1
            assert own(await b.submit([seq(5)], tag="e")) == [10.0]  # recorder raised
            assert own(await b.submit([seq(6)])) == [12.0]  # nothing tagged: no call
        assert calls[0][0] == [("a", [2.0, 4.0], True), ("d", [8.0], True)]
        assert [c[0] for c in calls[1:]] == [[("e", [10.0], True)]]
        assert calls[0][1] is False  # none of the first batch's requests answered yet
        assert all(name.startswith("infer") for _, _, name in calls)
    asyncio.run(main())


def test_a_request_cancelled_while_its_batch_runs_is_not_recorded():
    """A client that goes away while its batch runs: its request is cancelled, never
    answered, and left out of the batch's record; the others of the batch are in it."""
    started, release = threading.Event(), threading.Event()
    calls: list[list] = []

    def run(seqs):
        started.set()
        release.wait(10)
        return [{"y": 2 * s} for s in seqs]

    async def main():
        with ThreadPoolExecutor(1, thread_name_prefix="infer") as pool:
            b = batcher(run, pool, record=lambda c: calls.append([t for t, *_ in c]),
                        max_queue_delay_ms=20_000)
            b.holders = lambda: 2
            kept = asyncio.ensure_future(b.submit([seq(1)], tag="kept"))
            gone = asyncio.ensure_future(b.submit([seq(2)], tag="gone"))
            await asyncio.to_thread(started.wait, 10)
            gone.cancel()
            await asyncio.sleep(0)
            release.set()
            assert own(await kept) == [2.0]
            assert gone.cancelled()
        assert calls == [["kept"]]
    asyncio.run(main())


def test_a_batch_keeps_its_per_step_outputs_within_the_output_budget():
    """Issue 59, finding 3: 16 concurrent requests of a language model, each within
    max_lm_output_bytes (B=2, T=800, 10,000 words: 61 MiB of logits), were batched together
    (+3.9 GiB). A batch, and each padded run in it, now holds at most the budget of per-step
    outputs (B x T x step_bytes); a small request still joins a large one where it fits."""
    async def main():
        model = Model(hold_first=True)
        step_bytes, budget = 40_000, 64 << 20
        long = [np.zeros((800, 1), np.float32)] * 2  # 2 x 800 x 40,000 = 64,000,000 bytes
        with ThreadPoolExecutor(1) as pool:
            b = batcher(model, pool, step_bytes=step_bytes, max_output_bytes=budget)
            first = asyncio.ensure_future(b.submit(long))
            await _started(model)
            rest = [asyncio.ensure_future(b.submit(long)) for _ in range(15)]
            small = asyncio.ensure_future(b.submit([seq(1)]))  # 3 x 40,000: fits beside one
            await _queued(b, 31)
            model.release.set()
            answers = await asyncio.gather(first, *rest, small)
        assert [len(a) for a in answers] == [2] * 16 + [1]
        assert model.calls == [2] * 15 + [2, 1], model.calls  # the last run's batch: both
    asyncio.run(main())
