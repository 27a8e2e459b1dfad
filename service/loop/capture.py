"""Capture: a sampled share of what the service answers, kept as JSON lines for labels,
drift and retraining (docs/capture.md). A request's record is written (one ``write``, to
the page cache, no fsync) before its answer goes out, so a killed replica loses no record
of an answered request.

Stateless requests (/predict and OIP) are written once per batch, in the inference thread
that ran the batch, before it hands the answers back: the event loop only checks the id
the client gave (``given_id``) and tags the request (``Capture.tag``); the batch decides
the sample for its requests (``request_id``: a request not in it gets no id and costs
nothing more), and its sampled requests become one line whose arrays are columns (every
sequence's inputs in one array, the outputs in another), so a record costs a share of one
encoding and one ``write`` instead of its own (docs/design.md, "Capture").
A session's chunk is written on the event loop once the session applied it (its position
is known only then), as a line of its own. ``captures.records_of`` reads both back as
records of one request each.

The segment's disk space is reserved ahead in 4 MiB steps (``fallocate``, size kept), so
a full disk fails at a reservation, before any byte of a record is written, and then drops
records for a second at the cost of a counter. Serving goes on.

Layout: ``DIR/<model>/<version>/<YYYY-MM-DD>/<replica>-<n>.jsonl``; the segment being
written ends in ``.open`` and is closed by rename when it rotates (size, the day, the end).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from orthornn.export.artifacts.loop.captures import (
    OPEN,
    UPLOADED,
    replica_name,
)

from .. import request
from ..metrics import Metrics
from ..registry.spec import ModelSpec
from .disk import KEEP_SIZE, REASONS, RESERVE, day_start, fallocate, until_next_check
from .ids import request_id
from .records import Captured, batch_line

if TYPE_CHECKING:
    from .upload import Uploader


log = logging.getLogger("orthornn.service")


_DUMP = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE


@dataclass
class _Segment:
    path: Path  # the open file (… .jsonl.open)
    fd: int
    opened: float  # when (the capture's clock)
    size: int = 0  # bytes written (the file's length)
    reserved: int = 0  # bytes whose disk blocks are reserved (fallocate, past the length)


class Capture:
    def __init__(self, root: Path, share: float, metrics: Metrics | None = None, *,
                 replica: str | None = None,
                 segment_bytes: int = 64 << 20, retention_days: int = 30,
                 max_age_s: float | None = None, clock: Callable[[], float] = time.time):
        self.root, self.share, self.metrics = Path(root), share, metrics
        self.segment_bytes, self.max_age_s = segment_bytes, max_age_s
        self.retention_days, self.clock = retention_days, clock
        self._closed = False
        self._day, self._day_ends = "", 0.0  # the day being written (UTC), when it ends
        #: models whose write failed (a full or read-only disk): until when their records
        #: are dropped, unencoded, and why
        self._failed: dict[tuple[str, int], tuple[float, str]] = {}
        self._segments: dict[tuple[str, int], _Segment] = {}
        self._reserve_space = fallocate()
        # the event loop (sessions' records, the sample's admission) and the inference
        # threads (batches' records) both write; uncontended it costs 0.1 µs
        self._lock = threading.RLock()
        self._warned = -60.0  # when a failed write was last logged (time.monotonic)
        name = replica_name(replica, socket.gethostname())
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.replica, self._lock_fd = self._claim(name)
            self._recover()
            self._expire()
        except OSError as error:  # a read-only or broken folder: serve, drop and count
            self.replica, self._lock_fd = name, -1
            self.warn(f"capture: {self.root} cannot be prepared ({error}); its records "
                       f"are dropped until a write succeeds")
        # old days deleted a minute past each midnight, off the request path (a day's
        # folders can take a while to delete), whether or not anything is written
        self._stopped = threading.Event()
        self._retention = threading.Thread(target=self._expire_daily,
                                           name="capture-retention", daemon=True)
        self._retention.start()
        self.uploader: Uploader | None = None  # on a bucket: open_capture sets it

    # -- a request's part: tagged on the event loop, decided and written with its batch ------

    def admits(self, model: str, version: int, now: float, count: int = 1) -> bool:
        """Whether COUNT records of MODEL VERSION are to be encoded and written at NOW:
        False (the drops counted) for a second after a failed write or reservation, so that
        a full disk costs a dictionary look-up and a counter a batch."""
        if self._closed:
            return False
        if self._failed:
            failed = self._failed.get((model, version))
            if failed is not None:
                if now < failed[0]:
                    self.dropped(failed[1], count)
                    return False
                self._failed.pop((model, version), None)
        return True

    def tag(self, route: str) -> request.Scope | None:
        """(Event loop.) The current request's scope, its ROUTE set, when capture is to
        decide its sample (the HTTP layer gave it the client's id, ``given_id``); else None.
        The scope is the tag its batch hands the recorder: no object of capture's own is
        made per request."""
        scope = request.current()
        if not scope.deciding:
            return None
        scope.route = route
        return scope

    def decide(self, scope: request.Scope) -> str | None:
        """The id SCOPE's request is kept under, None when it is not in the sample: decided
        once (``request_id``), with its batch or, for a session's chunk, on the loop."""
        if scope.deciding:
            scope.deciding = False
            scope.id = request_id(scope.given, self.share)
        return scope.id

    def recorder(self, spec: ModelSpec, model: str, version: int, graph: str, timed: bool
                 ) -> Callable[[list[Captured]], None]:
        """What a batcher of MODEL VERSION's GRAPH calls with a batch's tagged requests,
        in its inference thread, before their answers go back (TIMED: the graph's output
        has a row per step)."""
        def record(tagged: list[Captured]) -> None:
            # the sample, decided here for the whole batch (``given_id``: why), in one loop
            # of this frame: a call per request cost as much again as the decision
            share, captured = self.share, []
            for c in tagged:
                scope = c[0]
                if scope.deciding:
                    scope.deciding = False
                    scope.id = request_id(scope.given, share)
                if scope.id is not None:
                    captured.append(c)
            if not captured:
                return
            now = self.clock()
            if (self._failed or self._closed) and \
                    not self.admits(model, version, now, len(captured)):
                for c in captured:  # dropped: their answers carry no id
                    c[0].id = None
                return
            try:
                line = batch_line(now, model, version, spec, graph, timed, captured)
            except (TypeError, ValueError) as error:  # outputs this cannot write
                self.warn(f"capture: a batch of {model} version {version} dropped: {error}")
                self.dropped("error", len(captured))
                return
            self.write(model, version, line, now, len(captured))
        return record

    def keep(self, record: dict[str, Any]) -> None:
        """Write RECORD (``model`` and ``version`` name its folder; numpy arrays as
        numbers) now; a failed write drops it (counted). Never raises."""
        model, version = str(record["model"]), int(record["version"])
        now = self.clock()
        if not self.admits(model, version, now):
            return
        try:
            line = orjson.dumps(record, option=_DUMP)
        except (TypeError, ValueError) as error:  # a record orjson cannot write
            self.warn(f"capture: a record of {model} version {version} dropped: {error}")
            self.dropped("error")
            return
        self.write(model, version, line, now)

    def write(self, model: str, version: int, line: bytes, now: float, count: int = 1
              ) -> None:
        """Write LINE (COUNT records, ending in a newline) to MODEL VERSION's open segment
        with one ``write``, its disk space reserved before; a failure drops them (counted),
        leaves the segment as it was, and drops MODEL VERSION's records for a second. Never
        raises."""
        with self._lock:
            if self._closed:  # the server's end: its batches finish before (http.app)
                self.dropped("error", count)
                return
            self._write(model, version, line, now, count)

    def _write(self, model: str, version: int, line: bytes, now: float, count: int) -> None:
        if now >= self._day_ends:
            self._new_day(now)
        key = (model, version)
        segment = self._segments.get(key)
        try:
            if segment is None:
                segment = self._segment(key)
            end = segment.size + len(line)
            if end > segment.reserved:
                self._reserve(segment, end)
            if os.write(segment.fd, line) != len(line):  # the kernel took less: a full disk
                raise OSError(errno.ENOSPC, "short write")
        except OSError as error:
            if segment is not None:  # a partial line cut: the next record starts whole
                with contextlib.suppress(OSError):
                    os.ftruncate(segment.fd, segment.size)
            reason = REASONS.get(error.errno or 0, "error")
            self.warn(f"capture: a record of {model} version {version} dropped: {error}")
            self.dropped(reason, count)
            self._failed[key] = (now + 1.0, reason)  # tried again in a second
            return
        segment.size = end
        if end >= self.segment_bytes:
            self._close(key)
        if self.metrics is not None:
            self.metrics.capture_records.inc(model, count)

    def _new_day(self, now: float) -> None:
        """Close yesterday's segments; the day's folder name and end."""
        start = day_start(now)
        self._day = start.strftime("%Y-%m-%d")
        self._day_ends = (start + dt.timedelta(days=1)).timestamp()
        for key in list(self._segments):
            self._close(key)

    def _reserve(self, segment: _Segment, end: int) -> None:
        """Reserve SEGMENT's disk blocks up to END at least (RESERVE ahead, up to the
        segment's size), the file's length kept: the records written into them cannot
        find the disk full, and a full disk refuses here, before any byte is written."""
        if self._reserve_space is None:  # not Linux: appends, a short one cut back
            segment.reserved = 1 << 62
            return
        target = max(end, min(segment.reserved + RESERVE, self.segment_bytes))
        target = -(-target // 4096) * 4096
        if self._reserve_space(segment.fd, KEEP_SIZE, segment.reserved,
                               target - segment.reserved) != 0:
            code = ctypes.get_errno()
            if code in (errno.EOPNOTSUPP, errno.ENOSYS):  # a file system without it
                self._reserve_space = None
                segment.reserved = 1 << 62
                return
            raise OSError(code, os.strerror(code))
        segment.reserved = target

    def _segment(self, key: tuple[str, int]) -> _Segment:
        """A new open segment for KEY in the day's folder, numbered after this replica's."""
        folder = self.root / key[0] / str(key[1]) / self._day
        folder.mkdir(parents=True, exist_ok=True)
        mine = re.compile(re.escape(self.replica) +
                          rf"-(\d+)\.jsonl(?:{re.escape(OPEN)}|{re.escape(UPLOADED)})?")
        n = 1 + max((int(m.group(1)) for p in folder.iterdir()
                     if (m := mine.fullmatch(p.name))), default=0)
        path = folder / f"{self.replica}-{n}.jsonl{OPEN}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        segment = self._segments[key] = _Segment(path, fd, self.clock())
        return segment

    def _close(self, key: tuple[str, int]) -> None:
        """Close KEY's open segment: its unused reservation given back, renamed to its
        final name (readers take those)."""
        segment = self._segments.pop(key, None)
        if segment is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(segment.fd, segment.size)  # frees the blocks reserved past the end
        with contextlib.suppress(OSError):
            os.close(segment.fd)
            segment.path.rename(segment.path.with_name(segment.path.name[:-len(OPEN)]))

    def rotate(self) -> None:
        """Close the segments open for max_age_s or longer (capture on object storage:
        a closed segment is uploaded; see ``upload``)."""
        if self.max_age_s is None:
            return
        cutoff = self.clock() - self.max_age_s
        with self._lock:
            for key in [k for k, s in self._segments.items() if s.opened <= cutoff]:
                self._close(key)

    def warn(self, message: str) -> None:
        """Log a failed write: the first, then at most one a minute (a full disk fails
        every write; the counts are in orthornn_capture_dropped_total)."""
        now = time.monotonic()
        if now - self._warned >= 60.0:
            self._warned = now
            log.warning("%s (the next such warning in a minute at the soonest)", message)

    def dropped(self, reason: str, count: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.capture_dropped.inc(reason, count)

    # -- start and end ---------------------------------------------------------------------

    def _claim(self, name: str) -> tuple[str, int]:
        """This replica's name in segment names, held by a lock on DIR/.replicas/NAME: a
        second process of the same name (two servers on one host) gets NAME-PID."""
        folder = self.root / ".replicas"
        folder.mkdir(exist_ok=True)
        for candidate in (name, f"{name}-{os.getpid()}"):
            replica_name(candidate, name)
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
                    self.dropped("torn")
                f.truncate(keep)  # also frees the blocks reserved past the end
            path.rename(path.with_name(path.name[:-len(OPEN)]))

    def _expire(self) -> None:
        """Remove day folders older than the retention (the captures are users' data)."""
        cutoff = (dt.datetime.fromtimestamp(self.clock(), dt.UTC)
                  - dt.timedelta(days=self.retention_days)).strftime("%Y-%m-%d")
        for day in self.root.glob("*/*/[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]"):
            if day.name < cutoff:
                shutil.rmtree(day, ignore_errors=True)

    def _expire_daily(self) -> None:
        """(The retention thread.) ``_expire`` a minute past each midnight until the close."""
        while not self._stopped.wait(until_next_check(self.clock())):
            try:
                self._expire()
            except OSError as error:  # the folder unreadable: tried again the next day
                self.warn(f"capture: old days under {self.root} not deleted ({error})")

    def close(self) -> None:
        """Close every segment (the server's end); on a bucket, upload them."""
        self._stopped.set()
        with self._lock:
            self._closed = True
            for key in list(self._segments):
                self._close(key)
        if self.uploader is not None:
            self.uploader.close()
        with self._lock:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def open_capture(settings: Any, metrics: Metrics | None) -> Capture | None:
    """The server's capture (``orthornn serve --capture``), or None when it is off; on a
    bucket (``capture_uri``), written to the spool folder and uploaded (``upload``)."""
    if settings.capture is None:
        return None
    capture = Capture(settings.capture, settings.capture_sample, metrics,
                      replica=settings.capture_replica,
                      retention_days=settings.capture_retention_days,
                      max_age_s=None if settings.capture_uri is None
                      else settings.capture_segment_age_s)
    if settings.capture_uri is not None:
        from orthornn.export.artifacts.storage import open_store

        from .upload import Uploader

        capture.uploader = Uploader(capture, open_store(settings.capture_uri, "capture"),
                                    metrics)
        capture.uploader.start()
    return capture
