"""Versions pinned for server-side sessions.

A session runs on one version, and may continue on any replica sharing the session store,
so a version a session uses is *kept* (``session_version``, ``keep``): pinned, it stays
loaded across hot swaps until ``retain`` (the sessions' reconcile task, from the store's
``versions_in_use``) finds no open session on it. The pin is one lease of the version
(``ModelVersion.pinned``). A replica that lacks a session's version loads it on demand
(``load_session_version``), verified like any load, outside the version policy (it serves
only sessions), and counted; a version that is gone from the repository or no longer
verifies is ``VersionGone`` (409 naming it).
"""

from __future__ import annotations

import time

from orthornn.export.artifacts.repository import check_name

from ..errors import VersionGone
from ..metrics import Metrics
from .catalog import Catalog, ModelVersion
from .loader import Loader


class SessionPins:
    def __init__(self, catalog: Catalog, loader: Loader, metrics: Metrics):
        self.catalog = catalog
        self.loader = loader
        self.metrics = metrics
        # the versions kept for sessions (under the catalog's lock), and when each was
        # last kept (time.monotonic())
        self._kept: dict[tuple[str, int], ModelVersion] = {}
        self._kept_at: dict[tuple[str, int], float] = {}

    def _find(self, name: str, version: int) -> ModelVersion | None:
        """(Under the lock.) A serving version or one kept for sessions."""
        return self.catalog.find(name, version) or self._kept.get((name, version))

    def session_version(self, name: str, version: int) -> ModelVersion | None:
        """VERSION of NAME leased for one session chunk (release() it), and kept for
        sessions from now on: a serving version or one kept for sessions; None when this
        replica has not loaded it."""
        with self.catalog.lock:
            mv = self._find(name, version)
            if mv is None or mv.released:
                return None
            mv.leases += 1
            self._keep(mv)
            return mv

    def keep(self, mv: ModelVersion) -> None:
        """Keep MV loaded for sessions (until retain() finds none on it)."""
        with self.catalog.lock:
            if not mv.released:
                self._keep(mv)

    def _keep(self, mv: ModelVersion) -> None:  # under the lock
        key = (mv.name, mv.version)
        if self._kept.get(key) is not mv:
            old = self._kept.pop(key, None)
            if old is not None and self._unpin(old):  # (another copy: never in practice)
                self.catalog.free(old)
            mv.leases += 1
            mv.pinned = True
            self._kept[key] = mv
        self._kept_at[key] = time.monotonic()

    def _unpin(self, mv: ModelVersion) -> bool:  # under the lock; whether to free it
        mv.pinned = False
        return self.catalog.end_lease(mv)

    def kept(self) -> dict[str, list[int]]:
        """The versions kept loaded for sessions, by model."""
        with self.catalog.lock:
            out: dict[str, list[int]] = {}
            for name, version in sorted(self._kept):
                out.setdefault(name, []).append(version)
            return out

    def revive(self, name: str, version: int) -> ModelVersion | None:
        """VERSION of NAME if it is kept for sessions, served again (the version policy
        takes it back instead of loading it twice)."""
        with self.catalog.lock:
            mv = self._kept.get((name, version))
            if mv is None or mv.released:
                return None
            mv.retired = False
            return mv

    def retain(self, in_use: dict[str, set[int]], since: float) -> None:
        """Keep the versions loaded here that open sessions use (IN_USE, as the store read
        it no earlier than SINCE, a time.monotonic()); stop keeping the others not kept
        since then, releasing those no longer served once nothing leases them."""
        free = []
        with self.catalog.lock:
            for name, used in in_use.items():
                for version in used:
                    mv = self._find(name, version)
                    if mv is not None and not mv.released:
                        self._keep(mv)
            for key in [k for k in self._kept
                        if k[1] not in in_use.get(k[0], ()) and self._kept_at[k] < since]:
                mv = self._kept.pop(key)
                del self._kept_at[key]
                if self._unpin(mv):
                    free.append(mv)
        for mv in free:
            self.catalog.free(mv)

    def load_session_version(self, name: str, version: int) -> ModelVersion:
        """VERSION of NAME leased for one session chunk (release() it), loaded now if this
        replica has not loaded it: verified like any load, kept for sessions, outside the
        version policy (requests without a session never get it). VersionGone (409) when
        it is not in the repository, does not verify, or NAME was unloaded here. Blocking:
        run it in a thread."""
        mv = self.session_version(name, version)
        if mv is not None:
            return mv
        with self.loader.lock:  # one loader at a time (this, the poller or the API)
            mv = self.session_version(name, version)
            if mv is not None:
                return mv
            where = f"model {name!r} version {version}"
            if name in self.catalog.unloaded:
                raise VersionGone(f"{where}, whose model was unloaded from this replica "
                                  f"(repository API)")
            try:
                path = self.loader.repo / check_name(name) / str(version)
            except ValueError:
                raise VersionGone(f"{where}, which is not a model of the repository") \
                    from None
            if not (path / "manifest.json").is_file():
                self.metrics.session_version_loads.labels(name, "missing").inc()
                raise VersionGone(f"{where}, which is no longer in the repository")
            loaded = self.loader.load(name, version, " for its sessions")
            if isinstance(loaded, str):
                self.metrics.session_version_loads.labels(name, "refused").inc()
                raise VersionGone(f"{where}, which no longer verifies ({loaded})")
            with self.catalog.lock:
                loaded.retired = True  # not served: released once no session keeps it
                loaded.leases += 1  # this chunk's lease
                self._keep(loaded)
            self.metrics.session_version_loads.labels(name, "loaded").inc()
            self.metrics.model_loaded(loaded.manifest)
            return loaded

    def clear(self) -> list[ModelVersion]:
        """Keep nothing more (the service stops); the kept versions not yet released."""
        with self.catalog.lock:
            out = [mv for mv in self._kept.values() if not mv.released]
            self._kept.clear()
            self._kept_at.clear()
            return out
