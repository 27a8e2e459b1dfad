"""docs/design.md's map of the code, kept true: every module it names exists and is named
in its folder's entry, its layer table is import-linter's service contract, and its claims
about imports are what the modules import."""

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
    modules_section = DESIGN.split("\n## Modules", 1)[1].split("\n## ", 1)[0]
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


def _imports(path: Path) -> set[str]:
    """Every module PATH imports, at its top or inside a function, relative ones resolved
    ("orthornn.export.artifacts.package" for `from ..package import` in loop/)."""
    package = ["orthornn", *path.relative_to(ROOT).parent.parts]
    if path.parent == ROOT / "orthornn":
        package = ["orthornn"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            found.add(".".join([*base, *([node.module] if node.module else [])]))
    return found


def test_the_import_table_is_what_each_stage_imports():
    """The table under "Packages and imports": each stage imports of the others exactly
    the modules its row names (each named one is imported somewhere, nothing else is),
    and the service never torch."""
    table = DESIGN.split("| package | imports of the other stages | why |", 1)[1]
    rows = {}
    for line in table.split("\n\n", 1)[0].splitlines()[2:]:
        package, names = (cell.strip() for cell in line.split("|")[1:3])
        stage = package.strip("`").split(".")[1] if "." in package else None
        if stage in STAGES:
            rows[stage] = {f"orthornn.{n}" for n in re.findall(r"`([a-z_.]+)`", names)
                           if not n.endswith(".py")}  # a module named as a place
    assert set(rows) == set(STAGES) - {"orthornn"}, sorted(rows)
    for stage, named in rows.items():
        used: dict[str, set[str]] = {}
        for module in _modules(stage) | {f"{stage}/__init__.py"}:
            for name in _imports(ROOT / module):
                # another stage, or the command package (orthornn.cli, ...), which none imports
                if name.startswith("orthornn.") and name.split(".")[1] != stage:
                    used.setdefault(name, set()).add(module)
                assert not (stage == "service" and name.split(".")[0] == "torch"), module
        outside = {n: sorted(m) for n, m in used.items()
                   if not any(n == p or n.startswith(p + ".") for p in named)}
        assert not outside, f"{stage} imports what its row does not name: {outside}"
        unused = {p for p in named if not any(n == p or n.startswith(p + ".") for n in used)}
        assert not unused, f"{stage}'s row names imports no module makes: {sorted(unused)}"


def test_the_offline_loops_third_party_imports_are_the_ones_named():
    claim = DESIGN.split("third-party imports:", 1)[1].split(";", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", claim))
    stdlib = set(__import__("sys").stdlib_module_names) | {"__future__"}
    used = {name.split(".")[0] for m in _modules("export") if m.startswith("export/artifacts/loop/")
            for name in _imports(ROOT / m)} - stdlib - {"orthornn"}
    assert used == named, f"the loop imports {sorted(used)}; docs/design.md names {sorted(named)}"


def _modules_bullets() -> list[tuple[str, str]]:
    """The Modules section as (folder, text) pieces: each bullet under the folder its first
    name gives ("training/", "models/" for `models/cells.py`, ...), export's sub-bullets
    under export/<their folder>."""
    section = DESIGN.split("\n## Modules", 1)[1].split("\n## ", 1)[0]
    pieces, top = [], ""
    for bullet in re.split(r"\n(?=- `|  - `)", section.strip()):
        first = re.match(r"\s*- `([a-z_/.]+)`", bullet).group(1)
        if bullet.startswith("- "):
            top = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/"
            pieces.append((top, bullet))
        else:
            sub = first if first.endswith("/") else ""
            pieces.append((top + sub, bullet))
    return pieces


def test_the_modules_section_names_each_module_under_its_folder():
    """Placement: each module of models/, training/, export/ and orthornn/ is named in the
    piece of "Modules" of its folder, after the name of its subfolder ("`tasks/`", "`loop/`")
    where it has one; and each bare name a piece gives is a module of that piece's folder."""
    pieces = _modules_bullets()
    wrong = []
    for stage in ("models", "training", "export", "orthornn"):
        for module in sorted(_modules(stage)):
            folder = max((f for f, _ in pieces if module.startswith(f)), key=len, default="")
            text = "\n".join(t for f, t in pieces if f == folder)
            below = module[len(folder):].split("/")[:-1]  # subfolders under the piece's
            after = text
            for sub in below:
                after = after.split(f"`{sub}/`", 1)[1] if f"`{sub}/`" in after else ""
            name = Path(module).name
            if not re.search(rf"`({re.escape(name)}|{re.escape(module)})[`:]", after):
                wrong.append(f"{module}: not named under {folder}{'/'.join(below)}")
    for folder, text in pieces:
        for name in re.findall(r"`([a-z_]+\.py)`", text):
            if not list((ROOT / folder).rglob(name)):
                wrong.append(f"{folder}: names {name}, which is not in that folder")
    assert not wrong, "\n".join(wrong)


def test_the_artifacts_contract_forbids_what_the_prose_says():
    """export/artifacts/ is what the service and training may import: import-linter forbids
    it torch and every other stage, and the offline loop inside it the serving stack."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    forbidden = {tuple(c["source_modules"]): set(c["forbidden_modules"])
                 for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "forbidden"}
    assert {"torch", "orthornn.models", "orthornn.training", "orthornn.export.builder",
            "orthornn.export.cli"} <= forbidden[("orthornn.export.artifacts",)]
    assert {"orthornn.service", "fastapi", "prometheus_client"} <= \
        forbidden[("orthornn.export.artifacts.loop",)]
