"""Build the ONNX graphs of a trained model (torch side of the export).

Graph inputs and outputs (B and T dynamic):
    classify / regress / seq2seq:  x float [B, T, d], lengths int64 [B]
    lm:                            tokens int64 [B, T], lengths int64 [B]
    full graphs also:              initial_state float [B, S], optional (zeros by default):
                                   the state to continue from (streaming)
    step graph (lm):               tokens int64 [B, 1], state float [B, S]
    outputs: "logits" (or "value" for regress) and "state" (the last state [B, S]); lm
    full graphs also "initial_logits" [B, V], the prediction the initial state gives.
Padded steps (t >= lengths[b]) never change a result, as in the torch model.

The recurrence is either ONNX's own RNN / LSTM operator (tanh, relu, leaky relu
without gates; lstm) or a ``Scan`` whose body is one step of models.ops' recurrence.
``mode`` decides where W comes from: ``dense`` stores the folded matrix as an
initializer; ``factored`` stores the parametrization's own parameters and builds W
in the graph with the ``ai.orthornn`` functions (export/builder/functions.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from orthornn.models.activations import Activation, check_kind
from orthornn.models.cells import LSTMLayer, Recurrence
from orthornn.models.networks import SequenceModel
from orthornn.models.parametrizations import (
    DenseTransition,
    HouseholderChain,
    PackedGivens,
    Parametrization,
    RotationPermutation,
    ScaledCayley,
    SVDForm,
)

from ..artifacts.package import INITIAL_LOGITS, INITIAL_STATE, output_name
from . import functions
from .graph import DOMAIN, IR_VERSION, Graph, value

MODES = ("dense", "factored")
RNN_ACTIVATIONS = {"tanh": "Tanh", "relu": "Relu", "leaky_relu": "LeakyRelu"}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


# -- where W comes from -------------------------------------------------------------------

# the ai.orthornn function (export/builder/functions.py) that rebuilds each parametrization's
# matrix() from its factors(), taken in the order factors() lists them
FUNCTIONS = {HouseholderChain: "HouseholderChain", PackedGivens: "PackedGivens",
             RotationPermutation: "RotationPermutation", ScaledCayley: "ScaledCayley"}
INT_FACTORS = {"order", "partner", "permutations", "upper_index"}


def factored_matrix(g: Graph, p: Parametrization, used: set[str]) -> str:
    """W [n, n] computed in the graph from p.factors(); ``used`` collects the
    ai.orthornn functions the graph calls."""
    factors = p.factors()
    if isinstance(p, DenseTransition):
        return g.const(_np(factors["weight"]), "W")
    if isinstance(p, SVDForm):  # U[:, :k] diag(s) V[:, :k]^T (square here: k = n)
        u = factored_matrix(g, factors["left"], used)
        v = factored_matrix(g, factors["right"], used)
        s = g.const(_np(factors["singular_values"]), "singular_values")
        return g.op("MatMul", g.op("Mul", u, s), g.op("Transpose", v, perm=[1, 0]))
    name = FUNCTIONS.get(type(p))
    if name is None:
        raise ValueError(f"no factored export for {type(p).__name__}")
    used.add(name)
    args = [g.const(_np(t), key, "int64" if key in INT_FACTORS else "float32")
            for key, t in factors.items()]
    return g.op(name, *args, domain=DOMAIN)


# -- the recurrence ---------------------------------------------------------------------

# the ONNX form of each activation kind of models.activations (keyed the same)
ACTIVATIONS: dict[str, Callable[[Graph, str, Activation], str]] = {
    "tanh": lambda body, z, act: body.op("Tanh", z),
    "relu": lambda body, z, act: body.op("Relu", z),
    "leaky_relu": lambda body, z, act: body.op("LeakyRelu", z, alpha=act.negative_slope),
    "abs": lambda body, z, act: body.op("Abs", z),
    # sign(z) relu(|z| + b)
    "modrelu": lambda body, z, act: body.op("Mul", body.op("Sign", z), body.op(
        "Relu", body.op("Add", body.op("Abs", z), body.const(_np(act.bias), "modrelu_bias")))),
}


def _activation(body: Graph, kind: str, z: str, act: Activation) -> str:
    return ACTIVATIONS[check_kind(kind)](body, z, act)


def _scan(g: Graph, layer: Recurrence, w_t: str, u: str, lengths: str, h0: str) -> tuple[str, str]:
    """Scan over time (axis 1) of one step of models.ops.rnn_scan: (every step's state
    [B, T, n], the state at each sequence's length [B, n]). The loop body is the step alone
    (one Gemm, the activation, the gates): padded steps run too, and the lengths are
    applied afterwards, once. Padded steps come after a sequence's last valid one, so they
    never reach its results; its steps past the length are zeroed by _zero_padded_steps
    where a graph outputs them."""
    body = Graph("step_")
    z = body.op("Gemm", "h_in", w_t, "u_t")  # h W^T + (W_in x_t + b), fused
    new = _activation(body, layer.activation.kind, z, layer.activation)
    if layer.gates is not None:
        a, b2 = (t.item() for t in layer.gates())
        new = body.op("Add", body.op("Mul", body.const(a, "a"), new),
                      body.op("Mul", body.const(b2, "b2"), "h_in"))
    # the step's last node writes h_out itself: one copy per step (for y_t), not two
    assert body.nodes[-1].output[0] == new
    body.nodes[-1].output[0] = "h_out"
    body.nodes.append(helper.make_node("Identity", ["h_out"], ["y_t"]))
    # Explicit shapes: onnxruntime needs them on Scan outputs when W comes from a function.
    n = layer.hidden_size
    graph = body.subgraph("recurrence_step",
                          [value("h_in", shape=["batch", n]), value("u_t", shape=["batch", n])],
                          [value("h_out", shape=["batch", n]), value("y_t", shape=["batch", n])])
    _, ys = g.op("Scan", h0, u, outputs=2, body=graph, num_scan_inputs=1,
                 scan_input_axes=[1], scan_output_axes=[1])
    steps = _time_steps(g, u)
    # the state after `length` steps: ys[:, length - 1], or h0 for length 0 (or less)
    length = g.op("Min", lengths, steps)
    one = g.const(1, "one", "int64")
    at = g.op("Max", g.op("Sub", length, one), g.const(0, "zero", "int64"))
    last = g.op("Where", g.op("Unsqueeze", g.op("LessOrEqual", length,
                                                g.const(0, "zero", "int64")),
                              g.const([1], "ax", "int64")),
                h0, g.op("GatherND", ys, g.op("Unsqueeze", at, g.const([1], "ax", "int64")),
                         batch_dims=1))
    return ys, last


def _time_steps(g: Graph, x: str) -> str:
    """T of x [B, T, ...], a scalar."""
    return g.op("Squeeze", g.op("Slice", g.op("Shape", x), g.const([1], "s", "int64"),
                                g.const([2], "e", "int64")), g.const([0], "ax", "int64"))


def _zero_padded_steps(g: Graph, ys: str, lengths: str) -> str:
    """ys [B, T, n] with the steps past each sequence's length set to zero."""
    steps = _time_steps(g, ys)
    valid = g.op("Less", g.op("Unsqueeze", g.op("Range", g.const(0, "zero", "int64"), steps,
                                                g.const(1, "one", "int64")),
                              g.const([0], "ax", "int64")),
                 g.op("Unsqueeze", lengths, g.const([1], "ax", "int64")))
    return g.op("Where", g.op("Unsqueeze", valid, g.const([2], "ax", "int64")), ys,
                g.const(0.0, "zero_f"))


def _rnn_op(g: Graph, layer: Recurrence, w: str, x: str, lengths32: str,
            h0: str) -> tuple[str, str]:
    """ONNX's RNN operator (ungated tanh / relu / leaky relu)."""
    act = layer.activation
    attrs: dict[str, Any] = {"activations": [RNN_ACTIVATIONS[act.kind]]}
    if act.kind == "leaky_relu":
        attrs["activation_alpha"] = [act.negative_slope]
    n = layer.hidden_size
    zero = g.const([0], "ax", "int64")
    w_in = g.const(_np(layer.input.weight)[None], "W_in")
    bias = g.const(np.concatenate([_np(layer.input.bias), np.zeros(n, np.float32)])[None], "B")
    y, y_h = g.op("RNN", g.op("Transpose", x, perm=[1, 0, 2]), w_in, g.op("Unsqueeze", w, zero),
                  bias, lengths32, g.op("Unsqueeze", h0, zero), outputs=2, hidden_size=n,
                  **attrs)
    states = g.op("Transpose", g.op("Squeeze", y, g.const([1], "ax", "int64")), perm=[1, 0, 2])
    return states, g.op("Squeeze", y_h, zero)


def _lstm(g: Graph, layer: LSTMLayer, x: str, lengths32: str, state: str) -> tuple[str, str]:
    lstm, n = layer.lstm, layer.hidden_size

    def reorder(t: torch.Tensor) -> np.ndarray:  # PyTorch gates (i, f, g, o) -> ONNX (i, o, f, c)
        i, f, c, o = np.split(_np(t), 4)
        return np.concatenate([i, o, f, c])
    zero = g.const([0], "ax", "int64")
    h0 = g.op("Slice", state, g.const([0], "s", "int64"), g.const([n], "e", "int64"),
              g.const([1], "ax", "int64"))
    c0 = g.op("Slice", state, g.const([n], "s", "int64"), g.const([2 * n], "e", "int64"),
              g.const([1], "ax", "int64"))
    y, y_h, y_c = g.op(
        "LSTM", g.op("Transpose", x, perm=[1, 0, 2]),
        g.const(reorder(lstm.weight_ih_l0)[None], "W"),
        g.const(reorder(lstm.weight_hh_l0)[None], "R"),
        g.const(np.concatenate([reorder(lstm.bias_ih_l0), reorder(lstm.bias_hh_l0)])[None], "B"),
        lengths32, g.op("Unsqueeze", h0, zero), g.op("Unsqueeze", c0, zero), outputs=3,
        hidden_size=n)
    states = g.op("Transpose", g.op("Squeeze", y, g.const([1], "ax", "int64")), perm=[1, 0, 2])
    last = g.op("Concat", g.op("Squeeze", y_h, zero), g.op("Squeeze", y_c, zero), axis=1)
    return states, last


# -- the model ------------------------------------------------------------------------------

def _recurrence(g: Graph, model: SequenceModel, mode: str, recurrence: str, per_step: bool,
                x: str, lengths: str, h0: str, used: set[str]) -> tuple[str, str]:
    """(the states of every step [B, T, S], zero past each length, or what the head reads
    of them; the last state [B, S]): ONNX's LSTM for an LSTM, its RNN operator where it
    can run the cell and RECURRENCE asks for it, else a Scan over one step; W dense or
    factored (MODE: ``ai.orthornn`` functions, their names added to USED)."""
    layer = model.layer
    lengths32 = g.op("Cast", lengths, to=TensorProto.INT32)
    if isinstance(layer, LSTMLayer):
        return _lstm(g, layer, x, lengths32, h0)
    p = layer.transition
    w = g.const(_np(p.matrix()), "W") if mode == "dense" else factored_matrix(g, p, used)
    usable_rnn = layer.gates is None and layer.activation.kind in RNN_ACTIVATIONS
    if recurrence == "rnn" and usable_rnn:
        return _rnn_op(g, layer, w, x, lengths32, h0)
    u = g.op("Add", g.op("MatMul", x, g.const(_np(layer.input.weight).T, "W_in_T")),
             g.const(_np(layer.input.bias), "b_in"))
    ys, last = _scan(g, layer, g.op("Transpose", w, perm=[1, 0]), u, lengths, h0)
    if model.task in ("classify", "regress") and not per_step:
        return ys, last  # classify/regress read `last` only
    return _zero_padded_steps(g, ys, lengths), last


def build_graph(model: SequenceModel, mode: str = "dense", *, step: bool = False,
                per_step: bool = False, recurrence: str = "scan",
                opset: int = functions.DEFAULT_OPSET) -> onnx.ModelProto:
    """The ONNX model of ``model`` (a models.networks.SequenceModel). ``per_step``:
    classify / regress graphs give their output after every time step [B, T, C] (the
    package's "steps" graph, for streaming labelling) instead of after the last."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if recurrence not in ("scan", "rnn"):
        raise ValueError(f"recurrence must be 'scan' or 'rnn'; got {recurrence!r}")
    if not hasattr(model, "layer"):
        raise ValueError(f"{model.arch} is not recurrent: export takes recurrent models only")
    task = model.task
    g, used = Graph(), set[str]()
    lm = task == "lm"
    x_in = value("tokens", TensorProto.INT64, ["batch", 1 if step else "time"]) if lm else \
        value("x", TensorProto.FLOAT, ["batch", "time", model.input_size])
    inputs = [x_in]
    x = x_in.name
    ones_shape = g.op("Slice", g.op("Shape", x), g.const([0], "s", "int64"),
                      g.const([1], "e", "int64"))
    batch_shape = ones_shape
    if step:  # one token per sequence: every length is 1
        lengths = g.op("Expand", g.const([1], "one", "int64"), batch_shape)
        inputs.append(value("state", TensorProto.FLOAT, ["batch", model.state_size]))
        h0 = "state"
    else:
        inputs.append(value("lengths", TensorProto.INT64, ["batch"]))
        lengths = "lengths"
        # the state to start from, [B, S]; optional: an input with a default (an
        # initializer of the same name) of zeros [1, S], broadcast to the batch
        inputs.append(value(INITIAL_STATE, TensorProto.FLOAT, ["state_batch",
                                                               model.state_size]))
        g.initializers.append(numpy_helper.from_array(
            np.zeros((1, model.state_size), np.float32), INITIAL_STATE))
        h0 = g.op("Expand", INITIAL_STATE, g.op("Concat", batch_shape, g.const(
            [model.state_size], "n", "int64"), axis=0))
    if lm:
        x = g.op("Gather", g.const(_np(model.embedding.weight), "embedding"), x, axis=0)

    states, last = _recurrence(g, model, mode, recurrence, per_step, x, lengths, h0, used)

    head_w = g.const(_np(model.head.weight).T, "head_W_T")
    head_b = g.const(_np(model.head.bias), "head_b")
    n = model.hidden_size

    def hidden(state: str) -> str:  # lstm: h of cat(h, c)
        return state if model.state_size == n else g.op(
            "Slice", state, g.const([0], "s", "int64"), g.const([n], "e", "int64"),
            g.const([1], "ax", "int64"))
    if task in ("classify", "regress") and not per_step:
        out = g.op("Add", g.op("MatMul", hidden(last), head_w), head_b)
        out_shape = ["batch", model.num_outputs]
    else:
        out = g.op("Add", g.op("MatMul", states, head_w), head_b)
        out_shape = ["batch", 1 if step else "time", model.num_outputs]
    out_name = output_name(task)
    g.nodes.append(helper.make_node("Identity", [out], [out_name]))
    g.nodes.append(helper.make_node("Identity", [last], ["state"] if not step else ["next_state"]))
    outputs = [value(out_name, TensorProto.FLOAT, out_shape),
               value("state" if not step else "next_state", TensorProto.FLOAT,
                     ["batch", model.state_size])]
    if lm and not step:  # the next-token logits the initial state gives: they score a
        # continued chunk's first token
        g.nodes.append(helper.make_node("Identity", [g.op("Add", g.op(
            "MatMul", hidden(h0), head_w), head_b)], [INITIAL_LOGITS]))
        outputs.append(value(INITIAL_LOGITS, TensorProto.FLOAT, ["batch", model.num_outputs]))
    suffix = "_step" if step else "_steps" if per_step else ""
    graph = helper.make_graph(g.nodes, f"{model.arch}_{task}{suffix}",
                              inputs, outputs, initializer=g.initializers)
    opsets = [helper.make_opsetid("", opset)]
    funcs = [functions.ALL[name](opset) for name in sorted(used)]
    if funcs:
        opsets.append(helper.make_opsetid(DOMAIN, 1))
    onnx_model = helper.make_model(graph, opset_imports=opsets, functions=funcs,
                                   ir_version=IR_VERSION, producer_name="orthornn")
    return onnx_model
