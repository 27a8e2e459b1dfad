"""The recurrence in plain PyTorch: the reference every faster path must equal.

    z_t = u_t + W h_{t-1},   h_t = g(z_t)                     (ungated)
    h_t = a g(z_t) + b2 h_{t-1}                               (FastRNN / SGORNN eq. 1)

u [B, T, n] is the precomputed input projection plus bias, g an activation kind of
``models.activations``. With ``lengths``, step t only updates sequences with
t < length: the last state is each sequence's own final state and states at padded
steps are zero, so padding never changes a result.

Two users share one forward loop:
* the op ``torch.ops.orthornn.rnn_scan`` (dense W; ``models.ops.scan``, which imports
  this module, never the other way round): its CPU implementation is ``scan_forward``
  / ``scan_backward`` below. The
  backward is one reverse scan for dz_t, then dW = sum_t dz_t h_{t-1}^T as a single
  matrix product (``scan_parameter_grads``, shared with the Triton path); it saves
  only the pre-activations and the carried states.
* ``rnn_scan_steps`` (any callable h -> W h, e.g. the per-step reflector chain): plain
  autograd through the loop, the papers' factored formulation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..activations import activation_derivative, activation_forward, modrelu_bias_grad


def step_masks(lengths: torch.Tensor | None, steps: int, device) -> torch.Tensor | None:
    """[T, B, 1] bool: step t is live for sequence b (t < lengths[b])."""
    if lengths is None:
        return None
    mask = torch.arange(steps, device=device)[:, None] < lengths.to(device)[None, :]
    return mask.unsqueeze(-1)


def _scan_loop(u, transition, act, h0, mask, gates, record: bool = False):
    """The one forward loop. u [B, T, n]; transition a dense W or a callable.
    Returns states [B, T, n], last [B, n] and, with ``record``, the pre-activations
    Z [B, T, n] and the carried states [B, T + 1, n] (h_0, h_1, ..., h_T; at a padded
    step the carried state is the previous one, not the zero output)."""
    batch, steps, n = u.shape
    h = u.new_zeros(batch, n) if h0 is None else h0
    u = u.transpose(0, 1)
    w_t = transition.T if isinstance(transition, torch.Tensor) else None
    states, pre, carried = [], [], [h]
    for t in range(steps):
        z = torch.addmm(u[t], h, w_t) if w_t is not None else u[t] + transition(h)
        new = act(z)
        if gates is not None:
            new = torch.addcmul(h * gates[1], new, gates[0])
        if mask is not None:
            new = torch.where(mask[t], new, h)
            states.append(new * mask[t])
        else:
            states.append(new)
        if record:
            pre.append(z)
            carried.append(new)
        h = new
    out = torch.stack(states, dim=1), h
    if record:
        return (*out, torch.stack(pre, dim=1), torch.stack(carried, dim=1))
    return out


def scan_forward(u, weight, h0, lengths, a, b2, bias, kind: str, slope: float,
                 keep: bool = True):
    """Reference forward of the op: (states, last, pre [B, T, n], carried [B, T+1, n]);
    without ``keep`` pre and carried are None (nothing recorded)."""
    gates = (a, b2) if a is not None else None

    def act(z):
        return activation_forward(kind, z, slope, bias)

    mask = step_masks(lengths, u.shape[1], u.device)
    if not keep:
        return (*_scan_loop(u, weight, act, h0, mask, gates), None, None)
    return _scan_loop(u, weight, act, h0, mask, gates, record=True)


def scan_backward(d_states, d_last, weight, pre, carried, lengths, a, b2, bias,
                  kind: str, slope: float):
    """Reference reverse scan. Returns dL/dz [B, T, n], dL/d(cell output) [B, T, n]
    (the gradient before the gate a; gated form only, else None) and dL/dh0 [B, n].
    ``d_states`` [B, T, n] and ``d_last`` [B, n] may be None (output unused)."""
    steps = pre.shape[1]
    mask = step_masks(lengths, steps, pre.device)
    # g'(z) for every step at once; the reverse scan then only multiplies.
    slope_of = activation_derivative(kind, pre, slope, bias)
    if a is not None:
        slope_of.mul_(a)  # dz_t = a g'(z_t) dL/dh_t in the gated form
    g = torch.zeros_like(carried[:, 0]) if d_last is None else d_last.clone()
    d_out = torch.empty_like(pre) if a is not None else None
    d_pre = torch.empty_like(pre)
    keep = None if mask is None else mask.to(pre.dtype)
    for t in reversed(range(steps)):
        if d_states is not None:
            g.add_(d_states[:, t] if keep is None else d_states[:, t] * keep[t])
        g_new = g if keep is None else g * keep[t]
        if d_out is not None:
            d_out[:, t] = g_new
        torch.mul(g_new, slope_of[:, t], out=d_pre[:, t])
        back = torch.mm(d_pre[:, t], weight)  # dL/dh_{t-1} through W
        if a is not None:
            back.addcmul_(g_new, b2)
        if keep is not None:
            back.add_(g * (1 - keep[t]))  # padded steps carry h_{t-1} unchanged
        g = back
    return d_pre, d_out, g


def scan_parameter_grads(d_pre, d_out, pre, carried, a, bias, kind: str, slope: float):
    """dW, da, db2 and d(modReLU bias) from the reverse scan's outputs (both paths)."""
    n = pre.shape[-1]
    prev = carried[:, :-1]
    # dW = sum_t dz_t h_{t-1}^T: one [n, B T] x [B T, n] product.
    d_weight = d_pre.reshape(-1, n).T @ prev.reshape(-1, n)
    d_a = d_b2 = d_bias = None
    if a is not None:
        d_a = (d_out * activation_forward(kind, pre, slope, bias)).sum().reshape(a.shape)
        d_b2 = (d_out * prev).sum().reshape(a.shape)  # a, b2: both 0-dim
    if bias is not None:
        d_bias = modrelu_bias_grad(pre, d_pre)
    return d_weight, d_a, d_b2, d_bias


def rnn_scan_steps(u: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
                   act: Callable[[torch.Tensor], torch.Tensor], h0: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None,
                   gates: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence with W applied by ``step`` (row vectors), through autograd."""
    return _scan_loop(u, step, act, h0, step_masks(lengths, u.shape[1], u.device), gates)
