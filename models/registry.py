"""The architecture registry: ``ARCHITECTURES`` and ``build_model``.

Each entry names its options with their defaults; ``build_model`` rejects options an
architecture does not take, and every builder validates ranges (ValueError naming the
option and the allowed values).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .activations import Activation
from .cells import LSTMLayer, Recurrence, ScalarGates
from .networks import SVDMLP, TASKS, SequenceModel
from .parametrizations import (
    BoundedSingularValues,
    DenseTransition,
    FreeSingularValues,
    HouseholderChain,
    PackedGivens,
    RotationPermutation,
    ScaledCayley,
    SVDForm,
)
from .validation import check_choice, check_int


@dataclass(frozen=True)
class Architecture:
    name: str
    summary: str
    #: option name -> default; None means "computed by the builder" (from hidden_size, or
    #: from another option: sgornn's b2_init from a_init).
    options: dict = field(default_factory=dict)
    #: builder(input_size, hidden_size, **options) -> recurrent layer
    build: Callable[..., nn.Module] | None = None
    recurrent: bool = True
    tasks: tuple[str, ...] = TASKS


SVDRNN_ACTIVATIONS = ("leaky_relu", "modrelu", "relu", "tanh", "abs")


def _svdrnn(d, n, m1=None, m2=None, r=0.01, sigma_star=1.0, negative_slope=0.01,
            activation="leaky_relu"):
    # leaky ReLU is the paper's (section 7); the copy preset uses modReLU, see README.
    check_choice("activation", activation, SVDRNN_ACTIVATIONS)
    transition = SVDForm(HouseholderChain(n, m1, name="m1"),
                         BoundedSingularValues(n, r, sigma_star),
                         HouseholderChain(n, m2, name="m2"))
    return Recurrence(d, transition, Activation(activation, n, negative_slope))


def _ornn(d, n, m=None, negative_slope=0.01):
    return Recurrence(d, HouseholderChain(n, m), Activation("leaky_relu", n, negative_slope))


def _scornn(d, n, rho=None):
    return Recurrence(d, ScaledCayley(n, rho), Activation("modrelu", n))


def _dizzyrnn(d, n, rotations=None, svd=False, svd_lambda=0.01):
    if not isinstance(svd, bool):
        raise ValueError(f"svd must be true or false, got {svd!r}")
    if svd:
        transition = SVDForm(PackedGivens(n, rotations), FreeSingularValues(n, svd_lambda),
                             PackedGivens(n, rotations))
    else:
        transition = PackedGivens(n, rotations)
    return Recurrence(d, transition, Activation("abs", n))


def _vprnn(d, n, rotations=None, seed=0):
    return Recurrence(d, RotationPermutation(n, rotations, seed=seed), Activation("relu", n))


def _sgornn(d, n, rotations=None, seed=0, a_init=None, b2_init=None):
    return Recurrence(d, RotationPermutation(n, rotations, seed=seed), Activation("relu", n),
                      ScalarGates(clip=True, a_init=a_init, b2_init=b2_init))


def _fastrnn(d, n, activation="relu", a_init=None, b2_init=None):
    check_choice("activation", activation, ("relu", "tanh"))
    return Recurrence(d, DenseTransition(n), Activation(activation, n),
                      ScalarGates(clip=False, a_init=a_init, b2_init=b2_init))


def _rnn(d, n, activation="tanh"):
    check_choice("activation", activation, ("tanh", "relu"))
    return Recurrence(d, DenseTransition(n), Activation(activation, n))


def _irnn(d, n):
    return Recurrence(d, DenseTransition(n, init="identity"), Activation("relu", n))


def _lstm(d, n):
    return LSTMLayer(d, n)


_ENTRIES = [
    Architecture("rnn", "dense W, tanh (or relu)", {"activation": "tanh"}, _rnn),
    Architecture("irnn", "dense W initialised to the identity, relu", {}, _irnn),
    Architecture("lstm", "torch.nn.LSTM", {}, _lstm),
    Architecture("ornn", "product of m Householder reflectors, leaky relu",
                 {"m": None, "negative_slope": 0.01}, _ornn),
    Architecture("svdrnn", "U diag(s) V^T, U and V from m1 and m2 Householder reflectors, "
                 "s = 2r(sigmoid(p) - 0.5) + sigma_star, leaky relu",
                 {"m1": None, "m2": None, "r": 0.01, "sigma_star": 1.0, "negative_slope": 0.01,
                  "activation": "leaky_relu"}, _svdrnn),
    Architecture("scornn", "scaled Cayley (I + A)^-1 (I - A) D, modReLU", {"rho": None}, _scornn),
    Architecture("dizzyrnn", "product of packed Givens rotations (optionally U diag(s) V^T), abs",
                 {"rotations": None, "svd": False, "svd_lambda": 0.01}, _dizzyrnn),
    Architecture("vprnn", "rotation and fixed permutation sublayers R_1 Q_1 ... R_k Q_k, relu",
                 {"rotations": None, "seed": 0}, _vprnn),
    Architecture("fastrnn", "dense W with scalar gates a, b2, relu (or tanh)",
                 {"activation": "relu", "a_init": None, "b2_init": None}, _fastrnn),
    Architecture("sgornn", "vprnn's W inside scalar gates a = sigmoid(alpha)/2, "
                 "b2 = (1 - 2a) sigmoid(beta) <= 1 - 2a, relu",
                 {"rotations": None, "seed": 0, "a_init": None, "b2_init": None}, _sgornn),
    Architecture("svdmlp", "deep MLP with rectangular SVD-parametrized layers, leaky relu",
                 {"depth": 2, "r": 0.5, "sigma_star": 1.0, "negative_slope": 0.01},
                 recurrent=False, tasks=("classify", "regress")),
]

ALIASES = {"spectral-rnn": "svdrnn"}


class _Registry(Mapping):
    """Canonical names in iteration order; aliases resolve on lookup."""

    def __init__(self, entries: list[Architecture]):
        self._entries = {a.name: a for a in entries}

    def __getitem__(self, name: str) -> Architecture:
        return self._entries[ALIASES.get(name, name)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return ALIASES.get(name, name) in self._entries


ARCHITECTURES = _Registry(_ENTRIES)


def build_model(arch: str, task: str = "classify", *, input_size: int, hidden_size: int = 128,
                num_outputs: int | None = None, embedding_size: int | None = None,
                seed: int | None = None, **options) -> nn.Module:
    """Build ``arch`` with a ``task`` head. For lm, input_size is the vocabulary size,
    num_outputs defaults to it and embedding_size to hidden_size. ``seed`` makes the
    initialisation reproducible."""
    if arch not in ARCHITECTURES:
        names = ", ".join(list(ARCHITECTURES) + list(ALIASES))
        raise ValueError(f"unknown architecture {arch!r}; valid names: {names}")
    spec = ARCHITECTURES[arch]
    check_choice("task", task, spec.tasks)
    input_size = check_int("input_size", input_size, 1)
    hidden_size = check_int("hidden_size", hidden_size, 1)
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        allowed = ", ".join(spec.options) or "none"
        raise ValueError(f"unknown option(s) {', '.join(unknown)} for {spec.name}; "
                         f"allowed: {allowed}")
    if num_outputs is None:
        num_outputs = {"lm": input_size, "regress": 1}.get(task)
        if num_outputs is None:
            raise ValueError(f"num_outputs is required for task {task!r} (number of classes)")
    num_outputs = check_int("num_outputs", num_outputs, 2 if task in ("classify", "seq2seq") else 1)
    if embedding_size is not None and task != "lm":
        raise ValueError("embedding_size applies only to task 'lm'")
    if seed is not None:
        torch.manual_seed(check_int("seed", seed, 0))
    if not spec.recurrent:
        return SVDMLP(task, input_size, hidden_size, num_outputs, **options)
    embedding_size = hidden_size if embedding_size is None else check_int(
        "embedding_size", embedding_size, 1)
    layer_input = embedding_size if task == "lm" else input_size
    layer = spec.build(layer_input, hidden_size, **options)
    return SequenceModel(spec.name, task, input_size, num_outputs, layer,
                         embedding_size if task == "lm" else None)
