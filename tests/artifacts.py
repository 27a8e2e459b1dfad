"""What users install, built from the checkout for the tests: the wheel (tests/system/test_wheel.py
installs and runs it in fresh virtual environments) and those environments. The container
images are built by scripts/images.sh, from a copy of the same files.

The wheel is built from a copy of the files a clone has (tracked files, and untracked
ones git does not ignore), the way CI's clean clone builds it: the checkout gets no
`build/` or `*.egg-info`, and nothing left there by an earlier build (setuptools puts
all of `build/lib` into a wheel, a module deleted since included) reaches the wheel.

pip reads its index from the machine's configuration (pip.conf, PIP_*). When it cannot
reach one (no network and nothing on disk), `build_wheel` and `make_venv` raise
`Unavailable`; `skip_or_fail` turns that into a skip with the reason, or a failure under
CI_TOOLS_STRICT=1 (as for the CI tools of scripts/ci-tools.sh).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the version the Makefile installs: torch==2.13.0 is the CPU build; a bare `torch`
# requirement could pull a several-GB CUDA build
TORCH_VERSION = "2.13.0"
PIP = ["-m", "pip", "--disable-pip-version-check", "--no-input"]
# what pip prints when no index (or no network) can give it a distribution
_UNREACHABLE = re.compile(
    r"No matching distribution found|Could not find a version that satisfies|"
    r"Failed to establish a new connection|Temporary failure in name resolution|"
    r"Network is unreachable|Name or service not known|NewConnectionError|"
    r"Max retries exceeded|ConnectTimeoutError|ReadTimeoutError|"
    r"ProxyError|SSLError|Could not fetch URL")


class Unavailable(RuntimeError):
    """pip could not get what it needs (no network, no index on disk, no cache)."""


def skip_or_fail(reason: str):
    """pytest.skip(reason), or pytest.fail under CI_TOOLS_STRICT=1."""
    import pytest

    if os.environ.get("CI_TOOLS_STRICT") == "1":
        pytest.fail(f"{reason} (CI_TOOLS_STRICT=1)")
    pytest.skip(reason)


def source_files() -> list[Path]:
    """The files of a clone, relative to ROOT: tracked, and untracked but not ignored (the
    work about to be committed); outside git, every file but the usual build debris."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True)
    if listed.returncode == 0:
        names = [Path(n) for n in listed.stdout.decode().split("\0") if n]
        return sorted(n for n in names if (ROOT / n).is_file())
    debris = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache",
              ".ruff_cache", "site", ".quickstart", "runs"}
    return sorted(p.relative_to(ROOT) for p in ROOT.rglob("*")
                  if p.is_file() and not debris.intersection(p.relative_to(ROOT).parts)
                  and not any(part.endswith(".egg-info") for part in p.parts))


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would let another interpreter see the
    checkout or this venv (PYTHONPATH, VIRTUAL_ENV, ...) or change the service's settings
    (ORTHORNN_*); pip's own configuration (PIP_*) stays."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV",
            "__PYVENV_LAUNCHER__")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith("ORTHORNN_")}
    return {**env, **extra}


def _pip(python: str | Path, *args: str, what: str, timeout: float) -> None:
    result = subprocess.run([str(python), *PIP, *args], capture_output=True, text=True,
                            timeout=timeout, env=clean_env(), cwd=tempfile.gettempdir())
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-4000:]
        if _UNREACHABLE.search(output):
            errors = [line.strip() for line in output.splitlines()
                      if line.strip().startswith("ERROR:")]
            raise Unavailable(f"{what}: pip could not get a distribution (no network or "
                              f"package index?): {' '.join(errors[-2:]) or output[-500:]}")
        raise RuntimeError(f"{what} failed (exit {result.returncode}):\n{output}")


def build_wheel(dest: Path, timeout: float = 300) -> Path:
    """`pip wheel --no-deps` of a copy of the checkout into DEST (with this interpreter's
    pip, build isolation as a user gets it); the path of the one orthornn wheel there."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="orthornn-source-") as tmp:
        source = Path(tmp) / "orthornn"
        for name in source_files():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
        _pip(sys.executable, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest),
             str(source), what="building the wheel", timeout=timeout)
    wheels = sorted(dest.glob("orthornn-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one orthornn wheel in {dest}, found {wheels}")
    return wheels[0]


def make_venv(path: Path, wheel: Path, extras: str, torch: bool = False,
              timeout: float = 900) -> float:
    """A fresh virtual environment at PATH (no system site-packages, nothing of the
    checkout) with WHEEL[EXTRAS] installed; with ``torch``, torch==TORCH_VERSION first, as
    the Makefile does. The seconds it took.

    The environment gets no pip of its own (ensurepip costs 3 s): this interpreter's pip
    installs into it (``pip --python``), with the machine's pip configuration, and
    compiles nothing ahead (``--no-compile``: the few modules a test imports compile then;
    compiling all of torch's costs 12 s of CPU)."""
    start = time.monotonic()
    path = Path(path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120, capture_output=True, env=clean_env())
    install = ["--python", str(path / "bin" / "python"), "install", "--quiet",
               "--no-compile"]
    if torch:
        _pip(sys.executable, *install, f"torch=={TORCH_VERSION}", what="installing torch",
             timeout=timeout)
    target = f"{wheel}[{extras}]" if extras else str(wheel)
    _pip(sys.executable, *install, target, what=f"installing {Path(wheel).name}[{extras}]",
         timeout=timeout)
    return time.monotonic() - start
