"""A task: what the model is built for, its data and its metric; the fixed, seeded splits
every bundled data set is cut with (functions of the example count alone, so ``train_size``
runs them without loading the data)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..data import Split, TokenStream

SPLIT_SEED = 2018  # fixed splits and permutations: independent of the training seed


@dataclass
class Task:
    name: str
    kind: str  # the model's task: classify | regress | seq2seq | lm
    input_size: int
    num_outputs: int
    metric: str  # accuracy | mse | cross_entropy | perplexity
    val: Split | TokenStream
    test: Split | TokenStream
    #: generated tasks: sample(batch_size, generator) -> Split; else None
    sample: Callable[[int, torch.Generator], Split] | None = None
    train: Split | list[int] | None = None  # a fixed split, or lm's training token ids
    baseline: float | None = None
    labels: list[str] | None = None
    vocabulary: list[str] | None = None
    max_length: int = 0
    #: seq2seq: the loss and its metric score only the last ``scored_steps`` steps (the copy
    #: task's copied portion, DizzyRNN sec. 6); None: every step
    scored_steps: int | None = None
    options: dict = field(default_factory=dict)  # what rebuilds this data pipeline
    #: how raw inputs became the model's inputs: {"kind": "affine", "offset": [...],
    #: "scale": [...], "description": ...} (model input = (raw - offset) / scale); None: as given
    transform: dict | None = None
    #: several data files (classify --data A --data B): how many rows of the concatenated train
    #: and test splits each file gave, in order; None: one data set
    train_parts: list[int] | None = None
    test_parts: list[int] | None = None

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    def input_spec(self) -> dict:
        return {"kind": "tokens" if self.kind == "lm" else "float",
                "feature_size": self.input_size, "max_length": self.max_length}


def split_order(n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))


def three_way(n: int, fractions: tuple[float, float]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices of (train, validation, test) of n examples: a fixed seeded permutation cut
    at the two fractions."""
    order = split_order(n)
    n_train = int(n * fractions[0])
    n_val = int(n * fractions[1])
    return order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:]


def holdout(n: int, n_val: int, fold: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of (train, validation) of n examples: block FOLD of n_val of a fixed seeded
    permutation validates (the first by default), the rest trains."""
    order = split_order(n)
    start = fold * n_val
    return torch.cat([order[:start], order[start + n_val:]]), order[start:start + n_val]


def split_fixed(x: torch.Tensor, y: torch.Tensor, fractions: tuple[float, float],
                 lengths: torch.Tensor | None = None) -> tuple[Split, Split, Split]:
    whole = Split(x, y, lengths)
    train, val, test = (whole.take(i) for i in three_way(len(y), fractions))
    return train, val, test


def classification(name, train, val, test, labels, options) -> Task:
    return Task(name, "classify", train.x.shape[-1], len(labels), "accuracy", val=val,
                test=test, train=train, labels=labels, max_length=train.x.shape[1],
                options=options)


def seeded_sample(sample, size: int, seed: int) -> Split:
    return sample(size, torch.Generator().manual_seed(seed))
