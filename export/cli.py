"""``orthornn export``: publish a run as a model package, or verify a package.
Torch-free at import; the exporter is imported when the command runs."""

from __future__ import annotations

import argparse
import sys


def add_export_parser(sub) -> None:
    parser = sub.add_parser(
        "export", help="export a run to ONNX and publish it into a model repository",
        description="orthornn export RUN_DIR --repo REPO --name NAME [--mode dense|factored] "
                    "publishes REPO/NAME/<next version>/ and prints its path; "
                    "orthornn export --verify-only PACKAGE checks a package.")
    parser.add_argument("run_dir", nargs="?", help="a training run directory")
    parser.add_argument("--repo", help="model repository root")
    parser.add_argument("--name", help="model name in the repository")
    parser.add_argument("--mode", default="dense", help="dense (default) or factored")
    parser.add_argument("--opset", type=int, default=18, help="ONNX opset (17-21, default 18)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress (default: a bar on a terminal, a line every few "
                             "seconds in a log)")
    parser.add_argument("--verify-only", metavar="PACKAGE",
                        help="verify a package (hashes and golden outputs) and exit")
    parser.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    if args.verify_only:
        from .package import verify_package

        manifest = verify_package(args.verify_only)
        print(f"{args.verify_only}: ok ({manifest.name} version {manifest.version}, "
              f"{manifest.arch} {manifest.mode})")
        return 0
    missing = [flag for flag, v in (("RUN_DIR", args.run_dir), ("--repo", args.repo),
                                    ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give --verify-only PACKAGE)")
    from .exporter import AlreadyPublished, export_run

    try:
        print(export_run(args.run_dir, args.repo, args.name, args.mode, args.opset,
                         progress=not args.no_progress))
    except AlreadyPublished as same:  # not an error: the model asked for is published
        print(f"orthornn export: {same}", file=sys.stderr)
        print(same.path)
    return 0
