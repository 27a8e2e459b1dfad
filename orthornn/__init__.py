"""orthornn: train, export and serve orthogonal and spectrally-constrained RNNs.

The installed top level is this one name. Its stages are subpackages, each a
top-level folder of the source tree (package-dir mapping in pyproject.toml):

    orthornn.models    architectures (torch)          from orthornn.models import build_model
    orthornn.training  tasks, trainer, checkpoints    (torch; the train extra)
    orthornn.export    ONNX export and model packages (the package reader is torch-free)
    orthornn.service   the HTTP service               (torch-free; the serve extra)

This package itself holds only the command line that composes them
(``orthornn.cli``, ``orthornn.quickstart``, ``python -m orthornn``) and imports no
stage at import time.
"""

import os
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("orthornn")
except PackageNotFoundError:  # run from a checkout without installing
    __version__ = "0+unknown"


def _intel() -> bool:
    """Whether this is an Intel CPU (Linux's /proc/cpuinfo; elsewhere assumed so)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return True


# MKL sums in an order fixed whatever the thread count (training/reproducibility.py says
# why); it reads this once, at its first call, so it is set before any of ours. On other
# CPUs than Intel's, MKL's AUTO branch does not hold the order (an AMD EPYC trained other
# bytes at 1 and 2 threads); its COMPATIBLE branch does, at no measured cost there.
MKL_CBWR = "AUTO,STRICT" if _intel() else "COMPATIBLE,STRICT"
os.environ.setdefault("MKL_CBWR", MKL_CBWR)
