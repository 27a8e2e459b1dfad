"""The repository API: the index, load and unload, rollback, and the rollouts; each
blocking step in a thread."""

from __future__ import annotations

import asyncio

from orthornn.export.artifacts.rollout import RULES

from ..errors import ClientError, NotFound, RollbackRefused
from ..registry.registry import Registry
from .checks import version_param
from .schemas import RepositoryIndexRequest, RollbackRequest, RolloutStartRequest


class Repository:
    def __init__(self, registry: Registry):
        self.registry = registry

    async def repository_index(self, req: RepositoryIndexRequest) -> list[dict]:
        rows = await asyncio.to_thread(self.registry.index)
        if req.ready is not None:
            rows = [r for r in rows if (r["state"] == "READY") == req.ready]
        return rows

    async def load(self, name: str) -> dict:
        errors = await asyncio.to_thread(self.registry.load, name)
        if not self.registry.model_ready(name):
            raise ClientError(f"model {name!r} failed to load: " + "; ".join(errors))
        return {"name": name, "versions": self.registry.serving()[name], "refused": errors}

    async def rollback(self, name: str, req: RollbackRequest) -> dict:
        """Promote an earlier version (the request's, or the one promoted before the
        current one) and swap to it now; 409 naming the usable versions when it cannot."""
        try:
            return await asyncio.to_thread(self.registry.rollback, name,
                                           version_param(req.version))
        except RollbackRefused as error:
            raise RollbackRefused(f"rollback of model {name!r}: {error}") from None

    def rollout(self, name: str) -> dict:
        """NAME's rollout plan as this replica read it, and this replica's tallies of it
        (what ``orthornn rollout run`` adds across replicas)."""
        if not self.registry.model_ready(name) and self.registry.rollouts.plan(name) is None:
            raise NotFound(f"model {name!r} is not loaded")
        plan = self.registry.rollouts.plan(name)
        return {"model": name, "plan": None if plan is None else plan.to_dict(),
                "report": self.registry.rollouts.report(name)}

    async def start_rollout(self, name: str, req: RolloutStartRequest) -> dict:
        thresholds = {k: getattr(req, k) for k in RULES}
        plan = await asyncio.to_thread(
            self.registry.policy.start_rollout, name, req.candidate, req.shadow, req.steps,
            req.interval_s, req.min_requests, thresholds)
        return plan.to_dict()

    async def end_rollout(self, name: str, action: str) -> dict:
        plan = await asyncio.to_thread(self.registry.policy.end_rollout, name, action)
        return plan.to_dict()

    async def unload(self, name: str) -> dict:
        await asyncio.to_thread(self.registry.unload, name)
        return {"name": name, "unloaded": True}
