"""The README's Python example runs as written."""

import re
from pathlib import Path


def test_readme_python_example_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_examples_show_parseable_answers():
    """Every answer the README shows after a curl parses (the end-to-end test runs them
    against the quickstart's models)."""
    from .readme_examples import examples, mismatch

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
    assert mismatch({"a": [1, 0.5]}, {"a": [1, 0.6]}) is not None
    assert mismatch({"a": "x"}, {"b": "x"}) is not None
