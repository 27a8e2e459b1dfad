"""Long jobs that a test needs, started as the session starts so that they run beside the
other tests (most of which wait on servers more than they compute): the quickstart's two
models and the same word model under another numerics setting, for
tests/integration/test_end_to_end.py, which runs last but for the images' tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the test that takes the quickstart's models (conftest orders it late)
QUICKSTART_TEST = "test_end_to_end.py::test_quickstart_serves_every_readme_example"
#: the quickstart's word model is trained a second time under this numerics setting
#: (bench/experiments/numerics.py): ATen's scalar kernels instead of the vectorised ones that every
#: x86-64 CPU with AVX2 runs, so other bytes than the quickstart's on any CI machine.
OTHER_NUMERICS = "aten-default"


@dataclass
class Quickstart:
    work: Path  # a temporary folder, removed at the session's end
    root: Path  # the quickstart's --dir
    other_run: Path  # the word model trained under OTHER_NUMERICS
    procs: tuple[subprocess.Popen, subprocess.Popen]
    logs: tuple[Path, Path]

    def wait(self, timeout: float) -> tuple[subprocess.CompletedProcess, str]:
        """(the quickstart as a finished command, the other training's output); the
        other training must have succeeded."""
        for proc in self.procs:
            proc.wait(timeout=timeout)
        built = subprocess.CompletedProcess(self.procs[0].args, self.procs[0].returncode,
                                            "", self.logs[0].read_text())
        other_log = self.logs[1].read_text()
        assert self.procs[1].returncode == 0, other_log[-3000:]
        assert built.returncode == 0, built.stderr[-3000:]
        return built, other_log

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


_quickstart: Quickstart | None = None


def start_quickstart() -> None:
    """``orthornn quickstart --no-serve`` and the other setting's word model, in the
    background (their output in files: a full pipe would stall them)."""
    global _quickstart
    from bench.experiments.numerics import environment

    work = Path(tempfile.mkdtemp(prefix="orthornn-quickstart-"))
    root, other_run = work / "qs", work / "other" / "words"
    logs = (work / "quickstart.log", work / "other.log")
    with open(logs[0], "w") as qs_log, open(logs[1], "w") as other_log:
        procs = (
            subprocess.Popen([sys.executable, "-m", "orthornn", "quickstart", "--dir",
                              str(root), "--no-serve"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=qs_log, text=True),  # not a tty: progress lines
            subprocess.Popen([sys.executable, str(ROOT / "bench" / "experiments" / "numerics.py"),
                              "--train-worker", str(other_run)], cwd=ROOT,
                             env=environment(OTHER_NUMERICS), stdout=other_log,
                             stderr=subprocess.STDOUT, text=True))
    _quickstart = Quickstart(work, root, other_run, procs, logs)


def quickstart() -> Quickstart:
    """The jobs ``start_quickstart`` began (started now when the session did not)."""
    if _quickstart is None:
        start_quickstart()
    assert _quickstart is not None
    return _quickstart


def stop() -> None:
    if _quickstart is not None:
        _quickstart.stop()
