"""Elementwise nonlinearities of the papers: one forward formula and one derivative
per kind, shared by the module below, the scan op's explicit backward and (later)
the GPU kernels and export.

    tanh, relu, leaky_relu(slope)
    modrelu(b) = sign(z) relu(|z| + b)      scoRNN eq. 3, trainable bias b
    abs(z) = |z|                            DizzyRNN 4.3: |g'| = 1 keeps gradient norms
"""

from __future__ import annotations

import torch
from torch import nn

from .validation import check_choice, check_float

# The one table of activation kinds: the torch functions below, the Triton kernels
# (models/ops/triton_scan.py, KIND = index here) and the ONNX builder
# (export/builder/onnx_export.py) are keyed by these names, and each raises on any other.
KINDS = ("tanh", "relu", "leaky_relu", "modrelu", "abs")


def check_kind(kind: str) -> str:
    return check_choice("activation", kind, KINDS)


def activation_forward(kind: str, z: torch.Tensor, slope: float = 0.01,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    if kind == "tanh":
        return torch.tanh(z)
    if kind == "relu":
        return torch.relu(z)
    if kind == "leaky_relu":
        return nn.functional.leaky_relu(z, slope)
    if kind == "abs":
        return z.abs()
    if kind == "modrelu":
        return torch.sign(z) * torch.relu(z.abs() + bias)
    raise ValueError(f"activation must be one of {', '.join(KINDS)}; got {kind!r}")


def activation_derivative(kind: str, z: torch.Tensor, slope: float = 0.01,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """g'(z), elementwise (dL/dz = g'(z) * dL/dg)."""
    if kind == "tanh":
        return 1 - torch.tanh(z).square()
    if kind == "relu":
        return (z > 0).to(z.dtype)
    if kind == "leaky_relu":
        return (z > 0).to(z.dtype) * (1 - slope) + slope
    if kind == "abs":
        return torch.sign(z)
    if kind == "modrelu":  # sign(z)^2 on the active set |z| + b > 0
        return (((z.abs() + bias) > 0) & (z != 0)).to(z.dtype)
    raise ValueError(f"activation must be one of {', '.join(KINDS)}; got {kind!r}")


def modrelu_bias_grad(z: torch.Tensor, d_z: torch.Tensor) -> torch.Tensor:
    """dL/db of modReLU summed over the leading dims, from dL/dz: dg/db = sign(z) on the
    active set, and dL/dz is already zero off it, so dL/db = sum(dL/dz * sign(z))."""
    return (d_z * torch.sign(z)).reshape(-1, z.shape[-1]).sum(0)


class Activation(nn.Module):
    def __init__(self, kind: str, size: int, negative_slope: float = 0.01):
        super().__init__()
        self.kind = check_kind(kind)
        self.negative_slope = check_float("negative_slope", negative_slope, 0.0, 1.0)
        # modReLU's trainable bias (scoRNN section 4.1); None for the other kinds.
        self.bias = nn.Parameter(torch.zeros(size)) if kind == "modrelu" else None

    def extra_repr(self) -> str:
        return self.kind + (f", negative_slope={self.negative_slope}"
                            if self.kind == "leaky_relu" else "")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return activation_forward(self.kind, z, self.negative_slope, self.bias)
