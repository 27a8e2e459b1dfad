"""Live drift (docs/drift.md): the sequences each version answers, gathered in windows and
tested against the reference its package recorded at export (``export.artifacts.drift``),
off the request path.

The request path only appends (the sequence, its output row) to the version's window: no
arithmetic. When the window holds ``drift_window`` sequences it is handed whole to one
worker thread, which computes the summaries and the tests (a few milliseconds) and sets
``orthornn_drift_score{model,version,test}`` and ``orthornn_drift_detected{model,version}``.
A window that fills while the worker still tests the version's previous one is dropped
(counted in ``Monitor.skipped``): the tests sample the traffic, and the backlog stays
bounded. Counted: whole sequences the model graph answered from the start; a chunk that
continues a state (states, sessions) and per-step answers are not (the reference holds
whole sequences). Versions whose package has no reference measure nothing.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from orthornn.export.artifacts import drift
from orthornn.export.artifacts.package import package_file

from .metrics import Metrics
from .registry.catalog import ModelVersion
from .registry.runtime import Chunk

log = logging.getLogger("orthornn.service")


@dataclass
class Monitor:
    """One version's live window and its latest result."""

    mv: ModelVersion
    reference: drift.Reference | None  # None: the package has none (drift off for it)
    window: int
    pending: list = field(default_factory=list)  # (sequence, output row) of this window
    busy: bool = False  # the worker is testing a window of this version
    windows: int = 0  # windows tested
    skipped: int = 0  # windows dropped because the previous one was still being tested
    alarms: int = 0  # windows that alarmed
    last: dict[str, float] | None = None  # the latest window's scores
    done: threading.Condition = field(default_factory=threading.Condition)


class Drift:
    """The service's drift monitors, one per loaded version (created at its first answer)."""

    def __init__(self, metrics: Metrics | None, window: int | None = None):
        self.metrics = metrics
        self.window = window  # None: the window each reference was calibrated for
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
        pending = m.pending
        for seq, row in zip(sequences, rows, strict=True):
            if not isinstance(seq, Chunk):
                pending.append((seq, row))
        if len(pending) >= m.window:
            m.pending = []
            if m.busy:
                m.skipped += 1
                return
            m.busy = True
            self.worker.submit(self._test, m, pending[: m.window])

    def _test(self, m: Monitor, window: list) -> None:
        """In the worker thread: one window's summaries, tests and gauges."""
        try:
            scores = test_window(m.mv, m.reference, window)
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


def test_window(mv: Any, reference: drift.Reference, window: list) -> dict[str, float]:
    """The scores of a window of (sequence, output row) against REFERENCE: what the
    service computes when a window fills (``orthornn monitor`` computes the same from
    captures)."""
    spec = mv.spec
    sequences = [np.asarray(s) for s, _ in window]
    outputs = [row[spec.output_name] for _, row in window]
    states = np.stack([row["state"] for _, row in window])
    return reference.scores(reference.summarize(sequences, outputs, states))
