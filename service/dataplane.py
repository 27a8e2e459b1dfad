"""The model work behind the HTTP routes: requests in, answers out (as MLServer's
``DataPlane`` serves REST and gRPC alike). The HTTP layer (``service.app``) reads bodies,
maps errors to status codes and counts metrics; everything that touches a model version,
a batcher, a state or a session is here.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager, suppress
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

import numpy as np
import orjson
from orthornn.export.package import DATATYPES
from pydantic import BaseModel, ValidationError

from . import generate, inputs
from .errors import ClientError, NotFound
from .metrics import UNKNOWN
from .protocol import (
    GenerateRequest,
    InferenceRequest,
    PredictRequest,
    RepositoryIndexRequest,
    RollbackRequest,
)
from .registry import Registry, RollbackRefused
from .runtime import Chunk
from .settings import Settings
from .streaming import (
    Session,
    Sessions,
    StateConflict,
    UnknownSession,
    decode_state,
    encode_state,
    state_version,
)

SEQUENCE_KEYS = ("sequence_id", "sequence_start", "sequence_end")


def server_version() -> str:
    try:
        return dist_version("orthornn")
    except PackageNotFoundError:
        return "0+unknown"


def parse(model: type[BaseModel], body: bytes, allow_empty: bool = False):
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


def version_param(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value
    if not (isinstance(value, str) and value.isascii() and value.isdigit()) or \
            not 1 <= int(value) < 2**62:
        raise NotFound(f"version must be a positive integer; got {value!r}")
    return int(value)


class DataPlane:
    def __init__(self, settings: Settings, registry: Registry, metrics=None):
        self.settings, self.registry, self.metrics = settings, registry, metrics
        self.sessions = Sessions(
            max_sessions=settings.max_sessions, idle_timeout_s=settings.session_idle_timeout_s,
            hold=lambda name, version: registry.acquire(name, version, session=True),
            release=lambda mv: registry.release(mv, session=True), metrics=metrics)

    def label(self, labels: dict, name: str, version: int | None = None) -> None:
        """The metric labels of a request naming model NAME (and VERSION), before any
        version is held: a loaded model's name, with the version only when it is loaded;
        UNKNOWN for a model that is not loaded (clients cannot grow the label set)."""
        if not self.registry.model_ready(name):
            labels["labels"] = (UNKNOWN, "")
        elif version is not None and self.registry.model_ready(name, version):
            labels["labels"] = (name, str(version))
        else:
            labels["labels"] = (name, "")

    @contextmanager
    def hold(self, labels: dict, name: str, version: int | None, *,
             from_states: bool = False):
        """Acquire a model version for one request; ``labels`` (the request's scope
        state) gets the metric labels. ``from_states``: the version is the one the
        request's states name (a 404 says so)."""
        try:
            mv = self.registry.acquire(name, version)
        except NotFound:
            self.label(labels, name)
            if from_states and self.registry.model_ready(name):
                loaded = self.registry.serving().get(name, [])
                raise NotFound(f"states: made by model {name!r} version {version}, which is "
                               f"not loaded (loaded: {loaded}); a state only continues the "
                               f"version that made it: start the sequence again without "
                               f"states") from None
            raise
        labels["labels"] = (name, str(mv.version))
        try:
            yield mv
        finally:
            self.registry.release(mv)

    # -- server and model metadata ----------------------------------------------------------

    @staticmethod
    def server_metadata() -> dict:
        return {"name": "orthornn", "version": server_version(),
                "extensions": ["binary_tensor_data", "model_repository", "sequences"]}

    def ready(self) -> bool:
        return self.registry.ready()

    def model_metadata(self, name: str, version: str | None, labels: dict) -> dict:
        self.label(labels, name)
        mv = self.registry.get(name, version_param(version))
        labels["labels"] = (name, str(mv.version))
        io = mv.spec.io["model"]
        promoted = self.registry.promoted(name)
        return {"name": name, "versions": [str(v) for v in self.registry.serving().get(name, [])],
                "platform": "onnxruntime_onnx",
                "inputs": io["inputs"], "outputs": io["outputs"],
                "parameters": {"version": str(mv.version), "task": mv.spec.task,
                               "arch": mv.spec.arch, "max_length": mv.spec.max_length,
                               "labels": mv.spec.labels, "streaming": mv.spec.streaming,
                               "preprocessing": mv.manifest.preprocessing,
                               "spectral": mv.manifest.spectral or {},
                               "promoted": None if promoted is None else str(promoted),
                               "evaluation": mv.manifest.evaluation,
                               "lineage": mv.manifest.lineage}}

    def model_ready(self, name: str, version: str | None, labels: dict) -> bool:
        """True when ready; False when in the repository but not ready; NotFound else."""
        self.label(labels, name)  # before the version is read: "x" is a 404 too
        v = version_param(version)
        self.label(labels, name, v)
        if self.registry.model_ready(name, v):
            return True
        if name not in {r["name"] for r in self.registry.index()}:
            raise NotFound(f"model {name!r} is not in the repository")
        return False

    def model_config(self, name: str, labels: dict) -> dict:
        """Triton's model configuration, as tritonclient reads it."""
        s = self.settings
        self.label(labels, name)
        mv = self.registry.get(name)
        labels["labels"] = (name, str(mv.version))
        io = mv.spec.io["model"]

        def tensors(items):
            return [{"name": t["name"], "data_type": "TYPE_" + t["datatype"],
                     "dims": t["shape"][1:], **({"optional": True} if t.get("optional")
                                                else {})} for t in items]
        config = {"name": name, "platform": "onnxruntime_onnx",
                  "max_batch_size": s.max_request_sequences,
                  "input": tensors(io["inputs"]), "output": tensors(io["outputs"]),
                  "dynamic_batching": {"max_queue_delay_microseconds":
                                       int(s.max_queue_delay_ms * 1000)} if s.batching else None,
                  "version_policy": {s.version_policy: {"num_versions": s.keep_versions}}}
        if mv.spec.streaming:  # sequences: state kept per sequence_id, idle ones ended
            config["sequence_batching"] = {
                "max_sequence_idle_microseconds": int(s.session_idle_timeout_s * 1e6)}
        return config

    # -- /generate ---------------------------------------------------------------------------

    async def generate(self, body: bytes, labels: dict) -> dict:
        req = parse(GenerateRequest, body)
        self.label(labels, req.model)
        with self.hold(labels, req.model, version_param(req.version)) as mv:
            prompt = generate.prompt_ids(mv.spec, req, self.settings.max_new_tokens)
            # a thread of its own (asyncio's default pool): a long generation must not hold
            # the inference threads, and the batcher must not wait for it
            mv.generating += 1
            try:
                result = await asyncio.to_thread(generate.generate, mv.runtime, mv.spec,
                                                 prompt, req)
            finally:
                mv.generating -= 1
        return {"model": mv.name, "version": mv.version, **result}

    # -- the model repository ------------------------------------------------------------------

    async def repository_index(self, body: bytes) -> list[dict]:
        req = parse(RepositoryIndexRequest, body, allow_empty=True)
        rows = await asyncio.to_thread(self.registry.index)
        if req.ready is not None:
            rows = [r for r in rows if (r["state"] == "READY") == req.ready]
        return rows

    async def load(self, name: str) -> dict:
        errors = await asyncio.to_thread(self.registry.load, name)
        if not self.registry.model_ready(name):
            raise ClientError(f"model {name!r} failed to load: " + "; ".join(errors))
        return {"name": name, "versions": self.registry.serving()[name], "refused": errors}

    async def rollback(self, name: str, body: bytes) -> dict:
        """Promote an earlier version (the body's, or the one promoted before the current
        one) and swap to it now; 409 naming the usable versions when it cannot."""
        req = parse(RollbackRequest, body, allow_empty=True)
        try:
            return await asyncio.to_thread(self.registry.rollback, name,
                                           version_param(req.version))
        except RollbackRefused as error:
            raise RollbackRefused(f"rollback of model {name!r}: {error}") from None

    async def unload(self, name: str) -> dict:
        await asyncio.to_thread(self.registry.unload, name)
        return {"name": name, "unloaded": True}

    # -- /predict --------------------------------------------------------------------------

    async def predict(self, body: bytes, labels: dict) -> dict:
        # the common body (float sequences) without pydantic; anything it does not take,
        # and every mistake, goes through pydantic and the checks that name the field
        fast = inputs.fast_predict_request(body)
        req = fast or parse(PredictRequest, body)
        self.label(labels, req.model)
        if req.session is not None:
            return await self._predict_session(req, body, fast, labels)
        for flag in ("start", "end"):
            if getattr(req, flag):
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
        with self.hold(labels, req.model, version, from_states=from_states) as mv:
            seqs = self._sequences(mv, req, body, fast)
            self._check_range(mv, seqs, "inputs", labels)
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
            outputs, _ = await self._run(mv, batch, req)
        return {"model": mv.name, "version": mv.version, "outputs": outputs}

    async def _predict_session(self, req, body: bytes, fast, labels: dict) -> dict:
        if req.states is not None:
            raise ClientError("states: not with 'session' (the session keeps its state)")
        if req.start:
            session = self.sessions.start(req.session, req.model, version_param(req.version))
        else:
            session = self.sessions.get(req.session, req.model)
            version = version_param(req.version)
            if version is not None and version != session.mv.version:
                raise StateConflict(f"session {req.session!r} runs on version "
                                    f"{session.mv.version}, not {version}")
        outputs = await self._session_chunk(
            session, req, labels, lambda mv: self._sequences(mv, req, body, fast),
            started=req.start, end=req.end)
        return {"model": session.mv.name, "version": session.mv.version, "outputs": outputs,
                "session": session.id}

    async def _session_chunk(self, session: Session, req, labels: dict, read, *,
                             started: bool, end: bool, run=None):
        """Apply one chunk to a session, after the chunks that arrived before it; ``read``
        gives the chunk's sequences from the session's model version."""
        mv = session.mv
        labels["labels"] = (mv.name, str(mv.version))
        ok = False
        try:
            async with session.lock:  # one chunk at a time, in arrival order
                if session.closed:
                    raise UnknownSession(f"session {session.id!r} ended while this request "
                                         f"waited")
                self._check_streaming(mv)
                seqs = read(mv)
                self._check_range(mv, seqs, "inputs", labels)
                if len(seqs) != 1:
                    raise ClientError(f"a session takes one sequence per request; got "
                                      f"{len(seqs)}")
                if isinstance(seqs[0], Chunk):
                    raise ClientError("inputs[initial_state]: not with a sequence_id (the "
                                      "session keeps its state)")
                chunk = Chunk(seqs[0], session.state)
                outputs, states = await (run or self._run)(mv, [chunk], req)
                session.state = np.array(states[0], dtype=np.float32)
                session.last_used = time.monotonic()
                ok = True
        finally:
            if end or (started and not ok):  # a failed first chunk opens nothing
                self.sessions.end(session)
        return outputs

    def _sequences(self, mv, req, body: bytes, fast) -> list[np.ndarray]:
        spec = mv.spec
        if fast is not None and spec.kind == "float":
            with suppress(ClientError):
                return inputs.predict_sequences(spec, fast, self.settings.max_request_sequences)
        if fast is not None:
            req = parse(PredictRequest, body)
        return inputs.predict_sequences(spec, req, self.settings.max_request_sequences)

    def _check_range(self, mv, seqs: list, field: str, labels: dict) -> None:
        """Inputs far outside the training range are answered, with a warning (a response
        header) and a count: usually the client skipped the model's preprocessing."""
        data = [s.data if isinstance(s, Chunk) else s for s in seqs]
        warning = inputs.range_warning(mv.spec, data, field)
        if warning is not None:
            labels["warning"] = warning
            if self.metrics is not None:
                self.metrics.inputs_out_of_range.labels(mv.name, str(mv.version)).inc()

    @staticmethod
    def _check_streaming(mv) -> None:
        if not mv.spec.streaming:
            raise ClientError(f"model {mv.name!r} version {mv.version} was exported before "
                              f"streaming (its graphs take no initial state); export it again "
                              f"to continue sequences across requests")

    async def _run(self, mv, seqs: list, req) -> tuple[list[dict], list[np.ndarray]]:
        """Batch the sequences; (the /predict outputs, the state after each sequence)."""
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

        def post(rows: list[dict]):
            out = inputs.shape_outputs(spec, rows, seqs, req.top_k, req.per_step,
                                       req.allow_unk)
            if req.return_state:
                for item, row in zip(out, rows, strict=True):
                    item["state"] = encode_state(mv.name, mv.version, row["state"])
            return out, [row["state"] for row in rows]
        return await batcher.submit(seqs, post)

    # -- Open Inference Protocol ------------------------------------------------------------

    async def infer(self, body: bytes, tail: bytes, name: str, version: str | None,
                    labels: dict) -> tuple[bytes, list[bytes]]:
        """An OIP inference request (JSON header ``body`` and binary ``tail``): the JSON
        answer and the binary output blobs. The request parameters ``sequence_id``,
        ``sequence_start`` and ``sequence_end`` (as tritonclient sends them) run it on a
        session."""
        req = inputs.fast_infer_request(body) or parse(InferenceRequest, body)
        for field, value, in_url in (("model_name", req.model_name, name),
                                     ("model_version", req.model_version, version)):
            if value is not None and in_url is not None and value != in_url:
                raise ClientError(f"{field}: the body names {value!r}, the URL {in_url!r}")
        binaries = inputs.binary_chunks(req, tail)
        params = req.parameters or {}
        if any(k in params for k in SEQUENCE_KEYS):
            session, start, end = self._sequence(params, name, version_param(version))
            result: dict = {}

            def read(mv) -> list:
                seqs, result["steps"] = self._infer_sequences(mv, req, binaries)
                return seqs

            async def run(mv, seqs, _req):
                result["answer"] = await self._infer_run(mv, req, seqs, result["steps"])
                return None, [result["answer"][1]["state"][0]]
            await self._session_chunk(session, req, labels, read, started=start, end=end,
                                      run=run)
            return self._infer_answer(session.mv, req, *result["answer"])
        with self.hold(labels, name, version_param(version)) as mv:
            seqs, steps = self._infer_sequences(mv, req, binaries)
            self._check_range(mv, seqs, "inputs[x]", labels)
            answer = await self._infer_run(mv, req, seqs, steps)
        return self._infer_answer(mv, req, *answer)

    def _sequence(self, params: dict, name: str, version: int | None):
        sid, start, end = (params.get(k) for k in SEQUENCE_KEYS)
        if isinstance(sid, bool) or not isinstance(sid, int | str) or sid in ("", 0):
            raise ClientError("parameters.sequence_id: required with sequence_start or "
                              "sequence_end, a non-zero integer or a non-empty string")
        for key, flag in (("sequence_start", start), ("sequence_end", end)):
            if flag is not None and not isinstance(flag, bool):
                raise ClientError(f"parameters.{key}: must be true or false")
        sid = str(sid)
        if start:
            return self.sessions.start(sid, name, version), True, bool(end)
        session = self.sessions.get(sid, name)
        if version is not None and version != session.mv.version:
            raise StateConflict(f"sequence {sid!r} runs on version {session.mv.version}, not "
                                f"{version}")
        return session, False, bool(end)

    def _infer_sequences(self, mv, req, binaries) -> tuple[list, int]:
        return inputs.infer_sequences(mv.spec, req, binaries, mv.spec.io["model"],
                                      self.settings.max_request_sequences)

    async def _infer_run(self, mv, req, seqs: list, steps: int) -> tuple[list[str], dict]:
        runtime = mv.runtime
        names = runtime.output_names["model"]
        wanted = [o.name for o in req.outputs] if req.outputs else names
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise ClientError(f"outputs: unknown output {unknown[0]!r}; the model has {names}")
        tensors = await mv.batcher.submit(
            seqs, lambda rows: inputs.outputs_to_tensors(rows, names, steps,
                                                         runtime.per_step["model"]))
        return wanted, tensors

    @staticmethod
    def _infer_answer(mv, req, wanted: list[str], tensors: dict) -> tuple[bytes, list[bytes]]:
        binary_all = bool((req.parameters or {}).get("binary_data_output"))
        binary = {o.name: bool((o.parameters or {}).get("binary_data", binary_all))
                  for o in req.outputs} if req.outputs else dict.fromkeys(wanted, binary_all)
        datatypes = {o["name"]: o["datatype"] for o in mv.spec.io["model"]["outputs"]}
        outputs, blobs = [], []
        for n in wanted:
            arr = tensors[n]
            item = {"name": n, "shape": list(arr.shape), "datatype": datatypes[n]}
            if binary[n]:
                blob = arr.astype(DATATYPES[datatypes[n]].numpy).tobytes()
                item["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                item["data"] = arr.reshape(-1)
            outputs.append(item)
        answer = {"model_name": mv.name, "model_version": str(mv.version), "outputs": outputs}
        if req.id is not None:
            answer["id"] = req.id
        return orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY), blobs
