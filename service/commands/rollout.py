"""``orthornn rollout start|status|promote|abort|run``: a candidate's rollout on live
traffic (``export.artifacts.rollout``); ``run`` is the controller (``registry.controller``)
over the replicas' measurements, fetched over HTTP. Torch-free."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request

from orthornn.export.artifacts import rollout
from orthornn.export.artifacts.repository import Location, add_model_flags, model_dir_of
from orthornn.export.artifacts.rollout import Plan, RolloutError
from orthornn.export.artifacts.rollout.flags import add_rollout_flags, flags_named, plan_options

from ..registry.controller import Controller

#: exit status of a rollout that ended without promoting its candidate (as a gate refusal)
NOT_PROMOTED_EXIT = 3


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
        add_model_flags(p)
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
    model_dir = model_dir_of(args)  # a folder, or a model's URI in a bucket
    if args.action == "start":
        if args.candidate is None or not str(args.candidate).isdigit():
            raise RolloutError(f"--candidate must be a version number (a positive integer); "
                               f"got {args.candidate!r}")
        with flags_named():
            plan = rollout.start(model_dir, int(args.candidate), **plan_options(args))
        print(f"{args.name}: rollout {plan.id} of version {plan.candidate} started "
              f"({describe_stage(plan)}); the replicas take it up at their next scan")
        return 0
    if args.action in ("promote", "abort"):
        plan = rollout.end_by_hand(model_dir, args.action)
        print(f"{args.name}: rollout {plan.id} {plan.state}: {plan.reason}")
        return 0
    if args.action == "status":
        current = rollout.read_plan(model_dir)
        if args.json:
            print(json.dumps(None if current is None else current.to_dict(), indent=2))
        else:
            print(status_text(current) if current else f"{args.name}: no rollout")
        return 0
    return controller(model_dir, args)


def describe_stage(plan: Plan) -> str:
    if plan.stage_name == rollout.SHADOW:
        return f"shadow, {plan.shadow:g} of requests"
    return f"canary {plan.stage_name}%"


def _fmt(value: object, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec) if isinstance(value, float) \
        else str(value)


def status_text(plan: Plan) -> str:
    """The plan and its analysis per stage, as ``orthornn rollout status`` prints it."""
    t = plan.thresholds
    lines = [f"model {plan.model}: rollout {plan.id} of version {plan.candidate} "
             f"(promoted: {plan.promoted}), {plan.state}"
             + (f" at {describe_stage(plan)}" if plan.running else ""),
             f"  stages {', '.join(map(str, plan.stages))}; at least {plan.interval_s:g} "
             f"s and {plan.min_requests} requests each; thresholds: agreement >= "
             f"{t.min_agreement:g}, excess error rate <= {t.max_error_rate:g}, p99 "
             f"ratio <= {t.max_latency_ratio:g}"]
    if plan.reason:
        lines.append(f"  {plan.state}: {plan.reason}")
    rows = [*plan.analysis, *([plan.current] if plan.current else [])]
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
                raise RolloutError(f"--replicas: {part!r} must be dns:HOST:PORT")
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
            raise RolloutError(f"--replicas: {part!r} must be http://HOST:PORT or "
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


def controller(model_dir: Location, args: argparse.Namespace) -> int:
    """``rollout run``: step the rollout from every replica's report until it ends."""
    if not args.replicas:
        raise RolloutError("--replicas: required (the replicas' URLs, or dns:HOST:PORT)")
    replica_urls(args.replicas)  # bad syntax: exit 2 now
    try:
        poll, timeout = float(args.poll), float(args.timeout)
    except ValueError:
        raise RolloutError(f"--poll and --timeout must be numbers; got {args.poll!r}, "
                           f"{args.timeout!r}") from None
    if not 0.01 <= poll <= 3600 or timeout < 0:
        raise RolloutError("--poll must be in [0.01, 3600] s and --timeout >= 0")
    deadline = time.monotonic() + timeout if timeout else None
    control = Controller(model_dir, ttl_s=max(3 * poll, 10.0))
    name = args.name
    shown = None
    while True:
        reports, missing = fetch_reports(replica_urls(args.replicas), name)
        plan, stepped = control.step(reports)
        if plan is None:
            raise RolloutError(f"no rollout for {name!r}: `orthornn rollout start` "
                               f"first")
        where = (plan.state, plan.stage, stepped)
        if where != shown:
            shown = where
            print(f"{name}: {plan.state}"
                  + (f" at {describe_stage(plan)}" if plan.running else f": {plan.reason}")
                  + ("" if stepped or not plan.running else
                     " (another controller holds the lease; watching)")
                  + (f" (no answer from {', '.join(missing)})" if missing else ""),
                  flush=True)
        if not plan.running:
            return 0 if plan.state == rollout.Phase.PROMOTED else NOT_PROMOTED_EXIT
        if deadline is not None and time.monotonic() > deadline:
            print(f"orthornn rollout run: --timeout {timeout:g} s passed; the rollout goes on "
                  f"(run the controller again)", file=sys.stderr)
            return 1
        time.sleep(poll)
