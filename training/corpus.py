"""Word-level language-modelling corpora, all offline.

The bundled corpus is real English that a package ships: the Wikipedia articles of
the shortened English Wikipedia dump in gensim's test data (106 articles, ~480k
words, wiki markup stripped with gensim's own ``filter_wiki``) and the Lee news
corpus beside it (~60k words). A user's plain-text file works too (``--corpus``).

Tokens: lowercased words (with inner apostrophes), numbers mapped to ``N`` as in the
Penn Treebank; each paragraph ends with ``<eos>``; the literal markers ``<unk>`` and
``<eos>`` in a file are those tokens (a corpus ``orthornn capture dataset`` wrote from token
ids). The vocabulary keeps the most frequent training words; everything else is ``<unk>``.
"""

from __future__ import annotations

import bz2
import re
from collections import Counter
from pathlib import Path

from orthornn.export.artifacts.vocabulary import EOS, UNK, corpus_words

BUNDLED = "gensim-wiki-news"


def tokenize(paragraph: str) -> list[str]:
    """A paragraph's words (export.artifacts.vocabulary.words, shared with the service;
    the markers <unk> and <eos> kept) and <eos>."""
    found = corpus_words(paragraph)
    return [*found, EOS] if found else []


def _gensim_test_data() -> Path:
    try:
        import gensim
    except ImportError:  # pragma: no cover - gensim is a training dependency
        raise ValueError("the bundled corpus needs gensim: pip install '.[train]' in a "
                         "checkout of orthornn") \
            from None
    return Path(gensim.__file__).parent / "test" / "test_data"


def bundled_documents() -> list[list[str]]:
    """The bundled corpus as documents, each a list of paragraphs."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    root = _gensim_test_data()
    dump = root / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    docs = []
    with bz2.open(dump) as f:
        for _title, text, _pageid in extract_pages(f):
            clean = filter_wiki(text).replace("'''", "").replace("''", "")
            paragraphs = [p for p in clean.split("\n") if len(p.split()) >= 5]
            if paragraphs:
                docs.append(paragraphs)
    news = (root / "lee_background.cor").read_text(encoding="utf-8", errors="replace")
    docs.extend([line] for line in news.splitlines() if line.strip())
    return docs


def file_documents(path: str | Path) -> list[list[str]]:
    """A user's text file: documents separated by blank lines, paragraphs by lines."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"corpus must be a readable text file; {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    docs = [[p for p in block.splitlines() if p.strip()] for block in re.split(r"\n\s*\n", text)]
    docs = [d for d in docs if d]
    if sum(len(tokenize(p)) for d in docs for p in d) < 100:
        raise ValueError(f"corpus {str(path)!r} holds fewer than 100 words")
    if len(docs) < 3:  # one document: split its paragraphs instead
        docs = [[p] for d in docs for p in d]
    return docs


def split_documents(docs: list[list[str]]) -> dict[str, list[str]]:
    """Fixed split by document: every 20th document to validation, the one after it to
    test, the rest (90%) to training. Returns token lists per split."""
    parts: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for i, doc in enumerate(docs):
        name = "val" if i % 20 == 10 else "test" if i % 20 == 11 else "train"
        for paragraph in doc:
            parts[name].extend(tokenize(paragraph))
    for name, tokens in parts.items():
        if len(tokens) < 2:
            raise ValueError(f"corpus too small: its {name} split has no text "
                             f"(give at least 12 documents or paragraphs)")
    return parts


def all_tokens(docs: list[list[str]]) -> list[str]:
    """Every paragraph's tokens, in order (a held-out corpus scored whole)."""
    return [t for doc in docs for paragraph in doc for t in tokenize(paragraph)]


def build_vocabulary(tokens: list[str], size: int) -> list[str]:
    """<unk>, <eos>, then the most frequent words (ties broken alphabetically)."""
    counts = Counter(t for t in tokens if t not in (UNK, EOS))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [UNK, EOS] + [w for w, _ in ranked[: max(0, size - 2)]]


def encode(tokens: list[str], vocabulary: list[str]) -> list[int]:
    index = {w: i for i, w in enumerate(vocabulary)}
    return [index.get(t, 0) for t in tokens]
