"""This replica's part in rollouts (``export.artifacts.rollout``): the plans read at each
repository scan, the routing and the shadow sampling they imply, and the tallies of what
this replica measured, per stage, which a controller adds across replicas (``report``).

The event loop asks (``candidate_for``, ``shadow_of``) and counts (``count``, ``time``,
``compared``...); the repository thread updates the plans (``update``). One lock guards
both; every call is a dict lookup or two, and without a running rollout nothing is counted.
"""

from __future__ import annotations

import contextlib
import random
import threading

from orthornn.export.artifacts.rollout import LATENCY_BOUNDS, Phase, Plan, Side, Tally
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from ..metrics import Metrics


def version_error(status: int) -> bool:
    """Whether an answer with STATUS is the version's failure: a 5xx other than 503 (the
    session store unavailable, or overload: the deployment's, not the version's). A 4xx
    (a bad body, a wrong shape, a missing model or session, a conflict, a rate limit) is
    the client's and never counts."""
    return status >= 500 and status != 503


class Rollouts:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self._lock = threading.Lock()
        self._plans: dict[str, Plan] = {}  # the last plan read per model (any state)
        self._running: dict[str, Plan] = {}  # the running ones
        self._tallies: dict[str, dict[int, Tally]] = {}  # of the running rollout, per stage
        self._random = random.Random()
        metrics.registry.register(_ComputeTimes(self))

    # -- the plans (repository thread) --------------------------------------------------

    def update(self, name: str, plan: Plan | None) -> None:
        """The plan of NAME as read now (None: none). A new rollout starts new tallies."""
        with self._lock:
            before = self._plans.get(name)
            if plan is None:
                self._plans.pop(name, None)
            else:
                self._plans[name] = plan
            running = plan if plan is not None and plan.running else None
            if running is None:
                self._running.pop(name, None)
            else:
                self._running[name] = running
                if before is None or before.id != running.id:
                    self._tallies[name] = {}
        self._export(name, before, running)

    def _export(self, name: str, before: Plan | None, running: Plan | None) -> None:
        m = self.metrics
        if before is not None and before.running and (running is None or running.id != before.id):
            for gauge in (m.rollout_stage, m.rollout_weight, m.shadow_agreement):
                with contextlib.suppress(KeyError):
                    gauge.remove(name, str(before.candidate))
        if running is not None:
            candidate = str(running.candidate)
            m.rollout_stage.labels(name, candidate).set(running.stage)
            m.rollout_weight.labels(name, candidate).set(running.weight())

    def plan(self, name: str) -> Plan | None:
        """The last plan read for NAME (running or finished)."""
        return self._plans.get(name)

    def running(self, name: str) -> Plan | None:
        return self._running.get(name)

    def candidate(self, name: str) -> int | None:
        """The candidate of NAME's running rollout (the registry keeps it loaded)."""
        plan = self._running.get(name)
        return None if plan is None else plan.candidate

    def ended_on_failures(self, name: str, version: int) -> str | None:
        """Why sessions on VERSION must end (409): its rollout was rolled back on errors."""
        plan = self._plans.get(name)
        if plan is None or plan.state != Phase.ROLLED_BACK or plan.candidate != version or \
                (plan.breach or {}).get("rule") != "max_error_rate":
            return None
        return f"version {version}'s rollout was rolled back ({plan.reason})"

    # -- routing (event loop) -------------------------------------------------------------

    def candidate_for(self, name: str, key: bytes) -> int | None:
        """The candidate, when a new request or session with routing KEY falls within the
        canary's weight; None: the promoted version."""
        plan = self._running.get(name)
        if plan is None:
            return None
        version = plan.place(key)
        return version if version == plan.candidate else None

    def shadow_of(self, name: str, version: int) -> int | None:
        """The candidate to shadow a request answered by VERSION with (the promoted one),
        for a sampled fraction of them; None: no shadow run."""
        plan = self._running.get(name)
        if plan is None or version != plan.promoted or self._random.random() >= plan.shadow:
            return None
        return plan.candidate

    # -- the tallies ----------------------------------------------------------------------

    def _tally(self, name: str) -> tuple[Plan, Tally] | None:
        plan = self._running.get(name)
        if plan is None:
            return None
        stages = self._tallies.setdefault(name, {})
        tally = stages.get(plan.stage)
        if tally is None:
            tally = stages[plan.stage] = Tally()
        return plan, tally

    def _side(self, name: str, version: int | None) -> Side | None:
        found = self._tally(name)
        if found is None or version is None:
            return None
        plan, tally = found
        if version == plan.candidate:
            return tally.candidate
        if version == plan.promoted:
            return tally.promoted
        return None

    def count(self, name: str | None, version: int | None, status: int,
              key: bytes | None = None, seconds: float | None = None,
              refused: bool = False) -> None:
        """One answered request that held VERSION of NAME, with its STATUS and compute time
        (SECONDS, None: it computed nothing). Counted only when the rollout placed it: KEY
        (its routing key; None: the client named the version, or states did) falls on
        VERSION under the current stage (``Plan.place``). Only the version's own failures are
        its errors: a 5xx other than 503 (``version_error``), or REFUSED (the candidate
        refused, 4xx, an input the promoted version takes). Any other 4xx is the client's
        and a 503 the deployment's: neither measures the version, so neither is counted at
        all (a flood of 4xx would otherwise dilute a version's error rate)."""
        failed = version_error(status) or (refused and status >= 400)
        if name is None or key is None or name not in self._running or \
                (status >= 400 and not failed):
            return
        with self._lock:
            plan = self._running.get(name)
            if plan is None or version is None or plan.place(key) != version:
                return
            side = self._side(name, version)
            if side is not None:
                side.requests += 1
                side.errors += failed
                if seconds is not None:
                    side.time(seconds)

    def time(self, name: str, version: int, seconds: float) -> None:
        """One compute time (queue and inference) of VERSION of NAME (a shadow run's: a
        live request's comes with its ``count``)."""
        if name not in self._running:
            return
        with self._lock:
            side = self._side(name, version)
            if side is not None:
                side.time(seconds)

    def compared(self, name: str, agreement: float, difference: float) -> None:
        with self._lock:
            found = self._tally(name)
            if found is None:
                return
            plan, tally = found
            tally.compared += 1
            tally.agreement += agreement
            tally.difference += difference
            self.metrics.shadow_agreement.labels(name, str(plan.candidate)).set(
                tally.agreement / tally.compared)

    def shadow_failed(self, name: str) -> None:
        with self._lock:
            found = self._tally(name)
            if found is not None:
                found[1].shadow_failures += 1

    def skipped(self, name: str) -> None:
        self.metrics.shadow_skipped.labels(name).inc()
        with self._lock:
            found = self._tally(name)
            if found is not None:
                found[1].skipped += 1

    def report(self, name: str) -> dict | None:
        """This replica's tallies of NAME's running rollout, for the controller:
        {"rollout": id, "stage": label, "stages": {"0": tally, ...}}; None: none."""
        with self._lock:
            plan = self._running.get(name)
            if plan is None:
                return None
            stages = {str(i): t.to_dict() for i, t in self._tallies.get(name, {}).items()}
        return {"rollout": plan.id, "stage": plan.stage_name, "stages": stages}


class _ComputeTimes(Collector):
    """``orthornn_rollout_compute_seconds{model,version}``: the running rollouts' two
    versions' compute times, made from the tallies when /metrics is read (nothing more to
    record per request); every fourth bound of the tallies' histogram."""

    STRIDE = 4

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def describe(self):  # type: ignore[no-untyped-def]  # the registry's own protocol
        return []

    def collect(self):  # type: ignore[no-untyped-def]
        family = HistogramMetricFamily(
            "orthornn_rollout_compute_seconds", "compute time (queue and inference) of a "
            "running rollout's two versions: the live requests it placed, and the "
            "candidate's shadow runs",
            labels=["model", "version"])
        rollouts = self.rollouts
        with rollouts._lock:
            for name, plan in rollouts._running.items():
                for version, pick in ((plan.promoted, "promoted"),
                                      (plan.candidate, "candidate")):
                    side = Side()
                    for tally in rollouts._tallies.get(name, {}).values():
                        side.add(getattr(tally, pick))
                    buckets, seen = [], 0
                    for i, count in enumerate(side.latency):
                        seen += count
                        if i < len(LATENCY_BOUNDS) and i % self.STRIDE == self.STRIDE - 1:
                            buckets.append((repr(LATENCY_BOUNDS[i]), seen))
                    buckets.append(("+Inf", seen))
                    family.add_metric([name, str(version)], buckets, side.seconds)
        yield family
