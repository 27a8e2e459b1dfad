"""Capture on its own (no HTTP): the sample by the request id's hash, a record's line against
an independent encoding, the segments and their rotation, the disk space reserved ahead
and given back, the drops (a read-only or full disk) counted and cheap, a killed writer's
torn line, the retention, and one segment name per replica."""

import base64
import binascii
import ctypes
import datetime as dt
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import orjson
import pytest
from orthornn.export.artifacts.loop.captures import array, read_records
from orthornn.service import request
from orthornn.service.errors import ClientError
from orthornn.service.loop import capture as capture_module
from orthornn.service.loop import records as records_module
from orthornn.service.loop.capture import Capture
from orthornn.service.loop.disk import fallocate
from orthornn.service.loop.ids import given_id, request_id, sampled
from orthornn.service.loop.records import keep_answer
from orthornn.service.metrics import Metrics
from orthornn.service.registry.runtime import Chunk

DAY = 86_400.0
T0 = 1_790_000_000.0  # 2026-09-21 (UTC)


def dropped(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("orthornn_capture_dropped_total",
                                             {"reason": reason}) or 0.0


def record(i: int, model: str = "m", version: int = 1) -> dict:
    return {"id": f"r{i}", "model": model, "version": version,
            "inputs": [np.full((2, 1), i, np.float32)], "outputs": [{"index": i}]}


def tag(rid: str, route: str) -> request.Scope:
    """The tag (its scope) of a request already decided in the sample under RID."""
    return request.Scope(id=rid, route=route)


def tagged(scope: request.Scope) -> request.Scope:
    """SCOPE as ``Capture.tag`` hands it on: a /predict request's."""
    scope.route = "/predict"
    return scope


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
    assert request_id("abc-1") == request_id(b"abc-1") == "abc-1"
    assert len({request_id(None) for _ in range(100)}) == 100
    # the id the client gave: the first X-Request-Id of two, as sent; else OIP's
    header = b"x-request-id"
    assert given_id([(b"host", b"h"), (header, b"first"), (header, b"second")]) == b"first"
    assert given_id([(b"host", b"h")], "oip-7") == "oip-7"
    assert given_id([(header, b"h-1")], "oip-7") == b"h-1"
    assert given_id([], "") is None and given_id([]) is None
    for bad in (b"", b"has space", b"x" * 129, "é".encode(), "é".encode("latin-1"),
                b"tab\there", b"del\x7f"):
        with pytest.raises(ClientError, match="X-Request-Id"):
            given_id([(header, bad)], "oip")
    longest = bytes(range(0x21, 0x7F)) + b"~" * 34  # every printable, 128 in all
    assert given_id([(header, longest)]) == longest
    assert request_id(longest) == longest.decode()


def test_only_a_request_in_the_sample_gets_an_id():
    """A given id (the header's, else OIP's) is kept under itself when its hash is in the
    sample, else the request has none; one without an id gets a new one with chance SHARE
    (10,000 draws at 0.1: 1,000 expected, sd 30)."""
    ids = [f"request-{i}" for i in range(2_000)]
    for share in (0.1, 0.5):
        in_sample = [i if binascii.crc32(i.encode()) % 10_000 < share * 10_000 else None
                     for i in ids]
        assert [request_id(i, share) for i in ids] == in_sample  # OIP's id
        assert [request_id(i.encode(), share) for i in ids] == in_sample  # the header's
    made = [request_id(None, 0.1) for _ in range(10_000)]
    kept = [m for m in made if m is not None]
    assert 850 < len(kept) < 1150 and len(set(kept)) == len(kept)
    assert all(len(m) == 32 and int(m, 16) >= 0 for m in kept)
    assert all(request_id("", 1.0) is not None for _ in range(10))  # empty: none given


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
    metrics, now, writes = Metrics(), [T0], []
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: now[0])
    real = os.write
    broken = [True]

    def write(fd, data):
        writes.append(data)
        if broken[0]:
            raise OSError(code, os.strerror(code))
        return real(fd, data)
    monkeypatch.setattr(capture_module.os, "write", write)
    keep_all(c, [record(i) for i in range(7)])  # seven records dropped, each counted
    assert dropped(metrics, reason) == 7
    assert len(writes) == 1  # the disk is not tried again within the second
    # one warning, not one a write: a full disk fails every write (a log that nobody reads
    # would fill its pipe and stall the server)
    assert len([r for r in caplog.records if "capture: a record of m" in r.message]) == 1
    broken[0] = False  # the disk back: the records of the next second are written
    now[0] += 1.0
    keep_all(c, [record(i) for i in range(7, 9)])
    c.close()
    assert sorted(r["id"] for r in read_records(tmp_path, "m")[0]) == ["r7", "r8"]


def test_a_short_write_is_cut_back_so_the_next_record_starts_whole(tmp_path, monkeypatch):
    """A disk that takes half a line (full mid-write): the half is cut, the record counted
    dropped, and the next records are whole lines after the ones before."""
    metrics, now = Metrics(), [T0]
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: now[0])
    keep_all(c, [record(0)])
    real = os.write
    monkeypatch.setattr(capture_module.os, "write", lambda fd, data: real(fd, data[:20]))
    keep_all(c, [record(1)])
    monkeypatch.undo()
    now[0] += 1.0
    keep_all(c, [record(2)])
    c.close()
    assert read_records(tmp_path, "m") == ([orjson.loads(orjson.dumps(
        record(i), option=orjson.OPT_SERIALIZE_NUMPY)) for i in (0, 2)], 0)
    assert dropped(metrics, "disk_full") == 1


def _space(path) -> int:
    return os.stat(path).st_blocks * 512


needs_fallocate = pytest.mark.skipif(fallocate() is None,
                                     reason="no fallocate(2) here")


@needs_fallocate
def test_disk_space_is_reserved_ahead_and_given_back_at_the_close(tmp_path):
    """While a segment is open its disk blocks are reserved 4 MiB ahead, its length the
    bytes written (a reader sees no zero tail); the close frees what was not used."""
    c = Capture(tmp_path, 1.0, replica="a", clock=lambda: T0)
    keep_all(c, [record(i) for i in range(10)])
    path = tmp_path / "m" / "1" / "2026-09-21" / "a-1.jsonl.open"
    written = sum(len(orjson.dumps(record(i), option=orjson.OPT_SERIALIZE_NUMPY)) + 1
                  for i in range(10))
    assert path.stat().st_size == written
    if _space(path) < capture_module.RESERVE:
        pytest.skip("this file system reserves no blocks past the end")
    c.close()
    closed = path.with_name("a-1.jsonl")
    assert closed.stat().st_size == written and _space(closed) < 64 << 10


def test_a_full_disk_refuses_at_the_reservation_and_costs_no_encoding(tmp_path, monkeypatch):
    """The reservation fails (ENOSPC): no byte written; for a second after, the records are
    dropped without being encoded or the disk tried; then reserved and written again."""
    metrics, now, tries, lines = Metrics(), [T0], [], []
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: now[0])

    def full(fd, mode, offset, length):
        tries.append(length)
        ctypes.set_errno(errno.ENOSPC)
        return -1
    c._reserve_space = full
    real_line = records_module.request_line
    monkeypatch.setattr(records_module, "request_line",
                        lambda *a: lines.append(1) or real_line(*a))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    with request.opened() as scope:
        for i in range(1000):
            scope.id = f"q{i}"
            keep_answer(c, "/predict", "m", 1, [x], [{"index": i}])
        assert tries and len(tries) == 1 and len(lines) == 1
        assert dropped(metrics, "disk_full") == 1000
        path = tmp_path / "m" / "1" / "2026-09-21" / "a-1.jsonl.open"
        assert path.stat().st_size == 0
        c._reserve_space = fallocate()  # the disk has room again
        now[0] += 1.0
        scope.id = "q-back"
        keep_answer(c, "/predict", "m", 1, [x], [{"index": 0}])
    c.close()
    (rec,), torn = read_records(tmp_path, "m")
    assert rec["id"] == "q-back" and torn == 0


def test_a_line_is_the_record_as_an_independent_encoding_writes_it(tmp_path):
    """keep_answer's bytes against a record built with the base64 module and json: the
    fields in order, each array's dtype, shape and bytes (a transposed view, int64 token
    ids, a session chunk, the OIP's output tensors by name)."""
    c = Capture(tmp_path, 1.0, replica="a", clock=lambda: T0 + 0.1234567)
    x = np.arange(12, dtype=np.float32).reshape(3, 4).T  # not contiguous
    tokens = np.array([5, 900, 7], dtype=np.int64)
    logits = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 2, 3)

    def b64(a):
        a = np.ascontiguousarray(a)
        return {"dtype": a.dtype.str, "shape": list(a.shape),
                "b64": base64.b64encode(a.tobytes()).decode()}
    with request.opened() as scope:
        scope.id, scope.compute_s = "a\"quote", 0.0123456
        keep_answer(c, "infer", "m", 3, [x, Chunk(tokens, np.zeros(2))], {"logits": logits},
                    "s-1", 7)
        scope.id, scope.compute_s = "b", None
        keep_answer(c, "/predict", "m", 3, [tokens], [{"label": "é", "index": 1}])
    c.close()
    lines = (tmp_path / "m" / "3" / "2026-09-21" / "a-1.jsonl").read_bytes().splitlines()
    first = orjson.loads(lines[0])
    assert list(first) == ["id", "time", "route", "model", "version", "inputs", "outputs",
                           "session", "position", "compute_ms"]
    assert first == {"id": 'a"quote', "time": round(T0 + 0.1234567, 6), "route": "infer",
                     "model": "m", "version": 3, "inputs": [b64(x), b64(tokens)],
                     "outputs": {"logits": b64(logits)}, "session": "s-1", "position": 7,
                     "compute_ms": 12.346}
    assert np.array_equal(array(first["inputs"][0]), x)
    assert orjson.loads(lines[1]) == {
        "id": "b", "time": round(T0 + 0.1234567, 6), "route": "/predict", "model": "m",
        "version": 3, "inputs": [b64(tokens)], "outputs": [{"label": "é", "index": 1}],
        "session": None, "position": None, "compute_ms": None}


def test_a_segment_cut_by_sigkill_recovers_to_exactly_the_written_records(tmp_path):
    """A real writer process: 200 records, then half of one more, then SIGKILL (its segment
    left open, its disk reservation held). The restart keeps exactly the 200, counts the
    torn one, and gives the reservation back."""
    script = f"""
import os, signal, sys
sys.path[:0] = {sys.path!r}
import numpy as np
from orthornn.service.loop.capture import Capture
c = Capture({str(tmp_path)!r}, 1.0, replica="a", clock=lambda: {T0!r})
for i in range(200):
    c.keep({{"id": f"r{{i}}", "model": "m", "version": 1, "x": [i]}})
seg = c._segments[("m", 1)]
os.write(seg.fd, b'{{"id": "r200", "model": "m", "ver')  # the kill comes mid-write
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    path = tmp_path / "m" / "1" / "2026-09-21" / "a-1.jsonl.open"
    assert path.exists()
    metrics = Metrics()
    Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0).close()
    closed = path.with_name("a-1.jsonl")
    assert not path.exists() and dropped(metrics, "torn") == 1
    records, torn = read_records(tmp_path, "m")
    assert records == [{"id": f"r{i}", "model": "m", "version": 1, "x": [i]}
                       for i in range(200)] and torn == 0
    assert closed.stat().st_size == sum(len(orjson.dumps(r)) + 1 for r in records)
    assert _space(closed) < 64 << 10  # the reservation given back


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


def test_old_days_are_deleted_past_each_midnight_off_the_request_path(tmp_path, monkeypatch):
    """The retention thread deletes the days past the retention a minute after midnight,
    with or without traffic; a new day's first record deletes nothing (its batch's
    answers wait for it); the close stops the thread."""
    armed, waits = threading.Event(), []

    def until(now: float) -> float:  # the thread's wait: held until the test arms it
        waits.append(now)
        if len(waits) == 1:
            assert armed.wait(10)
            return 0.0
        return 3600.0
    monkeypatch.setattr(capture_module, "until_next_check", until)
    now = [T0]  # 2026-09-21
    c = Capture(tmp_path, 1.0, replica="a", retention_days=30, clock=lambda: now[0])
    old = tmp_path / "m" / "1" / "2026-08-25"  # within 30 days of 09-21, not of 09-26
    old.mkdir(parents=True)
    now[0] += 5 * DAY
    keep_all(c, [record(1)])  # the new day's first record
    assert old.is_dir() and (tmp_path / "m" / "1" / "2026-09-26").is_dir()
    armed.set()
    deadline = time.monotonic() + 10
    while len(waits) < 2 and time.monotonic() < deadline:  # expired, then the next wait
        time.sleep(0.01)
    assert not old.exists() and waits[1] == now[0]
    c.close()
    c._retention.join(5)
    assert not c._retention.is_alive()


def test_the_retention_check_is_a_minute_past_the_next_midnight_utc():
    midnight = 1_790_035_200.0  # 2026-09-22 00:00 UTC
    assert dt.datetime.fromtimestamp(midnight, dt.UTC).strftime("%H:%M") == "00:00"
    assert capture_module.until_next_check(midnight - 3600) == 3600 + 60
    assert capture_module.until_next_check(midnight) == 60
    assert capture_module.until_next_check(midnight + 60) == 86_400  # just checked
    assert capture_module.until_next_check(midnight + 61) == 86_400 - 1


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
    # (issue 59, finding 12: ".." was taken; its lock file was then a folder, and two
    # servers wrote as one replica)
    for bad in ("no/slash", "..", ".", ".hidden", "a..b"):
        with pytest.raises(ValueError, match="capture_replica"):
            Capture(tmp_path, 1.0, replica=bad)


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


# -- a batch's records, written in its inference thread ---------------------------------------

def _b64(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(a.tobytes()).decode()}


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_a_batch_is_one_line_its_requests_read_back_one_record_each(tmp_path):
    """A classifier's batch of three sampled requests (one of two sequences, one a Chunk
    continuing a state): one line, against json/base64 built here; read back, each
    request's record holds its own sequences and the softmax numpy computes of its rows."""
    metrics = Metrics()
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0)
    spec = types.SimpleNamespace(task="classify", output_name="logits")
    record = c.recorder(spec, "m", 2, "model", timed=False)
    rng = np.random.default_rng(0)
    def x(n):
        return rng.normal(size=(n, 2)).astype(np.float32)
    seqs = [[x(3)], [x(5), x(1)], [Chunk(x(2), np.zeros(4, np.float32))]]
    logits = rng.normal(size=(4, 3)).astype(np.float32)
    rows = [[{"logits": logits[0]}], [{"logits": logits[1]}, {"logits": logits[2]}],
            [{"logits": logits[3]}]]
    tags = [tag("p-1", "/predict"), tag("o-1", "infer"), tag("s-1", "/predict")]
    record([(t, s, r, 0.0021) for t, s, r in zip(tags, seqs, rows, strict=True)])
    c.close()
    (line,) = (tmp_path / "m" / "2" / "2026-09-21" / "a-1.jsonl").read_bytes().splitlines()
    flat = [seqs[0][0], *seqs[1], seqs[2][0].data]
    p = _softmax(logits.astype(np.float64))
    assert orjson.loads(line) == {
        "ids": ["p-1", "o-1", "s-1"], "routes": ["/predict", "infer", "/predict"],
        "sequences": [1, 2, 1], "compute_ms": [2.1, 2.1, 2.1], "time": T0, "model": "m",
        "version": 2, "lengths": [3, 5, 1, 2], "inputs": _b64(np.concatenate(flat)),
        "outputs": {"kind": "classify", "name": "logits", "value": _b64(logits)}}
    records, torn = read_records(tmp_path, "m")
    assert torn == 0 and [r["id"] for r in records] == ["p-1", "o-1", "s-1"]
    for i, (r, n) in enumerate(zip(records, [1, 2, 1], strict=True)):
        first = sum([1, 2, 1][:i])
        assert (r["route"], r["version"], r["time"], r["session"]) == \
            (tags[i].route, 2, T0, None)
        assert len(r["inputs"]) == n and all(
            np.array_equal(a, b) for a, b in zip(r["inputs"], flat[first:first + n], strict=True))
        for item, row in zip(r["outputs"], p[first:first + n], strict=True):
            assert item == {"index": int(np.argmax(row)), "probabilities": row.tolist()}
    assert metrics.registry.get_sample_value("orthornn_capture_records_total",
                                             {"model": "m"}) == 3


def test_a_language_models_batch_keeps_each_sequences_log_likelihood(tmp_path):
    """LM rows: the log-likelihood of each sequence's tokens after its first, from the
    prepare step's log-probabilities or, without them (OIP), from the logits: both against
    numpy's log-softmax; per-step outputs of another graph go in a row per step."""
    c = Capture(tmp_path, 1.0, replica="a", clock=lambda: T0)
    rng = np.random.default_rng(1)
    tokens = [np.array([1, 4, 2, 0], np.int64), np.array([3], np.int64)]
    logits = [rng.normal(size=(n, 5)).astype(np.float32) for n in (4, 1)]

    def logp(z):
        z = z.astype(np.float64) - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    rows = [{"logits": logits[0], "_log_probabilities": logp(logits[0])}, {"logits": logits[1]}]
    lm = types.SimpleNamespace(task="lm", output_name="logits")
    c.recorder(lm, "lm", 1, "model", timed=True)(
        [(tag("a", "/predict"), [tokens[0]], [rows[0]], 0.001),
         (tag("b", "infer"), [tokens[1]], [rows[1]], 0.001)])
    steps = types.SimpleNamespace(task="classify", output_name="logits")
    y = rng.normal(size=(3, 2)).astype(np.float32)
    x = rng.normal(size=(3, 1)).astype(np.float32)
    c.recorder(steps, "st", 1, "steps", timed=True)(
        [(tag("c", "/predict"), [x], [{"logits": y}], 0.001)])
    c.close()
    a, b = read_records(tmp_path, "lm")[0]
    expected = logp(logits[0])[np.arange(3), tokens[0][1:]].sum()
    assert a["outputs"] == [{"log_likelihood": pytest.approx(expected, rel=1e-12)}]
    assert b["outputs"] == [{"log_likelihood": 0.0}]  # one token: nothing scored
    assert np.array_equal(a["inputs"][0], tokens[0]) and a["inputs"][0].dtype == np.int64
    (st,), torn = read_records(tmp_path, "st")
    assert torn == 0 and np.array_equal(st["outputs"][0]["logits"], y)


def test_a_batch_that_cannot_be_written_counts_each_of_its_records(tmp_path, monkeypatch):
    metrics = Metrics()
    c = Capture(tmp_path, 1.0, metrics, replica="a", clock=lambda: T0)
    spec = types.SimpleNamespace(task="classify", output_name="logits")
    record = c.recorder(spec, "m", 1, "model", timed=False)

    def refuse(*_):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(c, "_segment", refuse)
    x = np.zeros((2, 1), np.float32)
    decided = [request.Scope(given=f"r{i}".encode(), deciding=True) for i in range(4)]
    record([(tagged(scope), [x], [{"logits": np.zeros(3)}], 0.0)
            for scope in decided])
    assert dropped(metrics, "disk_full") == 4
    assert [s.id for s in decided] == ["r0", "r1", "r2", "r3"]  # answered with their ids
    monkeypatch.undo()  # the disk has room again, but for a second nothing of m 1 is tried
    later = [request.Scope(given=f"n{i}".encode(), deciding=True) for i in range(2)]
    record([(tagged(scope), [x], [{"logits": np.zeros(3)}], 0.0)
            for scope in later])
    assert dropped(metrics, "disk_full") == 6
    assert [s.id for s in later] == [None, None]  # no X-Request-Id: nothing is kept under it
    other = request.Scope(given=b"o-1", deciding=True)  # another model's are written
    c.recorder(spec, "other", 1, "model", timed=False)(
        [(tagged(other), [x], [{"logits": np.zeros(3)}], 0.0)])
    assert other.id == "o-1" and dropped(metrics, "disk_full") == 6
    assert not list((tmp_path / "m").rglob("*.jsonl*"))
    c.close()
    (rec,), torn = read_records(tmp_path, "other")
    assert rec["id"] == "o-1" and torn == 0


def test_the_batch_decides_the_sample_of_its_requests(tmp_path):
    """The event loop tags every request the HTTP layer gave an id to decide (none else);
    the batch decides each by its id's hash: the ones in the sample are written under
    their ids, which their answers carry; the rest get none."""
    c = Capture(tmp_path, 0.3, replica="a", clock=lambda: T0)
    spec = types.SimpleNamespace(task="classify", output_name="logits")
    ids = [f"q{i}" for i in range(2_000)]
    batch = []
    for rid in ids:
        with request.opened() as scope:
            scope.given, scope.deciding = given_id([(b"x-request-id", rid.encode())]), True
            batch.append((c.tag("infer"), [np.zeros((1, 1), np.float32)],
                          [{"logits": np.zeros(2)}], 0.0))
            assert batch[-1][0] is scope and scope.route == "infer"
    c.recorder(spec, "m", 1, "model", timed=False)(batch)
    in_sample = [i for i in ids if sampled(i, 0.3)]
    assert [t.id for t, *_ in batch] == [i if i in in_sample else None for i in ids]
    with request.opened():  # nothing to decide (capture was off when the request came)
        assert c.tag("infer") is None
    c.close()
    records, torn = read_records(tmp_path, "m")
    assert [r["id"] for r in records] == in_sample and torn == 0
