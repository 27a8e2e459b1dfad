"""The version policy: which versions of each model serve, from scans of
REPO/<name>/<version>/ and REPO/<name>/promotion.json (``export.artifacts.repository``),
and the repository API (load, unload, rollback).

A request without a version gets the model's default version: the promoted one when it
is loaded, else the newest loaded one. A promoted version that does not verify is never
served: what was served keeps serving. A change of promotion.json (a promotion, a
rollback) is found by the same scan as a new version, and swaps the same way
(``Catalog.swap``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from orthornn.export.artifacts import rollout
from orthornn.export.artifacts.repository import (
    ACTIONS,
    PROMOTION,
    Location,
    check_name,
    read_promotion,
    versions,
)
from orthornn.export.artifacts.rollback import rollback as rollback_promotion
from orthornn.export.artifacts.rollout import Plan, RolloutError, Thresholds, read_plan

from ..errors import NotFound, RollbackRefused, ServiceError
from ..metrics import Metrics
from ..settings import Settings
from .bucket import BucketMirror
from .catalog import Catalog, ModelVersion, model_names
from .controller import Controller
from .loader import Loader
from .pins import SessionPins
from .rollouts import Rollouts

log = logging.getLogger("orthornn.service")


def promotion_changes(before: dict, after: dict) -> list[str]:
    """The actions (publish, promote, rollback; "unknown" for an entry without one) of the
    changes of the promoted version between two readings of promotion.json: the history
    entries added since the earlier reading (less any that re-promotes the version already
    promoted), or, when the history was rewritten, one change if the version differs."""
    old, new = before["history"], after["history"]
    if len(new) > len(old) and new[:len(old)] == old:
        added = [e for e in new[len(old):]
                 if not (isinstance(e, dict) and e.get("previous") == e.get("version"))]
    elif after["version"] != before["version"]:
        added = new[-1:] or [None]
    else:
        return []
    return [e["action"] if isinstance(e, dict) and e.get("action") in ACTIONS else "unknown"
            for e in added]


class VersionPolicy:
    def __init__(self, settings: Settings, metrics: Metrics, catalog: Catalog,
                 loader: Loader, pins: SessionPins, rollouts: Rollouts):
        self.settings = settings
        self.metrics = metrics
        self.catalog = catalog
        self.loader = loader
        self.pins = pins
        self.rollouts = rollouts
        self.repo = Path(settings.repo)
        # a bucket's models are mirrored into self.repo before each scan; whether a
        # replica may write the bucket is not known before it tries: its controller runs
        # when asked for ("on"), not on "auto"
        self.bucket = None if settings.repository_uri is None else BucketMirror(
            settings.repository_uri, self.repo, metrics)
        self.controls_rollouts = settings.rollout_controller == "on" or (
            settings.rollout_controller == "auto" and self.bucket is None
            and os.access(self.repo, os.W_OK))
        self._controllers: dict[str, Controller] = {}  # per model, when it controls
        self._plan_error: dict[str, str] = {}  # unreadable rollout.json (logged once)
        self._promotion: dict[str, dict] = {}  # the last readable promotion.json
        self._promotion_error: dict[str, str] = {}  # unreadable promotion.json (logged once)
        self._not_served: dict[str, int] = {}  # a promoted version not served (logged once)
        self._rollback_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_promotion(self, name: str, on_disk: list[int]) -> tuple[int | None, bool]:
        """(the promoted version of NAME from promotion.json, None: no file; whether the
        file could be read). Counts the promotions since the last reading. A file that
        cannot be read (present but empty, garbled, unreadable; or gone after it was read
        while versions remain: ON_DISK) is no reason to change what serves: the caller
        keeps NAME as it is, which this reports (logged once,
        ``orthornn_model_promotion_unreadable``, the model's metadata and the repository
        index) until the file is readable again. Never the newest version: it may be one
        that was rolled back."""
        path = self.repo / name / PROMOTION
        try:
            record = read_promotion(self.repo / name)
            if record["version"] is None and on_disk and \
                    (self._promotion.get(name) or {}).get("version"):
                raise ValueError(f"{str(path)!r} is gone (it promoted version "
                                 f"{self._promotion[name]['version']})")
        except ValueError as error:
            last = self._promotion.get(name, {}).get("version")
            if self._promotion_error.get(name) != str(error):
                served = self.catalog.default(name)
                log.error("%s: %s; %s", name, error,
                          f"keeping version {served} serving (version {last} was the last "
                          f"promoted one read)" if served is not None and last is not None
                          else f"keeping version {served} serving" if served is not None
                          else "serving nothing of it until the file is readable (never "
                               "the newest version: it may be one that was rolled back); "
                               "repair it with `orthornn rollback --to V`")
                self._promotion_error[name] = str(error)
            self.metrics.promotion_unreadable.labels(name).set(1)
            with self.catalog.lock:
                self.catalog.promotion_errors[name] = str(error)
            return last, False
        if self._promotion_error.pop(name, None) is not None:
            log.info("%s: promotion.json is readable again", name)
            self.metrics.promotion_unreadable.labels(name).set(0)
        before = self._promotion.get(name)
        if before is not None:  # the history found at the first reading is not counted
            for action in promotion_changes(before, record):
                self.metrics.promotions.labels(name, action).inc()
        if record["version"] is not None and (before is None
                                              or before["version"] != record["version"]):
            log.info("%s: version %d is promoted", name, record["version"])
        self._promotion[name] = record
        self.metrics.promoted(name, record["version"])
        with self.catalog.lock:
            self.catalog.promoted_versions[name] = record["version"]
            self.catalog.promotion_errors.pop(name, None)
        return record["version"], True

    def _read_plan(self, name: str) -> None:
        """NAME's rollout plan into ``rollouts`` (an unreadable one, logged once, keeps the
        last reading, as promotion.json does)."""
        try:
            plan = read_plan(self.repo / name)
        except ValueError as error:
            if self._plan_error.get(name) != str(error):
                log.error("%s: %s; keeping the last rollout plan read", name, error)
                self._plan_error[name] = str(error)
            return
        self._plan_error.pop(name, None)
        before = self.rollouts.plan(name)
        if plan is not None and (before is None or (before.id, before.state, before.stage)
                                 != (plan.id, plan.state, plan.stage)):
            log.info("%s: rollout %s of version %d: %s%s", name, plan.id, plan.candidate,
                     plan.state, f" {plan.where()}" if plan.running else f" ({plan.reason})")
        self.rollouts.update(name, plan)

    def control_rollout(self, name: str) -> None:
        """The in-process controller (``controls_rollouts``): one step of NAME's running
        rollout from this replica's tallies, when it holds the rollout's lease (a lease
        outlives three scans)."""
        report = self.rollouts.report(name)
        if report is None:
            return
        controller = self._controllers.get(name)
        if controller is None:
            ttl = 3 * max(self.settings.poll_interval_s, 1.0)
            controller = self._controllers[name] = Controller(self._location(name), ttl)
        try:
            controller.step([report])
        except (OSError, ValueError) as error:
            log.error("%s: the rollout controller could not write the plan: %s", name, error)
            return
        if self.bucket is not None:  # the plan as written, into the mirror
            self.bucket.sync(name)
        self.sync_model(name)

    def sync_model(self, name: str) -> list[str]:
        """Apply the version policy to one model; returns the errors of refused versions.

        Under "latest" the promoted version is loaded first, then the newest others up to
        keep_versions; when the promoted version is refused (or missing), what served
        requests without a version keeps serving (at start-up: the newest version below
        the promoted one, else the newest)."""
        errors: list[str] = []
        with self.loader.lock:
            on_disk = sorted(versions(self.repo / name), reverse=True)
            promoted, readable = self._read_promotion(name, on_disk)
            self._read_plan(name)
            if not readable:  # what serves keeps serving, as it is (nothing at start-up)
                return [f"{PROMOTION}: {self.catalog.promotion_errors.get(name)}"]
            candidate = self.rollouts.candidate(name)
            current = self.catalog.versions(name)
            served = self.catalog.default(name)
            keep: dict[int, ModelVersion] = {}
            s = self.settings

            def take(v: int, force: bool = False) -> None:
                if v in keep or (s.version_policy == "latest" and len(keep) >= s.keep_versions
                                 and not force):
                    return
                mv = current.get(v) or self.pins.revive(name, v)  # kept for sessions: serve it
                if mv is None:
                    loaded = self.loader.load(name, v)
                    if isinstance(loaded, str):
                        errors.append(f"version {v}: {loaded}")
                        return
                    mv = loaded
                keep[v] = mv

            rest = on_disk  # newest first
            if promoted is not None and promoted in on_disk:
                take(promoted)
            if promoted is not None and promoted not in keep:  # refused or missing
                if served is not None and served in on_disk:
                    take(served)
                rest = [v for v in on_disk if v < promoted] + \
                    [v for v in on_disk if v > promoted]
            for v in rest:
                take(v)
            if candidate is not None and candidate in on_disk:  # a rollout's: beyond the keep
                take(candidate, force=True)
            default = self._default_version(name, promoted, served, keep)
            self.catalog.swap(name, keep, default)
        return errors

    def _default_version(self, name: str, promoted: int | None, served: int | None,
                         keep: dict[int, ModelVersion]) -> int | None:
        """The version requests without one get: the promoted one when it is loaded, else
        (it was refused or is missing) the one that served them, else the newest loaded
        below it, else the newest loaded (no promotion: the newest loaded)."""
        if not keep:
            return None
        if promoted is None or promoted in keep:
            self._not_served.pop(name, None)
            return promoted if promoted in keep else max(keep)
        if served in keep:
            default = served
        else:
            default = max((v for v in keep if v < promoted), default=max(keep))
        if self._not_served.get(name) != promoted:
            self._not_served[name] = promoted
            reason = self.loader.refused(name, promoted) or "not in the repository"
            log.error("%s: the promoted version %d is not served (%s); version %d serves "
                      "requests without a version", name, promoted, reason, default)
        return default

    def scan(self, sync: bool = True) -> None:
        if sync and self.bucket is not None:
            self.bucket.sync()
        for name in model_names(self.repo):
            if self._stop.is_set():
                return
            if name not in self.catalog.unloaded:
                self.sync_model(name)
                if self.controls_rollouts and self.rollouts.running(name) is not None:
                    self.control_rollout(name)
        gone = [n for n in self.catalog.serving() if not (self.repo / n).is_dir()]
        for name in gone:  # models whose directory vanished
            self.sync_model(name)

    # -- the repository API ----------------------------------------------------------------

    def _model_dir(self, name: str) -> Path:
        """REPO/NAME of a model with versions in the repository; NotFound otherwise."""
        try:
            model_dir = self.repo / check_name(name)
        except ValueError:
            raise NotFound(f"model {name!r} is not in the repository") from None
        if not model_dir.is_dir() or not versions(model_dir):
            raise NotFound(f"model {name!r} is not in the repository")
        return model_dir

    def _location(self, name: str) -> Location:
        """Where NAME's records are written: its folder, or its URI in the bucket."""
        return self.repo / name if self.bucket is None else self.bucket.location(name)

    def load(self, name: str) -> list[str]:
        """The repository API's load: (re)load NAME now, retrying refused versions."""
        self._model_dir(name)
        with self.loader.lock:
            self.catalog.unloaded.discard(name)
            self.loader.forget(name)
        return self.sync_model(name)

    def rollback(self, name: str, version: int | None = None) -> dict:
        """The repository API's rollback: promote VERSION (default: the version promoted
        before the current one) once it verifies, by ``export.artifacts.rollback``
        (the rule ``orthornn rollback`` follows too), then sync NAME at once so the swap
        does not wait for the next scan. {"model", "promoted", "previous"}; RollbackRefused
        names the usable versions. An unloaded model stays unloaded (only its promotion
        moves)."""
        self._model_dir(name)
        with self._rollback_lock:  # one promotion change at a time from this service
            try:
                done = rollback_promotion(self._location(name), version)
            except ValueError as error:
                raise RollbackRefused(str(error)) from None
            except OSError as error:  # e.g. the repository is mounted read-only here
                raise RollbackRefused(
                    f"the model repository cannot be written here ({error}); mount it "
                    f"writable for the service (Helm: persistence.readOnlyInServer=false) or "
                    f"run `orthornn rollback --repo REPO --name {name}` where it is") from None
        log.info("%s: rolled back to version %d (was %s) through the repository API", name,
                 done["promoted"], done["previous"])
        self._apply_written(name)
        return done

    def start_rollout(self, name: str, candidate: int, shadow: float, steps: list[int],
                      interval_s: float, min_requests: int, thresholds: dict) -> Plan:
        """The repository API's rollout start (``orthornn rollout start``'s rules); the
        plan, applied here at once."""
        self._model_dir(name)
        return self._write_plan(name, lambda: rollout.start(
            self._location(name), candidate, shadow=shadow, steps=steps, interval_s=interval_s,
            min_requests=min_requests, thresholds=Thresholds(**thresholds)))

    def end_rollout(self, name: str, action: str) -> Plan:
        """The repository API's rollout promote or abort."""
        self._model_dir(name)
        return self._write_plan(name, lambda: rollout.end_by_hand(self._location(name),
                                                                  action))

    def _write_plan(self, name: str, write: Callable[[], Plan]) -> Plan:
        """WRITE the plan (start, promote, abort) and apply it here at once; its refusal
        as the status it carries, an unwritable repository as 409."""
        try:
            plan = write()
        except RolloutError as error:
            raise ServiceError(f"rollout of model {name!r}: {error}", error.status) from None
        except OSError as error:  # e.g. mounted read-only here, or the bucket down
            where = "here" if self.bucket is None else f"in {self.bucket.uri} now"
            raise RollbackRefused(
                f"the model repository cannot be written {where} ({error}); run `orthornn "
                f"rollout` where it is writable, or again") from None
        self._apply_written(name)
        return plan

    def _apply_written(self, name: str) -> None:
        """What the repository API has just written for NAME, applied here at once (a
        bucket's first mirrored): the swap does not wait for the next scan. An unloaded
        model stays unloaded."""
        if self.bucket is not None:
            self.bucket.sync(name)
        if name not in self.catalog.unloaded:
            self.sync_model(name)

    def unload(self, name: str) -> None:
        with self.loader.lock:
            with self.catalog.lock:
                if not self.catalog.versions(name) and name not in model_names(self.repo):
                    raise NotFound(f"model {name!r} is not loaded")
                self.catalog.unloaded.add(name)
            self.catalog.swap(name, {})

    # -- the poller ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="orthornn-repository",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        catalog = self.catalog
        try:
            if self.bucket is not None:  # the models readiness waits for are the bucket's
                self.bucket.sync()
            if not catalog.configured:
                catalog.configured = {n for n in model_names(self.repo)
                                      if versions(self.repo / n)}
                if not catalog.configured:
                    log.warning(
                        "the model repository %s holds no model versions: the service reports "
                        "ready with nothing to serve; models published later are loaded "
                        "%s (readiness does not wait for them; --models NAME,... makes it)",
                        self.repo, f"within {self.settings.poll_interval_s:g} s"
                        if self.settings.poll_interval_s > 0 else "by the repository API only")
            self.scan(sync=False)
        except Exception:  # never let the poller die silently
            log.exception("repository scan failed")
        finally:
            catalog.scanned.set()
        interval = self.settings.poll_interval_s
        while interval > 0 and not self._stop.wait(interval):
            try:
                self.scan()
            except Exception:
                log.exception("repository scan failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
