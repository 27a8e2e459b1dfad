"""The ``ai.orthornn`` operators of the factored export: ONNX model-local functions
whose bodies use only standard operators, so stock onnxruntime runs them.

Each turns a transition's own parameters into the dense matrix W once per call:
    HouseholderChain(Y [n, m]) -> H_0 H_1 ... H_{m-1}            (Spectral-RNN eq. 2, 6)
    PackedGivens(angles, order, partner) -> P_1 ... P_k           (DizzyRNN 4.2)
    RotationPermutation(angles, order, partner, perms) -> R_1 Q_1 ... R_k Q_k   (VPRNN)
    ScaledCayley(skew, upper_index, D) -> (I + A)^{-1} (I - A) D  (scoRNN Thm 3.1)
The formulas are the ones of ``models.parametrizations``; the tests check each
function against the parametrization's ``matrix()``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from .graph import DOMAIN, Graph, value

DEFAULT_OPSET = 18


def _function(name: str, inputs: list[str], outputs: list[str], g: Graph,
              opset: int) -> onnx.FunctionProto:
    # Constants inside a function must be Constant nodes, not initializers.
    nodes = [helper.make_node("Constant", [], [t.name], value=t) for t in g.initializers] + g.nodes
    return helper.make_function(DOMAIN, name, inputs, outputs, nodes,
                                opset_imports=[helper.make_opsetid("", opset)])


def _identity_like(g: Graph, ref: str, axis: int) -> str:
    """I [n, n] with n = ref.shape[axis]."""
    n = g.op("Gather", g.op("Shape", ref), g.const([axis], "axis", "int64"), axis=0)
    square = g.op("Concat", n, n, axis=0)
    return g.op("EyeLike", g.op("ConstantOfShape", square,
                                value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0])))


def _row_update(body: Graph, m: str, coef: str, a: str, b: str) -> str:
    """m - coef * outer(a, b)."""
    outer = body.op("Mul", body.op("Unsqueeze", a, body.const([1], "ax", "int64")),
                    body.op("Unsqueeze", b, body.const([0], "ax", "int64")))
    return body.op("Sub", m, body.op("Mul", coef, outer))


def _matrix_loop(g: Graph, body: Graph, name: str, new: str, trips: str, init: str) -> None:
    """W = Loop(trips) over a body that maps the carried matrix M_in (iteration i) to
    ``new``."""
    body.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body.nodes.append(helper.make_node("Identity", [new], ["M_out"]))
    loop_body = body.subgraph(name, [value("i", TensorProto.INT64, []),
                                     value("cond_in", TensorProto.BOOL, []), value("M_in")],
                              [value("cond_out", TensorProto.BOOL, []), value("M_out")])
    g.nodes.append(helper.make_node("Loop", [trips, "", init], ["W"], body=loop_body))


def householder_chain(opset: int) -> onnx.FunctionProto:
    """Compact WY without a triangular solve (ONNX has none): H_0 ... H_{m-1} =
    I - Y T Y^T with T^{-1} = D + N, D = diag(||y_i||^2 / 2), N = striu(Y^T Y). As
    X = -D^{-1} N is nilpotent, (I - X)^{-1} = (I + X)(I + X^2)(I + X^4)... exactly,
    after ceil(log2 m) factors: a short Loop of m x m products instead of one
    iteration per reflector. The products run in float64, where the repeated squaring
    loses nothing that float32 would keep."""
    g = Graph("hc_")
    y = g.op("Cast", "Y", to=TensorProto.DOUBLE)
    gram = g.op("MatMul", g.op("Transpose", y, perm=[1, 0]), y)
    eye_m = g.op("EyeLike", gram)
    half = g.op("Div", g.op("ReduceSum", g.op("Mul", gram, eye_m),
                            g.const([1], "ax", "int64"), keepdims=0),
                g.const(2.0, "two", "float64"))
    zero = g.const(0.0, "zero", "float64")
    half = g.op("Where", g.op("Greater", half, zero), half, g.const(1.0, "one", "float64"))
    # a zero reflector (the identity, eq. 1) has a zero column in Y: any diagonal works
    x = g.op("Neg", g.op("Div", g.op("Trilu", gram, g.const(1, "k", "int64"), upper=1),
                         g.op("Unsqueeze", half, g.const([1], "ax", "int64"))))
    m = g.op("Gather", g.op("Shape", "Y"), g.const(1, "axis", "int64"), axis=0)
    trips = g.op("Max", g.op("Cast", g.op("Ceil", g.op("Div", g.op(
        "Log", g.op("Cast", m, to=TensorProto.DOUBLE)), g.const(np.log(2.0), "ln2", "float64"))),
        to=TensorProto.INT64), g.const(1, "one_i", "int64"))
    body = Graph("hcb_")
    body.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body.nodes.append(helper.make_node("MatMul", ["P_in", body.op("Add", eye_m, "X_in")],
                                       ["P_out"]))
    body.nodes.append(helper.make_node("MatMul", ["X_in", "X_in"], ["X_out"]))
    double = TensorProto.DOUBLE
    loop_body = body.subgraph("neumann_factor",
                              [value("i", TensorProto.INT64, []),
                               value("cond_in", TensorProto.BOOL, []),
                               value("P_in", double), value("X_in", double)],
                              [value("cond_out", TensorProto.BOOL, []),
                               value("P_out", double), value("X_out", double)])
    g.nodes.append(helper.make_node("Loop", [trips, "", eye_m, x], ["P", "X_last"],
                                    body=loop_body))
    t = g.op("Div", "P", g.op("Unsqueeze", half, g.const([0], "ax", "int64")))
    ytyt = g.op("MatMul", g.op("MatMul", y, t), g.op("Transpose", y, perm=[1, 0]))
    eye_n = g.op("Cast", _identity_like(g, "Y", 0), to=TensorProto.DOUBLE)
    g.nodes.append(helper.make_node("Cast", [g.op("Sub", eye_n, ytyt)], ["W"],
                                    to=TensorProto.FLOAT))
    return _function("HouseholderChain", ["Y"], ["W"], g, opset)


def _rotations(name: str, permuted: bool, opset: int) -> onnx.FunctionProto:
    g = Graph("rot_")
    c, s = g.op("Cos", "angles"), g.op("Sin", "angles")
    # per-coordinate coefficients (models.parametrizations.givens.pair_coefficients)
    cos = g.op("GatherElements", g.op("Concat", c, c, axis=1), "order", axis=1)
    sin = g.op("GatherElements", g.op("Concat", s, g.op("Neg", s), axis=1), "order", axis=1)
    eye = _identity_like(g, "order", 1)
    trips = g.op("Gather", g.op("Shape", "order"), g.const(0, "axis", "int64"), axis=0)
    last = g.op("Sub", trips, g.const(1, "one", "int64"))
    body = Graph("rotb_")
    # rows j = k-1 .. 0: M <- R_j Q_j M, with (R x)[r] = cos[r] x[r] + sin[r] x[partner[r]]
    j = body.op("Sub", last, "i")
    m = "M_in"
    if permuted:
        m = body.op("Gather", m, body.op("Gather", "perms", j, axis=0), axis=0)
    col = body.const([1], "ax", "int64")
    cj = body.op("Unsqueeze", body.op("Gather", cos, j, axis=0), col)
    sj = body.op("Unsqueeze", body.op("Gather", sin, j, axis=0), col)
    swapped = body.op("Gather", m, body.op("Gather", "partner", j, axis=0), axis=0)
    new = body.op("Add", body.op("Mul", cj, m), body.op("Mul", sj, swapped))
    _matrix_loop(g, body, "rotation_step", new, trips, eye)
    inputs = ["angles", "order", "partner"] + (["perms"] if permuted else [])
    return _function(name, inputs, ["W"], g, opset)


def packed_givens(opset: int) -> onnx.FunctionProto:
    return _rotations("PackedGivens", False, opset)


def rotation_permutation(opset: int) -> onnx.FunctionProto:
    return _rotations("RotationPermutation", True, opset)


def scaled_cayley(opset: int) -> onnx.FunctionProto:
    g = Graph("cay_")
    n = g.op("Shape", "D")
    square = g.op("Concat", n, n, axis=0)
    flat = g.op("ConstantOfShape", g.op("Mul", n, n),
                value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0.0]))
    upper = g.op("Reshape", g.op("ScatterElements", flat, "upper_index", "skew", axis=0), square)
    a = g.op("Sub", upper, g.op("Transpose", upper, perm=[1, 0]))
    eye = g.op("EyeLike", a)
    left, right = g.op("Add", eye, a), g.op("Sub", eye, a)
    size = g.op("Squeeze", n, g.const([0], "ax", "int64"))
    positions = g.op("Range", g.const(0, "zero", "int64"), size, g.const(1, "one", "int64"))
    body = Graph("cayb_")
    # Gauss-Jordan elimination of (I + A) X = (I - A). I + A has the positive definite
    # symmetric part I, so elimination without pivoting is safe.
    col = body.const([1], "ax", "int64")
    pivot = body.op("Gather", body.op("Gather", "L_in", "k", axis=0), "k", axis=0)
    row_l = body.op("Div", body.op("Gather", "L_in", "k", axis=0), pivot)
    row_r = body.op("Div", body.op("Gather", "R_in", "k", axis=0), pivot)
    factor = body.op("Gather", "L_in", "k", axis=1)
    one = body.const(1.0, "one")
    l_new = _row_update(body, "L_in", one, factor, row_l)
    r_new = _row_update(body, "R_in", one, factor, row_r)
    is_k = body.op("Unsqueeze", body.op("Equal", positions, "k"), col)
    body.nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    body.nodes.append(helper.make_node("Where", [is_k, row_l, l_new], ["L_out"]))
    body.nodes.append(helper.make_node("Where", [is_k, row_r, r_new], ["R_out"]))
    loop_body = body.subgraph("gauss_jordan_step",
                              [value("k", TensorProto.INT64, []),
                               value("cond_in", TensorProto.BOOL, []), value("L_in"),
                               value("R_in")],
                              [value("cond_out", TensorProto.BOOL, []), value("L_out"),
                               value("R_out")])
    g.nodes.append(helper.make_node("Loop", [size, "", left, right], ["L_end", "X"],
                                    body=loop_body))
    g.nodes.append(helper.make_node("Mul", ["X", g.op("Unsqueeze", "D", g.const([0], "ax",
                                                                             "int64"))], ["W"]))
    return _function("ScaledCayley", ["skew", "upper_index", "D"], ["W"], g, opset)


ALL = {"HouseholderChain": householder_chain, "PackedGivens": packed_givens,
       "RotationPermutation": rotation_permutation, "ScaledCayley": scaled_cayley}
