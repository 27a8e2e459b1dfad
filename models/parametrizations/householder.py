"""Products of Householder reflectors (Spectral-RNN eq. 1-2, 8; oRNN).

``HouseholderChain(n, m)`` is U = H_n(u_n) H_{n-1}(u_{n-1}) ... H_{n-m+1}(u_{n-m+1}),
where H_k(u) reflects the last k coordinates: H_k(u) = I - 2 û û^T / ||û||^2 with
û = (0_{n-k}, u), and H_k(0) = I (eq. 1). Reflector i (i = 0 .. m-1) is H_{n-i}; it
has n - i free entries, so the chain holds m n - m (m - 1) / 2 parameters, the count
the paper's parameter formula uses.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.householder import householder_apply, householder_matrix
from ..validation import check_int
from .base import Parametrization


class HouseholderChain(Parametrization):
    orthogonal = True

    def __init__(self, size: int, reflectors: int | None = None, *, name: str = "m"):
        super().__init__()
        self.size = check_int("hidden_size", size, 1)
        self.reflectors = check_int(name, size if reflectors is None else reflectors, 1, size)
        n, m = self.size, self.reflectors
        # Packed storage: reflector i owns rows i..n-1 of column i of Y (n x m).
        rows = torch.cat([torch.arange(i, n) for i in range(m)])
        cols = torch.cat([torch.full((n - i,), i) for i in range(m)])
        self.register_buffer("flat_index", rows * m + cols, persistent=False)
        self.vectors = nn.Parameter(torch.randn(rows.numel()) / n**0.5)

    def extra_repr(self) -> str:
        return f"size={self.size}, reflectors={self.reflectors}"

    def reflector_matrix(self) -> torch.Tensor:
        """Y [n, m]: column i is û for reflector i (zeros above row i)."""
        n, m = self.size, self.reflectors
        y = self.vectors.new_zeros(n * m).scatter(0, self.flat_index, self.vectors)
        return y.view(n, m)

    trainable = ("reflectors",)

    def factors(self) -> dict:
        return {"reflectors": self.reflector_matrix()}

    def _set_factor(self, name: str, y: torch.Tensor) -> None:
        # Y [n, m]; the entries above row i of column i are ignored
        self.vectors.copy_(y.reshape(-1)[self.flat_index].to(self.vectors))

    def matrix(self) -> torch.Tensor:
        return householder_matrix(self.reflector_matrix())  # compact WY, level-3 BLAS

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        # One reflector at a time (eq. 8), the op torch.ops.orthornn.householder_apply.
        return householder_apply(x, self.reflector_matrix(), transpose)
