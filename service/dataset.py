"""A training data set from the captures (``orthornn capture dataset``, docs/capture.md):
the labels (``captures.first_labels``) joined to the captured records by request id, within
a late-label window, one record per id (a retry captured twice is kept once), split by
time (the newest labelled share held out), written as the .npz that ``orthornn train
--task classify --data`` reads (x, lengths, y, labels) with provenance arrays training
ignores (ids, times, segments, versions). Torch-free: numpy, orjson, and tqdm when it is
installed."""

from __future__ import annotations

import datetime as dt
import io
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from orthornn.export.artifacts.captures import OPEN, array, first_labels, line_records
from orthornn.export.artifacts.package import read_manifest
from orthornn.export.artifacts.records import atomic_write
from orthornn.export.artifacts.repository import check_name

MIN_EXAMPLES = 10  # training's minimum (training/tasks/user.py load_npz)
DAY = 86_400.0


@dataclass
class Summary:
    records: int = 0  # captured records read (every version, since --since)
    labelled: int = 0  # records joined to a label (each once)
    unlabelled: int = 0
    late: int = 0  # labels that came more than the window after their record
    duplicates: int = 0  # records of an id already read (a retry), and repeated labels
    torn: int = 0  # lines that are not a whole record (a killed writer's last)
    classes: dict[str, int] = field(default_factory=dict)  # class name -> sequences
    train: int = 0  # sequences in FILE
    holdout: int = 0  # sequences in FILE2

    def lines(self) -> list[str]:
        per_class = ", ".join(f"{name}: {n}" for name, n in self.classes.items())
        return [f"records {self.records}, labelled {self.labelled}, unlabelled "
                f"{self.unlabelled}, late labels {self.late}, duplicates {self.duplicates}"
                + (f", torn lines {self.torn}" if self.torn else ""),
                f"per class: {per_class or '-'}",
                f"train {self.train} sequences, holdout {self.holdout}"]


def check_since(since: str | None) -> str | None:
    """--since as YYYY-MM-DD (a UTC day), or None."""
    if since is None:
        return None
    try:
        return dt.date.fromisoformat(since).isoformat()
    except ValueError:
        raise ValueError(f"--since: a date YYYY-MM-DD (UTC); got {since!r}") from None


def segments(root: Path, model: str, since: str | None = None) -> list[Path]:
    """MODEL's capture segments (closed and open) of every version, day >= SINCE."""
    return sorted(p for p in (Path(root) / model).glob("*/*/*.jsonl*")
                  if p.parent.parent.name.isdigit()
                  and (p.name.endswith(".jsonl") or p.name.endswith(".jsonl" + OPEN))
                  and (since is None or p.parent.name >= since))


def _progress(total: int, show: bool) -> Any:
    """A tqdm bar over the records' bytes (tqdm comes with the train extra; without it, or
    with --no-progress, none)."""
    if not show:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="capture dataset: records",
                file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 5.0)


def _records(paths: list[Path], root: Path, summary: Summary, show: bool
             ) -> Iterator[tuple[str, dict]]:
    """(segment name relative to ROOT, without .open; record) of every whole line."""
    sizes = {}
    for p in paths:
        try:
            sizes[p] = p.stat().st_size
        except FileNotFoundError:  # renamed from .open since the listing: read below
            sizes[p] = 0
    bar = _progress(sum(sizes.values()), show)
    try:
        for path in paths:
            name = path.relative_to(root).as_posix()
            name = name[:-len(OPEN)] if name.endswith(OPEN) else name
            try:
                data = path.read_bytes()
            except FileNotFoundError:  # closed by rename meanwhile
                data = (root / name).read_bytes()
            for line in data.splitlines():
                found = line_records(line)  # a batch's line: its requests' records
                if not found or not all(isinstance(r.get("id"), str) for r in found):
                    summary.torn += 1
                    continue
                for record in found:
                    yield name, record
            if bar is not None:
                bar.set_postfix_str(f"records={summary.records}", refresh=False)
                bar.update(sizes[path])
    finally:
        if bar is not None:
            bar.close()


@dataclass
class _Row:
    id: str
    time: float
    version: int
    segment: str
    x: np.ndarray  # [T, d] float32
    y: int


def _class_names(rows_versions: set[int], repo: Path | None, model: str,
                 outputs: dict[int, dict[int, str]], sizes: dict[int, int]) -> list[str]:
    """The class names: from the manifests of the versions that answered (REPO), or from
    what the records' outputs named (``label``/``index`` pairs) without one."""
    if repo is not None:
        names: list[str] | None = None
        for v in sorted(rows_versions):
            manifest = read_manifest(Path(repo) / model / str(v))
            if manifest.task != "classify":
                raise ValueError(f"model {model!r} version {v} is a "
                                 f"{manifest.task} model; the data set is for classify "
                                 f"models (the lm task trains on a text --corpus)")
            found = [str(n) for n in manifest.labels or range(manifest.output_spec.size)]
            if names is not None and found != names:
                raise ValueError(f"versions of {model!r} differ in their "
                                 f"classes ({names} and {found} in version {v}); use --since "
                                 f"to take one version's captures")
            names = found
        return names or []
    size = max(sizes.values(), default=0)
    named: dict[int, str] = {}
    for pairs in outputs.values():
        named.update(pairs)
    return [named.get(i, str(i)) for i in range(size)]


def _output_classes(outputs: Any) -> tuple[int, dict[int, str]]:
    """(class count, index -> name) a captured answer shows: /predict's probabilities and
    label/index (and top-k) items, or the OIP logits tensor."""
    size, names = 0, {}
    if isinstance(outputs, list):
        for item in outputs:
            if not isinstance(item, dict):
                continue
            if isinstance(item.get("probabilities"), list):
                size = max(size, len(item["probabilities"]))
            for pair in [item, *(item.get("top_k") or [])]:
                if isinstance(pair, dict) and isinstance(pair.get("index"), int) and \
                        isinstance(pair.get("label"), str):
                    names[pair["index"]] = pair["label"]
    elif isinstance(outputs, dict) and isinstance(outputs.get("logits"), dict):
        shape = outputs["logits"].get("shape") or [0]
        size = int(shape[-1])
    return size, names


def build(root: Path, model: str, *, since: str | None = None, window_days: float = 7.0,
          holdout_share: float = 0.2, repo: Path | None = None, progress: bool = True
          ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], Summary]:
    """The train and holdout arrays of MODEL's labelled captures under ROOT, and the
    counts. ValueError naming the flag for a bad argument or too few labelled records."""
    root = Path(root)
    check_name(model)
    since = check_since(since)
    if not (isinstance(window_days, int | float) and window_days > 0):
        raise ValueError(f"--window: days > 0; got {window_days!r}")
    if not (isinstance(holdout_share, int | float) and 0 <= holdout_share < 1):
        raise ValueError(f"--holdout-share: a share 0 <= F < 1; got {holdout_share!r}")
    if not (root / model).is_dir():
        raise ValueError(f"--capture: no captures of model {model!r} in {str(root)!r}")
    summary = Summary()
    labels, summary.duplicates = first_labels(root, model)
    seen: set[str] = set()
    rows: list[_Row] = []
    outputs: dict[int, dict[int, str]] = {}
    sizes: dict[int, int] = {}
    for segment, record in _records(segments(root, model, since), root, summary, progress):
        summary.records += 1
        rid = record["id"]
        if rid in seen:  # the same request captured twice (a retry): the first kept
            summary.duplicates += 1
            continue
        seen.add(rid)
        label = labels.get(rid)
        if label is None:
            summary.unlabelled += 1
            continue
        when = float(record.get("time") or 0.0)
        if float(label.get("time") or 0.0) - when > window_days * DAY:
            summary.late += 1
            continue
        version = int(record["version"])
        size, names = _output_classes(record.get("outputs"))
        sizes[version] = max(sizes.get(version, 0), size)
        outputs.setdefault(version, {}).update(names)
        inputs = [array(v) for v in record.get("inputs") or []]
        ys = label["label"] if isinstance(label["label"], list) else [label["label"]]
        if len(ys) != len(inputs) or not all(isinstance(y, int) for y in ys) or \
                any(x.ndim != 2 or x.dtype.kind != "f" for x in inputs):
            raise ValueError(f"record {rid!r} of model {model!r} is not a "
                             f"classifier's (float inputs [T, d], one class index per "
                             f"sequence); the data set is for classify models (the lm "
                             f"task trains on a text --corpus)")
        summary.labelled += 1
        rows.extend(_Row(rid, when, version, segment, x.astype(np.float32), int(y))
                    for x, y in zip(inputs, ys, strict=True))
    classes = _class_names({r.version for r in rows}, repo, model, outputs, sizes)
    if rows and max(r.y for r in rows) >= len(classes):
        raise ValueError(f"class index {max(r.y for r in rows)} outside the "
                         f"{len(classes)} classes of {model!r} (pass --repo to read them from "
                         f"the manifests)")
    # by time: the newest labelled records held out (a record's sequences stay together)
    order = sorted({(r.time, r.id) for r in rows})
    held = round(len(order) * holdout_share)
    newest = set(order[len(order) - held:]) if held else set()
    train = [r for r in rows if (r.time, r.id) not in newest]
    holdout = [r for r in rows if (r.time, r.id) in newest]
    train.sort(key=lambda r: r.time)
    holdout.sort(key=lambda r: r.time)
    summary.train, summary.holdout = len(train), len(holdout)
    counts = Counter(r.y for r in rows)
    summary.classes = {classes[i]: counts[i] for i in sorted(counts)}
    if len(train) < MIN_EXAMPLES or (holdout_share > 0 and len(holdout) < MIN_EXAMPLES):
        raise ValueError(f"too few labelled sequences of {model!r}: "
                         f"{len(train)} to train on and {len(holdout)} held out (training "
                         f"needs at least {MIN_EXAMPLES} in each; labelled records "
                         f"{summary.labelled}, unlabelled {summary.unlabelled}, late labels "
                         f"{summary.late})")
    widths = {x.shape[1] for r in rows for x in [r.x]}
    if len(widths) > 1:
        raise ValueError(f"the records of {model!r} differ in their feature "
                         f"size {sorted(widths)}; use --since to take one version's captures")
    return _arrays(train, classes), _arrays(holdout, classes), summary


def _arrays(rows: list[_Row], names: list[str]) -> dict[str, np.ndarray]:
    """x [N, T, d] float32 zero-padded, lengths, y, labels, and the provenance."""
    steps = max((r.x.shape[0] for r in rows), default=1)
    width = rows[0].x.shape[1] if rows else 1
    x = np.zeros((len(rows), steps, width), np.float32)
    for i, r in enumerate(rows):
        x[i, :r.x.shape[0]] = r.x
    return {"x": x, "lengths": np.array([r.x.shape[0] for r in rows], np.int64),
            "y": np.array([r.y for r in rows], np.int64), "labels": np.array(names, dtype=str),
            "ids": np.array([r.id for r in rows], dtype=str),
            "times": np.array([r.time for r in rows], np.float64),
            "segments": np.array(sorted({r.segment for r in rows}), dtype=str),
            "versions": np.array([r.version for r in rows], np.int64)}


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """ARRAYS as an .npz at PATH, atomically (a reader sees the old file or the new one)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    atomic_write(path, lambda tmp: tmp.write_bytes(buffer.getvalue()))


def holdout_path(out: Path) -> Path:
    """FILE2's default: ``<FILE stem>-holdout.npz`` beside FILE."""
    return out.with_name(f"{out.stem}-holdout.npz")


def write_dataset(root: Path, model: str, out: Path, holdout: Path | None = None, *,
                  since: str | None = None, window_days: float = 7.0,
                  holdout_share: float = 0.2, repo: Path | None = None,
                  progress: bool = True) -> Summary:
    """``build`` written to OUT and HOLDOUT (default ``holdout_path(OUT)``; none when the
    share is 0)."""
    out = Path(out)
    if not out.parent.is_dir():
        raise ValueError(f"--out: the folder {str(out.parent)!r} does not exist")
    train, held, summary = build(root, model, since=since, window_days=window_days,
                                 holdout_share=holdout_share, repo=repo, progress=progress)
    write_npz(out, train)
    if holdout_share > 0:
        write_npz(Path(holdout) if holdout is not None else holdout_path(out), held)
    return summary
