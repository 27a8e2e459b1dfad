"""``orthornn retrain-trigger``: whether the retraining job runs now (the decision:
``export.artifacts.loop.trigger``). It fires when drift is detected on the captures
(``orthornn monitor --exit-code``, run as the job would run it) or when at least
--min-labels labels arrived since the promoted version was published, and never within
--cooldown hours of the last version published or candidate refused by the gate. One
line says why it fires or why it does nothing; exit 0 fires, 1 does nothing, 2 is bad
input. The reason (drift | labels | first) goes to --reason-file, so the job passes
``export --require-better-on-gate-data`` when drift was the trigger. Torch-free (the
serving image can run it too)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from orthornn.export.artifacts.loop.captures import local_captures
from orthornn.export.artifacts.loop.trigger import DriftCheck, decide
from orthornn.export.artifacts.repository import add_model_flags, check_name, local_repo

from .flags import number

#: exit status when there is nothing to do (0 fires, 2 is bad input)
NOTHING_EXIT = 1
DEFAULT_MIN_LABELS = 100
DEFAULT_COOLDOWN_HOURS = 24.0
MAX_COOLDOWN_HOURS = 24.0 * 365


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
                        help="the capture folder (orthornn serve --capture DIR), or its "
                             "bucket (s3://BUCKET/PREFIX)")
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



def run_trigger(args: argparse.Namespace) -> int:
    missing = [flag for flag, v in (("--repo", args.repo), ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    name = check_name(args.name)
    min_labels = int(number("--min-labels", args.min_labels, 1, 1e9, integer=True))
    cooldown = number("--cooldown", args.cooldown, 0, MAX_COOLDOWN_HOURS)
    with local_repo(args.repo, name) as repo:  # a bucket's model: mirrored once, for both
        if not repo.is_dir():
            raise ValueError(f"--repo {args.repo!r} is not a folder (the model repository)")
        capture = local_captures(args.capture, name)  # a bucket's: copied once, for both
        decision = decide(capture, repo / name,  # absent: no version yet
                          min_labels=min_labels, cooldown_hours=cooldown, drift=args.drift,
                          drift_check=monitor_check(capture, repo, name))
    if args.reason_file:
        Path(args.reason_file).write_text(decision.reason + "\n")
    print(f"orthornn retrain-trigger: {decision.message}")
    return 0 if decision.fire else NOTHING_EXIT
