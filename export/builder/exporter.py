"""``export_run``: a training run directory -> a verified model package in a repository.

Steps: rebuild the model from RUN_DIR, build its ONNX graph(s) (dense or factored; a
Scan over one step, or ONNX's LSTM operator: a fixed rule, so an export is
reproducible), compute golden outputs with torch on inputs that include padded
variable-length sequences, evaluate the graph on the task's test split, record the drift
reference of its validation split (``reference``), write the manifest, verify the package
with onnxruntime, and publish it by one atomic rename.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from orthornn.export.artifacts.numbers import is_integer, is_number
from orthornn.models import spectral_summary
from orthornn.models.networks import SequenceModel
from orthornn.training.checkpoint import load_model, read_vocabulary
from orthornn.training.progress import progress_bar

from orthornn import __version__

from ..artifacts import gate, package, repository
from ..artifacts.loop import drift
from . import evaluation, gating
from .golden import graphs_and_golden
from .onnx_export import MODES
from .reference import build_reference

if TYPE_CHECKING:
    from orthornn.training.tasks import Task

MIN_OPSET, MAX_OPSET = 17, 21



def _io_spec(proto: onnx.ModelProto) -> package.GraphIO:
    def spec(v: onnx.ValueInfoProto, optional: bool = False) -> package.TensorSpec:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        return package.TensorSpec(v.name, package.ONNX_DATATYPES[t.elem_type].name, dims,
                                  optional)
    defaulted = {t.name for t in proto.graph.initializer}  # inputs with a default value
    return package.GraphIO([spec(v, v.name in defaulted) for v in proto.graph.input],
                           [spec(v) for v in proto.graph.output])


class AlreadyPublished(Exception):
    """The run's kept checkpoint is already published with the same mode and opset:
    nothing new is published (``path`` is that version)."""

    def __init__(self, path: repository.Location) -> None:
        super().__init__(f"{path} already holds this checkpoint (same weights, mode and "
                         f"opset): nothing published")
        self.path = path


def published_version(model_dir: Path, checkpoint_sha256: str, mode: str,
                      opset: int) -> Path | None:
    """The version of model_dir exported from these exact weights with this mode and
    opset, if any (a retrain that kept the old checkpoint, or an export run twice)."""
    for version in reversed(repository.versions(model_dir)):
        try:
            manifest = package.read_manifest(model_dir / str(version))
        except package.PackageError:
            continue
        if ((manifest.source or {}).get("checkpoint_sha256") == checkpoint_sha256
                and manifest.mode == mode and manifest.opset == opset):
            return model_dir / str(version)
    return None


def _number(name: str, value: Any, low: float | None = None) -> None:
    if value is None:
        return
    if not (is_number(value) and (low is None or value >= low)):
        where = f" >= {low:g}" if low is not None else ""
        raise ValueError(f"{name} must be a finite number{where}; got {value!r}")



def export_run(run_dir: str | Path, repo: str | Path, name: str, mode: str = "dense",
               opset: int = 18, progress: bool = False, *, gated: bool = False,
               min_metric: float | None = None, tolerance: float = 0.0,
               promote: bool = True, gate_data: str | Path | None = None,
               require_better: bool = False, gate_margin: float = gate.GATE_MARGIN
               ) -> repository.Location:
    """Publish RUN_DIR's best model as REPO/NAME/<next version>/ and return its path.
    progress: report the stages (a bar on a terminal, else a line every few seconds).
    Raises AlreadyPublished when a version holds the same checkpoint already.

    The package records its evaluation on the task's test split (through the exported
    graph) and its lineage. gated: publish only if the candidate passes the gate (export
    .gate: --min-metric or the task's baseline, and no worse than the promoted version by
    more than ``tolerance``), else keep it under REPO/NAME/rejected/ and raise
    GateRefused. A passed gate is recorded in the evaluation ("gate"). Either way a
    published version becomes the promoted one, unless ``promote`` is False (a rollout
    takes it live, or a person does).

    gate_data: a held-out slice (``orthornn capture dataset``'s newest labelled one: an
    .npz, or a text corpus for lm): the candidate is also judged on it against the promoted
    version, both through their own graphs (no worse beyond ``tolerance``; with
    ``require_better``, better by at least ``gate_margin``), and the evaluation records both
    splits ("splits")."""
    _check_arguments(name, mode, opset, gated, min_metric, tolerance, gate_data,
                     require_better, gate_margin)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    model, config = load_model(run_dir)
    location = repository.model_location(repo, name)
    # the version the candidate is judged against and its lineage's parent; in a bucket,
    # the only version read whole (of the others, the manifests)
    parent = repository.live_version(repository.versions(location),
                                     repository.promoted(location))
    with repository.local_model(location, whole=lambda v: v == parent) as model_dir:
        existing = published_version(model_dir, package.sha256(run_dir / "model.safetensors"),
                                     mode, opset)
        if existing is not None:
            raise AlreadyPublished(_in(location, existing))
        if not hasattr(model, "layer"):
            raise ValueError(f"{model.arch} is not recurrent: export takes recurrent models "
                             f"only")
        bar = progress_bar(total=4 if model.task == "lm" else 3, desc=f"export {name}",
                           unit="stage", enabled=progress)
        recurrence, graphs, golden = graphs_and_golden(model, config, mode, opset, bar)
        bar.set_postfix_str("evaluate, write, verify, publish")
        task, absent, record, held = _evaluate(config, graphs["model"], gate_data)
        contents = _Contents(
            name=name, run_dir=run_dir, model=model, config=config, mode=mode, opset=opset,
            recurrence=recurrence, graphs=graphs, golden=golden,
            vocabulary=read_vocabulary(run_dir, config),
            reference=_reference(task, graphs["model"], model.state_size, held),
            lineage=_lineage(config, task, parent), record=record)
        refusal = ""
        if gated:
            refusal, contents.record = gating.judge(
                record, task, absent, config, model_dir, parent, held, min_metric, tolerance,
                require_better, gate_margin)
    if refusal:
        # kept for a person to look at, as it is: a NaN model cannot pass the golden check
        kept = repository.keep_rejected(
            repo, name, lambda tmp, v: contents.write(tmp, v, verify=False),
            {"refused": refusal, **contents.lineage})
        bar.close()
        raise gate.GateRefused(refusal, kept)
    path = repository.publish(repo, name, contents.write)
    if promote:
        repository.promote(location, repository.version_of(path),
                           "promote" if gated else "publish",
                           ("passed the gate: " if gated else "published: ")
                           + _reason(record, absent))
    bar.update(1)
    bar.close()
    return path


def _in(location: repository.Location, version_dir: Path) -> repository.Location:
    """VERSION_DIR (a folder of the model's local copy) as a version of LOCATION."""
    if isinstance(location, Path):
        return version_dir
    return f"{location}/{version_dir.name}"


def _check_arguments(name: str, mode: str, opset: int, gated: bool, min_metric: float | None,
                     tolerance: float, gate_data: str | Path | None, require_better: bool,
                     gate_margin: float) -> None:
    """ValueError naming the argument (the flag) for a bad or inconsistent one."""
    repository.check_name(name)
    _number("min_metric", min_metric)
    _number("tolerance", tolerance, 0.0)
    if not gated and (min_metric is not None or tolerance):
        raise ValueError("--min-metric and --tolerance apply only with --gate")
    _number("gate_margin", gate_margin, 0.0)
    if not gated and (gate_data is not None or require_better):
        raise ValueError("--gate-data and --require-better-on-gate-data apply only with --gate")
    if require_better and gate_data is None:
        raise ValueError("--require-better-on-gate-data needs --gate-data HOLDOUT (the "
                         "captured slice the candidate must be better on)")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not is_integer(opset) or not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset must be an integer in [{MIN_OPSET}, {MAX_OPSET}]; got {opset!r}")


def _evaluate(config: dict, graph: onnx.ModelProto, gate_data: str | Path | None
              ) -> tuple[Task | None, str | None, dict, Task | None]:
    """(the run's task or None, why it cannot be rebuilt, the evaluation record, the
    held-out captured slice of --gate-data): the graph scored on the task's test split
    (several --data files: the first's, the one earlier versions had) and on the slice."""
    try:
        task, absent = evaluation.rebuild_task(config), None
    except ValueError as error:
        task, absent = None, str(error)
    if task is None:
        if gate_data is not None:
            raise ValueError(f"--gate-data: the run has no evaluation to gate on ({absent})")
        return None, absent, {"absent": absent}, None
    candidate = package.session_from_bytes(graph.SerializeToString())
    record = evaluation.evaluate(candidate, evaluation.original(task))
    held = None
    if gate_data is not None:
        held = evaluation.gate_data(task, gate_data)
        record["splits"] = {
            "test": {k: record[k] for k in ("value", "examples", "data_fingerprint")},
            "gate_data": {**{k: v for k, v in evaluation.evaluate(candidate, held).items()
                             if k in ("value", "examples", "data_fingerprint")},
                          "file": str(gate_data)}}
    return task, absent, record, held


def _reference(task: Task | None, graph: onnx.ModelProto, state_size: int,
               held: Task | None) -> drift.Reference | None:
    """The drift reference of the run's validation split and of HELD, the captured slice
    it was gated on (docs/drift.md); None without a task or with too few sequences (the
    version then measures no drift)."""
    if task is None:
        return None
    try:
        return build_reference(package.session_from_bytes(graph.SerializeToString()), task,
                               state_size, held)
    except ValueError:
        return None


def _lineage(config: dict, task: Task | None, parent: int | None) -> dict[str, Any]:
    lineage: dict[str, Any] = {
        "config_sha256": evaluation.config_sha256(config),
        "train_data_fingerprint": None if task is None else evaluation.train_fingerprint(task),
        "orthornn_version": __version__,
        "source_revision": evaluation.source_revision(),
        "parent": parent,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    learned = _learned(config)
    if learned is not None:  # the capture segments and labelled records the run learned from
        lineage["captures"] = learned
    return lineage


def _reason(record: dict, absent: str | None) -> str:
    """The promotion's reason: the scores the version was published on."""
    value = record.get("value")
    reason = (f"{record['metric']} {value:.6g} on the test split" if value is not None
              else f"evaluation absent: {absent}")
    if record.get("splits"):
        reason += f", {record['splits']['gate_data']['value']:.6g} on the held-out captured slice"
    return reason


@dataclass
class _Contents:
    """Everything a package holds, written into a folder by ``write`` (the repository's
    publish and keep_rejected call it with the folder and the version number)."""

    name: str
    run_dir: Path
    model: SequenceModel
    config: dict
    mode: str
    opset: int
    recurrence: str
    graphs: dict[str, onnx.ModelProto]
    golden: dict[str, np.ndarray]
    vocabulary: list[str] | None
    reference: drift.Reference | None
    lineage: dict[str, Any]
    record: dict

    def write(self, tmp: Path, version_number: int, verify: bool = True) -> None:
        files = {}
        for key, proto in self.graphs.items():
            onnx.save(proto, tmp / f"{key}.onnx")
            files[f"{key}.onnx"] = package.sha256(tmp / f"{key}.onnx")
        np.savez(tmp / "golden.npz", **self.golden)  # type: ignore[arg-type]  # stub: allow_pickle
        files["golden.npz"] = package.sha256(tmp / "golden.npz")
        if self.vocabulary is not None:
            (tmp / "vocab.txt").write_text("\n".join(self.vocabulary) + "\n")
            files["vocab.txt"] = package.sha256(tmp / "vocab.txt")
        if self.reference is not None:
            drift.write(self.reference, tmp / drift.FILE)
            files[drift.FILE] = package.sha256(tmp / drift.FILE)
        (tmp / "manifest.json").write_text(self._manifest(version_number, files).to_json())
        if verify:  # never publish what onnxruntime cannot reproduce
            package.verify_package(tmp)

    def _manifest(self, version_number: int, files: dict[str, str]) -> package.Manifest:
        model, config, summary_path = self.model, self.config, self.run_dir / "summary.json"
        return package.Manifest(
            name=self.name, version=version_number, arch=model.arch, task=model.task,
            task_name=config.get("task_name"), mode=self.mode, opset=self.opset,
            recurrence=self.recurrence, graphs={key: f"{key}.onnx" for key in self.graphs},
            io={key: _io_spec(proto) for key, proto in self.graphs.items()},
            input_spec=package.InputSpec.from_dict(config["input_spec"]),
            output_spec=package.OutputSpec.for_task(model.task, model.num_outputs,
                                                    model.state_size),
            labels=config.get("labels"),
            vocabulary_file="vocab.txt" if self.vocabulary is not None else None,
            hidden_size=model.hidden_size, files=files, spectral=spectral_summary(model),
            preprocessing=config.get("preprocessing"), evaluation=self.record,
            lineage=self.lineage, reference=drift.FILE if self.reference is not None else None,
            training=json.loads(summary_path.read_text()) if summary_path.is_file() else None,
            source={"run_dir": str(self.run_dir.resolve()),
                    "checkpoint_sha256": package.sha256(self.run_dir / "model.safetensors")},
            created=self.lineage["created"], orthornn_version=__version__)


def _learned(config: dict) -> dict | None:
    """The lineage's captures: the segments and labelled records of the run's data files
    (classify's --data, lm's --corpus) that came from ``orthornn capture dataset`` (None
    when none did, or the task takes no data files)."""
    from orthornn.training.tasks.user import provenance

    option = {"classify": "data", "lm": "corpus"}.get(str(config.get("task")))
    options = config.get("data")
    files = options.get(option) if option and isinstance(options, dict) else None
    return provenance(files) if files else None
