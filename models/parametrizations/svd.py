"""SVD form W = U diag(s) V^T with orthogonal factors given by parametrizations.

Square (Spectral-RNN eq. 6, DizzyRNN section 5) or rectangular (Spectral-RNN eq. 15):
for W of shape [rows, cols] with k = min(rows, cols),
W = U[:, :k] diag(s) V[:, :k]^T, i.e. U (diag(s) | 0) V^T with the zero block on the
side of the larger dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from ..validation import check_float, check_int
from .base import Parametrization


class BoundedSingularValues(nn.Module):
    """s_i = 2 r (sigmoid(p_i) - 0.5) + s* (Spectral-RNN eq. 7): s_i in (s* - r, s* + r)."""

    def __init__(self, count: int, r: float, sigma_star: float):
        super().__init__()
        self.r = check_float("r", r, 0.0)
        self.sigma_star = check_float("sigma_star", sigma_star, 0.0, low_open=True)
        if self.r >= self.sigma_star:
            raise ValueError(
                f"r must be smaller than sigma_star so singular values stay positive; "
                f"got r={self.r}, sigma_star={self.sigma_star}")
        self.logits = nn.Parameter(torch.zeros(check_int("singular values", count, 1)))

    def forward(self) -> torch.Tensor:
        return 2 * self.r * (torch.sigmoid(self.logits) - 0.5) + self.sigma_star

    def inverse(self, s: torch.Tensor) -> torch.Tensor:
        """The logits for which forward() returns s (each s_i inside the open interval)."""
        if not bool(((s - self.sigma_star).abs() < self.r).all()):
            raise ValueError(f"singular values must lie in ({self.sigma_star - self.r}, "
                             f"{self.sigma_star + self.r}) (sigma_star +- r)")
        return torch.logit((s - self.sigma_star) / (2 * self.r) + 0.5)

    def load(self, s: torch.Tensor) -> None:
        self.logits.copy_(self.inverse(s.to(self.logits)))

    def regularization(self) -> torch.Tensor:
        return self.logits.new_zeros(())


class FreeSingularValues(nn.Module):
    """Singular values trained directly, started at 1, penalised by lambda/2 ||s - 1||^2
    (DizzyRNN section 5.3)."""

    def __init__(self, count: int, penalty: float):
        super().__init__()
        self.penalty = check_float("svd_lambda", penalty, 0.0)
        self.values = nn.Parameter(torch.ones(check_int("singular values", count, 1)))

    def forward(self) -> torch.Tensor:
        return self.values

    def load(self, s: torch.Tensor) -> None:
        self.values.copy_(s.to(self.values))

    def regularization(self) -> torch.Tensor:
        return 0.5 * self.penalty * (self.values - 1).square().sum()


class SVDForm(Parametrization):
    orthogonal = False

    def __init__(self, left: Parametrization, singular: nn.Module, right: Parametrization):
        super().__init__()
        self.left, self.singular, self.right = left, singular, right
        self.rows, self.cols = left.size, right.size
        self.rank = min(self.rows, self.cols)
        self.size = self.rows if self.rows == self.cols else None  # square: a transition

    def singular_values(self) -> torch.Tensor:
        return self.singular()

    trainable = ("singular_values",)

    def factors(self) -> dict:
        """U and V (parametrizations) and the singular values s: W = U[:, :k] diag(s)
        V[:, :k]^T. The values, not their pre-image, so the map of eq. 7 stays here."""
        return {"left": self.left, "singular_values": self.singular_values(),
                "right": self.right}

    def _set_factor(self, name: str, value: torch.Tensor) -> None:
        self.singular.load(value)

    def matrix(self) -> torch.Tensor:
        k = self.rank
        u = self.left.matrix()[:, :k]
        v = self.right.matrix()[:, :k]
        return (u * self.singular_values()) @ v.T

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        # W x = U (s * (V^T x)); W^T x = V (s * (U^T x)). Row-vector convention.
        first, last, out = (self.left, self.right, self.cols) if transpose else \
            (self.right, self.left, self.rows)
        y = first.multiply(x, transpose=True)[..., : self.rank] * self.singular_values()
        if out > self.rank:
            y = torch.cat([y, y.new_zeros(*y.shape[:-1], out - self.rank)], dim=-1)
        return last.multiply(y)

    def regularization(self) -> torch.Tensor:
        return self.singular.regularization()
