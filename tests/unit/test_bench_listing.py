"""bench/'s three folders as `orthornn bench` sees them: --list names every script of
bench/perf, bench/load and bench/experiments, once, under its folder, with its docstring's
first line; the load tests share bench/load/client.py and import no other load test."""

from __future__ import annotations

import ast
from pathlib import Path

from orthornn.cli import main

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("perf", "load", "experiments")
#: imported by the load tests, not run: not a benchmark
LIBRARIES = {"bench/load/client.py"}


def _scripts(folder: str) -> list[Path]:
    path = ROOT / "bench" / folder
    return [p for p in [*path.glob("*.py"), *path.glob("*.sh")]
            if p.relative_to(ROOT).as_posix() not in LIBRARIES]


def test_list_names_exactly_the_scripts_of_the_three_folders(capsys):
    assert main(["bench", "--list"]) == 0
    listed: dict[str, list[str]] = {}
    folder = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("bench/"):
            folder = line.removeprefix("bench/").rstrip("/")
            listed[folder] = []
        else:
            name, _, summary = line.strip().partition(" ")
            assert summary.strip(), f"{name} has no docstring line"
            listed[folder].append(name)
    assert list(listed) == list(FOLDERS)
    for folder in FOLDERS:
        assert sorted(listed[folder]) == sorted(p.stem for p in _scripts(folder)), folder
    names = [name for names in listed.values() for name in names]
    assert len(names) == len(set(names)), "a name is in two folders"


def test_no_name_lists_them_too(capsys):
    assert main(["bench", "--list"]) == 0
    listing = capsys.readouterr().out
    assert main(["bench"]) == 0
    assert capsys.readouterr().out == listing


def test_outside_a_checkout_bench_says_where_the_benchmarks_are(monkeypatch, tmp_path,
                                                                capsys):
    import orthornn.cli

    monkeypatch.setattr(orthornn.cli, "SOURCE_TREE", tmp_path)
    assert main(["bench", "models"]) == 2
    assert "run orthornn from a checkout" in capsys.readouterr().err


def test_load_tests_import_only_the_shared_client_and_common():
    """A load test's helpers that another one needs move to bench/load/client.py."""
    shared = ("bench.common", "bench.load.client")
    load = {p.stem for p in (ROOT / "bench" / "load").glob("*.py")} - {"client"}
    bad = []
    for path in sorted((ROOT / "bench" / "load").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from bench.load import service` imports bench.load.service
                targets = [node.module] if node.module in shared else [
                    f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            bad += [f"{path.name}:{node.lineno}: {target}" for target in targets
                    if (target.startswith("bench.") and target not in shared)
                    or target.split(".")[0] in load]  # `from service import ...` too
    assert not bad, bad
