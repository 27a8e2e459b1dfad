"""Labels of captured requests: POST /v2/models/{name}/labels through the service (the
tokens, each error with its status and message, all or nothing, the label file, the
metric) on a real capture folder of the digits classifier and the words language model,
and the index of captured and labelled ids read incrementally from the files."""

import json
import re

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from orthornn.export.artifacts.loop.captures import read_labels
from orthornn.service.http.app import create_app
from orthornn.service.loop.index import CaptureIndex
from orthornn.service.loop.labels import MAX_LABELS, LabelStore
from orthornn.service.settings import Settings

from ...service_helpers import make_repo

ADMIN, LABELER = {"Authorization": "Bearer adm"}, {"Authorization": "Bearer lab"}


@pytest.fixture(scope="module")
def repo(service_packages, tmp_path_factory):
    return make_repo(service_packages, tmp_path_factory.mktemp("labels-repo"),
                     {"adding": [5], "digits": [1], "words": [1]})


def serve(repo, captured, **settings) -> TestClient:
    app = create_app(Settings(repo=repo, poll_interval_s=0, capture=captured,
                              capture_replica="r", **settings))
    return TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1")


def predict(c: TestClient, rid: str, model: str = "digits", sequences: int = 1) -> dict:
    body = {"model": model, "inputs": [[[0.1 * (i + 1)], [0.5], [0.9]]
                                       for i in range(sequences)]} \
        if model == "digits" else {"model": model, "text": ["the cat"] * sequences}
    r = c.post("/predict", json=body, headers={"X-Request-Id": rid})
    assert r.status_code == 200, r.text
    return r.json()


def label_lines(captured, model="digits") -> list[dict]:
    return [orjson.loads(line) for p in sorted((captured / model / "labels").glob("*/*"))
            for line in p.read_bytes().splitlines()]


def received(c: TestClient, model: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'orthornn_labels_received_total{{model="{model}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_labels_are_checked_written_and_counted(repo, tmp_path):
    captured = tmp_path / "cap"
    with serve(repo, captured, admin_token="adm", labels_token="lab") as c:
        c.app.state.registry.scanned.wait(60)
        for i in range(4):
            predict(c, f"d{i}")
        predict(c, "pair", sequences=2)
        predict(c, "w0", model="words")
        url = "/v2/models/digits/labels"
        body = [{"id": "d0", "label": 3}, {"id": "d1", "label": "7"}]
        # the tokens: none, a wrong one, a Basic one are refused; either token works
        assert c.post(url, json=body).status_code == 401
        assert c.post(url, json=body, headers={"Authorization": "Bearer no"}).status_code == 401
        r = c.post(url, json=body, headers={"Authorization": "Basic lab"})
        assert r.status_code == 401 and "the labels route" in r.json()["error"]
        # a page elsewhere may not send them, token or not
        r = c.post(url, json=body, headers={**LABELER, "Origin": "http://evil.example"})
        assert r.status_code == 403
        r = c.post(url, content=json.dumps(body), headers={**LABELER,
                                                          "Content-Type": "text/plain"})
        assert r.status_code == 415
        assert label_lines(captured) == []  # nothing written by a refused request

        r = c.post(url, json=body, headers=LABELER)
        assert r.status_code == 200 and r.json() == {"model": "digits", "accepted": 2}
        r = c.post(url, json=[{"id": "pair", "label": [1, "9"]}], headers=ADMIN)
        assert r.status_code == 200 and r.json()["accepted"] == 1
        lines = label_lines(captured)
        assert [(v["id"], v["label"], v["source"]) for v in lines] == [
            ("d0", 3, "api"), ("d1", 7, "api"), ("pair", [1, 9], "api")]
        assert all(set(v) == {"id", "label", "time", "source"} for v in lines)
        assert read_labels(captured, "digits") == lines
        assert received(c, "digits") == 3

        # each error: its status, the item and field named, and nothing written
        cases = [
            ([{"id": "d2", "label": 1}, {"id": "d2", "label": 2}], 400,
             r"\[1\]\.id: 'd2' appears twice"),
            ([{"id": "d2", "label": 1}, {"id": "nope", "label": 2}], 422,
             r"\[1\]\.id: 'nope' was not captured for model 'digits'"),
            ([{"id": "d2", "label": 1}, {"id": "d0", "label": 2}], 409,
             r"\[1\]\.id: 'd0' is already labelled"),
            ([{"id": "d2", "label": 1}, {"id": "d3", "label": 10}], 422,
             r"\[1\]\.label: class index 10 is outside 0\.\.9"),
            ([{"id": "d2", "label": "ten"}], 422,
             r"\[0\]\.label: 'ten' is not a class of model 'digits' version 1: one of '0'"),
            ([{"id": "d2", "label": True}], 422, r"\[0\]\.label: a class index"),
            ([{"id": "pair", "label": 1}], 409, "already labelled"),
            ([{"id": "d2", "label": [1, 2]}], 422, r"had 1 sequence: one class, not a list"),
            ([{"id": "two words", "label": 1}], 400, r"\[0\]\.id: 1 to 128 printable"),
            ([{"id": "d2"}], 400, r'\[0\]: must be an object with "id" and "label"'),
            ([{"id": "d2", "label": 1, "x": 2}], 400, r"unknown field 'x'"),
            ([], 400, "empty list"),
            ({"id": "d2", "label": 1}, 400, "body: must be a JSON list"),
            ([{"id": f"i{i}", "label": 1} for i in range(MAX_LABELS + 1)], 400,
             f"at most {MAX_LABELS} labels per request; got {MAX_LABELS + 1}"),
        ]
        for payload, status, message in cases:
            r = c.post(url, json=payload, headers=LABELER)
            assert r.status_code == status, (payload if len(payload) < 5 else "many", r.text)
            assert re.search(message, r.json()["error"]), r.json()["error"]
        r = c.post(url, content=b"[{", headers={**LABELER, "Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
        r = c.post("/v2/models/ghost/labels", json=[{"id": "d2", "label": 1}], headers=LABELER)
        assert r.status_code == 404 and "'ghost' is not in the model repository" in r.text
        r = c.post("/v2/models/adding/labels", json=[{"id": "d2", "label": 1}],
                   headers=LABELER)
        assert r.status_code == 422  # no adding request was captured
        assert len(label_lines(captured)) == 3 and received(c, "digits") == 3

        # a language model: the next tokens as words (mapped by the package's
        # vocabulary, <unk> for others), token ids, or text
        vocab = (repo / "words" / "1" / "vocab.txt").read_text().split("\n")
        r = c.post("/v2/models/words/labels", json=[{"id": "w0", "label": [99]}],
                   headers=LABELER)
        assert r.status_code == 422 and f"outside 0..{len(vocab) - 2}" in r.json()["error"]
        r = c.post("/v2/models/words/labels",
                   json=[{"id": "w0", "label": ["sat", "zebra", 2]}], headers=LABELER)
        assert r.status_code == 200
        assert read_labels(captured, "words")[0]["label"] == \
            [vocab.index("sat"), vocab.index("<unk>"), 2]
        assert received(c, "words") == 1


def test_capture_off_answers_409_and_the_document_lists_the_route(repo):
    app = create_app(Settings(repo=repo, poll_interval_s=0))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = c.post("/v2/models/digits/labels", json=[{"id": "a", "label": 1}])
        assert r.status_code == 409 and "capture is off" in r.json()["error"]
        op = c.get("/openapi.json").json()["paths"]["/v2/models/{name}/labels"]["post"]
        assert {"200", "401", "403", "404", "409", "415", "422"} <= set(op["responses"])
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/LabelsRequest")


def test_without_tokens_loopback_only_as_the_repository_api(repo, tmp_path):
    with serve(repo, tmp_path / "cap") as c:
        c.app.state.registry.scanned.wait(60)
        predict(c, "d0")
        r = c.post("/v2/models/digits/labels", json=[{"id": "d0", "label": 1}],
                   headers={"Host": "attacker.example"})  # DNS rebinding
        assert r.status_code == 403 and "loopback" in r.json()["error"]
        r = c.post("/v2/models/digits/labels", json=[{"id": "d0", "label": 1}])
        assert r.status_code == 200


def segment_line(rid: str, version: int = 1, sequences: int = 1) -> bytes:
    x = {"dtype": "<f4", "shape": [2, 1], "b64": "AAAAAAAAgD8="}
    return orjson.dumps({"id": rid, "time": 1.0, "route": "/predict", "model": "m",
                         "version": version, "inputs": [x] * sequences, "outputs": []}) + b"\n"


def test_the_index_reads_only_what_was_appended(tmp_path):
    day = tmp_path / "m" / "1" / "2026-11-27"
    day.mkdir(parents=True)
    open_segment = day / "a-1.jsonl.open"
    open_segment.write_bytes(segment_line("x1") + segment_line("x2") + b'{"id": "x3", "ti')
    (day / "b-1.jsonl").write_bytes(segment_line("y1") + segment_line("x1")  # a retry
                                    + segment_line('q"\\x'))  # escaped in JSON
    index = CaptureIndex(tmp_path, "m")
    index.refresh()
    assert len(index) == 4 and index.record("x3") is None  # a half line is not indexed
    assert index.record('q"\\x')["id"] == 'q"\\x'
    assert index.record("x2")["id"] == "x2" and index.record("y1")["inputs"]
    # the writer finishes the line, appends another, then closes the segment by rename
    with open(open_segment, "ab") as f:
        f.write(b'me": 2.0, "version": 1, "inputs": []}\n' + segment_line("x4"))
    open_segment.rename(day / "a-1.jsonl")
    reads = []
    real = CaptureIndex._tail

    def counted(self, segment):
        reads.append((segment.key, segment.offset))
        return real(self, segment)
    CaptureIndex._tail = counted
    try:
        index.refresh()
    finally:
        CaptureIndex._tail = real
    # the open segment is read from where the last read stopped, under its new name; the
    # closed one, read to its end already, not at all
    assert reads == [("m/1/2026-11-27/a-1.jsonl", 2 * len(segment_line("x1")))]
    assert len(index) == 6 and index.record("x4")["id"] == "x4"
    assert index.record("x3")["time"] == 2.0
    # another replica's label file: its ids are labelled here too
    labels = tmp_path / "m" / "labels" / "2026-11-27"
    labels.mkdir(parents=True)
    (labels / "other-1.jsonl").write_bytes(b'{"id": "x2", "label": 1}\n{"id": "x')
    index.refresh()
    assert index.labelled == {"x2"}
    (day / "b-1.jsonl").unlink()  # past the retention: its ids (and labels) are forgotten
    index.refresh()
    assert len(index) == 4 and index.record("y1") is None and index.record("x1") is not None


def test_on_a_bucket_the_index_reads_the_spool_and_the_copy_as_one(tmp_path):
    """A segment moves from the spool to the bucket's local copy (uploaded, unlinked, then
    mirrored): read once under its key, and its ids kept through the one refresh that
    finds it in neither folder; forgotten at the second."""
    copy, spool = tmp_path / "copy", tmp_path / "spool"
    day = "m/1/2026-11-27"
    (spool / day).mkdir(parents=True)
    (copy / day).mkdir(parents=True)
    (spool / day / "a-1.jsonl").write_bytes(segment_line("s1") + segment_line("s2"))
    index = CaptureIndex((copy, spool), "m")
    index.refresh()
    assert len(index) == 2
    (copy / day / "a-1.jsonl").write_bytes(segment_line("s1") + segment_line("s2"))
    index.refresh()  # in both folders: one segment, its ids once
    assert len(index) == 2 and index.record("s2")["id"] == "s2"
    (spool / day / "a-1.jsonl").unlink()
    (copy / day / "a-1.jsonl").unlink()
    index.refresh()  # between the spool's unlink and the copy's sync
    assert len(index) == 2 and index.record("s1") is None  # unreadable, yet not forgotten
    (copy / day / "a-1.jsonl").write_bytes(segment_line("s1") + segment_line("s2"))
    index.refresh()
    assert index.record("s1")["id"] == "s1"  # read from the copy
    (copy / day / "a-1.jsonl").unlink()
    index.refresh()
    index.refresh()  # gone from both, twice: forgotten
    assert len(index) == 0


def test_the_index_forgets_the_oldest_days_beyond_its_bound(tmp_path):
    for day, ids in (("2026-11-25", "ab"), ("2026-11-26", "cd"), ("2026-11-27", "ef")):
        folder = tmp_path / "m" / "1" / day
        folder.mkdir(parents=True)
        (folder / "r-1.jsonl").write_bytes(b"".join(segment_line(i) for i in ids))
    index = CaptureIndex(tmp_path, "m", max_ids=3)
    index.refresh()
    assert len(index) == 2 and index.record("e") and index.record("a") is None
    assert index.record("c") is None


def test_a_torn_label_line_is_skipped_and_fenced_off(service_packages, tmp_path):
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    day = tmp_path / "cap" / "digits" / "1" / "2026-11-27"
    day.mkdir(parents=True)
    day.joinpath("r-1.jsonl").write_bytes(segment_line("a") + segment_line("b"))
    store = LabelStore(tmp_path / "cap", repo, "r", clock=lambda: 1_795_000_000.0)
    assert store.add("digits", [{"id": "a", "label": 2}]) == 1
    path = next((tmp_path / "cap" / "digits" / "labels").glob("*/r-1.jsonl"))
    with open(path, "ab") as f:
        f.write(b'{"id": "b", "lab')  # a crash in the middle of a write
    assert [v["id"] for v in read_labels(tmp_path / "cap", "digits")] == ["a"]
    assert store.add("digits", [{"id": "b", "label": "4"}]) == 1
    assert path.read_bytes().count(b"\n") == 3  # the torn line ended by a newline first
    assert [(v["id"], v["label"]) for v in read_labels(tmp_path / "cap", "digits")] == \
        [("a", 2), ("b", 4)]
    assert np.isclose(read_labels(tmp_path / "cap", "digits")[1]["time"], 1_795_000_000.0)


def test_any_json_body_gets_a_4xx_with_an_error_never_a_5xx(repo, tmp_path):
    """Arbitrary JSON (and label-shaped bodies) to the labels route with capture on: a
    JSON error with a 4xx, or 200 for a body that is valid, and never a traceback."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    values = st.recursive(
        st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
        | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5),
                                                                    inner, max_size=3),
        max_leaves=20)
    ids = st.sampled_from(["d0", "d1", "pair", "w0", "nope", "", "x y"]) | st.text(max_size=4)
    items = st.fixed_dictionaries({"id": ids, "label": values})
    bodies = values | st.lists(items, max_size=4)
    with serve(repo, tmp_path / "cap") as c:
        c.app.state.registry.scanned.wait(60)
        for rid in ("d0", "d1"):
            predict(c, rid)
        predict(c, "pair", sequences=2)
        predict(c, "w0", model="words")

        accepted: list[tuple[str, str]] = []

        @settings(max_examples=150, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(model=st.sampled_from(["digits", "words"]), body=bodies)
        def run(model, body):
            r = c.post(f"/v2/models/{model}/labels", content=json.dumps(body),
                       headers={"Content-Type": "application/json"})
            assert r.status_code in (200, 400, 404, 409, 422), (r.status_code, r.text)
            if r.status_code != 200:
                assert isinstance(r.json()["error"], str)
            else:
                assert r.json()["accepted"] == len(body)
                accepted.extend((model, item["id"]) for item in body)
        run()
        # what was accepted is on disk, and only that, once per id
        written = [(m, v["id"]) for m in ("digits", "words")
                   for v in read_labels(tmp_path / "cap", m)]
        assert sorted(written) == sorted(accepted) and len(written) == len(set(written))


def test_label_days_past_the_capture_retention_are_deleted_with_the_captures(tmp_path):
    from orthornn.service.loop.capture import Capture

    for day in ("2026-08-01", "2026-11-20"):
        (tmp_path / "m" / "labels" / day).mkdir(parents=True)
        (tmp_path / "m" / "labels" / day / "r-1.jsonl").write_bytes(b'{"id":"a","label":1}\n')
    Capture(tmp_path, 1.0, replica="a", retention_days=30,
            clock=lambda: 1_795_000_000.0).close()  # 2026-11-18: the cutoff is 2026-10-19
    assert [p.name for p in (tmp_path / "m" / "labels").iterdir()] == ["2026-11-20"]
    assert len(read_labels(tmp_path, "m")) == 1
