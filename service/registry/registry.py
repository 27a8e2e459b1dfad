"""The model registry: the parts below, composed, and one object for their callers.

- ``catalog``: the serving table: the leases a request takes on its version, lookups,
  readiness, the repository index;
- ``loader``: verify, load and warm one version (a refusal recorded once);
- ``policy``: scans of the repository and promotion.json, which versions serve, the
  repository API (load, unload, rollback);
- ``pins``: the versions kept loaded for server-side sessions;
- ``rollouts``: this replica's part in rollouts (routing, shadow sampling, tallies).

The registry neither builds batchers nor shapes answers: the app attaches them by hooks
(``registry.batching``), as MLServer attaches adaptive batching when a model loads:
``on_load(mv)`` once a version is verified (it attaches ``mv.batcher`` and
``mv.steps_batcher``), ``on_release(mv)`` on the event loop once a retired version is free
(it closes them).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from ..metrics import Metrics
from ..settings import Settings
from .catalog import Catalog, ModelVersion, ReleaseHook
from .loader import Loader, LoadHook
from .pins import SessionPins
from .policy import VersionPolicy
from .rollouts import Rollouts

__all__ = ["ModelVersion", "Registry"]


class Registry:
    def __init__(self, settings: Settings, metrics: Metrics, providers: list[str], *,
                 on_load: LoadHook, on_release: ReleaseHook):
        self.catalog = Catalog(Path(settings.repo), metrics, set(settings.models), on_release,
                               settings.max_request_sequences)
        self.loader = Loader(settings, metrics, providers, on_load)
        self.pins = SessionPins(self.catalog, self.loader, metrics)
        self.rollouts = Rollouts(metrics)
        self.policy = VersionPolicy(settings, metrics, self.catalog, self.loader, self.pins,
                                    self.rollouts)
        self.scanned = self.catalog.scanned  # the start-up scan has finished
        # the serving table (event loop)
        self.acquire = self.catalog.acquire
        self.release = self.catalog.release
        self.get = self.catalog.get
        self.serving = self.catalog.serving
        self.versions = self.catalog.versions
        self.promoted = self.catalog.promoted
        self.promotion_error = self.catalog.promotion_error
        self.ready = self.catalog.ready
        self.waiting_for = self.catalog.waiting_for
        self.model_ready = self.catalog.model_ready
        # the versions kept for server-side sessions
        self.session_version = self.pins.session_version
        self.keep = self.pins.keep
        self.kept = self.pins.kept
        self.retain = self.pins.retain
        self.load_session_version = self.pins.load_session_version  # blocking
        # the version policy and the repository API (blocking: in a thread)
        self.scan = self.policy.scan
        self.sync_model = self.policy.sync_model
        self.load = self.policy.load
        self.unload = self.policy.unload
        self.rollback = self.policy.rollback

    def route(self, name: str, key: bytes) -> int | None:
        """The version a new request (or session) with routing KEY gets: a running
        rollout's candidate when KEY falls within its canary weight and it is loaded here;
        None: the default version."""
        candidate = self.rollouts.candidate_for(name, key)
        if candidate is None or not self.catalog.model_ready(name, candidate):
            return None
        return candidate

    def index(self) -> list[dict]:
        """Every model version in the repository with its state (Triton's index)."""
        return self.catalog.index(self.loader.refused)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Scan now and then every poll interval (in a thread); the released versions'
        on_release hook runs on LOOP."""
        self.catalog.loop = loop
        self.policy.start()

    def stop(self) -> None:
        self.policy.stop()

    async def close(self) -> None:
        self.stop()
        await self.catalog.close(self.pins.clear())
