"""Parametrizations: small modules that turn parameters into a (transition) matrix.

Every stage reuses these: the cells build their transition from them, export folds
``matrix()`` into dense weights or keeps the factored ``multiply`` form.
"""

from .base import Parametrization
from .cayley import ScaledCayley
from .dense import DenseTransition
from .givens import (
    PackedGivens,
    RotationPermutation,
    pair_coefficients,
    pair_layout,
    rotate_pairs,
    round_robin_pairs,
)
from .householder import HouseholderChain
from .svd import BoundedSingularValues, FreeSingularValues, SVDForm

__all__ = [
    "BoundedSingularValues",
    "DenseTransition",
    "FreeSingularValues",
    "HouseholderChain",
    "PackedGivens",
    "Parametrization",
    "RotationPermutation",
    "SVDForm",
    "ScaledCayley",
    "pair_coefficients",
    "pair_layout",
    "rotate_pairs",
    "round_robin_pairs",
]
