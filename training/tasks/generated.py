"""Generated tasks: the adding problem and the copy task (Arjovsky et al.; DizzyRNN
sec. 6), sampled afresh for training, with fixed seeded validation and test sets."""

from __future__ import annotations

import math

import torch
from orthornn.models.validation import check_choice, check_int

from ..config import COPY_LOSSES
from ..data import Split
from .task import SPLIT_SEED, Task, seeded_sample


def adding_batch(batch: int, steps: int, generator: torch.Generator) -> Split:
    """Adding problem: channel 0 values U[0, 1), channel 1 two markers, one in each half
    of the sequence; the target is the sum of the two marked values."""
    values = torch.rand(batch, steps, generator=generator)
    half = steps // 2
    first = torch.randint(0, half, (batch,), generator=generator)
    second = torch.randint(half, steps, (batch,), generator=generator)
    markers = torch.zeros(batch, steps)
    rows = torch.arange(batch)
    markers[rows, first] = 1
    markers[rows, second] = 1
    y = (values[rows, first] + values[rows, second]).unsqueeze(1)
    return Split(torch.stack([values, markers], dim=-1), y)


COPY_LENGTH = 10  # symbols to memorise and copy (Arjovsky et al.; DizzyRNN sec. 6)
COPY_DATA = 8  # data symbols of the default (Arjovsky) variant: 1-8
COPY_SYMBOLS = COPY_DATA + 2  # its alphabet: 0 blank, 1-8 data, 9 the marker


def copy_batch(batch: int, lag: int, generator: torch.Generator,
               symbols: int = COPY_DATA) -> Split:
    """Copy task: 10 symbols from 1-``symbols``, blanks (0), the marker ``symbols`` + 1
    ten steps before the end; the target is blank until the marker, then the 10 symbols.
    Length lag + 20; one-hot inputs of ``symbols`` + 2 channels."""
    steps = lag + 2 * COPY_LENGTH
    data = torch.randint(1, symbols + 1, (batch, COPY_LENGTH), generator=generator)
    x = torch.zeros(batch, steps, dtype=torch.long)
    x[:, :COPY_LENGTH] = data
    x[:, steps - COPY_LENGTH - 1] = symbols + 1
    y = torch.zeros(batch, steps, dtype=torch.long)
    y[:, -COPY_LENGTH:] = data
    return Split(torch.nn.functional.one_hot(x, symbols + 2).float(), y)


def adding_task(seq_len: int = 200, eval_size: int = 1000) -> Task:
    steps = check_int("seq_len", seq_len, 2, 100_000)

    def sample(batch, generator):
        return adding_batch(batch, steps, generator)
    return Task("adding", "regress", 2, 1, "mse", val=seeded_sample(sample, eval_size, SPLIT_SEED),
                test=seeded_sample(sample, eval_size, SPLIT_SEED + 1), sample=sample,
                baseline=1 / 6, max_length=steps, options={"seq_len": steps})


def copy_baseline(lag: int, symbols: int = COPY_DATA, loss: str = "all") -> float:
    """Cross-entropy of guessing blanks, then uniformly among the data symbols: averaged
    over every step (``all``: 10 log(symbols) / (lag + 20)) or over the copied steps only
    (``copied``: log(symbols)). Copy accuracy's chance level is 1 / symbols either way."""
    if loss == "copied":
        return math.log(symbols)
    return COPY_LENGTH * math.log(symbols) / (lag + 2 * COPY_LENGTH)


def copy_task(seq_len: int = 100, copy_loss: str = "all", copy_symbols: int = COPY_DATA,
          eval_size: int = 1000) -> Task:
    """Arjovsky et al.'s copy task (``copy_loss='all'``, 8 symbols: the cross-entropy of
    every step) or DizzyRNN's (sec. 6: ``copy_loss='copied'``, 10 symbols, lag 90: only
    the copied portion is scored)."""
    lag = check_int("seq_len", seq_len, 1, 100_000)
    check_choice("copy_loss", copy_loss, COPY_LOSSES)
    symbols = check_int("copy_symbols", copy_symbols, 2, 1000)

    def sample(batch, generator):
        return copy_batch(batch, lag, generator, symbols)
    return Task("copy", "seq2seq", symbols + 2, symbols + 2, "cross_entropy",
                val=seeded_sample(sample, eval_size, SPLIT_SEED), sample=sample,
                test=seeded_sample(sample, eval_size, SPLIT_SEED + 1),
                baseline=copy_baseline(lag, symbols, copy_loss),
                labels=[str(i) for i in range(symbols + 2)],
                max_length=lag + 2 * COPY_LENGTH,
                options={"seq_len": lag, "copy_loss": copy_loss, "copy_symbols": symbols},
                scored_steps=COPY_LENGTH if copy_loss == "copied" else None)
