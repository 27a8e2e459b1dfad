"""The rollout controller: steps a model's running rollout from the replicas'
measurements, holding the repository's lease so that only one controller (a writable
replica, or ``orthornn rollout run``) steps one rollout at a time."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Sequence

from orthornn.export.artifacts import rollout
from orthornn.export.artifacts.repository import Location
from orthornn.export.artifacts.rollout import Plan


class Controller:
    """MODEL_DIR's controller. ``ttl_s``: how long the lease outlives the last step (a
    controller that stops is replaced after it)."""

    def __init__(self, model_dir: Location, ttl_s: float) -> None:
        self.model_dir = model_dir  # a folder, or the model's URI in a bucket
        self.ttl_s = ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def step(self, reports: Sequence[dict]) -> tuple[Plan | None, bool]:
        """(the plan as it is now, whether this controller stepped it): one step from
        REPORTS (each replica's ``Rollouts.report``) when the rollout runs and the lease
        is this controller's; else the plan as it is."""
        plan = rollout.read_plan(self.model_dir)
        if plan is None or not plan.running or \
                not rollout.take_lease(self.model_dir, self.owner, self.ttl_s):
            return plan, False
        return rollout.step(self.model_dir, reports), True
