"""Packed Givens rotations (DizzyRNN section 4) and rotation + permutation sublayers
(VPRNN / SGORNN eq. 2).

Both are products of *packed rotations*: n/2 Givens rotations on disjoint coordinate
pairs (a, b), applied together in O(n):
    y_a = cos(t) x_a + sin(t) x_b,   y_b = -sin(t) x_a + cos(t) x_b   (DizzyRNN 4.1).
``rotate_pairs`` is that one formula; both classes below call it. Their dense matrix
is the same chain applied to the identity (``models.ops.rotation_chain``, the op
``torch.ops.orthornn.givens_apply``: O(k n^2) elementwise work with an explicit
backward, a Triton kernel on the GPU). ``multiply`` runs the same op on the batch of row
vectors (the per-vector factored path); the transposed application is the
``rotate_pairs`` loop.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.rotations import rotation_chain
from ..validation import check_even, check_int
from .base import Parametrization


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 partner: torch.Tensor) -> torch.Tensor:
    """Apply one packed rotation to row vectors: y = cos * x + sin * x[partner].

    For a pair (a, b) with angle t: cos[a] = cos[b] = cos t, sin[a] = sin t,
    sin[b] = -sin t, partner[a] = b, partner[b] = a; this is y_a = cos t x_a + sin t x_b,
    y_b = cos t x_b - sin t x_a. ``pair_coefficients`` builds the three vectors."""
    return torch.addcmul(x * cos, x[..., partner], sin)


def pair_layout(first: torch.Tensor, second: torch.Tensor):
    """(order, partner) [k, n] of pairs (first[j, i], second[j, i]): coordinate a takes
    its coefficient from slot order[j, a] of [angle slots of the first members | of the
    second members], and rotates with coordinate partner[j, a]."""
    order = torch.argsort(torch.cat([first, second], dim=1), dim=1)
    partner = torch.cat([second, first], dim=1).gather(1, order)
    return order, partner


def pair_coefficients(angles: torch.Tensor, first: torch.Tensor, second: torch.Tensor):
    """Per-coordinate (cos, sin, partner) [k, n] for angles [k, n/2] on pairs
    (first[j, i], second[j, i]): every packed rotation's coefficients in one go."""
    order, partner = pair_layout(first, second)
    c, s = torch.cos(angles), torch.sin(angles)
    cos = torch.cat([c, c], dim=1).gather(1, order)
    sin = torch.cat([s, -s], dim=1).gather(1, order)
    return cos, sin, partner


def round_robin_pairs(n: int) -> torch.Tensor:
    """The circle-method schedule: n - 1 rounds [n-1, n/2, 2]; each round pairs every
    coordinate once, and the n - 1 rounds together hold every pair exactly once."""
    others = n - 1
    rounds = []
    for r in range(others):
        pairs = [(r, n - 1)]
        pairs += [((r + i) % others, (r - i) % others) for i in range(1, n // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs])
    return torch.tensor(rounds, dtype=torch.long)


def _chain_rows(x: torch.Tensor, cos, sin, partner, perms) -> torch.Tensor:
    """The rotation chain on row vectors x [..., n] (the op acts on the rows of [n, N])."""
    flat = x.reshape(-1, x.shape[-1])
    return rotation_chain(flat.T, cos, sin, partner, perms).T.reshape(x.shape)


class _PackedRotations(Parametrization):
    """Shared storage: ``angles`` [k, n/2] and per-sublayer pair indices [k, n/2]."""

    orthogonal = True

    def _init_pairs(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.register_buffer("first", first, persistent=False)
        self.register_buffer("second", second, persistent=False)

    trainable = ("angles",)

    def factors(self) -> dict:
        """angles [k, n/2]; order, partner [k, n] (``pair_layout``); permutations [k, n]
        of the Q_j (rotation + permutation form only)."""
        order, partner = pair_layout(self.first, self.second)
        out = {"angles": self.angles, "order": order, "partner": partner}
        if self.permutations is not None:
            out["permutations"] = self.permutations
        return out

    def _set_factor(self, name: str, value: torch.Tensor) -> None:
        self.angles.copy_(value.to(self.angles))

    def coefficients(self, transpose: bool = False):
        """(cos, sin, partner) [k, n] of every sublayer; the transpose rotates by -angle."""
        cos, sin, partner = pair_coefficients(self.angles, self.first, self.second)
        return cos, -sin if transpose else sin, partner

    def matrix(self) -> torch.Tensor:
        eye = torch.eye(self.size, dtype=self.angles.dtype, device=self.angles.device)
        cos, sin, partner = self.coefficients()
        return rotation_chain(eye, cos, sin, partner, self.permutations)

    def extra_repr(self) -> str:
        return f"size={self.size}, rotations={self.rotations}"


class PackedGivens(_PackedRotations):
    """W = P_1 P_2 ... P_k, P_j the j-th round of the round-robin schedule (k <= n - 1)."""

    def __init__(self, size: int, rotations: int | None = None, *,
                 generator: torch.Generator | None = None):
        super().__init__()
        n = self.size = check_even("hidden_size", check_int("hidden_size", size, 2),
                                   "packed Givens rotations pair up the coordinates")
        self.rotations = check_int("rotations", n - 1 if rotations is None else rotations, 1, n - 1)
        pairs = round_robin_pairs(n)[: self.rotations]
        self._init_pairs(pairs[..., 0], pairs[..., 1])
        self.register_buffer("permutations", None)  # no Q_j between packed rotations
        self.angles = nn.Parameter(
            (torch.rand(self.rotations, n // 2, generator=generator) * 2 - 1) * math.pi)

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        # W x = P_1 (... (P_k x)); W^T x = P_k^T (... (P_1^T x)), P^T rotating by -angle.
        cos, sin, partner = self.coefficients(transpose)
        if not transpose:
            return _chain_rows(x, cos, sin, partner, None)
        for j in range(self.rotations):
            x = rotate_pairs(x, cos[j], sin[j], partner[j])
        return x


class RotationPermutation(_PackedRotations):
    """W = R_1 Q_1 R_2 Q_2 ... R_k Q_k (VPRNN; SGORNN eq. 2): R_j rotates the pairs
    (2i, 2i+1) by angles[j, i], Q_j is a fixed permutation drawn from ``seed``.
    VPRNN bounds k by 2 ceil(log2 n)."""

    def __init__(self, size: int, rotations: int | None = None, *, seed: int = 0,
                 generator: torch.Generator | None = None):
        super().__init__()
        n = self.size = check_even("hidden_size", check_int("hidden_size", size, 2),
                                   "rotation sublayers rotate coordinate pairs")
        limit = 2 * math.ceil(math.log2(n))
        self.rotations = check_int("rotations", limit if rotations is None else rotations, 1, limit)
        k = self.rotations
        pair = torch.arange(0, n, 2)
        self._init_pairs(pair.expand(k, -1).clone(), (pair + 1).expand(k, -1).clone())
        perm_gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
        # Q_j x = x[perm_j]: the fixed permutations are part of the model (saved buffers).
        self.register_buffer("permutations",
                             torch.stack([torch.randperm(n, generator=perm_gen) for _ in range(k)]))
        self.angles = nn.Parameter(
            (torch.rand(k, n // 2, generator=generator) * 2 - 1) * math.pi)

    def multiply(self, x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        cos, sin, partner = self.coefficients(transpose)
        if transpose:  # W^T = Q_k^T R_k^T ... Q_1^T R_1^T
            inverse = torch.argsort(self.permutations, dim=1)
            for j in range(self.rotations):
                x = rotate_pairs(x, cos[j], sin[j], partner[j])[..., inverse[j]]
            return x
        return _chain_rows(x, cos, sin, partner, self.permutations)
