"""Capture on object storage (``--capture s3://...``): the segments ``capture`` writes in
the replica's spool folder are uploaded, each to its own key in the bucket
(``<model>/<version>/<day>/<replica>-<n>.jsonl``, the folder's layout), once it closes:
at its size, at ``capture_segment_age_s`` (``Capture.rotate``, called here every second)
and at the server's end. An uploaded segment leaves an empty ``.uploaded`` marker that keeps
its number taken, so that a replica restarted on the same spool never reuses a key; what
a killed predecessor left in the spool is uploaded at the start. A failed upload keeps the
segment and is tried again a second later (``orthornn_capture_uploads_total``). The bucket's
day folders older than the retention are deleted once a day, as the spool's are."""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orthornn.export.artifacts.loop.captures import LABELS, UPLOADED
from orthornn.export.artifacts.storage import Exists, Store

from .disk import until_next_check

if TYPE_CHECKING:
    from ..metrics import Metrics

INTERVAL_S = 1.0  # how often open segments are checked for their age and closed ones sent


def name_os_thread(name: str) -> None:
    """The calling thread's name as the OS shows it (top -H, /proc/PID/task/*/comm; Python
    3.11 names only its own object): what bench/load/object_storage.py finds the upload's
    CPU time by. Linux's 15 characters; elsewhere nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


class Uploader:
    def __init__(self, capture: Any,  # capture.Capture: the layer above, which makes this
                 store: Store, metrics: Metrics | None = None,
                 interval_s: float = INTERVAL_S):
        self.capture, self.store, self.metrics = capture, store, metrics
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._next_expiry = 0.0  # when the bucket's old days are deleted next (clock time)
        self._backlog = True  # every day folder listed until one round sent all it found
        self._thread = threading.Thread(target=self._run, name="capture-upload", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def closed_segments(self) -> list[Path]:
        """The spool's closed, not yet uploaded segments, oldest day first: of every day
        until one round sent them all (what a predecessor left), then of the capture's
        day and the one before only (the spool keeps a marker for each segment sent within
        the retention, tens of thousands at the default age: not listed every second)."""
        root = self.capture.root
        if self._backlog:
            days = ["*"]
        else:
            now = dt.datetime.fromtimestamp(self.capture.clock(), dt.UTC)
            days = [(now - dt.timedelta(days=k)).strftime("%Y-%m-%d") for k in (1, 0)]
        return sorted((p for day in days for p in root.glob(f"*/*/{day}/*.jsonl")
                       if p.parent.parent.name.isdigit()),
                      key=lambda p: (p.parent.name, p.as_posix()))

    def upload_closed(self) -> int:
        """Upload every closed segment of the spool; how many went. A failure stops the
        round (the store is down: the rest waits for the next), counted and logged."""
        sent = 0
        for path in self.closed_segments():
            try:
                self._upload(path)
            except FileNotFoundError:  # uploaded by a concurrent round (the end's)
                continue
            except Exception as error:  # obstore's and the disk's errors alike: kept
                self._count("failed")
                self.capture.warn(f"capture: {path.name} not uploaded to {self.store.uri} "
                                  f"yet ({error}); tried again in {self.interval_s:g} s")
                return sent
            self._count("uploaded")
            sent += 1
        self._backlog = False
        return sent

    def _upload(self, path: Path) -> None:
        key = path.relative_to(self.capture.root).as_posix()
        data = path.read_bytes()
        try:
            self.store.write_if_absent(key, data)
        except Exists:  # an upload whose marker a kill prevented, or another spool's bytes
            if self.store.read(key).data != data:  # a lost spool, the host name kept
                self.store.write_if_absent(f"{key[:-len('.jsonl')]}-{uuid.uuid4().hex[:8]}"
                                           f".jsonl", data)
        marker = path.with_name(path.name + UPLOADED)
        marker.touch()  # first: a kill between the two leaves a segment known as sent
        path.unlink()

    def expire(self) -> None:
        """Delete the bucket's day folders (captures and labels) older than the capture's
        retention."""
        now = self.capture.clock()
        cutoff = (dt.datetime.fromtimestamp(now, dt.UTC)
                  - dt.timedelta(days=self.capture.retention_days)).strftime("%Y-%m-%d")
        for key in self.store.list():
            parts = key.split("/")
            if len(parts) == 4 and (parts[1].isdigit() or parts[1] == LABELS) \
                    and parts[2] < cutoff:
                self.store.delete(key)

    def _run(self) -> None:
        name_os_thread("capture-upload")
        self._tick()  # what a killed predecessor left, at once
        while not self._stopped.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        self.capture.rotate()
        self.upload_closed()
        if self.capture.clock() >= self._next_expiry:
            try:
                self.expire()
            except Exception as error:  # the store down: tried again the next day
                self.capture.warn(f"capture: old days in {self.store.uri} not deleted ({error})")
            self._next_expiry = self.capture.clock() + until_next_check(self.capture.clock())

    def close(self, timeout_s: float = 30.0) -> None:
        """(The server's end, after ``Capture.close``.) The last segments uploaded; what
        cannot be within TIMEOUT_S stays in the spool for the next start."""
        self._stopped.set()
        with contextlib.suppress(RuntimeError):  # never started
            self._thread.join(timeout=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.closed_segments() and time.monotonic() < deadline:
            if not self.upload_closed():
                break

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.capture_uploads.labels(outcome).inc()
