"""Prometheus metrics, all named ``orthornn_*``, in a registry of their own per service
instance (so several apps in one process, as in the tests, do not collide)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from orthornn.export.artifacts.numbers import is_number
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # the manifests it counts (the leaf imports nothing of the service)
    from orthornn.export.artifacts.package import Manifest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
UNKNOWN = "_unknown"  # label of requests for models that are not loaded (bounded cardinality)


class Tally(Collector):
    """A counter with one label kept as plain integers, a dictionary per thread that counts
    (each written by its thread only: no lock), added up when scraped. Capture counts a
    dropped record on every request while a disk refuses them; a prometheus ``Counter``
    child's ``inc`` (its checks and its lock) costs three times as much."""

    def __init__(self, name: str, documentation: str, label: str,
                 registry: CollectorRegistry):
        self.name, self.documentation, self.label = name, documentation, label
        self._mine = threading.local()  # .counts: this thread's dictionary
        self._all: list[dict[str, float]] = []  # every thread's, appended under the lock
        self._lock = threading.Lock()
        registry.register(self)

    def inc(self, value: str, amount: float = 1) -> None:
        try:
            counts = self._mine.counts
        except AttributeError:  # this thread's first count
            counts = self._mine.counts = {}
            with self._lock:
                self._all.append(counts)
        counts[value] = counts.get(value, 0) + amount

    def _threads(self) -> list[dict[str, float]]:
        """A copy of every thread's counts (``dict()`` copies one under the GIL, whole)."""
        with self._lock:
            return [dict(counts) for counts in self._all]

    def describe(self) -> list[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        total: dict[str, float] = {}
        for counts in self._threads():
            for value, count in counts.items():
                total[value] = total.get(value, 0) + count
        for value, count in sorted(total.items()):
            family.add_metric([value], count)
        yield family


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._request_metrics(r)
        self._loop_metrics(r)
        self._session_metrics(r)
        self._model_metrics(r)
        self._rollout_metrics(r)
        self._promoted: dict[str, str] = {}  # model -> its orthornn_model_promoted version
        # the process's CPU, memory and file descriptors (orthornn_process_*; Linux only)
        ProcessCollector(namespace="orthornn", registry=r)

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Requests, their latency and batches, admission's refusals."""
        self.requests = Counter(
            "orthornn_requests", "HTTP requests by model, version, endpoint and status",
            ["model", "version", "endpoint", "status"], registry=r)
        self.request_duration = Histogram(
            "orthornn_request_duration_seconds", "time from request start to answer, by "
            "route and model (as orthornn_requests_total counts it)",
            ["model", "endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram(
            "orthornn_queue_duration_seconds", "time a request waits for its batch to start",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.inference_duration = Histogram(
            "orthornn_inference_duration_seconds", "onnxruntime time of one batch",
            ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(
            "orthornn_batch_size", "sequences per onnxruntime run", ["model"],
            buckets=BATCH_BUCKETS, registry=r)
        self.inputs_out_of_range = Counter(
            "orthornn_inputs_out_of_range",
            "requests with an input far outside the model's training range (answered with "
            "an Orthornn-Input-Warning header)", ["model", "version"], registry=r)
        self.inflight = Gauge("orthornn_inflight_requests", "requests being answered",
                              registry=r)
        self.held = Counter(
            "orthornn_held_connections",
            "connections refused with 503 and then held (not read) until their Retry-After "
            "passed (hold_refused, eager listener)", registry=r)
        self.evicted = Counter(
            "orthornn_evicted_bodies",
            "request bodies still being received after the grace period, evicted (503) "
            "because they held the most of a full max_receiving_bytes budget", registry=r)
        self.slow_client_closes = Counter(
            "orthornn_slow_client_closes",
            "connections closed because a request's head (phase=head) or body (phase=body) "
            "did not arrive within header_timeout_s or body_timeout_s", ["phase"], registry=r)
        self.queue_depth = Gauge("orthornn_queue_depth", "sequences waiting for a batch",
                                 ["model"], registry=r)

    def _loop_metrics(self, r: CollectorRegistry) -> None:
        """The loop: capture's records and drops, labels, live drift (docs/drift.md)."""
        self.capture_records = Tally(
            "orthornn_capture_records", "answered requests whose record capture wrote "
            "(--capture)", "model", r)
        self.capture_dropped = Tally(
            "orthornn_capture_dropped", "sampled records capture did not write, by reason: "
            "disk_full, read_only, error; torn: a killed writer's last line, cut "
            "at the restart", "reason", r)
        self.capture_uploads = Counter(
            "orthornn_capture_uploads", "closed capture segments uploaded to the bucket "
            "(--capture s3://...), by outcome: uploaded, or failed (kept in the spool and "
            "tried again a second later)", ["outcome"], registry=r)
        self.labels_received = Counter(
            "orthornn_labels_received", "labels accepted by POST /v2/models/{name}/labels",
            ["model"], registry=r)
        self.drift_score = Gauge(
            "orthornn_drift_score", "the latest window's drift test statistic over its "
            "calibrated alarm threshold (>= 1: this test alarms), per test",
            ["model", "version", "test"], registry=r)
        self.drift_detected = Gauge(
            "orthornn_drift_detected", "1 while the latest live window of the version "
            "alarms on any drift test (after the multiple-test correction), else 0",
            ["model", "version"], registry=r)

    def _session_metrics(self, r: CollectorRegistry) -> None:
        """Server-side sessions and their store."""
        self.sessions_active = Gauge("orthornn_sessions_active",
                                     "open server-side sessions (state kept in the service)",
                                     registry=r)
        self.session_starts = Counter("orthornn_session_starts", "sessions started",
                                      ["model"], registry=r)
        self.session_ends = Counter("orthornn_session_ends", "sessions ended by the client",
                                    ["model"], registry=r)
        self.session_expiries = Counter("orthornn_session_expiries",
                                        "sessions ended after their idle timeout", ["model"],
                                        registry=r)
        self.session_store_duration = Histogram(
            "orthornn_session_store_duration_seconds",
            "time of one session store call, by store (memory, redis) and operation (create, "
            "get, advance, finish, delete, count, versions_in_use, ping)", ["store", "operation"],
            buckets=LATENCY_BUCKETS, registry=r)
        self.session_store_errors = Counter(
            "orthornn_session_store_errors",
            "session store calls that failed for want of the store (timeout, connection "
            "or Redis error; answered 503), by store and operation", ["store", "operation"],
            registry=r)
        self.session_store_up = Gauge(
            "orthornn_session_store_up",
            "1 while the session store answered its last call from the reconcile task "
            "(every second), 0 while it does not (session requests then get 503)",
            registry=r)
        self.session_version_loads = Counter(
            "orthornn_session_version_loads",
            "session versions this replica did not have and loaded from the repository "
            "on demand, by result: loaded, refused (did not verify), missing (gone from "
            "the repository; those two end the session with 409)", ["model", "result"],
            registry=r)

    def _model_metrics(self, r: CollectorRegistry) -> None:
        """Model versions: loads, promotion, swaps, evaluation, the transition's spectrum."""
        self.loaded = Gauge(
            "orthornn_model_loaded", "1 for every loaded (served) model version",
            ["model", "version", "arch", "mode"], registry=r)
        self.loads = Counter(
            "orthornn_model_loads", "model versions loaded (verified, warmed and served, or "
            "kept for sessions)", ["model"], registry=r)
        self.promoted_version = Gauge(
            "orthornn_model_promoted",
            "1 for the promoted version of each model (promotion.json), as last read",
            ["model", "version"], registry=r)
        self.promotion_unreadable = Gauge(
            "orthornn_model_promotion_unreadable",
            "1 while a model's promotion.json is there but cannot be read (empty, garbled) or "
            "is gone after it was read: the versions it served keep serving, unchanged "
            "(nothing, at start-up), until it is readable again (then 0)", ["model"],
            registry=r)
        self.repository_errors = Counter(
            "orthornn_repository_errors", "polls of a repository in a bucket (--repo s3://...) "
            "that failed (the store down or refusing): the loaded versions kept serving",
            registry=r)
        self.swaps = Counter(
            "orthornn_model_swaps", "times another version took over the requests that name "
            "no version (a newer one, a promotion or a rollback)", ["model"], registry=r)
        self.promotions = Counter(
            "orthornn_model_promotions",
            "changes of the promoted version (promotion.json) seen while serving, by the "
            "action of their history entry: publish, promote, rollback", ["model", "action"],
            registry=r)
        self.evaluation = Gauge(
            "orthornn_model_evaluation",
            "the version's score on its task's test split (the manifest's evaluation: "
            "accuracy, mse, cross_entropy or perplexity)", ["model", "version", "metric"],
            registry=r)
        self.load_failures = Counter(
            "orthornn_model_load_failures", "versions refused (verification or load failed)",
            ["model"], registry=r)
        self.sigma_min = Gauge(
            "orthornn_transition_sigma_min",
            "smallest singular value of the transition matrix (from the manifest)",
            ["model", "version"], registry=r)
        self.sigma_max = Gauge(
            "orthornn_transition_sigma_max",
            "largest singular value of the transition matrix (from the manifest)",
            ["model", "version"], registry=r)
        self.orthogonality_error = Gauge(
            "orthornn_transition_orthogonality_error",
            "||W^T W - I||_2 of the transition matrix (from the manifest)",
            ["model", "version"], registry=r)

    def _rollout_metrics(self, r: CollectorRegistry) -> None:
        """Rollouts (export.artifacts.rollout): this replica's view of the running one."""
        self.rollout_stage = Gauge(
            "orthornn_rollout_stage", "the running rollout's stage: 0 is the first (shadow, "
            "when it has one), then one per canary step", ["model", "candidate"], registry=r)
        self.rollout_weight = Gauge(
            "orthornn_rollout_weight", "the percentage of new requests and sessions the "
            "running rollout routes to its candidate (0 in shadow)", ["model", "candidate"],
            registry=r)
        self.shadow_agreement = Gauge(
            "orthornn_shadow_agreement", "the candidate's top-1 agreement with the promoted "
            "version on the requests this replica shadowed in the current stage",
            ["model", "candidate"], registry=r)
        self.shadow_skipped = Counter(
            "orthornn_shadow_skipped", "shadow runs skipped because the inference queue was "
            "busy", ["model"], registry=r)

    @staticmethod
    def _evaluation(manifest: Manifest) -> tuple[str, float] | None:
        """(metric, value) of a manifest's evaluation with a finite numeric value."""
        evaluation = getattr(manifest, "evaluation", None)
        if not isinstance(evaluation, dict):
            return None
        metric, value = evaluation.get("metric"), evaluation.get("value")
        if isinstance(metric, str) and metric and is_number(value):
            return metric, float(cast(float, value))  # is_number: a finite int or float
        return None

    def model_loaded(self, manifest: Manifest) -> None:
        name, version = manifest.name, str(manifest.version)
        self.loaded.labels(name, version, manifest.arch, manifest.mode).set(1)
        self.loads.labels(name).inc()
        self.load_failures.labels(name)  # at 0 from the first load: increase() sees the first
        spectral = manifest.spectral or {}
        for gauge, key in ((self.sigma_min, "sigma_min"), (self.sigma_max, "sigma_max"),
                           (self.orthogonality_error, "orthogonality_error")):
            if isinstance(spectral.get(key), int | float):
                gauge.labels(name, version).set(float(spectral[key]))
        evaluation = self._evaluation(manifest)
        if evaluation is not None:
            self.evaluation.labels(name, version, evaluation[0]).set(evaluation[1])

    def model_released(self, manifest: Manifest) -> None:
        name, version = manifest.name, str(manifest.version)
        for gauge, labels in ((self.loaded, (name, version, manifest.arch, manifest.mode)),
                              (self.sigma_min, (name, version)), (self.sigma_max, (name, version)),
                              (self.orthogonality_error, (name, version))):
            with contextlib.suppress(KeyError):
                gauge.remove(*labels)
        evaluation = self._evaluation(manifest)
        if evaluation is not None:
            with contextlib.suppress(KeyError):
                self.evaluation.remove(name, version, evaluation[0])

    def promoted(self, name: str, version: int | None) -> None:
        """The promoted version of NAME (None: none is)."""
        label = None if version is None else str(version)
        before = self._promoted.get(name)
        if before == label:
            return
        if before is not None:
            with contextlib.suppress(KeyError):
                self.promoted_version.remove(name, before)
        if label is None:
            self._promoted.pop(name, None)
        else:
            self._promoted[name] = label
            self.promoted_version.labels(name, label).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
