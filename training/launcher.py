"""The launcher of data-parallel training: ``orthornn train --nproc-per-node N`` (and
multi-node) checks the launch, then starts the workers through torchrun's own launcher
and turns a failed worker into one line naming it (``training.distributed`` is the
workers' side)."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import TrainConfig
from .distributed import (
    DEFAULT_TIMEOUT_S,
    backend_for,
    check_batch,
    check_resume_world,
    check_timeout,
    unreachable,
)
from .reproducibility import pick_threads, usable_cores


@dataclass(frozen=True)
class Launch:
    """The launcher's flags (``orthornn train --nproc-per-node ...``)."""

    nproc_per_node: int
    nnodes: int = 1
    rdzv_endpoint: str | None = None
    max_restarts: int = 0
    backend: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    force: bool = False

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc_per_node


def _device_type(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def check_launch(launch: Launch, config: TrainConfig) -> None:
    """Bad launcher input, each a ValueError naming the flag (exit 2), before any worker
    starts."""
    if launch.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {launch.nproc_per_node}")
    if launch.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {launch.nnodes}")
    if launch.max_restarts < 0:
        raise ValueError(f"--max-restarts must be at least 0, got {launch.max_restarts}")
    check_timeout(launch.timeout_s)
    device = _device_type(config.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA device is available")
    backend_for(launch.backend, torch.device(device))
    if device == "cuda":
        have, what = torch.cuda.device_count(), "CUDA devices"
    else:
        have, what = usable_cores(), "cores this process may use"
    if launch.nproc_per_node > have and not launch.force:
        raise ValueError(f"--nproc-per-node {launch.nproc_per_node} is more than the {have} "
                         f"{what}: the workers would take turns on them; pass --force to "
                         f"start them anyway")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ValueError(f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT, the "
                         f"rendezvous every node joins")
    if launch.rdzv_endpoint is not None:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--rdzv-endpoint must be HOST:PORT; got {launch.rdzv_endpoint!r}")
    check_batch(config.batch_size, launch.world)


def _torchrun_args(launch: Launch) -> list[str]:
    """torchrun's own flags for this launch: a local c10d rendezvous (--standalone) for one
    node, else c10d at --rdzv-endpoint; its join bounded by --dist-timeout-s."""
    seconds = str(max(1, math.ceil(launch.timeout_s)))
    args = ["--nnodes", str(launch.nnodes), "--nproc-per-node", str(launch.nproc_per_node),
            "--max-restarts", str(launch.max_restarts),
            "--rdzv-conf", f"join_timeout={seconds},read_timeout={seconds}"]
    if launch.nnodes == 1 and launch.rdzv_endpoint is None:
        return [*args, "--standalone"]
    return [*args, "--rdzv-backend", "c10d", "--rdzv-endpoint", str(launch.rdzv_endpoint),
            "--rdzv-id", "orthornn-train"]


def _checkpoint_step(run_dir: Path) -> int | None:
    """The step of the run directory's last checkpoint (metrics.jsonl gets a row with each)."""
    log = run_dir / "metrics.jsonl"
    if not (run_dir / "trainer_state.pt").is_file() or not log.is_file():
        return None
    lines = log.read_text().splitlines()
    return json.loads(lines[-1])["step"] if lines else None


def launch_workers(config: TrainConfig, launch: Launch, *, resume: bool, progress: bool) -> int:
    """Start the workers through torchrun's launcher and wait for them: 0 when they all
    finish; the workers' own 2 when they stopped on bad input (rank 0 said why); 1 with one
    line naming the failed worker otherwise. Multi-node: every node runs this."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    from .checkpoint import read_run_config

    check_launch(launch, config)
    if resume:
        check_resume_world(read_run_config(str(config.out)), launch.world)
    if launch.rdzv_endpoint is not None:
        host, _, port = launch.rdzv_endpoint.rpartition(":")
        reason = unreachable(host, int(port), launch.timeout_s, served_here=True)
        if reason is not None:
            raise ValueError(f"cannot reach --rdzv-endpoint {launch.rdzv_endpoint} within "
                             f"{launch.timeout_s:g} s (--dist-timeout-s): {reason}")
    if launch.nproc_per_node > 1:
        # torchrun gives its workers OMP_NUM_THREADS (1 unless set, with a warning); the
        # workers take their share of the cores themselves (pick_threads), and this tells
        # any OpenMP code outside torch's pool the same
        os.environ.setdefault("OMP_NUM_THREADS",
                              str(pick_threads(None, launch.nproc_per_node)))
    with tempfile.TemporaryDirectory(prefix="orthornn-train-") as tmp:
        # the workers get the resolved options (flags, file, preset) as one config file
        options = Path(tmp) / "train.json"
        options.write_text(json.dumps(config.to_dict()))
        worker = ["-m", "orthornn", "train", "--config", str(options), "--out", str(config.out),
                  "--backend", launch.backend, "--dist-timeout-s", str(launch.timeout_s)]
        worker += ["--resume"] if resume else []
        worker += [] if progress else ["--no-progress"]
        try:
            run(parse_args([*_torchrun_args(launch), *worker]))
        except ChildFailedError as error:
            rank, failure = error.get_first_failure()
            if failure.exitcode == 2:  # bad input: the workers printed it
                return 2
            how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                   else f"exited with status {failure.exitcode}")
            step = _checkpoint_step(Path(str(config.out)))
            where = (f"{config.out} holds the checkpoint of step {step}: continue with --resume"
                     if step is not None else f"no checkpoint was written to {config.out}")
            tries = (f" after {launch.max_restarts} restart(s) (--max-restarts)"
                     if launch.max_restarts else "; --max-restarts K restarts the group "
                     "from its last checkpoint")
            print(f"orthornn train: error: worker rank {rank} (pid {failure.pid}) {how}; the "
                  f"other workers were stopped{tries}. {where}", file=sys.stderr)
            return 1
        except SignalException as error:  # torchrun's own handler (Ctrl-C, a SIGTERM)
            print(f"orthornn train: stopped by {signal.Signals(error.sigval).name}; the "
                  f"workers were stopped", file=sys.stderr)
            return 128 + error.sigval
        except RendezvousError as error:
            raise ValueError(f"the rendezvous at --rdzv-endpoint "
                             f"{launch.rdzv_endpoint or 'localhost'} did not gather "
                             f"--nnodes {launch.nnodes} node(s) within {launch.timeout_s:g} s "
                             f"(--dist-timeout-s): {type(error).__name__}") from None
    return 0
