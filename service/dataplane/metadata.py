"""Server and model metadata: the OIP metadata, readiness and Triton's model configuration
of the loaded versions."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

from orthornn.export.artifacts.package import TensorSpec

from ..errors import NotFound
from ..registry.registry import Registry
from ..settings import Settings
from .checks import version_param
from .messages import Document, Served


def server_version() -> str:
    try:
        return dist_version("orthornn")
    except PackageNotFoundError:
        return "0+unknown"



class Metadata:
    def __init__(self, settings: Settings, registry: Registry):
        self.settings, self.registry = settings, registry

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
        plan = self.registry.rollouts.plan(name)
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
