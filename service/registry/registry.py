"""The model registry: scans REPO/<name>/<version>/, loads and verifies versions with
``export.package`` (sha256 of every file, then the golden outputs on the very sessions
that will serve), warms them up and swaps them in atomically.

A request without a version gets the model's default version: the promoted one
(REPO/<name>/promotion.json, ``export.repository``) when it is loaded, else the newest
loaded one. A promoted version that does not verify is never served: what was served
keeps serving. A change of promotion.json (a promotion, a rollback) is found by the same
scan as a new version, and swaps the same way.

A request holds its version (``acquire``/``release``): a version swapped out keeps
running what it holds and is released (batcher stopped) when the last of those requests
finishes. A version that fails verification is never served, the failure is logged and
counted, and it is not retried until its files change.

Server-side sessions are pinned to a version and may continue on any replica sharing the
session store, so a version is also *kept* for sessions (``session_version``, ``keep``):
a kept version stays loaded across hot swaps until ``retain`` (the dataplane's reconcile
task, from the store's ``versions_in_use``) finds no open session on it. A replica that
lacks a session's version loads it on demand (``load_session_version``), verified like any
load, outside the version policy (it serves only sessions), and counted; a version that is
gone from the repository or no longer verifies is ``VersionGone`` (409 naming it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

from orthornn.export.package import (
    Manifest,
    PackageError,
    check_hashes,
    golden_check,
    read_manifest,
)
from orthornn.export.repository import (
    ACTIONS,
    NAME,
    check_name,
    read_promotion,
    versions,
)
from orthornn.export.repository import rollback as rollback_promotion

from ..dataplane.outputs import prepare_rows
from ..errors import NotFound, RollbackRefused, VersionGone
from ..metrics import Metrics
from ..settings import Settings
from .batcher import Batcher
from .runtime import ModelSpec, Runtime

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


@dataclass(eq=False)
class ModelVersion:
    name: str
    version: int
    path: Path
    manifest: Manifest
    spec: ModelSpec
    runtime: Runtime
    batcher: Batcher
    loaded_at: float = field(default_factory=time.time)
    inflight: int = 0  # requests and sessions holding this version (acquire() .. release())
    generating: int = 0  # of those, /generate calls (they never reach the batcher)
    sessions: int = 0  # of those, the hold that keeps it loaded for sessions (0 or 1)
    steps_batcher: Batcher | None = None  # classify / regress: the per-step graph
    retired: bool = False
    released: bool = False

    @property
    def batchers(self) -> list[Batcher]:
        return [b for b in (self.batcher, self.steps_batcher) if b is not None]


def _signature(path: Path) -> tuple:
    """Changes when any file of a version directory changes (a half-written version that
    is completed later is tried again)."""
    try:
        entries = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir())
    except OSError:
        return ()
    return (path.stat().st_mtime_ns, *entries)


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics, executor: Executor,
                 providers: list[str]):
        self.settings = settings
        self.metrics = metrics
        self.executor = executor
        self.providers = providers
        self.repo = Path(settings.repo)
        self._lock = threading.RLock()
        self._load_lock = threading.Lock()  # one loader at a time (poller or API)
        self._serving: dict[str, dict[int, ModelVersion]] = {}
        self._default: dict[str, int] = {}  # the version a request without one gets
        self._promoted: dict[str, int | None] = {}  # promotion.json's version (last scan)
        self._promotion: dict[str, dict] = {}  # the last readable promotion.json
        self._promotion_error: dict[str, str] = {}  # unreadable promotion.json (logged once)
        self._not_served: dict[str, int] = {}  # a promoted version not served (logged once)
        self._rollback_lock = threading.Lock()
        self._failed: dict[tuple[str, int], tuple[tuple, str]] = {}
        self._unloaded: set[str] = set()
        # versions kept loaded for sessions, each held once (inflight and sessions + 1)
        # until retain() finds no session on it; the time each was last kept
        self._kept: dict[tuple[str, int], ModelVersion] = {}
        self._kept_at: dict[tuple[str, int], float] = {}
        self._configured: set[str] = set(settings.models)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.scanned = threading.Event()  # the start-up scan has finished

    # -- lookups (event loop) ---------------------------------------------------------

    def acquire(self, name: str, version: int | None = None) -> ModelVersion:
        """The requested (default: the promoted, else the newest) serving version, held
        until release() (a retired version is released when its last hold is)."""
        with self._lock:
            loaded = self._serving.get(name)
            if not loaded:
                raise NotFound(f"model {name!r} is not loaded")
            if version is None:
                version = self._default.get(name)
                if version not in loaded:
                    version = max(loaded)
            mv = loaded.get(version)
            if mv is None:
                raise NotFound(f"model {name!r} has no loaded version {version} "
                               f"(loaded: {sorted(loaded)})")
            mv.inflight += 1
            return mv

    def release(self, mv: ModelVersion) -> None:
        with self._lock:
            mv.inflight -= 1
            done = mv.retired and mv.inflight == 0 and not mv.released
            if done:
                mv.released = True
        if done:
            self._free(mv)

    def serving(self) -> dict[str, list[int]]:
        with self._lock:
            return {name: sorted(vs) for name, vs in self._serving.items() if vs}

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        """A serving version without holding it (metadata)."""
        mv = self.acquire(name, version)
        with self._lock:
            mv.inflight -= 1
        return mv

    # -- versions kept for sessions (event loop; load_session_version in a thread) ------

    def session_version(self, name: str, version: int) -> ModelVersion | None:
        """VERSION of NAME held for one session chunk (release() it), and kept for
        sessions from now on: a serving version or one kept for sessions; None when this
        replica has not loaded it."""
        with self._lock:
            mv = (self._serving.get(name) or {}).get(version) or \
                self._kept.get((name, version))
            if mv is None or mv.released:
                return None
            mv.inflight += 1
            self._keep(mv)
            return mv

    def keep(self, mv: ModelVersion) -> None:
        """Keep MV loaded for sessions (until retain() finds none on it)."""
        with self._lock:
            if not mv.released:
                self._keep(mv)

    def _keep(self, mv: ModelVersion) -> None:  # under self._lock
        key = (mv.name, mv.version)
        if self._kept.get(key) is not mv:
            old = self._kept.pop(key, None)
            if old is not None and self._unkeep(old):  # (another copy: never in practice)
                self._free(old)
            mv.inflight += 1
            mv.sessions += 1
            self._kept[key] = mv
        self._kept_at[key] = time.monotonic()

    def _unkeep(self, mv: ModelVersion) -> bool:  # under self._lock; whether to free it
        mv.inflight -= 1
        mv.sessions -= 1
        if mv.retired and mv.inflight == 0 and not mv.released:
            mv.released = True
            return True
        return False

    def kept(self) -> dict[str, list[int]]:
        """The versions kept loaded for sessions, by model."""
        with self._lock:
            out: dict[str, list[int]] = {}
            for name, version in sorted(self._kept):
                out.setdefault(name, []).append(version)
            return out

    def retain(self, in_use: dict[str, set[int]], since: float) -> list[ModelVersion]:
        """Keep the versions loaded here that open sessions use (IN_USE, as the store read
        it no earlier than SINCE, a time.monotonic()); stop keeping the others not kept
        since then, releasing those no longer served once nothing holds them. The
        versions released."""
        free = []
        with self._lock:
            for name, used in in_use.items():
                for version in used:
                    mv = (self._serving.get(name) or {}).get(version) or \
                        self._kept.get((name, version))
                    if mv is not None and not mv.released:
                        self._keep(mv)
            for key in [k for k, mv in self._kept.items()
                        if k[1] not in in_use.get(k[0], ()) and self._kept_at[k] < since]:
                mv = self._kept.pop(key)
                del self._kept_at[key]
                if self._unkeep(mv):
                    free.append(mv)
        for mv in free:
            self._free(mv)
        return free

    def load_session_version(self, name: str, version: int) -> ModelVersion:
        """VERSION of NAME held for one session chunk (release() it), loaded now if this
        replica has not loaded it: verified like any load, kept for sessions, outside the
        version policy (requests without a session never get it). VersionGone (409) when
        it is not in the repository, does not verify, or NAME was unloaded here. Blocking:
        run it in a thread."""
        mv = self.session_version(name, version)
        if mv is not None:
            return mv
        with self._load_lock:  # one loader at a time (this, the poller or the API)
            mv = self.session_version(name, version)
            if mv is not None:
                return mv
            where = f"model {name!r} version {version}"
            if name in self._unloaded:
                raise VersionGone(f"{where}, whose model was unloaded from this replica "
                                  f"(repository API)")
            try:
                path = self.repo / check_name(name) / str(version)
            except ValueError:
                raise VersionGone(f"{where}, which is not a model of the repository") \
                    from None
            if not (path / "manifest.json").is_file():
                self.metrics.session_version_loads.labels(name, "missing").inc()
                raise VersionGone(f"{where}, which is no longer in the repository")
            sig = _signature(path)
            failed = self._failed.get((name, version))
            reason = failed[1] if failed is not None and failed[0] == sig else None
            if reason is None:
                start = time.perf_counter()
                try:
                    mv = self.load_version(name, version)
                except (PackageError, OSError) as error:
                    reason = str(error)
                    self._failed[(name, version)] = (sig, reason)
                    self.metrics.load_failures.labels(name).inc()
                    log.error("refused %s version %d (for a session): %s", name, version,
                              error)
                else:
                    log.info("loaded %s version %d for its sessions in %.2f s", name,
                             version, time.perf_counter() - start)
            if mv is None:
                self.metrics.session_version_loads.labels(name, "refused").inc()
                raise VersionGone(f"{where}, which no longer verifies ({reason})")
            with self._lock:
                mv.retired = True  # not served: released once no session keeps it
                mv.inflight += 1  # this chunk's hold
                self._keep(mv)
            self.metrics.session_version_loads.labels(name, "loaded").inc()
            self.metrics.model_loaded(mv.manifest)
            return mv

    def promoted(self, name: str) -> int | None:
        """The version promotion.json promotes (as the last scan read it), or None (no
        file, or an unreadable one); it serves unless it failed verification."""
        with self._lock:
            return self._promoted.get(name)

    def ready(self) -> bool:
        return self.scanned.is_set() and not self.waiting_for()

    def waiting_for(self) -> list[str]:
        """The configured models that readiness waits for (none loaded yet)."""
        with self._lock:
            return sorted(n for n in self._configured - self._unloaded
                          if not self._serving.get(n))

    def model_ready(self, name: str, version: int | None = None) -> bool:
        with self._lock:
            loaded = self._serving.get(name) or {}
            return bool(loaded) if version is None else version in loaded

    def index(self) -> list[dict]:
        """Every model version in the repository with its state (Triton's index)."""
        rows = []
        names = set(self._model_names()) | set(self._serving)
        with self._lock:
            for name in sorted(names):
                loaded = self._serving.get(name, {})
                on_disk = versions(self.repo / name)
                promoted = self._promoted.get(name)
                for v in sorted(set(on_disk) | set(loaded)):
                    if v in loaded:
                        state, reason = "READY", ""
                    elif (name, v) in self._failed:
                        state, reason = "UNAVAILABLE", self._failed[(name, v)][1]
                    elif name in self._unloaded:
                        state, reason = "UNAVAILABLE", "unloaded"
                    elif promoted is not None and v != promoted:
                        state, reason = "UNAVAILABLE", (f"not loaded (version policy; version "
                                                        f"{promoted} is promoted)")
                    else:
                        state, reason = "UNAVAILABLE", "not loaded (version policy)"
                    rows.append({"name": name, "version": str(v), "state": state,
                                 "reason": reason})
        return rows

    # -- loading (background thread or the repository API) ----------------------------

    def _model_names(self) -> list[str]:
        if not self.repo.is_dir():
            return []
        return sorted(p.name for p in self.repo.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and NAME.match(p.name))

    def load_version(self, name: str, version: int) -> ModelVersion:
        """Verify, load and warm one version; PackageError when it must not be served."""
        path = self.repo / name / str(version)
        manifest = read_manifest(path)
        if manifest.name != name or manifest.version != version:
            raise PackageError(f"manifest says {manifest.name!r} version "
                               f"{manifest.version!r}, directory is {name}/{version}")
        check_hashes(path, manifest)
        spec = ModelSpec.from_manifest(manifest, path, self.settings.max_token_length)
        runtime = Runtime(path, manifest, self.providers, self.settings.inference_threads)
        try:  # the golden check runs on the sessions that will serve
            golden_check(path, manifest, sessions=runtime.sessions)
            runtime.warm_up(spec, min(self.settings.max_batch_size, 4))
        except PackageError:
            raise
        except Exception as error:
            raise PackageError(f"golden check could not run: {error}") from None
        s = self.settings

        def batcher(graph: str) -> Batcher:
            return Batcher(lambda seqs: runtime.run_padded(spec, seqs, graph), self.executor,
                           max_batch_size=s.max_batch_size,
                           max_queue_delay_ms=s.max_queue_delay_ms,
                           max_queue_size=s.max_queue_size, workers=s.inference_workers,
                           enabled=s.batching, metrics=self.metrics, model=name,
                           prepare=(lambda rows: prepare_rows(spec, rows)) if graph == "model"
                           else None)
        mv = ModelVersion(name, version, path, manifest, spec, runtime, batcher("model"))
        if "steps" in runtime.sessions:
            mv.steps_batcher = batcher("steps")
        for b in mv.batchers:  # sessions wait between requests: they are not on their way
            b.holders = lambda: mv.inflight - mv.generating - mv.sessions
        return mv

    def _read_promotion(self, name: str) -> int | None:
        """The promoted version of NAME from promotion.json (None: no file); counts the
        promotions since the last reading. An unreadable file (logged once) keeps the last
        good reading: a passing read error on a shared volume must not swap to the newest
        version, which may be one that was rolled back (None when there never was one)."""
        try:
            record = read_promotion(self.repo / name)
        except ValueError as error:
            last = self._promotion.get(name, {}).get("version")
            if self._promotion_error.get(name) != str(error):
                log.error("%s: %s; %s", name, error,
                          f"keeping version {last}, the last promoted one read" if last
                          else "serving as if no version were promoted (the newest verified)")
                self._promotion_error[name] = str(error)
            with self._lock:
                self._promoted[name] = last
            return last
        if self._promotion_error.pop(name, None) is not None:
            log.info("%s: promotion.json is readable again", name)
        before = self._promotion.get(name)
        if before is not None:  # the history found at the first reading is not counted
            for action in promotion_changes(before, record):
                self.metrics.promotions.labels(name, action).inc()
        if record["version"] is not None and (before is None
                                              or before["version"] != record["version"]):
            log.info("%s: version %d is promoted", name, record["version"])
        self._promotion[name] = record
        with self._lock:
            self._promoted[name] = record["version"]
        return record["version"]

    def sync_model(self, name: str) -> list[str]:
        """Apply the version policy to one model; returns the errors of refused versions.

        Under "latest" the promoted version is loaded first, then the newest others up to
        keep_versions; when the promoted version is refused (or missing), what served
        requests without a version keeps serving (at start-up: the newest version below
        the promoted one, else the newest)."""
        errors: list[str] = []
        with self._load_lock:
            on_disk = sorted(versions(self.repo / name), reverse=True)
            promoted = self._read_promotion(name)
            with self._lock:
                current = dict(self._serving.get(name, {}))
                served = self._default.get(name)
            keep: dict[int, ModelVersion] = {}
            s = self.settings

            def take(v: int) -> None:
                if v in keep or (s.version_policy == "latest" and len(keep) >= s.keep_versions):
                    return
                if v in current:
                    keep[v] = current[v]
                    return
                with self._lock:  # kept for sessions (retired or loaded for them): serve it
                    kept = self._kept.get((name, v))
                    if kept is not None and not kept.released:
                        kept.retired = False
                        keep[v] = kept
                        return
                sig = _signature(self.repo / name / str(v))
                failed = self._failed.get((name, v))
                if failed is not None and failed[0] == sig:
                    errors.append(f"version {v}: {failed[1]}")
                    return
                start = time.perf_counter()
                try:
                    mv = self.load_version(name, v)
                except (PackageError, OSError) as error:
                    self._failed[(name, v)] = (sig, str(error))
                    self.metrics.load_failures.labels(name).inc()
                    log.error("refused %s version %d: %s", name, v, error)
                    errors.append(f"version {v}: {error}")
                    return
                self._failed.pop((name, v), None)
                log.info("loaded %s version %d (%s, %s) in %.2f s", name, v,
                         mv.manifest.arch, mv.manifest.mode,
                         time.perf_counter() - start)
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
            default = self._default_version(name, promoted, served, keep)
            self._swap(name, current, keep, default)
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
            reason = self._failed.get((name, promoted), ((), "not in the repository"))[1]
            log.error("%s: the promoted version %d is not served (%s); version %d serves "
                      "requests without a version", name, promoted, reason, default)
        return default

    def _swap(self, name: str, current: dict[int, ModelVersion],
              keep: dict[int, ModelVersion], default: int | None = None) -> None:
        retired = [mv for v, mv in current.items() if v not in keep]
        added = [mv for v, mv in keep.items() if v not in current]
        with self._lock:
            before = self._default.get(name)
            if not retired and not added and default == before:
                return
            if keep:
                self._serving[name] = dict(keep)
                self._default[name] = default if default in keep else max(keep)
            else:
                self._serving.pop(name, None)
                self._default.pop(name, None)
            after = self._default.get(name)
            free = []
            for mv in retired:
                mv.retired = True
                if mv.inflight == 0 and not mv.released:
                    mv.released = True
                    free.append(mv)
        for mv in added:
            self.metrics.model_loaded(mv.manifest)
        if before is not None and after is not None and after != before:
            self.metrics.swaps.labels(name).inc()
            log.info("%s: version %d now serves (was %d)", name, after, before)
        for mv in free:
            self._free(mv)

    def _free(self, mv: ModelVersion) -> None:
        """Release a retired version once nothing holds it."""
        self.metrics.model_released(mv.manifest)
        log.info("released %s version %d", mv.name, mv.version)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            for batcher in mv.batchers:
                if running is loop:
                    loop.create_task(batcher.close())
                else:
                    asyncio.run_coroutine_threadsafe(batcher.close(), loop)
        mv.runtime.sessions.clear()

    def scan(self) -> None:
        for name in self._model_names():
            if self._stop.is_set():
                return
            if name not in self._unloaded:
                self.sync_model(name)
        with self._lock:  # models whose directory vanished
            gone = [n for n in self._serving if not (self.repo / n).is_dir()]
        for name in gone:
            self.sync_model(name)

    def _model_dir(self, name: str) -> Path:
        """REPO/NAME of a model with versions in the repository; NotFound otherwise."""
        try:
            model_dir = self.repo / check_name(name)
        except ValueError:
            raise NotFound(f"model {name!r} is not in the repository") from None
        if not model_dir.is_dir() or not versions(model_dir):
            raise NotFound(f"model {name!r} is not in the repository")
        return model_dir

    def load(self, name: str) -> list[str]:
        """The repository API's load: (re)load NAME now, retrying refused versions."""
        self._model_dir(name)
        with self._load_lock:
            self._unloaded.discard(name)
            for key in [k for k in self._failed if k[0] == name]:
                del self._failed[key]
        return self.sync_model(name)

    def rollback(self, name: str, version: int | None = None) -> dict:
        """The repository API's rollback: promote VERSION (default: the version promoted
        before the current one) once it verifies, by ``export.repository.rollback`` (the
        rule ``orthornn rollback`` follows too), then sync NAME at once so the swap does not
        wait for the next scan. {"model", "promoted", "previous"}; RollbackRefused names
        the usable versions. An unloaded model stays unloaded (only its promotion moves)."""
        model_dir = self._model_dir(name)
        with self._rollback_lock:  # one promotion change at a time from this service
            try:
                done = rollback_promotion(model_dir, version)
            except ValueError as error:
                raise RollbackRefused(str(error)) from None
            except OSError as error:  # e.g. the repository is mounted read-only here
                raise RollbackRefused(
                    f"the model repository cannot be written here ({error}); mount it "
                    f"writable for the service (Helm: persistence.readOnlyInServer=false) or "
                    f"run `orthornn rollback --repo REPO --name {name}` where it is") from None
        log.info("%s: rolled back to version %d (was %d) through the repository API", name,
                 done["promoted"], done["previous"])
        if name not in self._unloaded:
            self.sync_model(name)
        return done

    def unload(self, name: str) -> None:
        with self._load_lock:
            with self._lock:
                current = dict(self._serving.get(name, {}))
                if not current and name not in self._model_names():
                    raise NotFound(f"model {name!r} is not loaded")
                self._unloaded.add(name)
            self._swap(name, current, {})

    # -- lifecycle -------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="orthornn-repository",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if not self._configured:
                self._configured = {n for n in self._model_names() if versions(self.repo / n)}
                if not self._configured:
                    log.warning(
                        "the model repository %s holds no model versions: the service reports "
                        "ready with nothing to serve; models published later are loaded "
                        "%s (readiness does not wait for them; --models NAME,... makes it)",
                        self.repo, f"within {self.settings.poll_interval_s:g} s"
                        if self.settings.poll_interval_s > 0 else "by the repository API only")
            self.scan()
        except Exception:  # never let the poller die silently
            log.exception("repository scan failed")
        finally:
            self.scanned.set()
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

    async def close(self) -> None:
        self.stop()
        with self._lock:
            everything = {id(mv): mv for vs in self._serving.values() for mv in vs.values()}
            everything.update((id(mv), mv) for mv in self._kept.values() if not mv.released)
            self._serving.clear()
            self._kept.clear()
            self._kept_at.clear()
        for mv in everything.values():
            for batcher in mv.batchers:
                await batcher.close()
            self.metrics.model_released(mv.manifest)
