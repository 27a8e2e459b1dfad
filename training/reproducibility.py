"""Repeatable training on the CPU, at a thread count that fits the machine.

Two things made the same command with the same seed train different weights:
- MKL (torch's BLAS on x86) picks its gemm blocking from the thread count, so 1 and 2
  threads summed dL/dW in different orders; its conditional numerical reproducibility
  mode (``MKL_CBWR=AUTO,STRICT``; ``COMPATIBLE,STRICT`` on other CPUs than Intel's,
  where AUTO does not) fixes the order whatever the thread count. MKL reads
  the variable once, at its first call, so ``orthornn/__init__.py`` sets it (unless the
  user chose a mode) before anything of ours can run a matrix product.
- oneDNN's LSTM kernel splits its weight gradients by thread; training turns oneDNN off
  (``deterministic_cpu``), which leaves the same ops on ATen's and MKL's paths.
With both, measured on every architecture: identical bytes for 1 and 2 threads, and
for the same command twice (tests/integration/test_reproducibility.py).

Across CPUs there is no such guarantee. MKL picks its branch by CPU (``MKL_CBWR``'s
AUTO: AVX-512 here, another on an AMD EPYC), ATen its kernels by instruction set
(``ATEN_CPU_CAPABILITY``), and training amplifies their last-bit differences: the word LM
trained 6 different weights under 12 settings on one Intel Xeon (bench/experiments/numerics.py,
docs/training.md "Across CPUs"), and pinning both to the AVX2/COMPATIBLE paths still
trained other bytes on an Intel Xeon than on an AMD EPYC. So nothing is pinned for
portability (it cost 2-4x on MKL's gemms and bought no identity); the docs' answers are
checked within the spread those settings measured.

Threads: with more threads than idle cores, every parallel region waits for a thread
the scheduler parked: beside one busy process on 2 cores, 2 threads trained the digits
model 3x slower than 1 (bench/perf/threads.py). ``pick_threads`` uses the cores that are
idle now, at least 1; since results do not depend on it, this costs no repeatability.
Beside other workers of the same run (torchrun's LOCAL_WORLD_SIZE > 1), idle cores cannot be
sampled (they all start at once), so each takes an equal share of the cores instead. The
cores are those the process may run on, within a container's CPU limit (cgroup v2
``cpu.max``), which the affinity mask does not show.
"""

from __future__ import annotations

import math
import os
import time

#: a container's CPU limit (cgroup v2): "QUOTA PERIOD" or "max PERIOD"
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        with open(CGROUP_CPU_MAX) as limit:
            quota, period = limit.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError, ZeroDivisionError):  # no cgroup v2 limit here
        pass
    return cores


def idle_cores(interval_s: float = 0.2) -> float | None:
    """How many cores were idle over the next ``interval_s`` (Linux /proc/stat; None
    elsewhere)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields[:8])  # idle + iowait, total (no guest)

    try:
        idle0, total0 = sample()
        time.sleep(interval_s)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (os.cpu_count() or 1) * (idle1 - idle0) / (total1 - total0)


def pick_threads(requested: int | None, local_world: int = 1) -> int:
    """``requested`` if given; beside ``local_world`` - 1 other workers of the run, an equal
    share of the cores (at least 1); else the idle cores now (rounded, at least 1, at most
    the cores this process may use)."""
    if requested is not None:
        return requested
    cores = usable_cores()
    if local_world > 1:
        return max(1, cores // local_world)
    idle = idle_cores()
    if idle is None:
        return cores
    return max(1, min(cores, round(idle)))


def numerics(torch, device, threads: int) -> dict:
    """What determines a run's bytes besides its config, for summary.json."""
    return {"torch": torch.__version__, "threads": threads, "device": str(device),
            "mkl_cbwr": os.environ.get("MKL_CBWR"),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn": False, "deterministic": device.type == "cpu"}
