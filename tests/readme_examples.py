"""The user-facing pages (README.md and docs/*.md, listed in `DOCS`) and the example
commands they show with their answers: a `curl` command (lines joined at a trailing
backslash) directly followed by `# ...` comment lines is an example; the comment is its
answer. A JSON answer must match the real one as a subset (every key shown is there with
an equal value; lists have the shown length; numbers agree within ``TOLERANCE``); a text
answer must appear in the output (case-insensitive). A sampled ``/generate`` answer's
words (``SAMPLED``) vary with the CPU that trained the model (docs/training.md, "Across
CPUs"): only their form is checked (as many ids and tokens as shown; the text a string),
and tests/integration/test_end_to_end.py checks that they are the model's words and the
same twice."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# every user-facing page: the README and the documentation site's pages (mkdocs.yml)
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def pages() -> list[tuple[Path, str]]:
    """(path, text) of every user-facing page, README first."""
    return [(path, path.read_text()) for path in DOCS]


def code_blocks(language: str) -> list[tuple[Path, str]]:
    """(path, body) of every ```language block of every user-facing page."""
    return [(path, block) for path, text in pages()
            for block in re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)]


@dataclass
class Example:
    command: str
    answer: str

    def expected(self):
        return json.loads(self.answer) if self.answer[:1] in "{[" else self.answer


def examples(text: str | None = None) -> list[Example]:
    """The examples of ``text``, or of every user-facing page (an example shown on two
    pages, as the quickstart's on the README and docs/index.md, counts once)."""
    if text is None:
        blocks = [block for _, block in code_blocks("sh")]
    else:
        blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
    found = []
    for block in blocks:
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("curl "):
                i += 1
                continue
            command = [lines[i]]
            while (command[-1].endswith("\\") or "".join(command).count("'") % 2) \
                    and i + 1 < len(lines):  # a continued line or an open quote
                i += 1
                command.append(lines[i])
            i += 1
            answer = []
            while i < len(lines) and lines[i].startswith("#"):
                answer.append(lines[i][1:].strip())
                i += 1
            example = Example("\n".join(command), " ".join(answer))
            if answer and example not in found:
                found.append(example)
    return found


#: numbers agree within ABS + REL x |shown|. The word model's shown probabilities and
#: perplexity spread up to 8.6% (beyond 0.02) around the shown value over the 12 numerics
#: settings of bench/experiments/numerics.py (7 different trained weights; docs/training.md, "Across
#: CPUs"); 15% leaves room for CPUs not measured, and a wrong model, tokenizer or softmax
#: still moves them far more (after 3 training steps the likeliest word has 0.001)
TOLERANCE = (0.02, 0.15)

#: the fields of a sampled /generate answer (one with a finish_reason) checked by form only
SAMPLED = ("text", "ids", "tokens")


def mismatch(expected, actual, where: str = "answer", varies: tuple[str, ...] = ()
             ) -> str | None:
    """None when ``actual`` matches ``expected`` as described above, else why not. Keys in
    ``varies`` (at any depth) need only the shown form: a list of as many items, a
    string."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where}: expected an object, got {actual!r}"
        for key, value in expected.items():
            if key not in actual:
                return f"{where}.{key}: missing"
            if key in varies:  # a list of the shown length; a string, any string
                if isinstance(value, list) and (not isinstance(actual[key], list)
                                                or len(actual[key]) != len(value)):
                    return f"{where}.{key}: expected {len(value)} items (their values " \
                           f"vary), got {actual[key]!r}"
                if isinstance(value, str) and not isinstance(actual[key], str):
                    return f"{where}.{key}: expected a string, got {actual[key]!r}"
                continue
            problem = mismatch(value, actual[key], f"{where}.{key}", varies)
            if problem:
                return problem
        return None
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return f"{where}: expected {len(expected)} items, got {actual!r}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            problem = mismatch(e, a, f"{where}[{i}]")
            if problem:
                return problem
        return None
    if isinstance(expected, float) or (isinstance(actual, float) and
                                       isinstance(expected, int | float)):
        if not isinstance(actual, int | float) or abs(actual - expected) > \
                TOLERANCE[0] + TOLERANCE[1] * abs(expected):
            return f"{where}: expected about {expected}, got {actual!r}"
        return None
    if expected != actual:
        return f"{where}: expected {expected!r}, got {actual!r}"
    return None


def check(example: Example, output: str) -> str | None:
    expected = example.expected()
    if isinstance(expected, str):
        return None if expected.lower() in output.lower() else \
            f"{expected!r} not in the output {output[:500]!r}"
    try:
        actual = json.loads(output)
    except ValueError:
        return f"not JSON: {output[:500]!r}"
    sampled = isinstance(expected, dict) and "finish_reason" in expected
    return mismatch(expected, actual, varies=SAMPLED if sampled else ())
