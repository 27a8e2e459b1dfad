"""A chain of packed rotations (and optional fixed permutations) applied to the rows
of a matrix, with an explicit backward: the op ``torch.ops.orthornn.givens_apply``.

    X_{j} = R_j Q_j X_{j+1}, j = k .. 1,   output X_1 = R_1 Q_1 ... R_k Q_k X

R_j is one packed rotation in the per-coordinate form of ``models.parametrizations
.givens.rotate_pairs``: (R x)[r] = cos[j, r] x[r] + sin[j, r] x[partner[j, r]];
Q_j x = x[perm[j]] (identity when no permutations are given). Building W = chain(I)
through autograd costs an index-add per rotation; here the backward is
G <- R_j^T G = cos G + (sin G)[partner], then G <- Q_j^T G, with dL/dcos and dL/dsin
as row-wise dot products against the saved inputs of each rotation.

The functions below are the CPU (reference) implementation; ``models.ops.triton_chains``
holds the Triton kernels ``models.ops.dispatch`` picks on the GPU.
"""

import torch
from torch import Tensor

from .dispatch import use_triton


def chain_forward(x, cos, sin, partner, perms, keep: bool):
    """(output, inputs [k, n, N] of every rotation, or an empty tensor unless ``keep``)."""
    inputs = []
    c, s = cos.unsqueeze(-1), sin.unsqueeze(-1)
    for j in reversed(range(cos.shape[0])):
        if perms is not None:
            x = x.index_select(0, perms[j])
        if keep:
            inputs.append(x)
        x = torch.addcmul(x * c[j], x.index_select(0, partner[j]), s[j])
    return x, torch.stack(inputs[::-1]) if keep else x.new_empty(0)


def chain_backward(grad, inputs, cos, sin, partner, perms):
    """(dL/dx, dL/dcos, dL/dsin) from dL/doutput and the saved rotation inputs."""
    d_cos, d_sin = torch.empty_like(cos), torch.empty_like(sin)
    inverse = torch.argsort(perms, dim=1) if perms is not None else None
    c, s = cos.unsqueeze(-1), sin.unsqueeze(-1)
    for j in range(cos.shape[0]):  # R_1 first: it was applied last
        x_in = inputs[j]
        d_cos[j] = (grad * x_in).sum(1)
        d_sin[j] = (grad * x_in.index_select(0, partner[j])).sum(1)
        grad = grad * c[j] + (grad * s[j]).index_select(0, partner[j])
        if inverse is not None:
            grad = grad.index_select(0, inverse[j])
    return grad, d_cos, d_sin


#: Most rows the Triton kernels take (in auto mode; more run the reference).
MAX_TRITON_ROWS = 1024


def _unsupported(x: Tensor) -> str | None:
    if x.dtype != torch.float32:
        return f"supports float32 only; got {x.dtype}"
    if x.shape[0] > MAX_TRITON_ROWS:
        return f"supports up to {MAX_TRITON_ROWS} rows; got {x.shape[0]}"
    return None


def _triton(x, *others) -> bool:
    return use_triton("givens_apply", (x, *others), _unsupported(x))


@torch.library.custom_op("orthornn::givens_apply", mutates_args=())
def _chain(x: Tensor, cos: Tensor, sin: Tensor, partner: Tensor, perms: Tensor | None,
           keep_inputs: bool) -> tuple[Tensor, Tensor]:
    if _triton(x, cos, sin, partner, perms):
        from . import triton_chains

        return triton_chains.givens_forward(x, cos, sin, partner, perms, keep_inputs)
    return chain_forward(x, cos, sin, partner, perms, keep_inputs)


@_chain.register_fake
def _(x, cos, sin, partner, perms, keep_inputs):
    saved = x.new_empty(cos.shape[0], *x.shape) if keep_inputs else x.new_empty(0)
    return torch.empty_like(x), saved


@torch.library.custom_op("orthornn::givens_apply_backward", mutates_args=())
def _chain_backward(grad: Tensor, inputs: Tensor, cos: Tensor, sin: Tensor, partner: Tensor,
                    perms: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if _triton(grad, inputs, cos, sin, partner, perms):
        from . import triton_chains

        return triton_chains.givens_backward(grad, inputs, cos, sin, partner, perms)
    return chain_backward(grad, inputs, cos, sin, partner, perms)


@_chain_backward.register_fake
def _(grad, inputs, cos, sin, partner, perms):
    return torch.empty_like(grad), torch.empty_like(cos), torch.empty_like(sin)


def _setup_context(ctx, inputs, output):
    _, cos, sin, partner, perms, _ = inputs
    ctx.save_for_backward(output[1], cos, sin, partner, perms)


def _backward(ctx, grad, _d_inputs):
    inputs, cos, sin, partner, perms = ctx.saved_tensors
    if inputs.numel() == 0 and grad is not None and cos.numel():
        raise RuntimeError("givens_apply was called with keep_inputs=False; it has no backward")
    d_x, d_cos, d_sin = torch.ops.orthornn.givens_apply_backward(
        grad, inputs, cos, sin, partner, perms)
    return d_x, d_cos, d_sin, None, None, None


_chain.register_autograd(_backward, setup_context=_setup_context)


def rotation_chain(x: Tensor, cos: Tensor, sin: Tensor, partner: Tensor,
                   perms: Tensor | None = None) -> Tensor:
    """R_1 Q_1 ... R_k Q_k x for x [n, N] (rotations act on rows); cos, sin, partner and
    perms are [k, n]."""
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a tensor [n, N]; got {getattr(x, 'shape', x)!r}")
    shape = (cos.shape[0], x.shape[0])
    for name, value in (("cos", cos), ("sin", sin), ("partner", partner), ("perms", perms)):
        if value is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} must be a tensor {list(shape)}; got {tuple(value.shape)}")
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin))
    return torch.ops.orthornn.givens_apply(x, cos, sin, partner, perms, keep)[0]


givens_apply = rotation_chain  # the op's name in torch.ops.orthornn
