"""The loop for a language model: captures of version 1 labelled with their next tokens,
`orthornn capture dataset` writing them as text corpora, a retrain on the original corpus
plus the captured one (`--corpus` twice), and `orthornn export --gate --gate-data
HOLDOUT.txt` judging the candidate on the original test split and on the held-out captured
corpus.

The data: sentences in one word order in the original corpus; the captured traffic is the
same words in the reverse order (the shift). Every perplexity the gate compares is
recomputed here with onnxruntime and numpy on each version's own graph, over whole
sequences (no windows: the state the gate carries across its windows is the graph's own)."""

import base64
import datetime as dt
import json

import numpy as np
import onnxruntime as ort
import orjson
import pytest
from orthornn.export.artifacts.loop.dataset import write_dataset
from orthornn.export.builder.exporter import export_run
from orthornn.training.config import TrainConfig
from orthornn.training.trainer import train

from tests.helpers import orthornn_here as orthornn

ANIMALS = ["cat", "dog", "bird"]
T0 = 1_795_000_000.0  # 2026-11-18 (UTC)


def _sentence(i: int) -> list[str]:
    a, b, c = (ANIMALS[(i + k) % 3] for k in range(3))
    return ["the", a, "sat", "on", "the", b, "and", "the", c, "ran", "home"]


def _common(**kw) -> dict:
    return dict(arch="lstm", task="lm", vocab_size=20, bptt=8, hidden_size=16, batch_size=8,
                log_every=50, optimizer="adam", lr=0.02, **kw)


def _day(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d")


def _capture(root, vocab: list[str]) -> list[str]:
    """60 records of model m version 1, each a reversed sentence's first 5 token ids, and
    their labels: the sentence's other tokens. Returns the segment names."""
    segments, labels = set(), []
    for i in range(60):
        ids = [vocab.index(w) for w in reversed(_sentence(i))]
        t = T0 + i * 600.0
        tokens = np.array(ids[:5], np.int64)
        record = {"id": f"w{i}", "time": t, "route": "/predict", "model": "m", "version": 1,
                  "inputs": [{"dtype": tokens.dtype.str, "shape": [5],
                              "b64": base64.b64encode(tokens.tobytes()).decode()}],
                  "outputs": [{"log_likelihood": -4.0}], "session": None, "position": None,
                  "compute_ms": 0.1}
        folder = root / "m" / "1" / _day(t)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "a-1.jsonl", "ab") as f:
            f.write(orjson.dumps(record) + b"\n")
        segments.add(f"m/1/{_day(t)}/a-1.jsonl")
        labels.append({"id": f"w{i}", "label": ids[5:], "time": t + 5.0, "source": "api"})
    folder = root / "m" / "labels" / _day(T0)
    folder.mkdir(parents=True)
    (folder / "r-1.jsonl").write_bytes(b"".join(orjson.dumps(v) + b"\n" for v in labels))
    return sorted(segments)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """v1 (original corpus) published in repo; its captures made a data set; runs:
    original (v1's), captured (original + captured corpus), cow (another vocabulary)."""
    root = tmp_path_factory.mktemp("gate-data-lm")
    original = root / "original.txt"
    original.write_text("\n\n".join(" ".join(_sentence(i)) for i in range(40)) + "\n")
    train(TrainConfig(corpus=str(original), steps=150, out=str(root / "original"),
                      **_common()), progress=False)
    repo = root / "repo"
    export_run(root / "original", repo, "m")
    vocab = (repo / "m" / "1" / "vocab.txt").read_text().splitlines()
    segments = _capture(root / "cap", vocab)
    summary = write_dataset(root / "cap", "m", root / "captured.txt", repo=repo,
                            progress=False)
    assert (summary.train, summary.holdout, summary.unmapped) == (48, 12, 0)
    train(TrainConfig(corpus=[str(original), str(root / "captured.txt")], steps=150,
                      out=str(root / "captured"), **_common()), progress=False)
    cow = root / "cow.txt"
    cow.write_text(original.read_text().replace("cat", "cow"))
    train(TrainConfig(corpus=str(cow), steps=4, out=str(root / "cow"), **_common()),
          progress=False)
    return root, segments


def _tokens(path, vocab: list[str], documents=None) -> np.ndarray:
    """The token ids of a corpus file, each document's words and its <eos>, by VOCAB (the
    corpus holds plain lowercase words here); DOCUMENTS: only those indices."""
    docs = [d for d in path.read_text().split("\n\n") if d.strip()]
    chosen = range(len(docs)) if documents is None else documents
    return np.array([vocab.index(w) for i in chosen for w in [*docs[i].split(), "<eos>"]])


def _columns(n: int) -> tuple[int, int]:
    """The gate's parallel streams of N tokens: min(10, (N - 1) // 2) of them, and their
    length (the last few tokens that do not fill a column are left out)."""
    columns = min(10, max(1, (n - 1) // 2))
    return columns, (n - 1) // columns


def _streamed(n: int) -> int:
    """The tokens the streams of N tokens hold (what the evaluation counts as examples)."""
    columns, length = _columns(n)
    return columns * length + 1


def _perplexity(package, ids: np.ndarray) -> float:
    """exp(mean NLL) of the package's model.onnx over IDS cut into the gate's parallel
    streams, each run whole from a zero state."""
    columns, length = _columns(len(ids))
    x = ids[: columns * length].reshape(columns, length)
    y = ids[1: columns * length + 1].reshape(columns, length)
    sess = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    (logits,) = sess.run(["logits"], {"tokens": x.astype(np.int64),
                                      "lengths": np.full(columns, length, np.int64)})
    logits = logits.astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    nll = -np.take_along_axis(logp, y[..., None], -1)
    return float(np.exp(nll.mean()))


def test_the_retrain_on_captures_passes_both_splits(loop, tmp_path):
    root, segments = loop
    repo = tmp_path / "repo"
    v1 = export_run(root / "original", repo, "m")
    v2 = export_run(root / "captured", repo, "m", gated=True, tolerance=1.0,
                    gate_data=root / "captured-holdout.txt", require_better=True)
    vocab = (v2 / "vocab.txt").read_text().splitlines()
    assert vocab == (v1 / "vocab.txt").read_text().splitlines()  # the first corpus's
    held = _tokens(root / "captured-holdout.txt", vocab)
    test = _tokens(root / "original.txt", vocab, documents=[11, 31])  # i % 20 == 11
    manifest = json.loads((v2 / "manifest.json").read_text())
    evaluation = manifest["evaluation"]
    assert evaluation["metric"] == "perplexity" and not evaluation["higher_is_better"]
    # the headline value: the ORIGINAL corpus's test split, not the combined one
    assert evaluation["value"] == pytest.approx(_perplexity(v2, test), rel=1e-4)
    assert evaluation["examples"] == _streamed(len(test))
    splits = evaluation["splits"]
    assert splits["gate_data"]["value"] == pytest.approx(_perplexity(v2, held), rel=1e-4)
    assert len(held) == 12 * 12 and splits["gate_data"]["examples"] == _streamed(len(held))
    outcome = evaluation["gate"]["gate_data"]
    assert outcome["incumbent"] == pytest.approx(_perplexity(v1, held), rel=1e-4)
    assert outcome["incumbent"] - outcome["candidate"] >= 0.02  # lower is better
    assert outcome["candidate"] < 0.5 * outcome["incumbent"]  # v1 never saw the shift
    # lineage: the captured corpus's segments and sequences (from its sidecar)
    assert manifest["lineage"]["captures"] == {"segments": segments, "labels": 48}


def test_a_candidate_worse_on_the_captured_slice_is_refused(loop, tmp_path):
    """The captures' retrain promoted; the original-only run is worse on the held-out
    captured corpus by far more than --tolerance 2 (and within it on the original split)."""
    root, _ = loop
    repo = tmp_path / "repo"
    incumbent = export_run(root / "captured", repo, "m")
    held_path = root / "captured-holdout.txt"
    line = orthornn("export", root / "original", "--repo", repo, "--name", "m", "--gate",
                    "--tolerance", "2", "--gate-data", held_path, "--no-progress",
                    code=3).stderr.strip()
    (kept,) = (repo / "m" / "rejected").iterdir()
    held = _tokens(held_path, (kept / "vocab.txt").read_text().splitlines())
    candidate, promoted = _perplexity(kept, held), _perplexity(incumbent, held)
    assert candidate > promoted + 2
    assert (f"on the held-out captured slice (--gate-data {held_path}): candidate's "
            f"perplexity {candidate:.6g} is worse than promoted version 1's {promoted:.6g} "
            f"by more than --tolerance 2 on the same data") in line
    # better, but not by the margin asked for
    repo2 = tmp_path / "repo2"
    export_run(root / "original", repo2, "m")
    line = orthornn("export", root / "captured", "--repo", repo2, "--name", "m", "--gate",
                    "--tolerance", "2", "--gate-data", held_path,
                    "--require-better-on-gate-data", "--gate-margin", "1000", "--no-progress",
                    code=3).stderr
    assert "is not better than promoted version 1's" in line
    assert "by at least --gate-margin 1000" in line


def test_lm_gate_data_bad_input_is_one_line(loop, tmp_path):
    root, _ = loop
    repo = tmp_path / "repo"
    export_run(root / "original", repo, "m")
    npz = tmp_path / "held.npz"
    np.savez(npz, x=np.zeros((20, 5, 3), np.float32), y=np.zeros(20, np.int64))
    cases = [(npz, "an lm run takes a held-out text corpus (orthornn capture dataset on a "
                   "language model's captures), not an .npz"),
             (tmp_path / "nope.txt", f"--gate-data {str(tmp_path / 'nope.txt')!r}: corpus "
                                     f"must be a readable text file")]
    for path, message in cases:
        err = orthornn("export", root / "captured", "--repo", repo, "--name", "m", "--gate",
                       "--gate-data", path, "--no-progress", code=2).stderr
        assert message in err and len(err.strip().splitlines()) == 1, err
    # a promoted version whose token ids name other words cannot be compared with
    other = tmp_path / "other"
    export_run(root / "cow", other, "m")
    err = orthornn("export", root / "captured", "--repo", other, "--name", "m", "--gate",
                   "--gate-data", root / "captured-holdout.txt", "--no-progress",
                   code=2).stderr
    assert "cannot compare with promoted version 1" in err and "vocabulary differs" in err
