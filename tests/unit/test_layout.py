"""The package layout rules of docs/design.md, checked on the source (the lint rule) and in
fresh interpreters: one installed name, stages that import each other in one direction,
a torch-free service, one line (exit 2) for a missing extra, one table per formula."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("models", "training", "export", "service")

# inside export: the torch-free artifacts/ (what the service reads) imports no other stage
# and nothing of builder/ (the torch exporter); export/cli.py imports both, lazily
ARTIFACTS_ALLOWED = ("orthornn.export.artifacts",)


def _python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout: every .py outside the venv
        return [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts]
    return [ROOT / line for line in listed.stdout.split() if (ROOT / line).is_file()]


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_no_bare_stage_imports():
    """The lint rule: `models`, `training`, `export`, `service` are installed only as
    orthornn.<stage>; a bare import would load a second copy or a user's own package."""
    bad = [f"{path.relative_to(ROOT)}:{line}: import {name}"
           for path in _python_files() for line, name in _absolute_imports(path)
           if name.split(".")[0] in STAGES]
    assert not bad, "use the orthornn.<stage> names:\n" + "\n".join(bad)


def test_export_artifacts_are_torch_free():
    """export/artifacts/ (the package format, the repository, the gate, the vocabulary),
    which the service and training import, imports neither torch nor another stage nor
    the torch exporter export/builder/, lazily or not."""
    bad = []
    artifacts = ROOT / "export" / "artifacts"
    for path in sorted(artifacts.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        depth = len(path.relative_to(artifacts).parts) - 1  # folders below artifacts/
        for node in ast.walk(tree):
            # relative: only within artifacts/ (`from .package import`, from loop/
            # `from ..package import`), never above it
            if isinstance(node, ast.ImportFrom) and node.level > depth + 1:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                           f"{'.' * node.level}{node.module or ''}")
        for line, name in _absolute_imports(path):
            if name.split(".")[0] in ("torch", "safetensors", "triton") or (
                    name.startswith("orthornn") and not name.startswith(ARTIFACTS_ALLOWED)):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bad, "export/artifacts/ imports no torch, no stage, nothing of builder/:\n" + (
        "\n".join(bad))


def _run(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_every_module_imports_once_under_its_orthornn_name():
    """Run from the checkout, where a bare `import models` would succeed: importing every
    module must load none under a bare name (the custom ops register once)."""
    code = ("import importlib, pkgutil, sys\n"
            "import orthornn\n"
            "for m in pkgutil.walk_packages(orthornn.__path__, 'orthornn.'):\n"
            "    if m.name != 'orthornn.__main__':\n"
            "        importlib.import_module(m.name)\n"
            "for stage in ('models', 'training', 'export', 'service'):\n"
            "    importlib.import_module('orthornn.' + stage)\n"
            "    for m in pkgutil.walk_packages(sys.modules['orthornn.' + stage].__path__,\n"
            "                                   'orthornn.' + stage + '.'):\n"
            "        importlib.import_module(m.name)\n"
            f"bare = sorted(m for m in sys.modules if m.split('.')[0] in {STAGES!r})\n"
            "print(bare)\n"
            "sys.exit(bool(bare))\n")
    result = _run(code)
    assert result.returncode == 0, result.stdout + result.stderr


TORCH_FREE = ("import sys\n"
              "for name in ('torch', 'safetensors', 'tqdm', 'sklearn', 'triton'):\n"
              "    sys.modules[name] = None  # unimportable, as in the serving image\n")


def test_service_imports_with_torch_unimportable(tmp_path):
    code = TORCH_FREE + ("import orthornn.service\n"
                         "from orthornn.service.http.app import create_app\n"
                         "from orthornn.cli import build_parser\n"
                         "build_parser().parse_args(['serve', '--repo', '.'])\n"
                         "print('ok')\n")
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_export_artifacts_import_with_torch_unimportable(tmp_path):
    code = TORCH_FREE + ("import importlib, pkgutil\n"
                         "import orthornn.export.artifacts as artifacts\n"
                         "for m in pkgutil.walk_packages(artifacts.__path__,\n"
                         "                               'orthornn.export.artifacts.'):\n"
                         "    importlib.import_module(m.name)\n"
                         "assert 'orthornn.export.builder' not in sys.modules\n"
                         "print('ok')\n")
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


#: the serving stack, unimportable too: what the training image's offline commands lack
NO_SERVING_STACK = TORCH_FREE + (
    "for name in ('fastapi', 'starlette', 'uvicorn', 'pydantic', 'pydantic_settings',\n"
    "             'prometheus_client'):\n"
    "    sys.modules[name] = None\n")


@pytest.mark.parametrize("argv,code", [
    (["labels", "import", "labels.jsonl", "--capture", "captures", "--name", "m",
      "--repo", "repo"], 2),  # through the store: the id was never captured
    (["capture", "dataset", "--capture", "captures", "--name", "m", "--out", "d.npz",
      "--no-progress"], 2),  # through the data set: too few labelled records
    (["monitor", "--capture", "captures", "--name", "m", "--repo", "repo"], 0),
    (["retrain-trigger", "--capture", "captures", "--name", "m", "--repo", "repo"], 0),
])
def test_the_offline_loop_commands_run_without_the_serving_stack(tmp_path, argv, code):
    """Issue 60: `orthornn labels import` needed the serve extra (pydantic and
    prometheus_client through the labels module); the loop's offline commands run with
    FastAPI, pydantic and prometheus_client (and torch) unimportable."""
    (tmp_path / "captures" / "m").mkdir(parents=True)
    (tmp_path / "repo" / "m").mkdir(parents=True)
    (tmp_path / "labels.jsonl").write_text('{"id": "never-captured", "label": 1}\n')
    program = NO_SERVING_STACK + f"from orthornn.cli import main\nsys.exit(main({argv!r}))\n"
    result = _run(program, cwd=tmp_path)
    assert result.returncode == code, result.stdout + result.stderr
    assert "needs the" not in result.stderr and "Traceback" not in result.stderr, \
        result.stderr


@pytest.mark.parametrize("argv,extra", [
    (["train", "--arch", "svdrnn", "--task", "digits", "--out", "RUN"], "train"),
    (["architectures"], "train"),
])
def test_missing_extra_is_one_line_and_exit_2(tmp_path, argv, extra):
    code = TORCH_FREE + f"from orthornn.cli import main\nsys.exit(main({argv!r}))\n"
    result = _run(code, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"orthornn {argv[0]} needs the {extra} extra: "
                                    f"pip install '.[{extra}]' in a checkout"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "RUN").exists()


def test_missing_extra_maps_only_known_modules():
    from orthornn.cli import missing_extra

    assert missing_extra(ModuleNotFoundError("x", name="torch.nn")) == "train"
    assert missing_extra(ModuleNotFoundError("x", name="fastapi")) == "serve"
    assert missing_extra(ModuleNotFoundError("x", name="triton")) == "gpu"
    assert missing_extra(ModuleNotFoundError("x", name="orthornn.models.nope")) is None


def test_version_flag(capsys):
    from orthornn import __version__
    from orthornn.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"orthornn {__version__}"
    assert __version__ != "0+unknown"  # installed: the distribution's version


def test_training_commands_back_large_tensors_with_huge_pages():
    """train and quickstart set THP_MEM_ALLOC_ENABLE before torch loads (a child process,
    where torch is not imported yet: c10 reads it once); other commands leave it alone and
    a user's own value wins."""
    code = ("import os, sys; from orthornn.cli import main; "
            "main(sys.argv[1:]); print('THP', os.environ.get('THP_MEM_ALLOC_ENABLE'))")
    def thp(*argv: str, **env: str) -> str:
        clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                             text=True, cwd=ROOT, env={**clean, **env}, timeout=120)
        return out.stdout.strip().splitlines()[-1]

    assert thp("train", "--task", "adding", "--show-config") == "THP 1"
    assert thp("train", "--task", "adding", "--show-config", THP_MEM_ALLOC_ENABLE="0") == "THP 0"
    assert thp("architectures") == "THP None"


# -- one table per formula -------------------------------------------------------------------

def test_activation_kinds_are_one_table():
    from orthornn.export.builder.onnx_export import ACTIVATIONS
    from orthornn.models.activations import KINDS, Activation, activation_forward

    assert set(ACTIVATIONS) == set(KINDS)
    with pytest.raises(ValueError, match="activation must be one of"):
        Activation("gelu", 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        activation_forward("gelu", torch.zeros(2))


def test_unknown_activation_raises_in_the_onnx_and_triton_builders():
    from orthornn.export.builder.graph import Graph
    from orthornn.export.builder.onnx_export import _activation

    with pytest.raises(ValueError, match="activation must be one of"):
        _activation(Graph(), "gelu", "z", None)
    triton_scan = pytest.importorskip("orthornn.models.ops.triton_scan")
    u = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="activation must be one of"):
        triton_scan._common(u, torch.eye(4), None, None, None, None, "gelu")


def test_set_factors_round_trips_and_names_bad_input():
    from orthornn.models.parametrizations import (
        BoundedSingularValues,
        HouseholderChain,
        PackedGivens,
        ScaledCayley,
        SVDForm,
    )

    for p in (HouseholderChain(6, 3), PackedGivens(6, 2), ScaledCayley(6)):
        before = p.matrix().detach().clone()
        (name,) = p.trainable
        value = p.factors()[name].detach().clone()
        with torch.no_grad():
            for param in p.parameters():
                param.zero_()
        p.set_factors(**{name: value})
        torch.testing.assert_close(p.matrix(), before)
        with pytest.raises(ValueError, match="must have shape"):
            p.set_factors(**{name: value.reshape(-1)[:-1]})
        with pytest.raises(ValueError, match=f"factor must be one of {name}; got 'nope'"):
            p.set_factors(nope=value)
    svd = SVDForm(HouseholderChain(4), BoundedSingularValues(4, 0.1, 1.0), HouseholderChain(4))
    s = torch.tensor([0.95, 1.0, 1.05, 0.99])
    svd.set_factors(singular_values=s)
    torch.testing.assert_close(torch.linalg.svdvals(svd.matrix().detach()),
                               s.sort(descending=True).values)
    with pytest.raises(ValueError, match="singular values must lie in"):
        svd.set_factors(singular_values=torch.full((4,), 2.0))


def test_models_ops_modules_import_in_one_direction():
    """The op modules build on the reference, never the reverse (no import circle)."""
    import ast

    ops = ROOT / "models" / "ops"
    reference = ast.parse((ops / "reference.py").read_text())
    imported = {node.module for node in ast.walk(reference)
                if isinstance(node, ast.ImportFrom) and node.level == 1}
    assert not imported & {"scan", "triton_scan", "dispatch"}, imported


def test_no_import_cycle_not_even_through_a_function_level_import(tmp_path):
    """grimp (import-linter's graph) reads every import, at module level or inside a
    function: no module may reach itself through them (import-linter's contracts in
    pyproject.toml order the layers; this finds a cycle hidden behind a lazy import)."""
    tree = tmp_path / "orthornn"  # laid out as the wheel installs it
    tree.mkdir()
    for path in (ROOT / "orthornn").glob("*.py"):
        (tree / path.name).symlink_to(path)
    for stage in STAGES:
        (tree / stage).symlink_to(ROOT / stage)
    code = ("import grimp\n"
            "g = grimp.build_graph('orthornn', cache_dir=None)\n"
            "for a in sorted(g.modules):\n"
            "    for b in sorted(g.find_modules_directly_imported_by(a)):\n"
            "        chain = g.find_shortest_chain(importer=b, imported=a)\n"
            "        if chain:\n"
            "            print(a, '->', ' -> '.join(chain))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "", f"import cycles:\n{done.stdout}"
