"""The request metrics (``orthornn_requests_total``, ``orthornn_request_duration_seconds``),
recorded in one place for the two places that answer requests: the route dispatcher
(``routing.Routes``: every request that reaches it) and admission (``admission.Admission``:
what it refuses itself). Label children are cached: a lookup per request costs more than
the increment."""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from ..metrics import Metrics


class RequestCounts:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._counters: dict[tuple[str, str, str, int], Counter] = {}
        self._durations: dict[tuple[str, str], Histogram] = {}

    def record(self, endpoint: str, labels: tuple[str, str], status: int,
               start: float) -> None:
        """One answered request: its route template, model/version labels, status and
        duration since START (a time.perf_counter())."""
        key = (*labels, endpoint, status)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._counters[key] = self.metrics.requests.labels(
                labels[0], labels[1], endpoint, str(status))
        counter.inc()
        histogram = self._durations.get((labels[0], endpoint))
        if histogram is None:
            histogram = self._durations[(labels[0], endpoint)] = \
                self.metrics.request_duration.labels(labels[0], endpoint)
        histogram.observe(time.perf_counter() - start)
