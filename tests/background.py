"""Long jobs that a test needs, run beside the other tests (most of which wait on servers
more than they compute): the quickstart's two models, for
tests/integration/test_end_to_end.py (which runs late, before the images' tests), the
container images' build (tests/containers.py), and the exported packages that the service
tests serve (``service_packages``: otherwise each worker of each phase trains and exports
them again). The quickstart's word model trained under other CPU kernels is a slow test's
own job (``other_numerics_job``).

Each job is a detached process group (``Job``) whose output goes to a log file and whose
exit status is written to a file when it ends, so that any process can wait for it. A
test session starts the jobs it needs when it is collected; ``make test``
(scripts/test.sh) starts them earlier, before the lint and the first phase (``python -m
tests.background start-quickstart DIR``, ``start-packages DIR``, ``start-images DIR``),
and sets ``ORTHORNN_BACKGROUND=DIR``: the phases' sessions then adopt them instead of
starting their own, so that they use the cores that the installs and the lint leave idle.
``python -m tests.background stop DIR`` ends them (scripts/test.sh's exit trap)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the test that takes the quickstart's models (conftest orders it late)
QUICKSTART_TEST = "test_end_to_end.py::test_quickstart_serves_every_readme_example"
#: the quickstart's word model is trained a second time under this numerics setting
#: (bench/experiments/numerics.py): ATen's scalar kernels instead of the vectorised ones that every
#: x86-64 CPU with AVX2 runs, so other bytes than the quickstart's on any CI machine.
OTHER_NUMERICS = "aten-default"
#: where make test's jobs are (scripts/test.sh sets it)
SHARED = "ORTHORNN_BACKGROUND"


@dataclass
class Job:
    """A command in a process group of its own (its leader's pid is the group's id), its
    output in FOLDER/NAME.log, its exit status in FOLDER/NAME.rc once it ends."""
    folder: Path
    name: str
    pid: int

    @property
    def log(self) -> Path:
        return self.folder / f"{self.name}.log"

    @classmethod
    def start(cls, folder: Path, name: str, command: list[str], env: dict | None = None,
              nice: bool = False) -> Job:
        folder.mkdir(parents=True, exist_ok=True)
        rc = folder / f"{name}.rc"
        rc.unlink(missing_ok=True)
        # the status is written by the shell that ran the command, through a temporary
        # name: a reader sees no file or the whole status
        wrapper = ['sh', '-c', '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"', str(rc)]
        with open(folder / f"{name}.log", "w") as log:
            proc = subprocess.Popen([*(["nice", "-n", "19"] if nice else []), *wrapper,
                                     *command], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        (folder / f"{name}.pid").write_text(str(proc.pid))
        _CHILDREN.append(proc)  # reaped (_reap), not left a zombie
        return cls(folder, name, proc.pid)

    @classmethod
    def adopt(cls, folder: Path, name: str) -> Job | None:
        """The job NAME another process started in FOLDER, if there is one."""
        try:
            return cls(folder, name, int((folder / f"{name}.pid").read_text()))
        except (OSError, ValueError):
            return None

    def returncode(self) -> int | None:
        try:
            return int((self.folder / f"{self.name}.rc").read_text())
        except (OSError, ValueError):
            return None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.returncode()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} still running after {timeout:.0f} s "
                                   f"(its log: {self.log})")
            if not _exists(self.pid):  # ended: its status, or none if it was killed
                code = self.returncode()
                return -signal.SIGKILL if code is None else code
            time.sleep(0.5)
        return code

    def stop(self) -> None:
        """End the whole group (SIGTERM, then SIGKILL after 30 s)."""
        for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait
            while _exists(self.pid, group=True) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not _exists(self.pid, group=True):
                break
        _reap()


def _exists(pid: int, group: bool = False) -> bool:
    """Whether process PID (or the process group PID) still exists; this process's own
    ended children are reaped first, so that a zombie does not count."""
    _reap()
    try:
        (os.killpg if group else os.kill)(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: it exists
        return True
    return True


#: the jobs this process started
_CHILDREN: list[subprocess.Popen] = []


def _reap() -> None:
    for proc in list(_CHILDREN):
        if proc.poll() is not None:
            _CHILDREN.remove(proc)


@dataclass
class Quickstart:
    work: Path  # the job's folder, removed at the session's end
    root: Path  # the quickstart's --dir
    job: Job
    owned: bool = True  # started by this session; adopted ones are make test's to stop

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """The quickstart as a finished command (its output as stderr)."""
        code = self.job.wait(timeout)
        return subprocess.CompletedProcess(["orthornn", "quickstart"], code, "",
                                           self.job.log.read_text())

    def stop(self) -> None:
        if not self.owned:  # (another worker of the phase may still read it)
            return
        self.job.stop()
        shutil.rmtree(self.work, ignore_errors=True)


_quickstart: Quickstart | None = None
QUICKSTART_JOB = "quickstart"


def quickstart_job(work: Path) -> Job:
    """Start ``orthornn quickstart --no-serve`` into WORK/qs (its output in a file, not a
    pipe: a full pipe would stall it; not a tty: progress lines)."""
    work = work.resolve()  # the paths the quickstart prints are the ones the test expects
    return Job.start(work, QUICKSTART_JOB, [sys.executable, "-m", "orthornn", "quickstart",
                                            "--dir", str(work / "qs"), "--no-serve"])


def other_numerics_job(folder: Path) -> Job:
    """The quickstart's word model trained again under OTHER_NUMERICS into FOLDER/words
    (bench/experiments/numerics.py's worker: the quickstart's configuration)."""
    from bench.experiments.numerics import environment

    return Job.start(folder, "other", [sys.executable,
                                       str(ROOT / "bench" / "experiments" / "numerics.py"),
                                       "--train-worker", str(folder / "words")],
                     env=environment(OTHER_NUMERICS))


def start_quickstart() -> None:
    """The quickstart's job: make test's (``ORTHORNN_BACKGROUND``) when it started one,
    else started now in a temporary folder."""
    global _quickstart
    shared = os.environ.get(SHARED)
    adopted = Job.adopt(Path(shared) / "quickstart", QUICKSTART_JOB) if shared else None
    if adopted is not None:
        work, job, owned = Path(shared) / "quickstart", adopted, False
    else:
        work = Path(tempfile.mkdtemp(prefix="orthornn-quickstart-"))
        job, owned = quickstart_job(work), True
    _quickstart = Quickstart(work, work / "qs", job, owned)


def quickstart() -> Quickstart:
    """The jobs ``start_quickstart`` began (started now when the session did not)."""
    if _quickstart is None:
        start_quickstart()
    assert _quickstart is not None
    return _quickstart


def stop() -> None:
    if _quickstart is not None:
        _quickstart.stop()


# -- the service tests' packages (the service_packages fixture, tests/conftest.py) -------

PACKAGES = "packages"


def build_service_packages(root: Path) -> Path:
    """Train and export, into ROOT/stage: adding (regress, svdrnn, 5 versions from 5
    seeds: they answer differently), digits (classify, scornn, T = 64, d = 1) and words
    (lm, lstm, with step graph and vocabulary); the stage folder."""
    from orthornn.export.builder.exporter import export_run
    from orthornn.training.config import TrainConfig
    from orthornn.training.trainer import train

    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join(f"the cat sat on the mat {i} and the dog ran to the cat's "
                                  f"house" for i in range(40)))
    common = dict(hidden_size=8, steps=4, batch_size=8, log_every=4, optimizer="adam")
    stage = root / "stage"
    for seed in range(5):
        run = root / f"adding-{seed}"
        train(TrainConfig(arch="svdrnn", task="adding", seq_len=6, seed=seed, out=str(run),
                          **common), progress=False)
        export_run(run, stage, "adding")
    train(TrainConfig(arch="scornn", task="digits", out=str(root / "digits"), **common),
          progress=False)
    export_run(root / "digits", stage, "digits")
    train(TrainConfig(arch="lstm", task="lm", corpus=str(corpus), vocab_size=20, bptt=5,
                      out=str(root / "words"), **common), progress=False)
    export_run(root / "words", stage, "words")
    return stage


def service_packages(fallback: Path) -> Path:
    """The stage folder of make test's packages job once it has succeeded, else (no job:
    a pytest run of its own) built now under FALLBACK. The tests copy from it, never
    write to it: both phases share it."""
    shared = os.environ.get(SHARED)
    job = Job.adopt(Path(shared), PACKAGES) if shared else None
    if job is None:
        return build_service_packages(fallback)
    code = job.wait(timeout=900)
    assert code == 0, f"the packages job ended with {code}: {job.log.read_text()[-3000:]}"
    return job.folder / PACKAGES / "stage"


def main(argv: list[str]) -> int:
    """``start-quickstart DIR``: the quickstart's jobs in DIR/quickstart; ``start-packages
    DIR``: the service tests' packages into DIR/packages (one thread; ``build-packages
    DIR`` is what that job runs); ``start-images DIR``: the images' build
    (tests/containers.py) in DIR; ``stop DIR``: end them all and remove DIR/quickstart
    (scripts/test.sh)."""
    from .containers import BUILD, build_job

    commands = ("start-quickstart", "start-packages", "build-packages", "start-images", "stop")
    if len(argv) != 2 or argv[0] not in commands:
        print(f"usage: python -m tests.background {'|'.join(commands)} DIR", file=sys.stderr)
        return 2
    folder = Path(argv[1]).resolve()
    if argv[0] == "start-quickstart":
        quickstart_job(folder / "quickstart")
    elif argv[0] == "start-packages":
        Job.start(folder, PACKAGES, [sys.executable, "-m", "tests.background",
                                     "build-packages", str(folder / PACKAGES)])
    elif argv[0] == "build-packages":
        import torch

        torch.set_num_threads(1)  # beside the quickstart's trainings and the installs
        build_service_packages(folder)
    elif argv[0] == "start-images":
        build_job(folder)
    else:
        for job in (Job.adopt(folder / "quickstart", QUICKSTART_JOB),
                    Job.adopt(folder, PACKAGES), Job.adopt(folder, BUILD)):
            if job is not None:
                job.stop()
        shutil.rmtree(folder / "quickstart", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
