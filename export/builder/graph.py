"""A tiny ONNX graph builder: nodes, initializers and unique names, nothing more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

IR_VERSION = 10  # what current onnxruntime releases load
DOMAIN = "ai.orthornn"


class Graph:
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def const(self, value: npt.ArrayLike, hint: str = "c",
              dtype: npt.DTypeLike = np.float32) -> str:
        """An initializer (arrays) holding ``value``."""
        name = self.name(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    @overload
    def op(self, op_type: str, *inputs: str, outputs: Literal[1] = 1, domain: str = "",
           hint: str | None = None, **attrs: Any) -> str: ...

    @overload
    def op(self, op_type: str, *inputs: str, outputs: int, domain: str = "",
           hint: str | None = None, **attrs: Any) -> list[str]: ...

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "",
           hint: str | None = None, **attrs: Any) -> str | list[str]:
        """A node; its output name (its names, a list, when ``outputs`` > 1)."""
        names = [self.name(hint or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def subgraph(self, name: str, inputs: Sequence[onnx.ValueInfoProto],
                 outputs: Sequence[onnx.ValueInfoProto]) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, inputs, outputs, initializer=self.initializers)


def value(name: str, elem: int = TensorProto.FLOAT,
          shape: Sequence[str | int | None] | None = None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)
