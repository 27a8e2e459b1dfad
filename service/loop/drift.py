"""Live drift (docs/drift.md): the sequences each version answers, gathered in windows and
tested against the reference its package recorded at export (``export.artifacts.loop.drift``),
off the request path.

The request path only appends each answered sequence to its version's window: its input
(as the request holds it), its prediction output and its final state; of a language
model's logits [T, V], only the log-probability of each next token [T] (a gather of the
log-probabilities its batch computed in the inference thread), so that a window's size is
bounded by the model's max_length and never by its vocabulary (whole logits: 61 MiB a
request, gigabytes a window). When the window holds ``drift_window`` sequences it is
handed whole to one worker thread, which computes the summaries and the tests (a few
milliseconds) and sets
``orthornn_drift_score{model,version,test}`` and ``orthornn_drift_detected{model,version}``.
A version's windows are tested at most once per ``drift_interval_s``, and never two at
once: a window that fills sooner, or while the worker still tests the previous one, is
dropped (counted in ``Monitor.skipped``). The tests sample the traffic, so their cost is
bounded whatever the request rate (a window's test is a few milliseconds of CPU).

Counted: whole sequences the model graph answered from the start, at most
``drift.per_request`` of one request (a window spans at least ``drift.MIN_REQUESTS``
requests, so that a few requests cannot fake drift); a chunk that continues a state
(states, sessions) and per-step answers are not (the reference holds whole sequences).
Versions whose package has no reference measure nothing.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from orthornn.export.artifacts.loop import drift
from orthornn.export.artifacts.package import package_file

from ..metrics import Metrics
from ..registry.batching import LOG_PROBABILITIES
from ..registry.catalog import ModelVersion
from ..registry.runtime import Chunk

log = logging.getLogger("orthornn.service")


@dataclass
class Monitor:
    """One version's live window and its latest result."""

    mv: ModelVersion
    reference: drift.Reference | None  # None: the package has none (drift off for it)
    window: int
    #: (sequence, prediction output, final state) of this window: arrays only, which the
    #: garbage collector does not track (whole rows, dicts with lists, made it work); a
    #: language model's output is its ``drift.next_tokens``
    pending: list = field(default_factory=list)
    busy: bool = False  # the worker is testing a window of this version
    tested_at: float = -math.inf  # when the latest window was handed to the worker
    windows: int = 0  # windows tested
    skipped: int = 0  # windows dropped because the previous one was still being tested
    alarms: int = 0  # windows that alarmed
    last: dict[str, float] | None = None  # the latest window's scores
    done: threading.Condition = field(default_factory=threading.Condition)


class Drift:
    """The service's drift monitors, one per loaded version (created at its first answer)."""

    def __init__(self, metrics: Metrics | None, window: int | None = None,
                 interval_s: float = 0.0):
        self.metrics = metrics
        self.window = window  # None: the window each reference was calibrated for
        self.interval_s = interval_s  # at most one test per version per this many seconds
        self.monitors: dict[tuple[str, int], Monitor] = {}
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="orthornn-drift")

    def monitor(self, mv: ModelVersion) -> Monitor:
        key = (mv.name, mv.version)
        m = self.monitors.get(key)
        if m is None or m.mv is not mv:  # first answer of this loaded version
            m = self.monitors[key] = self._open(mv)
        return m

    def _open(self, mv: ModelVersion) -> Monitor:
        reference = None
        if mv.manifest.reference is not None:
            try:  # its sha256 was checked when the version was loaded
                reference = drift.read(package_file(mv.path, "reference", mv.manifest.reference))
            except ValueError as error:
                log.error("%s version %d: no drift monitoring: %s", mv.name, mv.version, error)
        for key in [k for k, m in self.monitors.items() if m.mv.released]:
            del self.monitors[key]  # versions no longer loaded
        window = self.window or (reference.window if reference is not None else 0)
        return Monitor(mv, reference, window)

    def observe(self, mv: ModelVersion, sequences: list, rows: list[dict]) -> None:
        """On the event loop, after a batch answered SEQUENCES with ROWS (the graph's
        outputs per sequence): add the whole sequences to the version's window."""
        m = self.monitor(mv)
        if m.reference is None:
            return
        pending, cap = m.pending, drift.per_request(m.window)
        lm = mv.spec.task == "lm"  # the batch's log-probabilities: the next tokens' only
        name = LOG_PROBABILITIES if lm else mv.spec.output_name
        for seq, row in zip(sequences, rows, strict=True):
            if cap == 0:
                break
            if not isinstance(seq, Chunk) and name in row:
                pending.append((seq, drift.next_tokens(seq, row[name]) if lm else row[name],
                                row["state"]))
                cap -= 1
        if len(pending) >= m.window:
            m.pending = []
            now = time.monotonic()
            if m.busy or now - m.tested_at < self.interval_s:
                m.skipped += 1
                return
            m.busy, m.tested_at = True, now
            self.worker.submit(self._test, m, pending[: m.window])

    def _test(self, m: Monitor, window: list) -> None:
        """In the worker thread: one window's summaries, tests and gauges."""
        try:
            scores = test_window(m.reference, window, gathered=m.mv.spec.task == "lm")
            detected = any(s >= 1 for s in scores.values())
            if self.metrics is not None:
                version = str(m.mv.version)
                for test, score in scores.items():
                    self.metrics.drift_score.labels(m.mv.name, version, test).set(score)
                self.metrics.drift_detected.labels(m.mv.name, version).set(int(detected))
            with m.done:
                m.windows += 1
                m.alarms += detected
                m.last = scores
                m.done.notify_all()
        except Exception:  # a bug here must not stop the monitor of every later window
            log.exception("drift test of %s version %d failed", m.mv.name, m.mv.version)
        finally:
            m.busy = False

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)


def test_window(reference: drift.Reference, window: list, gathered: bool = False
                ) -> dict[str, float]:
    """The scores of a window of (sequence, prediction output, final state) against
    REFERENCE: what the service computes when a window fills (``orthornn monitor``
    computes the same from captures). GATHERED: a language model's outputs are
    ``drift.next_tokens``, as the service keeps them."""
    sequences = [np.asarray(s) for s, _, _ in window]
    outputs = [o for _, o, _ in window]
    states = np.stack([s for _, _, s in window])
    return reference.window_scores(sequences, outputs, states, gathered)
