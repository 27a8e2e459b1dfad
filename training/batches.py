"""A run's data, step by step, as two strategies of the training loop: the windows of a
language model's token stream (the hidden state carried from one window to the next) and
the batches of every other task (sampled from a fixed split, or generated). Each runs the
forward pass of its step, so the loop has no branch on the task."""

from __future__ import annotations

import torch

from . import distributed
from .config import TrainConfig
from .data import EpochSampler, MixedSampler, TokenStream, dtype_of, model_input
from .tasks import Task


class Windows:
    """A language model's training stream: this rank's columns of each window
    (``TokenStream.rows``), the state carried across windows (and checkpointed)."""

    def __init__(self, task: Task, config: TrainConfig, ctx: distributed.Context):
        self.stream = TokenStream(torch.tensor(task.train), config.batch_size,
                                  task.options["bptt"], ctx.rank, ctx.world)
        self.per_epoch: int | None = self.stream.per_epoch
        self.carried: torch.Tensor | None = None

    def resume(self, carried: torch.Tensor | None) -> None:
        """The checkpoint's state of the whole batch: this rank's columns of it."""
        self.carried = None if carried is None else carried[self.stream.rows]

    def forward(self, net, model, step: int, log_now: bool, device: torch.device):
        """(output, target, h0: a leaf whose gradient is logged on LOG_NOW steps, or None)."""
        x, y, fresh = self.stream.window(step)
        x, y = x.to(device), y.to(device)
        h0 = None if fresh or self.carried is None else self.carried.to(device)
        if log_now:
            h0 = (torch.zeros(x.shape[0], model.state_size, device=device,
                              dtype=dtype_of(model))
                  if h0 is None else h0).requires_grad_(True)
        out, last = net(x, h0=h0, return_state=True)
        self.carried = last.detach()
        return out, y, h0

    def whole_state(self, ctx: distributed.Context) -> torch.Tensor | None:
        """The carried state of every rank's columns (a collective: every rank calls it)."""
        return None if self.carried is None else distributed.gather_rows(self.carried, ctx)


class Batches:
    """Every other task: this rank's rows of each global batch (``data.rank_share``),
    from the fixed split's epochs or generated from the step's own seed."""

    def __init__(self, task: Task, config: TrainConfig, ctx: distributed.Context):
        self.task, self.config, self.ctx = task, config, ctx
        self.sampler: EpochSampler | MixedSampler | None = None
        if task.sample is None and config.data_mix is not None and task.train_parts:
            # --data-mix: a fixed share of each batch from the files after the first
            self.sampler = MixedSampler(task.train, task.train_parts[0], config.batch_size,
                                        config.data_mix, config.seed, ctx.rank, ctx.world)
        elif task.sample is None:
            self.sampler = EpochSampler(task.train, config.batch_size, config.seed, ctx.rank,
                                        ctx.world)
        self.per_epoch = None if self.sampler is None else self.sampler.per_epoch

    def resume(self, carried: torch.Tensor | None) -> None:
        pass  # nothing is carried between batches

    def forward(self, net, model, step: int, log_now: bool, device: torch.device):
        config = self.config
        if self.sampler is None:
            batch = self.task.sample(config.batch_size, torch.Generator().manual_seed(
                config.seed * 1_000_003 + step)).shard(self.ctx.rank, self.ctx.world)
        else:
            batch = self.sampler.batch(step)
        x, y = model_input(batch.x, model, device), model_input(batch.y, model, device)
        lengths = None if batch.lengths is None else batch.lengths.to(device)
        h0 = None
        if log_now and getattr(model, "state_size", None):
            h0 = torch.zeros(x.shape[0], model.state_size, device=device,
                             dtype=dtype_of(model), requires_grad=True)
        out = net(x, lengths=lengths, h0=h0) if h0 is not None else net(x, lengths=lengths)
        return out, y, h0

    def whole_state(self, ctx: distributed.Context) -> None:
        return None


def batches_for(task: Task, config: TrainConfig, ctx: distributed.Context) -> Windows | Batches:
    return Windows(task, config, ctx) if task.kind == "lm" else Batches(task, config, ctx)
