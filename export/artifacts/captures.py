"""The capture folder's format, read side (docs/capture.md): the records ``orthornn serve
--capture DIR`` writes, ``DIR/<model>/<version>/<YYYY-MM-DD>/<replica>-<n>.jsonl`` (``.open``
while written), their arrays, and the labels given back beside them,
``DIR/<model>/labels/<YYYY-MM-DD>/<replica>-1.jsonl``. Written once here for the service
(capture, labels) and for the retraining job's commands (capture dataset, monitor,
retrain-trigger), which run in the training image: numpy and orjson only, no server.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson

OPEN = ".open"  # the suffix of the segment a replica is writing
LABELS = "labels"  # DIR/<model>/labels/: beside the version folders


def array(value: dict[str, Any]) -> np.ndarray:
    """The array a record holds: its dtype, shape and little-endian bytes in base64."""
    data = base64.b64decode(value["b64"])
    return np.frombuffer(data, dtype=np.dtype(value["dtype"])).reshape(value["shape"])


def segments(root: Path, model: str) -> list[Path]:
    """MODEL's segments under ROOT, closed and open, in name order (version folders only:
    the labels folder beside them is not one)."""
    return sorted(p for p in (Path(root) / model).glob("*/*/*.jsonl*")
                  if p.parent.parent.name.isdigit())


def read_records(root: Path, model: str) -> tuple[list[dict[str, Any]], int]:
    """Every record captured for MODEL under ROOT (closed and open segments), and the count
    of lines that are not a whole record (a torn last line of a killed writer)."""
    records, torn = [], 0
    for path in segments(root, model):
        for line in path.read_bytes().splitlines():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                torn += 1
    return records, torn


def label_lines(data: bytes) -> Iterator[dict]:
    """The label lines of a label file's bytes; a torn line a crash left is skipped."""
    for line in data.splitlines():
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(value, dict) and "id" in value and "label" in value:
            yield value


def label_files(root: Path, model: str) -> list[Path]:
    return sorted((Path(root) / model / LABELS).glob("*/*.jsonl"))


def read_labels(root: Path, model: str) -> list[dict]:
    """Every label line of MODEL under the capture folder ROOT: {"id", "label" (a class
    index, a list of them, or token ids), "time" (Unix seconds), "source" ("api" or
    "import")}, in file order (day, then replica); torn lines skipped."""
    return [{"id": v["id"], "label": v["label"], "time": v.get("time"),
             "source": v.get("source")}
            for path in label_files(root, model) for v in label_lines(path.read_bytes())]


def first_labels(root: Path, model: str) -> tuple[dict[str, dict], int]:
    """MODEL's label lines by request id, the earliest (by its time) of an id labelled
    twice (two replicas at once), and how many later ones were left out."""
    labels: dict[str, dict] = {}
    duplicates = 0
    for line in sorted(read_labels(root, model), key=lambda v: v.get("time") or 0.0):
        if line["id"] in labels:
            duplicates += 1
        else:
            labels[line["id"]] = line
    return labels, duplicates
