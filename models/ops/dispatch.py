"""Which implementation an op runs: the pure-PyTorch reference or a Triton kernel.

``ORTHORNN_KERNELS`` (read at every call, so tests and users can switch it):
    auto       Triton when every tensor is on CUDA, triton imports, the op supports
               the shape and dtype and its kernel was not measured slower than the
               reference there; otherwise the reference (the default)
    triton     always Triton (also where it is slower); an error when that is
               impossible. CPU tensors need
               ``TRITON_INTERPRET=1`` set before the first kernel runs in the process
               (the interpreter runs the kernels with numpy: slow, for tests only)
    reference  always the pure-PyTorch reference
Triton is imported lazily, only when a kernel is about to run, so the package works
without it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

MODES = ("auto", "triton", "reference")
ENV = "ORTHORNN_KERNELS"
#: 32-bit registers a thread may use (PTX) and a block may hold (sm_80, sm_90).
MAX_REGISTERS = 255
REGISTER_FILE = 64 * 1024


def kernel_mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent: auto falls back to the reference
        return False
    return True


def use_triton(op: str, tensors, unsupported: str | None = None,
               slower: str | None = None) -> bool:
    """True when ``op`` should run its Triton kernel on ``tensors`` (None entries are
    skipped). ``unsupported`` is the op's reason it cannot take these inputs, or None
    (``triton`` mode raises it). ``slower`` is the op's reason its kernel is slower than
    the reference on these inputs, or None: ``auto`` then picks the reference, while
    ``triton`` mode runs the kernel anyway (it is correct there, only slower)."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    on_cuda = all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))
    if mode == "auto":
        return on_cuda and unsupported is None and slower is None and triton_available()
    if not triton_available():
        raise RuntimeError(f"{ENV}=triton but triton is not installed "
                           "(pip install '.[gpu]' in a checkout of orthornn, or the dev extra)")
    if not on_cuda and not interpreter_requested():
        raise RuntimeError(f"{ENV}=triton with CPU tensors needs TRITON_INTERPRET=1, set "
                           "before the first kernel runs (the interpreter runs them on the CPU)")
    if unsupported is not None:
        raise ValueError(f"{ENV}=triton: {op} {unsupported}")
    return True


def launch_options(num_warps: int) -> dict:
    """Triton launch options of every kernel here: ``num_warps`` and ``maxnreg``, all the
    registers a thread of such a block may have. The kernels run few programs (one per
    16 sequences, rows or columns), so blocks per SM do not matter, and without the bound
    ptxas at times spills a few bytes to use fewer registers (``scripts/compile_check.py``)."""
    return dict(num_warps=num_warps,
                maxnreg=min(MAX_REGISTERS, REGISTER_FILE // (32 * num_warps)))


def check_launch(kernel, tensor: torch.Tensor) -> None:
    """Kernels are built for the GPU or for the interpreter when their module is first
    imported; CPU tensors need the interpreter's build."""
    if not tensor.is_cuda and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                           "the first kernel runs in this process (the kernels were built "
                           "for the GPU)")
