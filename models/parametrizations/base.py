"""The interface every transition parametrization implements.

A parametrization is a small module that owns its parameters and turns them into
a matrix. It offers two equivalent views:

* ``matrix()``: the dense matrix, built with level-3 BLAS. The forward pass of a
  network materialises it once per call and uses plain matrix products.
* ``multiply(x)``: the factored, per-vector application of the papers (one reflector
  or one packed rotation at a time). It is the reference for the dense path, the
  graph that the factored ONNX export reproduces, and the cheap path when only a
  few vectors are multiplied.

``factors()`` names the tensors that determine ``matrix()`` (in the order the factored
ONNX functions take them; a composite form lists its parts as parametrizations), and
``set_factors(name=tensor)`` loads the trainable ones: the one way to set a
parametrization's value.

``multiply`` acts on row vectors: ``multiply(x) == x @ matrix().T`` for x of shape
[..., cols]; ``multiply(x, transpose=True) == x @ matrix()``.
"""

from __future__ import annotations

import torch
from torch import nn


class Parametrization(nn.Module):
    #: True when every value of the parameters gives an orthogonal matrix.
    orthogonal: bool = True
    #: True when the parameters are constrained ones (reflectors, angles, skew entries):
    #: they form the "orthogonal" optimizer group with its own learning rate.
    constrained: bool = True

    def matrix(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover - interface

    #: the names in factors() that set_factors accepts
    trainable: tuple[str, ...] = ()

    def factors(self) -> dict:  # pragma: no cover - interface
        raise NotImplementedError

    def set_factors(self, **values: torch.Tensor) -> None:
        """Load trainable factors, each in the shape factors() gives it."""
        current = self.factors()
        for name, value in values.items():
            if name not in self.trainable:
                raise ValueError(f"{type(self).__name__} factor must be one of "
                                 f"{', '.join(self.trainable)}; got {name!r}")
            value = torch.as_tensor(value)
            if tuple(value.shape) != tuple(current[name].shape):
                raise ValueError(f"{type(self).__name__} factor {name!r} must have shape "
                                 f"{tuple(current[name].shape)}; got {tuple(value.shape)}")
            with torch.no_grad():
                self._set_factor(name, value)

    def _set_factor(self, name: str, value: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError

    def regularization(self) -> torch.Tensor:
        """Penalty added to the loss (zero unless the parametrization defines one)."""
        return self._zero()

    def _zero(self) -> torch.Tensor:
        ref = next(self.parameters(), None)
        return torch.zeros((), dtype=ref.dtype if ref is not None else torch.get_default_dtype(),
                           device=ref.device if ref is not None else None)
