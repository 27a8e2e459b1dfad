"""``orthornn retrain-trigger``: whether the retraining job runs now. It fires when drift is
detected on the captures (``orthornn monitor --exit-code``, run as the job would run it)
or when at least --min-labels labels arrived since the promoted version was published,
and never within --cooldown hours of the last version published or candidate refused by
the gate. One line says why it fires or why it does nothing; exit 0 fires, 1 does
nothing, 2 is bad input. The reason (drift | labels | first) goes to --reason-file, so
the job passes ``export --require-better-on-gate-data`` when drift was the trigger.
Torch-free (the serving image can run it too)."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from orthornn.export.artifacts.repository import (
    add_model_flags,
    check_name,
    live_version,
    promoted,
    rejected,
    versions,
)

#: exit status when there is nothing to do (0 fires, 2 is bad input)
NOTHING_EXIT = 1
DEFAULT_MIN_LABELS = 100
DEFAULT_COOLDOWN_HOURS = 24.0
MAX_COOLDOWN_HOURS = 24.0 * 365

#: a drift check: (orthornn monitor's exit status: 1 drift, 0 none, 2 could not tell;
#: its last line of output)
DriftCheck = Callable[[], tuple[int, str]]


@dataclass(frozen=True)
class Decision:
    fire: bool
    reason: str  # drift | labels | first, or none when it does not fire
    message: str  # the one line printed


def add_trigger_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "retrain-trigger", help="decide whether the retraining job runs: drift on the "
                                "captures, or enough new labels, outside the cooldown",
        description="Exit 0 (fire) when orthornn monitor detects drift on the newest "
                    "captures or at least --min-labels labels arrived since the promoted "
                    "version was published; exit 1 (nothing to do) within --cooldown hours "
                    "of the last version published or refused, or when neither holds; "
                    "exit 2 on bad input. With no version published yet it fires (reason "
                    "first: train on the original data). Prints one line saying why.")
    parser.add_argument("--capture", required=True, metavar="DIR",
                        help="the capture folder (orthornn serve --capture DIR)")
    add_model_flags(parser)
    parser.add_argument("--min-labels", default=str(DEFAULT_MIN_LABELS), metavar="N",
                        help=f"fire when at least N labels arrived since the promoted version "
                             f"was published (default {DEFAULT_MIN_LABELS})")
    parser.add_argument("--cooldown", default=str(DEFAULT_COOLDOWN_HOURS), metavar="HOURS",
                        help="do nothing within this many hours of the last version published "
                             f"or refused by the gate (default {DEFAULT_COOLDOWN_HOURS:g})")
    parser.add_argument("--drift", action=argparse.BooleanOptionalAction, default=True,
                        help="fire on drift detected by orthornn monitor (default: on)")
    parser.add_argument("--reason-file", metavar="FILE",
                        help="write the reason (drift, labels, first; none when it does not "
                             "fire) to FILE, for the job (default: not written)")
    parser.set_defaults(run=run_trigger)


def _number(flag: str, text: str, low: float, high: float, integer: bool = False) -> float:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        value = math.nan
    if not (low <= value <= high):  # NaN fails too
        kind = "an integer" if integer else "a number"
        raise ValueError(f"{flag} must be {kind} in [{low:g}, {high:g}]; got {text!r}")
    return value


def _created(path: Path) -> float | None:
    """A version's (or a refused candidate's) creation time from its manifest, as Unix
    seconds; None when it has none (an unreadable or very old manifest)."""
    import json

    try:
        text = json.loads((path / "manifest.json").read_text()).get("created")
        return dt.datetime.fromisoformat(text).timestamp() if isinstance(text, str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _when(seconds: float) -> str:
    return dt.datetime.fromtimestamp(seconds, dt.UTC).isoformat(timespec="seconds")


def monitor_check(capture: Path, repo: Path, name: str) -> DriftCheck:
    """orthornn monitor --exit-code on the captures, in a child process of this same
    Python (what the job would run; its output is not this command's)."""
    def check() -> tuple[int, str]:
        done = subprocess.run(
            [sys.executable, "-m", "orthornn", "monitor", "--capture", str(capture),
             "--name", name, "--repo", str(repo), "--exit-code"],
            capture_output=True, text=True, check=False)
        # its verdict is stdout's last line (stderr holds notes), or an error on stderr
        lines = [line for line in done.stdout.splitlines() if line.strip()] or \
            [line for line in done.stderr.splitlines() if line.strip()]
        return done.returncode, lines[-1].strip() if lines else ""
    return check


def count_labels(capture: Path, name: str, since: float | None) -> int:
    """Labels of NAME under the capture folder that arrived after ``since`` (Unix seconds;
    every label when None)."""
    from orthornn.export.artifacts.loop.captures import read_labels

    return sum(1 for label in read_labels(capture, name)
               if since is None or (isinstance(label.get("time"), int | float)
                                    and label["time"] > since))


def decide(capture: Path, model_dir: Path, *, min_labels: int, cooldown_hours: float,
           drift: bool, drift_check: DriftCheck, now: float | None = None) -> Decision:
    """Whether the retraining job runs, and why (the rules of the module docstring), in
    the order: no version yet, the cooldown, drift, labels."""
    now = time.time() if now is None else now
    name = model_dir.name
    on_disk = versions(model_dir)
    if not on_disk:  # nothing serves yet, so nothing was captured: a first version
        return Decision(True, "first", f"fires: no version of {name} is published yet "
                                       f"(reason first: train on the original data)")
    if not capture.is_dir():
        raise ValueError(f"--capture {str(capture)!r} is not a folder (the capture folder of "
                         f"orthornn serve --capture)")
    attempts = [(t, f"version {p.name} was published") for p in
                (model_dir / str(v) for v in on_disk) if (t := _created(p)) is not None]
    attempts += [(t, f"candidate {p.name} was refused by the gate") for p in
                 rejected(model_dir) if (t := _created(p)) is not None]
    if attempts:
        last, what = max(attempts)
        if now - last < cooldown_hours * 3600:
            return Decision(False, "none", f"nothing to do: {what} {(now - last) / 3600:.1f} h "
                            f"ago, within the --cooldown of {cooldown_hours:g} h (until "
                            f"{_when(last + cooldown_hours * 3600)})")
    live = live_version(on_disk, promoted(model_dir))
    since = _created(model_dir / str(live))
    drift_note = "drift off (--no-drift)"
    if drift:
        code, detail = drift_check()
        if code == 1:
            return Decision(True, "drift", f"fires: drift detected on the captures of {name} "
                                           f"(orthornn monitor: {detail})")
        drift_note = "no drift" if code == 0 else \
            f"drift not measured (orthornn monitor exit {code}: {detail})"
    labels = count_labels(capture, name, since)
    since_text = f"since promoted version {live} was published" + (
        f" ({_when(since)})" if since is not None else " (its time unknown: every label)")
    if labels >= min_labels:
        return Decision(True, "labels", f"fires: {labels} labels arrived {since_text}, at "
                                        f"least --min-labels {min_labels}; {drift_note}")
    return Decision(False, "none", f"nothing to do: {drift_note}; {labels} labels "
                                   f"{since_text}, fewer than --min-labels {min_labels}")


def run_trigger(args: argparse.Namespace) -> int:
    missing = [flag for flag, v in (("--repo", args.repo), ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if not Path(args.repo).is_dir():
        raise ValueError(f"--repo {args.repo!r} is not a folder (the model repository)")
    model_dir = Path(args.repo) / check_name(args.name)  # absent: no version yet
    min_labels = int(_number("--min-labels", args.min_labels, 1, 1e9, integer=True))
    cooldown = _number("--cooldown", args.cooldown, 0, MAX_COOLDOWN_HOURS)
    capture = Path(args.capture)
    decision = decide(capture, model_dir, min_labels=min_labels, cooldown_hours=cooldown,
                      drift=args.drift,
                      drift_check=monitor_check(capture, Path(args.repo), args.name))
    if args.reason_file:
        Path(args.reason_file).write_text(decision.reason + "\n")
    print(f"orthornn retrain-trigger: {decision.message}")
    return 0 if decision.fire else NOTHING_EXIT
