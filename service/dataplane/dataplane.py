"""The model work behind the HTTP routes: typed requests in, typed results out
(``service.dataplane.messages``), as MLServer's ``DataPlane`` serves REST and gRPC alike:
check the inputs against the version's spec, ``ModelVersion.infer``, then shape the answer.
The request's scope (``service.request``) says which version answered, for its metrics and
a running rollout's analysis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from orthornn.export.artifacts.package import INITIAL_STATE

from .. import request
from ..errors import (
    SECRET_HEADER,
    ClientError,
    Conflict,
    NotFound,
    ServiceError,
    StateConflict,
)
from ..loop.capture import Capture
from ..loop.drift import Drift
from ..loop.labels import LabelStore
from ..loop.records import keep_answer
from ..metrics import UNKNOWN, Metrics
from ..registry.registry import ModelVersion, Registry
from ..registry.runtime import Chunk
from ..registry.spec import ModelSpec
from ..sessions.manager import Sessions
from ..sessions.store import open_store
from ..sessions.tokens import decode_state, encode_state, state_version
from ..settings import Settings
from . import generate
from .checks import (
    check_streaming,
    infer_sequences,
    output_value_bytes,
    per_step_bytes,
    predict_sequences,
    range_warning,
    session_sequence,
    state_of,
    version_param,
)
from .in_flight import OutputsInFlight
from .messages import (
    Document,
    Inference,
    InferenceResult,
    OutputTensor,
    Prediction,
    PredictResult,
    Served,
)
from .metadata import Metadata
from .outputs import outputs_to_tensors, shape_outputs
from .repository import Repository
from .schemas import (
    GenerateRequest,
)
from .shadow import Shadows


def _secret(header: str | None, field: object, name: str) -> str | None:
    """A session's secret, from the request's header or its body (NAME: the field); 400
    when both are given and differ, or the field is not a string."""
    if field is not None and not isinstance(field, str):
        raise ClientError(f"{name}: must be a string")
    if header is not None and field is not None and header != field:
        raise ClientError(f"{name}: differs from the {SECRET_HEADER} header; give the "
                          f"secret once")
    return header if header is not None else field


class DataPlane:
    def __init__(self, settings: Settings, registry: Registry,
                 metrics: Metrics | None = None, capture: Capture | None = None):
        self.settings, self.registry, self.metrics = settings, registry, metrics
        # server-side sessions: in this process or in a Redis the replicas share
        self.sessions = Sessions(open_store(settings, metrics), registry, metrics=metrics,
                                 secrets=settings.session_secrets)
        self.rollouts = registry.rollouts
        self.shadows = Shadows(registry)
        self.metadata = Metadata(settings, registry)  # the routes' other two jobs
        self.repository = Repository(registry)
        # live drift against each version's reference (off: not even a method call)
        self.drift = Drift(metrics, settings.drift_window, settings.drift_interval_s) \
            if settings.drift else None
        # capture (create_app's: the batchers record with it too), and the labels of the
        # captures, written beside them as the replica capture claimed
        self.capture = capture
        self.outputs = OutputsInFlight(settings.max_output_bytes_in_flight)
        # (on a bucket: labels are objects there; the index reads its copy and the spool,
        # the folder capture writes)
        on_bucket = settings.capture_uri is not None
        self.label_store = None if settings.capture is None or capture is None else \
            LabelStore(settings.capture_uri or settings.capture, settings.repo,
                       capture.replica, metrics, spool=settings.capture if on_bucket else None)

    def _tag(self, route: str) -> request.Scope | None:
        """Capture's tag of this request (None: capture off, or no sample to decide)."""
        return None if self.capture is None else self.capture.tag(route)

    def observe(self, held: request.Scope, status: int) -> None:
        """An answered request, for a running rollout's analysis: counted only when the
        rollout placed it (``held.route_key``: the service chose its version), and only a
        5xx is the version's error (``rollouts.version_error``); a request that held no
        version, e.g. an unreadable body, is nobody's."""
        self.rollouts.count(held.model, held.version, status, held.route_key, held.compute_s,
                            held.candidate_refused)

    def labels(self, held: request.Scope) -> tuple[str, str]:
        """The metric labels of a request: the version it held, else the model it named
        when loaded (with the version only when that is loaded); UNKNOWN for a model that
        is not loaded (clients cannot grow the label set)."""
        if held.model is not None:
            return held.model, str(held.version)
        name, version = held.named, held.named_version
        if name is None or not self.registry.model_ready(name):
            return UNKNOWN, ""
        if version is not None and self.registry.model_ready(name, version):
            return name, str(version)
        return name, ""

    @contextmanager
    def hold(self, name: str, version: int | None, *, from_states: bool = False,
             batched: bool = True) -> Iterator[ModelVersion]:
        """Lease a model version for one request. ``from_states``: the
        version is the one the request's states name (a 404 says so). ``batched=False``:
        the request never submits to a batcher (the batchers do not wait for it)."""
        try:
            mv = self.registry.acquire(name, version, batched=batched)
        except NotFound:
            if from_states and self.registry.model_ready(name):
                loaded = self.registry.serving().get(name, [])
                raise NotFound(f"states: made by model {name!r} version {version}, which is "
                               f"not loaded (loaded: {loaded}); a state only continues the "
                               f"version that made it: start the sequence again without "
                               f"states") from None
            raise
        try:
            yield mv
        finally:
            self.registry.release(mv, batched=batched)

    # -- labels ------------------------------------------------------------------------------

    async def label(self, name: str, body: bytes) -> dict:
        """POST /v2/models/{name}/labels: the body's labels of captured requests, all or
        none (``service.loop.labels``); 409 when capture is off (nothing to label)."""
        if self.label_store is None:
            raise Conflict("labels: capture is off; labels are taken for captured requests "
                           "only (orthornn serve --capture DIR)")
        return await asyncio.to_thread(self.label_store.add_body, name, body)

    # -- /generate ---------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> Document:
        with self.hold(req.model, version_param(req.version), batched=False) as mv:
            prompt = generate.prompt_ids(mv.spec, req, self.settings.max_new_tokens,
                                         self.settings.max_lm_output_bytes)
            # a thread of its own (asyncio's default pool): a long generation must not hold
            # the inference threads, and the batcher must not wait for it (batched=False)
            result = await asyncio.to_thread(generate.generate, mv.runtime, mv.spec,
                                             prompt, req, self.settings.max_lm_output_bytes)
        return Document(Served(mv.name, mv.version),
                      {"model": mv.name, "version": mv.version, **result})

    # -- /predict --------------------------------------------------------------------------

    async def predict(self, req: Prediction, key: bytes = b"",
                      secret: str | None = None) -> PredictResult:
        """KEY: the request's routing key (a rollout's canary places it by its hash);
        SECRET: a session's secret from the request's header (or in the body)."""
        if req.session is not None:
            return await self._predict_session(req, secret)
        for flag, given in (("start", req.start), ("end", req.end),
                            ("position", req.position is not None),
                            ("session_secret", req.session_secret is not None)):
            if given:
                raise ClientError(f"{flag}: only with 'session'")
        version = version_param(req.version)
        from_states = False
        if req.states is not None:
            made_by = state_version(req.states, req.model)
            if version is None:
                version = made_by  # a state continues the version that made it
                from_states = made_by is not None
            elif made_by is not None and made_by != version:
                raise StateConflict(f"states: made by version {made_by}, the request asks "
                                    f"for version {version}; a state only continues the "
                                    f"version that made it")
        elif version is None:
            version = self.registry.route(req.model, key)
            request.current().route_key = key
        with self.hold(req.model, version, from_states=from_states) as mv:
            seqs = self._sequences(mv, req)
            warning = self._range_warning(mv, seqs, "inputs")
            if req.states is not None:
                if len(req.states) != len(seqs):
                    raise ClientError(f"states: one per sequence ({len(seqs)}); got "
                                      f"{len(req.states)}")
                check_streaming(mv)
                batch: list[np.ndarray | Chunk] = [
                    Chunk(s, decode_state(st, mv.name, mv.version, mv.spec.state_size,
                                          f"states[{i}]"))
                    for i, (s, st) in enumerate(zip(seqs, req.states, strict=True))]
            else:
                batch = list(seqs)
            outputs, _, raw = await self._run(mv, batch, req, self._tag("/predict"))
            if req.states is None and not req.per_step:
                self.shadows.after(mv, lambda spec: predict_sequences(
                    spec, req, self.settings.max_request_sequences), raw)
        return PredictResult(Served(mv.name, mv.version, warning), outputs)

    async def _predict_session(self, req: Prediction, secret: str | None) -> PredictResult:
        assert req.session is not None
        if req.states is not None:
            raise ClientError("states: not with 'session' (the session keeps its state)")

        async def chunk(mv: ModelVersion, state: np.ndarray | None
                        ) -> tuple[tuple[list[dict], str | None, np.ndarray], np.ndarray, int]:
            check_streaming(mv)
            seq = session_sequence(self._sequences(mv, req))
            warning = self._range_warning(mv, [seq], "inputs")
            outputs, states, _ = await self._run(mv, [Chunk(seq, state)], req)
            return (outputs, warning, seq), states[0], len(seq)
        request.current().route_key = req.session.encode()  # placed by its id
        applied = await self.sessions.chunk(
            req.session, req.model, chunk, version=version_param(req.version),
            start=req.start, end=req.end, position=req.position,
            secret=_secret(secret, req.session_secret, "session_secret"))
        outputs, warning, seq = applied.answer
        keep_answer(self.capture, "/predict", applied.model, applied.version, [seq],
                          outputs, req.session, applied.position)
        return PredictResult(Served(applied.model, applied.version, warning), outputs,
                             session=req.session, position=applied.position,
                             session_secret=applied.secret)

    def _sequences(self, mv: ModelVersion, req: Prediction) -> list[np.ndarray]:
        seqs = self._checked(mv, lambda spec: predict_sequences(
            spec, req, self.settings.max_request_sequences, self.settings.max_lm_output_bytes))
        # padded to the longest: what the batch's graph output holds
        self.outputs.take(len(seqs) * max(len(s) for s in seqs)
                          * per_step_bytes(mv.spec, bool(req.per_step)))
        return seqs

    def _checked(self, mv: ModelVersion, check: Callable[[ModelSpec], Any]) -> Any:
        """CHECK(MV's spec): the request's inputs as MV takes them. A rollout's candidate
        refusing (4xx) a request the rollout placed on it, which the promoted version's
        spec takes, is the candidate's failure, not the client's (the scope's
        ``candidate_refused``): a candidate that narrows its inputs (a shorter max_length)
        is rolled back on it."""
        try:
            return check(mv.spec)
        except ServiceError as error:
            held = request.current()
            plan = self.rollouts.running(mv.name)
            if held.route_key is None or plan is None or plan.candidate != mv.version or \
                    not 400 <= error.status < 500:
                raise
            promoted = self.registry.versions(mv.name).get(plan.promoted)
            if promoted is not None:
                try:
                    check(promoted.spec)
                except ServiceError:
                    pass  # the promoted version refuses it too: the client's
                else:
                    held.candidate_refused = True
            raise

    async def _run(self, mv: ModelVersion, seqs: list, req: Prediction,
                   tag: request.Scope | None = None
                   ) -> tuple[list[dict], list[np.ndarray], list[np.ndarray]]:
        """(The /predict outputs, the state after each sequence, the graph's output per
        sequence.) TAG: capture's, the request recorded with its batch."""
        spec = mv.spec
        if req.per_step and spec.task not in ("classify", "regress"):
            raise ClientError(f"per_step: for classify and regress models; {spec.task} "
                              f"models already answer every step")
        rows = await mv.infer(seqs, per_step=req.per_step, probabilities=True, tag=tag)
        if self.drift is not None and not req.per_step:
            self.drift.observe(mv, seqs, rows)
        out = shape_outputs(spec, rows, seqs, req.top_k, req.per_step, req.allow_unk)
        if req.return_state:
            for item, row in zip(out, rows, strict=True):
                item["state"] = encode_state(mv.name, mv.version, row["state"])
        return out, [row["state"] for row in rows], [row[spec.output_name] for row in rows]

    # -- sessions (server-side state, /predict and OIP sequences alike: service.streaming) --

    def _range_warning(self, mv: ModelVersion, seqs: list, field: str) -> str | None:
        """Inputs far outside the training range are answered, with a warning (a response
        header) and a count: usually the client skipped the model's preprocessing."""
        data = [s.data if isinstance(s, Chunk) else s for s in seqs]
        warning = range_warning(mv.spec, data, field)
        if warning is not None and self.metrics is not None:
            self.metrics.inputs_out_of_range.labels(mv.name, str(mv.version)).inc()
        return warning

    # -- Open Inference Protocol ------------------------------------------------------------

    async def infer(self, req: Inference, name: str, version: str | None,
                    key: bytes = b"", secret: str | None = None) -> InferenceResult:
        """An OIP inference request on model NAME (VERSION: the URL's); with a
        ``sequence``, a chunk of that session (its position makes it exactly-once, as
        /predict's ``position``); ``session_secret`` (or SECRET, the request's header) is
        the session's secret."""
        position = given = None
        if req.sequence is not None:
            sid = req.sequence.id

            async def chunk(mv: ModelVersion, state: np.ndarray | None) -> tuple[
                    tuple[list[OutputTensor], str | None, list], np.ndarray, int]:
                check_streaming(mv)
                seqs, steps = self._infer_sequences(mv, req)
                seq = session_sequence(seqs)
                warning = self._range_warning(mv, [seq], "inputs[x]")
                tensors = await self._infer_run(mv, req, [Chunk(seq, state)], steps)
                return (tensors, warning, [seq]), state_of(tensors), len(seq)
            request.current().route_key = sid.encode()  # a sequence is placed by its id
            applied = await self.sessions.chunk(
                sid, name, chunk, version=version_param(version), start=req.sequence.start,
                end=req.sequence.end, position=req.sequence.position, what="sequence",
                secret=_secret(secret, req.session_secret, "parameters.session_secret"))
            tensors, warning, seqs = applied.answer
            served = Served(applied.model, applied.version, warning)
            position, given = applied.position, applied.secret
        else:
            if req.session_secret is not None:
                raise ClientError("parameters.session_secret: only with sequence_id")
            number = version_param(version)
            stateless = all(t.name != INITIAL_STATE for t in req.inputs)
            if number is None and stateless:  # a state continues the version that made it
                number = self.registry.route(name, key)
                request.current().route_key = key
            with self.hold(name, number) as mv:
                seqs, steps = self._infer_sequences(mv, req)
                warning = self._range_warning(mv, seqs, "inputs[x]")
                tensors = await self._infer_run(mv, req, seqs, steps,
                                                self._tag("infer"))
                if stateless:
                    self._shadow_infer(mv, req, seqs, tensors)
            served = Served(mv.name, mv.version, warning)
        wanted = [o.name for o in req.outputs] if req.outputs else None
        outputs = [t for t in tensors if wanted is None or t.name in wanted]
        if wanted is not None:
            outputs.sort(key=lambda t: wanted.index(t.name))
        if self.capture is not None and req.sequence is not None:  # a session's chunk
            keep_answer(self.capture, "infer", served.model, served.version, seqs,
                        {t.name: t.data for t in outputs}, req.sequence.id, position)
        return InferenceResult(served, outputs, req.id, position=position,
                               session_secret=given)

    def _infer_sequences(self, mv: ModelVersion, req: Inference) -> tuple[list, int]:
        seqs, steps = self._checked(mv, lambda spec: infer_sequences(
            spec, req, spec.io["model"], self.settings.max_request_sequences,
            self.settings.max_lm_output_bytes))
        self.outputs.take(len(seqs) * steps * per_step_bytes(
            mv.spec, value_bytes=output_value_bytes(mv.spec, req)))
        return seqs, steps

    async def _infer_run(self, mv: ModelVersion, req: Inference, seqs: list, steps: int,
                         tag: request.Scope | None = None) -> list[OutputTensor]:
        """Every output of the model, as tensors [B, ...] (the request's outputs checked).
        TAG: capture's, the request recorded with its batch."""
        runtime = mv.runtime
        names = runtime.output_names["model"]
        unknown = [o.name for o in req.outputs or () if o.name not in names]
        if unknown:
            raise ClientError(f"outputs: unknown output {unknown[0]!r}; the model has {names}")
        datatypes = {o.name: o.datatype for o in mv.spec.io["model"].outputs}
        # a language model's drift summary reads the batch's log-probabilities (computed
        # in the inference thread, not on the event loop)
        rows = await mv.infer(seqs, tag=tag,
                              probabilities=self.drift is not None and mv.spec.task == "lm")
        if self.drift is not None:
            self.drift.observe(mv, seqs, rows)
        tensors = outputs_to_tensors(rows, names, steps, runtime.per_step["model"])
        return [OutputTensor(n, datatypes[n], tensors[n]) for n in names]

    def _shadow_infer(self, mv: ModelVersion, req: Inference, seqs: list,
                      tensors: list[OutputTensor]) -> None:
        """Maybe shadow an inference request (its graph output per sequence, the padding
        past each sequence's length cut off)."""
        if not self.rollouts.running(mv.name):
            return
        (out,) = [t.data for t in tensors if t.name == mv.spec.output_name]
        timed = mv.spec.output_name in mv.runtime.per_step["model"]
        raw = [out[i, :len(s)] if timed else out[i] for i, s in enumerate(seqs)]
        self.shadows.after(mv, lambda spec: self._infer_sequences_of(spec, req), raw)

    def _infer_sequences_of(self, spec: ModelSpec, req: Inference) -> list:
        return infer_sequences(spec, req, spec.io["model"],
                               self.settings.max_request_sequences)[0]
