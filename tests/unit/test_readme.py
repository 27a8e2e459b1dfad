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
    assert mismatch({"a": [1, 0.5]}, {"a": [1, 0.54], "b": 2}) is None
    assert mismatch({"a": [1, 0.5]}, {"a": [1, 0.7]}) is not None
    assert mismatch({"a": "x"}, {"b": "x"}) is not None


def test_numbers_agree_to_the_digits_shown():
    """A number shown with k decimals holds for what rounds to it, away from the rounding
    boundary; a sampled text, ids and tokens are exact (the quickstart's models are the
    same on every CPU)."""
    from ..readme_examples import Example, check

    shown = Example("curl ...", '{"p": 0.82, "ppl": 370, "q": 1.5e-3, "n": 3, '
                    '"tokens": ["a", "b"], "text": "a b"}')
    good = {"p": 0.8248, "ppl": 369.6, "q": 0.00154, "n": 3, "tokens": ["a", "b"],
            "text": "a b"}
    assert check(shown, json.dumps(good)) is None
    assert check(shown, json.dumps({**good, "p": 0.8152, "ppl": 370.45})) is None
    # at a rounding boundary (within MARGIN of it) counts as not shown stably
    for change in ({"p": 0.826}, {"p": 0.81}, {"p": 0.82495}, {"ppl": 370.6}, {"ppl": 368},
                   {"ppl": 370.4999}, {"q": 0.0016},
                   {"n": 3.6}, {"n": 4}, {"p": True}, {"p": "0.82"}, {"tokens": ["a", "c"]},
                   {"tokens": ["a"]}, {"text": "a c"}):
        problem = check(shown, json.dumps({**good, **change}))
        assert problem is not None, change
    assert "to the digits shown" in check(shown, json.dumps({**good, "p": 0.9}))


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
