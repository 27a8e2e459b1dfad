"""Language modelling on a corpus: the bundled one, a user's text file, or several files
(``--corpus ORIGINAL --corpus CAPTURED``, the second as ``orthornn capture dataset`` writes
it). Several files are each split on their own (``corpus.split_documents``) and their
splits concatenated, the first file's first; the vocabulary is the first file's (its
training split's most frequent words), so a retrain on the original corpus plus captured
text keeps the token ids of the version trained on the original alone, which the gate
compares it with. ``test_parts`` says how many test tokens each file gave: the package's
evaluation is the first file's test split (``export.builder.evaluation.original``)."""

from __future__ import annotations

from pathlib import Path

import torch
from orthornn.models.validation import check_int

from .. import corpus as corpus_lib
from ..data import TokenStream
from .task import Task

#: parallel streams an evaluation split is cut into (fewer for a short text)
EVAL_COLUMNS = 10


def corpus_files(corpus: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """The corpus option as a list of paths (none: the bundled corpus)."""
    if corpus is None:
        return []
    return [str(corpus)] if isinstance(corpus, str | Path) else [str(p) for p in corpus]


def token_stream(ids: list[int] | torch.Tensor, bptt: int,
                 columns: int = EVAL_COLUMNS) -> TokenStream:
    """An evaluation split's stream: at most COLUMNS parallel streams, each at least two
    tokens long, the state carried across its windows."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return TokenStream(ids, min(columns, max(1, (ids.numel() - 1) // 2)), bptt)


def _split(path: str, named: bool) -> dict[str, list[str]]:
    """One file's train, validation and test tokens (its name in the error when there are
    several)."""
    try:
        return corpus_lib.split_documents(corpus_lib.file_documents(path))
    except ValueError as error:
        if named and repr(path) not in str(error):
            raise ValueError(f"corpus {path!r}: {error}") from None
        raise


def lm_task(corpus: str | list[str] | None = None, vocab_size: int = 10000, bptt: int = 70,
            eval_columns: int = EVAL_COLUMNS) -> Task:
    vocab_size = check_int("vocab_size", vocab_size, 3, 1_000_000)
    bptt = check_int("bptt", bptt, 1, 100_000)
    paths = corpus_files(corpus)
    parts = [_split(p, len(paths) > 1) for p in paths] \
        or [corpus_lib.split_documents(corpus_lib.bundled_documents())]
    vocabulary = corpus_lib.build_vocabulary(parts[0]["train"], vocab_size)

    def ids(name: str) -> list[int]:
        return [i for part in parts for i in corpus_lib.encode(part[name], vocabulary)]
    task = Task("lm", "lm", len(vocabulary), len(vocabulary), "perplexity",
                val=token_stream(ids("val"), bptt, eval_columns),
                test=token_stream(ids("test"), bptt, eval_columns),
                train=ids("train"), vocabulary=vocabulary, max_length=bptt,
                options={"corpus": corpus_lib.BUNDLED if corpus is None
                         else str(corpus) if isinstance(corpus, str | Path) else paths,
                         "vocab_size": vocab_size, "bptt": bptt})
    if len(parts) > 1:
        task.train_parts = [len(p["train"]) for p in parts]
        task.test_parts = [len(p["test"]) for p in parts]
    return task


def held_out(task: Task, path: str | Path) -> TokenStream:
    """A held-out corpus file (``orthornn capture dataset``'s newest labelled slice) as an
    evaluation stream of TASK: all of its documents, in order, by the run's vocabulary."""
    assert task.vocabulary is not None
    tokens = corpus_lib.all_tokens(corpus_lib.file_documents(path))
    return token_stream(corpus_lib.encode(tokens, task.vocabulary), task.max_length)
