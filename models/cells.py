"""Recurrent layers: one generic cell (input projection, transition, activation,
optional scalar gates) for every architecture but the LSTM, which wraps nn.LSTM.

Both expose the same interface:
    layer(x_proj_input, h0=None, lengths=None) -> (states [B, T, n], last [B, state_size])
    layer.state_size, layer.recurrent_weight()
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .activations import Activation
from .ops import rnn_scan, rnn_scan_steps
from .parametrizations import Parametrization
from .validation import check_float

DEFAULT_A = 1 / (1 + math.exp(3.0))  # sigmoid(-3), FastRNN's initial a
DEFAULT_B2 = 1 / (1 + math.exp(-3.0))  # sigmoid(3), FastRNN's initial b2


class ScalarGates(nn.Module):
    """The scalar gates a and b2 of h_t = a g(.) + b2 h_{t-1}.

    FastRNN (``clip=False``): a = sigmoid(alpha), b2 = sigmoid(beta).
    SGORNN (``clip=True``) must keep b2 <= 1 - 2a (eq. 3), which needs a < 1/2. Clipping
    b2 after the sigmoid (the paper's wording) zeroes beta's gradient whenever the clip is
    active, which FastRNN's initial values (alpha = -3, beta = 3) already make it at step 0.
    So the constraint is built into the map instead:
        a = sigmoid(alpha) / 2,   b2 = (1 - 2a) sigmoid(beta),
    which holds for every alpha and beta and gives both a gradient everywhere.

    ``a_init`` and ``b2_init`` are the gate values at initialisation (the parameters are
    their pre-images); defaults: FastRNN's a = sigmoid(-3) = 0.047 and b2 = sigmoid(3) =
    0.953 (FastRNN), or 0.95 (1 - 2a) = 0.860 (SGORNN, inside the constraint).
    """

    def __init__(self, clip: bool, a_init: float | None = None, b2_init: float | None = None):
        super().__init__()
        self.clip = clip
        a_max = 0.5 if clip else 1.0
        a = check_float("a_init", DEFAULT_A if a_init is None else a_init, 0.0, a_max,
                        low_open=True)
        if a >= a_max:
            raise ValueError(f"a_init must be a number in (0, {a_max}), got {a_init!r}")
        b2_max = 1 - 2 * a if clip else 1.0
        b2 = check_float("b2_init", (0.95 * b2_max if clip else DEFAULT_B2)
                         if b2_init is None else b2_init, 0.0, b2_max, low_open=True)
        if b2 >= b2_max:
            raise ValueError(f"b2_init must be a number in (0, {b2_max:g})"
                             f"{' (1 - 2 a_init, SGORNN eq. 3)' if clip else ''}, got {b2_init!r}")
        alpha = math.log(a / a_max / (1 - a / a_max))
        beta = math.log((b2 / b2_max) / (1 - b2 / b2_max))
        self.alpha = nn.Parameter(torch.tensor(alpha))
        self.beta = nn.Parameter(torch.tensor(beta))

    def extra_repr(self) -> str:
        return f"clip={self.clip}"

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.clip:
            a = 0.5 * torch.sigmoid(self.alpha)
            return a, (1 - 2 * a) * torch.sigmoid(self.beta)
        return torch.sigmoid(self.alpha), torch.sigmoid(self.beta)


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
            return rnn_scan_steps(u, self.transition.multiply, self.activation, h0, lengths, gates)
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
