"""The labelled error rate of the captures (docs/drift.md, "Once labels arrive"): each
captured answer that got a label is right or wrong, per version in the order the answers
were given, and river's ADWIN watches that stream for a change. The drift tests compare
inputs and outputs with a reference; this one measures what the labels say the model got
wrong, so it sees a shift that keeps the inputs alike and moves only the answers.

Classifiers only (a label is a class index per sequence); torch-free. ``orthornn monitor``
reports it beside the drift windows, and its ``--exit-code`` counts a rise as drift.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from orthornn.export.artifacts.loop.captures import array
from orthornn.export.artifacts.package import PackageError, read_manifest

# ADWIN's confidence (river's default): a change is declared when two sub-windows' means
# differ by more than the Hoeffding-style bound at this delta (Bifet and Gavalda, 2007)
DELTA = 0.002


@dataclass
class ErrorRate:
    """One version's labelled answers: how many, how many wrong, and ADWIN's last change."""

    version: int
    labelled: int
    errors: int
    expected: float | None  # 1 - the package's accuracy on its test split
    change_at: int | None = None  # the labelled answer (0-based) at which ADWIN cut
    change_time: float | None = None
    before: float | None = None  # the error rate of the answers ADWIN dropped
    after: float | None = None  # and of every answer from the kept ones' first on

    @property
    def rate(self) -> float:
        return self.errors / self.labelled if self.labelled else 0.0

    @property
    def rose(self) -> bool:
        """ADWIN's last change was a rise of the error rate."""
        return self.change_at is not None and self.after is not None and \
            self.before is not None and self.after > self.before

    def line(self) -> str:
        expected = "" if self.expected is None else \
            f" (its test split: {self.expected:.4f})"
        text = (f"version {self.version}: {self.labelled} labelled answers, error rate "
                f"{self.rate:.4f}{expected}")
        if self.change_at is None:
            return text + "; ADWIN: no change"
        when = dt.datetime.fromtimestamp(self.change_time or 0, dt.UTC).isoformat(
            timespec="seconds")
        verb = "ROSE" if self.rose else "fell"
        return (text + f"; ADWIN: the error rate {verb} from {self.before:.4f} to "
                f"{self.after:.4f} at labelled answer {self.change_at + 1} ({when})")

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "labelled": self.labelled, "errors": self.errors,
                "rate": self.rate, "expected": self.expected, "change_at": self.change_at,
                "before": self.before, "after": self.after, "rose": self.rose}


def predicted(outputs: Any) -> list[int] | None:
    """The class each sequence of a captured answer was given: /predict's items (their
    probabilities' argmax, else their ``index``, else the first of ``top_k``), or the OIP
    ``logits`` tensor's argmax; None for an answer that is not a classifier's."""
    if isinstance(outputs, list):
        classes = []
        for item in outputs:
            if not isinstance(item, dict):
                return None
            top = item.get("top_k")
            if isinstance(item.get("probabilities"), list) and item["probabilities"]:
                classes.append(int(np.argmax(item["probabilities"])))
            elif isinstance(item.get("index"), int):
                classes.append(item["index"])
            elif isinstance(top, list) and top and isinstance(top[0], dict) and \
                    isinstance(top[0].get("index"), int):
                classes.append(top[0]["index"])
            else:
                return None
        return classes
    if isinstance(outputs, dict) and isinstance(outputs.get("logits"), dict):
        try:
            logits = array(outputs["logits"])
        except (KeyError, TypeError, ValueError):
            return None
        if logits.ndim != 2:  # [B, C] only: per-step logits are not one class a sequence
            return None
        return [int(c) for c in logits.argmax(axis=1)]
    return None


def streams(records: list[dict], labels: dict[str, dict], since: float | None = None
            ) -> dict[int, list[tuple[float, bool]]]:
    """Per version, (time, wrong) of every labelled sequence of the captured RECORDS, in
    the order the answers were given; LABELS: a label line by id (``first_labels``); a
    request captured twice counts once."""
    seen: set[str] = set()
    out: dict[int, list[tuple[float, bool]]] = {}
    for r in sorted(records, key=lambda r: r.get("time", 0)):
        rid = r.get("id")
        if rid in seen or rid not in labels or r.get("session") is not None or \
                (since is not None and r.get("time", 0) < since):
            continue
        seen.add(rid)
        label = labels[rid]["label"]
        truth = label if isinstance(label, list) else [label]
        given = predicted(r.get("outputs"))
        if given is None or len(given) != len(truth) or \
                not all(isinstance(t, int) for t in truth):
            continue  # not a classifier's answer, or a label of another shape
        try:
            version, when = int(r["version"]), float(r["time"])
        except (KeyError, TypeError, ValueError):
            continue
        out.setdefault(version, []).extend((when, g != t) for g, t in zip(given, truth,
                                                                          strict=True))
    return out


def adwin(wrong: list[bool], delta: float = DELTA) -> tuple[int | None, int]:
    """river's ADWIN over the 0/1 error stream: (the index of its last change, or None;
    the width of the window it kept there)."""
    from river.drift import ADWIN

    detector = ADWIN(delta=delta)
    last, width = None, 0
    for i, w in enumerate(wrong):
        detector.update(int(w))
        if detector.drift_detected:
            last, width = i, int(detector.width)
    return last, width


def error_rates(records: list[dict], labels: dict[str, dict], repo: Path, name: str,
                since: float | None = None) -> list[ErrorRate]:
    """The labelled error rate of each version of NAME with labelled answers among its
    captured RECORDS, and ADWIN's last change in it. ModuleNotFoundError when river (the
    train extra) is missing."""
    rates = []
    for version, items in sorted(streams(records, labels, since).items()):
        wrong = [w for _, w in items]
        try:
            manifest = read_manifest(Path(repo) / name / str(version))
            expected = None if manifest.evaluation is None or \
                manifest.evaluation.get("metric") != "accuracy" else \
                1.0 - float(manifest.evaluation["value"])
        except (PackageError, ValueError, OSError, TypeError, KeyError):
            expected = None
        rate = ErrorRate(version, len(wrong), sum(wrong), expected)
        at, width = adwin(wrong)
        if at is not None:
            start = at + 1 - width  # the answers ADWIN kept: [start, at]
            if start > 0:
                rate.change_at, rate.change_time = at, items[at][0]
                rate.before = float(np.mean(wrong[:start]))
                rate.after = float(np.mean(wrong[start:]))
        rates.append(rate)
    return rates
