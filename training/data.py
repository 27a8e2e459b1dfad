"""Containers for a task's data: fixed splits of (x, y, lengths) and a token stream.

Generated tasks (adding, copy) draw a fresh training batch per step from a seeded
generator; dataset tasks shuffle a fixed training split once per epoch.

Data-parallel (training.distributed): rank r of N trains ``rank_share`` of each global batch,
rows r, r + N, ...; the language model's rank takes a contiguous block of the stream's
columns instead. Either way the ranks' rows of a step are together the one-process batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rank_share(index: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank`` of ``world``'s rows of a global batch: every world-th from its own.
    On an epoch's permutation this is torch's DistributedSampler split (rank r reads order[r::N],
    b = B / N at a time), so each example is read once per epoch by one rank."""
    return index[rank::world]


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

    def shard(self, rank: int, world: int) -> Split:
        """This rank's rows of a batch (``rank_share``); the whole batch for one process."""
        return self if world == 1 else self.take(rank_share(torch.arange(len(self)), rank, world))

    def batches(self, batch_size: int):
        for start in range(0, len(self), batch_size):
            yield self.take(torch.arange(start, min(start + batch_size, len(self))))


class EpochSampler:
    """Minibatches from a fixed split: a seeded permutation per epoch, the last
    incomplete batch dropped so every step sees batch_size sequences (the global batch;
    rank ``rank`` of ``world`` reads only its ``rank_share`` of it)."""

    def __init__(self, split: Split, batch_size: int, seed: int, rank: int = 0,
                 world: int = 1):
        if len(split) < batch_size:
            raise ValueError(f"batch_size must be at most the training set size "
                             f"({len(split)}), got {batch_size}")
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.rank, self.world = rank, world
        self.per_epoch = len(split) // batch_size

    def batch(self, step: int) -> Split:
        epoch, i = divmod(step, self.per_epoch)
        order = torch.randperm(len(self.split),
                               generator=torch.Generator().manual_seed(self.seed + epoch))
        chosen = order[i * self.batch_size:(i + 1) * self.batch_size]
        return self.split.take(rank_share(chosen, self.rank, self.world))


class MixedSampler:
    """Minibatches from two pools of a fixed split, the first ``first`` rows (the original
    data) and the rest (the captured data): each global batch takes
    ``round(mix * batch_size)`` rows (at least 1, at most batch_size - 1) from the second
    pool and the rest from the first. Each pool is read as an endless stream of seeded
    permutations, one per pass over it, so a small captured pool is oversampled (read
    again, reshuffled, on each pass) and never repeats a row within a pass. ``per_epoch``
    counts steps per pass over the whole split (what --epochs means)."""

    def __init__(self, split: Split, first: int, batch_size: int, mix: float, seed: int,
                 rank: int = 0, world: int = 1):
        rest = len(split) - first
        if first < 1 or rest < 1:
            raise ValueError(f"data_mix needs rows in both the first data file's training "
                             f"split and the others'; got {first} and {rest}")
        if batch_size < 2:
            raise ValueError(f"data_mix needs batch_size >= 2 (one row from each pool); "
                             f"got {batch_size}")
        self.split, self.batch_size, self.seed = split, batch_size, seed
        self.rank, self.world = rank, world
        self.pools = (torch.arange(first), torch.arange(first, len(split)))
        second = min(batch_size - 1, max(1, round(mix * batch_size)))
        self.counts = (batch_size - second, second)
        self.per_epoch = max(1, len(split) // batch_size)

    def _rows(self, pool: int, step: int) -> torch.Tensor:
        rows, k = self.pools[pool], self.counts[pool]
        n = len(rows)
        positions = torch.arange(step * k, (step + 1) * k)
        chosen = torch.empty(k, dtype=torch.long)
        for p in positions.div(n, rounding_mode="floor").unique().tolist():  # passes in this batch
            order = torch.randperm(n, generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + 2 * p + pool))
            here = positions.div(n, rounding_mode="floor") == p
            chosen[here] = rows[order[positions[here] % n]]
        return chosen

    def batch(self, step: int) -> Split:
        chosen = torch.cat([self._rows(0, step), self._rows(1, step)])
        return self.split.take(rank_share(chosen, self.rank, self.world))


class TokenStream:
    """A long token stream cut into ``columns`` parallel streams [columns, L]; step i
    reads the window [i bptt, (i + 1) bptt] and its one-step-shifted target, so the
    hidden state carries from one step to the next (reset at each epoch).

    Rank ``rank`` of ``world`` keeps the block ``rows`` of columns/world consecutive
    columns: a contiguous part of the stream, whose hidden state it carries itself."""

    def __init__(self, tokens: torch.Tensor, columns: int, bptt: int, rank: int = 0,
                 world: int = 1):
        length = (tokens.numel() - 1) // columns
        if length < 2:
            raise ValueError(f"the token stream ({tokens.numel()} tokens) is too short for "
                             f"{columns} columns")
        self.tokens = tokens  # all of them (the streams drop the last few that do not fit)
        self.data = tokens[: columns * length + 1]
        self.rows = slice(rank * columns // world, (rank + 1) * columns // world)
        self.inputs = self.data[:-1].view(columns, length)[self.rows]
        self.targets = self.data[1:].view(columns, length)[self.rows]
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


def dtype_of(model) -> torch.dtype:
    """The dtype the model computes in (TrainConfig.precision)."""
    return next(model.parameters()).dtype


def model_input(x: torch.Tensor, model, device: torch.device) -> torch.Tensor:
    """X on DEVICE; a float input in the model's dtype (the data is made in float32 for
    every precision, so a float64 run sees the same numbers)."""
    return x.to(device, dtype_of(model)) if x.is_floating_point() else x.to(device)
