"""What every sharding rule sees: the op sets, the node in context, the rule registry."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from planner.ir import IRGraph, Node, TensorMeta
from planner.mesh import Mesh
from planner.strategy import Strategy, split_label

log = logging.getLogger(__name__)

FALLBACK = "replicate (fallback)"

# single-input ops that act element-wise and commute with a sum over ranks (partial inputs are fine)
LINEAR_UNARY = {
    "aten.clone.default", "aten.contiguous.default", "aten.alias.default", "aten.detach.default",
    "aten.neg.default", "aten._to_copy.default", "aten.to.dtype", "aten.to.dtype_layout",
    "aten.lift_fresh_copy.default", "getitem", "aten.to.device",
}
SHAPE_ONLY = {"aten.new_ones.default", "aten.new_zeros.default", "aten.new_full.default", "aten.new_empty.default"}
SCALAR_LINEAR = {"aten.mul.Tensor", "aten.div.Tensor", "aten.mul.Scalar", "aten.div.Scalar"}
ELEMENTWISE_UNARY = {
    "aten.gelu.default", "aten.relu.default", "aten.silu.default", "aten.tanh.default",
    "aten.sigmoid.default", "aten.exp.default", "aten.log.default", "aten.abs.default",
    "aten.rsqrt.default", "aten.sqrt.default", "aten.pow.Tensor_Scalar", "aten.add.Tensor",
    "aten.sub.Tensor", "aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.sin.default",
    "aten.cos.default", "aten.erf.default", "aten.square.default", "aten.reciprocal.default",
    "aten.gt.Scalar", "aten.lt.Scalar", "aten.ge.Scalar", "aten.le.Scalar", "aten.eq.Scalar", "aten.ne.Scalar",
    "aten.logical_not.default", "aten.bitwise_not.default", "aten.type_as.default", "aten.masked_fill.Scalar",
    "aten.floor_divide.default", "aten.remainder.Scalar", "aten.remainder.Tensor", "aten.fmod.Scalar", "aten.clamp.default",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.sign.default", "aten.floor.default", "aten.ceil.default",
    "aten.round.default", "aten.trunc.default", "aten.log1p.default", "aten.expm1.default", "aten.log2.default",
    "aten.softplus.default", "aten.hardtanh.default", "aten.leaky_relu.default", "aten.elu.default", "aten.mish.default",
    "aten.hardswish.default", "aten.hardsigmoid.default", "aten.isinf.default", "aten.isnan.default", "aten.pow.Scalar",
    "aten.bitwise_and.Scalar", "aten.bitwise_or.Scalar", "aten.fill.Scalar", "aten.div.Tensor_mode", "aten.div.Scalar_mode",
    "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.max.other", "aten.min.other", "aten.maximum.default",
    "aten.minimum.default", "aten.tan.default", "aten.atan.default", "aten.gelu_.default",
}
# ops whose output is the shape (and dtype) of their input, whatever its values: they follow its dims
LIKE = {"aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default", "aten.full_like.default"}
DROPOUT = {"aten.dropout.default", "aten.native_dropout.default"}
RESHAPE = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.flatten.using_ints", "aten.unflatten.int"}
# op(x, dim, ...): dim must not be sharded. target -> (position of the dim argument, its default)
DIM_NEEDS_WHOLE: dict[str, tuple[int, int]] = {
    "aten.softmax.int": (1, -1), "aten._softmax.default": (1, -1), "aten.log_softmax.int": (1, -1), "aten._log_softmax.default": (1, -1),
    "aten.slice.Tensor": (1, 0), "aten.split.Tensor": (2, 0), "aten.split_with_sizes.default": (2, 0), "aten.chunk.default": (2, 0),
    "aten.cumsum.default": (1, 0), "aten.narrow.default": (1, 0), "aten.unbind.int": (1, 0),
    "aten.topk.default": (2, -1), "aten.sort.default": (1, -1), "aten.sort.stable": (2, -1), "aten.argsort.default": (1, -1),
    "aten.argsort.stable": (2, -1), "aten.max.dim": (1, 0), "aten.min.dim": (1, 0), "aten.argmax.default": (1, 0),
    "aten.argmin.default": (1, 0), "aten.cumprod.default": (1, 0), "aten.logcumsumexp.default": (1, 0),
    "aten.roll.default": (2, 0), "aten.flip.default": (1, 0),
}
# of those, the ops that commute with a sum over ranks (a partial input may stay partial)
DIM_WHOLE_LINEAR = {"aten.slice.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default",
                    "aten.narrow.default", "aten.unbind.int", "aten.cumsum.default", "aten.roll.default", "aten.flip.default"}
# of those, the ops whose outputs lose the dim (unbind; max/min/argmax/argmin unless keepdim)
DIM_DROPPED = {"aten.unbind.int": None, "aten.max.dim": 2, "aten.min.dim": 2, "aten.argmax.default": 2, "aten.argmin.default": 2}
# reductions whose result needs the reduced dims whole (not a sum of per-shard parts):
# target -> (position of the dims argument, position of keepdim)
WHOLE_REDUCTIONS: dict[str, tuple[int, int]] = {
    "aten.var_mean.correction": (1, 3), "aten.var.correction": (1, 3), "aten.std.correction": (1, 3),
    "aten.std_mean.correction": (1, 3), "aten.amax.default": (1, 2), "aten.amin.default": (1, 2),
    "aten.logsumexp.default": (1, 2), "aten.linalg_vector_norm.default": (2, 3),
}
SOURCE_OPS_OK = {"aten.arange.start", "aten.arange.default", "aten.arange.start_step", "aten.zeros.default",
                 "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default"}
BINARY_ELEMENTWISE = {
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.where.self",
    "aten.maximum.default", "aten.minimum.default", "aten.masked_fill.Tensor", "aten.eq.Tensor",
    "aten.lt.Tensor", "aten.gt.Tensor", "aten.logical_and.default", "aten.logical_or.default",
    "aten.pow.Tensor_Tensor", "aten.ne.Tensor", "aten.ge.Tensor", "aten.le.Tensor",
    "aten.__and__.Tensor", "aten.bitwise_and.Tensor", "aten.__or__.Tensor", "aten.bitwise_or.Tensor",
    "aten.masked_fill.Scalar", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.min.other", "aten.max.other",
    "aten.floor_divide.default", "aten.remainder.Tensor", "aten.fmod.Tensor", "aten.logical_xor.default",
    "aten.bitwise_xor.Tensor", "aten.__xor__.Tensor", "aten.atan2.default", "aten.clamp.Tensor", "aten.addcmul.default",
    "aten.addcdiv.default", "aten.lerp.Tensor", "aten.lerp.Scalar", "aten.div.Tensor_mode", "aten.copy.default", "aten.fill.Tensor", "aten.xlogy.Tensor",
}


class RuleContext:
    """What a rule sees: the node, its fx arguments, the graph and the mesh."""

    def __init__(self, node: Node, graph: IRGraph, mesh: Mesh) -> None:
        self.node = node
        self.graph = graph
        self.mesh = mesh
        fx = graph.graph_module.graph
        self.fx_node = next((n for n in fx.nodes if n.name == node.name), None)

    @property
    def args(self) -> tuple[Any, ...]:
        return tuple(self.fx_node.args) if self.fx_node is not None else ()

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.fx_node.kwargs) if self.fx_node is not None else {}

    def in_meta(self, i: int) -> TensorMeta:
        ref = self.node.inputs[i]
        meta = self.graph.nodes[ref.node].outputs[ref.index]
        assert meta is not None
        return meta

    def in_shape(self, i: int) -> tuple[int, ...]:
        return self.in_meta(i).shape

    def is_param(self, i: int) -> bool:
        return self.graph.nodes[self.node.inputs[i].node].kind == "param"

    def needs_grad(self, i: int) -> bool:
        ref = self.node.inputs[i]
        producer = self.graph.nodes[ref.node]
        meta = producer.outputs[ref.index]
        return producer.requires_grad and meta is not None and meta.is_float


AnchorRule = Callable[[RuleContext], list[Strategy]]
ANCHOR_RULES: dict[str, AnchorRule] = {}


def anchor_rule(*targets: str) -> Callable[[AnchorRule], AnchorRule]:
    def register(fn: AnchorRule) -> AnchorRule:
        for t in targets:
            ANCHOR_RULES[t] = fn
        return fn

    return register



def letter_range(n: int, start: str = "a") -> str:
    return "".join(chr(ord(start) + i) for i in range(n))


def active_tp(mesh: Mesh) -> list[str]:
    return [a for a in mesh.tp_axes if mesh.degree(a) > 1]


def multi_axis_label(mesh: Mesh, assign: dict[str, tuple[str, ...]], roles: dict[str, str]) -> str:
    """``tp3d[batch=i,in=k,out=j]``: where each tensor-parallel axis of a 2-D/3-D mesh computes."""
    tp = active_tp(mesh)
    parts = [f"{roles.get(c, c)}={','.join(a for a in axes if a in tp)}" for c, axes in assign.items() if any(a in tp for a in axes)]
    if not parts:
        return split_label(mesh, frozenset(a for axes in assign.values() for a in axes))
    return f"tp{len(tp)}d[{' '.join(sorted(parts))}]"


