"""``orthornn capture dataset``: a training set from the labelled captures, thin over
``export.artifacts.loop.dataset``. Torch-free, and without the serving stack; the command
package hands in its one ``--no-progress`` definition (``training.flags``, which service/
does not import)."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path

from .flags import number


def add_capture_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                       add_progress_flag: Callable[[argparse.ArgumentParser], None]) -> None:
    capture = sub.add_parser("capture", help="the captured requests (a training set from "
                                             "the labelled ones)")
    actions = capture.add_subparsers(dest="action", metavar="ACTION", required=True)
    data = actions.add_parser(
        "dataset", help="labelled captures -> an .npz for orthornn train --task classify "
                        "--data, or a text corpus for --task lm --corpus",
        description="Joins the labels to the captured records by id (a label later than "
                    "--window days after its record is not used; an id captured twice is "
                    "kept once), splits by time (the newest --holdout-share of the "
                    "labelled records is held out) and writes FILE and FILE2 in the format "
                    "orthornn train --task classify --data reads, with the provenance "
                    "arrays ids, times, segments and versions; a language model's as the "
                    "text corpus --task lm --corpus reads (a line per sequence: its input "
                    "tokens, then its labelled next tokens, as words of the vocabulary of "
                    "the version that answered; needs --repo), the provenance in FILE.json.")
    data.add_argument("--capture", metavar="DIR", required=True,
                      help="the capture folder, or its bucket (s3://BUCKET/PREFIX)")
    data.add_argument("--name", required=True, help="the model's name")
    data.add_argument("--since", metavar="DATE",
                      help="only records from this UTC date or time on (YYYY-MM-DD or "
                           "ISO 8601)")
    data.add_argument("--window", metavar="DAYS", default="7",
                      help="a label counts when it came at most DAYS after its record "
                           "(default 7)")
    data.add_argument("--holdout-share", metavar="F", default="0.2",
                      help="the newest share of the labelled records held out (0 <= F < 1, "
                           "default 0.2; 0: no FILE2)")
    data.add_argument("--out", metavar="FILE", required=True,
                      help="the training part (.npz; a language model's: a text corpus)")
    data.add_argument("--holdout", metavar="FILE2",
                      help="the held-out part (default: <FILE stem>-holdout.npz beside FILE; "
                           "a language model's: <FILE stem>-holdout<FILE's suffix or .txt>)")
    data.add_argument("--repo", metavar="REPO",
                      help="the model repository: the class names (or a language model's "
                           "vocabulary, required then) from the manifests of the versions "
                           "that answered (default: as the records' answers name them)")
    add_progress_flag(data)
    data.set_defaults(run=run_dataset)


def run_dataset(args: argparse.Namespace) -> int:
    from orthornn.export.artifacts.loop.captures import local_captures
    from orthornn.export.artifacts.loop.dataset import holdout_path, write_dataset
    from orthornn.export.artifacts.repository import check_name, local_repo

    share = number("--holdout-share", args.holdout_share)
    capture = local_captures(args.capture, args.name, show=not args.no_progress)
    with contextlib.ExitStack() as stack:  # a bucket's model: mirrored while it is read
        repo = None if args.repo is None else \
            stack.enter_context(local_repo(args.repo, check_name(args.name)))
        summary = write_dataset(capture, args.name, Path(args.out),
                                None if args.holdout is None else Path(args.holdout),
                                since=args.since, window_days=number("--window", args.window),
                                holdout_share=share, repo=repo, progress=not args.no_progress)
    for line in summary.lines():
        print(f"{args.name}: {line}")
    held = "" if share == 0 else \
        f", {args.holdout or holdout_path(Path(args.out), summary.task)} ({summary.holdout})"
    print(f"wrote {args.out} ({summary.train}){held}")
    return 0
