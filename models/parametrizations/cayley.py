"""Scaled Cayley transform (scoRNN, Theorem 3.1): W = (I + A)^{-1} (I - A) D.

A is skew-symmetric, stored as its n (n - 1) / 2 strictly upper entries; D is a fixed
diagonal of +-1 with ``rho`` entries equal to -1 (placed first). Autograd through the
solve gives exactly the gradient of Theorem 3.2, dL/dA = V^T - V with
V = (I + A)^{-T} dL/dW (D + W^T); the tests check this.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..validation import check_int
from .base import Parametrization


class ScaledCayley(Parametrization):
    orthogonal = True

    def __init__(self, size: int, rho: int | None = None, *,
                 generator: torch.Generator | None = None):
        super().__init__()
        n = self.size = check_int("hidden_size", size, 1)
        self.rho = check_int("rho", n // 2 if rho is None else rho, 0, n)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("upper_index", rows * n + cols, persistent=False)
        diag = torch.ones(n)
        diag[: self.rho] = -1
        self.register_buffer("diagonal", diag)
        self.skew = nn.Parameter(self.block_init(n, generator)[rows, cols])

    def extra_repr(self) -> str:
        return f"size={self.size}, rho={self.rho}"

    @staticmethod
    def block_init(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """scoRNN section 4.2: A is zero except 2x2 blocks [[0, s_j], [-s_j, 0]] on the
        diagonal, s_j = sqrt((1 - cos t_j) / (1 + cos t_j)), t_j ~ U[0, pi/2], so the
        Cayley transform has eigenvalues e^{+-i t_j} spread on the right half circle."""
        a = torch.zeros(n, n)
        blocks = n // 2
        t = torch.rand(blocks, generator=generator) * (math.pi / 2)
        s = torch.sqrt((1 - torch.cos(t)) / (1 + torch.cos(t)))
        idx = torch.arange(blocks) * 2
        a[idx, idx + 1] = s
        a[idx + 1, idx] = -s
        return a

    def skew_matrix(self) -> torch.Tensor:
        n = self.size
        upper = self.skew.new_zeros(n * n).scatter(0, self.upper_index, self.skew).view(n, n)
        return upper - upper.T

    trainable = ("skew",)

    def factors(self) -> dict:
        """skew: A's strictly upper entries, row-major; upper_index: their flat
        positions in A [n, n]; diagonal: D."""
        return {"skew": self.skew, "upper_index": self.upper_index, "diagonal": self.diagonal}

    def _set_factor(self, name: str, value: torch.Tensor) -> None:
        self.skew.copy_(value.to(self.skew))

    def matrix(self) -> torch.Tensor:
        a = self.skew_matrix()
        # (I + A)^{-1} (I - A) D: one LU solve; the D scaling multiplies columns. The
        # solve runs in float64: its orthogonality error grows with cond(I + A), and an
        # n x n solve costs little next to the recurrence.
        a64 = a.double()
        eye = torch.eye(self.size, dtype=torch.float64, device=a.device)
        w = torch.linalg.solve(eye + a64, eye - a64) * self.diagonal.double()
        return w.to(a.dtype)

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        # Factored view (scoRNN section 4, "layers"): x -> D x -> (I - A) x -> (I + A)^{-1} x.
        a = self.skew_matrix()
        eye = torch.eye(self.size, dtype=a.dtype, device=a.device)
        d = self.diagonal.to(a.dtype)
        if transpose:  # W^T x = D (I - A)^T (I + A)^{-T} x = D (I + A) (I - A)^{-1} x
            y = torch.linalg.solve(eye - a, x.unsqueeze(-1)).squeeze(-1)
            return (y @ (eye - a)) * d  # row-vector form of (I + A) y is y (I + A)^T = y (I - A)
        y = (x * d) @ (eye + a)  # row-vector form of (I - A) D x
        return torch.linalg.solve(eye + a, y.unsqueeze(-1)).squeeze(-1)
