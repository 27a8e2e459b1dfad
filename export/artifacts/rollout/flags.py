"""The flags of a rollout's plan, shared by ``orthornn rollout start`` and ``orthornn export
--gate --rollout``, and the flag a plan field's error names."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from .plan import DEFAULT_STEPS, RolloutError, Thresholds, parse_steps


def add_rollout_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The plan's flags, for ``rollout start`` and ``export --gate --rollout``."""
    t = Thresholds()
    parser.add_argument("--shadow", default="0.1", metavar="FRACTION",
                        help="share of requests the candidate also runs on, compared only, "
                             "before any canary (default 0.1; 0: no shadow stage)")
    parser.add_argument("--steps", default=",".join(map(str, DEFAULT_STEPS)),
                        help="canary percentages, increasing, ending at 100 (default "
                             "5,25,50,100)")
    parser.add_argument("--interval", default="60", metavar="SECONDS",
                        help="time per stage, at least (default 60)")
    parser.add_argument("--min-requests", default="100", metavar="N",
                        help="requests the candidate answers or shadows per stage, at least "
                             "(default 100)")
    parser.add_argument("--min-agreement", default=str(t.min_agreement), metavar="A",
                        help=f"roll back when the candidate's top-1 agreement with the "
                             f"promoted version falls below A (default {t.min_agreement})")
    parser.add_argument("--max-error-rate", default=str(t.max_error_rate), metavar="R",
                        help=f"roll back when its error rate exceeds the promoted version's "
                             f"by more than R (default {t.max_error_rate})")
    parser.add_argument("--max-latency-ratio", default=str(t.max_latency_ratio), metavar="X",
                        help=f"roll back when its p99 compute time is more than X times the "
                             f"promoted version's (default {t.max_latency_ratio})")


def plan_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``rollout.start`` from the flags (RolloutError names the
    flag of a value that is not a number)."""

    def number(flag: str, text: str, kind: type = float) -> float:
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise RolloutError(f"{flag} must be {what}; got {text!r}") from None
    with flags_named():
        thresholds = Thresholds(
            min_agreement=number("--min-agreement", args.min_agreement),
            max_error_rate=number("--max-error-rate", args.max_error_rate),
            max_latency_ratio=number("--max-latency-ratio", args.max_latency_ratio))
        steps = parse_steps(args.steps)
    return {"shadow": number("--shadow", args.shadow), "steps": steps,
            "interval_s": number("--interval", args.interval),
            "min_requests": int(number("--min-requests", args.min_requests, int)),
            "thresholds": thresholds}



#: a rollout plan's fields that a flag of another name sets
_FLAGS = {"interval_s": "--interval"}


@contextlib.contextmanager
def flags_named() -> Iterator[None]:
    """A RolloutError about a plan field names the flag that sets it, too."""
    try:
        yield
    except RolloutError as error:
        if error.field is None:
            raise
        flag = _FLAGS.get(error.field, f"--{error.field.replace('_', '-')}")
        text = str(error)  # it starts with the field's name, or gets the flag in front
        text = flag + text.removeprefix(error.field) if text.startswith(error.field) \
            else f"{flag}: {text}"
        raise RolloutError(text, error.status) from None
