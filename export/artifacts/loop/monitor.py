"""The drift windows of the captured records (``orthornn monitor``, docs/drift.md): each
version's whole sequences in time order, at most a request's share of each window, run
again through the version's graph (the hidden state is not captured) and scored against
its package's reference, as the service scores its live windows. Torch-free; the command
(``service.commands.monitor``) prints, plots and decides the exit status."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..package import PackageError, check_hashes, package_file, read_manifest, session
from . import drift
from .captures import array, progress_bar


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
        return {"version": self.version, "start": iso(self.start), "end": iso(self.end),
                "sequences": self.sequences, "scores": self.scores, "drift": self.drifts}


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds")


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
            scores = reference.window_scores(seqs, outputs, states)
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
