"""The labelled captures of a data set as rows of its task (``dataset``): a classifier's
sequences with a class index each (the class names from the versions' manifests, else as
the records' answers name them), a language model's input tokens followed by their
labelled next tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..package import Manifest

TASKS = ("classify", "lm")


@dataclass
class Labelled:
    """A captured record joined to its label (as service.loop.labels normalised it)."""

    id: str
    time: float
    version: int
    segment: str
    inputs: list[np.ndarray]
    label: Any
    outputs: Any


@dataclass
class Row:
    """One labelled sequence."""

    id: str
    time: float
    version: int
    segment: str
    x: np.ndarray  # classify: [T, d] float32; lm: the token ids, inputs then next tokens
    y: int = -1  # classify: the class index


def _is_tokens(x: np.ndarray) -> bool:
    return x.ndim == 1 and x.dtype.kind in "iu"


def task_of(joined: list[Labelled], manifests: dict[int, Manifest], model: str) -> str:
    """classify or lm: the manifests' task (--repo), else what the records hold (token ids:
    lm). ValueError for another task, versions of two tasks, or lm without --repo."""
    for v, manifest in manifests.items():
        if manifest.task not in TASKS:
            raise ValueError(f"model {model!r} version {v} is a {manifest.task} model; the "
                             f"data set is for {' and '.join(TASKS)} models")
    tasks = {m.task for m in manifests.values()}
    if len(tasks) > 1:
        raise ValueError(f"versions of {model!r} differ in their task ({', '.join(sorted(tasks))}"
                         f"); use --since to take one version's captures")
    if tasks:
        return tasks.pop()
    if joined and all(_is_tokens(x) for j in joined for x in j.inputs):
        raise ValueError(f"--repo: the captures of {model!r} are a language model's (token "
                         f"ids); the corpus is written in words, by the vocabulary of the "
                         f"version that answered: pass --repo REPO")
    return "classify"


def classify_rows(joined: list[Labelled], model: str) -> list[Row]:
    """A row per sequence: its float inputs [T, d] and its class index."""
    rows: list[Row] = []
    for j in joined:
        ys = j.label if isinstance(j.label, list) else [j.label]
        if len(ys) != len(j.inputs) or not all(isinstance(y, int) for y in ys) or \
                any(x.ndim != 2 or x.dtype.kind != "f" for x in j.inputs):
            raise ValueError(f"record {j.id!r} of model {model!r} is not a classifier's "
                             f"(float inputs [T, d], one class index per sequence)")
        rows.extend(Row(j.id, j.time, j.version, j.segment, x.astype(np.float32), int(y))
                    for x, y in zip(j.inputs, ys, strict=True))
    return rows


def lm_rows(joined: list[Labelled], model: str) -> list[Row]:
    """A row per sequence: its input tokens, then its labelled next tokens."""
    rows: list[Row] = []
    for j in joined:
        label = j.label
        nexts = [label] if isinstance(label, list) and all(
            isinstance(t, int) for t in label) else label
        if not isinstance(nexts, list) or len(nexts) != len(j.inputs) or not all(
                isinstance(n, list) and all(isinstance(t, int) for t in n) for n in nexts) \
                or not all(_is_tokens(x) for x in j.inputs):
            raise ValueError(f"record {j.id!r} of model {model!r} is not a language model's "
                             f"(token-id inputs [T], a list of next token ids per sequence)")
        rows.extend(Row(j.id, j.time, j.version, j.segment,
                         np.concatenate([x.astype(np.int64), np.asarray(n, np.int64)]))
                    for x, n in zip(j.inputs, nexts, strict=True))
    return rows


def _versions_class_names(rows_versions: set[int], manifests: dict[int, Manifest], model: str,
                 outputs: dict[int, dict[int, str]], sizes: dict[int, int]) -> list[str]:
    """The class names: from the manifests of the versions that answered (--repo), or from
    what the records' outputs named (``label``/``index`` pairs) without one."""
    if manifests:
        names: list[str] | None = None
        for v in sorted(rows_versions):
            manifest = manifests[v]
            found = [str(n) for n in manifest.labels or range(manifest.output_spec.size)]
            if names is not None and found != names:
                raise ValueError(f"versions of {model!r} differ in their "
                                 f"classes ({names} and {found} in version {v}); use --since "
                                 f"to take one version's captures")
            names = found
        return names or []
    size = max(sizes.values(), default=0)
    named: dict[int, str] = {}
    for pairs in outputs.values():
        named.update(pairs)
    return [named.get(i, str(i)) for i in range(size)]


def _output_classes(outputs: Any) -> tuple[int, dict[int, str]]:
    """(class count, index -> name) a captured answer shows: /predict's probabilities and
    label/index (and top-k) items, or the OIP logits tensor."""
    size, names = 0, {}
    if isinstance(outputs, list):
        for item in outputs:
            if not isinstance(item, dict):
                continue
            if isinstance(item.get("probabilities"), list):
                size = max(size, len(item["probabilities"]))
            for pair in [item, *(item.get("top_k") or [])]:
                if isinstance(pair, dict) and isinstance(pair.get("index"), int) and \
                        isinstance(pair.get("label"), str):
                    names[pair["index"]] = pair["label"]
    elif isinstance(outputs, dict) and isinstance(outputs.get("logits"), dict):
        shape = outputs["logits"].get("shape") or [0]
        size = int(shape[-1])
    return size, names


def class_names(joined: list[Labelled], rows: list[Row], manifests: dict[int, Manifest],
             model: str) -> list[str]:
    """The class names of a classifier's rows, every class index checked against them."""
    outputs: dict[int, dict[int, str]] = {}
    sizes: dict[int, int] = {}
    for j in joined:
        size, names = _output_classes(j.outputs)
        sizes[j.version] = max(sizes.get(j.version, 0), size)
        outputs.setdefault(j.version, {}).update(names)
    classes = _versions_class_names({r.version for r in rows}, manifests, model, outputs, sizes)
    if rows and max(r.y for r in rows) >= len(classes):
        raise ValueError(f"class index {max(r.y for r in rows)} outside the "
                         f"{len(classes)} classes of {model!r} (pass --repo to read them from "
                         f"the manifests)")
    widths = {r.x.shape[1] for r in rows}
    if len(widths) > 1:
        raise ValueError(f"the records of {model!r} differ in their feature "
                         f"size {sorted(widths)}; use --since to take one version's captures")
    return classes
