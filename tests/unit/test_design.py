"""docs/design.md's map of the code, kept true: every module it names exists, every module
of the tree is named, and its layer table is import-linter's service contract."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = (ROOT / "docs" / "design.md").read_text()
STAGES = ("models", "training", "export", "service", "orthornn")
#: the sizes a reader can hold at once (issue 60): a module, a function (nested ones and
#: a class built inside one counted with it)
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def _modules(stage: str) -> set[str]:
    """STAGE's modules, relative to the repository ("export/artifacts/gate.py")."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / stage).rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts
            and not (stage == "orthornn" and p.parent != ROOT / "orthornn")}


def _service_tree() -> set[str]:
    """The files of the ```text map of service/ (indentation gives the folders)."""
    block = DESIGN.split("```text\nservice/\n", 1)[1].split("```", 1)[0]
    files, folders = set(), {0: "service"}
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        first = line[indent:].split("  ")[0]  # the names, before the description
        names = re.findall(r"(?:^|(?<=\s))([a-z_]+(?:\.py|/))(?=\s|$)", first)
        parent = folders[max(k for k in folders if k < indent)] if indent else "service"
        for name in names:
            if name.endswith("/"):
                folders = {k: v for k, v in folders.items() if k < indent}
                folders[indent] = f"{parent}/{name[:-1]}"
            else:
                files.add(f"{parent}/{name}")
    return files


def test_the_service_map_lists_every_module_and_only_those():
    listed = _service_tree()
    actual = {m for m in _modules("service") if "/codecs/" not in m}  # codecs/: one row
    assert not listed - _modules("service"), f"named but absent: {sorted(listed - actual)}"
    assert not actual - listed, f"absent from the map: {sorted(actual - listed)}"
    codecs = {Path(m).stem for m in _modules("service") if "/codecs/" in m}
    row = next(line for line in DESIGN.splitlines() if line.strip().startswith("codecs/"))
    row += next(line for line in DESIGN.splitlines()[DESIGN.splitlines().index(row) + 1:])
    assert all(c in row for c in codecs), f"codecs/ row misses one of {sorted(codecs)}"


def test_every_module_of_the_other_stages_is_named_and_every_name_exists():
    modules_section = DESIGN.split("## Modules", 1)[1].split("## The service in layers")[0]
    named = set(re.findall(r"`([a-z_/]+\.py)", modules_section))
    for stage in ("models", "training", "export", "orthornn"):
        for module in sorted(_modules(stage)):
            name = Path(module).name
            assert name in modules_section or module in modules_section, \
                f"docs/design.md's Modules do not name {module}"
    every = {Path(m).name for s in STAGES for m in _modules(s)} | \
        {m for s in STAGES for m in _modules(s)}
    missing = {n for n in named if n.split(":")[0] not in every
               and not any(m.endswith(n) for s in STAGES for m in _modules(s))}
    assert not missing, f"docs/design.md names modules that do not exist: {sorted(missing)}"


def test_the_layer_table_is_import_linters_service_contract():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"]
                    if c.get("containers") == ["orthornn.service"] and c["type"] == "layers")
    layers = [[name.strip() for name in row.split("|")] for row in contract["layers"]]
    table = DESIGN.split("| layer | may import | may not |", 1)[1].split("\n\n", 1)[0]
    rows = [re.findall(r"`([a-z_]+)`", line.split("|")[1]) for line in table.splitlines()
            if line.startswith("| `")]
    assert [sorted(r) for r in rows] == [sorted(r) for r in layers], \
        "docs/design.md's layer table and pyproject.toml's layers differ"


def test_modules_and_functions_stay_small():
    too_long = []
    for stage in STAGES:
        for module in [*sorted(_modules(stage)), f"{stage}/__init__.py"]:
            path = ROOT / module
            if not path.is_file():
                continue
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                too_long.append(f"{module}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = node.end_lineno - node.lineno + 1
                    if size > MAX_FUNCTION_LINES:
                        too_long.append(f"{module}:{node.lineno} {node.name}: {size} lines")
    assert not too_long, (f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} "
                          f"a function: split them\n" + "\n".join(too_long))


def test_every_layers_contract_is_exhaustive():
    """A module added to a layered package without a layer fails make lint."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layered = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert layered and all(c.get("exhaustive") is True for c in layered), \
        [c["name"] for c in layered if not c.get("exhaustive")]
