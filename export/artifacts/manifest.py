"""manifest.json's one schema, torch-free: ``Manifest`` with its typed graph entries
(``GraphIO``, ``TensorSpec``), the input specification and the preprocessing field; the
exporter writes it, the service reads it (``package.read_manifest``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .numbers import is_number

FORMAT = "orthornn-package/1"
TASKS = ("classify", "regress", "seq2seq", "lm")
INPUT_KINDS = ("float", "tokens")


class PackageError(ValueError):
    """A package that must not be served; the message says what is wrong."""


@dataclass(frozen=True)
class Datatype:
    """A tensor datatype of packages and of the Open Inference Protocol."""

    name: str  # the protocol's name
    numpy: np.dtype  # the array type (little-endian on the wire)
    onnx: int  # onnx.TensorProto's element type
    json_buffer: str  # pysimdjson's as_buffer type for its JSON numbers: "d" or "i"


#: the one table of datatypes (graph I/O specs, the OIP codecs, binary tensors)
DATATYPES = {d.name: d for d in (Datatype("FP32", np.dtype("<f4"), 1, "d"),
                                 Datatype("INT64", np.dtype("<i8"), 7, "i"))}
ONNX_DATATYPES = {d.onnx: d for d in DATATYPES.values()}


# the optional state input of the full graphs and the prediction it gives (language
# models): names the exporter writes and the service feeds and reads
INITIAL_STATE, INITIAL_LOGITS = "initial_state", "initial_logits"


def output_name(task: str) -> str:
    """The name of a graph's prediction output: "value" for regress, else "logits"."""
    return "value" if task == "regress" else "logits"


def _check(name: str, value: Any, kind: type | tuple[type, ...],
           allowed: Collection[str] | None = None) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise PackageError(f"manifest field {name!r} must be {getattr(kind, '__name__', kind)}; "
                           f"got {value!r}")
    if allowed is not None and value not in allowed:
        raise PackageError(f"manifest field {name!r} must be one of {', '.join(allowed)}; "
                           f"got {value!r}")
    return value


@dataclass(frozen=True)
class InputSpec:
    """What a graph reads: ``float`` features [B, T, feature_size], or ``tokens`` ids
    [B, T] below feature_size (the vocabulary size). max_length: the longest sequence
    trained on (0: any; for language models the BPTT window, not a limit)."""

    kind: str
    feature_size: int
    max_length: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> InputSpec:
        _check("input_spec", d, dict)
        return cls(kind=_check("input_spec.kind", d.get("kind"), str, INPUT_KINDS),
                   feature_size=_check("input_spec.feature_size", d.get("feature_size"), int),
                   max_length=_check("input_spec.max_length", d.get("max_length") or 0, int))


@dataclass(frozen=True)
class OutputSpec:
    """The prediction output: its name (``output_name``), its last dimension and the size of
    the recurrent state [B, state_size] every graph also returns."""

    kind: str
    size: int
    state_size: int

    @classmethod
    def for_task(cls, task: str, size: int, state_size: int) -> OutputSpec:
        return cls(output_name(task), size, state_size)

    @classmethod
    def from_dict(cls, d: dict) -> OutputSpec:
        _check("output_spec", d, dict)
        return cls(kind=_check("output_spec.kind", d.get("kind"), str, ("logits", "value")),
                   size=_check("output_spec.size", d.get("size"), int),
                   state_size=_check("output_spec.state_size", d.get("state_size"), int))


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a graph, as manifest.json's ``io`` lists it (and the Open
    Inference Protocol's model metadata shows it)."""

    name: str
    datatype: str  # a key of DATATYPES
    shape: list[int]  # -1: any size (the batch, the time steps)
    optional: bool = False  # an input with a default value (the initial state)

    def to_dict(self) -> dict[str, Any]:
        """As manifest.json writes it: ``optional`` only where it is true."""
        d: dict[str, Any] = {"name": self.name, "datatype": self.datatype,
                             "shape": list(self.shape)}
        if self.optional:
            d["optional"] = True
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str) -> TensorSpec:
        _check(where, d, dict)
        shape = _check(f"{where}.shape", d.get("shape"), list)
        for i, size in enumerate(shape):
            _check(f"{where}.shape[{i}]", size, int)
        return cls(name=_check(f"{where}.name", d.get("name"), str),
                   datatype=_check(f"{where}.datatype", d.get("datatype"), str),
                   shape=shape,
                   optional=_check(f"{where}.optional", d.get("optional", False), bool))


@dataclass(frozen=True)
class GraphIO:
    """The inputs and outputs of one graph of a package."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]

    def to_dict(self) -> dict[str, list[dict[str, Any]]]:
        return {"inputs": [t.to_dict() for t in self.inputs],
                "outputs": [t.to_dict() for t in self.outputs]}

    @classmethod
    def from_dict(cls, d: Any, where: str) -> GraphIO:
        _check(where, d, dict)
        return cls(*([TensorSpec.from_dict(t, f"{where}.{side}[{i}]")
                       for i, t in enumerate(_check(f"{where}.{side}", d.get(side), list))]
                      for side in ("inputs", "outputs")))


@dataclass(frozen=True)
class Manifest:
    """manifest.json of a model package."""

    name: str
    version: int
    arch: str
    task: str
    mode: str  # dense | factored
    opset: int
    recurrence: str  # rnn | scan | lstm
    graphs: dict[str, str]  # graph key ("model", "steps", "step") -> file name
    io: dict[str, GraphIO]  # graph key -> its inputs and outputs
    input_spec: InputSpec
    output_spec: OutputSpec
    files: dict  # file name -> sha256
    hidden_size: int
    task_name: str | None = None
    labels: list | None = None
    vocabulary_file: str | None = None
    spectral: dict = field(default_factory=dict)
    #: float inputs: how raw values became the model's inputs and the range it was trained
    #: on (``check_preprocessing``); None for token inputs and packages before this field
    preprocessing: dict | None = None
    training: dict | None = None
    #: the exported graph's score on the task's test split (``evaluation.evaluate``):
    #: metric, value, higher_is_better, split, examples, data_fingerprint; or, when the
    #: data cannot be rebuilt, {"absent": REASON}. None for packages before this field.
    #: A run on several --data files is scored on the first file's test split; with
    #: ``export --gate-data`` also "splits": {"test": ..., "gate_data": ...} (value,
    #: examples, data_fingerprint; the slice's file), and a passed gate's "gate" record
    #: holds both versions' values on the slice ("gate_data")
    evaluation: dict | None = None
    #: where the version comes from: config_sha256, train_data_fingerprint,
    #: orthornn_version, source_revision, parent (the promoted version when it was
    #: published), created; and "captures": {"segments": [capture segment paths], "labels":
    #: labelled records} when it learned from ``orthornn capture dataset`` files (absent
    #: otherwise and in older manifests)
    lineage: dict | None = None
    #: the drift reference file (``export.artifacts.loop.drift``: summaries of the validation
    #: split and the tests' calibrated thresholds); None for packages before it, or when
    #: the validation data could not be rebuilt: the service then measures no drift
    reference: str | None = None
    source: dict = field(default_factory=dict)
    created: str = ""
    orthornn_version: str = ""
    format: str = FORMAT

    @property
    def output_name(self) -> str:
        return output_name(self.task)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["io"] = {key: graph.to_dict() for key, graph in self.io.items()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PackageError(f"not an orthornn package manifest ({FORMAT})")
        known = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   and f.name not in d]
        if missing:
            raise PackageError(f"manifest field missing: {', '.join(missing)}")
        values = {k: v for k, v in d.items() if k in known}  # newer fields are ignored
        values["input_spec"] = InputSpec.from_dict(d["input_spec"])
        values["output_spec"] = OutputSpec.from_dict(d["output_spec"])
        values["io"] = {key: GraphIO.from_dict(graph, f"io.{key}")
                        for key, graph in _check("io", d["io"], dict).items()}
        manifest = cls(**values)
        for name, kind in (("name", str), ("version", int), ("arch", str), ("mode", str),
                           ("opset", int), ("recurrence", str), ("graphs", dict),
                           ("files", dict), ("hidden_size", int)):
            _check(name, getattr(manifest, name), kind)
        for key, filename in manifest.graphs.items():
            _check(f"graphs.{key}", filename, str)
        _check("task", manifest.task, str, TASKS)
        if manifest.output_spec.kind != manifest.output_name:
            raise PackageError(f"manifest field 'output_spec.kind' must be "
                               f"{manifest.output_name!r} for task {manifest.task!r}")
        if manifest.input_spec.kind == "tokens" and not manifest.vocabulary_file:
            raise PackageError("manifest field 'vocabulary_file' is required for token inputs")
        for key, filename in manifest.graphs.items():
            plain_file_name(f"graphs.{key}", filename)
        if manifest.vocabulary_file is not None:
            plain_file_name("vocabulary_file", manifest.vocabulary_file)
        if manifest.reference is not None:
            plain_file_name("reference", manifest.reference)
        if manifest.preprocessing is not None:
            check_preprocessing(manifest.preprocessing, manifest.input_spec.feature_size)
        return manifest


def _numbers(name: str, value: Any, sizes: tuple[int, ...]) -> list[float]:
    if not isinstance(value, list) or len(value) not in sizes or \
            not all(is_number(v) for v in value):
        raise PackageError(f"manifest field {name!r} must be a list of "
                           f"{' or '.join(map(str, sizes))} finite numbers; got {value!r}")
    return value


def check_preprocessing(d: Any, feature_size: int) -> dict:
    """The ``preprocessing`` field of float-input packages::

        {"transform": {"kind": "affine", "offset": [..], "scale": [..], "description": ".."}
                      or null,         # model input = (raw - offset) / scale, per feature
         "training_range": {"source": "..", "count": N, "mean": [d], "std": [d],
                            "min": [d], "max": [d]}}   # of the model inputs seen in training

    offset and scale have 1 (every feature) or feature_size numbers."""
    _check("preprocessing", d, dict)
    transform = d.get("transform")
    if transform is not None:
        _check("preprocessing.transform", transform, dict)
        _check("preprocessing.transform.kind", transform.get("kind"), str, ("affine",))
        for key in ("offset", "scale"):
            _numbers(f"preprocessing.transform.{key}", transform.get(key), (1, feature_size))
        if any(v == 0 for v in transform["scale"]):
            raise PackageError("manifest field 'preprocessing.transform.scale' must not hold 0")
    stats = d.get("training_range")
    if stats is not None:
        _check("preprocessing.training_range", stats, dict)
        for key in ("mean", "std", "min", "max"):
            _numbers(f"preprocessing.training_range.{key}", stats.get(key), (feature_size,))
        if any(lo > hi for lo, hi in zip(stats["min"], stats["max"], strict=True)):
            raise PackageError("manifest field 'preprocessing.training_range': min above max")
    return d


def plain_file_name(field_name: str, name: Any) -> str:
    """NAME, a file name of the package folder itself: a string with no folder part (no
    ``/``, ``\\``, ``..``, absolute path or drive), else PackageError naming FIELD_NAME."""
    _check(field_name, name, str)
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or ":" in name or Path(name).name != name):
        raise PackageError(f"manifest field {field_name!r} must be a plain file name inside "
                           f"the package folder (no folder, '..' or absolute path); got "
                           f"{name[:200]!r}")
    return name
