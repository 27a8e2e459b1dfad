"""The recurrence in plain PyTorch: the reference every faster path must equal.

    z_t = u_t + W h_{t-1},   h_t = g(z_t)                     (ungated)
    h_t = a g(z_t) + b2 h_{t-1}                               (FastRNN / SGORNN eq. 1)

u [B, T, n] is the precomputed input projection plus bias, g an activation kind of
``models.activations``. With ``lengths``, step t only updates sequences with
t < length: the last state is each sequence's own final state and states at padded
steps are zero, so padding never changes a result.

Two entry points share one forward loop:
* ``rnn_scan`` (dense W): a custom autograd function. Its backward is one reverse
  scan for dz_t, then dW = sum_t dz_t h_{t-1}^T as a single matrix product; it saves
  only the pre-activations and the states.
* ``rnn_scan_steps`` (any callable h -> W h, e.g. the per-step reflector chain): plain
  autograd through the loop, the papers' factored formulation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..activations import activation_derivative, activation_forward, modrelu_bias_grad


def _step_masks(lengths: torch.Tensor | None, steps: int, device) -> torch.Tensor | None:
    if lengths is None:
        return None
    mask = torch.arange(steps, device=device)[:, None] < lengths.to(device)[None, :]
    return mask.unsqueeze(-1)  # [T, B, 1]


def _scan_loop(u, transition, act, h0, mask, gates, record: bool = False):
    """The one forward loop. u [B, T, n]; transition a dense W or a callable.
    Returns states [B, T, n], last [B, n] and, with ``record``, the pre-activations
    Z [T, B, n] and the previous states H [T, B, n] (h_{t-1} for each t)."""
    batch, steps, n = u.shape
    h = u.new_zeros(batch, n) if h0 is None else h0
    u = u.transpose(0, 1)
    w_t = transition.T if isinstance(transition, torch.Tensor) else None
    states, pre, prev = [], [], []
    for t in range(steps):
        z = torch.addmm(u[t], h, w_t) if w_t is not None else u[t] + transition(h)
        new = act(z)
        if gates is not None:
            new = torch.addcmul(h * gates[1], new, gates[0])
        if record:
            pre.append(z)
            prev.append(h)
        if mask is not None:
            new = torch.where(mask[t], new, h)
            states.append(new * mask[t])
        else:
            states.append(new)
        h = new
    out = torch.stack(states, dim=1), h
    if record:
        return (*out, torch.stack(pre), torch.stack(prev))
    return out


class _DenseScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, weight, h0, mask, a, b2, bias, kind, slope):
        gates = (a, b2) if a is not None else None
        def act(z):
            return activation_forward(kind, z, slope, bias)
        states, last, pre, prev = _scan_loop(u, weight, act, h0, mask, gates, record=True)
        ctx.save_for_backward(weight, mask, a, b2, bias, pre, prev)
        ctx.kind, ctx.slope = kind, slope
        ctx.set_materialize_grads(False)  # an unused output (often `states`) costs nothing
        return states, last

    @staticmethod
    def backward(ctx, d_states, d_last):
        weight, mask, a, b2, bias, pre, prev = ctx.saved_tensors
        kind, slope = ctx.kind, ctx.slope
        steps = pre.shape[0]
        # g'(z) for every step at once; the reverse scan then only multiplies.
        slope_of = activation_derivative(kind, pre, slope, bias)
        if a is not None:
            slope_of.mul_(a)  # dz_t = a g'(z_t) dL/dh_t in the gated form
        if d_states is not None:
            d_states = d_states.transpose(0, 1).contiguous()  # [T, B, n]
        g = torch.zeros_like(prev[0]) if d_last is None else d_last.clone()
        # dL/d(cell output) per step, before the gate a: needed for da and db2 only.
        d_out = torch.empty_like(pre) if a is not None else None
        d_pre = torch.empty_like(pre)
        keep = None if mask is None else mask.to(pre.dtype)
        for t in reversed(range(steps)):
            if d_states is not None:
                g.add_(d_states[t] if keep is None else d_states[t] * keep[t])
            g_new = g if keep is None else g * keep[t]
            if d_out is not None:
                d_out[t] = g_new
            torch.mul(g_new, slope_of[t], out=d_pre[t])
            back = torch.mm(d_pre[t], weight)  # dL/dh_{t-1} through W
            if a is not None:
                back.addcmul_(g_new, b2)
            if keep is not None:
                back.add_(g * (1 - keep[t]))  # padded steps carry h_{t-1} unchanged
            g = back
        n = pre.shape[-1]
        # dW = sum_t dz_t h_{t-1}^T: one [n, T B] x [T B, n] product.
        d_weight = d_pre.reshape(-1, n).T @ prev.reshape(-1, n)
        d_a = d_b2 = d_bias = None
        if a is not None:
            d_a = (d_out * activation_forward(kind, pre, slope, bias)).sum().reshape(a.shape)
            d_b2 = (d_out * prev).sum().reshape(b2.shape)
        if bias is not None:
            d_bias = modrelu_bias_grad(pre, d_pre)
        d_h0 = g if ctx.needs_input_grad[2] else None
        return d_pre.transpose(0, 1), d_weight, d_h0, None, d_a, d_b2, d_bias, None, None


def rnn_scan(u: torch.Tensor, weight: torch.Tensor, h0: torch.Tensor | None = None,
             lengths: torch.Tensor | None = None, *, activation: str = "relu",
             slope: float = 0.01, bias: torch.Tensor | None = None,
             gates: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the recurrence with a dense W [n, n]: (states [B, T, n], last [B, n])."""
    if h0 is None:
        h0 = u.new_zeros(u.shape[0], u.shape[2])
    a, b2 = gates if gates is not None else (None, None)
    mask = _step_masks(lengths, u.shape[1], u.device)
    return _DenseScan.apply(u, weight, h0, mask, a, b2, bias, activation, slope)


def rnn_scan_steps(u: torch.Tensor, step: Callable[[torch.Tensor], torch.Tensor],
                   act: Callable[[torch.Tensor], torch.Tensor], h0: torch.Tensor | None = None,
                   lengths: torch.Tensor | None = None,
                   gates: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence with W applied by ``step`` (row vectors), through autograd."""
    return _scan_loop(u, step, act, h0, _step_masks(lengths, u.shape[1], u.device), gates)
