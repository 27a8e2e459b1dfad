"""Task presets: every training option of every task, per architecture where the papers
differ, each with where it comes from.

``resolve(values)`` fills a TrainConfig from four layers, later ones winning:

    default (TrainConfig's field defaults)  <  preset (this table)
        <  resumed run / config file  <  flag

and returns each value's ``Provenance`` beside it: its kind decides whether the batch
size may be capped to the data, its text is what ``orthornn train --show-config`` prints.
Values the papers do not give come from the authors' public code where it has them
(zhangjiong724/spectral-RNN code/test.json and Params.py; SpartinStuff/scoRNN), else
they are orthornn's own choices, marked as such with the measurement behind them.

Importing this module needs no torch (``train --help`` builds on TrainConfig alone);
``resolve`` imports ``orthornn.models`` for the architectures' option names and, for the
batch-size fit of a fixed data set, the task code that counts its training split.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, fields

from ..config import TASK_NAMES, TrainConfig
from .table import PRESETS


class Kind(enum.Enum):
    """Where a resolved value came from."""

    DEFAULT = "default"  # TrainConfig's field default
    PRESET = "preset"  # a rule of the task's preset
    FLAG = "flag"  # the command line
    CONFIG = "config file"  # --config FILE
    RESUMED = "resumed run"  # --resume: the run's own configuration
    PER_OPTION = "per option"  # arch_options as a whole: each option has its own source


#: kinds whose values the user chose: the presets' batch cap leaves them as given (the
#: trainer then rejects a batch larger than the training split, naming it)
CHOSEN = frozenset({Kind.FLAG, Kind.CONFIG, Kind.RESUMED})


@dataclass(frozen=True)
class Provenance:
    """Where a value came from: ``kind`` decides, ``str()`` is what --show-config prints,
    e.g. 'preset: SOURCE (capped at the 54 training sequences)'."""

    kind: Kind
    detail: str = ""  # the preset rule's source, the config file, what a flag replaced
    notes: tuple[str, ...] = ()  # what happened to the value since, in parentheses

    def noted(self, note: str) -> Provenance:
        return dataclasses.replace(self, notes=(*self.notes, note))

    def __str__(self) -> str:
        head = f"{self.kind.value}:" if self.kind in (Kind.PRESET, Kind.PER_OPTION) \
            else self.kind.value
        return " ".join([head, *([self.detail] if self.detail else []),
                         *(f"({note})" for note in self.notes)])


DEFAULT, FLAG = Provenance(Kind.DEFAULT), Provenance(Kind.FLAG)


def _field_defaults() -> dict:
    config = TrainConfig()
    return {f.name: getattr(config, f.name) for f in fields(TrainConfig)}


def _batch_fit(config: dict) -> int | None:
    """The size of the task's training split when it is a fixed set (None otherwise)."""
    if config["task"] not in ("digits", "permuted-digits", "mnist1d", "ucr", "classify"):
        return None
    from ..tasks import train_size

    return train_size(config["task"], **{k: config.get(k) for k in ("dataset", "data")})


def resolve(given: dict, origin: dict[str, Provenance] | None = None
            ) -> tuple[TrainConfig, dict[str, Provenance]]:
    """TrainConfig from ``given`` (field -> value, from flags, a config file or a resumed
    run; ``origin`` says where each came from, default a flag) over the task preset over
    TrainConfig's defaults. Returns (config, sources): sources maps every field (and
    ``arch_options.KEY``) to its Provenance: default, a preset rule, or the given origin."""
    origin = dict(origin or {})
    values = _field_defaults()
    sources = {name: DEFAULT for name in values}
    arch, task = given.get("arch", values["arch"]), given.get("task", values["task"])
    values.update(arch=arch, task=task)
    user_options = dict(given.get("arch_options") or {})
    merged = {**values, **{k: v for k, v in given.items() if k != "arch_options"}}
    preset_options: dict = {}
    option_sources: dict[str, Provenance] = {}
    if task in PRESETS:
        from orthornn.models import ARCHITECTURES

        name = ARCHITECTURES[arch].name if arch in ARCHITECTURES else arch
        allowed = set(ARCHITECTURES[arch].options) if arch in ARCHITECTURES else set()
        for rule in PRESETS[task].values():
            if rule.archs is not None and name not in rule.archs:
                continue
            if rule.when is not None and not rule.when(merged):
                continue
            preset = Provenance(Kind.PRESET, rule.source)
            for key, value in rule.values.items():
                if key == "arch_options":
                    for option, v in value.items():
                        if option in allowed:
                            preset_options[option] = v
                            option_sources[option] = preset
                    continue
                other = {"steps": "epochs", "epochs": "steps"}.get(key)
                if other is not None and other in given:
                    continue  # the user chose the other unit of the budget
                if other is not None:
                    values[other] = None
                    sources[other] = DEFAULT.noted(f"the preset gives {key}")
                values[key], sources[key] = value, preset
                if key not in given:
                    merged[key] = value
    for key, value in given.items():
        if key == "arch_options":
            continue
        values[key], sources[key] = value, origin.get(key, FLAG)
    # values that are functions of the resolved config (e.g. scoRNN's rho from n)
    for key, value in list(values.items()):
        if callable(value):
            values[key] = value(values)
    options = {}
    for option, value in preset_options.items():
        if option in user_options:
            continue  # given: the user's value below (no preset function to evaluate)
        # a function of the config sees the options given with it (e.g. b2_init from a_init)
        options[option] = value({**values, "arch_options": user_options}) \
            if callable(value) else value
    for option, value in user_options.items():
        options[option] = value
        option_sources[option] = origin.get("arch_options", FLAG)
    values["arch_options"] = options
    for option, source in option_sources.items():
        sources[f"arch_options.{option}"] = source
    if options:
        sources["arch_options"] = Provenance(Kind.PER_OPTION, "arch_options.KEY")
    # a preset's batch size never exceeds the training split (ItalyPowerDemand has 54
    # series after the validation split, GunPoint 40); a user's value is checked as given
    if sources["batch_size"].kind not in CHOSEN:
        size = _batch_fit(values)
        if size is not None and values["batch_size"] > size:
            values["batch_size"] = size
            sources["batch_size"] = sources["batch_size"].noted(
                f"capped at the {size} training sequences")
    return TrainConfig(**values), sources


def show(config: TrainConfig, sources: dict[str, Provenance]) -> str:
    """The resolved configuration, one option per line with its source."""
    lines = []
    for f in fields(TrainConfig):
        value = getattr(config, f.name)
        if f.name == "arch_options":
            for option, v in value.items():
                lines.append((f"arch_options.{option}", v,
                              sources.get(f"arch_options.{option}", DEFAULT)))
            continue
        lines.append((f.name, value, sources.get(f.name, DEFAULT)))
    width = max(len(name) for name, _, _ in lines)
    return "\n".join(f"{name:<{width}}  {value!r:<12}  {source}"
                     for name, value, source in lines)


def preset_tasks() -> tuple[str, ...]:
    return tuple(t for t in TASK_NAMES if t in PRESETS)
