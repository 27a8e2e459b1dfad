"""The serving table: the versions of each model that serve requests, the one a request
without a version gets, and the leases that keep a version loaded.

A request leases its version (``acquire`` .. ``release``): a version swapped out keeps
running what it holds and is released (the app's ``on_release`` hook, which closes its
batchers, then its inference sessions) when the last lease ends. The version policy
(``policy``) decides what serves and swaps it in (``swap``); the session pins (``pins``)
lease the versions kept for server-side sessions under the same lock. Readiness and the
repository index are read here, from what the policy and the loader recorded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orthornn.export.artifacts.package import Manifest
from orthornn.export.artifacts.repository import NAME, versions

from .. import request
from ..errors import ClientError, NotFound
from ..metrics import Metrics
from .batcher import Batcher
from .runtime import Runtime
from .spec import ModelSpec

log = logging.getLogger("orthornn.service")


@dataclass(eq=False)
class ModelVersion:
    """One loaded version of a model: its package, inference sessions and batchers, and
    the leases that keep it loaded."""

    name: str
    version: int
    path: Path
    manifest: Manifest
    spec: ModelSpec
    runtime: Runtime
    #: the batchers, attached by the app's on_load hook (``registry.batching``)
    batcher: Batcher = field(init=False, repr=False)
    steps_batcher: Batcher | None = None  # classify / regress: the per-step graph
    leases: int = 0  # what holds this version loaded: requests, session chunks, the pin
    unbatched: int = 0  # of those, leases that never reach a batcher (/generate)
    pinned: bool = False  # of those, the one that keeps it loaded for sessions (pins)
    retired: bool = False  # no longer served: released when its last lease ends
    released: bool = False

    @property
    def batchers(self) -> list[Batcher]:
        return [b for b in (getattr(self, "batcher", None), self.steps_batcher)
                if b is not None]

    async def infer(self, sequences: list, *, per_step: bool = False,
                    probabilities: bool = False, tag: Any = None) -> list[dict]:
        """The output rows of SEQUENCES (arrays, or Chunks that continue from a state), one
        dict per sequence in order, batched with other requests'. PER_STEP: the "steps"
        graph (an output after every step); PROBABILITIES: the batch's prepare step adds
        them (``batching.prepare_rows``); TAG: capture's, recorded with the batch. The
        compute time (queue and inference) is the request's: a running rollout compares its
        versions' over the requests it placed."""
        batcher = self.batcher
        if per_step:
            if self.steps_batcher is None:
                raise ClientError(f"per_step: model {self.name!r} version {self.version} has "
                                  f"no per-step graph; export it again")
            batcher = self.steps_batcher
        start = time.perf_counter()
        rows = await batcher.submit(sequences, prepare=probabilities, tag=tag)
        request.current().compute_s = time.perf_counter() - start
        return rows

    def on_the_way(self) -> int:
        """The leases of requests that will submit to a batcher (being parsed, or inside
        submit()): the batchers' ``holders``. Sessions wait between requests: their pin is
        not on its way."""
        return self.leases - self.unbatched - self.pinned


ReleaseHook = Callable[[ModelVersion], Coroutine[Any, Any, None]]


def model_names(repo: Path) -> list[str]:
    """The model directories of the repository."""
    if not repo.is_dir():
        return []
    return sorted(p.name for p in repo.iterdir()
                  if p.is_dir() and not p.name.startswith(".") and NAME.match(p.name))


class Catalog:
    def __init__(self, repo: Path, metrics: Metrics, configured: set[str],
                 on_release: ReleaseHook, max_sequences: int = 1):
        self.repo = repo
        #: the JSON body of the largest request a version served since start takes
        #: (``ModelSpec.largest_body``, MAX_SEQUENCES sequences): the body limit's default;
        #: it never shrinks, so that a session's chunk to a retired version still fits
        self.largest_body = 0
        self.max_sequences = max_sequences
        self.metrics = metrics
        self.on_release = on_release  # on the event loop, once a retired version is free
        self.lock = threading.RLock()  # the table and every version's leases
        self._serving: dict[str, dict[int, ModelVersion]] = {}
        self._default: dict[str, int] = {}  # the version a request without one gets
        # written by the version policy:
        self.promoted_versions: dict[str, int | None] = {}  # promotion.json's (last scan)
        self.promotion_errors: dict[str, str] = {}  # why promotion.json cannot be read now
        self.unloaded: set[str] = set()  # models unloaded through the repository API
        self.configured = configured  # the models readiness waits for
        self.scanned = threading.Event()  # the start-up scan has finished
        self.loop: asyncio.AbstractEventLoop | None = None  # where on_release runs

    # -- leases (event loop) ------------------------------------------------------------

    def acquire(self, name: str, version: int | None = None, *,
                batched: bool = True) -> ModelVersion:
        """The requested (default: the promoted, else the newest) serving version, leased
        until release() (a retired version is released when its last lease ends).
        ``batched=False``: a lease that never submits to a batcher (/generate), so the
        batchers do not wait for it; release it the same way."""
        with self.lock:
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
            mv.leases += 1
            mv.unbatched += not batched
        scope = request.current()  # the request is counted under the version it leased
        scope.model, scope.version = mv.name, mv.version
        return mv

    def release(self, mv: ModelVersion, *, batched: bool = True) -> None:
        with self.lock:
            mv.unbatched -= not batched
            done = self.end_lease(mv)
        if done:
            self.free(mv)

    def end_lease(self, mv: ModelVersion) -> bool:
        """(Under the lock.) One lease of MV ends; whether it is to be freed now."""
        mv.leases -= 1
        if mv.retired and mv.leases == 0 and not mv.released:
            mv.released = True
            return True
        return False

    def find(self, name: str, version: int) -> ModelVersion | None:
        """(Under the lock.) VERSION of NAME if it serves."""
        return (self._serving.get(name) or {}).get(version)

    def free(self, mv: ModelVersion) -> None:
        """Release a retired version once nothing leases it: the on_release hook on the
        event loop (it closes the batchers), then its inference sessions."""
        self.metrics.model_released(mv.manifest)
        log.info("released %s version %d", mv.name, mv.version)
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                loop.create_task(self.on_release(mv))
            else:
                asyncio.run_coroutine_threadsafe(self.on_release(mv), loop)
        mv.runtime.inference_sessions.clear()

    # -- lookups (event loop) -------------------------------------------------------------

    def serving(self) -> dict[str, list[int]]:
        with self.lock:
            return {name: sorted(vs) for name, vs in self._serving.items() if vs}

    def versions(self, name: str) -> dict[int, ModelVersion]:
        """NAME's serving versions (a copy)."""
        with self.lock:
            return dict(self._serving.get(name, {}))

    def default(self, name: str) -> int | None:
        with self.lock:
            return self._default.get(name)

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        """A serving version without leasing it (metadata)."""
        mv = self.acquire(name, version)
        with self.lock:
            mv.leases -= 1
        return mv

    def promoted(self, name: str) -> int | None:
        """The version promotion.json promotes (as the last scan read it), or None (no
        file, or an unreadable one); it serves unless it failed verification."""
        with self.lock:
            return self.promoted_versions.get(name)

    def promotion_error(self, name: str) -> str | None:
        """Why NAME's promotion.json cannot be read (what serves stays as it was), or None."""
        with self.lock:
            return self.promotion_errors.get(name)

    def ready(self) -> bool:
        return self.scanned.is_set() and not self.waiting_for()

    def waiting_for(self) -> list[str]:
        """The configured models that readiness waits for (none loaded yet)."""
        with self.lock:
            return sorted(n for n in self.configured - self.unloaded
                          if not self._serving.get(n))

    def model_ready(self, name: str, version: int | None = None) -> bool:
        with self.lock:
            loaded = self._serving.get(name) or {}
            return bool(loaded) if version is None else version in loaded

    def index(self, refused: Callable[[str, int], str | None]) -> list[dict]:
        """Every model version in the repository with its state (Triton's index);
        REFUSED: why a version was refused (the loader's record), None if it was not."""
        rows = []
        names = set(model_names(self.repo)) | set(self._serving)
        with self.lock:
            for name in sorted(names):
                loaded = self._serving.get(name, {})
                promoted = self.promoted_versions.get(name)
                unreadable = self.promotion_errors.get(name)
                for v in sorted(set(versions(self.repo / name)) | set(loaded)):
                    refusal = refused(name, v)
                    if v in loaded:
                        state, reason = "READY", ""
                    elif refusal is not None:
                        state, reason = "UNAVAILABLE", refusal
                    elif name in self.unloaded:
                        state, reason = "UNAVAILABLE", "unloaded"
                    elif unreadable is not None:
                        state, reason = "UNAVAILABLE", (f"not loaded: {unreadable} (what "
                                                        f"serves stays until it is readable)")
                    elif promoted is not None and v != promoted:
                        state, reason = "UNAVAILABLE", (f"not loaded (version policy; version "
                                                        f"{promoted} is promoted)")
                    else:
                        state, reason = "UNAVAILABLE", "not loaded (version policy)"
                    rows.append({"name": name, "version": str(v), "state": state,
                                 "reason": reason})
        return rows

    # -- swaps (the version policy, under the loader's lock) ------------------------------

    def swap(self, name: str, keep: dict[int, ModelVersion],
             default: int | None = None) -> None:
        """Serve KEEP (DEFAULT for requests without a version) for NAME from now on; the
        versions no longer served are retired, released once nothing leases them."""
        with self.lock:
            current = self._serving.get(name, {})
            retired = [mv for v, mv in current.items() if v not in keep]
            added = [mv for v, mv in keep.items() if v not in current]
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
                if mv.leases == 0 and not mv.released:
                    mv.released = True
                    free.append(mv)
        for mv in added:
            self.metrics.model_loaded(mv.manifest)
            self.largest_body = max(self.largest_body, mv.spec.largest_body(self.max_sequences))
        if before is not None and after is not None and after != before:
            self.metrics.swaps.labels(name).inc()
            log.info("%s: version %d now serves (was %d)", name, after, before)
        for mv in free:
            self.free(mv)

    async def close(self, also: list[ModelVersion]) -> None:
        """Serve nothing more; every serving version, and ALSO (those kept for sessions),
        is released at once."""
        with self.lock:
            everything = {id(mv): mv for vs in self._serving.values() for mv in vs.values()}
            everything.update((id(mv), mv) for mv in also)
            self._serving.clear()
        for mv in everything.values():
            await self.on_release(mv)
            self.metrics.model_released(mv.manifest)
