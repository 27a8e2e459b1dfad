"""Containers for a task's data: fixed splits of (x, y, lengths) and a token stream.

Generated tasks (adding, copy) draw a fresh training batch per step from a seeded
generator; dataset tasks shuffle a fixed training split once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Split:
    """A fixed set of sequences. x [N, T, d] float or [N, T] long; y [N] / [N, 1] /
    [N, T]; lengths [N] or None (all sequences use every step)."""

    x: torch.Tensor
    y: torch.Tensor
    lengths: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.x.shape[0]

    def take(self, index: torch.Tensor) -> Split:
        lengths = None if self.lengths is None else self.lengths[index]
        return Split(self.x[index], self.y[index], lengths)

    def batches(self, batch_size: int):
        for start in range(0, len(self), batch_size):
            yield self.take(torch.arange(start, min(start + batch_size, len(self))))


class EpochSampler:
    """Minibatches from a fixed split: a seeded permutation per epoch, the last
    incomplete batch dropped so every step sees batch_size sequences."""

    def __init__(self, split: Split, batch_size: int, seed: int):
        if len(split) < batch_size:
            raise ValueError(f"batch_size must be at most the training set size "
                             f"({len(split)}), got {batch_size}")
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.per_epoch = len(split) // batch_size

    def batch(self, step: int) -> Split:
        epoch, i = divmod(step, self.per_epoch)
        order = torch.randperm(len(self.split),
                               generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.split.take(order[i * self.batch_size:(i + 1) * self.batch_size])


class TokenStream:
    """A long token stream cut into ``columns`` parallel streams [columns, L]; step i
    reads the window [i bptt, (i + 1) bptt] and its one-step-shifted target, so the
    hidden state carries from one step to the next (reset at each epoch)."""

    def __init__(self, tokens: torch.Tensor, columns: int, bptt: int):
        length = (tokens.numel() - 1) // columns
        if length < 2:
            raise ValueError(f"the token stream ({tokens.numel()} tokens) is too short for "
                             f"{columns} columns")
        self.data = tokens[: columns * length + 1]
        self.inputs = self.data[:-1].view(columns, length)
        self.targets = self.data[1:].view(columns, length)
        self.bptt = min(bptt, length)
        self.per_epoch = -(-length // self.bptt)

    def window(self, step: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(x [columns, <=bptt], y, starts_epoch)."""
        i = step % self.per_epoch
        sl = slice(i * self.bptt, (i + 1) * self.bptt)
        return self.inputs[:, sl], self.targets[:, sl], i == 0

    def windows(self):
        for i in range(self.per_epoch):
            x, y, _ = self.window(i)
            yield x, y
