"""scripts/wheelhouse.py: the wheelhouse holds what pip needs on the image's exact Python,
markers on python_full_version and extras included (pip's own --python-version evaluates
those for the running interpreter)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)


def wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A minimal wheel whose METADATA lists REQUIRES (and a vendored dist-info deeper down,
    which must not be taken for its own)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
        z.writestr(f"{name}/_vendor/other-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: other\nVersion: 1.0\nRequires-Dist: nope\n")
    return path


@pytest.fixture
def house(tmp_path):
    wheel(tmp_path, "app", "1.0", "client>=2", "gpu-lib==3.0; extra == 'gpu'")
    wheel(tmp_path, "client", "2.1", "timeout>=4; python_full_version < '3.11.3'",
          "old>=1; python_version < '3.10'")
    return tmp_path


def test_a_marker_on_the_full_version_is_evaluated_for_the_target(house):
    assert wheelhouse.missing(house, "3.11.2", ["app"]) == ["timeout>=4"]
    assert wheelhouse.missing(house, "3.11.7", ["app"]) == []
    assert sorted(wheelhouse.missing(house, "3.9.18", ["app"])) == ["old>=1", "timeout>=4"]


def test_extras_asked_of_a_wheel_bring_their_requirements(house):
    assert wheelhouse.missing(house, "3.11.7", ["app[gpu]"]) == ["gpu-lib==3.0"]
    wheel(house, "gpu_lib", "3.0")
    assert wheelhouse.missing(house, "3.11.7", ["app[gpu]"]) == []


def test_a_version_outside_the_specifier_is_missing(house):
    assert wheelhouse.missing(house, "3.11.7", ["client>=3"]) == ["client>=3"]


def test_two_versions_of_one_project_are_refused(house):
    wheel(house, "client", "2.2")
    with pytest.raises(SystemExit, match="two versions of client"):
        wheelhouse.wheels(house)
