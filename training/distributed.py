"""Data-parallel training on torch.distributed: what a worker needs, and the launcher.

A worker is one ``orthornn train`` process that torchrun started (``torchrun ... -m
orthornn train``, or ``orthornn train --nproc-per-node N``, which calls torchrun's own
launcher, ``torch.distributed.run``). It reads its place from torchrun's environment
(``context``), joins the process group (``join``: gloo on the CPU, nccl on CUDA) and trains
its share of every global batch under DistributedDataParallel (training.trainer).

Equal to one process: every rank's loss is the mean over its own equal-sized share of the
global batch, and DDP averages the gradients over the ranks, so the averaged gradient is the
one-process mean over the whole batch, up to the order of the floating-point sums
(tests/integration/test_distributed.py). Rank 0 alone reads and writes the run directory; what
it read (the state to resume from, or why not) reaches the others by ``from_rank0``.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from .config import TrainConfig

BACKENDS = ("auto", "gloo", "nccl")
#: seconds a rendezvous, or a collective waiting for a slower rank, may take (--dist-timeout-s);
#: a rank that rank 0 keeps waiting while it validates waits inside this too
DEFAULT_TIMEOUT_S = 600.0
T = TypeVar("T")


@dataclass(frozen=True)
class Context:
    """This process's place in the group, from torchrun's environment (one process: 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    restart: int = 0  # torchrun's restarts of the group so far (--max-restarts)

    @property
    def main(self) -> bool:
        return self.rank == 0


def context() -> Context:
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    return Context(rank=int(env.get("RANK", "0")), world=world,
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                   restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")))


def check_batch(batch_size: int, world: int) -> None:
    """Every rank trains an equal share of the global batch (what makes the ranks' mean
    losses average to the global one)."""
    if batch_size % world:
        raise ValueError(f"--batch-size ({batch_size}) is the global batch: it must be a "
                         f"multiple of the number of processes ({world})")


def backend_for(requested: str, device: torch.device) -> str:
    """gloo on the CPU, nccl on CUDA; nccl is refused without a CUDA device."""
    if requested not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}; got {requested!r}")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ValueError("--backend nccl needs CUDA devices (NCCL runs on GPUs only) and this "
                         "run trains on the CPU: use --backend gloo (or auto)")
    return requested


def check_timeout(timeout_s: float) -> float:
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"--dist-timeout-s must be a number of seconds > 0; got {timeout_s!r}")
    return float(timeout_s)


def _is_this_machine(family: int, address: str) -> bool:
    """Whether an IP address is one of this machine's (only those can be bound)."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def unreachable(host: str, port: int, timeout_s: float, *, served_here: bool = False
                ) -> str | None:
    """None once HOST:PORT accepts a connection (or, ``served_here``, once HOST is this
    machine, whose launcher will serve the rendezvous); else, after ``timeout_s``, why not.
    Retried meanwhile: the other machine, or its DNS name, may come up after this one.
    Checked here, in Python, because torch's own attempts fail after the same wait but
    print C++ stack traces on the way."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            if served_here and any(_is_this_machine(info[0], str(info[4][0])) for info in found):
                return None
            left = max(0.1, deadline - time.monotonic())
            with socket.create_connection((host, port), timeout=min(2.0, left)):
                return None
        except OSError as error:
            reason = str(error) or type(error).__name__
        if time.monotonic() >= deadline:
            return reason
        time.sleep(0.5)


class RankError(ValueError):
    """A failure of this rank alone, which the others may not see: each rank reports its own
    (other errors are every rank's, and rank 0 alone reports them)."""


def join(backend: str, ctx: Context, timeout_s: float) -> None:
    """Join the process group torchrun's environment describes, giving up after
    ``timeout_s`` (the same bound then holds for every collective)."""
    host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    where = f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    # rank 0 serves the store of a plain env:// group; under torchrun it is the agent's,
    # which this machine's agent has reached already
    if (not ctx.main and host and port.isdigit()
            and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ):
        reason = unreachable(host, int(port), timeout_s)
        if reason is not None:
            raise RankError(f"rank {ctx.rank}: cannot reach the process group's rendezvous at "
                            f"{where} within {timeout_s:g} s (--dist-timeout-s): {reason}")
    timeout = timedelta(seconds=timeout_s)
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent store outlives a restart of the group, and torch's env://
            # rendezvous uses it without a prefix per attempt: a restarted rank could read
            # the dead group's addresses (measured: a refused connection or a hang in 5 of 6
            # restarts). Each attempt keeps its own keys.
            store = dist.PrefixStore(f"orthornn-attempt-{ctx.restart}/", dist.TCPStore(
                host, int(port), ctx.world, is_master=False, timeout=timeout))
            dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend, timeout=timeout)
    except dist.DistError as error:  # the rendezvous store not reached, or ranks missing
        text = str(error).strip()
        reason = text.splitlines()[0] if text else type(error).__name__
        raise RankError(f"rank {ctx.rank}: could not join the process group at {where} within "
                        f"{timeout_s:g} s (--dist-timeout-s): {reason}") from None


def die_with_launcher() -> None:
    """Under torchrun, end this worker when its launcher ends, however that ends: killed with
    SIGKILL, the launcher cannot stop its workers, and an orphan could be left waiting for
    peers that are gone (Linux's parent-death signal; torchrun starts the workers from its
    main thread, whose end is the process's)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def from_rank0(read: Callable[[], T], ctx: Context) -> T:
    """``read()`` on rank 0 alone (the run directory is rank 0's), its result or its
    ValueError given to every rank, so that all of them go on, or stop on the same error."""
    if ctx.world == 1:
        return read()
    box: list = [None]
    if ctx.main:
        try:
            box[0] = ("ok", read())
        except ValueError as error:
            box[0] = ("error", str(error))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ValueError(value)
    return value


def mean(value: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The mean of a tensor over the ranks (equal shares: the mean of the ranks' means is
    the global batch's mean)."""
    if ctx.world == 1:
        return value
    total = value.detach().clone()
    dist.all_reduce(total)
    return total / ctx.world


def gradient_norm(grad: torch.Tensor, ctx: Context) -> float:
    """||dL/dh0|| of the global loss from each rank's gradient of its own mean loss: rank r's
    rows of the global gradient are its own divided by the number of ranks."""
    if ctx.world == 1:
        return grad.norm().item()
    squares = grad.detach().square().sum().reshape(1)
    dist.all_reduce(squares)
    return squares.sqrt().item() / ctx.world


def gather_rows(value: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The ranks' row blocks stacked in rank order (the language model's carried state:
    rank r's rows are columns r b ... (r + 1) b - 1 of the one-process state)."""
    if ctx.world == 1:
        return value
    parts = [torch.empty_like(value) for _ in range(ctx.world)]
    dist.all_gather(parts, value.contiguous())
    return torch.cat(parts)


def check_resume_world(run_config: dict, world: int) -> None:
    """A run resumes with the number of processes that trained it: another number sums every
    gradient in another order, and the resumed run would not equal an uninterrupted one."""
    saved = (run_config.get("distributed") or {}).get("world_size", 1)
    if saved != world:
        raise ValueError(f"cannot resume: the run was trained by {saved} process(es) and this "
                         f"resume has {world}; resume it with the same number (--nnodes x "
                         f"--nproc-per-node = {saved}), since another one changes the order of "
                         f"every gradient sum and the run would no longer equal an "
                         f"uninterrupted one")


def record(config: TrainConfig, ctx: Context, backend: str | None) -> dict:
    """What config.json records of the group: world size, per-rank batch, backend."""
    return {"world_size": ctx.world, "per_rank_batch": config.batch_size // ctx.world,
            "backend": backend if ctx.world > 1 else None}

