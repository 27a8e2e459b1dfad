"""`orthornn capture dataset` against a hand-built capture folder (the join by id, the
late-label window, a retry captured twice, the split by time; the .npz read back by
training's own ``load_npz`` and compared with the captured arrays), and `orthornn labels
import` (JSON lines and CSV, its errors naming the line and the field)."""

import base64
import datetime as dt
import re

import numpy as np
import orjson
import pytest
from orthornn.export.artifacts.loop.captures import read_labels
from orthornn.export.artifacts.loop.dataset import build, holdout_path, write_dataset
from orthornn.training.tasks.user import load_npz

from ...helpers import orthornn_here
from ...service_helpers import make_repo

T0 = 1_795_000_000.0  # 2026-11-18 (UTC)
DAY = 86_400.0
NAMES = [f"c{i}" for i in range(4)]


def day_of(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d")


def encoded(a: np.ndarray) -> dict:
    return {"dtype": a.dtype.str, "shape": list(a.shape),
            "b64": base64.b64encode(a.tobytes()).decode()}


def captured_record(rid: str, t: float, xs: list[np.ndarray], version: int = 1) -> dict:
    outputs = [{"label": NAMES[i % 4], "index": i % 4, "probabilities": [0.25] * 4,
                "top_k": [{"label": NAMES[j], "index": j, "probability": 0.25}
                          for j in range(4)]}
               for i in range(len(xs))]  # the class names, as /predict's answers show them
    return {"id": rid, "time": t, "route": "/predict", "model": "m", "version": version,
            "inputs": [encoded(x) for x in xs], "outputs": outputs, "session": None,
            "position": None, "compute_ms": 0.1}


def write_segment(root, replica: str, records: list[dict], suffix: str = ".jsonl",
                  model: str = "m") -> None:
    for r in records:
        folder = root / model / str(r["version"]) / day_of(r["time"])
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{replica}-1{suffix}", "ab") as f:
            f.write(orjson.dumps(r) + b"\n")


def write_labels(root, lines: list[dict], model: str = "m") -> None:
    folder = root / model / "labels" / day_of(T0)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "r-1.jsonl", "ab") as f:
        f.write(b"".join(orjson.dumps({**v, "source": "api"}) + b"\n" for v in lines))


@pytest.fixture
def captures(tmp_path):
    """60 records of model m over six days (lengths 2..6, d = 3), one of two sequences,
    a retry of r5 captured again by replica b, and a torn last line in an open segment;
    labels for r0..r53, r54's eight days late, r55..r59 unlabelled, r1 labelled twice."""
    rng = np.random.default_rng(0)
    root, xs, records = tmp_path / "cap", {}, []
    for i in range(60):
        t = T0 + i * 0.1 * DAY
        xs[f"r{i}"] = [rng.normal(size=(2 + i % 5, 3)).astype(np.float32)
                       for _ in range(2 if i == 7 else 1)]
        records.append(captured_record(f"r{i}", t, xs[f"r{i}"]))
    write_segment(root, "a", records[:20])
    for r in records[20:]:  # the segment a replica is writing: a-2 (a-1 was closed)
        folder = root / "m" / "1" / day_of(r["time"])
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "a-2.jsonl.open", "ab") as f:
            f.write(orjson.dumps(r) + b"\n")
    retry = captured_record("r5", records[5]["time"] + 1.0, xs["r5"])  # the same inputs
    write_segment(root, "b", [retry])
    with open(sorted(root.glob("m/1/*/a-2.jsonl.open"))[-1], "ab") as f:
        f.write(b'{"id": "r60", "time"')  # a killed writer's torn last line
    labels = {f"r{i}": ([1, 2] if i == 7 else i % 4) for i in range(55)}
    write_labels(root, [{"id": rid, "label": y,
                         "time": records[int(rid[1:])]["time"] + (8 * DAY if rid == "r54"
                                                                  else 60.0)}
                        for rid, y in labels.items()]
                 + [{"id": "r1", "label": 3, "time": records[1]["time"] + 120.0}])
    return root, xs, records, labels


def test_the_dataset_joins_dedups_splits_by_time_and_loads_in_training(captures, tmp_path):
    root, xs, records, labels = captures
    summary = write_dataset(root, "m", tmp_path / "d.npz", progress=False)
    assert (summary.records, summary.labelled, summary.unlabelled, summary.late,
            summary.duplicates, summary.torn) == (61, 54, 5, 1, 2, 1)
    # 54 labelled records (r7 has two sequences): the newest 11 records held out
    train, held = np.load(tmp_path / "d.npz"), np.load(holdout_path(tmp_path / "d.npz"))
    kept = [f"r{i}" for i in range(54)]  # by time; r54 late, r55.. unlabelled
    assert list(held["ids"]) == kept[43:]
    assert list(train["ids"]) == [*kept[:7], "r7", *kept[7:43]]
    assert (summary.train, summary.holdout) == (44, 11)
    assert summary.classes == {"c0": 14, "c1": 15, "c2": 14, "c3": 12}
    for part in (train, held):
        rows = [(rid, k) for rid in dict.fromkeys(part["ids"]) for k in range(len(xs[rid]))]
        assert len(rows) == len(part["y"])
        for n, (rid, k) in enumerate(rows):
            x = xs[rid][k]  # r5's first capture, not the retry's zeros
            assert part["lengths"][n] == len(x)
            assert np.array_equal(part["x"][n, :len(x)], x)
            assert not part["x"][n, len(x):].any()  # zero padding
            want = labels[rid][k] if isinstance(labels[rid], list) else labels[rid]
            assert part["y"][n] == want  # r1's second label ignored: the first counts
            assert part["times"][n] == records[int(rid[1:])]["time"]
        assert list(part["labels"]) == NAMES and set(part["versions"]) == {1}
    assert max(train["times"]) < min(held["times"])
    day0, day1 = day_of(T0), day_of(records[50]["time"])
    assert set(train["segments"]) >= {f"m/1/{day0}/a-1.jsonl"}
    assert all(s.endswith(".jsonl") for s in [*train["segments"], *held["segments"]])
    assert f"m/1/{day1}/a-2.jsonl" in held["segments"]  # the open one, by its final name
    # training's own reader takes both files
    for path, part in ((tmp_path / "d.npz", train), (holdout_path(tmp_path / "d.npz"), held)):
        x, y, lengths, names = load_npz(path)
        assert np.array_equal(x.numpy(), part["x"]) and np.array_equal(y.numpy(), part["y"])
        assert np.array_equal(lengths.numpy(), part["lengths"]) and names == NAMES


def test_the_window_since_and_too_few_are_counted_or_refused(captures, tmp_path):
    root, _, records, _ = captures
    _, _, wide = build(root, "m", window_days=9, holdout_share=0.25, progress=False)
    assert (wide.late, wide.labelled, wide.holdout) == (0, 55, 14)
    since = day_of(records[20]["time"])
    _, _, later = build(root, "m", since=since, holdout_share=0, progress=False)
    assert later.records == sum(1 for r in records if day_of(r["time"]) >= since)
    with pytest.raises(ValueError, match=r"too few labelled sequences of 'm': \d+ to train "
                                         r"on and \d+ held out"):
        build(root, "m", holdout_share=0.9, progress=False)
    for kwargs, flag in (({"since": "yesterday"}, "--since"), ({"window_days": 0}, "--window"),
                         ({"holdout_share": 1.0}, "--holdout-share")):
        with pytest.raises(ValueError, match=flag):
            build(root, "m", progress=False, **kwargs)
    with pytest.raises(ValueError, match="no captures of model 'nope'"):
        build(root, "nope", progress=False)


def test_the_command_prints_the_summary_and_exits_2_on_bad_input(captures, tmp_path):
    root = captures[0]
    out = tmp_path / "part.npz"
    r = orthornn_here("capture", "dataset", "--capture", root, "--name", "m", "--out", out,
                      "--holdout", tmp_path / "held.npz", "--no-progress", code=0)
    assert "m: records 61, labelled 54, unlabelled 5, late labels 1, duplicates 2" in r.stdout
    assert "per class: c0: 14, c1: 15, c2: 14, c3: 12" in r.stdout
    assert f"wrote {out} (44), {tmp_path / 'held.npz'} (11)" in r.stdout
    assert len(np.load(tmp_path / "held.npz")["y"]) == 11
    r = orthornn_here("capture", "dataset", "--capture", root, "--name", "m", "--out", out,
                      "--window", "soon", code=2)
    assert r.stderr.strip() == "orthornn capture: error: --window must be a number; got 'soon'"


# -- orthornn labels import ----------------------------------------------------------------

@pytest.fixture
def digits(service_packages, tmp_path):
    """The digits package in a repository, and captures of it (r0..r11, one sequence each;
    r12 two sequences)."""
    repo = make_repo(service_packages, tmp_path / "repo", {"digits": [1]})
    records = [captured_record(f"r{i}", T0 + i, [np.ones((3, 1), np.float32)])
               for i in range(12)]
    records.append(captured_record("r12", T0 + 12, [np.ones((3, 1), np.float32)] * 2))
    for r in records:
        r["model"] = "digits"
    folder = tmp_path / "cap" / "digits" / "1" / day_of(T0)
    folder.mkdir(parents=True)
    (folder / "a-1.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return repo, tmp_path / "cap"


def test_labels_import_from_json_lines_and_csv(digits, tmp_path):
    repo, cap = digits
    jsonl = tmp_path / "l.jsonl"
    jsonl.write_text("".join(orjson.dumps({"id": f"r{i}", "label": i % 10}).decode() + "\n"
                             for i in range(6)) + "\n")
    r = orthornn_here("labels", "import", jsonl, "--capture", cap, "--name", "digits",
                      "--repo", repo, code=0)
    assert f"digits: imported 6 labels from {jsonl}" in r.stdout
    csv = tmp_path / "l.csv"
    csv.write_text('id,label\nr6,7\nr7,"3"\nr12,"[1, 2]"\n')
    orthornn_here("labels", "import", csv, "--capture", cap, "--name", "digits", "--repo",
                  repo, code=0)
    got = read_labels(cap, "digits")
    assert [(v["id"], v["label"], v["source"]) for v in got] == \
        [(f"r{i}", i, "import") for i in range(6)] + \
        [("r6", 7, "import"), ("r7", 3, "import"), ("r12", [1, 2], "import")]


@pytest.mark.parametrize("text, message", [
    ("id,label\nr8,1\nr9,11\n", r"l.csv line 3: label: class index 11 is outside 0..9"),
    ("id,label\nr8,1\nnope,1\n", r"l.csv line 3: id: 'nope' was not captured for model "
                                 r"'digits'"),
    ("r8,1\nr8,2\n", r"l.csv line 2: id: 'r8' appears twice"),
    ("r8,1\nr0,2\n", r"l.csv line 2: id: 'r0' is already labelled"),
    ("r8,1\nr9,seven\n", r"l.csv line 2: label: 'seven' is not a class"),
    ("r8,1\nr9,1,2\n", r"l.csv line 2: two columns id,label; got 3"),
    ("r8,1\nr12,1\n", r"l.csv line 2: label: the request had 2 sequences"),
    # issue 59, finding 11: csv's own errors were tracebacks
    ('r8,1\nr9,"1\nr10,2\n', r"l.csv line 3: not CSV \(unexpected end of data\)"),
    ("r8,1\nr9," + "7" * (200 << 10) + "\n", r"l.csv line 2: not CSV \(field larger than "
                                           r"field limit"),
])
def test_labels_import_errors_name_the_line_and_field_and_write_nothing(digits, tmp_path,
                                                                         text, message):
    repo, cap = digits
    first = tmp_path / "first.jsonl"
    first.write_text('{"id": "r0", "label": 0}\n')
    orthornn_here("labels", "import", first, "--capture", cap, "--name", "digits",
                  "--repo", repo, code=0)
    path = tmp_path / "l.csv"
    path.write_text(text)
    r = orthornn_here("labels", "import", path, "--capture", cap, "--name", "digits",
                      "--repo", repo, code=2)
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("orthornn labels: error: ") and re.search(message, line), line
    assert [v["id"] for v in read_labels(cap, "digits")] == ["r0"]


def test_labels_import_skips_a_byte_order_mark(digits, tmp_path):
    """A file written with a BOM (as spreadsheets and some editors do): a JSON-lines file is
    still read as JSON lines (it was read as CSV), a CSV's first id is still the id."""
    repo, cap = digits
    jsonl, csv = tmp_path / "l.jsonl", tmp_path / "l.csv"
    jsonl.write_bytes(b'\xef\xbb\xbf{"id": "r1", "label": 1}\n')
    csv.write_bytes(b"\xef\xbb\xbfr2,2\n")
    for path in (jsonl, csv):
        orthornn_here("labels", "import", path, "--capture", cap, "--name", "digits",
                      "--repo", repo, code=0)
    assert [(v["id"], v["label"]) for v in read_labels(cap, "digits")] == [("r1", 1), ("r2", 2)]


def manifest_only(repo, version: int, task: str, labels: list[str]) -> None:
    """A package folder holding only manifest.json (all the data set reads of it)."""
    folder = repo / "m" / str(version)
    folder.mkdir(parents=True)
    spec = {"kind": "float", "feature_size": 3, "max_length": 0}
    (folder / "manifest.json").write_text(orjson.dumps({
        "format": "orthornn-package/1", "name": "m", "version": version, "arch": "rnn",
        "task": task, "mode": "dense", "opset": 17, "recurrence": "rnn", "graphs": {},
        "io": {}, "files": {}, "hidden_size": 4, "input_spec": spec,
        "output_spec": {"kind": "value" if task == "regress" else "logits",
                        "size": len(labels) or 1, "state_size": 4},
        "labels": labels or None}).decode())


def test_with_repo_the_class_names_come_from_the_manifests(captures, tmp_path):
    root = captures[0]
    names = ["zero", "one", "two", "three"]
    manifest_only(tmp_path / "repo", 1, "classify", names)
    train, held, _ = build(root, "m", repo=tmp_path / "repo", progress=False)
    assert list(train["labels"]) == names and list(held["labels"]) == names
    other = tmp_path / "other"
    manifest_only(other, 1, "regress", [])
    with pytest.raises(ValueError, match="version 1 is a regress model; the data set is for "
                                         "classify and lm models"):
        build(root, "m", repo=other, progress=False)


# -- a language model's captures: a text corpus ------------------------------------------

@pytest.fixture
def word_captures(service_packages, tmp_path):
    """The words language model in a repository and 80 captured records of it over four
    days: token-id inputs of 4..8 tokens drawn from its whole vocabulary (<unk>, <eos> and
    the number token N among them), r9 of two sequences, labelled with 2..3 next tokens
    (r3's holding id 99, which the vocabulary has no word for); a retry of r4, r70's label
    eight days late, r75..r79 unlabelled."""
    repo = make_repo(service_packages, tmp_path / "repo", {"words": [1]})
    vocab = (repo / "words" / "1" / "vocab.txt").read_text().splitlines()
    rng = np.random.default_rng(1)
    root, tokens, records, labels = tmp_path / "cap", {}, [], {}
    for i in range(80):
        rid = f"r{i}"
        tokens[rid] = [rng.integers(0, len(vocab), 4 + i % 5).astype(np.int64)
                       for _ in range(2 if i == 9 else 1)]
        record = captured_record(rid, T0 + i * 0.05 * DAY, tokens[rid])
        record.update(model="words", outputs=[{"log_likelihood": -3.0}] * len(tokens[rid]))
        records.append(record)
        nexts = [[int(t) for t in rng.integers(0, len(vocab), 2 + i % 2)]
                 for _ in tokens[rid]]
        if i == 3:
            nexts[0][-1] = 99
        labels[rid] = nexts if i == 9 else nexts[0]  # as service.loop.labels normalises them
    retry = {**records[4], "time": records[4]["time"] + 1.0}  # the same inputs
    write_segment(root, "a", records, model="words")
    write_segment(root, "b", [retry], model="words")
    write_labels(root, [{"id": rid, "label": y,
                         "time": records[int(rid[1:])]["time"] + (8 * DAY if rid == "r70"
                                                                  else 60.0)}
                        for rid, y in labels.items() if int(rid[1:]) < 75], model="words")
    return root, repo, vocab, tokens, labels, records


def expected_words(vocab: list[str], ids) -> list[str]:
    """What the corpus must hold for token IDS: the vocabulary's word, '0' for the number
    token N (training reads a number as N), <unk> for an id outside the vocabulary."""
    return ["<unk>" if t >= len(vocab) else "0" if vocab[t] == "N" else vocab[t] for t in ids]


def test_a_language_models_captures_become_a_corpus_training_reads(word_captures, tmp_path):
    from orthornn.training.corpus import encode, file_documents, tokenize

    root, repo, vocab, tokens, labels, records = word_captures
    assert {"<unk>", "<eos>", "N"} <= set(vocab)
    out = tmp_path / "words.txt"
    summary = write_dataset(root, "words", out, repo=repo, progress=False)
    # the same join and counts as a classifier's: 81 read, r4 twice, r70 late, 5 unlabelled
    assert (summary.records, summary.labelled, summary.unlabelled, summary.late,
            summary.duplicates, summary.torn) == (81, 74, 5, 1, 1, 0)
    kept = [f"r{i}" for i in range(70)] + [f"r{i}" for i in range(71, 75)]
    held_ids = kept[-15:]  # the newest round(74 * 0.2) records
    held_path = holdout_path(out, "lm")
    assert held_path == tmp_path / "words-holdout.txt"
    assert (summary.train, summary.holdout) == (74 - 15 + 1, 15)  # r9: two sequences
    assert summary.task == "lm" and summary.classes == {}
    assert summary.unmapped == 1  # r3's id 99
    written = 0
    for path, ids in ((out, kept[:-15]), (held_path, held_ids)):
        side = orjson.loads((tmp_path / f"{path.name}.json").read_bytes())
        rows = [(rid, k) for rid in ids for k in range(len(tokens[rid]))]
        assert side["ids"] == [rid for rid, _ in rows]
        assert side["times"] == [records[int(rid[1:])]["time"] for rid, _ in rows]
        assert side["versions"] == [1] * len(rows) and side["model"] == "words"
        assert side["segments"] == sorted({f"words/1/{day_of(records[int(rid[1:])]['time'])}"
                                           f"/a-1.jsonl" for rid in ids})
        docs = path.read_text().split("\n\n")
        assert docs[-1] == "" and len(docs) - 1 == len(rows)
        read_back = file_documents(path)  # training's reader: one document a sequence
        assert len(read_back) == len(rows)
        for n, (rid, k) in enumerate(rows):
            nexts = labels[rid][k] if rid == "r9" else labels[rid]
            want = [*tokens[rid][k].tolist(), *nexts]  # r4's first capture, not the retry's
            assert side["tokens"][n] == want
            assert docs[n].split(" ") == expected_words(vocab, want)  # word by word
            (line,) = read_back[n]
            got = tokenize(line)
            assert got[-1] == "<eos>" and encode(got[:-1], vocab) == \
                [t if t < len(vocab) else 0 for t in want]  # every id back, 99 as <unk>
            written += len(want)
    assert summary.tokens == written
    assert max(orjson.loads((tmp_path / "words.txt.json").read_bytes())["times"]) < \
        min(orjson.loads((tmp_path / "words-holdout.txt.json").read_bytes())["times"])


def test_a_language_models_data_set_refusals_name_the_flag(word_captures):
    root, repo = word_captures[:2]
    with pytest.raises(ValueError, match=r"^--repo: the captures of 'words' are a language "
                                         r"model's \(token ids\)"):
        build(root, "words", progress=False)
    # 67 older records (r9: two sequences) and the newest 7
    with pytest.raises(ValueError, match=r"too few labelled sequences of 'words': 68 to "
                                         r"train on and 7 held out \(training needs at "
                                         r"least 12 sequences and 100 words in each; words "):
        build(root, "words", repo=repo, holdout_share=0.1, progress=False)
    record = captured_record("f0", T0, [np.ones((2, 3), np.float32)])
    write_segment(root, "c", [{**record, "model": "words"}], model="words")
    write_labels(root, [{"id": "f0", "label": 1, "time": T0 + 1}], model="words")
    with pytest.raises(ValueError, match=r"record 'f0' of model 'words' is not a language "
                                         r"model's \(token-id inputs \[T\]"):
        build(root, "words", repo=repo, progress=False)


def test_the_command_writes_a_language_models_corpus(word_captures, tmp_path):
    root, repo = word_captures[:2]
    out, held = tmp_path / "cap.txt", tmp_path / "cap-holdout.txt"
    r = orthornn_here("capture", "dataset", "--capture", root, "--name", "words", "--repo",
                      repo, "--out", out, "--no-progress", code=0)
    tokens = sum(len(line.split()) for path in (out, held) for line in
                 path.read_text().splitlines())
    assert r.stdout.splitlines() == [
        "words: records 81, labelled 74, unlabelled 5, late labels 1, duplicates 1",
        f"words: tokens {tokens}, not in the vocabulary 1 (written as <unk>)",
        "words: train 60 sequences, holdout 15",
        f"wrote {out} (60), {held} (15)"]
    r = orthornn_here("capture", "dataset", "--capture", root, "--name", "words", "--out",
                      out, "--no-progress", code=2)
    assert r.stderr.startswith("orthornn capture: error: --repo: the captures of 'words'")
