"""Request and answer schemas: the simple ``/predict`` and ``/generate`` API and the Open
Inference Protocol (REST, v2). They document the API (OpenAPI at /docs) and validate
request bodies; semantic limits that depend on the model (sequence length, feature size,
token ids) are checked in ``service.dataplane.checks``. ``parse`` validates a body against one of
them, with a message that names the field."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    Strict,
    ValidationError,
)
from pydantic_core import PydanticCustomError

from ..errors import ClientError
from ..loop.labels import MAX_LABELS

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: bytes, allow_empty: bool = False) -> M:
    """BODY validated against MODEL (an empty body is MODEL's defaults when allowed);
    ClientError naming the field otherwise."""
    if allow_empty and not body.strip():
        return model()
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise ClientError(_describe(e)) from None


def _describe(e: ValidationError) -> str:
    errors = e.errors(include_url=False)
    first = max(errors, key=lambda err: len(err["loc"]))  # the most specific union branch
    if any(err["type"] == "json_invalid" for err in errors):
        return f"body is not valid JSON: {first['msg']}"
    where = ""
    for part in first["loc"]:
        if isinstance(part, int):
            where += f"[{part}]"
        elif "[" in part or part in ("float", "int", "str", "bool", "list", "constrained-str"):
            continue  # a union member's tag, not a field
        else:
            where += f".{part}" if where else part
    return f"{where or 'body'}: {first['msg']}"


Number = Annotated[float, Strict()]  # JSON numbers only: no strings, no booleans
Step = Number | list[Number]
Version = Annotated[int, Strict(), Field(ge=1, le=2**62)] | Annotated[
    str, Field(pattern=r"^[1-9][0-9]{0,17}$")]


#: the most keys of a request's ``parameters`` object (the request's, an input's or an
#: output's): with OIP's own rule for their values (a string, a number or a boolean) and
#: the bounds below, a request's free-form objects are small before they are decoded
#: (1,000,000 keys held the event loop for 1.5 s)
MAX_PARAMETERS = 64
MAX_PARAMETER_CHARS = 4096  # a string value's length (a key's: 128)


def _parameter_value(value: Any) -> Any:
    if isinstance(value, bool | int | float) or (isinstance(value, str)
                                                  and len(value) <= MAX_PARAMETER_CHARS):
        return value
    raise PydanticCustomError("parameter", f"a string (at most {MAX_PARAMETER_CHARS} "
                                           "characters), a number or a boolean")


ParameterValue = Annotated[Any, AfterValidator(_parameter_value)]
Parameters = Annotated[dict[Annotated[str, Field(max_length=128)], ParameterValue],
                       Field(max_length=MAX_PARAMETERS)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PredictRequest(_Model):
    model: str = Field(min_length=1, max_length=128, description="model name")
    version: Version | None = Field(None, description="a loaded version (default: the "
                                                      "promoted one, else the newest)")
    inputs: list[list[Step]] | None = Field(
        None, description="sequences: each a list of time steps, each a list of feature_size "
                          "numbers (or one number when feature_size is 1); language models: "
                          "lists of token ids")
    text: list[Annotated[str, Field(max_length=1_000_000)]] | None = Field(
        None, description="language models: texts, tokenised with the model's vocabulary")
    top_k: Annotated[int, Strict()] | None = Field(
        None, ge=1, le=1_000_000, description="classify: also list the k likeliest labels; "
                                              "lm: next tokens listed (default 5)")
    return_state: bool = Field(
        False, description="streaming: give each output the opaque 'state' after its sequence "
                           "(pass it back in 'states' to continue from there)")
    states: list[Any] | None = Field(
        None, description="streaming: one state per sequence, exactly as a response returned "
                          "it; each sequence continues from its state (the version that made "
                          "the states answers)")
    session: Annotated[str, Field(min_length=1, max_length=128,
                                  pattern=r"^[A-Za-z0-9._:-]+$")] | None = Field(
        None, description="streaming: a server-side session id; the service keeps its state "
                          "(one sequence per request)")
    start: bool = Field(False, description="with session: open it (on the requested or the "
                                           "default version, which it keeps until it ends)")
    end: bool = Field(False, description="with session: close it after this chunk")
    session_secret: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="with session: the secret the answer to its start gave (or the "
                          "Orthornn-Session-Secret header); with start, optionally one the "
                          "client chose (22 to 128 base64 or hex characters, at least 128 "
                          "random bits), so that a retried start is recognised. A chunk "
                          "without the session's secret gets 404")
    position: Annotated[int, Strict()] | None = Field(
        None, ge=0, le=2**62,
        description="with session: the time steps the client believes the session has "
                    "consumed (0 for the first chunk; the answer's Orthornn-Session-Position "
                    "header gives the next). Makes the chunk exactly-once: at the session's "
                    "position it is applied; at the position before the last applied chunk "
                    "it is a retry of that chunk, answered again without advancing; at any "
                    "other, 409 naming the session's position. Without it, chunks apply in "
                    "arrival order")
    per_step: bool = Field(False, description="classify / regress: an output after every "
                                              "time step, in 'steps'")
    allow_unk: bool = Field(
        False, description="lm: let <unk> (the stand-in for every out-of-vocabulary word) be "
                           "among next_tokens; by default it is left out (probabilities stay "
                           "the model's, not renormalised)")


class Candidate(BaseModel):
    label: str | None = None
    token: str | None = None
    index: int | None = None
    id: int | None = None
    probability: float


class SequenceOutput(BaseModel):
    label: str | None = None
    index: int | None = None
    probabilities: list[float] | None = None
    top_k: list[Candidate] | None = None
    value: float | list[float] | None = None
    labels: list[str] | None = Field(None, description="seq2seq: one label per time step")
    indices: list[int] | None = None
    next_tokens: list[Candidate] | None = None
    log_likelihood: float | None = None
    perplexity: float | None = None
    tokens: int | None = Field(None, description="lm: number of tokens scored")
    steps: list[dict] | None = Field(None, description="per_step: the output after each step")
    state: dict | None = Field(None, description="return_state: the opaque state after this "
                                                 "sequence")


class PredictResponse(BaseModel):
    model: str
    version: int
    outputs: list[SequenceOutput]
    session: str | None = None
    session_secret: str | None = Field(
        None, description="in the answer to a session's start: the secret every later chunk "
                          "of the session presents (also the Orthornn-Session-Secret header)")
    position: int | None = Field(None, description="with session: the time steps the "
                                                   "session has consumed after this chunk "
                                                   "(the next chunk's position)")


class GenerateRequest(_Model):
    model: str = Field(min_length=1, max_length=128)
    version: Version | None = None
    prompt: Annotated[str, Field(max_length=1_000_000)] | list[
        Annotated[int, Strict()]] = Field(
        "", description="text (tokenised with the model's vocabulary) or token ids; empty: "
                        "start after an <eos>")
    max_new_tokens: Annotated[int, Strict()] = Field(16, ge=1, le=1_000_000)
    temperature: Number = Field(1.0, ge=0, le=100, description="0: greedy")
    top_k: Annotated[int, Strict()] | None = Field(None, ge=1, le=1_000_000)
    seed: Annotated[int, Strict()] | None = Field(None, ge=0, le=2**63 - 1)
    stop_at_eos: bool = True
    allow_unk: bool = Field(False, description="let <unk> be generated (default: never)")


class GenerateResponse(BaseModel):
    model: str
    version: int
    prompt_ids: list[int]
    ids: list[int]
    tokens: list[str]
    text: str
    finish_reason: str


class ErrorResponse(BaseModel):
    error: str


# -- Open Inference Protocol (v2) ------------------------------------------------------

class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: dict[str, Any] = Field(default_factory=dict)


class RequestInput(_Model):
    name: str = Field(min_length=1, max_length=256)
    shape: list[Annotated[int, Strict(), Field(ge=0, le=2**40)]] = Field(max_length=16)
    datatype: str = Field(min_length=1, max_length=16)
    parameters: Parameters | None = None
    data: list[Any] | None = Field(None, description="row-major, flat or nested; absent when "
                                                     "the binary extension carries it")


class RequestOutput(_Model):
    name: str = Field(min_length=1, max_length=256)
    parameters: Parameters | None = None


class InferenceRequest(_Model):
    id: str | None = Field(None, max_length=1024)
    # what KServe's client (InferRequest.to_rest) adds: the URL names the model; when the
    # body names one too, the two must agree
    model_name: str | None = Field(None, max_length=256)
    model_version: str | None = Field(None, max_length=64)
    parameters: Parameters | None = None
    inputs: list[RequestInput] = Field(min_length=1, max_length=64)
    outputs: list[RequestOutput] | None = Field(None, max_length=64)


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="session_secret: in the answer to a sequence's start, the secret "
                          "its later requests present")
    outputs: list[ResponseOutput]


class RepositoryIndexRequest(_Model):
    ready: bool | None = None


class RepositoryModel(BaseModel):
    name: str
    version: str
    state: str
    reason: str


class RollbackRequest(_Model):
    version: Version | None = Field(
        None, description="the version to promote (default: the version promoted before "
                          "the current one, else the newest below it); it must be in the "
                          "repository and verify")


class RolloutStartRequest(_Model):
    """``orthornn rollout start``'s flags (export.artifacts.rollout.start checks them)."""

    candidate: int = Field(description="the version to roll out: in the repository, passed "
                                       "the gate, verifies")
    shadow: float = Field(0.1, description="share of requests the candidate shadows (0: no "
                                           "shadow stage)")
    steps: list[int] = Field([5, 25, 50, 100], description="canary percentages, ending at 100")
    interval_s: float = Field(60.0, description="seconds per stage, at least")
    min_requests: int = Field(100, description="requests per stage, at least")
    min_agreement: float = Field(0.9, description="the candidate's top-1 agreement, at least")
    max_error_rate: float = Field(0.01, description="its error rate above the promoted "
                                                    "version's, at most")
    max_latency_ratio: float = Field(2.0, description="its p99 compute time over the promoted "
                                                      "version's, at most")


class RollbackResponse(BaseModel):
    model: str
    promoted: int = Field(description="the version now promoted (and serving)")
    previous: int = Field(description="the version promoted before")


# -- the labels route (for the OpenAPI document: the route parses the body itself, in one
#    pass, with messages that name the item: service.loop.labels) -----------------------

class Label(BaseModel):
    id: str = Field(description="a captured request's id (its X-Request-Id)",
                    min_length=1, max_length=128)
    label: int | str | list[int | str | list[int | str]] = Field(
        description="classify: a class index or name (a list, one per sequence, for a "
                    "request of several sequences); lm: the next tokens (token ids, words, "
                    "or text)")


class LabelsRequest(RootModel[list[Label]]):
    root: list[Label] = Field(max_length=MAX_LABELS)


class LabelsResponse(BaseModel):
    model: str
    accepted: int = Field(description="labels written (all of the request's)")
