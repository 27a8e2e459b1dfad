"""Networks: a recurrent layer with an input stage and a task head, and the SVD MLP.

Tasks (docs/design.md):
    classify  float [B, T, d] -> logits [B, C]      (head on each sequence's last state)
    regress   float [B, T, d] -> [B, num_outputs]   (num_outputs defaults to 1)
    seq2seq   float [B, T, d] -> logits [B, T, C]   (head on every state; copy task)
    lm        long  [B, T]    -> logits [B, T, V]   (embedding, recurrence, per-step softmax)
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from .activations import Activation
from .parametrizations import BoundedSingularValues, HouseholderChain, Parametrization, SVDForm
from .validation import check_int

TASKS = ("classify", "regress", "seq2seq", "lm")


class _Network(nn.Module):
    """What every network offers beyond forward: the optimizer groups and penalties."""

    def regularization(self) -> torch.Tensor:
        """Sum of the parametrizations' penalties (DizzyRNN's lambda/2 ||s - 1||^2); add it
        to the loss."""
        total = next(self.parameters()).new_zeros(())
        for module in self.modules():
            if isinstance(module, Parametrization) and module is not self:
                total = total + module.regularization()
        return total

    def orthogonal_parameters(self) -> list[nn.Parameter]:
        """Parameters of the constrained parametrizations (reflectors, angles, skew
        matrices, singular-value logits)."""
        seen: dict[int, nn.Parameter] = {}
        for module in self.modules():
            if isinstance(module, Parametrization) and module.constrained:
                seen.update({id(p): p for p in module.parameters()})
        return list(seen.values())

    def param_groups(self, lr: float, orthogonal_lr: float | None = None) -> list[dict]:
        """Optimizer groups: the orthogonal parameters get their own learning rate, as
        scoRNN trains A with a smaller one (section 5.3)."""
        special = {id(p) for p in self.orthogonal_parameters()}
        groups = [{"name": "default", "lr": lr,
                   "params": [p for p in self.parameters() if id(p) not in special]}]
        if special:
            groups.append({"name": "orthogonal",
                           "lr": lr if orthogonal_lr is None else orthogonal_lr,
                           "params": self.orthogonal_parameters()})
        return groups


class SequenceModel(_Network):
    def __init__(self, arch: str, task: str, input_size: int, num_outputs: int,
                 layer: nn.Module, embedding_size: int | None = None):
        super().__init__()
        self.arch, self.task = arch, task
        self.input_size, self.num_outputs = input_size, num_outputs
        self.layer = layer
        self.hidden_size, self.state_size = layer.hidden_size, layer.state_size
        self.embedding = nn.Embedding(input_size, embedding_size) if task == "lm" else None
        self.head = nn.Linear(self.hidden_size, num_outputs)

    def recurrent_weight(self) -> torch.Tensor | None:
        """The dense transition matrix [n, n] the forward pass uses (None for lstm)."""
        return self.layer.recurrent_weight()

    def encode(self, x: torch.Tensor, h0: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None, *, factored: bool = False):
        """(states [B, T, n], last state [B, state_size]); pass the last state back as h0
        to carry the recurrence across calls. ``factored`` runs the papers' per-step
        application of the transition instead of the dense matrix (same result)."""
        batch, steps = self._check_input(x)
        if lengths is not None:
            lengths = self._check_lengths(lengths, batch, steps)
        if h0 is not None:
            self._check_h0(h0, batch)
        inputs = self.embedding(x) if self.embedding is not None else x
        return self.layer(inputs, h0, lengths, factored=factored)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None,
                h0: torch.Tensor | None = None, return_state: bool = False):
        """Task outputs; with ``return_state``, (outputs, last state) so a caller (the
        language-model trainer, a generator) can carry the state to the next call."""
        states, last = self.encode(x, h0, lengths)
        if self.task in ("classify", "regress"):
            out = self.head(last[:, : self.hidden_size])
        else:
            out = self.head(states)
        return (out, last) if return_state else out

    # -- input checks: a ValueError naming the argument, never an opaque shape error --
    def _check_input(self, x) -> tuple[int, int]:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if self.task == "lm":
            if x.dim() != 2 or x.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"x must be token ids, an integer tensor [B, T]; "
                                 f"got {x.dtype} {tuple(x.shape)}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.input_size):
                raise ValueError(f"x token ids must lie in [0, {self.input_size - 1}] "
                                 f"(input_size is the vocabulary size)")
        elif x.dim() != 3 or x.shape[-1] != self.input_size or not x.is_floating_point():
            raise ValueError(f"x must be a float tensor [B, T, {self.input_size}]; "
                             f"got {x.dtype} {tuple(x.shape)}")
        if x.shape[0] < 1 or x.shape[1] < 1:
            raise ValueError(f"x must hold at least one sequence of one step; got {tuple(x.shape)}")
        return x.shape[0], x.shape[1]

    @staticmethod
    def _check_lengths(lengths, batch: int, steps: int) -> torch.Tensor:
        lengths = torch.as_tensor(lengths)
        if lengths.shape != (batch,) or lengths.is_floating_point():
            raise ValueError(f"lengths must be an integer tensor [{batch}]; "
                             f"got {lengths.dtype} {tuple(lengths.shape)}")
        if int(lengths.min()) < 1 or int(lengths.max()) > steps:
            raise ValueError(f"lengths must lie in [1, {steps}] (the padded length T)")
        return lengths.long()

    def _check_h0(self, h0, batch: int) -> None:
        if not isinstance(h0, torch.Tensor) or h0.shape != (batch, self.state_size):
            raise ValueError(f"h0 must be a tensor [{batch}, {self.state_size}]; "
                             f"got {getattr(h0, 'shape', type(h0).__name__)}")


def spectral_summary(model) -> dict:
    """The spectrum of the transition matrix the forward pass uses (``recurrent_weight``):
    min / max singular value, the spectral margin max|s_i - 1| and ||W^T W - I||_2;
    {} for models without one. Training logs it, the model package's manifest carries it."""
    with torch.no_grad():
        w = model.recurrent_weight()
        if w is None:
            return {}
        w = w.detach().double().cpu()
        s = torch.linalg.svdvals(w)
        eye = torch.eye(w.shape[0], dtype=torch.float64)
        return {"sigma_min": s.min().item(), "sigma_max": s.max().item(),
                "spectral_margin": (s - 1).abs().max().item(),
                "orthogonality_error": torch.linalg.matrix_norm(w.T @ w - eye, ord=2).item()}


class SVDLinear(nn.Module):
    """y = W x + b with W [out, in] in the rectangular SVD parametrization (Spectral-RNN
    eq. 15): 2 min(out, in) reflectors reach every matrix (Theorem 4)."""

    def __init__(self, in_features: int, out_features: int, r: float, sigma_star: float):
        super().__init__()
        k = min(in_features, out_features)
        self.weight_param = SVDForm(HouseholderChain(out_features, k, name="reflectors"),
                                    BoundedSingularValues(k, r, sigma_star),
                                    HouseholderChain(in_features, k, name="reflectors"))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_param.matrix().T + self.bias


class SVDMLP(_Network):
    """A deep MLP (Spectral-RNN section 5, eq. 16) with every layer SVD-parametrized.
    Input [B, d], or [B, T, d'] flattened when T d' = input_size."""

    def __init__(self, task: str, input_size: int, hidden_size: int, num_outputs: int,
                 depth: int = 2, r: float = 0.5, sigma_star: float = 1.0,
                 negative_slope: float = 0.01):
        super().__init__()
        self.arch, self.task = "svdmlp", task
        self.input_size, self.hidden_size, self.num_outputs = input_size, hidden_size, num_outputs
        depth = check_int("depth", depth, 1, 64)
        sizes = [input_size] + [hidden_size] * depth + [num_outputs]
        self.layers = nn.ModuleList(SVDLinear(a, b, r, sigma_star)
                                    for a, b in itertools.pairwise(sizes))
        self.activation = Activation("leaky_relu", hidden_size, negative_slope)

    def recurrent_weight(self) -> None:
        return None

    def encode(self, *args, **kwargs):
        raise ValueError("svdmlp is not recurrent: it has no encode(); call the model directly")

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError("x must be a float tensor [B, input_size] or [B, T, d]")
        if x.dim() == 3:
            x = x.flatten(1)
        if x.dim() != 2 or x.shape[1] != self.input_size:
            raise ValueError(f"x must have {self.input_size} features per example "
                             f"([B, {self.input_size}] or [B, T, d] with T d = {self.input_size}); "
                             f"got {tuple(x.shape)}")
        for layer in self.layers[:-1]:
            x = self.activation(layer(x))
        return self.layers[-1](x)
