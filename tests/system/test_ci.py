"""CI cannot pass by skipping (tests/skips.py, scripts/ci-debian.sh under CI_TOOLS_STRICT=1):
a run that skipped a test for an unexpected reason fails and names it; a missing tool that
cannot be installed fails the tools step and names it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
import pytest

def test_passes():
    assert True

@pytest.mark.skip(reason="needs a CUDA device")
def test_gpu():
    pass

{unexpected}
'''
REDIS = '''
def test_redis():
    pytest.skip("redis-server not found on PATH or in /usr/sbin")
'''


#: a module skipped as a whole at import (as tests/integration/test_fuzz.py is without
#: atheris): a collection report, not a test's
MODULE_SKIP = '''
import pytest

pytest.importorskip("orthornn_no_such_module")

def test_never_collected():
    pass
'''


def run_suite(tmp_path: Path, unexpected: bool, strict: bool, module_skip: bool = False,
              workers: int = 0) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(SUITE.format(unexpected=REDIS if unexpected else ""))
    files = [str(tmp_path / "test_suite.py")]
    if module_skip:
        (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
        files.append(str(tmp_path / "test_module_skip.py"))
    env = {k: v for k, v in os.environ.items() if k != "CI_TOOLS_STRICT"}
    env["PYTHONPATH"] = str(ROOT)
    if strict:
        env["CI_TOOLS_STRICT"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.skips", "--rootdir", str(tmp_path), "-c", os.devnull,
                           *(["-n", str(workers)] if workers else []), *files],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_strict_run_with_an_unexpected_skip_fails_and_names_it(tmp_path):
    result = run_suite(tmp_path, unexpected=True, strict=True)
    assert result.returncode == 1, result.stdout
    assert "unexpected skips (CI_TOOLS_STRICT=1: the run fails)" in result.stdout
    assert "test_suite.py::test_redis: redis-server not found" in result.stdout
    assert "test_gpu" not in result.stdout.split("unexpected skips")[1]  # expected: not listed


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_a_strict_run_with_a_module_level_skip_fails_and_names_it(tmp_path, workers):
    result = run_suite(tmp_path, unexpected=False, strict=True, module_skip=True,
                       workers=workers)
    assert result.returncode == 1, result.stdout
    listed = result.stdout.split("unexpected skips (CI_TOOLS_STRICT=1: the run fails)")[1]
    assert "test_module_skip.py: could not import 'orthornn_no_such_module'" in listed, \
        result.stdout
    assert listed.count("test_module_skip.py") == 1, listed  # once, not once per worker
    assert "test_gpu" not in listed


def test_a_run_with_a_module_level_skip_that_is_not_strict_passes_and_warns(tmp_path):
    result = run_suite(tmp_path, unexpected=False, strict=False, module_skip=True)
    assert result.returncode == 0, result.stdout
    assert "skips that CI_TOOLS_STRICT=1 would fail" in result.stdout
    assert "test_module_skip.py: could not import" in result.stdout


def test_a_strict_run_with_only_expected_skips_passes(tmp_path):
    result = run_suite(tmp_path, unexpected=False, strict=True)
    assert result.returncode == 0, result.stdout
    assert "unexpected skips" not in result.stdout


def test_a_run_that_is_not_strict_passes_and_warns(tmp_path):
    result = run_suite(tmp_path, unexpected=True, strict=False)
    assert result.returncode == 0, result.stdout
    assert "skips that CI_TOOLS_STRICT=1 would fail" in result.stdout
    assert "test_suite.py::test_redis" in result.stdout


def test_ci_runs_make_test_strictly():
    script = (ROOT / ".ci" / "run").read_text()
    assert "CI_TOOLS_STRICT=1 make test" in script


def test_the_tools_step_fails_under_strict_when_a_tool_cannot_be_installed(tmp_path):
    """No apt-get and none of the programs on PATH: strict exits 1 and names them; not
    strict warns and exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("bash", "id", "env"):
        (bin_dir / name).symlink_to(shutil.which(name))
    script = str(ROOT / "scripts" / "ci-debian.sh")
    base = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    strict = subprocess.run([str(bin_dir / "bash"), script], env={**base, "CI_TOOLS_STRICT": "1"},
                            capture_output=True, text=True, timeout=60)
    # the script also looks in /usr/sbin, which this PATH cannot hide
    named = [p for p in ("chromium", "redis-server", "haproxy", "prometheus", "podman", "runc",
                         "mmdebstrap", "wrk") if not Path("/usr/sbin", p).exists()]
    assert named
    assert strict.returncode == 1, strict.stderr
    assert strict.stderr.startswith("ci-debian: no apt-get (not a Debian-based system); "
                                    f"cannot install {' '.join(named)} (CI_TOOLS_STRICT=1")
    lenient = subprocess.run([str(bin_dir / "bash"), script], env=base, capture_output=True,
                             text=True, timeout=60)
    assert lenient.returncode == 0, lenient.stderr
    assert "will be skipped" in lenient.stderr


def test_a_background_job_is_waited_for_and_stopped_from_another_process(tmp_path):
    """tests/background.Job, as make test uses it: a job started by one process (which
    then exits) is adopted by another, which reads its exit status from its file, or ends
    its whole process group."""
    from tests.background import Job

    starter = ("import sys; from pathlib import Path; from tests.background import Job; "
               "Job.start(Path(sys.argv[1]), 'quick', ['sh', '-c', 'echo hi; exit 3']); "
               "Job.start(Path(sys.argv[1]), 'slow', ['sh', '-c', 'sleep 300 & sleep 300'])")
    subprocess.run([sys.executable, "-c", starter, str(tmp_path)], cwd=ROOT, check=True,
                   timeout=60)
    quick, slow = Job.adopt(tmp_path, "quick"), Job.adopt(tmp_path, "slow")
    assert quick is not None and slow is not None and Job.adopt(tmp_path, "none") is None
    assert quick.wait(timeout=30) == 3 and quick.log.read_text() == "hi\n"
    assert slow.returncode() is None
    with pytest.raises(TimeoutError, match="slow still running"):
        slow.wait(timeout=1)
    slow.stop()  # the group: the shell and both sleeps
    assert subprocess.run(["pgrep", "-g", str(slow.pid)], capture_output=True).returncode == 1
    assert slow.wait(timeout=10) != 0


def test_the_service_packages_come_from_make_tests_job_when_there_is_one(tmp_path, monkeypatch):
    """tests/background.service_packages: with ORTHORNN_BACKGROUND pointing at a folder
    whose packages job succeeded, its stage is used and nothing is built; a failed job is
    an error with its log, not a silent rebuild."""
    from tests import background
    from tests.background import PACKAGES, Job

    built = tmp_path / "ok" / PACKAGES / "stage" / "digits" / "1"
    Job.start(tmp_path / "ok", PACKAGES, ["mkdir", "-p", str(built)]).wait(timeout=30)
    monkeypatch.setenv(background.SHARED, str(tmp_path / "ok"))
    fallback = tmp_path / "fallback"
    assert background.service_packages(fallback) == tmp_path / "ok" / PACKAGES / "stage"
    assert not fallback.exists()
    Job.start(tmp_path / "bad", PACKAGES, ["sh", "-c", "echo no corpus; exit 1"])
    monkeypatch.setenv(background.SHARED, str(tmp_path / "bad"))
    with pytest.raises(AssertionError, match="packages job ended with 1: no corpus"):
        background.service_packages(fallback)
