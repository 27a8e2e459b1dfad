"""Language modelling on a corpus (the bundled one, or a user's text file)."""

from __future__ import annotations

import torch
from orthornn.models.validation import check_int

from .. import corpus as corpus_lib
from ..data import TokenStream
from .task import Task


def lm_task(corpus: str | None = None, vocab_size: int = 10000, bptt: int = 70,
        eval_columns: int = 10) -> Task:
    vocab_size = check_int("vocab_size", vocab_size, 3, 1_000_000)
    bptt = check_int("bptt", bptt, 1, 100_000)
    docs = corpus_lib.bundled_documents() if corpus is None else corpus_lib.file_documents(corpus)
    parts = corpus_lib.split_documents(docs)
    vocabulary = corpus_lib.build_vocabulary(parts["train"], vocab_size)

    def ids(name):
        return torch.tensor(corpus_lib.encode(parts[name], vocabulary), dtype=torch.long)
    columns = {name: min(eval_columns, max(1, (len(parts[name]) - 1) // 2)) for name in parts}
    return Task("lm", "lm", len(vocabulary), len(vocabulary), "perplexity",
                val=TokenStream(ids("val"), columns["val"], bptt),
                test=TokenStream(ids("test"), columns["test"], bptt),
                train=ids("train").tolist(), vocabulary=vocabulary, max_length=bptt,
                options={"corpus": corpus_lib.BUNDLED if corpus is None else str(corpus),
                         "vocab_size": vocab_size, "bptt": bptt})
