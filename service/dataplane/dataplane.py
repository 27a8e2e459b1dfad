"""The model work behind the HTTP routes: typed requests in, typed results out
(``service.dataplane.messages``), as MLServer's ``DataPlane`` serves REST and gRPC alike. The HTTP
layer (``service.http.app``) decodes bodies with the codecs, maps errors to status codes and
counts metrics; everything that touches a model version, a batcher, a state or a session
is here. Whatever holds a model version for a request records it in the request's
``Held`` (an argument), so that the request is counted under it, a failed one too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import numpy as np
from orthornn.export.artifacts.numbers import is_integer
from orthornn.export.artifacts.package import INITIAL_STATE, TensorSpec
from orthornn.export.artifacts.rollout import RULES

from ..errors import (
    SECRET_HEADER,
    ClientError,
    NotFound,
    RollbackRefused,
    ServiceError,
    StateConflict,
)
from ..metrics import UNKNOWN, Held, Metrics
from ..registry.batcher import Batcher
from ..registry.registry import ModelVersion, Registry
from ..registry.runtime import Chunk
from ..registry.spec import ModelSpec
from ..sessions.manager import Sessions
from ..sessions.owners import MAX_ID_LENGTH
from ..sessions.store import open_store
from ..sessions.tokens import decode_state, encode_state, state_version
from ..settings import Settings
from . import generate
from .checks import infer_sequences, predict_sequences, range_warning
from .messages import (
    Document,
    Inference,
    InferenceResult,
    OutputTensor,
    Prediction,
    PredictResult,
    Served,
)
from .outputs import outputs_to_tensors, shape_outputs
from .schemas import (
    GenerateRequest,
    RepositoryIndexRequest,
    RollbackRequest,
    RolloutStartRequest,
)
from .shadow import Shadows

SEQUENCE_KEYS = ("sequence_id", "sequence_start", "sequence_end", "sequence_position")


def server_version() -> str:
    try:
        return dist_version("orthornn")
    except PackageNotFoundError:
        return "0+unknown"


def _secret(header: str | None, field: object, name: str) -> str | None:
    """A session's secret, from the request's header or its body (NAME: the field); 400
    when both are given and differ, or the field is not a string."""
    if field is not None and not isinstance(field, str):
        raise ClientError(f"{name}: must be a string")
    if header is not None and field is not None and header != field:
        raise ClientError(f"{name}: differs from the {SECRET_HEADER} header; give the "
                          f"secret once")
    return header if header is not None else field


def version_param(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if not (isinstance(value, str) and value.isascii() and value.isdigit()) or \
            not 1 <= int(value) < 2**62:
        raise NotFound(f"version must be a positive integer; got {value!r}")
    return int(value)


class DataPlane:
    def __init__(self, settings: Settings, registry: Registry,
                 metrics: Metrics | None = None):
        self.settings, self.registry, self.metrics = settings, registry, metrics
        # server-side sessions: in this process or in a Redis the replicas share
        self.sessions = Sessions(open_store(settings, metrics), registry, metrics=metrics,
                                 secrets=settings.session_secrets)
        self.rollouts = registry.rollouts
        self.shadows = Shadows(registry)

    def observe(self, held: Held, status: int) -> None:
        """An answered request, for a running rollout's analysis: counted only when the
        rollout placed it (``held.route_key``: the service chose its version), and only a
        5xx is the version's error (``rollouts.version_error``); a request that held no
        version, e.g. an unreadable body, is nobody's."""
        self.rollouts.count(held.model, held.version, status, held.route_key, held.compute_s,
                            held.candidate_refused)

    def labels(self, held: Held) -> tuple[str, str]:
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
    def hold(self, name: str, version: int | None, held: Held, *, from_states: bool = False,
             batched: bool = True) -> Iterator[ModelVersion]:
        """Acquire a model version for one request (recorded in HELD). ``from_states``: the
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
        held.hold(mv.name, mv.version)
        try:
            yield mv
        finally:
            self.registry.release(mv, batched=batched)

    # -- server and model metadata ----------------------------------------------------------

    @staticmethod
    def server_metadata() -> dict:
        return {"name": "orthornn", "version": server_version(),
                "extensions": ["binary_tensor_data", "model_repository", "sequences"]}

    def ready(self) -> bool:
        return self.registry.ready()

    def model_metadata(self, name: str, version: str | None) -> Document:
        mv = self.registry.get(name, version_param(version))
        io = mv.spec.io["model"]
        promoted = self.registry.promoted(name)
        return Document(Served(name, mv.version), {
            "name": name, "versions": [str(v) for v in self.registry.serving().get(name, [])],
            "platform": "onnxruntime_onnx",
            "inputs": [t.to_dict() for t in io.inputs],
            "outputs": [t.to_dict() for t in io.outputs],
            "parameters": {"version": str(mv.version), "task": mv.spec.task,
                           "arch": mv.spec.arch, "max_length": mv.spec.max_length,
                           "labels": mv.spec.labels, "streaming": mv.spec.streaming,
                           "preprocessing": mv.manifest.preprocessing,
                           "spectral": mv.manifest.spectral or {},
                           "promoted": None if promoted is None else str(promoted),
                           # why promotion.json cannot be read (what serves stays), or None
                           "promotion_error": self.registry.promotion_error(name),
                           "rollout": self._rollout_summary(name),
                           "evaluation": mv.manifest.evaluation,
                           "lineage": mv.manifest.lineage}})

    def _rollout_summary(self, name: str) -> dict | None:
        """The model's last rollout as this replica read it (None: none)."""
        plan = self.rollouts.plan(name)
        if plan is None:
            return None
        return {"id": plan.id, "candidate": str(plan.candidate), "state": plan.state,
                "stage": str(plan.stage_name), "weight": plan.weight(), "reason": plan.reason}

    def model_ready(self, name: str, version: str | None) -> bool:
        """True when ready; False when in the repository but not ready; NotFound else."""
        v = version_param(version)
        if self.registry.model_ready(name, v):
            return True
        if name not in {r["name"] for r in self.registry.index()}:
            raise NotFound(f"model {name!r} is not in the repository")
        return False

    def model_config(self, name: str) -> Document:
        """Triton's model configuration, as tritonclient reads it."""
        s = self.settings
        mv = self.registry.get(name)
        io = mv.spec.io["model"]

        def tensors(items: list[TensorSpec]) -> list[dict[str, Any]]:
            return [{"name": t.name, "data_type": "TYPE_" + t.datatype, "dims": t.shape[1:],
                     **({"optional": True} if t.optional else {})} for t in items]
        config = {"name": name, "platform": "onnxruntime_onnx",
                  "max_batch_size": s.max_request_sequences,
                  "input": tensors(io.inputs), "output": tensors(io.outputs),
                  "dynamic_batching": {"max_queue_delay_microseconds":
                                       int(s.max_queue_delay_ms * 1000)} if s.batching else None,
                  "version_policy": {s.version_policy: {"num_versions": s.keep_versions}}}
        if mv.spec.streaming:  # sequences: state kept per sequence_id, idle ones ended
            config["sequence_batching"] = {
                "max_sequence_idle_microseconds": int(s.session_idle_timeout_s * 1e6)}
        return Document(Served(name, mv.version), config)

    # -- /generate ---------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest, held: Held) -> Document:
        with self.hold(req.model, version_param(req.version), held, batched=False) as mv:
            prompt = generate.prompt_ids(mv.spec, req, self.settings.max_new_tokens,
                                         self.settings.max_lm_output_bytes)
            # a thread of its own (asyncio's default pool): a long generation must not hold
            # the inference threads, and the batcher must not wait for it (batched=False)
            result = await asyncio.to_thread(generate.generate, mv.runtime, mv.spec,
                                             prompt, req, self.settings.max_lm_output_bytes)
        return Document(Served(mv.name, mv.version),
                      {"model": mv.name, "version": mv.version, **result})

    # -- the model repository ------------------------------------------------------------------

    async def repository_index(self, req: RepositoryIndexRequest) -> list[dict]:
        rows = await asyncio.to_thread(self.registry.index)
        if req.ready is not None:
            rows = [r for r in rows if (r["state"] == "READY") == req.ready]
        return rows

    async def load(self, name: str) -> dict:
        errors = await asyncio.to_thread(self.registry.load, name)
        if not self.registry.model_ready(name):
            raise ClientError(f"model {name!r} failed to load: " + "; ".join(errors))
        return {"name": name, "versions": self.registry.serving()[name], "refused": errors}

    async def rollback(self, name: str, req: RollbackRequest) -> dict:
        """Promote an earlier version (the request's, or the one promoted before the
        current one) and swap to it now; 409 naming the usable versions when it cannot."""
        try:
            return await asyncio.to_thread(self.registry.rollback, name,
                                           version_param(req.version))
        except RollbackRefused as error:
            raise RollbackRefused(f"rollback of model {name!r}: {error}") from None

    def rollout(self, name: str) -> dict:
        """NAME's rollout plan as this replica read it, and this replica's tallies of it
        (what ``orthornn rollout run`` adds across replicas)."""
        if not self.registry.model_ready(name) and self.rollouts.plan(name) is None:
            raise NotFound(f"model {name!r} is not loaded")
        plan = self.rollouts.plan(name)
        return {"model": name, "plan": None if plan is None else plan.to_dict(),
                "report": self.rollouts.report(name)}

    async def start_rollout(self, name: str, req: RolloutStartRequest) -> dict:
        thresholds = {k: getattr(req, k) for k in RULES}
        plan = await asyncio.to_thread(
            self.registry.policy.start_rollout, name, req.candidate, req.shadow, req.steps,
            req.interval_s, req.min_requests, thresholds)
        return plan.to_dict()

    async def end_rollout(self, name: str, action: str) -> dict:
        plan = await asyncio.to_thread(self.registry.policy.end_rollout, name, action)
        return plan.to_dict()

    async def unload(self, name: str) -> dict:
        await asyncio.to_thread(self.registry.unload, name)
        return {"name": name, "unloaded": True}

    # -- /predict --------------------------------------------------------------------------

    async def predict(self, req: Prediction, held: Held, key: bytes = b"",
                      secret: str | None = None) -> PredictResult:
        """KEY: the request's routing key (a rollout's canary places it by its hash);
        SECRET: a session's secret from the request's header (or in the body)."""
        if req.session is not None:
            return await self._predict_session(req, held, secret)
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
            held.routed(key)
        with self.hold(req.model, version, held, from_states=from_states) as mv:
            seqs = self._sequences(mv, req, held)
            warning = self._range_warning(mv, seqs, "inputs")
            if req.states is not None:
                if len(req.states) != len(seqs):
                    raise ClientError(f"states: one per sequence ({len(seqs)}); got "
                                      f"{len(req.states)}")
                self._check_streaming(mv)
                batch: list[np.ndarray | Chunk] = [
                    Chunk(s, decode_state(st, mv.name, mv.version, mv.spec.state_size,
                                          f"states[{i}]"))
                    for i, (s, st) in enumerate(zip(seqs, req.states, strict=True))]
            else:
                batch = list(seqs)
            outputs, _, raw = await self._run(mv, batch, req, held)
            if req.states is None and not req.per_step:
                self.shadows.after(mv, lambda spec: predict_sequences(
                    spec, req, self.settings.max_request_sequences), raw)
        return PredictResult(Served(mv.name, mv.version, warning), outputs)

    async def _predict_session(self, req: Prediction, held: Held,
                               secret: str | None) -> PredictResult:
        assert req.session is not None
        if req.states is not None:
            raise ClientError("states: not with 'session' (the session keeps its state)")

        async def chunk(mv: ModelVersion, state: np.ndarray | None
                        ) -> tuple[tuple[list[dict], str | None], np.ndarray, int]:
            self._check_streaming(mv)
            seq = self._session_sequence(self._sequences(mv, req, held))
            warning = self._range_warning(mv, [seq], "inputs")
            outputs, states, _ = await self._run(mv, [Chunk(seq, state)], req, held)
            return (outputs, warning), states[0], len(seq)
        held.routed(req.session.encode())  # a session is placed by its id
        applied = await self.sessions.chunk(
            req.session, req.model, chunk, version=version_param(req.version),
            start=req.start, end=req.end, position=req.position, held=held,
            secret=_secret(secret, req.session_secret, "session_secret"))
        outputs, warning = applied.answer
        return PredictResult(Served(applied.model, applied.version, warning), outputs,
                             session=req.session, position=applied.position,
                             session_secret=applied.secret)

    def _sequences(self, mv: ModelVersion, req: Prediction, held: Held) -> list[np.ndarray]:
        return self._checked(mv, held, lambda spec: predict_sequences(
            spec, req, self.settings.max_request_sequences, self.settings.max_lm_output_bytes))

    def _checked(self, mv: ModelVersion, held: Held, check: Callable[[ModelSpec], Any]) -> Any:
        """CHECK(MV's spec): the request's inputs as MV takes them. A rollout's candidate
        refusing (4xx) a request the rollout placed on it, which the promoted version's
        spec takes, is the candidate's failure, not the client's (``Held.refused``): a
        candidate that narrows its inputs (a shorter max_length) is rolled back on it."""
        try:
            return check(mv.spec)
        except ServiceError as error:
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
                    held.refused()
            raise

    async def _run(self, mv: ModelVersion, seqs: list, req: Prediction, held: Held
                   ) -> tuple[list[dict], list[np.ndarray], list[np.ndarray]]:
        """Batch the sequences; (the /predict outputs, the state after each sequence, the
        graph's output per sequence)."""
        spec = mv.spec
        batcher = mv.batcher
        if req.per_step:
            if spec.task not in ("classify", "regress"):
                raise ClientError(f"per_step: for classify and regress models; {spec.task} "
                                  f"models already answer every step")
            if mv.steps_batcher is None:
                raise ClientError(f"per_step: model {mv.name!r} version {mv.version} has no "
                                  f"per-step graph; export it again")
            batcher = mv.steps_batcher

        def post(rows: list[dict[str, np.ndarray]]  # in the inference thread
                 ) -> tuple[list[dict[str, Any]], list[np.ndarray], list[np.ndarray]]:
            out = shape_outputs(spec, rows, seqs, req.top_k, req.per_step,
                                        req.allow_unk)
            if req.return_state:
                for item, row in zip(out, rows, strict=True):
                    item["state"] = encode_state(mv.name, mv.version, row["state"])
            return out, [row["state"] for row in rows], [row[spec.output_name] for row in rows]
        return await self._submit(mv, batcher, seqs, post, held,
                                  prepare=True)  # one softmax per batch

    async def _submit(self, mv: ModelVersion, batcher: Batcher, seqs: list,
                      post: Callable[[list[dict]], Any], held: Held, *,
                      prepare: bool = False) -> Any:
        """``batcher.submit``, its compute time (queue and inference) kept in HELD: a
        running rollout compares its versions' over the requests it placed (``observe``)."""
        start = time.perf_counter()
        done = await batcher.submit(seqs, post, prepare=prepare)
        held.computed(time.perf_counter() - start)
        return done

    # -- sessions (server-side state, /predict and OIP sequences alike: service.streaming) --

    @staticmethod
    def _session_sequence(seqs: list) -> np.ndarray:
        if len(seqs) != 1:
            raise ClientError(f"a session takes one sequence per request; got {len(seqs)}")
        if isinstance(seqs[0], Chunk):
            raise ClientError("inputs[initial_state]: not with a sequence_id (the session "
                              "keeps its state)")
        return seqs[0]

    def _range_warning(self, mv: ModelVersion, seqs: list, field: str) -> str | None:
        """Inputs far outside the training range are answered, with a warning (a response
        header) and a count: usually the client skipped the model's preprocessing."""
        data = [s.data if isinstance(s, Chunk) else s for s in seqs]
        warning = range_warning(mv.spec, data, field)
        if warning is not None and self.metrics is not None:
            self.metrics.inputs_out_of_range.labels(mv.name, str(mv.version)).inc()
        return warning

    @staticmethod
    def _check_streaming(mv: ModelVersion) -> None:
        if not mv.spec.streaming:
            raise ClientError(f"model {mv.name!r} version {mv.version} was exported before "
                              f"streaming (its graphs take no initial state); export it again "
                              f"to continue sequences across requests")

    # -- Open Inference Protocol ------------------------------------------------------------

    async def infer(self, req: Inference, name: str, version: str | None, held: Held,
                    key: bytes = b"", secret: str | None = None) -> InferenceResult:
        """An OIP inference request on model NAME (VERSION: the URL's). The request
        parameters ``sequence_id``, ``sequence_start`` and ``sequence_end`` (as tritonclient
        sends them) run it on a session; ``sequence_position`` makes the chunk exactly-once
        (as /predict's ``position``); ``session_secret`` (or SECRET, the request's header)
        is the session's secret."""
        position = given = None
        if any(k in req.parameters for k in SEQUENCE_KEYS):
            sid, start, end, position_param = self._sequence(req.parameters)

            async def chunk(mv: ModelVersion, state: np.ndarray | None
                            ) -> tuple[tuple[list[OutputTensor], str | None], np.ndarray, int]:
                self._check_streaming(mv)
                seqs, steps = self._infer_sequences(mv, req, held)
                seq = self._session_sequence(seqs)
                warning = self._range_warning(mv, [seq], "inputs[x]")
                tensors = await self._infer_run(mv, req, [Chunk(seq, state)], steps, held)
                return (tensors, warning), self._state_of(tensors), len(seq)
            held.routed(sid.encode())  # a sequence is placed by its id
            applied = await self.sessions.chunk(
                sid, name, chunk, version=version_param(version), start=start, end=end,
                position=position_param, what="sequence", held=held,
                secret=_secret(secret, req.parameters.get("session_secret"),
                               "parameters.session_secret"))
            tensors, warning = applied.answer
            served = Served(applied.model, applied.version, warning)
            position, given = applied.position, applied.secret
        else:
            if "session_secret" in req.parameters:
                raise ClientError("parameters.session_secret: only with sequence_id")
            number = version_param(version)
            stateless = all(t.name != INITIAL_STATE for t in req.inputs)
            if number is None and stateless:  # a state continues the version that made it
                number = self.registry.route(name, key)
                held.routed(key)
            with self.hold(name, number, held) as mv:
                seqs, steps = self._infer_sequences(mv, req, held)
                warning = self._range_warning(mv, seqs, "inputs[x]")
                tensors = await self._infer_run(mv, req, seqs, steps, held)
                if stateless:
                    self._shadow_infer(mv, req, seqs, tensors)
            served = Served(mv.name, mv.version, warning)
        wanted = [o.name for o in req.outputs] if req.outputs else None
        outputs = [t for t in tensors if wanted is None or t.name in wanted]
        if wanted is not None:
            outputs.sort(key=lambda t: wanted.index(t.name))
        return InferenceResult(served, outputs, req.id, position=position,
                               session_secret=given)

    @staticmethod
    def _state_of(tensors: list[OutputTensor]) -> np.ndarray:
        (state,) = [t.data for t in tensors if t.name == "state"]
        return state[0]

    @staticmethod
    def _sequence(params: dict) -> tuple[str, bool, bool, int | None]:
        """(sequence_id, sequence_start, sequence_end, sequence_position) of an inference
        request's parameters, checked."""
        sid, start, end, position = (params.get(k) for k in SEQUENCE_KEYS)
        if isinstance(sid, bool) or not isinstance(sid, int | str) or sid in ("", 0):
            raise ClientError("parameters.sequence_id: required with sequence_start, "
                              "sequence_end or sequence_position, a non-zero integer or a "
                              "non-empty string")
        # one bound for session ids on both protocols (/predict's session), checked before
        # the id is kept anywhere
        if isinstance(sid, int) and not -2**63 <= sid < 2**64:
            raise ClientError("parameters.sequence_id: an integer id must fit in 64 bits")
        if isinstance(sid, str) and len(sid) > MAX_ID_LENGTH:
            raise ClientError(f"parameters.sequence_id: 1 to {MAX_ID_LENGTH} characters; got "
                              f"{len(sid)}")
        for key, flag in (("sequence_start", start), ("sequence_end", end)):
            if flag is not None and not isinstance(flag, bool):
                raise ClientError(f"parameters.{key}: must be true or false")
        if position is not None and (not is_integer(position) or not 0 <= position < 2**62):
            raise ClientError("parameters.sequence_position: must be an integer >= 0 (the "
                              "time steps the sequence has consumed)")
        return str(sid), bool(start), bool(end), position

    def _infer_sequences(self, mv: ModelVersion, req: Inference, held: Held
                         ) -> tuple[list, int]:
        return self._checked(mv, held, lambda spec: infer_sequences(
            spec, req, spec.io["model"], self.settings.max_request_sequences,
            self.settings.max_lm_output_bytes))

    async def _infer_run(self, mv: ModelVersion, req: Inference, seqs: list, steps: int,
                         held: Held) -> list[OutputTensor]:
        """Every output of the model, as tensors [B, ...] (the request's outputs checked)."""
        runtime = mv.runtime
        names = runtime.output_names["model"]
        unknown = [o.name for o in req.outputs or () if o.name not in names]
        if unknown:
            raise ClientError(f"outputs: unknown output {unknown[0]!r}; the model has {names}")
        datatypes = {o.name: o.datatype for o in mv.spec.io["model"].outputs}
        tensors = await self._submit(
            mv, mv.batcher, seqs, lambda rows: outputs_to_tensors(rows, names, steps,
                                                                  runtime.per_step["model"]),
            held)
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
