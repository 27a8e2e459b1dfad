"""What the service knows of a model version from its manifest (``ModelSpec``): the task,
the inputs it takes and the answers it gives, for the request checks and the answers.
Torch-free, like the rest of the service."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from orthornn.export.artifacts.package import INITIAL_STATE, GraphIO, Manifest
from orthornn.export.artifacts.vocabulary import UNK, words

#: an input is far outside the training range when it lies beyond min - m (max - min) or
#: max + m (max - min) of its feature (m (|max| or 1) for a feature constant in training)
RANGE_MARGIN = 0.5
#: the most bytes one input number takes in a request body as clients write it: a
#: float64's 17 significant digits with sign, point, exponent, comma and a space
#: ("-1.2345678901234567e-308, " is 26)
NUMBER_BYTES = 32

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
    io: dict[str, GraphIO] = field(default_factory=dict)
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
            streaming=any(i.name == INITIAL_STATE for i in manifest.io["model"].inputs))
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

    def largest_body(self, max_sequences: int) -> int:
        """An upper bound of the JSON body of the largest request this model takes:
        MAX_SEQUENCES sequences of max_length steps, a step's values at NUMBER_BYTES each
        (text: the longest word and a space, every character written as a 6-byte \\u
        escape), and each sequence's state (the body limit's default: Settings.body_limit)."""
        step = NUMBER_BYTES * self.feature_size
        if self.kind == "tokens":
            longest = max((len(w) for w in self.vocabulary or ()), default=1)
            step = max(NUMBER_BYTES, 6 * (longest + 1))
        return max_sequences * (self.max_length * step + NUMBER_BYTES * self.state_size)

    @property
    def unk_id(self) -> int | None:
        """The id of <unk> in a language model's vocabulary (None: it has none)."""
        return self.token_ids.get(UNK)

    def encode(self, text: str) -> list[int]:
        unk = self.token_ids.get(UNK, 0)
        return [self.token_ids.get(w, unk) for w in tokenize(text)]
