"""The activations of ``models.activations`` re-expressed in Triton: one ``@triton.jit``
helper per kind (forward, derivative), dispatched on the constexpr KIND = ``KINDS.index``,
for the fused recurrence's kernels (``triton_scan``)."""

import triton
import triton.language as tl

from ..activations import KINDS

# The branches of _activation / _activation_grad below number the kinds in this order.
assert KINDS == ("tanh", "relu", "leaky_relu", "modrelu", "abs"), KINDS


@triton.jit
def _sign(z):
    return tl.where(z > 0, 1.0, 0.0) - tl.where(z < 0, 1.0, 0.0)


@triton.jit
def _tanh(z):  # via exp(-2|z|): no overflow, no cancellation near 0
    e = tl.exp(-2.0 * tl.abs(z))
    return _sign(z) * (1.0 - e) / (1.0 + e)


@triton.jit
def _tanh_grad(z):
    t = _tanh(z)
    return 1.0 - t * t


@triton.jit
def _relu(z):
    return tl.maximum(z, 0.0)


@triton.jit
def _relu_grad(z):
    return tl.where(z > 0, 1.0, 0.0)


@triton.jit
def _leaky_relu(z, slope):
    return tl.where(z > 0, z, z * slope)


@triton.jit
def _leaky_relu_grad(z, slope):
    return tl.where(z > 0, 1.0, 0.0) * (1.0 - slope) + slope


@triton.jit
def _modrelu(z, bias):  # scoRNN eq. 3: sign(z) relu(|z| + b)
    return _sign(z) * tl.maximum(tl.abs(z) + bias, 0.0)


@triton.jit
def _modrelu_grad(z, bias):
    return tl.where(((tl.abs(z) + bias) > 0) & (z != 0), 1.0, 0.0)


@triton.jit
def _abs(z):
    return tl.abs(z)


@triton.jit
def _abs_grad(z):
    return _sign(z)


@triton.jit
def _activation(z, bias, slope, KIND: tl.constexpr):
    if KIND == 0:
        out = _tanh(z)
    elif KIND == 1:
        out = _relu(z)
    elif KIND == 2:
        out = _leaky_relu(z, slope)
    elif KIND == 3:
        out = _modrelu(z, bias)
    else:  # KIND == 4 (the launcher passes KINDS.index of a checked kind)
        out = _abs(z)
    return out


@triton.jit
def _activation_grad(z, bias, slope, KIND: tl.constexpr):
    if KIND == 0:
        out = _tanh_grad(z)
    elif KIND == 1:
        out = _relu_grad(z)
    elif KIND == 2:
        out = _leaky_relu_grad(z, slope)
    elif KIND == 3:
        out = _modrelu_grad(z, bias)
    else:  # KIND == 4
        out = _abs_grad(z)
    return out


@triton.jit
def _bias_tile(bias_ptr, cols, col_ok, KIND: tl.constexpr, BN: tl.constexpr):
    if KIND == 3:
        b = tl.load(bias_ptr + cols, mask=col_ok, other=0.0)
    else:
        b = tl.zeros([BN], dtype=tl.float32)
    return b[None, :]
