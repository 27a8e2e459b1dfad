"""Training a language model on several corpora (`orthornn train --task lm --corpus
ORIGINAL --corpus CAPTURED`): each file split on its own by document and the splits
concatenated, the vocabulary the first file's, the package's evaluation the first file's
test split; and the corpus markers `<unk>` and `<eos>` that `orthornn capture dataset`
writes. Every expected token list is rebuilt here from the files' words, by the documented
rules."""

import json
from collections import Counter

import pytest
from orthornn.export.artifacts.vocabulary import corpus_words, word_text, words
from orthornn.export.builder.evaluation import original
from orthornn.training import checkpoint
from orthornn.training.config import TrainConfig
from orthornn.training.corpus import tokenize
from orthornn.training.tasks import make_task
from orthornn.training.trainer import train

from tests.helpers import orthornn_here as orthornn

ORIGINAL = [f"the cat sat on the mat {i} and the dog ran home" for i in range(40)]
CAPTURED = [f"a bird flew over the dog and the cat {'sat' if i % 2 else 'ran'} away"
            for i in range(24)]


def _write(path, documents):
    path.write_text("\n\n".join(documents) + "\n")
    return str(path)


def _splits(documents):
    """(train, val, test) tokens of one file by the documented rule: document i goes to
    validation when i % 20 == 10, to test when i % 20 == 11, else to training; each one's
    words (a number reads as N) and its closing <eos>."""
    parts: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for i, doc in enumerate(documents):
        part = 1 if i % 20 == 10 else 2 if i % 20 == 11 else 0
        parts[part] += ["N" if w.isdigit() else w for w in doc.split()] + ["<eos>"]
    return parts[0], parts[1], parts[2]


@pytest.fixture
def corpora(tmp_path):
    return _write(tmp_path / "original.txt", ORIGINAL), _write(tmp_path / "cap.txt", CAPTURED)


def test_corpus_twice_concatenates_the_splits_with_the_first_files_vocabulary(corpora):
    first, second = corpora
    task = make_task("lm", corpus=[first, second], vocab_size=30, bptt=5)
    alone = make_task("lm", corpus=first, vocab_size=30, bptt=5)
    a, b = _splits(ORIGINAL), _splits(CAPTURED)
    counts = Counter(t for t in a[0] if t != "<eos>")
    ranked = sorted(counts, key=lambda w: (-counts[w], w))  # the first file's training words
    assert task.vocabulary == alone.vocabulary == ["<unk>", "<eos>", *ranked]
    assert "bird" not in task.vocabulary  # a captured word the original never had

    def ids(tokens):
        return [task.vocabulary.index(t) if t in task.vocabulary else 0 for t in tokens]
    assert task.train == ids(a[0]) + ids(b[0])
    assert task.val.tokens.tolist() == ids(a[1]) + ids(b[1])
    assert task.test.tokens.tolist() == ids(a[2]) + ids(b[2])
    assert task.train_parts == [len(a[0]), len(b[0])]
    assert task.test_parts == [len(a[2]), len(b[2])]
    assert task.options == {"corpus": [first, second], "vocab_size": 30, "bptt": 5}
    # the package's evaluation: the first file's test split, cut as a run on it alone cuts it
    head = original(task).test
    assert head.data.tolist() == alone.test.data.tolist()
    assert head.inputs.shape == alone.test.inputs.shape and head.bptt == alone.test.bptt
    # one file: as before (no parts; the option stays a path)
    assert alone.test_parts is None and alone.options["corpus"] == first


def test_the_markers_read_back_as_tokens_and_every_word_has_a_text():
    assert corpus_words("the <unk> cat<eos> 12 sat") == ["the", "<unk>", "cat", "<eos>", "N",
                                                         "sat"]
    assert tokenize("a <eos> <unk>") == ["a", "<eos>", "<unk>", "<eos>"]
    assert tokenize("Don't STOP: 3.14") == [*words("Don't STOP: 3.14"), "<eos>"]  # as before
    for word in ["<unk>", "<eos>", "N", "cat", "don't"]:
        assert corpus_words(word_text(word)) == [word]
    assert word_text("Cat") is None and word_text("two words") is None


def test_the_command_line_takes_corpus_twice_and_refuses_a_bad_list(corpora, tmp_path):
    import argparse

    from orthornn.training.cli import add_train_parser, resolve_args

    first, second = corpora
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers())
    one = parser.parse_args(["train", "--task", "lm", "--corpus", first, "--out", "x"])
    two = parser.parse_args(["train", "--task", "lm", "--corpus", first, "--corpus", second,
                             "--out", "x"])
    assert resolve_args(one)[0].corpus == first
    assert resolve_args(two)[0].corpus == [first, second]
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"corpus": []}))
    bad = orthornn("train", "--arch", "lstm", "--task", "lm", "--config", config, "--out",
                   tmp_path / "r", code=2).stderr
    assert "corpus must be a path or a list of 1 to 16 paths (--corpus FILE, repeated)" in bad
    short = _write(tmp_path / "short.txt", [" ".join(["word"] * 30)] * 5)  # 5 documents
    bad = orthornn("train", "--arch", "lstm", "--task", "lm", "--corpus", first, "--corpus",
                   short, "--out", tmp_path / "r2", code=2).stderr
    assert f"corpus {short!r}: corpus too small: its val split has no text" in bad


def test_an_lm_trains_an_epoch_on_original_plus_captured(corpora, tmp_path):
    first, second = corpora
    run = tmp_path / "run"
    summary = train(TrainConfig(arch="lstm", task="lm", corpus=[first, second], vocab_size=30,
                                bptt=5, hidden_size=8, epochs=1, batch_size=4, log_every=5,
                                optimizer="adam", lr=0.02, out=str(run)), progress=False)
    config = checkpoint.read_run_config(run)
    assert config["train"]["corpus"] == [first, second]
    assert checkpoint.read_vocabulary(run, config) == \
        make_task("lm", corpus=first, vocab_size=30, bptt=5).vocabulary
    a, b = _splits(ORIGINAL), _splits(CAPTURED)
    # one epoch: the concatenated training stream cut into batch-size columns of bptt windows
    per_epoch = -(-((len(a[0]) + len(b[0]) - 1) // 4) // 5)
    assert summary["steps"] == per_epoch
    assert summary["test"]["perplexity"] > 0
