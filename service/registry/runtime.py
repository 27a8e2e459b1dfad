"""onnxruntime side of the service: sessions of a model package and running its graphs
on padded batches (their execution providers: ``service.registry.devices``). Torch-free; sessions
come from ``export.package.session_from_bytes`` so the service and the export verify the
same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from orthornn.export.package import INITIAL_STATE, Manifest, PackageError, session_from_bytes
from orthornn.export.vocabulary import UNK, words

#: an input is far outside the training range when it lies beyond min - m (max - min) or
#: max + m (max - min) of its feature (m (|max| or 1) for a feature constant in training)
RANGE_MARGIN = 0.5


@dataclass(slots=True)
class Chunk:
    """A sequence (or the next chunk of one) and the state it continues from (None: the
    start of the sequence). Batches mix chunks with and without states."""

    data: np.ndarray
    state: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.data)


# Training's word tokenizer (export.vocabulary). Unlike training, no "<eos>" is appended:
# a request's text is a prefix, not a finished paragraph.
tokenize = words


@dataclass
class ModelSpec:
    """What the HTTP layer needs to validate requests and shape answers (from the manifest)."""

    name: str
    version: int
    task: str  # classify | regress | seq2seq | lm
    arch: str
    kind: str  # float | tokens
    feature_size: int
    max_length: int
    output_name: str  # logits | value
    output_size: int
    state_size: int
    labels: list[str] | None
    streaming: bool = False  # the graphs take an initial state (packages since streaming)
    vocabulary: list[str] | None = None
    token_ids: dict[str, int] = field(default_factory=dict)
    io: dict = field(default_factory=dict)
    #: float inputs: per feature, the bounds beyond which an input is "far outside" the
    #: training range (RANGE_MARGIN of the range beyond its ends); None: not checked
    input_low: np.ndarray | None = None
    input_high: np.ndarray | None = None
    input_low_max: float = 0.0
    input_high_min: float = 0.0
    training_min: list | None = None
    training_max: list | None = None

    @classmethod
    def from_manifest(cls, manifest: Manifest, package: Path, max_token_length: int) -> ModelSpec:
        inputs, outputs = manifest.input_spec, manifest.output_spec
        spec = cls(
            name=manifest.name, version=manifest.version, task=manifest.task,
            arch=manifest.arch, kind=inputs.kind, feature_size=inputs.feature_size,
            max_length=inputs.max_length, output_name=manifest.output_name,
            output_size=outputs.size, state_size=outputs.state_size,
            labels=manifest.labels, io=manifest.io,
            streaming=any(i["name"] == INITIAL_STATE for i in manifest.io["model"]["inputs"]))
        if spec.kind == "tokens":
            words = (package / manifest.vocabulary_file).read_text().split("\n")
            if words and words[-1] == "":
                words.pop()
            spec.vocabulary = words
            spec.token_ids = {w: i for i, w in enumerate(words)}
            # the BPTT window is not a limit: the state carries across it
            spec.max_length = max(spec.max_length, max_token_length)
        if spec.max_length <= 0:
            spec.max_length = max_token_length
        stats = (manifest.preprocessing or {}).get("training_range")
        if spec.kind == "float" and stats:
            low, high = np.array(stats["min"]), np.array(stats["max"])
            margin = RANGE_MARGIN * np.where(high > low, high - low, np.maximum(np.abs(high), 1))
            spec.input_low = (low - margin).astype(np.float32)
            spec.input_high = (high + margin).astype(np.float32)
            spec.input_low_max = float(spec.input_low.max())
            spec.input_high_min = float(spec.input_high.min())
            spec.training_min, spec.training_max = stats["min"], stats["max"]
        return spec

    @property
    def unk_id(self) -> int | None:
        """The id of <unk> in a language model's vocabulary (None: it has none)."""
        return self.token_ids.get(UNK)

    def encode(self, text: str) -> list[int]:
        unk = self.token_ids.get(UNK, 0)
        return [self.token_ids.get(w, unk) for w in tokenize(text)]


class Runtime:
    """The onnxruntime sessions of one package version; thread-safe (onnxruntime's run is)."""

    def __init__(self, package: Path, manifest: Manifest, providers: list[str], threads: int):
        self.providers = providers
        self.sessions = {}
        for graph, filename in manifest.graphs.items():
            try:
                self.sessions[graph] = session_from_bytes(str(package / filename), providers,
                                                          threads)
            except Exception as error:  # onnxruntime refuses the file
                raise PackageError(f"onnxruntime cannot load {filename!r}: {error}") from None
        if "model" not in self.sessions:
            raise PackageError("the package has no 'model' graph")
        self.output_names = {g: [o.name for o in s.get_outputs()]
                             for g, s in self.sessions.items()}
        # outputs with a time axis ([B, T, ...]) are cut per sequence
        self.per_step = {g: {o.name for o in s.get_outputs() if len(o.shape) == 3}
                         for g, s in self.sessions.items()}

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.output_names[graph]
        return dict(zip(names, self.sessions[graph].run(names, feeds), strict=True))

    def run_padded(self, spec: ModelSpec, sequences: list, graph: str = "model") -> list[dict]:
        """Run a full graph ("model", or "steps": an output per step) on sequences of any
        lengths padded into one batch; each an array, or a Chunk that continues from a
        state. Per sequence, its rows of every output (time-axis outputs cut to its
        length)."""
        states = [s.state if isinstance(s, Chunk) else None for s in sequences]
        sequences = [s.data if isinstance(s, Chunk) else s for s in sequences]
        lengths = np.array([len(s) for s in sequences], dtype=np.int64)
        steps = int(lengths.max())
        if spec.kind == "tokens":
            x = np.zeros((len(sequences), steps), dtype=np.int64)
        else:
            x = np.zeros((len(sequences), steps, spec.feature_size), dtype=np.float32)
        for i, s in enumerate(sequences):
            x[i, :len(s)] = s
        feeds = {"tokens" if spec.kind == "tokens" else "x": x, "lengths": lengths}
        if any(s is not None for s in states):
            h0 = feeds[INITIAL_STATE] = np.zeros((len(states), spec.state_size), np.float32)
            for i, s in enumerate(states):
                if s is not None:
                    h0[i] = s
        out = self.run(graph, feeds)
        per_step = self.per_step[graph]
        return [{k: (v[i, :n] if k in per_step else v[i]) for k, v in out.items()}
                for i, n in enumerate(lengths.tolist())]

    def warm_up(self, spec: ModelSpec, batch: int) -> None:
        steps = min(spec.max_length, 16)
        if spec.kind == "tokens":
            seqs = [np.zeros(steps, np.int64)] * batch
        else:
            seqs = [np.zeros((steps, spec.feature_size), np.float32)] * batch
        self.run_padded(spec, seqs)
        if "step" in self.sessions:
            self.run("step", {"tokens": np.zeros((1, 1), np.int64),
                              "state": np.zeros((1, spec.state_size), np.float32)})
