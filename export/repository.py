"""Publishing into a model repository, REPO/<name>/<version>/, torch-free.

A version is built in a hidden temporary directory beside its final place and
appears by one atomic rename, so a reader (the service) never sees a partial one.
Version numbers are integers that only grow: the next one is above every existing
version and above the last one ever published (REPO/<name>/.last_version).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name) or ".." in name:
        raise ValueError(f"name must be 1-128 letters, digits, '_', '-' or '.', starting with "
                         f"a letter or digit (no path separators); got {name!r}")
    return name


def versions(model_dir: str | Path) -> list[int]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def next_version(model_dir: Path) -> int:
    last = 0
    marker = model_dir / ".last_version"
    if marker.is_file():
        text = marker.read_text().strip()
        last = int(text) if text.isdigit() else 0
    return max([last, *versions(model_dir)]) + 1


def publish(repo: str | Path, name: str, build: Callable[[Path, int], None]) -> Path:
    """Call build(tmp_dir, version) to fill a new version, then rename it into place.
    Returns REPO/NAME/<version>. On any error nothing visible is left behind."""
    model_dir = Path(repo) / check_name(name)
    model_dir.mkdir(parents=True, exist_ok=True)
    tmp = model_dir / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        version = next_version(model_dir)
        build(tmp, version)
        for _ in range(100):
            target = model_dir / str(version)
            try:
                os.rename(tmp, target)  # atomic; fails if another publisher took it
            except OSError:
                if not target.exists():
                    raise
                version = next_version(model_dir)
                build(tmp, version)  # the manifest names the version: write it again
                continue
            marker_tmp = model_dir / f".last_version.{uuid.uuid4().hex[:8]}"
            marker_tmp.write_text(f"{version}\n")
            os.replace(marker_tmp, model_dir / ".last_version")
            return target
        raise OSError(f"could not claim a version number in {str(model_dir)!r}")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
