"""onnxruntime side of the service: the inference sessions of a model package (one
onnxruntime ``InferenceSession`` per graph) and running its graphs on padded batches (their
execution providers: ``service.registry.devices``). Torch-free; the inference sessions come
from ``export.package.session`` so the service and the export verify the same way (a
graph's own bytes, no external data)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from orthornn.export.artifacts.package import (
    INITIAL_STATE,
    Manifest,
    PackageError,
    session,
)

from .spec import ModelSpec


@dataclass(slots=True)
class Chunk:
    """A sequence (or the next chunk of one) and the state it continues from (None: the
    start of the sequence). Batches mix chunks with and without states."""

    data: np.ndarray
    state: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.data)


class Runtime:
    """The onnxruntime inference sessions of one package version, by graph ("model",
    "steps", "step"); thread-safe (onnxruntime's run is)."""

    def __init__(self, package: Path, manifest: Manifest, providers: list[str], threads: int):
        self.providers = providers
        self.inference_sessions = {}
        for graph, filename in manifest.graphs.items():
            try:
                self.inference_sessions[graph] = session(package / filename, providers,
                                                         threads)
            except PackageError:
                raise
            except Exception as error:  # onnxruntime refuses the file
                raise PackageError(f"onnxruntime cannot load {filename!r}: {error}") from None
        if "model" not in self.inference_sessions:
            raise PackageError("the package has no 'model' graph")
        self.output_names = {g: [o.name for o in s.get_outputs()]
                             for g, s in self.inference_sessions.items()}
        # outputs with a time axis ([B, T, ...]) are cut per sequence
        self.per_step = {g: {o.name for o in s.get_outputs() if len(o.shape) == 3}
                         for g, s in self.inference_sessions.items()}

    def run(self, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.output_names[graph]
        return dict(zip(names, self.inference_sessions[graph].run(names, feeds), strict=True))

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
        if "step" in self.inference_sessions:
            self.run("step", {"tokens": np.zeros((1, 1), np.int64),
                              "state": np.zeros((1, spec.state_size), np.float32)})
