"""``orthornn monitor --capture DIR --name NAME``: the live drift tests (docs/drift.md) over
the captured records, window by window in time order, against each version's reference
in the repository. Torch-free.

The hidden state is not captured, so each record's inputs are run again through its
version's graph (onnxruntime, from the repository): the outputs and states, and so the
windows' scores, are those the service computed. Windows are per version (each has its own
reference), of whole sequences (a session's chunks are left out, as the service leaves
them out); only full windows are tested. Once labels arrive, the labelled error rate of
each version and ADWIN's change in it (``export.artifacts.loop.error_rate``) are reported too.
``--exit-code``: 1 when the newest window drifts or the error rate of the newest captured
version rose, 0 when neither (or nothing is full or labelled yet), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
from orthornn.export.artifacts.loop.captures import (
    first_labels,
    local_captures,
    parse_since,
    read_records,
)
from orthornn.export.artifacts.loop.error_rate import error_rates
from orthornn.export.artifacts.loop.monitor import Window, iso, monitor
from orthornn.export.artifacts.repository import check_name, local_repo

from .flags import number

DRIFTS_EXIT = 1  # --exit-code: the newest window drifts


def add_monitor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "monitor", help="drift of the captured requests against each version's reference",
        description="Runs the service's drift tests (KS on the input summaries, chi-squared "
                    "on the predicted classes, KS on entropy or NLL, MMD on the final "
                    "state) over the records `orthornn serve --capture DIR` kept, in "
                    "windows in time order, against the reference each version's package "
                    "recorded at export; once labels arrive, each version's labelled "
                    "error rate and river's ADWIN over it. Prints a table; exit 1 with "
                    "--exit-code when the newest window drifts or the error rate rose.")
    parser.add_argument("--capture", metavar="DIR",
                        help="the capture folder, or its bucket (s3://BUCKET/PREFIX; required)")
    parser.add_argument("--name", help="the model's name (required)")
    parser.add_argument("--repo", help="the model repository, where the versions' references "
                                       "and graphs are (default: $ORTHORNN_REPO)")
    parser.add_argument("--since", metavar="DATE",
                        help="only records from this UTC date or time on (YYYY-MM-DD or "
                             "ISO 8601)")
    parser.add_argument("--window", metavar="N",
                        help="sequences per window (default: the window the reference was "
                             "calibrated for, 200)")
    parser.add_argument("--plot", metavar="FILE",
                        help="a plot of every test's score per window, with the alarm line "
                             "(PNG; needs matplotlib, the train extra)")
    parser.add_argument("--json", metavar="FILE", help="the windows and scores as JSON")
    parser.add_argument("--exit-code", action="store_true",
                        help="exit 1 when the newest window drifts or the labelled error "
                             "rate of the newest captured version rose, 0 when not (2: bad "
                             "input)")
    parser.set_defaults(run=run_monitor)



def parse_window(value: str | None) -> int | None:
    return None if value is None else int(number("--window", value, 20, 100_000, integer=True))



def table(windows: list[Window]) -> str:
    tests = list(dict.fromkeys(t for w in windows for t in w.scores))
    head = ["window", "version", "from", "to", "seqs", *tests, "drift"]
    rows = [[str(i), str(w.version), iso(w.start)[:16].replace("T", " "),
             iso(w.end)[:16].replace("T", " "),
             str(w.sequences), *(f"{w.scores[t]:.2f}" if t in w.scores else "-" for t in tests),
             "DRIFT" if w.drifts else "no"] for i, w in enumerate(windows)]
    widths = [max(len(r[j]) for r in [head, *rows]) for j in range(len(head))]
    return "\n".join("  ".join(c.rjust(n) for c, n in zip(r, widths, strict=True))
                     for r in [head, *rows])


def plot(windows: list[Window], path: Path, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 3.5))
    tests = list(dict.fromkeys(t for w in windows for t in w.scores))
    x = np.arange(len(windows))
    for test in tests:
        ax.plot(x, [w.scores.get(test, np.nan) for w in windows], marker="o", ms=3,
                label=test)
    ax.axhline(1.0, color="red", linestyle="--", linewidth=1, label="alarm (score 1)")
    ax.set_yscale("symlog", linthresh=1.0)  # linear up to the alarm line, then log
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("window (time order)")
    ax.set_ylabel("statistic / threshold")
    ax.set_title(f"drift of {name}'s captured requests")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_monitor(args: argparse.Namespace) -> int:
    missing = [f for f, v in (("--capture", args.capture), ("--name", args.name)) if not v]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    name = check_name(args.name)
    capture = local_captures(args.capture, name, show=sys.stderr.isatty())
    repo_value = args.repo or os.environ.get("ORTHORNN_REPO")
    if not repo_value:
        raise ValueError("--repo: required (or ORTHORNN_REPO): the versions' references and "
                         "graphs are in the repository")
    with local_repo(repo_value, name) as repo:  # a bucket's model: mirrored while read
        if not (repo / name).is_dir():
            raise ValueError(f"--repo, --name: no model {name!r} in {repo_value!r}")
        return report(args, capture, repo, name)


def report(args: argparse.Namespace, capture: Path, repo: Path, name: str) -> int:
    """The drift windows and labelled error rates of NAME's captures against REPO's
    versions, printed (and written as JSON and a plot when asked); the exit code."""
    start, window = parse_since(args.since), parse_window(args.window)
    since = None if start is None else start.timestamp()
    if args.plot:
        import matplotlib  # noqa: F401  # a missing train extra: one line, before the work
    records, torn = read_records(capture, name)  # once, for the windows and the labels
    windows, notes = monitor(records, repo, name, since, window,
                             progress=sys.stderr.isatty())
    if torn:
        notes.insert(0, f"{torn} torn lines skipped")
    try:
        rates = error_rates(records, first_labels(capture, name)[0], repo, name, since)
    except ModuleNotFoundError as error:  # the serve image: no river
        rates = []
        notes.append(f"the labelled error rate is not measured: {error.name} is not "
                     f"installed (the train extra)")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    verdict = []
    if windows:
        print(table(windows))
        newest = windows[-1]
        verdict.append(f"{len(windows)} windows, {sum(w.drifts for w in windows)} "
                       f"drifting; the newest (version {newest.version}, to "
                       f"{iso(newest.end)}) {'DRIFTS' if newest.drifts else 'does not drift'}")
    for rate in rates:
        print(f"labels: {rate.line()}")
    # the labels speak for the version serving now (the newest captured), not a past one
    newest_version = max((r["version"] for r in records
                          if isinstance(r.get("version"), int)), default=None)
    rose = bool(rates) and rates[-1].rose and rates[-1].version == newest_version
    if rose:
        verdict.append(f"the labelled error rate of version {rates[-1].version} ROSE "
                       f"(ADWIN: {rates[-1].before:.4f} -> {rates[-1].after:.4f})")
    # the last line: retrain-trigger quotes it
    print("; ".join(verdict) if verdict else f"no full window of {name}'s captured "
                                              f"sequences yet")
    drifts = bool(windows and windows[-1].drifts) or rose
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"model": name, "windows": [w.to_dict() for w in windows], "notes": notes,
             "newest_drifts": bool(windows and windows[-1].drifts),
             "error_rates": [r.to_dict() for r in rates], "error_rate_rose": rose,
             "drift": drifts}, indent=2) + "\n")
    if args.plot and windows:
        plot(windows, Path(args.plot), name)
    if args.exit_code and drifts:
        return DRIFTS_EXIT
    return 0
