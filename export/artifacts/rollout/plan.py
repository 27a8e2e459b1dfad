"""A rollout's plan: its phase, stages, thresholds and the canary's routing rule, as
REPO/<name>/rollout.json holds it (``Plan.to_dict`` / ``Plan.from_dict``)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from orthornn.export.artifacts.numbers import is_number

SHADOW = "shadow"
DEFAULT_STEPS = (5, 25, 50, 100)
#: the rules' names, as the plan, the API and the flags (with dashes) spell them
RULES = ("min_agreement", "max_error_rate", "max_latency_ratio")


class Phase(StrEnum):
    """A rollout's state; the one spelling used by rollout.json, the API and the CLI."""

    RUNNING = "running"
    PROMOTED = "promoted"
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"


class RolloutError(ValueError):
    """Bad input to a rollout (exit 2, or the 4xx ``status``). ``field``: the plan field
    the message names (the CLI shows its flag beside it), or None."""

    def __init__(self, message: str, status: int = 400, field: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field


def check_number(name: str, value: Any, low: float, high: float) -> float:
    """VALUE, a finite number in [LOW, HIGH]; RolloutError naming NAME otherwise."""
    if is_number(value) and low <= value <= high:
        return value
    raise RolloutError(f"{name} must be a number in [{low:g}, {high:g}]; got {value!r}",
                       field=name)


@dataclass(frozen=True)
class Thresholds:
    """When a rollout stops: the candidate's top-1 agreement with the promoted version
    below ``min_agreement``; its error rate above the promoted version's by more than
    ``max_error_rate``; its p99 compute time over the promoted version's above
    ``max_latency_ratio``."""

    min_agreement: float = 0.9
    max_error_rate: float = 0.01
    max_latency_ratio: float = 2.0

    def __post_init__(self) -> None:
        check_number("min_agreement", self.min_agreement, 0.0, 1.0)
        check_number("max_error_rate", self.max_error_rate, 0.0, 1.0)
        check_number("max_latency_ratio", self.max_latency_ratio, 1.0, 1000.0)


def parse_steps(text: str | Sequence[int]) -> list[int]:
    """The canary percentages: increasing, ending at 100 ("5,25,50,100" or a list)."""
    try:
        steps = [int(s) for s in (text.split(",") if isinstance(text, str) else text)]
    except (TypeError, ValueError):
        raise RolloutError(f"steps must be comma-separated percentages such as 5,25,50,100; "
                           f"got {text!r}", field="steps") from None
    if not steps or any(not 0 < s <= 100 for s in steps) or steps != sorted(set(steps)) or \
            steps[-1] != 100:
        raise RolloutError(f"steps must be increasing percentages in (0, 100] ending at 100 "
                           f"(e.g. 5,25,50,100); got {text!r}", field="steps")
    return steps


def bucket(key: bytes) -> float:
    """Where a routing key falls in [0, 100): the same key always lands on the same
    version of a stage, on every replica (a retry included)."""
    return zlib.crc32(key) % 10000 / 100


@dataclass
class Plan:
    """One rollout of ``candidate`` over ``promoted``. ``stages``: "shadow" (the candidate
    also runs on a ``shadow`` fraction of the promoted version's requests, compared only)
    and canary percentages; ``analysis``: one record per finished stage; ``current``: the
    running stage's analysis so far; ``past``: the earlier rollouts, summarised."""

    id: str
    model: str
    candidate: int
    promoted: int
    state: Phase
    stages: list[str | int]
    stage: int
    stage_started: str
    started: str
    shadow: float
    interval_s: float
    min_requests: int
    thresholds: Thresholds
    ended: str | None = None
    analysis: list[dict] = field(default_factory=list)
    reason: str | None = None
    breach: dict | None = None
    past: list[dict] = field(default_factory=list)
    current: dict | None = None
    #: in a bucket, a plan decided to be promoted (its last stage passed, or promoted by
    #: hand) before the promotion is written: {"reason", "by_hand"}; whoever reads it next
    #: completes it (``rollout.bucket_records``). Never written in a folder, where the lock
    #: makes the two writes one.
    finishing: dict | None = None

    @property
    def running(self) -> bool:
        return self.state == Phase.RUNNING

    @property
    def stage_name(self) -> str | int:
        """The current stage: "shadow" or a percentage."""
        return self.stages[self.stage]

    def where(self) -> str:
        """The current stage in words: "in shadow" or "at 25%"."""
        return "in shadow" if self.stage_name == SHADOW else f"at {self.stage_name}%"

    def weight(self) -> int:
        """The candidate's share of new requests, in percent (0 in shadow or when not
        running)."""
        return 0 if not self.running or self.stage_name == SHADOW else int(self.stage_name)

    def place(self, key: bytes) -> int:
        """The version a request (or session) with routing KEY goes to: the candidate when
        KEY's bucket is below the stage's weight, else the promoted version."""
        share = self.weight()
        return self.candidate if share and bucket(key) < share else self.promoted

    def summary(self) -> dict:
        """What ``past`` keeps of a finished rollout."""
        return {k: getattr(self, k) for k in ("id", "candidate", "promoted", "state",
                                               "started", "ended", "reason", "breach")}

    def to_dict(self) -> dict:
        """rollout.json's form (the API's too)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["state"] = str(self.state)
        d["thresholds"] = asdict(self.thresholds)
        if self.finishing is None:  # rollout.json as it always was
            del d["finishing"]
        return d

    @classmethod
    def from_dict(cls, d: object) -> Plan:
        """The plan of rollout.json's content; ValueError when it is not one."""
        names = {f.name for f in fields(cls)}
        if not isinstance(d, dict) or not {"id", "candidate", "state", "stages"} <= set(d):
            raise ValueError("not a rollout plan")
        try:
            plan = cls(**{k: v for k, v in d.items() if k in names})
            plan.state = Phase(plan.state)
            plan.thresholds = Thresholds(**d["thresholds"])
            plan.stage_name  # noqa: B018  (the stage index is in range)
        except (TypeError, ValueError, IndexError) as error:
            raise ValueError(f"not a rollout plan ({error})") from None
        return plan
