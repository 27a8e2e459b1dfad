"""Live drift (docs/drift.md): the sequences each version answers, gathered in windows and
tested against the reference its package recorded at export (``export.artifacts.drift``),
off the request path.

The request path adds each answered sequence's summary to the version's window: a fixed
size a sequence whatever its length and vocabulary (its input's length, mean and variance
or token counts, its prediction's class and entropy or its next tokens' log-likelihood, its
final state's projection), so a window never holds a request's inputs or outputs (a
language model's logits kept whole: 61 MiB a request, gigabytes a window). The summary
is O(T d) of arithmetic (a language model's log-probabilities come from its batch, which
computed them in the inference thread). When the window holds ``drift_window`` sequences
it is handed to one worker thread, which computes the tests (a few milliseconds) and sets
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
from orthornn.export.artifacts import drift
from orthornn.export.artifacts.package import package_file

from .metrics import Metrics
from .registry.batching import LOG_PROBABILITIES
from .registry.catalog import ModelVersion
from .registry.runtime import Chunk

log = logging.getLogger("orthornn.service")


@dataclass
class Monitor:
    """One version's live window and its latest result."""

    mv: ModelVersion
    reference: drift.Reference | None  # None: the package has none (drift off for it)
    window: int
    #: the summaries of this window's sequences (``drift.summarize``: arrays of a fixed
    #: size a sequence), a dict per batch, and how many sequences they hold
    pending: list = field(default_factory=list)
    count: int = 0
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
        whole = [(seq, row) for seq, row in zip(sequences, rows, strict=True)
                 if not isinstance(seq, Chunk)][:drift.per_request(m.window)]
        if not whole:
            return
        lm = mv.spec.task == "lm"  # its rows carry the batch's log-probabilities
        name = LOG_PROBABILITIES if lm else mv.spec.output_name
        m.pending.append(m.reference.summarize(
            [seq for seq, _ in whole], [row[name] for _, row in whole],
            np.stack([row["state"] for _, row in whole]), log_probabilities=lm))
        m.count += len(whole)
        if m.count >= m.window:
            pending, m.pending, m.count = m.pending, [], 0
            now = time.monotonic()
            if m.busy or now - m.tested_at < self.interval_s:
                m.skipped += 1
                return
            m.busy, m.tested_at = True, now
            window = {k: np.concatenate([p[k] for p in pending])[: m.window]
                      for k in pending[0]}
            self.worker.submit(self._test, m, window)

    def _test(self, m: Monitor, window: dict[str, np.ndarray]) -> None:
        """In the worker thread: one window's tests and gauges."""
        try:
            assert m.reference is not None
            scores = m.reference.scores(window)
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


def test_window(reference: drift.Reference, window: list) -> dict[str, float]:
    """The scores of a window of (sequence, prediction output, final state) against
    REFERENCE: what the service computes when a window fills (``orthornn monitor``
    computes the same from captures)."""
    sequences = [np.asarray(s) for s, _, _ in window]
    outputs = [o for _, o, _ in window]
    states = np.stack([s for _, _, s in window])
    return reference.scores(reference.summarize(sequences, outputs, states))
