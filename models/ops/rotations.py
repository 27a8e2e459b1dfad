"""A chain of packed rotations (and optional fixed permutations) applied to the rows
of a matrix, with an explicit backward.

    X_{j} = R_j Q_j X_{j+1}, j = k .. 1,   output X_1 = R_1 Q_1 ... R_k Q_k X

R_j is one packed rotation in the per-coordinate form of ``models.parametrizations
.givens.rotate_pairs``: (R x)[r] = cos[j, r] x[r] + sin[j, r] x[partner[j, r]];
Q_j x = x[perm[j]] (identity when no permutations are given). Building W = chain(I)
through autograd costs an index-add per rotation; here the backward is
G <- R_j^T G = cos G + (sin G)[partner], then G <- Q_j^T G, with dL/dcos and dL/dsin
as row-wise dot products against the saved inputs of each rotation.
"""

from __future__ import annotations

import torch


def _forward(x, cos, sin, partner, perms, keep: bool):
    inputs = []
    for j in reversed(range(cos.shape[0])):
        if perms is not None:
            x = x.index_select(0, perms[j])
        if keep:
            inputs.append(x)
        x = torch.addcmul(x * cos[j], x.index_select(0, partner[j]), sin[j])
    return x, inputs[::-1]


class _RotationChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, partner, perms):
        out, inputs = _forward(x, cos.unsqueeze(-1), sin.unsqueeze(-1), partner, perms, True)
        ctx.save_for_backward(cos, sin, partner, perms, torch.stack(inputs))
        return out

    @staticmethod
    def backward(ctx, grad):
        cos, sin, partner, perms, inputs = ctx.saved_tensors
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
        return grad, d_cos, d_sin, None, None


def rotation_chain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   partner: torch.Tensor, perms: torch.Tensor | None = None) -> torch.Tensor:
    """R_1 Q_1 ... R_k Q_k x for x [n, N] (rotations act on rows); cos, sin, partner and
    perms are [k, n]."""
    return _RotationChain.apply(x, cos, sin, partner, perms)
