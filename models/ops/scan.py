"""``torch.ops.orthornn.rnn_scan``: the whole recurrence as one op (forward and backward).

The op's CPU implementation is the reference (``models.ops.reference``); on CUDA, or
on the CPU under the Triton interpreter, ``models.ops.dispatch`` picks the fused Triton
kernels of ``models.ops.triton_scan``. Both paths save the same two tensors for the
backward, the pre-activations Z [B, T, n] and the carried states [B, T + 1, n], and
share ``scan_parameter_grads`` (dW as one matrix product).

The op returns (states, last, pre, carried); ``rnn_scan`` below hands back the first
two. pre and carried are residuals for the backward, not differentiable outputs.
"""

import os

import torch
from torch import Tensor

from ..activations import check_kind
from . import reference
from .dispatch import use_triton

#: Hidden sizes the Triton scan takes (``ORTHORNN_KERNELS=triton``; an error above).
#: Above the on-chip limit of ``triton_scan`` W is streamed from L2 each step.
MAX_TRITON_HIDDEN = 1024
#: Largest hidden size ``auto`` runs the Triton scan at: the largest where it was measured
#: faster than the reference loop (docs/gpu.md, "Measured on a GPU"; H200,
#: bench/results/gpu/ops-grid.json). At n = 256 the fused scan is 2.2x to 2.8x faster
#: forward + backward (T = 128, B = 64: 6.2 ms against 14.7 ms); at n = 512 it is slower
#: at every T and B measured (0.5x to 0.8x; T = 128, B = 64: 22.0 ms against 16.6 ms, and
#: 10.5 against 7.2 ms forward alone), so auto picks the reference above this size.
#: ``ORTHORNN_KERNELS=triton`` still runs the kernel up to ``MAX_TRITON_HIDDEN``.
MAX_AUTO_HIDDEN = 256

#: Column programs per group of 16 sequences of the Triton scan, by shape: ((largest n,
#: largest B), programs), the first entry that covers (n, B) applies, 1 (one program per
#: group, the kernel measured in docs/gpu.md) elsewhere. With more than one, the programs
#: of a group split each step's output columns and meet at a grid-wide barrier per step
#: (``triton_scan``). Filled in from ``bench/perf/ops.py --columns``'s table on a GPU:
#: empty until that has run, since a split pays a barrier per step that only a
#: measurement can weigh against the columns it spreads.
COLUMN_TABLE: tuple[tuple[tuple[int, int], int], ...] = ()
#: Overrides the table (a positive integer, or ``auto`` for the table): how
#: ``bench/perf/ops.py`` measures each split, and how the tests force one.
COLUMNS_ENV = "ORTHORNN_SCAN_COLUMNS"


def _unsupported(u: Tensor, weight: Tensor) -> str | None:
    if u.dtype != torch.float32 or weight.dtype != torch.float32:
        return f"supports float32 only; got {u.dtype}"
    if u.shape[-1] > MAX_TRITON_HIDDEN:
        return f"supports hidden sizes up to {MAX_TRITON_HIDDEN}; got {u.shape[-1]}"
    return None


def _slower(u: Tensor) -> str | None:
    if u.shape[-1] > MAX_AUTO_HIDDEN:
        return (f"is slower than the reference above hidden size {MAX_AUTO_HIDDEN}; "
                f"got {u.shape[-1]}")
    return None


def columns_for(n: int, batch: int) -> int:
    """Column programs per group requested for hidden size n and batch B: the
    ``ORTHORNN_SCAN_COLUMNS`` override, else ``COLUMN_TABLE`` (the launcher then caps it
    at the tiles of n and, on a GPU, at what stays resident)."""
    value = os.environ.get(COLUMNS_ENV, "auto").strip().lower() or "auto"
    if value != "auto":
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{COLUMNS_ENV} must be a positive integer or auto; got {value!r}")
        return int(value)
    for (max_n, max_b), columns in COLUMN_TABLE:
        if n <= max_n and batch <= max_b:
            return columns
    return 1


def _columns(u: Tensor) -> int:
    from . import triton_scan

    batch, _, n = u.shape
    return triton_scan.column_programs(n, batch, columns_for(n, batch), u.device)


def _triton(u: Tensor, weight: Tensor, *others) -> bool:
    return use_triton("rnn_scan", (u, weight, *others), _unsupported(u, weight), _slower(u))


@torch.library.custom_op("orthornn::rnn_scan", mutates_args=())
def _scan(u: Tensor, weight: Tensor, h0: Tensor, lengths: Tensor | None, a: Tensor | None,
          b2: Tensor | None, bias: Tensor | None, activation: str, slope: float,
          keep: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``keep``: return the residuals (pre, carried); empty tensors otherwise (no backward)."""
    if _triton(u, weight, h0, lengths, a, b2, bias):
        from . import triton_scan

        states, last, pre, carried = triton_scan.scan_forward(
            u, weight, h0, lengths, a, b2, bias, activation, slope, keep, _columns(u))
    else:
        states, last, pre, carried = reference.scan_forward(
            u, weight, h0, lengths, a, b2, bias, activation, slope, keep)
        last = last.clone()  # never alias an input or another output (custom-op rule)
    if not keep:
        pre, carried = u.new_empty(0), u.new_empty(0)
    return states, last, pre, carried


@_scan.register_fake
def _(u, weight, h0, lengths, a, b2, bias, activation, slope, keep):
    batch, steps, n = u.shape
    if not keep:
        return u.new_empty(batch, steps, n), u.new_empty(batch, n), u.new_empty(0), u.new_empty(0)
    return (u.new_empty(batch, steps, n), u.new_empty(batch, n),
            u.new_empty(batch, steps, n), u.new_empty(batch, steps + 1, n))


@torch.library.custom_op("orthornn::rnn_scan_backward", mutates_args=())
def _scan_backward(d_states: Tensor | None, d_last: Tensor | None, weight: Tensor, pre: Tensor,
                   carried: Tensor, lengths: Tensor | None, a: Tensor | None,
                   b2: Tensor | None, bias: Tensor | None, activation: str, slope: float,
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(dL/dZ [B, T, n], dL/d(cell output) [B, T, n] (empty when ungated), dL/dh0 [B, n])."""
    if _triton(pre, weight, d_states, d_last, carried, lengths, a, b2, bias):
        from . import triton_scan

        d_pre, d_out, d_h0 = triton_scan.scan_backward(
            d_states, d_last, weight, pre, lengths, a, b2, bias, activation, slope,
            _columns(pre))
    else:
        d_pre, d_out, d_h0 = reference.scan_backward(
            d_states, d_last, weight, pre, carried, lengths, a, b2, bias, activation, slope)
    return d_pre, pre.new_empty(0) if d_out is None else d_out, d_h0


@_scan_backward.register_fake
def _(d_states, d_last, weight, pre, carried, lengths, a, b2, bias, activation, slope):
    return (torch.empty_like(pre), torch.empty_like(pre) if a is not None else pre.new_empty(0),
            carried.new_empty(carried.shape[0], carried.shape[2]))


def _setup_context(ctx, inputs, output):
    _, weight, _, lengths, a, b2, bias, activation, slope, _keep = inputs
    ctx.save_for_backward(weight, output[2], output[3], lengths, a, b2, bias)
    ctx.activation, ctx.slope = activation, slope
    ctx.set_materialize_grads(False)  # an unused output (often `states`) costs nothing


def _backward(ctx, d_states, d_last, _d_pre, _d_carried):
    weight, pre, carried, lengths, a, b2, bias = ctx.saved_tensors
    if carried.numel() == 0:
        raise RuntimeError("rnn_scan ran with keep=False (no residuals saved); it has no backward")
    kind, slope = ctx.activation, ctx.slope
    d_pre, d_out, d_h0 = torch.ops.orthornn.rnn_scan_backward(
        d_states, d_last, weight, pre, carried, lengths, a, b2, bias, kind, slope)
    d_weight, d_a, d_b2, d_bias = reference.scan_parameter_grads(
        d_pre, d_out if a is not None else None, pre, carried, a, bias, kind, slope)
    return d_pre, d_weight, d_h0, None, d_a, d_b2, d_bias, None, None, None


_scan.register_autograd(_backward, setup_context=_setup_context)


def _check(u, weight, h0, lengths, bias, gates, activation) -> None:
    check_kind(activation)
    if not isinstance(u, Tensor) or u.dim() != 3 or not u.is_floating_point():
        raise ValueError(f"u must be a float tensor [B, T, n]; got {getattr(u, 'shape', u)!r}")
    batch, steps, n = u.shape
    if min(batch, steps, n) < 1:
        raise ValueError(f"u must have at least one sequence, step and unit; got {tuple(u.shape)}")
    if not isinstance(weight, Tensor) or weight.shape != (n, n):
        raise ValueError(f"weight must be a tensor [{n}, {n}]; "
                         f"got {getattr(weight, 'shape', weight)!r}")
    if h0 is not None and (not isinstance(h0, Tensor) or h0.shape != (batch, n)):
        raise ValueError(f"h0 must be a tensor [{batch}, {n}]; got {getattr(h0, 'shape', h0)!r}")
    if lengths is not None and (lengths.shape != (batch,) or lengths.is_floating_point()):
        raise ValueError(f"lengths must be an integer tensor [{batch}]; got {lengths.dtype} "
                         f"{tuple(lengths.shape)}")
    if (activation == "modrelu") != (bias is not None):
        raise ValueError("bias must be a tensor [n] for activation 'modrelu' and None otherwise")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be a tensor [{n}]; got {tuple(bias.shape)}")
    if gates is not None and (len(gates) != 2 or any(g.dim() != 0 for g in gates)):
        raise ValueError("gates must be a pair of 0-dim tensors (a, b2)")


def rnn_scan(u: Tensor, weight: Tensor, h0: Tensor | None = None, lengths: Tensor | None = None,
             *, activation: str = "relu", slope: float = 0.01, bias: Tensor | None = None,
             gates: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """h_t = g(u_t + W h_{t-1}) (or the gated form) over u [B, T, n] with W [n, n]:
    (states [B, T, n], last [B, n]). See ``models.ops.reference`` for the semantics."""
    _check(u, weight, h0, lengths, bias, gates, activation)
    if h0 is None:
        h0 = u.new_zeros(u.shape[0], u.shape[2])
    if lengths is not None:
        lengths = lengths.to(device=u.device, dtype=torch.long)
    a, b2 = gates if gates is not None else (None, None)
    # Residuals for the backward only when one can follow (inference saves nothing).
    keep = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (u, weight, h0, a, b2, bias))
    states, last, _, _ = torch.ops.orthornn.rnn_scan(u, weight, h0, lengths, a, b2, bias,
                                                     activation, float(slope), keep)
    return states, last
