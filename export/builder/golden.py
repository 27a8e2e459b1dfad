"""A run's graphs and their golden outputs: the model's graph (and the per-step graph of a
classifier or regressor, the one-step graph of a language model), checked by onnx, and
torch's outputs on inputs that include padded variable-length sequences and states to
continue from, which the package's golden check compares onnxruntime against."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch
from orthornn.models.cells import LSTMLayer
from orthornn.models.networks import SequenceModel

from ..artifacts import package
from ..artifacts.package import INITIAL_LOGITS, INITIAL_STATE
from .onnx_export import build_graph


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


def graphs_and_golden(model: SequenceModel, config: dict, mode: str, opset: int, bar: Any
                      ) -> tuple[str, dict[str, onnx.ModelProto], dict[str, np.ndarray]]:
    """(the recurrence, the graphs by key, the golden arrays), each stage shown on BAR."""
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
    return recurrence, graphs, golden
