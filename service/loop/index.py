"""The index of one model's captured and labelled ids (docs/capture.md, "Labels"), read
incrementally from the segment and label files of every replica, so that a label request
does not rescan the captures: where each id's record starts, the ids captured more than
once (a retry, or a squat: ``ambiguous``), and the ids already labelled. On a bucket it
reads two folders: the local copy of the bucket's objects and this replica's spool, where a
segment lives until its upload (the same key in both: read once)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from orthornn.export.artifacts.loop.captures import (
    OPEN,
    fingerprint,
    label_files,
    label_lines,
    line_records,
    segment_name,
    segments,
)

#: ids the index holds per model (a later capture of an id counts as one more), measured
#: (bench/perf/labels.py) at 160 bytes a 32-character id and 256 a 128-character one, the
#: longest an id may be: at most 256 MB at the bound (docs/capture.md, "Labels"); beyond it
#: the oldest days' segments are forgotten (a label for them is then an unknown id)
MAX_INDEXED_IDS = 1_000_000


#: the later captures of one id the index keeps: enough to tell a retry from a squat
MAX_TWINS = 4


# a record's first key is its id (capture writes it first): read without parsing the line
_FIRST_ID = re.compile(rb'\{\s*"id"\s*:\s*("(?:[^"\\]|\\.){1,300}")')


_READ = 8 << 20  # bytes of a segment read at once (a 64 MiB segment in eight reads)


_SHIFT = 40  # an id's place: segment number << 40 | byte offset (segments < 1 TiB)


@dataclass
class _Segment:
    key: str  # relative to the capture folder, without .open
    number: int
    day: str
    offset: int = 0  # bytes read (whole lines only)
    ids: list[str] = field(default_factory=list)  # the ids it gave the index
    evicted: bool = False
    done: bool = False  # closed and read to its end
    missing: int = 0  # refreshes in a row that found it in no folder


class CaptureIndex:
    """One model's captured ids (id -> where its record starts) and labelled ids, kept up
    to date by reading only the bytes appended since the last ``refresh``: the segments of
    every replica on the volume and every replica's label files. Memory: the ids (at most
    ``max_ids``; then the oldest day's segments are forgotten, ids and labels alike).
    ROOTS: the capture folder, or on a bucket its local copy and the spool."""

    def __init__(self, roots: Path | tuple[Path, ...], model: str,
                 max_ids: int = MAX_INDEXED_IDS):
        self.roots = tuple(Path(r) for r in roots) if isinstance(roots, tuple) \
            else (Path(roots),)
        self.model, self.max_ids = model, max_ids
        self._segments: dict[str, _Segment] = {}
        self._by_number: list[_Segment] = []
        self._ids: dict[str, int] = {}  # id -> segment number << 40 | offset
        #: ids captured more than once (a retry, or another client's request under the
        #: same id) -> where each of the later ones starts
        self._twins: dict[str, list[int]] = {}
        self._twin_count = 0  # their places: they count against max_ids too
        self.labelled: set[str] = set()
        self._label_offsets: dict[Path, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def refresh(self) -> None:
        if not any((root / self.model).is_dir() for root in self.roots):
            return
        listed = set()
        for root in self.roots:
            for path in segments(root, self.model):
                key = segment_name(path, root)
                if key in listed:  # uploaded, and still in the spool
                    continue
                listed.add(key)
                segment = self._segments.get(key)
                if segment is None:
                    segment = _Segment(key, len(self._by_number), path.parent.name)
                    self._segments[key] = segment
                    self._by_number.append(segment)
                segment.missing = 0
                if not segment.done:
                    self._tail(segment)
                    # closed by rename, never written again: read to its end once
                    segment.done = not path.name.endswith(OPEN)
        # deleted (retention): ids forgotten when the segment is in no folder; on a bucket
        # only at the second refresh in a row, as the first may fall between its upload's
        # unlink from the spool and the copy's next sync from the bucket
        strikes = 2 if len(self.roots) > 1 else 1
        for segment in self._segments.values():
            if segment.key in listed or segment.evicted or any(
                    Path(f"{root / segment.key}{end}").exists()
                    for root in self.roots for end in ("", OPEN)):
                continue
            segment.missing += 1
            if segment.missing >= strikes:
                self._forget(segment)
        for path in (p for root in self.roots for p in label_files(root, self.model)):
            offset = self._label_offsets.get(path, 0)
            data = _read_from(path, offset)
            end = data.rfind(b"\n") + 1
            if end:
                self.labelled.update(str(v["id"]) for v in label_lines(data[:end])
                                     if str(v["id"]) in self._ids)
                self._label_offsets[path] = offset + end
        if len(self._ids) + self._twin_count > self.max_ids:
            self._evict()

    def _tail(self, segment: _Segment) -> None:
        """Index the whole lines appended to SEGMENT since the last read."""
        size = _READ
        while True:
            try:
                data = self._read(segment, segment.offset, size)
            except FileNotFoundError:  # gone since the listing: ``refresh`` tells
                return
            end = data.rfind(b"\n") + 1
            if not end:
                if len(data) < size:  # a line still being written: the next refresh
                    return
                size *= 2  # one record longer than a read
                continue
            start, base = segment.offset, segment.number << _SHIFT
            for line in data[:end - 1].split(b"\n"):
                for rid in _line_ids(line):
                    if rid not in self._ids:
                        self._ids[rid] = base | start
                        segment.ids.append(rid)
                    else:  # a retry's twin, or a squatted id: ``ambiguous`` tells
                        twins = self._twins.setdefault(rid, [])
                        if len(twins) < MAX_TWINS:
                            twins.append(base | start)
                            self._twin_count += 1
                start += len(line) + 1
            segment.offset += end
            if len(data) < size:
                return
            size = _READ

    def _forget(self, segment: _Segment) -> None:
        for rid in segment.ids:
            if self._ids.get(rid, -1) >> _SHIFT == segment.number:
                del self._ids[rid]
                self._twin_count -= len(self._twins.pop(rid, ()))
                self.labelled.discard(rid)
        segment.ids = []
        segment.evicted = True

    def _evict(self) -> None:
        """The oldest day's segments forgotten until the ids fit in max_ids."""
        for segment in sorted(self._by_number, key=lambda s: (s.day, s.number)):
            if len(self._ids) + self._twin_count <= self.max_ids:
                return
            if not segment.evicted:
                self._forget(segment)

    def record(self, rid: str) -> dict | None:
        """The captured record of RID (None: not captured, or forgotten)."""
        place = self._ids.get(rid)
        return None if place is None else self._record_at(place, rid)

    def ambiguous(self, rid: str) -> bool:
        """Whether RID was captured for requests with different inputs (another client sent
        the id too: labelling it would pair one client's input with another's label); a
        retry, the same inputs captured twice, is not."""
        twins = self._twins.get(rid)
        if not twins:
            return False
        first = self.record(rid)
        kept = {fingerprint(r) for r in [first, *(self._record_at(p, rid) for p in twins)]
                if r is not None}
        return len(kept) > 1

    def _record_at(self, place: int, rid: str) -> dict | None:
        segment = self._by_number[place >> _SHIFT]
        offset = place & ((1 << _SHIFT) - 1)
        try:
            data, size = b"", 1 << 16
            while b"\n" not in data:
                more = self._read(segment, offset + len(data), size)
                if not more:
                    return None
                data += more
                size *= 2
            found = line_records(data[:data.index(b"\n")]) or []
        except FileNotFoundError:
            return None
        return next((r for r in found if r.get("id") == rid), None)  # a batch's: its own

    def _read(self, segment: _Segment, offset: int, size: int) -> bytes:
        """SIZE bytes of SEGMENT from OFFSET, from whichever folder holds it, closed or
        open (closed by rename, or uploaded, between the listing and the read)."""
        for root in self.roots:
            try:
                return _read_from(root / segment.key, offset, size, alt=OPEN)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(segment.key)


def _read_from(path: Path, offset: int, size: int = -1, alt: str | None = None) -> bytes:
    """SIZE bytes (all: -1) of PATH from OFFSET; ALT: the path's other name (a segment
    closed by rename between the listing and the read)."""
    for candidate in (path, Path(f"{path}{alt}")) if alt else (path,):
        try:
            with open(candidate, "rb") as f:
                f.seek(offset)
                return f.read(size)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(path)


def _line_ids(line: bytes) -> list[str]:
    """The request ids of a segment's line: a batch's (its ``ids``) or a request's."""
    if line.startswith(b'{"ids":'):  # a batch's line, as capture writes it
        try:
            ids = orjson.loads(line).get("ids")
        except orjson.JSONDecodeError:  # a torn line: never an id
            return []
        return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
    rid = _line_id(line)
    return [] if rid is None else [rid]


def _line_id(line: bytes) -> str | None:
    if line.startswith(b'{"id":"'):  # as capture writes it: the id up to the next quote
        rid = line[7:max(7, line.find(b'"', 7))]
        if rid and b"\\" not in rid:  # no escape in it (else parsed below)
            return rid.decode("ascii", "replace")
    found = _FIRST_ID.match(line)
    try:
        if found is not None:
            value = orjson.loads(found.group(1))
        else:  # not as capture writes it (whitespace, another key first): parse it all
            value = orjson.loads(line).get("id")
    except (orjson.JSONDecodeError, AttributeError):  # a torn line: never an id
        return None
    return value if isinstance(value, str) else None
