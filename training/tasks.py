"""The papers' tasks, all offline: generated (adding, copy), bundled data sets
(digits, permuted-digits, mnist1d, ucr), language modelling (lm) and a user's .npz.

``make_task(name, **options)`` returns a ``Task``: what the model must be built for
(kind, input size, outputs), the data (a training source and fixed validation and
test sets), the metric and the task's baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from orthornn.models.validation import check_choice, check_int

from . import corpus as corpus_lib
from .config import COPY_LOSSES, TASK_NAMES
from .data import Split, TokenStream

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

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "accuracy"

    def input_spec(self) -> dict:
        return {"kind": "tokens" if self.kind == "lm" else "float",
                "feature_size": self.input_size, "max_length": self.max_length}


# -- generated tasks ------------------------------------------------------------------

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


def _fixed(sample, size: int, seed: int) -> Split:
    return sample(size, torch.Generator().manual_seed(seed))


def _adding(seq_len: int = 200, eval_size: int = 1000) -> Task:
    steps = check_int("seq_len", seq_len, 2, 100_000)

    def sample(batch, generator):
        return adding_batch(batch, steps, generator)
    return Task("adding", "regress", 2, 1, "mse", val=_fixed(sample, eval_size, SPLIT_SEED),
                test=_fixed(sample, eval_size, SPLIT_SEED + 1), sample=sample,
                baseline=1 / 6, max_length=steps, options={"seq_len": steps})


def copy_baseline(lag: int, symbols: int = COPY_DATA, loss: str = "all") -> float:
    """Cross-entropy of guessing blanks, then uniformly among the data symbols: averaged
    over every step (``all``: 10 log(symbols) / (lag + 20)) or over the copied steps only
    (``copied``: log(symbols)). Copy accuracy's chance level is 1 / symbols either way."""
    if loss == "copied":
        return math.log(symbols)
    return COPY_LENGTH * math.log(symbols) / (lag + 2 * COPY_LENGTH)


def _copy(seq_len: int = 100, copy_loss: str = "all", copy_symbols: int = COPY_DATA,
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
                val=_fixed(sample, eval_size, SPLIT_SEED), sample=sample,
                test=_fixed(sample, eval_size, SPLIT_SEED + 1),
                baseline=copy_baseline(lag, symbols, copy_loss),
                labels=[str(i) for i in range(symbols + 2)],
                max_length=lag + 2 * COPY_LENGTH,
                options={"seq_len": lag, "copy_loss": copy_loss, "copy_symbols": symbols},
                scored_steps=COPY_LENGTH if copy_loss == "copied" else None)


# -- fixed data sets ------------------------------------------------------------------

# The splits are functions of the example count alone, so train_size (the presets' batch
# cap) runs the very code that builds them on the count, without loading the data.
DIGITS_COUNT = 1797  # scikit-learn's bundled 8x8 digits (load_digits)
DIGITS_SPLIT = (0.7, 0.15)  # train, validation; the test set is the rest
MNIST1D_COUNT = 4000  # training sequences of mnist1d's generator at its default arguments
MNIST1D_VAL = 500  # of them held out for validation
UCR_VAL = 0.2  # of the official training set held out (Spectral-RNN appendix)
USER_SPLIT = (0.8, 0.1)  # a user's .npz: train, validation; the test set is the rest


def _order(n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(SPLIT_SEED))


def _three_way(n: int, fractions: tuple[float, float]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indices of (train, validation, test) of n examples: a fixed seeded permutation cut
    at the two fractions."""
    order = _order(n)
    n_train = int(n * fractions[0])
    n_val = int(n * fractions[1])
    return order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:]


def _holdout(n: int, n_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of (train, validation) of n examples: a fixed seeded permutation's first
    n_val validate."""
    order = _order(n)
    return order[n_val:], order[:n_val]


def _ucr_holdout(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _holdout(n, max(1, round(UCR_VAL * n)))  # one series at least, however small


def _split_fixed(x: torch.Tensor, y: torch.Tensor, fractions: tuple[float, float],
                 lengths: torch.Tensor | None = None) -> tuple[Split, Split, Split]:
    whole = Split(x, y, lengths)
    train, val, test = (whole.take(i) for i in _three_way(len(y), fractions))
    return train, val, test


def _classification(name, train, val, test, labels, options) -> Task:
    return Task(name, "classify", train.x.shape[-1], len(labels), "accuracy", val=val,
                test=test, train=train, labels=labels, max_length=train.x.shape[1],
                options=options)


def _digits(permuted: bool) -> Task:
    """scikit-learn's bundled 8x8 digits, read pixel by pixel (T = 64), scaled to [0, 1];
    the permuted variant applies one fixed seeded permutation of the 64 pixels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16
    if permuted:
        x = x[:, torch.randperm(64, generator=torch.Generator().manual_seed(SPLIT_SEED))]
    splits = _split_fixed(x.unsqueeze(-1), torch.tensor(bunch.target), DIGITS_SPLIT)
    name = "permuted-digits" if permuted else "digits"
    task = _classification(name, *splits, [str(i) for i in range(10)], {})
    task.transform = {"kind": "affine", "offset": [0.0], "scale": [16.0],
                      "description": "scikit-learn's pixel values 0-16 divided by 16 (inputs "
                                     "in [0, 1])" + (", pixels in a fixed permuted order"
                                                     if permuted else "")}
    return task


def _mnist1d() -> Task:
    """MNIST-1D generated offline by the mnist1d package's own generator (its default
    arguments: 4000 training and 1000 test sequences of length 40); 500 training
    sequences held out for validation."""
    from mnist1d.data import get_dataset_args, make_dataset

    data = make_dataset(get_dataset_args())  # generation only, never its download
    x = torch.tensor(data["x"], dtype=torch.float32).unsqueeze(-1)
    y = torch.tensor(data["y"], dtype=torch.long)
    whole = Split(x, y)
    train, val = _holdout(len(y), MNIST1D_VAL)
    test = Split(torch.tensor(data["x_test"], dtype=torch.float32).unsqueeze(-1),
                 torch.tensor(data["y_test"], dtype=torch.long))
    return _classification("mnist1d", whole.take(train), whole.take(val), test,
                           [str(i) for i in range(10)], {})


def _sktime_data() -> Path:
    import sktime

    return Path(sktime.__file__).parent / "datasets" / "data"


def ucr_datasets() -> list[str]:
    """Equal-length UCR/UEA classification sets that sktime ships in the package."""
    names = []
    for folder in sorted(_sktime_data().iterdir()):
        train = folder / f"{folder.name}_TRAIN.ts"
        if not (train.is_file() and (folder / f"{folder.name}_TEST.ts").is_file()):
            continue
        header = train.read_text(errors="replace")[:20000].lower()
        header = header[: header.find("@data")]
        if "@classlabel true" in header and "@equallength false" not in header:
            names.append(folder.name)
    return names


def step_width(length: int) -> int:
    """n_i: the largest divisor of L not above sqrt(L) (Spectral-RNN appendix)."""
    return max(d for d in range(1, math.isqrt(length) + 1) if length % d == 0)


def fold_series(x: np.ndarray, point_by_point: bool) -> np.ndarray:
    """[N, channels, L] -> [N, L / n_i, channels n_i] (or [N, L, channels])."""
    n, channels, length = x.shape
    width = 1 if point_by_point else step_width(length)
    x = x.reshape(n, channels, length // width, width).transpose(0, 2, 1, 3)
    return x.reshape(n, length // width, channels * width)


def _ucr(dataset: str | None = None, point_by_point: bool = False) -> Task:
    """A bundled UCR/UEA set with its official train/test split; 20% of train (fixed,
    seeded) is held out for validation, as in the Spectral-RNN appendix."""
    from sktime.datasets import load_from_tsfile

    available = ucr_datasets()
    if dataset is None:
        raise ValueError(f"task 'ucr' needs --dataset NAME (dataset), one of: "
                         f"{', '.join(available)}")
    if dataset not in available:
        raise ValueError(f"dataset must be one of the UCR/UEA sets bundled with sktime: "
                         f"{', '.join(available)}; got {dataset!r}")
    root = _sktime_data() / dataset
    arrays = {}
    for part in ("TRAIN", "TEST"):
        x, y = load_from_tsfile(str(root / f"{dataset}_{part}.ts"), return_data_type="numpy3D")
        arrays[part] = (np.asarray(x, dtype=np.float32), np.asarray(y).astype(str))
    labels = sorted({str(v) for part in arrays.values() for v in part[1]})
    index = {label: i for i, label in enumerate(labels)}

    def split(part):
        x, y = arrays[part]
        return Split(torch.tensor(fold_series(x, point_by_point)),
                     torch.tensor([index[v] for v in y]))
    train_all, test = split("TRAIN"), split("TEST")
    train, val = _ucr_holdout(len(train_all))
    return _classification("ucr", train_all.take(train), train_all.take(val),
                           test, labels, {"dataset": dataset, "point_by_point": point_by_point})


def _series_count(path: Path) -> int:
    """Series in a .ts file: the non-empty lines after @data."""
    lines = path.read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().lower() == "@data")
    return sum(1 for line in lines[start + 1:] if line.strip() and not line.startswith("#"))


def train_size(name: str, dataset: str | None = None, data: str | None = None) -> int | None:
    """Sequences in a fixed-data task's training split, without building the task (the
    presets cap their batch size with it): the task's own split run on its example count.
    None for generated tasks, lm and bad input (which make_task then reports)."""
    if name in ("digits", "permuted-digits"):
        return len(_three_way(DIGITS_COUNT, DIGITS_SPLIT)[0])
    if name == "mnist1d":
        return len(_holdout(MNIST1D_COUNT, MNIST1D_VAL)[0])
    if name == "ucr" and dataset in ucr_datasets():
        series = _series_count(_sktime_data() / dataset / f"{dataset}_TRAIN.ts")
        return len(_ucr_holdout(series)[0])
    if name == "classify" and data is not None and Path(data).is_file():
        try:
            with np.load(data, allow_pickle=False) as f:
                return len(_three_way(len(f["y"]), USER_SPLIT)[0])
        except (OSError, ValueError, KeyError):
            return None
    return None


def _lm(corpus: str | None = None, vocab_size: int = 10000, bptt: int = 70,
        eval_columns: int = 10) -> Task:
    vocab_size = check_int("vocab_size", vocab_size, 3, 1_000_000)
    bptt = check_int("bptt", bptt, 1, 100_000)
    docs = corpus_lib.bundled_documents() if corpus is None else corpus_lib.file_documents(corpus)
    parts = corpus_lib.split_documents(docs)
    vocabulary = corpus_lib.build_vocabulary(parts["train"], vocab_size)

    def ids(name):
        return torch.tensor(corpus_lib.encode(parts[name], vocabulary), dtype=torch.long)
    columns = {name: min(eval_columns, max(1, (len(parts[name]) - 1) // 2)) for name in parts}
    return Task("lm", "lm", len(vocabulary), len(vocabulary), "perplexity",
                val=TokenStream(ids("val"), columns["val"], bptt),
                test=TokenStream(ids("test"), columns["test"], bptt),
                train=ids("train").tolist(), vocabulary=vocabulary, max_length=bptt,
                options={"corpus": corpus_lib.BUNDLED if corpus is None else str(corpus),
                         "vocab_size": vocab_size, "bptt": bptt})


def load_npz(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, list]:
    """A user's data: x [N, T, d] float (padded when ``lengths`` [N] is given), y [N]
    integer class ids, optional ``labels`` [C]."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data must be an existing .npz file; {str(path)!r} does not exist")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
    except (OSError, ValueError) as error:
        raise ValueError(f"data {str(path)!r} is not a readable .npz file ({error})") from None
    for key in ("x", "y"):
        if key not in arrays:
            raise ValueError(f"data file must hold arrays 'x' and 'y'; missing {key!r}")
    x, y = arrays["x"], arrays["y"]
    if x.ndim == 2:
        x = x[..., None]
    if x.ndim != 3 or not np.issubdtype(x.dtype, np.number):
        raise ValueError(f"data x must be a numeric array [N, T, d] (or [N, T]); got {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("data x holds NaN or infinite values")
    if y.ndim != 1 or len(y) != len(x) or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"data y must be integer class ids [N] with N = {len(x)}; "
                         f"got {y.dtype} {y.shape}")
    if len(y) < 10:
        raise ValueError(f"data must hold at least 10 sequences, got {len(y)}")
    if y.min() < 0:
        raise ValueError("data y class ids must be >= 0")
    lengths = None
    if "lengths" in arrays:
        lengths = arrays["lengths"]
        if lengths.shape != (len(x),) or not np.issubdtype(lengths.dtype, np.integer) \
                or lengths.min() < 1 or lengths.max() > x.shape[1]:
            raise ValueError(f"data lengths must be integers [N] in [1, {x.shape[1]}]")
        lengths = torch.tensor(lengths, dtype=torch.long)
    classes = int(y.max()) + 1
    labels = [str(v) for v in arrays["labels"]] if "labels" in arrays else \
        [str(i) for i in range(classes)]
    if len(labels) < max(classes, 2):
        raise ValueError(f"data labels must name every class (>= {max(classes, 2)}), "
                         f"got {len(labels)}")
    return (torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long), lengths,
            labels)


def _user_classify(data: str | None = None) -> Task:
    if data is None:
        raise ValueError("task 'classify' needs --data FILE (an .npz with x and y)")
    x, y, lengths, labels = load_npz(data)
    train, val, test = _split_fixed(x, y, USER_SPLIT, lengths)
    return _classification("classify", train, val, test, labels, {"data": str(data)})


_BUILDERS = {
    "adding": (_adding, ("seq_len",)),
    "copy": (_copy, ("seq_len", "copy_loss", "copy_symbols")),
    "digits": (lambda: _digits(False), ()),
    "permuted-digits": (lambda: _digits(True), ()),
    "mnist1d": (_mnist1d, ()),
    "ucr": (_ucr, ("dataset", "point_by_point")),
    "lm": (_lm, ("corpus", "vocab_size", "bptt")),
    "classify": (_user_classify, ("data",)),
}


def make_task(name: str, **options) -> Task:
    """Build a task; options a task does not take must be None (unset)."""
    if name not in _BUILDERS:
        raise ValueError(f"task must be one of {', '.join(TASK_NAMES)}; got {name!r}")
    builder, accepted = _BUILDERS[name]
    stray = sorted(k for k, v in options.items() if v is not None and k not in accepted)
    if stray:
        raise ValueError(f"option(s) {', '.join(stray)} do not apply to task {name!r}"
                         + (f" (it takes: {', '.join(accepted)})" if accepted else ""))
    return builder(**{k: v for k, v in options.items() if k in accepted and v is not None})
