"""A training data set from the captures (``orthornn capture dataset``, docs/capture.md):
the labels (``captures.first_labels``) joined to the captured records by request id, within
a late-label window, one record per id (a retry captured twice is kept once), split by
time (the newest labelled share held out), and written as what ``orthornn train`` reads:

- a classifier's: the .npz of ``--task classify --data`` (x, lengths, y, labels) with
  provenance arrays training ignores (ids, times, segments, versions);
- a language model's: the text corpus of ``--task lm --corpus``, a document (one line) per
  labelled sequence, its input tokens then its labelled next tokens as words of the
  vocabulary of the version that answered (``<unk>`` and ``<eos>`` as their markers,
  ``export.artifacts.vocabulary.word_text``), and the provenance in a JSON sidecar
  (``sidecar``: FILE.json; ids, times, versions, segments, and each document's token ids).

Torch-free: numpy, orjson, and tqdm when it is installed."""

from __future__ import annotations

import datetime as dt
import io
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from orthornn.export.artifacts.loop.captures import (
    array,
    fingerprint,
    first_labels,
    line_records,
    parse_since,
    progress_bar,
    segment_name,
    segments,
)
from orthornn.export.artifacts.package import Manifest, read_manifest, read_vocabulary
from orthornn.export.artifacts.records import atomic_write
from orthornn.export.artifacts.repository import check_name
from orthornn.export.artifacts.vocabulary import UNK, sidecar, word_text

from .rows import Labelled, Row, class_names, classify_rows, lm_rows, task_of

MIN_EXAMPLES = 10  # training's minimum (training/tasks/user.py load_npz)
# an lm corpus: training splits each file by document (every 20th to validation, the next
# to test: 12 documents at least) and reads at least 100 words (training/corpus.py)
LM_MIN_EXAMPLES, LM_MIN_WORDS = 12, 100
CORPUS_FORMAT = "orthornn-captured-corpus/1"
DAY = 86_400.0


@dataclass
class Summary:
    records: int = 0  # captured records read (every version, since --since)
    labelled: int = 0  # records joined to a label (each once)
    unlabelled: int = 0
    late: int = 0  # labels that came more than the window after their record
    duplicates: int = 0  # records of an id already read (a retry), and repeated labels
    ambiguous: int = 0  # labelled ids captured for two requests with different inputs: left out
    torn: int = 0  # lines that are not a whole record (a killed writer's last)
    classes: dict[str, int] = field(default_factory=dict)  # class name -> sequences
    train: int = 0  # sequences in FILE
    holdout: int = 0  # sequences in FILE2
    task: str = "classify"  # or lm
    tokens: int = 0  # lm: the tokens written (FILE and FILE2)
    unmapped: int = 0  # lm: of them, ids the vocabulary has no word for (written as <unk>)

    def lines(self) -> list[str]:
        per_class = ", ".join(f"{name}: {n}" for name, n in self.classes.items())
        return [f"records {self.records}, labelled {self.labelled}, unlabelled "
                f"{self.unlabelled}, late labels {self.late}, duplicates {self.duplicates}"
                + (f", torn lines {self.torn}" if self.torn else "")
                + (f", ambiguous ids {self.ambiguous} (left out)" if self.ambiguous else ""),
                f"tokens {self.tokens}, not in the vocabulary {self.unmapped} (written as "
                f"{UNK})" if self.task == "lm" else f"per class: {per_class or '-'}",
                f"train {self.train} sequences, holdout {self.holdout}"]


def _records(paths: list[Path], root: Path, summary: Summary, show: bool
             ) -> Iterator[tuple[str, dict]]:
    """(segment name relative to ROOT, without .open; record) of every whole line."""
    sizes = {}
    for p in paths:
        try:
            sizes[p] = p.stat().st_size
        except FileNotFoundError:  # renamed from .open since the listing: read below
            sizes[p] = 0
    bar = progress_bar(sum(sizes.values()), "capture dataset: records", "B", show)
    try:
        for path in paths:
            name = segment_name(path, root)
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



def _join(root: Path, model: str, since: dt.datetime | None, window_days: float,
          summary: Summary,
          progress: bool) -> list[Labelled]:
    """MODEL's captured records with a label in the window, each id once, counted."""
    labels, summary.duplicates = first_labels(root, model)
    seen: dict[str, bytes] = {}  # id -> its first record's fingerprint
    ambiguous: set[str] = set()
    joined: list[Labelled] = []
    for segment, record in _records(segments(root, model, since), root, summary, progress):
        if since is not None and float(record.get("time") or 0.0) < since.timestamp():
            continue  # (a day's segment holds the hours before a --since time too)
        summary.records += 1
        rid = record["id"]
        if rid in seen:  # the same request captured twice (a retry): the first kept;
            summary.duplicates += 1  # another client's under the same id: neither
            if rid not in ambiguous and fingerprint(record) != seen[rid]:
                ambiguous.add(rid)
            continue
        seen[rid] = fingerprint(record)
        label = labels.get(rid)
        if label is None:
            summary.unlabelled += 1
            continue
        when = float(record.get("time") or 0.0)
        if float(label.get("time") or 0.0) - when > window_days * DAY:
            summary.late += 1
            continue
        summary.labelled += 1
        joined.append(Labelled(rid, when, int(record["version"]), segment,
                                [array(v) for v in record.get("inputs") or []],
                                label["label"], record.get("outputs")))
    if ambiguous:  # the data set never pairs one client's input with another's label
        summary.ambiguous = sum(1 for j in joined if j.id in ambiguous)
        summary.labelled -= summary.ambiguous
        joined = [j for j in joined if j.id not in ambiguous]
    return joined


def _manifests(repo: Path | None, model: str, versions: set[int]) -> dict[int, Manifest]:
    """The manifests of the versions that answered (none without --repo)."""
    if repo is None:
        return {}
    return {v: read_manifest(Path(repo) / model / str(v)) for v in sorted(versions)}



def _by_time(rows: list[Row], share: float) -> tuple[list[Row], list[Row]]:
    """(older, newest SHARE of the records), each in time order; a record's sequences stay
    together. Records of one batch share its time: they keep the order they were read in
    (the batch's, its requests' arrival), not their ids' order (a stable sort)."""
    order = sorted(dict.fromkeys((r.time, r.id) for r in rows), key=lambda key: key[0])
    held = round(len(order) * share)
    newest = set(order[len(order) - held:]) if held else set()
    train = sorted((r for r in rows if (r.time, r.id) not in newest), key=lambda r: r.time)
    holdout = sorted((r for r in rows if (r.time, r.id) in newest), key=lambda r: r.time)
    return train, holdout


def _too_few(task: str, train: list[Row], holdout: list[Row], share: float, model: str,
             summary: Summary) -> None:
    """ValueError when a part has fewer sequences (and, lm, words) than training needs."""
    parts = [train, holdout] if share > 0 else [train]
    least, words = (LM_MIN_EXAMPLES, LM_MIN_WORDS) if task == "lm" else (MIN_EXAMPLES, 0)
    if all(len(p) >= least and _words(p) >= words for p in parts):
        return
    need = f"{least} sequences and {words} words" if words else f"{least}"
    counted = f"words {_words(train)} and {_words(holdout)}; " if words else ""
    raise ValueError(f"too few labelled sequences of {model!r}: "
                     f"{len(train)} to train on and {len(holdout)} held out (training "
                     f"needs at least {need} in each; {counted}labelled records "
                     f"{summary.labelled}, unlabelled {summary.unlabelled}, late labels "
                     f"{summary.late})")


def _words(rows: list[Row]) -> int:
    """The tokens training reads of an lm part: each document's, and its closing <eos>."""
    return sum(len(r.x) + 1 for r in rows)


def build(root: Path, model: str, *, since: str | None = None, window_days: float = 7.0,
          holdout_share: float = 0.2, repo: Path | None = None, progress: bool = True
          ) -> tuple[dict[str, Any], dict[str, Any], Summary]:
    """The train and holdout parts of MODEL's labelled captures under ROOT, and the counts:
    a classifier's arrays (``_arrays``), a language model's corpus (``_corpus``; needs
    REPO, whose vocabularies map the token ids to words). ValueError naming the flag for a
    bad argument or too few labelled records."""
    root = Path(root)
    check_name(model)
    start = parse_since(since)
    if not (isinstance(window_days, int | float) and window_days > 0):
        raise ValueError(f"--window: days > 0; got {window_days!r}")
    if not (isinstance(holdout_share, int | float) and 0 <= holdout_share < 1):
        raise ValueError(f"--holdout-share: a share 0 <= F < 1; got {holdout_share!r}")
    if not (root / model).is_dir():
        raise ValueError(f"--capture: no captures of model {model!r} in {str(root)!r}")
    summary = Summary()
    joined = _join(root, model, start, window_days, summary, progress)
    manifests = _manifests(repo, model, {j.version for j in joined})
    summary.task = task_of(joined, manifests, model)
    if summary.task == "lm":
        rows = lm_rows(joined, model)
    else:
        rows = classify_rows(joined, model)
        classes = class_names(joined, rows, manifests, model)
        counts = Counter(r.y for r in rows)
        summary.classes = {classes[i]: counts[i] for i in sorted(counts)}
    train, holdout = _by_time(rows, holdout_share)
    summary.train, summary.holdout = len(train), len(holdout)
    _too_few(summary.task, train, holdout, holdout_share, model, summary)
    if summary.task == "classify":
        return _arrays(train, classes), _arrays(holdout, classes), summary
    assert repo is not None  # task_of asked for it
    vocabularies = {v: read_vocabulary(Path(repo) / model / str(v), m) or []
                    for v, m in manifests.items()}
    return (_corpus(train, model, vocabularies, summary),
            _corpus(holdout, model, vocabularies, summary), summary)


def _arrays(rows: list[Row], names: list[str]) -> dict[str, np.ndarray]:
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


def _corpus(rows: list[Row], model: str, vocabularies: dict[int, list[str]],
            summary: Summary) -> dict[str, Any]:
    """A language model's part: ``text``, a document a sequence (one line: its tokens as
    words of the vocabulary of the version that answered, ``<unk>`` for a token it does
    not map), and the provenance of the sidecar (``provenance``)."""
    texts = {v: [word_text(w) for w in words] for v, words in vocabularies.items()}
    documents = []
    for r in rows:
        known = texts[r.version]
        found = [known[t] if 0 <= t < len(known) else None for t in r.x.tolist()]
        summary.unmapped += sum(w is None for w in found)
        summary.tokens += len(found)
        documents.append(" ".join(UNK if w is None else w for w in found))
    return {"text": "".join(f"{d}\n\n" for d in documents),
            "provenance": {"format": CORPUS_FORMAT, "model": model,
                           "ids": [r.id for r in rows], "times": [r.time for r in rows],
                           "versions": [r.version for r in rows],
                           "segments": sorted({r.segment for r in rows}),
                           "tokens": [r.x.tolist() for r in rows]}}


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """ARRAYS as an .npz at PATH, atomically (a reader sees the old file or the new one)."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    atomic_write(path, lambda tmp: tmp.write_bytes(buffer.getvalue()))


def write_corpus(path: Path, part: dict[str, Any]) -> None:
    """A language model's part: the text at PATH and its provenance at ``sidecar(PATH)``,
    each atomically (the sidecar first: a corpus is never newer than its provenance)."""
    provenance = orjson.dumps(part["provenance"])
    atomic_write(sidecar(path), lambda tmp: tmp.write_bytes(provenance))
    atomic_write(path, lambda tmp: tmp.write_text(part["text"], encoding="utf-8"))


def holdout_path(out: Path, task: str = "classify") -> Path:
    """FILE2's default: ``<FILE stem>-holdout.npz`` beside FILE (a language model's:
    ``<FILE stem>-holdout<FILE's suffix, or .txt>``)."""
    suffix = (out.suffix or ".txt") if task == "lm" else ".npz"
    return out.with_name(f"{out.stem}-holdout{suffix}")


def write_dataset(root: Path, model: str, out: Path, holdout: Path | None = None, *,
                  since: str | None = None, window_days: float = 7.0,
                  holdout_share: float = 0.2, repo: Path | None = None,
                  progress: bool = True) -> Summary:
    """``build`` written to OUT and HOLDOUT (default ``holdout_path(OUT)``; none when the
    share is 0): a classifier's as .npz files, a language model's as text corpora."""
    out = Path(out)
    if not out.parent.is_dir():
        raise ValueError(f"--out: the folder {str(out.parent)!r} does not exist")
    train, held, summary = build(root, model, since=since, window_days=window_days,
                                 holdout_share=holdout_share, repo=repo, progress=progress)
    write = write_corpus if summary.task == "lm" else write_npz
    write(out, train)
    if holdout_share > 0:
        write(Path(holdout) if holdout is not None else holdout_path(out, summary.task), held)
    return summary
