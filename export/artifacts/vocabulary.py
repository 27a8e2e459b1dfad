"""The word tokenizer of language-model packages, torch-free: training builds the
vocabulary with it and the service tokenises request text with it, so the two can
never drift apart. Lowercased words (with inner apostrophes); numbers map to "N" as in
the Penn Treebank."""

from __future__ import annotations

import re

UNK, EOS = "<unk>", "<eos>"
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?|\d+(?:[.,]\d+)*")


def words(text: str) -> list[str]:
    return ["N" if w[0].isdigit() else w for w in _WORD.findall(text.lower())]
