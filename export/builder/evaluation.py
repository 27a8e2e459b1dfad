"""A model package's score on its task's test split, through the exported graph.

What the service will run (onnxruntime on ``model.onnx``), not torch, is what is scored,
and the gate compares two packages on the same data this way. The metric is the one the
trainer reports in summary.json (``training.evaluation.evaluate``), computed in numpy:
accuracy (classify), MSE (regress), cross-entropy over every step (seq2seq, the copy
task), perplexity with the state carried across windows (lm).

Also the lineage's fingerprints: a hash of the run's resolved config and of its data.

A run on several data files (``--data ORIGINAL --data CAPTURED``, or ``--corpus`` for lm)
is scored on the first file's test split (``original``): the split every earlier version
was judged on, so the gate compares like with like; ``gate_data`` scores the held-out
captured slice the same way (``orthornn export --gate --gate-data``: an .npz, or for lm a
text corpus scored as perplexity).
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..artifacts import package
from ..artifacts.scoring import log_softmax

if TYPE_CHECKING:
    import onnxruntime as ort
    from orthornn.training.data import Split, TokenStream
    from orthornn.training.tasks import Task

HIGHER_IS_BETTER = {"accuracy": True, "mse": False, "cross_entropy": False,
                    "perplexity": False}
BATCH = 256


def rebuild_task(config: dict) -> Task:
    """The run's task with its data, from config.json; ValueError (with the reason) when
    the data cannot be rebuilt (e.g. a user's .npz that is gone)."""
    from orthornn.training.config import TrainConfig
    from orthornn.training.tasks import make_task

    known = {f.name for f in fields(TrainConfig)}
    train = TrainConfig(**{k: v for k, v in config["train"].items() if k in known})
    try:
        return make_task(train.task, **train.task_options())
    except (ValueError, OSError) as error:
        raise ValueError(f"the run's data cannot be rebuilt: {error}") from None


def original(task: Task) -> Task:
    """``task`` with its test split cut to the first data file's rows (a run on several
    --data files; the task itself otherwise)."""
    if not task.test_parts:
        return task
    import dataclasses

    import torch
    from orthornn.training.data import TokenStream
    from orthornn.training.tasks.language import token_stream

    if isinstance(task.test, TokenStream):  # lm: the first corpus's test tokens
        split: Split | TokenStream = token_stream(task.test.tokens[: task.test_parts[0]],
                                                  task.max_length)
    else:
        split = task.test.take(torch.arange(task.test_parts[0]))
    return dataclasses.replace(task, test=split)


def gate_data(task: Task, path: str | Path) -> Task:
    """``task`` with the held-out slice in ``path`` as its test split: for a classify run an
    .npz in the format ``train --data`` reads, for an lm run a text corpus in the format
    ``train --corpus`` reads (scored whole, by the run's vocabulary). ValueError when it does
    not fit the run (another feature size, other class names, a task that is neither)."""
    import dataclasses

    from orthornn.training.data import Split
    from orthornn.training.tasks import load_npz
    from orthornn.training.tasks.language import held_out

    if task.kind == "lm":
        if Path(path).suffix == ".npz":
            raise ValueError(f"--gate-data {str(path)!r}: an lm run takes a held-out text "
                             f"corpus (orthornn capture dataset on a language model's "
                             f"captures), not an .npz")
        try:
            stream = held_out(task, path)
        except ValueError as error:
            raise ValueError(f"--gate-data {str(path)!r}: {error}") from None
        return dataclasses.replace(task, test=stream, test_parts=None)
    if task.kind != "classify" or task.labels is None:
        raise ValueError(f"--gate-data takes a classify run's held-out .npz or an lm run's "
                         f"held-out text corpus; this run's task is {task.kind}")
    try:
        x, y, lengths, labels = load_npz(path)
    except ValueError as error:
        raise ValueError(f"--gate-data {str(path)!r}: a classify run takes a held-out .npz "
                         f"(orthornn capture dataset): {error}") from None
    if x.shape[2] != task.input_size:
        raise ValueError(f"--gate-data {str(path)!r}: feature size d = {x.shape[2]}; the "
                         f"run's is {task.input_size}")
    if int(y.max()) >= len(task.labels) or labels[: len(task.labels)] != task.labels[
            : len(labels)]:
        raise ValueError(f"--gate-data {str(path)!r}: class names {labels} differ from the "
                         f"run's {task.labels}")
    return dataclasses.replace(task, test=Split(x, y, lengths), test_parts=None)


def fingerprint(*arrays: Any) -> str:
    """sha256 of arrays (their dtype, shape and bytes), or of a JSON-able value."""
    digest = hashlib.sha256()
    for a in arrays:
        if a is None:
            digest.update(b"none")
            continue
        if not hasattr(a, "shape"):
            digest.update(json.dumps(a, sort_keys=True).encode())
            continue
        a = np.ascontiguousarray(a.numpy() if hasattr(a, "numpy") else a)
        digest.update(f"{a.dtype}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def split_fingerprint(split: Split | TokenStream) -> str:
    from orthornn.training.data import TokenStream

    if isinstance(split, TokenStream):
        return fingerprint(split.data)
    return fingerprint(split.x, split.y, split.lengths)


def train_fingerprint(task: Task) -> str:
    """The training data: a fixed split's arrays, lm's token ids, or for a generated task
    (a fresh seeded batch per step) the generator's options."""
    if task.train is None:
        return fingerprint({"generated": task.name, **task.options})
    if isinstance(task.train, list):
        return fingerprint(np.asarray(task.train, dtype=np.int64))
    return fingerprint(task.train.x, task.train.y, task.train.lengths)


def config_sha256(config: dict) -> str:
    """The run's resolved training options, minus where it was written and how many
    threads ran it (neither changes the result)."""
    train = {k: v for k, v in config["train"].items() if k not in ("out", "threads")}
    return fingerprint({**{k: v for k, v in config.items() if k != "train"}, "train": train})


def source_revision() -> str | None:
    """The git commit of the orthornn source that runs (``-dirty`` with uncommitted
    changes), when it runs from a checkout; None from an installed wheel."""
    try:
        result = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[2]),
                                 "describe", "--always", "--dirty", "--abbrev=40"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (result.stdout.strip() or None) if result.returncode == 0 else None


def score(package_dir: str | Path, task: Task) -> float:
    """The task's metric of a published package's full graph on the task's test split."""
    package_dir = Path(package_dir)
    manifest = package.read_manifest(package_dir)
    if manifest.task != task.kind:
        raise ValueError(f"{package_dir} is a {manifest.task} model; the run's task is "
                         f"{task.kind}")
    if manifest.input_spec.feature_size != task.input_size:
        raise ValueError(f"{package_dir} takes inputs of size {manifest.input_spec.feature_size}; "
                         f"the test split's are {task.input_size}")
    if task.vocabulary is not None and package.read_vocabulary(package_dir, manifest) not in (
            None, task.vocabulary):  # the same token ids must name the same words
        raise ValueError(f"{package_dir}'s vocabulary differs from the run's: its token ids "
                         f"name other words (train the candidate with the same first --corpus "
                         f"and --vocab-size)")
    return score_session(package.session(package_dir / manifest.graphs["model"]), task)


def score_session(sess: ort.InferenceSession, task: Task) -> float:
    """The task's metric of a full graph's onnxruntime session on the task's test split;
    NaN when the graph gives a non-finite output."""
    from orthornn.training.data import TokenStream

    out = package.output_name(task.kind)
    data = task.test
    if isinstance(data, TokenStream):
        total, count, state = 0.0, 0, None
        for x, y in data.windows():
            x = x.numpy().astype(np.int64)
            feeds = {"tokens": x, "lengths": np.full(len(x), x.shape[1], dtype=np.int64)}
            if state is not None:
                feeds[package.INITIAL_STATE] = state
            logits, state = sess.run([out, "state"], feeds)
            if not np.isfinite(logits).all():
                return math.nan
            nll = -np.take_along_axis(log_softmax(logits), y.numpy()[..., None], -1)
            total, count = total + float(nll.sum()), count + y.numel()
        return math.exp(min(total / count, 50.0))
    total, count = 0.0, 0
    for batch in data.batches(BATCH):
        x = batch.x.numpy().astype(np.float32)
        lengths = (np.full(len(x), x.shape[1], dtype=np.int64) if batch.lengths is None
                   else batch.lengths.numpy().astype(np.int64))
        (pred,) = sess.run([out], {"x": x, "lengths": lengths})
        if not np.isfinite(pred).all():
            return math.nan
        y = batch.y.numpy()
        if task.metric == "accuracy":
            total += float((pred.argmax(-1) == y).sum())
        elif task.metric == "mse":
            total += float(((pred.astype(np.float64) - y) ** 2).mean()) * len(y)
        else:  # cross_entropy (the copy task): every step, or the scored last ones
            steps = getattr(task, "scored_steps", None)
            if steps is not None:
                pred, y = pred[:, -steps:], y[:, -steps:]
            nll = -np.take_along_axis(log_softmax(pred), y[..., None], -1)
            total += float(nll.mean()) * len(y)
        count += len(y)
    return total / count


def evaluate(sess: ort.InferenceSession, task: Task) -> dict:
    """The manifest's ``evaluation`` record of a full graph's session on ``task``'s test
    split."""
    value = score_session(sess, task)
    return {"metric": task.metric, "value": value,
            "higher_is_better": HIGHER_IS_BETTER[task.metric], "split": "test",
            "examples": len(task.test) if hasattr(task.test, "__len__")
            else int(task.test.data.numel()),
            "data_fingerprint": split_fingerprint(task.test)}
