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
import datetime as dt
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from orthornn.export.artifacts.loop import drift
from orthornn.export.artifacts.loop.captures import (
    array,
    first_labels,
    parse_since,
    progress_bar,
    read_records,
)
from orthornn.export.artifacts.loop.error_rate import error_rates
from orthornn.export.artifacts.package import (
    PackageError,
    check_hashes,
    package_file,
    read_manifest,
    session,
)
from orthornn.export.artifacts.repository import check_name

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
    parser.add_argument("--capture", metavar="DIR", help="the capture folder (required)")
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


@dataclass
class Window:
    version: int
    start: float  # the time of its first and last record (Unix seconds)
    end: float
    sequences: int
    scores: dict[str, float] = field(default_factory=dict)

    @property
    def drifts(self) -> bool:
        return any(s >= 1 for s in self.scores.values())

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "start": _iso(self.start), "end": _iso(self.end),
                "sequences": self.sequences, "scores": self.scores, "drift": self.drifts}


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


def parse_window(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 20 <= n <= 100_000:
        raise ValueError(f"--window must be an integer in [20, 100000]; got {value!r}")
    return n


def _sequences(records: list[dict], since: float | None) -> dict[int, list[tuple]]:
    """Per version, (time, its whole sequences) of every request in time order."""
    out: dict[int, list[tuple]] = {}
    for r in sorted(records, key=lambda r: r.get("time", 0)):
        if r.get("session") is not None or (since is not None and r.get("time", 0) < since):
            continue
        try:
            version = int(r["version"])
            seqs = [array(v) for v in r["inputs"]]
        except (KeyError, TypeError, ValueError):
            continue  # not a record this reads
        out.setdefault(version, []).append((float(r["time"]), seqs))
    return out


def monitor(records: list[dict], repo: Path, name: str, since: float | None = None,
            window: int | None = None, progress: bool = False) -> tuple[list[Window], list[str]]:
    """The tested windows of NAME's captured RECORDS (all versions, by their end time), and
    notes (versions left out, and why)."""
    notes: list[str] = []
    windows: list[Window] = []
    for version, requests in sorted(_sequences(records, since).items()):
        path = repo / name / str(version)
        try:
            manifest = read_manifest(path)
            check_hashes(path, manifest)
            if manifest.reference is None:
                notes.append(f"version {version}: its package has no drift reference "
                             f"(exported before it); {sum(len(q) for _, q in requests)} "
                             f"sequences not tested")
                continue
            reference = drift.read(package_file(path, "reference", manifest.reference))
            sess = session(path / manifest.graphs["model"])
        except (PackageError, ValueError, OSError) as error:
            notes.append(f"version {version}: not tested: {error}")
            continue
        size = window or reference.window
        # as the service counts them: at most per_request(size) sequences of one request
        cap = drift.per_request(size)
        items = [(t, s) for t, seqs in requests for s in seqs[:cap]]
        full = len(items) // size
        if full == 0:
            notes.append(f"version {version}: {len(items)} sequences, no full window of "
                         f"{size} yet")
            continue
        bar = progress_bar(full, f"version {version}", "window", progress)
        for k in range(full):
            part = items[k * size:(k + 1) * size]
            seqs = [s for _, s in part]
            outputs, states = drift.run_graph(sess, manifest.output_name, seqs)
            scores = reference.scores(reference.summarize(seqs, outputs, states))
            windows.append(Window(version, part[0][0], part[-1][0], size, scores))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        if len(items) % size:
            notes.append(f"version {version}: the last {len(items) % size} sequences wait "
                         f"for a full window")
    windows.sort(key=lambda w: w.end)
    return windows, notes


def table(windows: list[Window]) -> str:
    tests = list(dict.fromkeys(t for w in windows for t in w.scores))
    head = ["window", "version", "from", "to", "seqs", *tests, "drift"]
    rows = [[str(i), str(w.version), _iso(w.start)[:16].replace("T", " "),
             _iso(w.end)[:16].replace("T", " "),
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
    capture = Path(args.capture)
    if not capture.is_dir():
        raise ValueError(f"--capture: {str(capture)!r} is not a folder")
    repo_value = args.repo or os.environ.get("ORTHORNN_REPO")
    if not repo_value:
        raise ValueError("--repo: required (or ORTHORNN_REPO): the versions' references and "
                         "graphs are in the repository")
    repo = Path(repo_value)
    if not (repo / name).is_dir():
        raise ValueError(f"--repo, --name: no model {name!r} in {str(repo)!r}")
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
                       f"{_iso(newest.end)}) {'DRIFTS' if newest.drifts else 'does not drift'}")
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
