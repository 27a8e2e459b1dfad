"""``orthornn rollout start|status|promote|abort|run``: a candidate's rollout on live
traffic (``export.artifacts.rollout``), and the flags ``orthornn export --gate --rollout``
shares. Torch-free."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .artifacts import rollout

#: exit status of a rollout that ended without promoting its candidate (as a gate refusal)
NOT_PROMOTED_EXIT = 3


def add_rollout_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The plan's flags, for ``rollout start`` and ``export --gate --rollout``."""
    t = rollout.Thresholds()
    parser.add_argument("--shadow", default="0.1", metavar="FRACTION",
                        help="share of requests the candidate also runs on, compared only, "
                             "before any canary (default 0.1; 0: no shadow stage)")
    parser.add_argument("--steps", default=",".join(map(str, rollout.DEFAULT_STEPS)),
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
            raise rollout.RolloutError(f"{flag} must be {what}; got {text!r}") from None
    thresholds = rollout.Thresholds(
        min_agreement=number("--min-agreement", args.min_agreement),
        max_error_rate=number("--max-error-rate", args.max_error_rate),
        max_latency_ratio=number("--max-latency-ratio", args.max_latency_ratio))
    return {"shadow": number("--shadow", args.shadow), "steps": rollout.parse_steps(args.steps),
            "interval_s": number("--interval", args.interval),
            "min_requests": int(number("--min-requests", args.min_requests, int)),
            "thresholds": thresholds}


def add_rollout_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "rollout", help="roll a candidate out on live traffic: shadow, canary steps, "
                        "automatic promotion or rollback",
        description="A candidate that passed the gate goes through a shadow stage (it also "
                    "runs on a sample of live requests; only the comparison is kept) and "
                    "canary steps (a share of new requests and sessions), while the "
                    "replicas measure agreement, errors and latency. The plan lives in "
                    "REPO/NAME/rollout.json; every replica reads it.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="start a rollout of --candidate V")
    status = actions.add_parser("status", help="the rollout's stage and analysis per stage")
    promote = actions.add_parser("promote", help="promote the candidate now")
    abort = actions.add_parser("abort", help="stop the rollout; the promoted version stays")
    run = actions.add_parser(
        "run", help="the controller: add the replicas' measurements, advance, promote or "
                    "roll back, until the rollout ends",
        description="Polls each replica's GET /v2/repository/models/NAME/rollout, adds "
                    "their measurements and writes the plan's next stage. Exit 0 when the "
                    "candidate is promoted, 3 when the rollout is rolled back or aborted.")
    for p in (start, status, promote, abort, run):
        p.add_argument("--repo", help="model repository root (required)")
        p.add_argument("--name", help="model name in the repository (required)")
    start.add_argument("--candidate", metavar="V", help="the version to roll out (required)")
    add_rollout_flags(start)
    status.add_argument("--json", action="store_true", help="the plan as JSON")
    run.add_argument("--replicas", metavar="URL,...",
                     help="the replicas' base URLs (http://host:port), or dns:HOST:PORT for "
                          "every address HOST resolves to (a headless Service)")
    run.add_argument("--poll", default="1", metavar="SECONDS",
                     help="time between steps (default 1)")
    run.add_argument("--timeout", default="0", metavar="SECONDS",
                     help="give up (exit 1) after this long; 0: never (default)")
    parser.set_defaults(run=run_rollout)


def run_rollout(args: argparse.Namespace) -> int:
    from .cli import _model_dir

    model_dir = _model_dir(args)
    if args.action == "start":
        if args.candidate is None or not str(args.candidate).isdigit():
            raise rollout.RolloutError(f"--candidate must be a version number (a positive "
                                       f"integer); got {args.candidate!r}")
        plan = rollout.start(model_dir, int(args.candidate), **plan_options(args))
        print(f"{args.name}: rollout {plan['id']} of version {plan['candidate']} started "
              f"({describe_stage(plan)}); the replicas take it up at their next scan")
        return 0
    if args.action in ("promote", "abort"):
        plan = rollout.end_by_hand(model_dir, args.action)
        print(f"{args.name}: rollout {plan['id']} {plan['state']}: {plan['reason']}")
        return 0
    if args.action == "status":
        current = rollout.read_plan(model_dir)
        if args.json:
            print(json.dumps(current, indent=2))
        else:
            print(status_text(current) if current else f"{args.name}: no rollout")
        return 0
    return controller(model_dir, args)


def describe_stage(plan: dict) -> str:
    stage = plan["stages"][plan["stage"]]
    if stage == rollout.SHADOW:
        return f"shadow, {plan['shadow']:g} of requests"
    return f"canary {stage}%"


def _fmt(value: object, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) \
        else str(value)


def status_text(plan: dict) -> str:
    """The plan and its analysis per stage, as ``orthornn rollout status`` prints it."""
    t = plan["thresholds"]
    lines = [f"model {plan['model']}: rollout {plan['id']} of version {plan['candidate']} "
             f"(promoted: {plan['promoted']}), {plan['state']}"
             + (f" at {describe_stage(plan)}" if plan["state"] == rollout.RUNNING else ""),
             f"  stages {', '.join(map(str, plan['stages']))}; at least {plan['interval_s']:g} "
             f"s and {plan['min_requests']} requests each; thresholds: agreement >= "
             f"{t['min_agreement']:g}, excess error rate <= {t['max_error_rate']:g}, p99 "
             f"ratio <= {t['max_latency_ratio']:g}"]
    if plan.get("reason"):
        lines.append(f"  {plan['state']}: {plan['reason']}")
    rows = [*plan["analysis"], *([plan["current"]] if plan.get("current") else [])]
    if rows:
        lines.append(f"  {'stage':<8} {'outcome':<9} {'requests':>8} {'compared':>8} "
                     f"{'agreement':>9} {'mean diff':>9} {'errors':>6} {'error rate':>10} "
                     f"{'p99 ratio':>9} {'skipped':>7}")
        for row in rows:
            lines.append(f"  {row['stage']!s:<8} {row['outcome']:<9} {row['requests']:>8} "
                         f"{row['compared']:>8} {_fmt(row['agreement']):>9} "
                         f"{_fmt(row['mean_difference']):>9} {row['errors']:>6} "
                         f"{_fmt(row['error_rate']):>10} {_fmt(row['latency_ratio']):>9} "
                         f"{row['skipped']:>7}")
    return "\n".join(lines)


def replica_urls(spec: str) -> list[str]:
    """--replicas: base URLs, or dns:HOST:PORT (every address of HOST)."""
    urls: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.startswith("dns:"):
            host, _, port = part[4:].rpartition(":")
            if not host or not port.isdigit():
                raise rollout.RolloutError(f"--replicas: {part!r} must be dns:HOST:PORT")
            try:
                infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except OSError:
                continue  # no replica resolvable now: the next poll tries again
            for info in infos:
                address = str(info[4][0])
                urls.append(f"http://{f'[{address}]' if ':' in address else address}:{port}")
        elif part.startswith(("http://", "https://")):
            urls.append(part.rstrip("/"))
        else:
            raise rollout.RolloutError(f"--replicas: {part!r} must be http://HOST:PORT or "
                                       f"dns:HOST:PORT")
    return sorted(set(urls))


def fetch_reports(urls: list[str], name: str) -> tuple[list[dict], list[str]]:
    """Each replica's report of NAME's rollout; and the replicas that did not answer."""
    reports, missing = [], []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/v2/repository/models/{name}/rollout",
                                        timeout=5) as answer:
                report = json.loads(answer.read()).get("report")
        except (OSError, ValueError, urllib.error.URLError):
            missing.append(url)
            continue
        if report is not None:
            reports.append(report)
    return reports, missing


def controller(model_dir: Path, args: argparse.Namespace) -> int:
    if not args.replicas:
        raise rollout.RolloutError("--replicas: required (the replicas' URLs, or "
                                   "dns:HOST:PORT)")
    replica_urls(args.replicas)  # bad syntax: exit 2 now
    try:
        poll, timeout = float(args.poll), float(args.timeout)
    except ValueError:
        raise rollout.RolloutError(f"--poll and --timeout must be numbers; got {args.poll!r}, "
                                   f"{args.timeout!r}") from None
    if not 0.01 <= poll <= 3600 or timeout < 0:
        raise rollout.RolloutError("--poll must be in [0.01, 3600] s and --timeout >= 0")
    deadline = time.monotonic() + timeout if timeout else None
    shown = None
    while True:
        reports, missing = fetch_reports(replica_urls(args.replicas), model_dir.name)
        plan = rollout.control(model_dir, reports)
        if plan is None:
            raise rollout.RolloutError(f"no rollout for {model_dir.name!r}: `orthornn rollout "
                                       f"start` first")
        where = (plan["state"], plan["stage"])
        if where != shown:
            shown = where
            print(f"{model_dir.name}: {plan['state']}"
                  + (f" at {describe_stage(plan)}" if plan["state"] == rollout.RUNNING
                     else f": {plan['reason']}")
                  + (f" (no answer from {', '.join(missing)})" if missing else ""),
                  flush=True)
        if plan["state"] != rollout.RUNNING:
            return 0 if plan["state"] == rollout.PROMOTED else NOT_PROMOTED_EXIT
        if deadline is not None and time.monotonic() > deadline:
            print(f"orthornn rollout run: --timeout {timeout:g} s passed; the rollout goes on "
                  f"(run the controller again)", file=sys.stderr)
            return 1
        time.sleep(poll)
