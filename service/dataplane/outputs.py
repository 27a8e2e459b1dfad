"""Answers from a model version's output rows (``ModelVersion.infer``), shaped on the event
loop once they are back: probabilities, top-k, per-step outputs and language-model scoring
for /predict, and the stacked output tensors of the Open Inference Protocol. The codecs only
serialise what these give."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from orthornn.export.artifacts.package import INITIAL_LOGITS
from orthornn.export.artifacts.scoring import log_softmax, softmax

from ..registry.batching import INDEX, LOG_PROBABILITIES, PROBABILITIES, prepare_rows
from ..registry.runtime import Chunk
from ..registry.spec import ModelSpec


def _label(spec: ModelSpec, i: int) -> str:
    return spec.labels[i] if spec.labels and i < len(spec.labels) else str(i)


def _classify_item(spec: ModelSpec, p: list[float], i: int, top_k: int | None) -> dict:
    item: dict[str, Any] = {"label": _label(spec, i), "index": i, "probabilities": p}
    if top_k:  # most likely first; ties keep the class order (a stable sort)
        best = sorted(range(len(p)), key=lambda j: -p[j])[:top_k]
        item["top_k"] = [{"label": _label(spec, j), "index": j, "probability": p[j]}
                         for j in best]
    return item


def _per_step_items(spec: ModelSpec, y: np.ndarray, top_k: int | None) -> list[dict]:
    """classify / regress outputs after every step (y [T, C] of the "steps" graph)."""
    if spec.task == "regress":
        return [{"value": float(v[0]) if v.size == 1 else v.tolist()}
                for v in y.astype(np.float64)]
    p = softmax(y.astype(np.float64))
    return [_classify_item(spec, row, i, top_k)
            for row, i in zip(p.tolist(), p.argmax(axis=-1).tolist(), strict=True)]


def shape_outputs(spec: ModelSpec, rows: list[dict], sequences: list,
                  top_k: int | None, per_step: bool = False, allow_unk: bool = False
                  ) -> list[dict]:
    """Per sequence, the /predict answer from its output rows. ``sequences``: arrays, or
    Chunks that continued from a state. Language models list no <unk> among next_tokens
    unless allow_unk."""
    if per_step:
        out = []
        for row in rows:
            steps = _per_step_items(spec, row[spec.output_name], top_k)
            out.append({**steps[-1], "steps": steps})
        return out
    if rows and spec.task in ("classify", "lm") and \
            PROBABILITIES not in rows[0] and LOG_PROBABILITIES not in rows[0]:
        prepare_rows(spec, rows)  # not batched through the batcher's prepare step
    out = []
    for row, seq in zip(rows, sequences, strict=True):
        if spec.task == "classify":
            out.append(_classify_item(spec, row[PROBABILITIES], row[INDEX], top_k))
            continue
        y = row[spec.output_name]
        if spec.task == "regress":
            y = y.astype(np.float64)
            item = {"value": float(y[0]) if y.size == 1 else y.tolist()}
        elif spec.task == "seq2seq":
            idx = np.argmax(y, axis=-1)
            item = {"indices": idx.tolist(), "labels": [_label(spec, int(j)) for j in idx]}
        else:  # lm: y [T, V]; position t predicts token t + 1
            tokens = seq.data if isinstance(seq, Chunk) else seq
            logp = row[LOG_PROBABILITIES]
            scored = len(tokens) - 1
            ll = float(logp[np.arange(scored), tokens[1:]].sum()) if scored else 0.0
            if isinstance(seq, Chunk) and seq.state is not None and INITIAL_LOGITS in row:
                # a continued chunk: its first token is predicted by the state it continues
                ll += float(log_softmax(row[INITIAL_LOGITS].astype(np.float64))[tokens[0]])
                scored += 1
            p = np.exp(logp[-1])
            rank = -p
            if not allow_unk and spec.unk_id is not None:
                rank[spec.unk_id] = np.inf  # last: never among the top k
            best = np.argsort(rank, kind="stable")[:min(top_k or 5, len(p) - (not allow_unk))]
            vocab = spec.vocabulary or []
            item = {"next_tokens": [{"token": vocab[j], "id": int(j),
                                     "probability": float(p[j])} for j in best],
                    "log_likelihood": ll,
                    "perplexity": math.exp(-ll / scored) if scored else None,
                    "tokens": scored}
        out.append(item)
    return out


def outputs_to_tensors(rows: list[dict], names: list[str], steps: int,
                       per_step: set[str]) -> dict[str, np.ndarray]:
    """Stack the named outputs of per-sequence rows back into [B, ...] tensors; time-axis
    outputs are padded to the request's T with zeros past each sequence's length."""
    out = {}
    for name in names:
        if name in per_step:
            first = rows[0][name]
            arr = np.zeros((len(rows), steps, *first.shape[1:]), dtype=first.dtype)
            for i, r in enumerate(rows):
                arr[i, :len(r[name])] = r[name]
        elif len(rows) == 1:  # a view: np.stack's copy of one row costs 3 us
            arr = rows[0][name][None]
        else:
            arr = np.stack([r[name] for r in rows])
        out[name] = arr
    return out
