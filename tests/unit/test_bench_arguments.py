"""The load benches refuse bad arguments and a missing load client before they start a
server: a usage error naming the option (exit 2), never a traceback."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = None if path is None else {"PATH": path}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "load" / script), *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("share", ["0", "1.5", "-0.1"])
def test_a_share_outside_zero_to_one_is_refused(share):
    out = _run("capture.py", "--sample", share)
    assert out.returncode == 2, out.stderr
    assert f"--sample: a share in (0, 1]; got {float(share)}" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset")
@pytest.mark.parametrize(("script", "args", "option"), [
    ("capture.py", ["--client", "wrk"], "--client wrk: "),
    ("collector.py", [], "the load comes from wrk: "),
])
def test_without_wrk_the_wrk_client_is_refused(tmp_path, script, args, option):
    (tmp_path / "taskset").symlink_to(shutil.which("taskset"))  # taskset alone on PATH
    out = _run(script, *args, path=str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert f"{option}wrk not installed" in out.stderr
    assert "Traceback" not in out.stderr
