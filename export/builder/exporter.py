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
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from orthornn.export.artifacts.numbers import is_integer, is_number
from orthornn.models import spectral_summary
from orthornn.models.cells import LSTMLayer
from orthornn.models.networks import SequenceModel
from orthornn.training.checkpoint import load_model, read_vocabulary
from orthornn.training.progress import progress_bar

from orthornn import __version__

from ..artifacts import gate, package, repository
from ..artifacts.loop import drift
from ..artifacts.package import INITIAL_LOGITS, INITIAL_STATE
from . import evaluation
from .onnx_export import MODES, build_graph
from .reference import build_reference

if TYPE_CHECKING:
    from orthornn.training.tasks import Task

MIN_OPSET, MAX_OPSET = 17, 21


def _golden_inputs(model: SequenceModel, config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """A padded batch of variable-length sequences for the full graph."""
    gen = torch.Generator().manual_seed(seed)
    steps = max(1, min(int(config["input_spec"].get("max_length") or 16), 16))
    lengths = torch.tensor([steps, max(1, steps - 3), 1, max(1, steps // 2)])
    if model.task == "lm":
        x = torch.randint(0, model.input_size, (4, steps), generator=gen)
        return {"tokens": x.numpy(), "lengths": lengths.numpy()}
    x = torch.randn(4, steps, model.input_size, generator=gen)
    return {"x": x.numpy(), "lengths": lengths.numpy()}


def _continued(feeds: dict, state_size: int, seed: int = 3) -> dict[str, np.ndarray]:
    """The same batch continuing from states: rows 1 and 3 from random ones, rows 0 and 2
    from zeros (the ``GRAPH@continued`` golden case)."""
    gen = torch.Generator().manual_seed(seed)
    initial = torch.randn(len(feeds["lengths"]), state_size, generator=gen) * 0.5
    initial[::2] = 0
    return {**feeds, INITIAL_STATE: initial.numpy()}


@torch.no_grad()
def _torch_outputs(model: SequenceModel, feeds: dict, graph: str) -> dict[str, np.ndarray]:
    """What torch computes for a graph's feeds: the golden outputs."""
    out_name = package.output_name(model.task)
    if graph == "step":
        out, last = model(torch.from_numpy(feeds["tokens"]), h0=torch.from_numpy(feeds["state"]),
                          return_state=True)
        return {out_name: out.numpy(), "next_state": last.numpy()}
    x = torch.from_numpy(feeds["tokens"] if model.task == "lm" else feeds["x"])
    h0 = torch.from_numpy(feeds[INITIAL_STATE]) if INITIAL_STATE in feeds else \
        torch.zeros(x.shape[0], model.state_size)
    lengths = torch.from_numpy(feeds["lengths"])
    if graph == "steps":  # classify / regress after every step
        states, last = model.encode(x, h0, lengths)
        return {out_name: model.head(states[..., : model.hidden_size]).numpy(),
                "state": last.numpy()}
    out, last = model(x, lengths=lengths, h0=h0, return_state=True)
    outputs = {out_name: out.numpy(), "state": last.numpy()}
    if model.task == "lm":
        outputs[INITIAL_LOGITS] = model.head(h0[:, : model.hidden_size]).numpy()
    return outputs


def choose_recurrence(model: SequenceModel, mode: str, opset: int) -> tuple[str, onnx.ModelProto]:
    """("lstm" | "scan", graph): ONNX's LSTM operator for the LSTM, else a Scan over one
    step. A fixed rule, so the same run always exports the same graph: ONNX's RNN
    operator was faster only at batch 1 (by at most 1.5x, 0.02 ms), and 2-7x slower at
    the batches the service's dynamic batching forms (bench/perf/recurrence.py, in
    docs/benchmarks.md)."""
    if isinstance(model.layer, LSTMLayer):
        return "lstm", build_graph(model, mode, opset=opset)
    return "scan", build_graph(model, mode, recurrence="scan", opset=opset)


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

    def __init__(self, path: Path) -> None:
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


def _threshold(min_metric: float | None, config: dict) -> gate.Threshold | None:
    """--min-metric, else the run's task baseline (a model must beat the trivial one)."""
    if min_metric is not None:
        return gate.Threshold(float(min_metric), "--min-metric", strict=False)
    if config.get("baseline") is not None:
        return gate.Threshold(float(config["baseline"]), "the task's baseline", strict=True)
    return None


def export_run(run_dir: str | Path, repo: str | Path, name: str, mode: str = "dense",
               opset: int = 18, progress: bool = False, *, gated: bool = False,
               min_metric: float | None = None, tolerance: float = 0.0,
               promote: bool = True, gate_data: str | Path | None = None,
               require_better: bool = False, gate_margin: float = gate.GATE_MARGIN) -> Path:
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
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    model, config = load_model(run_dir)
    model_dir = Path(repo) / name
    existing = published_version(model_dir, package.sha256(run_dir / "model.safetensors"),
                                 mode, opset)
    if existing is not None:
        raise AlreadyPublished(existing)
    if not hasattr(model, "layer"):
        raise ValueError(f"{model.arch} is not recurrent: export takes recurrent models only")

    stages = 4 if model.task == "lm" else 3
    bar = progress_bar(total=stages, desc=f"export {name}", unit="stage", enabled=progress)
    bar.set_postfix_str("graph")
    recurrence, graph = choose_recurrence(model, mode, opset)
    onnx.checker.check_model(graph, full_check=True)
    bar.update(1)
    bar.set_postfix_str("golden outputs")
    graphs = {"model": graph}
    if model.task in ("classify", "regress"):  # streaming labelling: an output per step
        graphs["steps"] = build_graph(model, mode, per_step=True, opset=opset,
                                      recurrence="scan")
        onnx.checker.check_model(graphs["steps"], full_check=True)
    feeds = _golden_inputs(model, config)
    golden = {}
    for key in graphs:  # each full graph from zeros, and continuing from states
        for case, case_feeds in ((key, feeds),
                                 (f"{key}@continued", _continued(feeds, model.state_size))):
            golden.update({f"{case}/{k}": v for k, v in case_feeds.items()})
            golden.update({f"{case}/{k}": v for k, v in
                           _torch_outputs(model, case_feeds, key).items()})
    bar.update(1)
    if model.task == "lm":
        bar.set_postfix_str("step graph")
        graphs["step"] = build_graph(model, mode, step=True, opset=opset)
        onnx.checker.check_model(graphs["step"], full_check=True)
        gen = torch.Generator().manual_seed(2)
        step_feeds = {"tokens": torch.randint(0, model.input_size, (4, 1), generator=gen).numpy(),
                      "state": torch.randn(4, model.state_size, generator=gen).numpy() * 0.5}
        golden.update({f"step/{k}": v for k, v in step_feeds.items()})
        golden.update({f"step/{k}": v for k, v in
                       _torch_outputs(model, step_feeds, "step").items()})
        bar.update(1)
    bar.set_postfix_str("evaluate, write, verify, publish")
    try:
        task, absent = evaluation.rebuild_task(config), None
    except ValueError as error:
        task, absent = None, str(error)
    held = None
    if task is not None:
        candidate = package.session_from_bytes(graph.SerializeToString())
        # several --data files: scored on the first's test split, the one earlier versions had
        record = evaluation.evaluate(candidate, evaluation.original(task))
        if gate_data is not None:
            held = evaluation.gate_data(task, gate_data)
            record["splits"] = {
                "test": {k: record[k] for k in ("value", "examples", "data_fingerprint")},
                "gate_data": {**{k: v for k, v in evaluation.evaluate(candidate, held).items()
                                 if k in ("value", "examples", "data_fingerprint")},
                              "file": str(gate_data)}}
    else:
        record = {"absent": absent}
        if gate_data is not None:
            raise ValueError(f"--gate-data: the run has no evaluation to gate on ({absent})")
    reference = None  # the drift reference, of the run's validation split (docs/drift.md)
    if task is not None:
        try:
            reference = build_reference(package.session_from_bytes(graph.SerializeToString()),
                                        task, model.state_size)
        except ValueError:  # too few validation sequences: the version measures no drift
            reference = None
    parent = repository.live_version(repository.versions(model_dir),
                                     repository.promoted(model_dir))
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    lineage: dict[str, Any] = {
        "config_sha256": evaluation.config_sha256(config),
        "train_data_fingerprint": None if task is None else evaluation.train_fingerprint(task),
        "orthornn_version": __version__,
        "source_revision": evaluation.source_revision(),
        "parent": parent,
        "created": created}
    learned = _learned(config)
    if learned is not None:  # the capture segments and labelled records the run learned from
        lineage["captures"] = learned
    refusal = ""
    if gated:
        refusal = _gate(record, task, absent, config, model_dir, parent, min_metric, tolerance)
        outcome: dict = {"passed": True, "against": parent}
        if not refusal and held is not None:
            refusal, outcome["gate_data"] = _gate_on_held(
                record, held, model_dir, parent, tolerance, require_better, gate_margin)
        if not refusal:  # what `orthornn rollout start` checks
            record = {**record, "gate": outcome}

    summary_path = run_dir / "summary.json"
    vocabulary = read_vocabulary(run_dir, config)

    def build(tmp: Path, version_number: int, verify: bool = True) -> None:
        files = {}
        for key, proto in graphs.items():
            filename = f"{key}.onnx"
            onnx.save(proto, tmp / filename)
            files[filename] = package.sha256(tmp / filename)
        np.savez(tmp / "golden.npz", **golden)  # type: ignore[arg-type]  # stub: allow_pickle
        files["golden.npz"] = package.sha256(tmp / "golden.npz")
        if vocabulary is not None:
            (tmp / "vocab.txt").write_text("\n".join(vocabulary) + "\n")
            files["vocab.txt"] = package.sha256(tmp / "vocab.txt")
        if reference is not None:
            drift.write(reference, tmp / drift.FILE)
            files[drift.FILE] = package.sha256(tmp / drift.FILE)
        io = {key: _io_spec(proto) for key, proto in graphs.items()}
        manifest = package.Manifest(
            name=name, version=version_number, arch=model.arch, task=model.task,
            task_name=config.get("task_name"), mode=mode, opset=opset, recurrence=recurrence,
            graphs={key: f"{key}.onnx" for key in graphs}, io=io,
            input_spec=package.InputSpec.from_dict(config["input_spec"]),
            output_spec=package.OutputSpec.for_task(model.task, model.num_outputs,
                                                    model.state_size),
            labels=config.get("labels"),
            vocabulary_file="vocab.txt" if vocabulary is not None else None,
            hidden_size=model.hidden_size, files=files, spectral=spectral_summary(model),
            preprocessing=config.get("preprocessing"), evaluation=record, lineage=lineage,
            reference=drift.FILE if reference is not None else None,
            training=json.loads(summary_path.read_text()) if summary_path.is_file() else None,
            source={"run_dir": str(run_dir.resolve()),
                    "checkpoint_sha256": package.sha256(run_dir / "model.safetensors")},
            created=created,
            orthornn_version=__version__)
        (tmp / "manifest.json").write_text(manifest.to_json())
        if verify:  # never publish what onnxruntime cannot reproduce
            package.verify_package(tmp)

    if refusal:
        # kept for a person to look at, as it is: a NaN model cannot pass the golden check
        kept = repository.keep_rejected(repo, name, lambda tmp, v: build(tmp, v, verify=False),
                                        {"refused": refusal, **lineage})
        bar.close()
        raise gate.GateRefused(refusal, kept)
    path = repository.publish(repo, name, build)
    value = record.get("value")
    reason = (f"{record['metric']} {value:.6g} on the test split" if value is not None
              else f"evaluation absent: {absent}")
    if record.get("splits"):
        reason += f", {record['splits']['gate_data']['value']:.6g} on the held-out captured slice"
    if promote:
        repository.promote(model_dir, int(path.name), "promote" if gated else "publish",
                           ("passed the gate: " if gated else "published: ") + reason)
    bar.update(1)
    bar.close()
    return path


def _gate(record: dict, task: Task | None, absent: str | None, config: dict, model_dir: Path,
          parent: int | None, min_metric: float | None, tolerance: float) -> str:
    """Why the candidate is refused ('' if it passes): the gate's rules on its evaluation
    and on the promoted version's, scored on the same test split."""
    if task is None:
        return f"no evaluation to gate on: {absent}"
    incumbent = _incumbent(model_dir, parent, evaluation.original(task))
    refusal = gate.check(record["metric"], record["higher_is_better"], record["value"],
                         _threshold(min_metric, config), incumbent, tolerance)
    split = "the original test split" if task.test_parts else "the test split"
    return f"on {split}: {refusal}" if refusal and record.get("splits") else refusal


def _incumbent(model_dir: Path, parent: int | None, task: Task) -> tuple[int, float] | None:
    """(version, score) of the promoted version on ``task``'s test split, through its graph."""
    if parent is None:
        return None
    try:
        return parent, evaluation.score(model_dir / str(parent), task)
    except (ValueError, package.PackageError) as error:
        raise ValueError(f"cannot compare with promoted version {parent}: {error}") from None


def _gate_on_held(record: dict, held: Task, model_dir: Path, parent: int | None,
                  tolerance: float, require_better: bool, margin: float) -> tuple[str, dict]:
    """The gate on the held-out captured slice (--gate-data): (why refused or '', what was
    compared, for the evaluation's "gate" record)."""
    value = record["splits"]["gate_data"]["value"]
    incumbent = _incumbent(model_dir, parent, held)
    metric, higher = record["metric"], record["higher_is_better"]
    refusal = gate.check(metric, higher, value, None, incumbent, tolerance)
    if not refusal and require_better:
        refusal = gate.check_better(metric, higher, value, incumbent, margin)
    where = f"on the held-out captured slice (--gate-data {record['splits']['gate_data']['file']})"
    outcome = {"candidate": value, "incumbent": None if incumbent is None else incumbent[1],
               "require_better": require_better, "margin": margin if require_better else None}
    return (f"{where}: {refusal}" if refusal else ""), outcome


def _learned(config: dict) -> dict | None:
    """The lineage's captures: the segments and labelled records of the run's data files
    (classify's --data, lm's --corpus) that came from ``orthornn capture dataset`` (None
    when none did, or the task takes no data files)."""
    from orthornn.training.tasks.user import provenance

    option = {"classify": "data", "lm": "corpus"}.get(str(config.get("task")))
    options = config.get("data")
    files = options.get(option) if option and isinstance(options, dict) else None
    return provenance(files) if files else None
