"""The word tokenizer of language-model packages, torch-free: training builds the
vocabulary with it and the service tokenises request text with it, so the two can
never drift apart. Lowercased words (with inner apostrophes); numbers map to "N" as in
the Penn Treebank.

A corpus file (``orthornn train --task lm --corpus``) may also hold the literal markers
``<unk>`` and ``<eos>``: they read as those tokens (``corpus_words``), which is how a
corpus written from token ids (``orthornn capture dataset``, ``word_text``) keeps them.
Request text is tokenized by ``words`` alone."""

from __future__ import annotations

import re
from pathlib import Path

UNK, EOS = "<unk>", "<eos>"
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*")
_MARKER = re.compile(f"({re.escape(UNK)}|{re.escape(EOS)})")
NUMBER = "N"


def words(text: str) -> list[str]:
    return [NUMBER if w[0].isdigit() else w for w in _WORD.findall(text.lower())]


def corpus_words(text: str) -> list[str]:
    """A corpus line's tokens: ``words``, with the markers ``<unk>`` and ``<eos>`` kept as
    those tokens."""
    found: list[str] = []
    for i, part in enumerate(_MARKER.split(text)):  # odd parts: the markers themselves
        found.extend([part] if i % 2 else words(part))
    return found


def word_text(word: str) -> str | None:
    """The text ``corpus_words`` reads back as the one token WORD: the word itself, its
    marker (``<unk>``, ``<eos>``), a number for ``N``; None when no text does."""
    if word in (UNK, EOS):
        return word
    if word == NUMBER:
        return "0"
    return word if words(word) == [word] else None


def sidecar(corpus: str | Path) -> Path:
    """Where a corpus written from captures keeps its provenance: FILE.json beside FILE
    (``orthornn capture dataset`` writes it, training reads its segments for the lineage)."""
    corpus = Path(corpus)
    return corpus.with_name(corpus.name + ".json")
