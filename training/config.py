"""Training configuration: one dataclass, filled from a YAML/JSON file and/or flags.

Every field can be set in the file; flags given on the command line override it.
``validate`` checks ranges and names the field and its allowed values.
"""

from __future__ import annotations

import json
import math
import types
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import get_args, get_type_hints

# This module stays torch-free (the console script builds its flags from it); the
# checks import models lazily.
TASK_NAMES = ("adding", "copy", "digits", "permuted-digits", "mnist1d", "ucr", "lm", "classify")

OPTIMIZERS = ("rmsprop", "adam")
SCHEDULES = ("constant", "cosine", "step", "linear")
SELECTS = ("auto", "best", "last")
COPY_LOSSES = ("all", "copied")  # cross-entropy over every step, or the copied steps only
DEVICES = ("auto", "cpu", "cuda")
#: the dtype of the parameters and the arithmetic while training; the run's weights are
#: saved in it, and export (and the kept model's test score) folds them to float32 as
#: served. float64 keeps the CPU kernels' last-bit differences from growing through
#: training (the quickstart's word model: weights within 2.2e-9 under 12 numerics
#: settings, where float32's gave other answers: docs/training.md, "Across CPUs"), at
#: about 2x float32's time on the CPU.
PRECISIONS = ("float32", "float64")


@dataclass
class TrainConfig:
    arch: str = "svdrnn"
    task: str = "adding"
    out: str | None = None
    # model
    hidden_size: int = 128
    arch_options: dict = field(default_factory=dict)
    embedding_size: int | None = None
    # data (each applies to the tasks that take it)
    seq_len: int | None = None
    copy_loss: str | None = None
    copy_symbols: int | None = None
    dataset: str | None = None
    point_by_point: bool | None = None
    step_width: int | None = None  # UCR: points a step (the series padded to a multiple)
    val_fold: int | None = None  # UCR: which 20% block of the training split validates
    corpus: str | list[str] | None = None  # one text file, or several (each split on its own)
    vocab_size: int | None = None
    bptt: int | None = None
    data: str | list[str] | None = None  # one .npz, or several (their splits concatenated)
    data_mix: float | None = None  # share of each batch drawn from the data files after the first
    # optimisation
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 64
    optimizer: str = "rmsprop"
    lr: float = 1e-3
    orthogonal_lr: float | None = None
    schedule: str = "constant"
    clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    precision: str = "float32"
    threads: int | None = None
    # bookkeeping
    log_every: int = 50
    eval_every: int | None = None
    eval_batch_size: int = 256
    select: str = "auto"
    plot: bool = False

    def task_options(self) -> dict:
        return {"seq_len": self.seq_len, "copy_loss": self.copy_loss,
                "copy_symbols": self.copy_symbols, "dataset": self.dataset,
                "point_by_point": self.point_by_point, "step_width": self.step_width,
                "val_fold": self.val_fold,
                "corpus": self.corpus,
                "vocab_size": self.vocab_size, "bptt": self.bptt, "data": self.data,
                "data_mix": self.data_mix}

    def to_dict(self) -> dict:
        return asdict(self)


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def read_config_file(path: str | Path) -> dict:
    """A YAML or JSON mapping of TrainConfig fields."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            values = json.loads(text)
        else:
            import yaml

            values = yaml.safe_load(text)
    except Exception as error:  # a syntax error of either format
        raise ValueError(f"config file {str(path)!r} cannot be parsed: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of options")
    if "format" in values and isinstance(values.get("train"), dict):
        # a run's own config.json: its training options, for a new run (a new --out)
        values = {k: v for k, v in values["train"].items() if k != "out"}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(field_names()))
    if unknown:
        raise ValueError(f"config file {str(path)!r}: unknown option(s) {', '.join(unknown)}; "
                         f"allowed: {', '.join(field_names())}")
    return {name: typed_value(name, value, path) for name, value in values.items()}


def typed_value(name: str, value: object, path: str | Path) -> object:
    """A config file's value of option ``name`` as the option's type (TrainConfig's
    annotation): a number written as a string (``lr: "0.02"``, what ``helm --set`` renders
    for a decimal) is that number; a bool given as "true" or "false" is the bool. Anything
    else not of the type is a ValueError naming the option, the file and what is allowed.
    None, and the options of several types (paths, arch_options), are left to ``validate``."""
    hint = get_type_hints(TrainConfig)[name]
    kinds = [t for t in (get_args(hint) if isinstance(hint, types.UnionType) else (hint,))
             if t is not type(None)]
    kind = kinds[0] if len(kinds) == 1 else None
    if value is None or kind not in (int, float, bool, str):
        return value
    allowed = {int: 'an integer (e.g. 40 or "40")', float: 'a number (e.g. 0.02 or "0.02")',
               bool: "true or false", str: "a string"}[kind]
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if kind is bool and text in ("true", "false"):
            return text == "true"
        if kind in (int, float):
            try:
                number = kind(text)
            except ValueError:  # "2.5" for an integer, "abc", ""
                number = math.nan
            if math.isfinite(number):
                return number
    elif (kind is bool or not isinstance(value, bool)) and (  # a bool is no number
            isinstance(value, kind) or (kind is float and isinstance(value, int))):
        return value
    raise ValueError(f"config file {str(path)!r}: {name} must be {allowed}; got {value!r}")


#: most data files one run reads (the original set, the captures, a few more)
MAX_DATA_FILES = 16


def check_paths(name: str, value: object) -> None:
    """data or corpus: one path, or a list of 1 to MAX_DATA_FILES paths."""
    if value is not None and not isinstance(value, str) and (
            not isinstance(value, list | tuple) or not value or len(value) > MAX_DATA_FILES
            or not all(isinstance(p, str) and p for p in value)):
        raise ValueError(f"{name} must be a path or a list of 1 to {MAX_DATA_FILES} paths "
                         f"(--{name} FILE, repeated); got {value!r}")


def check_data(data: object, data_mix: object) -> None:
    """data: one path, or a list of 1 to MAX_DATA_FILES paths; data_mix in (0, 1), only with
    two or more files (it is the share of each batch drawn from the files after the first)."""
    check_paths("data", data)
    if data_mix is not None:
        files = 0 if data is None else 1 if isinstance(data, str) else len(data)  # type: ignore[arg-type]
        if files < 2:
            raise ValueError("data_mix (--data-mix) needs two or more --data files: it is the "
                             "share of each batch drawn from the files after the first")
        if isinstance(data_mix, bool) or not isinstance(data_mix, int | float) \
                or not 0 < data_mix < 1:
            raise ValueError(f"data_mix must be a number in (0, 1) (the share of each batch "
                             f"from the files after the first); got {data_mix!r}")


def validate(config: TrainConfig) -> TrainConfig:
    from orthornn.models import ARCHITECTURES
    from orthornn.models.validation import check_choice, check_float, check_int

    if config.arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}; got {config.arch!r}")
    check_choice("task", config.task, TASK_NAMES)
    if not config.out:
        raise ValueError("--out RUN_DIR is required (out: the run directory to create)")
    check_int("hidden_size", config.hidden_size, 1, 65536)
    if config.copy_loss is not None:
        check_choice("copy_loss", config.copy_loss, COPY_LOSSES)
    if config.copy_symbols is not None:
        check_int("copy_symbols", config.copy_symbols, 2, 1000)
    if not isinstance(config.arch_options, dict):
        raise ValueError("arch_options must be a mapping of option names to values")
    own = sorted(set(config.arch_options) & {f.name for f in fields(TrainConfig)})
    if own:  # build_model takes these as its own arguments (a TypeError there)
        flags = ", ".join(f"--{name.replace('_', '-')}" for name in own)
        raise ValueError(f"arch_options: {', '.join(own)} are settings of their own ({flags}), "
                         f"not architecture options")
    check_data(config.data, config.data_mix)
    check_paths("corpus", config.corpus)
    if config.steps is not None and config.epochs is not None:
        raise ValueError("give steps or epochs, not both")
    if config.steps is not None:
        check_int("steps", config.steps, 1)
    if config.epochs is not None:
        check_float("epochs", config.epochs, 0.0, low_open=True)
    check_int("batch_size", config.batch_size, 1, 1 << 20)
    check_choice("optimizer", config.optimizer, OPTIMIZERS)
    check_float("lr", config.lr, 0.0, 10.0, low_open=True)
    if config.orthogonal_lr is not None:
        check_float("orthogonal_lr", config.orthogonal_lr, 0.0, 10.0, low_open=True)
    check_choice("schedule", config.schedule, SCHEDULES)
    check_float("clip", config.clip, 0.0)
    check_int("seed", config.seed, 0)
    check_choice("device", config.device, DEVICES)
    check_choice("precision", config.precision, PRECISIONS)
    if config.threads is not None:
        check_int("threads", config.threads, 1, 1024)
    check_int("log_every", config.log_every, 1)
    if config.eval_every is not None:
        check_int("eval_every", config.eval_every, 1)
    check_int("eval_batch_size", config.eval_batch_size, 1)
    check_choice("select", config.select, SELECTS)
    return config
