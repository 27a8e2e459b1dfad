"""Householder reflector chains (Spectral-RNN eq. 1, 8): the op
``torch.ops.orthornn.householder_apply`` and the compact-WY dense matrix.

Y [n, m] holds one reflector per column, H(y) = I - 2 y y^T / ||y||^2 (a zero column is
the identity, eq. 1). U = H(y_0) H(y_1) ... H(y_{m-1}).

* ``householder_apply(x, y, transpose)``: x [..., n] -> x U^T (or x U), one reflector
  at a time (eq. 8): O(m n) per vector, the factored inference path. The backward
  walks the chain in reverse and, as every reflector is an involution, recovers each
  reflector's input from its output instead of saving m intermediate batches.
* ``householder_matrix(y)``: U by the compact WY form, level-3 BLAS only (cuBLAS on
  the GPU, where ``bench/perf/ops.py`` times it against torch.linalg.householder_product).
"""

import torch
from torch import Tensor

from .dispatch import use_triton


def _scales(y: Tensor) -> Tensor:
    """2 / ||y_i||^2 per column, 0 for a zero column (the identity)."""
    scale = 2 / (y * y).sum(0)
    return torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))


def _order(m: int, transpose: bool, backward: bool = False):
    # x @ U^T applies the rightmost reflector first; x @ U the leftmost first.
    forward = range(m) if transpose else reversed(range(m))
    return reversed(list(forward)) if backward else forward


def apply_reference(x: Tensor, y: Tensor, transpose: bool) -> Tensor:
    """Per-vector reference, one reflector at a time (eq. 8):
    H(u) h = h - 2 (u^T h / u^T u) u."""
    scale = _scales(y)
    for i in _order(y.shape[1], transpose):
        u = y[:, i]
        x = x - (scale[i] * (x @ u)).unsqueeze(-1) * u
    return x


def apply_backward_reference(grad: Tensor, out: Tensor, y: Tensor, transpose: bool):
    """(dL/dx, dL/dy) of ``apply_reference`` from dL/dout and out. For one reflector
    out = x - s c u with c = x.u, s = 2 / u.u:
        dL/dx = H(u) G,   dL/du = -s sum_b (c_b G_b + (G_b.u) x_b) + s^2 (sum_b c_b G_b.u) u."""
    scale = _scales(y)
    d_y = torch.zeros_like(y)
    for i in _order(y.shape[1], transpose, backward=True):
        u, s = y[:, i], scale[i]
        x = out - (s * (out @ u)).unsqueeze(-1) * u  # H(u) is its own inverse
        c, gu = x @ u, grad @ u
        d_y[:, i] = -s * (c @ grad + gu @ x) + s * s * (c @ gu) * u
        grad = grad - (s * gu).unsqueeze(-1) * u
        out = x
    return grad, d_y


#: Largest n the Triton kernels take (in auto mode; larger runs the reference).
MAX_TRITON_SIZE = 4096


def _unsupported(x: Tensor, y: Tensor) -> str | None:
    if x.dtype != torch.float32 or y.dtype != torch.float32:
        return f"supports float32 only; got {x.dtype}"
    if y.shape[0] > MAX_TRITON_SIZE:
        return f"supports sizes up to {MAX_TRITON_SIZE}; got {y.shape[0]}"
    return None


def _triton(x, y, *others) -> bool:
    return use_triton("householder_apply", (x, y, *others), _unsupported(x, y))


@torch.library.custom_op("orthornn::householder_apply", mutates_args=())
def _apply(x: Tensor, y: Tensor, transpose: bool) -> Tensor:
    if _triton(x, y):
        from . import triton_chains

        return triton_chains.householder_forward(x, y, transpose)
    return apply_reference(x, y, transpose)


@_apply.register_fake
def _(x, y, transpose):
    return torch.empty_like(x)


@torch.library.custom_op("orthornn::householder_apply_backward", mutates_args=())
def _apply_backward(grad: Tensor, out: Tensor, y: Tensor, transpose: bool,
                    ) -> tuple[Tensor, Tensor]:
    if _triton(grad, y, out):
        from . import triton_chains

        return triton_chains.householder_backward(grad, out, y, transpose)
    return apply_backward_reference(grad, out, y, transpose)


@_apply_backward.register_fake
def _(grad, out, y, transpose):
    return torch.empty_like(grad), torch.empty_like(y)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output, inputs[1])
    ctx.transpose = inputs[2]


def _backward(ctx, grad):
    out, y = ctx.saved_tensors
    d_x, d_y = torch.ops.orthornn.householder_apply_backward(grad, out, y, ctx.transpose)
    return d_x, d_y, None


_apply.register_autograd(_backward, setup_context=_setup_context)


def householder_apply(x: Tensor, y: Tensor, transpose: bool = False) -> Tensor:
    """x [..., n] @ U^T (``transpose``: @ U) for U the product of the reflectors in the
    columns of y [n, m]."""
    if not isinstance(y, Tensor) or y.dim() != 2:
        raise ValueError(f"y must be a tensor [n, m]; got {getattr(y, 'shape', y)!r}")
    if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != y.shape[0]:
        raise ValueError(f"x must be a tensor [..., {y.shape[0]}]; "
                         f"got {getattr(x, 'shape', x)!r}")
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.orthornn.householder_apply(flat, y, bool(transpose)).reshape(x.shape)


def householder_matrix(y: Tensor) -> Tensor:
    """U = H(y_0) ... H(y_{m-1}) [n, n] in compact WY form (Schreiber & Van Loan;
    Joffrain et al. 2006): U = I - Y T Y^T with T^{-1} = striu(Y^T Y) + diag(||y_i||^2 / 2).
    One Gram product and one triangular solve: level-3 BLAS throughout."""
    gram = y.T @ y
    half_norms = gram.diagonal() / 2
    # A zero vector is the identity (eq. 1); its column of Y is zero, so any
    # non-zero diagonal entry decouples it from T without changing the product.
    half_norms = torch.where(half_norms > 0, half_norms, torch.ones_like(half_norms))
    t_inv = torch.triu(gram, diagonal=1) + torch.diag(half_norms)
    t_yt = torch.linalg.solve_triangular(t_inv, y.T, upper=True)
    return torch.eye(y.shape[0], dtype=y.dtype, device=y.device) - y @ t_yt
