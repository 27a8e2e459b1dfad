"""The typed seam between the HTTP layer and the dataplane: what a codec decodes a request
body into, and what the dataplane answers, whatever the protocol (as MLServer's
``InferenceRequest`` / ``InferenceResponse`` serve REST and gRPC alike).

The wire schemas (pydantic, for validation and the OpenAPI document) are in
``service.dataplane.schemas``; the codecs (``service.http.codecs``) turn bodies into these
values and these values into bodies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .schemas import PredictRequest, RequestOutput


@dataclass(frozen=True)
class Served:
    """What the HTTP layer needs besides the answer: the model version that answered (the
    metric labels) and the input-range warning, if any (a response header)."""

    model: str
    version: int
    warning: str | None = None


# -- the Open Inference Protocol ---------------------------------------------------------

@dataclass(frozen=True)
class InputTensor:
    """One input of an inference request, decoded from JSON or binary data."""

    name: str
    datatype: str  # as the request declares it
    shape: tuple[int, ...]
    data: np.ndarray | None  # flat; None when the datatype is not one the service knows


@dataclass(frozen=True)
class Sequence:
    """An inference request's session: the parameters ``sequence_id``, ``sequence_start``,
    ``sequence_end`` (as tritonclient sends them) and ``sequence_position``."""

    id: str
    start: bool = False
    end: bool = False
    position: int | None = None


@dataclass(frozen=True)
class Inference:
    """An inference request: the URL's model (and version), the body's inputs."""

    inputs: list[InputTensor]
    outputs: list[RequestOutput] | None = None  # None: every output of the model
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    sequence: Sequence | None = None  # None: stateless
    session_secret: str | None = None  # the parameter (the header comes beside it)

    def binary_outputs(self) -> set[str]:
        """The outputs the request wants as binary data ("*": all): ``binary_data`` per
        output, else the request's ``binary_data_output``."""
        binary_all = bool(self.parameters.get("binary_data_output"))
        if not self.outputs:  # every output
            return {"*"} if binary_all else set()
        return {o.name for o in self.outputs
                if (o.parameters or {}).get("binary_data", binary_all)}


@dataclass(frozen=True)
class OutputTensor:
    name: str
    datatype: str
    data: np.ndarray  # [B, ...]


@dataclass(frozen=True)
class InferenceResult:
    served: Served
    outputs: list[OutputTensor]
    id: str | None = None
    position: int | None = None  # a sequence's position after this chunk (time steps)
    session_secret: str | None = None  # in the answer to a sequence's start


# -- /predict ----------------------------------------------------------------------------

@dataclass(slots=True)
class Prediction:
    """A /predict request as the dataplane takes it: ``PredictRequest``'s fields, with
    ``inputs`` either as the JSON gave them (lists, validated by pydantic) or as float32
    arrays [T, d] (the codec's fast path, which skips pydantic for the common body)."""

    model: str
    version: int | str | None = None
    inputs: list[np.ndarray] | list[list[Any]] | None = None
    text: list[str] | None = None
    top_k: int | None = None
    return_state: bool = False
    states: list[Any] | None = None
    session: str | None = None
    start: bool = False
    end: bool = False
    position: int | None = None
    session_secret: str | None = None
    per_step: bool = False
    allow_unk: bool = False

    @classmethod
    def of(cls, req: PredictRequest) -> Prediction:
        """The validated body's fields (the same names, by construction)."""
        return cls(**dict(req))


@dataclass(frozen=True)
class PredictResult:
    served: Served
    outputs: list[dict]  # one per sequence, as protocol.SequenceOutput
    session: str | None = None
    position: int | None = None  # the session's position after this chunk (time steps)
    session_secret: str | None = None  # in the answer to a session's start


@dataclass(frozen=True)
class Document:
    """Any other answer of a model version: a JSON document (metadata, /generate)."""

    served: Served
    body: Any
