"""Recurrent layers: one generic cell (input projection, transition, activation,
optional scalar gates) for every architecture but the LSTM, which wraps nn.LSTM.

Both expose the same interface:
    layer(x_proj_input, h0=None, lengths=None) -> (states [B, T, n], last [B, state_size])
    layer.state_size, layer.recurrent_weight()
"""

from __future__ import annotations

import torch
from torch import nn

from .activations import Activation
from .ops import rnn_scan, rnn_scan_steps
from .parametrizations import Parametrization


class ScalarGates(nn.Module):
    """a = sigmoid(alpha), b2 = sigmoid(beta) (FastRNN). With ``clip`` (SGORNN eq. 3),
    b2 is clipped after the sigmoid to at most 1 - 2a, whatever alpha and beta are."""

    def __init__(self, clip: bool, alpha: float = -3.0, beta: float = 3.0):
        super().__init__()
        self.clip = clip
        self.alpha = nn.Parameter(torch.tensor(float(alpha)))
        self.beta = nn.Parameter(torch.tensor(float(beta)))

    def extra_repr(self) -> str:
        return f"clip={self.clip}"

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.sigmoid(self.alpha)
        b2 = torch.sigmoid(self.beta)
        if self.clip:
            b2 = torch.minimum(b2, 1 - 2 * a)
        return a, b2


class Recurrence(nn.Module):
    """h_t = g(W_x x_t + b + W h_{t-1}), or the gated form a g(.) + b2 h_{t-1}."""

    def __init__(self, input_size: int, transition: Parametrization, activation: Activation,
                 gates: ScalarGates | None = None):
        super().__init__()
        self.state_size = self.hidden_size = transition.size
        self.input = nn.Linear(input_size, self.hidden_size)
        self.transition = transition
        self.activation = activation
        self.gates = gates

    def recurrent_weight(self) -> torch.Tensor:
        return self.transition.matrix()

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, factored: bool = False):
        u = self.input(x)
        gates = self.gates() if self.gates is not None else None
        if factored:  # the papers' per-step application of the transition, the reference
            return rnn_scan_steps(u, self.transition.apply, self.activation, h0, lengths, gates)
        # Dense path: build W once per call (level-3 BLAS), then one addmm per step.
        act = self.activation
        return rnn_scan(u, self.transition.matrix(), h0, lengths, activation=act.kind,
                        slope=act.negative_slope, bias=act.bias, gates=gates)


class LSTMLayer(nn.Module):
    """nn.LSTM behind the common interface. Its carried state is cat(h, c) [B, 2n]."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.state_size = 2 * hidden_size
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)

    def recurrent_weight(self) -> None:
        return None

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, factored: bool = False):
        state = None
        if h0 is not None:
            h, c = h0.split(self.hidden_size, dim=-1)
            state = (h.unsqueeze(0).contiguous(), c.unsqueeze(0).contiguous())
        if lengths is None:
            states, (h, c) = self.lstm(x, state)
        else:
            packed = nn.utils.rnn.pack_padded_sequence(
                x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, (h, c) = self.lstm(packed, state)
            states, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                         total_length=x.shape[1])
        return states, torch.cat([h[0], c[0]], dim=-1)
