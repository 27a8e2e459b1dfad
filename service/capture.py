"""Capture: a sampled share of what the service answers, kept as JSON lines for labels,
drift and retraining (docs/capture.md). A request's record is written (one ``write``, to
the page cache, no fsync) before its answer goes out, so a killed replica loses no record
of an answered request. Written where the answer is made, on the event loop: a writer
thread or a write at the end of the loop's turn made each captured request wait a turn or
a GIL hand-over, which cost a tenth of the throughput (docs/design.md, "Capture"). A full
disk or a read-only one drops records, counted; serving goes on.

Layout: ``DIR/<model>/<version>/<YYYY-MM-DD>/<replica>-<n>.jsonl``; the segment being
written ends in ``.open`` and is closed by rename when it rotates (size, the day, the end).
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from orthornn.export.artifacts.rollout.plan import bucket

from . import request
from .errors import ClientError
from .metrics import Metrics
from .registry.runtime import Chunk

log = logging.getLogger("orthornn.service")

OPEN = ".open"  # the suffix of the segment a replica is writing
_DUMP = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE
_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
_REPLICA = re.compile(r"[A-Za-z0-9._-]{1,128}")


def request_id(header: str | None, oip_id: str | None = None) -> str:
    """The request's id: the client's X-Request-Id (400 unless 1-128 printable ASCII
    characters), else the OIP request's ``id``, else a new one."""
    if header is not None:
        if not _ID.fullmatch(header):
            raise ClientError("X-Request-Id: 1 to 128 printable ASCII characters, no spaces")
        return header
    return oip_id if oip_id else uuid.uuid4().hex


def _check_replica(name: str) -> str:
    """NAME, a replica's name in segment file names (ValueError naming the setting)."""
    if not _REPLICA.fullmatch(name):
        raise ValueError(f"capture_replica: {name!r} is not 1-128 of A-Z a-z 0-9 . _ -")
    return name


def sampled(request: str, share: float) -> bool:
    """Whether the request with id REQUEST is captured at SHARE (0 < share <= 1): decided by
    the id's hash (the rollout's ``bucket``), so a retry and every replica decide alike."""
    return bucket(request.encode()) < share * 100


@dataclass
class _Segment:
    path: Path  # the open file (… .jsonl.open)
    fd: int
    size: int = 0


class Capture:
    def __init__(self, root: Path, share: float, metrics: Metrics | None = None, *,
                 replica: str | None = None,
                 segment_bytes: int = 64 << 20, retention_days: int = 30,
                 clock: Callable[[], float] = time.time):
        self.root, self.share, self.metrics = Path(root), share, metrics
        self.segment_bytes = segment_bytes
        self.retention_days, self.clock = retention_days, clock
        self._closed = False
        self._day, self._day_ends = "", 0.0  # the day being written (UTC), when it ends
        self._records: dict[str, Any] = {}  # orthornn_capture_records_total's children
        #: models whose segment could not be opened: until when their records are dropped
        self._failed: dict[tuple[str, str], tuple[float, str]] = {}
        self._segments: dict[tuple[str, str], _Segment] = {}
        self._warned = -60.0  # when a failed write was last logged (time.monotonic)
        name = _check_replica(replica or socket.gethostname())
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.replica, self._lock_fd = self._claim(name)
            self._recover()
            self._expire()
        except OSError as error:  # a read-only or broken folder: serve, drop and count
            self.replica, self._lock_fd = name, -1
            self._warn(f"capture: {self.root} cannot be prepared ({error}); its records "
                       f"are dropped until a write succeeds")

    # -- the event loop ----------------------------------------------------------------------

    def keep(self, record: dict[str, Any]) -> None:
        """Write RECORD (``model`` and ``version`` name its folder) now, before the answer
        it records goes out; a failed write drops it (counted). Never raises."""
        if self._closed:
            return
        now = self.clock()
        if now >= self._day_ends:  # a new day: yesterday's segments closed, old days expired
            start = dt.datetime.fromtimestamp(now, dt.UTC).replace(hour=0, minute=0, second=0,
                                                                   microsecond=0)
            self._day = start.strftime("%Y-%m-%d")
            self._day_ends = (start + dt.timedelta(days=1)).timestamp()
            for key in list(self._segments):
                self._close(key)
            self._expire()
        key = (str(record["model"]), str(record["version"]))
        if now < self._failed.get(key, (0.0, ""))[0]:  # no new segment could be opened
            self._dropped(self._failed[key][1])
            return
        try:
            data = orjson.dumps(record, option=_DUMP)
            segment = self._segments.get(key) or self._segment(key)
            view = memoryview(data)
            while view:  # one write, unless the kernel takes less
                view = view[os.write(segment.fd, view):]
            segment.size += len(data)
            if segment.size >= self.segment_bytes:
                self._close(key)
        except OSError as error:  # the segment stays: the next write tries it again
            reason = {errno.ENOSPC: "disk_full", errno.EDQUOT: "disk_full",
                      errno.EROFS: "read_only", errno.EACCES: "read_only",
                      errno.EPERM: "read_only"}.get(error.errno or 0, "error")
            self._warn(f"capture: a record of {key[0]} version {key[1]} dropped: {error}")
            self._dropped(reason)
            if key not in self._segments:  # not even a segment: try again in a second
                self._failed[key] = (now + 1.0, reason)
            return
        except (TypeError, ValueError) as error:  # a record orjson cannot write
            self._warn(f"capture: a record of {key[0]} version {key[1]} dropped: {error}")
            self._dropped("error")
            return
        counter = self._records.get(key[0])
        if counter is None and self.metrics is not None:  # the label child, looked up once
            counter = self._records[key[0]] = self.metrics.capture_records.labels(key[0])
        if counter is not None:
            counter.inc()

    def _segment(self, key: tuple[str, str]) -> _Segment:
        """A new open segment for KEY in the day's folder, numbered after this replica's."""
        folder = self.root / key[0] / key[1] / self._day
        folder.mkdir(parents=True, exist_ok=True)
        mine = re.compile(re.escape(self.replica) + r"-(\d+)\.jsonl(?:\.open)?")
        n = 1 + max((int(m.group(1)) for p in folder.iterdir()
                     if (m := mine.fullmatch(p.name))), default=0)
        path = folder / f"{self.replica}-{n}.jsonl{OPEN}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        segment = self._segments[key] = _Segment(path, fd)
        return segment

    def _close(self, key: tuple[str, str]) -> None:
        """Close KEY's open segment: rename it to its final name (readers take those)."""
        segment = self._segments.pop(key, None)
        if segment is None:
            return
        with contextlib.suppress(OSError):
            os.close(segment.fd)
            segment.path.rename(segment.path.with_name(segment.path.name[:-len(OPEN)]))

    def _warn(self, message: str) -> None:
        """Log a failed write: the first, then at most one a minute (a full disk fails
        every write; the counts are in orthornn_capture_dropped_total)."""
        now = time.monotonic()
        if now - self._warned >= 60.0:
            self._warned = now
            log.warning("%s (the next such warning in a minute at the soonest)", message)

    def _dropped(self, reason: str, count: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.capture_dropped.labels(reason).inc(count)

    # -- start and end ---------------------------------------------------------------------

    def _claim(self, name: str) -> tuple[str, int]:
        """This replica's name in segment names, held by a lock on DIR/.replicas/NAME: a
        second process of the same name (two servers on one host) gets NAME-PID."""
        folder = self.root / ".replicas"
        folder.mkdir(exist_ok=True)
        for candidate in (name, f"{name}-{os.getpid()}"):
            _check_replica(candidate)
            fd = os.open(folder / candidate, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return candidate, fd
        raise ValueError(f"capture: {name!r} and {name}-{os.getpid()} are both in use")

    def _recover(self) -> None:
        """Segments this replica left open (it was killed): a torn last line (a record whose
        write never finished, so its answer was never sent) is cut, counted, and the
        segment closed."""
        pattern = f"*/*/*/{self.replica}-*.jsonl{OPEN}"
        for path in self.root.glob(pattern):
            with open(path, "rb+") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep < len(data):
                    f.truncate(keep)
                    self._dropped("torn")
            path.rename(path.with_name(path.name[:-len(OPEN)]))

    def _expire(self) -> None:
        """Remove day folders older than the retention (the captures are users' data)."""
        cutoff = (dt.datetime.fromtimestamp(self.clock(), dt.UTC)
                  - dt.timedelta(days=self.retention_days)).strftime("%Y-%m-%d")
        for day in self.root.glob("*/*/[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]"):
            if day.name < cutoff:
                shutil.rmtree(day, ignore_errors=True)

    def close(self) -> None:
        """Close every segment (the server's end)."""
        self._closed = True
        for key in list(self._segments):
            self._close(key)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)


def keep_answer(capture: Capture | None, route: str, model: str, version: int,
                      inputs: list, outputs: Any, session: str | None = None,
                      position: int | None = None) -> None:
    """The record of one answered request, when capture is on and samples its id: the
    inputs as the model saw them (arrays, token ids), the outputs the client gets, the
    session's id and position after a chunk, the compute time (the request's scope)."""
    if capture is None:
        return
    scope = request.current()
    if scope.id is None or not sampled(scope.id, capture.share):
        return
    if isinstance(outputs, dict):  # the OIP's output tensors by name
        outputs = {name: _array(value) for name, value in outputs.items()}
    capture.keep({
        "id": scope.id, "time": round(capture.clock(), 6), "route": route, "model": model,
        "version": version,
        "inputs": [_array(s.data if isinstance(s, Chunk) else s) for s in inputs],
        "outputs": outputs, "session": session, "position": position,
        "compute_ms": None if scope.compute_s is None else round(scope.compute_s * 1e3, 3)})


def _array(a: np.ndarray) -> dict[str, Any]:
    """An array as a record holds it: its dtype, shape and little-endian bytes in base64
    (exact, and ten times cheaper to write than its numbers as JSON text)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(a.tobytes()).decode()}


def array(value: dict[str, Any]) -> np.ndarray:
    """The array a record holds (``_array``'s inverse)."""
    data = base64.b64decode(value["b64"])
    return np.frombuffer(data, dtype=np.dtype(value["dtype"])).reshape(value["shape"])


def read_records(root: Path, model: str) -> tuple[list[dict[str, Any]], int]:
    """Every record captured for MODEL under ROOT (closed and open segments), and the count
    of lines that are not a whole record (a torn last line of a killed writer)."""
    records, torn = [], 0
    # version folders only: DIR/<model>/labels/ holds the labels given back (labels.py)
    for path in sorted(p for p in (Path(root) / model).glob("*/*/*.jsonl*")
                       if p.parent.parent.name.isdigit()):
        for line in path.read_bytes().splitlines():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                torn += 1
    return records, torn
