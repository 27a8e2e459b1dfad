"""Rollouts on live traffic, torch-free: the plan (``plan``), the analysis of what the
replicas measure (``analysis``) and the plan's file in the repository (``store``). The
controller that steps a rollout is the service's (``service.registry.controller``)."""

from .analysis import LATENCY_BOUNDS, Side, Tally, analyse, breach, combine, decide
from .plan import (
    DEFAULT_STEPS,
    RULES,
    SHADOW,
    Phase,
    Plan,
    RolloutError,
    Thresholds,
    bucket,
    parse_steps,
)
from .store import (
    LEASE,
    ROLLOUT,
    end_by_hand,
    gate_refusal,
    read_plan,
    rolled_back,
    start,
    step,
    take_lease,
)

__all__ = ["DEFAULT_STEPS", "LATENCY_BOUNDS", "LEASE", "ROLLOUT", "RULES", "SHADOW", "Phase",
           "Plan", "RolloutError", "Side", "Tally", "Thresholds", "analyse", "breach",
           "bucket", "combine", "decide", "end_by_hand", "gate_refusal", "parse_steps",
           "read_plan", "rolled_back", "start", "step", "take_lease"]
