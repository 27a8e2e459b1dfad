"""The user-facing pages (README.md and docs/*.md, listed in `DOCS`) and the example
commands they show with their answers: a `curl` command (lines joined at a trailing
backslash) directly followed by `# ...` comment lines is an example; the comment is its
answer. A JSON answer must match the real one as a subset (every key shown is there with
an equal value; lists have the shown length); a number must agree to the digits shown
(``Shown``: 0.82 is 0.815-0.825, 370 is 369.5-370.5, each MARGIN inside); a text
answer must appear in the output (case-insensitive). Exact checks hold on any CPU
because the quickstart's models are trained in float64 (docs/training.md, "Across CPUs":
answers within 2e-7 under every numerics setting measured)."""

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
        return json.loads(self.answer, parse_float=Shown) if self.answer[:1] in "{[" \
            else self.answer


class Shown(float):
    """A number as an answer shows it: its value and how many decimals it was shown with
    (json's parse_float hook hands over the text)."""

    decimals: int

    def __new__(cls, text: str):
        shown = super().__new__(cls, text)
        mantissa, _, exponent = text.lower().partition("e")
        decimals = len(mantissa.partition(".")[2]) - int(exponent or 0)
        shown.decimals = decimals
        return shown


#: how far inside its rounding interval an answer must be, relative to the number: over
#: 200 times what varied between CPUs' kernels (2e-7 on the word model's probabilities
#: below 1 over the 12 settings of bench/experiments/numerics.py), so that a number shown
#: never sits where another CPU could round it the other way
MARGIN = 1e-4


def agrees(shown: float | int, actual: float | int) -> bool:
    """Whether ACTUAL rounds to SHOWN at the digits shown (an integer shown for a float
    answer is shown to the unit), at least MARGIN inside the rounding interval."""
    if isinstance(shown, float) and not isinstance(shown, Shown):
        shown = Shown(repr(shown))  # a float written in Python: its shortest repr
    decimals = shown.decimals if isinstance(shown, Shown) else 0
    return abs(actual - shown) <= 0.5 * 10.0 ** -decimals - MARGIN * abs(shown) - 1e-12


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


def mismatch(expected, actual, where: str = "answer") -> str | None:
    """None when ``actual`` matches ``expected`` as described above, else why not."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return f"{where}: expected an object, got {actual!r}"
        for key, value in expected.items():
            if key not in actual:
                return f"{where}.{key}: missing"
            problem = mismatch(value, actual[key], f"{where}.{key}")
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
        if isinstance(actual, bool) or not isinstance(actual, int | float) \
                or not agrees(expected, actual):
            return f"{where}: expected {expected} to the digits shown, got {actual!r}"
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
    return mismatch(expected, actual)
