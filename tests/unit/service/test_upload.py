"""Capture on a bucket, its upload half (``service.loop.upload``) on the storage interface's
folder backend (the S3 one against SeaweedFS is tests/integration/test_object_storage.py):
a segment goes when it closes (its age, the end), byte for byte, once; its number stays
taken after the upload; what a killed predecessor left goes at the next start; a refusing
store keeps the segment for the next round; the bucket's old days are deleted; and the
commands' local copy of a bucket reads what the bucket holds."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from orthornn.export.artifacts.loop.captures import UPLOADED, local_captures, read_records
from orthornn.export.artifacts.storage import Local
from orthornn.service.loop.capture import Capture
from orthornn.service.loop.upload import Uploader
from orthornn.service.metrics import Metrics

T0 = 1_790_000_000.0  # 2026-09-21 (UTC)
DAY = "2026-09-21"


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def record(i: int) -> dict:
    return {"id": f"r{i}", "model": "m", "version": 1,
            "inputs": [np.full((2, 1), i, np.float32)], "outputs": [{"index": i}]}


def uploads(metrics: Metrics, outcome: str) -> float:
    return metrics.registry.get_sample_value("orthornn_capture_uploads_total",
                                             {"outcome": outcome}) or 0.0


@pytest.fixture
def setup(tmp_path):
    clock, metrics = Clock(), Metrics()
    capture = Capture(tmp_path / "spool", 1.0, metrics, replica="r", max_age_s=60,
                      clock=clock)
    bucket = Local(tmp_path / "bucket")
    return capture, Uploader(capture, bucket, metrics), bucket, clock, metrics


def test_a_segment_is_uploaded_when_it_is_old_enough_and_its_number_stays_taken(setup):
    capture, uploader, bucket, clock, metrics = setup
    capture.keep(record(1))
    capture.rotate()
    uploader.upload_closed()
    assert bucket.list() == []  # open, not old enough: nothing sent
    clock.now += 60
    capture.rotate()
    assert uploader.upload_closed() == 1
    key = f"m/1/{DAY}/r-1.jsonl"
    assert bucket.list() == [key]
    spool = capture.root / "m" / "1" / DAY
    assert sorted(p.name for p in spool.iterdir()) == [f"r-1.jsonl{UPLOADED}"]
    assert (spool / f"r-1.jsonl{UPLOADED}").stat().st_size == 0
    capture.keep(record(2))  # the next segment: number 2, not 1 again
    capture.close()  # the end closes it
    uploader.close()
    assert bucket.list() == [key, f"m/1/{DAY}/r-2.jsonl"]
    records, torn = read_records(bucket.root, "m")
    assert [r["id"] for r in records] == ["r1", "r2"] and torn == 0
    assert uploads(metrics, "uploaded") == 2


def test_a_restarted_replica_uploads_what_its_killed_predecessor_left(tmp_path):
    clock, bucket = Clock(), Local(tmp_path / "bucket")
    killed = Capture(tmp_path / "spool", 1.0, replica="r", max_age_s=60, clock=clock)
    for i in range(3):
        killed.keep(record(i))
    # killed: never closed, its segment left .open; its lock would have died with it
    os.close(killed._lock_fd)
    killed._stopped.set()
    restarted = Capture(tmp_path / "spool", 1.0, replica="r", max_age_s=60, clock=clock)
    assert restarted.replica == "r"
    assert Uploader(restarted, bucket).upload_closed() == 1  # closed at its start, then sent
    records, _ = read_records(bucket.root, "m")
    assert [r["id"] for r in records] == ["r0", "r1", "r2"]
    restarted.keep(record(3))  # numbered on from the predecessor's
    restarted.close()
    assert list(restarted.root.glob("m/1/*/r-2.jsonl"))


def test_an_upload_the_kill_cut_before_its_marker_is_not_sent_twice(setup):
    capture, uploader, bucket, clock, _ = setup
    capture.keep(record(1))
    clock.now += 60
    capture.rotate()
    segment = next(capture.root.glob("m/1/*/r-1.jsonl"))
    bucket.write_if_absent(segment.relative_to(capture.root).as_posix(), segment.read_bytes())
    assert uploader.upload_closed() == 1  # the same bytes there already: only the marker
    assert bucket.list() == [f"m/1/{DAY}/r-1.jsonl"]


def test_other_bytes_under_the_name_are_kept_and_the_segment_goes_beside_them(setup):
    """A spool lost with the host name kept numbers from 1 again: the bucket's object under
    that name is another segment, never overwritten."""
    capture, uploader, bucket, clock, _ = setup
    bucket.write(f"m/1/{DAY}/r-1.jsonl", b'{"id":"older"}\n')
    capture.keep(record(1))
    clock.now += 60
    capture.rotate()
    assert uploader.upload_closed() == 1
    keys = bucket.list()
    assert len(keys) == 2 and bucket.read(f"m/1/{DAY}/r-1.jsonl").data == b'{"id":"older"}\n'
    records, _ = read_records(bucket.root, "m")
    assert sorted(r["id"] for r in records) == ["older", "r1"]


def test_a_refusing_store_keeps_the_segment_for_the_next_round(setup, monkeypatch):
    capture, uploader, bucket, clock, metrics = setup
    capture.keep(record(1))
    clock.now += 60
    capture.rotate()

    def refuse(key: str, data: bytes) -> str:
        raise OSError("the store is down")
    monkeypatch.setattr(bucket, "write_if_absent", refuse)
    assert uploader.upload_closed() == 0
    assert uploads(metrics, "failed") == 1 and bucket.list() == []
    assert list(capture.root.glob("m/1/*/r-1.jsonl"))  # kept
    monkeypatch.undo()
    assert uploader.upload_closed() == 1 and bucket.list() == [f"m/1/{DAY}/r-1.jsonl"]


def test_the_buckets_days_past_the_retention_are_deleted(setup):
    _, uploader, bucket, _, _ = setup
    old = (dt.datetime.fromtimestamp(T0, dt.UTC) - dt.timedelta(days=31)).strftime("%Y-%m-%d")
    keep = (dt.datetime.fromtimestamp(T0, dt.UTC) - dt.timedelta(days=29)).strftime("%Y-%m-%d")
    for key in (f"m/1/{old}/a-1.jsonl", f"m/labels/{old}/a-1.jsonl", f"m/1/{keep}/a-1.jsonl",
                f"m/labels/{keep}/a-1.jsonl", "m/other/x"):
        bucket.write(key, b"{}\n")
    uploader.expire()
    assert bucket.list() == [f"m/1/{keep}/a-1.jsonl", f"m/labels/{keep}/a-1.jsonl",
                             "m/other/x"]


def test_the_commands_copy_of_a_bucket_follows_it(tmp_path, monkeypatch):
    """local_captures on a URI: the objects copied, a new one fetched, a deleted one gone,
    keys outside the layout (a '..' day, a hidden name) never written."""
    bucket = Local(tmp_path / "bucket")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    import orthornn.export.artifacts.storage as storage
    monkeypatch.setattr(storage, "open_store", lambda uri, setting: bucket)
    line = b'{"id":"a","model":"m","version":1,"inputs":[],"outputs":[]}\n'
    bucket.write(f"m/1/{DAY}/r-1.jsonl", line)
    bucket.write(f"m/1/{DAY}/.hidden.jsonl", line)
    bucket.write("m/1/notaday/r-1.jsonl", line)
    root = local_captures("s3://captures/p", "m")
    assert [r["id"] for r in read_records(root, "m")[0]] == ["a"]
    bucket.write(f"m/1/{DAY}/r-2.jsonl", line.replace(b'"a"', b'"b"'))
    bucket.delete(f"m/1/{DAY}/r-1.jsonl")
    assert local_captures("s3://captures/p", "m") == root
    assert [r["id"] for r in read_records(root, "m")[0]] == ["b"]
    assert sorted(p.relative_to(root).as_posix() for p in Path(root).rglob("*.jsonl")) == \
        [f"m/1/{DAY}/r-2.jsonl"]
    with pytest.raises(ValueError, match="--capture"):
        local_captures(tmp_path / "none", "m")


def test_the_label_index_lists_the_recent_days_and_all_only_now_and_then(tmp_path):
    """mirror_captures with DAYS (what the labels' index runs every second): one listing
    per version folder of the copy and the labels, of those days only; a new object of
    those days fetched, nothing removed; the whole listing (every few minutes) fetches an
    old day's object and removes what the bucket no longer holds."""
    from orthornn.export.artifacts.loop.captures import mirror_captures

    bucket, root = Local(tmp_path / "bucket"), tmp_path / "copy"
    listed: list[str] = []
    list_all = bucket.list
    bucket.list = lambda prefix="": listed.append(prefix) or list_all(prefix)  # type: ignore
    line = b'{"id":"a","model":"m","version":1,"inputs":[],"outputs":[]}\n'
    old, yesterday, today = "2026-09-01", "2026-09-19", "2026-09-20"
    for key in (f"m/1/{old}/r-1.jsonl", f"m/2/{yesterday}/r-1.jsonl"):
        bucket.write(key, line)
    mirror_captures(bucket, root, "m")
    assert listed == ["m/"]
    bucket.write(f"m/2/{today}/r-2.jsonl", line)
    bucket.write(f"m/labels/{today}/r-1.jsonl", b'{"id":"a","label":1}\n')
    bucket.write(f"m/1/{old}/r-2.jsonl", line)  # a predecessor's leftover, sent late
    bucket.delete(f"m/1/{old}/r-1.jsonl")  # the retention
    listed.clear()
    bucket.write(f"m/3/{today}/r-1.jsonl", line)  # a new version's first captures
    mirror_captures(bucket, root, "m", days=(yesterday, today), versions=(2, 3))
    assert sorted(listed) == sorted(f"m/{sub}/{day}/" for sub in ("1", "2", "3", "labels")
                                    for day in (yesterday, today))
    copied = lambda: sorted(p.relative_to(root).as_posix() for p in root.rglob("*.jsonl"))  # noqa: E731
    assert copied() == [f"m/1/{old}/r-1.jsonl", f"m/2/{yesterday}/r-1.jsonl",
                        f"m/2/{today}/r-2.jsonl", f"m/3/{today}/r-1.jsonl",
                        f"m/labels/{today}/r-1.jsonl"]
    mirror_captures(bucket, root, "m")  # the whole listing
    assert copied() == [f"m/1/{old}/r-2.jsonl", f"m/2/{yesterday}/r-1.jsonl",
                        f"m/2/{today}/r-2.jsonl", f"m/3/{today}/r-1.jsonl",
                        f"m/labels/{today}/r-1.jsonl"]


def test_old_days_are_listed_until_a_round_sends_everything_then_only_the_last_two(setup,
                                                                                   monkeypatch):
    """What a predecessor left in a past day's folder is sent, even when the first round
    fails; once a round sent all, only the capture's day and the one before are listed."""
    capture, uploader, bucket, _, _ = setup
    left = capture.root / "m" / "1" / "2026-09-01" / "old-1.jsonl"
    left.parent.mkdir(parents=True)
    left.write_bytes(b'{"id":"left"}\n')

    def refuse(key: str, data: bytes) -> str:
        raise OSError("the store is down")
    monkeypatch.setattr(bucket, "write_if_absent", refuse)
    assert uploader.upload_closed() == 0
    monkeypatch.undo()
    assert uploader.closed_segments() == [left]  # still listed after the failed round
    assert uploader.upload_closed() == 1 and bucket.list() == ["m/1/2026-09-01/old-1.jsonl"]
    late = capture.root / "m" / "1" / "2026-09-01" / "old-2.jsonl"
    late.write_bytes(b'{"id":"late"}\n')
    yesterday = capture.root / "m" / "1" / "2026-09-20" / "y-1.jsonl"
    yesterday.parent.mkdir(parents=True)
    yesterday.write_bytes(b'{"id":"y"}\n')
    assert uploader.closed_segments() == [yesterday]
