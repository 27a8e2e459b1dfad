"""The user-facing pages (README.md and docs/*.md): their Python examples run as written,
their curl answers parse, and they stand alone in a clone."""

import json
import re

from ..readme_examples import DOCS, README, ROOT, code_blocks, pages


def test_readme_python_example_runs():
    blocks = code_blocks("python")
    assert blocks
    for path, block in blocks:
        exec(compile(block, str(path.relative_to(ROOT)), "exec"), {})


def test_readme_examples_show_parseable_answers():
    """Every answer the README and the docs show after a curl parses (the end-to-end test
    runs them against the quickstart's models)."""
    from ..readme_examples import examples, mismatch

    found = examples()
    assert len(found) >= 6
    models = set()
    for example in found:
        expected = example.expected()
        if isinstance(expected, dict):
            models.add(expected.get("model") or expected.get("model_name") or
                       expected.get("name"))
            assert mismatch(expected, expected) is None
    assert models == {"words", "digits"}  # the quickstart's models only
    assert mismatch({"a": [1, 0.5]}, {"a": [1, 0.51], "b": 2}) is None
    assert mismatch({"a": [1, 0.5]}, {"a": [1, 0.7]}) is not None
    assert mismatch({"a": "x"}, {"b": "x"}) is not None


def test_a_sampled_answer_is_checked_by_its_form():
    """A /generate answer's words vary with the CPU that trained the model: other tokens,
    as many as shown, pass; fewer tokens, another finish reason, other prompt ids or a text
    that is not a string fail. Every other answer keeps its exact checks."""
    from ..readme_examples import Example, check

    shown = Example("curl ... /generate", '{"prompt_ids": [2, 82], "text": "a b c", '
                    '"tokens": ["a", "b", "c"], "ids": [1, 2, 3], "finish_reason": "length"}')
    good = {"prompt_ids": [2, 82], "text": "x y z", "tokens": ["x", "y", "z"],
            "ids": [5, 6, 7], "finish_reason": "length"}
    assert check(shown, json.dumps(good)) is None
    assert check(shown, json.dumps({**good, "text": "x y"})) is None  # <eos> is not shown
    for change in ({"tokens": ["x"]}, {"ids": [5, 6]}, {"finish_reason": "eos"},
                   {"prompt_ids": [2, 83]}, {"text": 3}):
        assert check(shown, json.dumps({**good, **change})) is not None, change
    predict = Example("curl ... /predict", '{"outputs": [{"text": "a b"}]}')
    assert check(predict, '{"outputs": [{"text": "x y"}]}') is not None  # not sampled


def test_user_facing_pages_stand_alone():
    """Nothing outside a clone is named (../shared/, beside the checkout, is not in one:
    no shared/ path at all), and the README stays a short quickstart; the rest is in docs/."""
    assert README in DOCS and len(DOCS) > 1
    named = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
             for path, text in pages()
             for number, line in enumerate(text.splitlines(), 1) if "shared/" in line]
    assert not named, "a user-facing page names shared/:\n" + "\n".join(named)
    assert len(README.read_text().splitlines()) <= 220


def test_every_docs_page_is_in_the_site_nav():
    """mkdocs.yml lists every docs/*.md page (mkdocs build --strict checks the links)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, flags=re.M))
    assert listed == {path.name for path in DOCS if path != README}
