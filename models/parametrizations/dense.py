"""An unconstrained dense transition (rnn, irnn, fastrnn): the baseline the papers
compare against. ``init`` picks PyTorch's nn.RNN initialisation or the identity (IRNN,
Le et al. 2015)."""

from __future__ import annotations

import torch
from torch import nn

from ..validation import check_choice, check_int
from .base import Parametrization


class DenseTransition(Parametrization):
    orthogonal = False
    constrained = False

    def __init__(self, size: int, init: str = "uniform"):
        super().__init__()
        n = self.size = check_int("hidden_size", size, 1)
        check_choice("init", init, ("uniform", "identity"))
        if init == "identity":
            weight = torch.eye(n)
        else:  # nn.RNN's default: U(-1/sqrt(n), 1/sqrt(n))
            weight = (torch.rand(n, n) * 2 - 1) / n**0.5
        self.weight = nn.Parameter(weight)

    trainable = ("weight",)

    def factors(self) -> dict:
        return {"weight": self.weight}

    def _set_factor(self, name: str, value: torch.Tensor) -> None:
        self.weight.copy_(value.to(self.weight))

    def matrix(self) -> torch.Tensor:
        return self.weight

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        return x @ self.weight if transpose else x @ self.weight.T
