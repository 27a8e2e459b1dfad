"""``orthornn export``: publish a run as a model package, or verify a package.
Torch-free at import; the exporter is imported when the command runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orthornn.training.flags import add_progress_flag

from .artifacts.repository import add_model_flags, model_dir_of
from .artifacts.rollout.flags import add_rollout_flags, flags_named, plan_options


def add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "export", help="export a run to ONNX and publish it into a model repository",
        description="orthornn export RUN_DIR --repo REPO --name NAME [--mode dense|factored] "
                    "publishes REPO/NAME/<next version>/ and prints its path; "
                    "orthornn export --verify-only PACKAGE checks a package.")
    parser.add_argument("run_dir", nargs="?", help="a training run directory")
    add_model_flags(parser, required=False)  # not with --verify-only
    parser.add_argument("--mode", default="dense", help="dense (default) or factored")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset (17-21, default 18)")
    add_progress_flag(parser)
    parser.add_argument("--verify-only", metavar="PACKAGE",
                        help="verify a package (hashes and golden outputs) and exit")
    parser.add_argument("--gate", action="store_true",
                        help="publish and promote only if the candidate meets --min-metric (or "
                             "beats the task's baseline) and is no worse than the promoted "
                             "version on the same test split; a refusal exits 3")
    parser.add_argument("--min-metric", metavar="VALUE",
                        help="with --gate: the worst acceptable test metric, in its direction "
                             "(accuracy at least VALUE; MSE, perplexity at most VALUE)")
    parser.add_argument("--tolerance", default="0",
                        help="with --gate: how much worse than the promoted version the "
                             "candidate may be, in the metric's units (default 0)")
    parser.add_argument("--gate-data", metavar="HOLDOUT",
                        help="with --gate: also judge the candidate and the promoted version on "
                             "this held-out captured slice (orthornn capture dataset's "
                             "holdout: an .npz for classify, a text corpus for lm, scored as "
                             "perplexity), each through its own graph: refused if worse on it "
                             "beyond --tolerance (default: the test split only)")
    parser.add_argument("--require-better-on-gate-data", action="store_true",
                        help="with --gate-data: also refused unless better than the promoted "
                             "version on the slice by at least --gate-margin (the retraining "
                             "job passes it when drift was the trigger)")
    parser.add_argument("--gate-margin", metavar="M", default=None,
                        help="with --require-better-on-gate-data: how much better, in the "
                             "metric's units (default 0.02: two accuracy points)")
    parser.add_argument("--rollout", action="store_true",
                        help="with --gate: a candidate that passes is published and rolled "
                             "out on live traffic (orthornn rollout; the flags below) "
                             "instead of promoted at once")
    parser.add_argument("--no-promote", action="store_true",
                        help="with --gate: a candidate that passes is published only (roll it "
                             "out later with orthornn rollout start)")
    add_rollout_flags(parser.add_argument_group("rollout (with --gate --rollout)"))
    parser.set_defaults(run=run_export)

    versions = sub.add_parser(
        "versions", help="list a model's versions: metric, lineage, status",
        description="Every version of REPO/NAME with its test metric, lineage and status "
                    "(promoted, published, rejected by the gate), then the promotion history.")
    add_model_flags(versions)
    versions.set_defaults(run=run_versions)

    rollback = sub.add_parser(
        "rollback", help="move a model's promotion back (the running service swaps)",
        description="Promote the version that was live before the current one, or --to V. "
                    "The version must be in the repository and verify (sha256, golden "
                    "outputs); nothing is deleted.")
    add_model_flags(rollback)
    rollback.add_argument("--to", metavar="V", help="the version to promote (default: the one "
                          "live before the current one)")
    rollback.set_defaults(run=run_rollback)


def run_export(args: argparse.Namespace) -> int:
    if args.verify_only:
        from .artifacts.package import verify_package

        manifest = verify_package(args.verify_only)
        print(f"{args.verify_only}: ok ({manifest.name} version {manifest.version}, "
              f"{manifest.arch} {manifest.mode})")
        return 0
    missing = [flag for flag, v in (("RUN_DIR", args.run_dir), ("--repo", args.repo),
                                    ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --verify-only PACKAGE)")
    from .artifacts.gate import GATE_MARGIN, REFUSED_EXIT, GateRefused
    from .artifacts.storage import check_location, is_object_uri, open_store
    from .builder.exporter import AlreadyPublished, export_run

    if is_object_uri(check_location(args.repo, "--repo")):
        open_store(args.repo).check()  # a missing bucket or refused keys: before any work

    min_metric = None if args.min_metric is None else _float("--min-metric", args.min_metric)
    tolerance = _float("--tolerance", args.tolerance)
    if args.gate_margin is not None and not args.require_better_on_gate_data:
        raise ValueError("--gate-margin applies only with --require-better-on-gate-data")
    margin = GATE_MARGIN if args.gate_margin is None else _float("--gate-margin",
                                                                  args.gate_margin)
    if (args.rollout or args.no_promote) and not args.gate:
        raise ValueError("--rollout and --no-promote apply only with --gate (a rollout takes "
                         "a candidate that passed it)")
    if args.rollout and args.no_promote:
        raise ValueError("--rollout and --no-promote: choose one")
    from .artifacts.repository import model_location, version_of
    from .artifacts.repository import promoted as promoted_version
    from .artifacts.rollout import RolloutError, read_plan, start

    options = plan_options(args) if args.rollout else {}  # bad flags: before any work
    if args.rollout:  # a running rollout refuses the new one: before anything is published
        try:
            running = read_plan(model_location(args.repo, args.name))
        except ValueError:
            running = None  # an unreadable plan is replaced (rollout.start)
        if running is not None and running.running:
            raise RolloutError(f"a rollout of version {running.candidate} is already "
                               f"running for {args.name!r}; `orthornn rollout abort` or "
                               f"`promote` it first (nothing was exported)")
    if args.rollout and promoted_version(model_location(args.repo, args.name)) is None:
        print("orthornn export: no version is promoted yet, so there is nothing to roll out "
              "against: a candidate that passes is promoted at once", file=sys.stderr)
        args.rollout = False
    try:
        path = export_run(args.run_dir, args.repo, args.name, args.mode, args.opset,
                          progress=not args.no_progress, gated=args.gate,
                          min_metric=min_metric, tolerance=tolerance,
                          promote=not (args.rollout or args.no_promote),
                          gate_data=args.gate_data,
                          require_better=args.require_better_on_gate_data, gate_margin=margin)
        print(path)
        if args.rollout:
            with flags_named():
                plan = start(model_location(args.repo, args.name), version_of(path), **options)
            print(f"orthornn export: rollout {plan.id} of version {plan.candidate} "
                  f"started (orthornn rollout status --repo {args.repo} --name {args.name})",
                  file=sys.stderr)
    except AlreadyPublished as same:  # not an error: the model asked for is published
        print(f"orthornn export: {same}", file=sys.stderr)
        print(same.path)
    except GateRefused as refused:
        print(f"orthornn export: refused by the gate: {refused} (kept in {refused.kept})",
              file=sys.stderr)
        return REFUSED_EXIT
    return 0


def _float(flag: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{flag} must be a number; got {text!r}") from None


def _short(value: object, width: int = 12) -> str:
    return "-" if value is None else str(value)[:width]


def run_versions(args: argparse.Namespace) -> int:
    from .artifacts.repository import local_model

    with local_model(model_dir_of(args), whole=lambda v: False) as model_dir:  # manifests
        _print_versions(model_dir)
    return 0


def _print_versions(model_dir: Path) -> None:
    from .artifacts.listing import describe
    from .artifacts.repository import read_promotion

    print(f"{'version':<24} {'status':<11} {'metric':<22} {'created':<25} {'parent':<6} "
          f"{'config':<12} {'source':<12} {'learned':<14}")
    for row in describe(model_dir):
        evaluation, lineage = row["evaluation"] or {}, row["lineage"] or {}
        metric = (f"{evaluation['metric']}={evaluation['value']:.4g}"
                  if isinstance(evaluation.get("value"), int | float)
                  else "absent" if "absent" in evaluation else "-")
        print(f"{row['id']:<24} {row['status']:<11} {metric:<22} {_short(row['created'], 25):<25} "
              f"{_short(lineage.get('parent')):<6} {_short(lineage.get('config_sha256')):<12} "
              f"{_short(lineage.get('source_revision')):<12} {_learned(lineage):<14}")
        if row.get("reason"):
            what = "rolled back" if row["status"] == "rolled_back" else "refused"
            print(f"{'':<24} {what}: {row['reason']}")
    history = read_promotion(model_dir)["history"]
    if history:
        print("\npromotion history:")
        for entry in history:
            print(f"  {entry['time']}  {entry['action']:<8} -> {entry['version']} "
                  f"(was {_short(entry.get('previous'))}): {entry.get('reason', '')}")


def _learned(lineage: dict) -> str:
    """The versions column of what a version learned from captures: labelled records and
    capture segments ("-" for one trained on fixed data, or an older manifest)."""
    captures = lineage.get("captures")
    if not isinstance(captures, dict):
        return "-"
    segments = captures.get("segments")
    count = len(segments) if isinstance(segments, list) else "?"
    return f"{captures.get('labels', '?')} labels/{count} seg"


def run_rollback(args: argparse.Namespace) -> int:
    from .artifacts.rollback import rollback
    from .artifacts.storage import is_object_uri

    model_dir = model_dir_of(args)
    to = None
    if args.to is not None:
        if not args.to.isdigit() or int(args.to) < 1:
            raise ValueError(f"--to must be a version number (a positive integer); got "
                             f"{args.to!r}")
        to = int(args.to)
    done = rollback(model_dir, to)
    was = "promotion.json unreadable" if done["previous"] is None else done["previous"]
    swap = ("" if is_object_uri(str(args.repo))
            else "; a running service swaps to it at its next repository scan")
    print(f"{args.name}: version {done['promoted']} is promoted (was {was}){swap}")
    return 0
