"""The planner's IR: the traced fx graph with, on every node, what planning needs to know.

Produced by :func:`planner.trace.trace`. The fx graph is the ``torch.export`` training-IR graph
(ATen ops such as ``aten.linear``, ``aten.layer_norm``, ``aten.scaled_dot_product_attention``,
``aten.cross_entropy_loss`` kept whole), parameters lifted to placeholders.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch.fx

T = TypeVar("T")
NodeKind = Literal["param", "buffer", "input", "constant", "op", "output"]
SavedSource = Literal["input", "output", "internal"]

DTYPE_BYTES = {
    "torch.float64": 8, "torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2,
    "torch.int64": 8, "torch.int32": 4, "torch.int16": 2, "torch.int8": 1, "torch.uint8": 1,
    "torch.bool": 1, "torch.complex64": 8, "torch.complex128": 16,
}


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str

    @functools.cached_property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return "float" in self.dtype or "complex" in self.dtype

    def __str__(self) -> str:
        return f"{self.dtype.removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class Saved:
    """A tensor autograd keeps for backward: one of the node's inputs, its output, or internal."""

    source: SavedSource
    index: int
    nbytes: int


@dataclass(frozen=True)
class InputRef:
    """A tensor argument of a node: output ``index`` of node ``node``."""

    node: str
    index: int = 0


@dataclass
class Node:
    name: str
    kind: NodeKind
    target: str
    inputs: tuple[InputRef, ...]
    outputs: tuple[TensorMeta | None, ...]
    module_path: str = ""
    flops_fwd: int = 0
    flops_bwd: int = 0
    saved: tuple[Saved, ...] = ()
    alias_input: int | None = None  # the output is a view of this tensor input
    param_names: tuple[str, ...] = ()  # parameters/buffers: every name (tied weights have several)
    requires_grad: bool = False
    layer: int | None = None  # index of the repeated-layer instance this node belongs to
    template: str = ""  # the node at the same position in the first instance (itself if none)

    @property
    def out(self) -> TensorMeta:
        meta = self.outputs[0]
        if meta is None:
            raise ValueError(f"node {self.name} ({self.target}) has no tensor output")
        return meta

    def __str__(self) -> str:
        outs = ", ".join(str(o) for o in self.outputs)
        return f"{self.name} = {self.target}({', '.join(i.node for i in self.inputs)}) -> {outs}"


@dataclass(frozen=True)
class RepeatedLayers:
    """Instances of one layer module repeated ``count`` times, e.g. the blocks ``h.0`` .. ``h.95``."""

    prefix: str
    count: int
    nodes_per_layer: int


@dataclass
class IRGraph:
    graph_module: torch.fx.GraphModule
    nodes: dict[str, Node]
    input_names: tuple[str, ...]  # user inputs in the order of the flattened (args, kwargs)
    output_name: str  # the node producing the (scalar) loss
    repeated: tuple[RepeatedLayers, ...] = ()
    in_spec: object = None  # pytree spec of (args, kwargs)
    # tensors the traced code creates from Python values (torch.tensor(...) in forward), by the name
    # a "constant" node's param_names carry; the runtime holds them as buffers
    constants: dict[str, object] = field(default_factory=dict, repr=False, compare=False)
    timings: dict[str, float] = field(default_factory=dict)
    # what planning derives from the graph alone, shared by the problems of a search (consumers,
    # strategies per node and mesh); dropped when the nodes change
    derived: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    def memo(self, key: object, make: Callable[[], T]) -> T:
        """``make()``, once per key while the nodes stay the same."""
        if self.derived.get("_nodes") != len(self.nodes):
            self.derived.clear()
            self.derived["_nodes"] = len(self.nodes)
        if key not in self.derived:
            self.derived[key] = make()
        return self.derived[key]  # type: ignore[return-value]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.nodes.values())

    @property
    def params(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.kind == "param"]

    def consumers(self) -> dict[str, list[tuple[str, int]]]:
        """For each node, the (consumer, argument position) pairs reading its outputs (shared: do
        not modify)."""

        def make() -> dict[str, list[tuple[str, int]]]:
            out: dict[str, list[tuple[str, int]]] = {n: [] for n in self.nodes}
            for node in self.nodes.values():
                for pos, ref in enumerate(node.inputs):
                    out[ref.node].append((node.name, pos))
            return out

        return self.memo("consumers", make)

    def batch_rows(self) -> int:
        """The traced batch: dim 0 of the first input (1 without inputs)."""
        return self.nodes[self.input_names[0]].out.shape[0] if self.input_names else 1

    def num_params(self) -> int:
        return sum(n.out.numel for n in self.params)

    def total_flops(self) -> int:
        return sum(n.flops_fwd + n.flops_bwd for n in self.nodes.values())

    def summary(self) -> str:
        ops = sum(1 for n in self.nodes.values() if n.kind == "op")
        rep = "; ".join(f"{r.count} x {r.prefix}.* ({r.nodes_per_layer} nodes each)" for r in self.repeated)
        return (
            f"{ops} ops, {len(self.params)} parameters ({_count(self.num_params())} values), "
            f"{self.total_flops() / 1e12:.2f} TFLOP per step; repeated: {rep or 'none'}"
        )


def _count(n: float) -> str:
    """A count as people read it: 6.2 K, 124.4 M, 12.854 B (a tiny model's 0.000 B said nothing)."""
    for scale, unit, digits in ((1e9, "B", 3), (1e6, "M", 1), (1e3, "K", 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{int(n)}"
