"""Capture on its own (no HTTP): the sample by the request id's hash, the segments and their
rotation, the drops (a read-only or full disk) counted, a killed writer's torn line, the
retention, and one segment name per replica."""

import binascii
import errno
import os

import numpy as np
import orjson
import pytest
from orthornn.service import capture as capture_module
from orthornn.service.capture import Capture, read_records, request_id, sampled
from orthornn.service.errors import ClientError
from orthornn.service.metrics import Metrics

DAY = 86_400.0
T0 = 1_790_000_000.0  # 2026-09-21 (UTC)


def dropped(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("orthornn_capture_dropped_total",
                                             {"reason": reason}) or 0.0


def record(i: int, model: str = "m", version: int = 1) -> dict:
    return {"id": f"r{i}", "model": model, "version": version,
            "inputs": [np.full((2, 1), i, np.float32)], "outputs": [{"index": i}]}


def keep_all(c: Capture, records: list[dict]) -> None:
    for r in records:
        c.keep(r)


def test_the_sample_follows_the_ids_crc32_alike_everywhere():
    ids = [f"request-{i}" for i in range(10_000)]
    for share in (0.1, 0.5, 1.0):
        chosen = [i for i in ids if sampled(i, share)]
        # the formula, independently: CRC-32 of the id's bytes, in 10,000 buckets
        assert chosen == [i for i in ids
                          if binascii.crc32(i.encode()) % 10_000 < share * 10_000]
        assert abs(len(chosen) / len(ids) - share) < 0.02
    assert request_id("abc-1") == "abc-1" and request_id(None, "oip-7") == "oip-7"
    assert len({request_id(None) for _ in range(100)}) == 100
    for bad in ("", "has space", "x" * 129, "é"):
        with pytest.raises(ClientError, match="X-Request-Id"):
            request_id(bad)


def test_records_are_written_per_model_version_and_day_and_closed_by_rename(tmp_path):
    metrics = Metrics()
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0)
    keep_all(c, [record(i) for i in range(50)] + [record(i, "m", 2) for i in range(5)])
    day = tmp_path / "m" / "1" / "2026-09-21"
    assert sorted(p.name for p in day.iterdir()) == ["a-1.jsonl.open"]  # written, still open
    lines = (day / "a-1.jsonl.open").read_bytes().splitlines()
    assert [orjson.loads(x)["id"] for x in lines] == [f"r{i}" for i in range(50)]
    assert orjson.loads(lines[3])["inputs"] == [[[3.0], [3.0]]]
    c.close()
    assert sorted(p.name for p in day.iterdir()) == ["a-1.jsonl"]
    records, torn = read_records(tmp_path, "m")
    assert len(records) == 55 and torn == 0
    assert metrics.registry.get_sample_value("orthornn_capture_records_total",
                                             {"model": "m"}) == 55


def test_segments_rotate_by_size_and_number_on(tmp_path):
    c = Capture(tmp_path, 1.0, replica="a", segment_bytes=300, clock=lambda: T0)
    for i in range(12):  # one at a time: each its own write
        keep_all(c, [record(i)])
    c.close()
    names = sorted(p.name for p in (tmp_path / "m" / "1" / "2026-09-21").iterdir())
    assert len(names) > 2 and all(n.endswith(".jsonl") for n in names)
    assert sorted(int(n[2:-6]) for n in names) == list(range(1, len(names) + 1))
    assert sorted(r["id"] for r in read_records(tmp_path, "m")[0]) == \
        sorted(f"r{i}" for i in range(12))


@pytest.mark.parametrize("code, reason", [(errno.EROFS, "read_only"),
                                          (errno.ENOSPC, "disk_full")])
def test_a_read_only_or_full_disk_drops_and_counts_and_recovers(tmp_path, monkeypatch, caplog,
                                                                code, reason):
    metrics = Metrics()
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0)
    real = os.write
    broken = [True]

    def write(fd, data):
        if broken[0]:
            raise OSError(code, os.strerror(code))
        return real(fd, data)
    monkeypatch.setattr(capture_module.os, "write", write)
    keep_all(c, [record(i) for i in range(7)])  # seven writes fail: each dropped, counted
    assert dropped(metrics, reason) == 7
    # one warning, not one a write: a full disk fails every write (a log that nobody reads
    # would fill its pipe and stall the server)
    assert len([r for r in caplog.records if "capture: a record of m" in r.message]) == 1
    broken[0] = False  # the disk back: the next records are written
    keep_all(c, [record(i) for i in range(7, 9)])
    c.close()
    assert sorted(r["id"] for r in read_records(tmp_path, "m")[0]) == ["r7", "r8"]


def test_a_killed_writers_torn_line_is_cut_and_counted_at_the_restart(tmp_path):
    day = tmp_path / "m" / "1" / "2026-09-21"
    day.mkdir(parents=True)
    whole = b"".join(orjson.dumps({"id": f"r{i}"}) + b"\n" for i in range(3))
    (day / "a-4.jsonl.open").write_bytes(whole + b'{"id": "r3", "inp')
    (day / "b-1.jsonl.open").write_bytes(b'{"id": "b0"}\n{"id"')  # another replica's
    metrics = Metrics()
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0)
    assert (day / "a-4.jsonl").read_bytes() == whole and dropped(metrics, "torn") == 1
    assert (day / "b-1.jsonl.open").exists()  # b's own restart closes it
    keep_all(c, [record(9)])
    c.close()
    assert (day / "a-5.jsonl").exists()  # numbering goes on after the recovered segment
    records, torn = read_records(tmp_path, "m")
    assert sorted(r["id"] for r in records) == ["b0", "r0", "r1", "r2", "r9"] and torn == 1


def test_day_folders_past_the_retention_are_deleted(tmp_path):
    for day in ("2026-08-01", "2026-09-01", "2026-09-20"):
        (tmp_path / "m" / "1" / day).mkdir(parents=True)
    c = Capture(tmp_path, 1.0, replica="a", retention_days=30, clock=lambda: T0)
    c.close()
    assert sorted(p.name for p in (tmp_path / "m" / "1").iterdir()) == \
        ["2026-09-01", "2026-09-20"]


def test_two_writers_of_one_name_never_share_a_segment(tmp_path):
    first = Capture(tmp_path, 1.0, replica="pod", clock=lambda: T0)
    second = Capture(tmp_path, 1.0, replica="pod", clock=lambda: T0)
    assert first.replica == "pod" and second.replica == f"pod-{os.getpid()}"
    keep_all(first, [record(1)])
    keep_all(second, [record(2)])
    first.close()
    second.close()
    names = sorted(p.name for p in (tmp_path / "m" / "1" / "2026-09-21").iterdir())
    assert names == sorted([f"pod-{os.getpid()}-1.jsonl", "pod-1.jsonl"])
    with pytest.raises(ValueError, match="capture_replica"):
        Capture(tmp_path, 1.0, replica="no/slash")


def test_a_new_day_opens_a_new_folder(tmp_path):
    now = [T0]
    c = Capture(tmp_path, 1.0, replica="a", clock=lambda: now[0])
    keep_all(c, [record(1)])
    now[0] += DAY
    keep_all(c, [record(2)])
    c.close()
    assert sorted(p.name for p in (tmp_path / "m" / "1").iterdir()) == \
        ["2026-09-21", "2026-09-22"]
    assert all(p.name == "a-1.jsonl" for p in (tmp_path / "m" / "1").glob("*/*"))


def test_a_segment_that_cannot_be_opened_is_tried_again_once_a_second(tmp_path, monkeypatch):
    """A read-only folder: every record is dropped and counted, and the folder is not
    listed and opened again for each record (once a second)."""
    metrics, now, opened = Metrics(), [T0], []
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: now[0])

    def refuse(path, *args):
        opened.append(path)
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(capture_module.os, "open", refuse)
    keep_all(c, [record(i) for i in range(5)])
    assert len(opened) == 1 and dropped(metrics, "read_only") == 5
    now[0] += 1.5
    keep_all(c, [record(5)])
    assert len(opened) == 2 and dropped(metrics, "read_only") == 6
    monkeypatch.undo()
    c.close()


def test_a_folder_that_cannot_be_prepared_serves_on_and_counts_the_drops(tmp_path):
    """DIR/.replicas is a file (as a read-only or broken volume would refuse the folder):
    the server starts, every record is dropped and counted, nothing raises."""
    (tmp_path / ".replicas").write_text("not a folder")
    (tmp_path / "m").write_text("not a folder either")  # no model folder can be made
    metrics = Metrics()
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0)
    keep_all(c, [record(i) for i in range(3)])
    assert dropped(metrics, "error") == 3
    c.close()
