"""Per-op sharding rules: which strategies each ATen op admits on a mesh.

Two kinds of nodes:

* **anchors** get a variable per strategy in the ILP: parameters, inputs, ops with several tensor
  inputs (linear, embedding, attention, layer norm, losses, binary element-wise ops), and
  single-input ops that start a repeated layer;
* **followers** (ops with one tensor input: views, transposes, activations, dropout, reductions)
  take their layout from their input: :func:`follow` maps the input's Spec to the one strategy
  the follower uses, converting the input first where the op cannot run on it as it is (a softmax
  over a sharded dim, a GELU of a partial sum).

Unknown ops fall back to ``replicate``: every input gathered, the op run whole on every rank.
The fallback is explicit (``algorithm="replicate (fallback)"``) and listed in the report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from planner.cost import steps_comms
from planner.ir import IRGraph, Node, TensorMeta
from planner.layout import Layout, Spec, spec_conversion
from planner.mesh import Mesh
from planner.strategy import Comm, Operand, Strategy, dedupe, einsum_strategies, enumerate_layouts, split_label, with_dp

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
}
DROPOUT = {"aten.dropout.default", "aten.native_dropout.default"}
RESHAPE = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}
DIM_NEEDS_WHOLE = {  # op(x, dim, ...): dim must not be sharded
    "aten.softmax.int": 1, "aten._softmax.default": 1, "aten.log_softmax.int": 1, "aten._log_softmax.default": 1,
    "aten.slice.Tensor": 1, "aten.split.Tensor": 2, "aten.split_with_sizes.default": 2, "aten.chunk.default": 2,
    "aten.cumsum.default": 1, "aten.narrow.default": 1, "aten.unbind.int": 1,
}
SOURCE_OPS_OK = {"aten.arange.start", "aten.arange.default", "aten.arange.start_step", "aten.zeros.default",
                 "aten.ones.default", "aten.full.default", "aten.empty.memory_format", "aten.scalar_tensor.default"}
BINARY_ELEMENTWISE = {
    "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.where.self",
    "aten.maximum.default", "aten.minimum.default", "aten.masked_fill.Tensor", "aten.eq.Tensor",
    "aten.lt.Tensor", "aten.gt.Tensor", "aten.logical_and.default", "aten.logical_or.default",
    "aten.pow.Tensor_Tensor", "aten.ne.Tensor", "aten.ge.Tensor", "aten.le.Tensor",
    "aten.__and__.Tensor", "aten.bitwise_and.Tensor", "aten.__or__.Tensor", "aten.bitwise_or.Tensor",
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


def is_follower(node: Node, graph: IRGraph) -> bool:
    if node.kind != "op" or len(node.inputs) != 1:
        return False
    leader = graph.nodes[node.inputs[0].node]
    return leader.layer == node.layer


def anchor_strategies(node: Node, graph: IRGraph, mesh: Mesh) -> list[Strategy]:
    if node.kind == "param":
        return _param_strategies(node, mesh)
    if node.kind == "input":
        return [_input_strategy(node, mesh)]
    if node.kind in ("buffer", "constant"):
        return [Strategy("replicate", "source", (), (Spec(Layout.replicated(len(node.out.shape))),))]
    ctx = RuleContext(node, graph, mesh)
    if not node.inputs:
        outs = tuple(Spec(Layout.replicated(len(o.shape))) if o is not None else None for o in node.outputs)
        return [Strategy("replicate" if node.target in SOURCE_OPS_OK else FALLBACK, "op", (), outs)]
    rule = ANCHOR_RULES.get(node.target)
    if rule is None and node.target in BINARY_ELEMENTWISE:
        rule = _elementwise_strategies
    if rule is None and len(node.inputs) == 1:
        rule = _unary_anchor
    strategies = rule(ctx) if rule is not None else []
    if not strategies:
        strategies = [_fallback(ctx)]
    return strategies


def _fallback(ctx: RuleContext) -> Strategy:
    ins = tuple(Spec(Layout.replicated(len(ctx.in_shape(i)))) for i in range(len(ctx.node.inputs)))
    outs = tuple(Spec(Layout.replicated(len(o.shape))) if o is not None else None for o in ctx.node.outputs)
    return Strategy(FALLBACK, "op", ins, outs)


def _param_strategies(node: Node, mesh: Mesh) -> list[Strategy]:
    out = []
    for lay in enumerate_layouts(node.out.shape, mesh, axes=mesh.tp_axes, orders=True, all_or_none=False):
        label = "replicated" if not lay.shard_axes else "sharded"
        out.append(Strategy(label, "source", (), (Spec(lay),)))
    return out


def _input_strategy(node: Node, mesh: Mesh) -> Strategy:
    """Each rank is fed its data-parallel shard of the batch: dim 0 split over the dp axes."""
    shape = node.out.shape
    dims: list[tuple[str, ...]] = [() for _ in shape]
    dp = tuple(a for a in mesh.dp_axes if mesh.degree(a) > 1)
    if shape and dp:
        if shape[0] % mesh.group_size(dp):
            raise ValueError(
                f"input {node.name} has batch {shape[0]}, not divisible by the data-parallel degree "
                f"{mesh.group_size(dp)} of mesh {mesh}; use a batch that is a multiple of it"
            )
        dims[0] = dp
    lay = Layout(tuple(dims))
    return Strategy("dp" if dp else "replicate", "source", (), (Spec(lay),))


def _letters(n: int, start: str = "a") -> str:
    return "".join(chr(ord(start) + i) for i in range(n))


def _active_tp(mesh: Mesh) -> list[str]:
    return [a for a in mesh.tp_axes if mesh.degree(a) > 1]


def multi_axis_label(mesh: Mesh, assign: dict[str, tuple[str, ...]], roles: dict[str, str]) -> str:
    """``tp3d[batch=i,in=k,out=j]``: where each tensor-parallel axis of a 2-D/3-D mesh computes."""
    tp = _active_tp(mesh)
    parts = [f"{roles.get(c, c)}={','.join(a for a in axes if a in tp)}" for c, axes in assign.items() if any(a in tp for a in axes)]
    if not parts:
        return split_label(mesh, frozenset(a for axes in assign.values() for a in axes))
    return f"tp{len(tp)}d[{' '.join(sorted(parts))}]"


def reduced_variants(ctx: RuleContext, strategies: list[Strategy], batch_dims: int, bias: int | None = None) -> list[Strategy]:
    """Each strategy with a partial output over tensor-parallel axes, plus variants that reduce it
    inside the strategy: all-reduce (Megatron's row-parallel output), or reduce-scatter onto one
    of the first ``batch_dims`` dims (sequence parallelism; 3-D's reduce-scatter over k).

    The reduced variants add the bias (input ``bias``) after the reduction, as Megatron does: after
    an all-reduce every rank adds the whole bias, so its gradient is no longer partial over the
    reduced axes (no gradient all-reduce for it)."""
    out: list[Strategy] = list(strategies)
    meta = ctx.node.out
    for s in strategies:
        raw = s.outputs[0]
        if raw is None:
            continue
        tp_partial = ctx.mesh.sort_axes({a for a in raw.layout.partial if not ctx.mesh.is_dp(a)})
        if not tp_partial:
            continue
        targets = [Layout(raw.layout.dims, raw.layout.partial - set(tp_partial))]
        for d in range(batch_dims):
            dims = list(raw.layout.dims)
            dims[d] = (*dims[d], *tp_partial)
            target = Layout(tuple(dims), raw.layout.partial - set(tp_partial))
            if target.divides(meta.shape, ctx.mesh):
                targets.append(target)
        for target in targets:
            conv = spec_conversion(raw, Spec(target), ctx.mesh)
            raw_local = meta.nbytes // raw.layout.shard_factor(ctx.mesh)
            comms = steps_comms(conv.forward, raw_local, ctx.mesh, "fwd")
            if ctx.node.requires_grad:
                comms += steps_comms(conv.backward, meta.nbytes // target.shard_factor(ctx.mesh), ctx.mesh, "bwd")
            kind = "all-reduce" if not target.shard_axes - raw.layout.shard_axes else "reduce-scatter"
            inputs = s.inputs
            if bias is not None and bias < len(inputs):
                b = inputs[bias]
                grad = b.grad_partial - set(tp_partial) if kind == "all-reduce" else b.grad_partial | (target.shard_axes - raw.layout.shard_axes - b.layout.shard_axes)
                inputs = (*inputs[:bias], Spec(b.layout, frozenset(grad)), *inputs[bias + 1 :])
            out.append(replace(s, algorithm=f"{s.algorithm}/{kind}", inputs=inputs, outputs=(Spec(target),), comms=s.comms + comms, raw_output=raw))
    return out


def regather_variants(ctx: RuleContext, strategies: list[Strategy], inputs: dict[int, int | None]) -> list[Strategy]:
    """On 2-D/3-D meshes, each strategy whose inputs are gathered before use (over the
    tensor-parallel axes they leave idle) also comes in a variant that receives them still split
    over those axes, gathers them itself, and gathers them again in backward rather than keeping
    the gathered tensors saved (Bian et al.'s two 3-D variants: less memory, more traffic).

    ``inputs``: position -> dim that carries the idle axes on arrival (None: the first dim that
    is already split, else dim 0)."""
    tp = _active_tp(ctx.mesh)
    if len(tp) < 2:
        return strategies
    out = list(strategies)
    for s in strategies:
        if not s.split_axes & set(tp):
            continue
        new_inputs = list(s.inputs)
        regather: list[tuple[int, Spec]] = []
        comms: list[Comm] = []
        for pos, dim in inputs.items():
            if pos >= len(s.inputs) or not ctx.needs_grad(pos):
                continue
            compute = s.inputs[pos]
            idle = tuple(a for a in tp if a not in compute.layout.shard_axes and a not in compute.layout.partial)
            if not idle:
                continue
            d = dim if dim is not None else next((k for k, axes in enumerate(compute.layout.dims) if axes), 0)
            dims = list(compute.layout.dims)
            dims[d] = (*dims[d], *idle)
            arrival_layout = Layout(tuple(dims), compute.layout.partial)
            if not arrival_layout.divides(ctx.in_shape(pos), ctx.mesh):
                continue
            arrival = Spec(arrival_layout, compute.grad_partial - set(idle))
            conv = spec_conversion(arrival, compute, ctx.mesh)
            nbytes = ctx.in_meta(pos).nbytes
            gathered = steps_comms(conv.forward, nbytes // arrival_layout.shard_factor(ctx.mesh), ctx.mesh, "fwd")
            comms += [*gathered, *steps_comms(conv.backward, nbytes // compute.layout.shard_factor(ctx.mesh), ctx.mesh, "bwd")]
            comms += [replace(c, phase="bwd") for c in gathered]  # gathered again for backward
            new_inputs[pos] = arrival
            regather.append((pos, compute))
        if regather:
            out.append(replace(s, algorithm=f"{s.algorithm}+regather", inputs=tuple(new_inputs), comms=s.comms + tuple(comms), regather=tuple(regather)))
    return out


@anchor_rule("aten.linear.default")
def _linear(ctx: RuleContext) -> list[Strategy]:
    x_shape = ctx.in_shape(0)
    o_dim, i_dim = ctx.in_shape(1)
    batch = _letters(len(x_shape) - 1)
    sizes = dict(zip(batch, x_shape[:-1], strict=True)) | {"i": i_dim, "o": o_dim}
    operands = [Operand(batch + "i", ctx.is_param(0), ctx.needs_grad(0)), Operand("oi", ctx.is_param(1), ctx.needs_grad(1))]
    if len(ctx.node.inputs) > 2:
        operands.append(Operand("o", ctx.is_param(2), ctx.needs_grad(2)))
    result = []
    roles = {c: "batch" for c in batch} | {"i": "in", "o": "out"}
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, batch + "o", sizes, batch_letters=batch):
        tp_o = [a for a in assign["o"] if not ctx.mesh.is_dp(a)]
        tp_i = [a for a in assign["i"] if not ctx.mesh.is_dp(a)]
        if len(_active_tp(ctx.mesh)) > 1:
            label = multi_axis_label(ctx.mesh, assign, roles)
        elif tp_o and tp_i:
            label = "tp-col-row"
        elif tp_o:
            label = "tp1d-col"
        elif tp_i:
            label = "tp1d-row"
        else:
            label = split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "linear", ins, (Spec(out),), split))
    result = regather_variants(ctx, reduced_variants(ctx, result, len(batch), bias=2), {0: None, 1: 1})
    return result + summa_strategies(ctx, batch, sizes)


def summa_strategies(ctx: RuleContext, batch: str, sizes: dict[str, int]) -> list[Strategy]:
    """2-D SUMMA (van de Geijn & Watts; Optimus, Xu et al. 2021) on a ``row x col`` mesh: X, W
    and Y blocked q x q (rows of X on ``row``, its hidden dim on ``col``; W[in, out] on
    ``(row, col)``). Forward runs q steps, each broadcasting a block-column of X along the row's
    ``col`` group and a block-row of W along the ``row`` group, then a local matmul-accumulate.
    Backward: dX = dY W^T re-broadcasts W and reduces over ``col``; dW = X^T dY re-broadcasts X
    and reduces over ``row``; dY never moves, and only local blocks are saved. Per device per
    linear X[N,a] W[a,b]: forward q broadcasts of N*a/q^2 and of a*b/q^2; backward the same
    broadcasts again plus q reduces of N*a/q^2 and of a*b/q^2 (ring volume (2Na + 2ab)/q^2 * q
    each way), 4q latency steps forward+backward per operand pair."""
    mesh = ctx.mesh
    if set(_active_tp(mesh)) != {"row", "col"} or mesh.degree("row") != mesh.degree("col"):
        return []
    q = mesh.degree("row")
    o_dim, i_dim = ctx.in_shape(1)
    dp = tuple(a for a in mesh.dp_axes if mesh.degree(a) > 1)
    itemsize = ctx.in_meta(0).itemsize
    out = []
    for d in range(len(batch)):
        x_dims: list[tuple[str, ...]] = [() for _ in range(len(batch) + 1)]
        if d == 0 and dp:
            x_dims[0] = dp
        x_dims[d] = (*x_dims[d], "row")
        x_dims[-1] = ("col",)
        x_lay = Layout(tuple(x_dims))
        if not x_lay.divides(ctx.in_shape(0), mesh) or o_dim % q or i_dim % q:
            continue
        split = frozenset({"row", "col", *dp})
        x = Spec(x_lay, frozenset())
        w = Spec(Layout((("col",), ("row",))), frozenset(dp))
        ins = [x, w]
        if len(ctx.node.inputs) > 2:
            ins.append(Spec(Layout((("col",),)), frozenset({"row", *dp})))
        y = Layout((*x_lay.dims[:-1], ("col",)))
        rows = ctx.node.out.numel // o_dim // mesh.group_size(x_lay.shard_axes - {"col"})
        x_block, w_block = rows * (i_dim // q) * itemsize, (o_dim // q) * (i_dim // q) * itemsize
        comms = [Comm("broadcast", ("col",), x_block, "fwd"), Comm("broadcast", ("row",), w_block, "fwd")] * q
        comms += [Comm("broadcast", ("row",), w_block, "bwd"), Comm("reduce", ("col",), x_block, "bwd"),
                  Comm("broadcast", ("col",), x_block, "bwd"), Comm("reduce", ("row",), w_block, "bwd")] * q
        label = with_dp(f"tp2d-summa[batch{d}=row]", mesh, split)
        out.append(Strategy(label, "summa", tuple(ins), (Spec(y),), split, tuple(comms)))
    return out


@anchor_rule("aten.addmm.default")
def _addmm(ctx: RuleContext) -> list[Strategy]:
    """``addmm(bias[n], x[m,k], w[k,n])`` (Hugging Face's Conv1D): a linear with the weight transposed."""
    args = list(ctx.args) + [None] * 5
    beta = ctx.kwargs.get("beta", 1)
    alpha = ctx.kwargs.get("alpha", 1)
    if len(ctx.in_shape(0)) != 1 or beta != 1 or alpha != 1 or args[3] is not None:
        return []
    (n,) = ctx.in_shape(0)
    m, k = ctx.in_shape(1)
    sizes = {"m": m, "k": k, "n": n}
    operands = [Operand("n", ctx.is_param(0), ctx.needs_grad(0)), Operand("mk", ctx.is_param(1), ctx.needs_grad(1)), Operand("kn", ctx.is_param(2), ctx.needs_grad(2))]
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, "mn", sizes, dp_letters="m", batch_letters="m"):
        tp_n = [a for a in assign["n"] if not ctx.mesh.is_dp(a)]
        tp_k = [a for a in assign["k"] if not ctx.mesh.is_dp(a)]
        label = "tp1d-col" if tp_n and not tp_k else "tp1d-row" if tp_k and not tp_n else "tp-col-row" if tp_k else split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "addmm", ins, (Spec(out),), split))
    return reduced_variants(ctx, result, 1, bias=0)


@anchor_rule("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def _matmul(ctx: RuleContext) -> list[Strategy]:
    a, b = ctx.in_shape(0), ctx.in_shape(1)
    if len(a) < 2 or len(b) < 2 or (len(b) > 2 and a[:-2] != b[:-2]):
        return []
    batch = _letters(len(a) - 2)
    sizes = dict(zip(batch, a[:-2], strict=True)) | {"m": a[-2], "k": a[-1], "n": b[-1]}
    b_letters = (batch if len(b) > 2 else "") + "kn"
    operands = [Operand(batch + "mk", ctx.is_param(0), ctx.needs_grad(0)), Operand(b_letters, ctx.is_param(1), ctx.needs_grad(1))]
    return [
        Strategy(with_dp(split_label(ctx.mesh, split), ctx.mesh, split), "op", ins, (Spec(out),), split)
        for ins, out, split, _ in einsum_strategies(ctx.mesh, operands, batch + "mn", sizes, batch_letters=batch + "m")
        if not out.partial or not any(ctx.mesh.is_dp(p) for p in out.partial)
    ]


@anchor_rule("aten.embedding.default")
def _embedding(ctx: RuleContext) -> list[Strategy]:
    v, e = ctx.in_shape(0)
    idx_shape = ctx.in_shape(1)
    batch = _letters(len(idx_shape))
    sizes = dict(zip(batch, idx_shape, strict=True)) | {"v": v, "e": e}
    operands = [Operand("ve", ctx.is_param(0), ctx.needs_grad(0)), Operand(batch, False, False)]
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, batch + "e", sizes, dp_letters=batch[:1], batch_letters=batch):
        if assign["v"]:
            label = "vocab-parallel"
        elif assign["e"]:
            label = "tp1d-col"
        else:
            label = split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "embedding", ins, (Spec(out),), split))
    return reduced_variants(ctx, result, len(batch))


@anchor_rule("aten.layer_norm.default")
def _layer_norm(ctx: RuleContext) -> list[Strategy]:
    """Rows split freely; the normalised dim split too (2-D/3-D), when the kernel all-reduces the
    row statistics over those axes: mean and variance forward, and the two row sums of the
    gradient backward (one all-reduce each, of one value per local row)."""
    x_shape = ctx.in_shape(0)
    norm = len(ctx.args[1])
    batch = _letters(len(x_shape) - norm)
    hidden = _letters(norm, "p")
    sizes = dict(zip(batch + hidden, x_shape, strict=True))
    operands = [Operand(batch + hidden, ctx.is_param(0), ctx.needs_grad(0))]
    operands += [Operand(hidden, ctx.is_param(i), ctx.needs_grad(i)) for i in range(1, len(ctx.node.inputs))]
    splittable = batch + (hidden if len(hidden) == 1 else "")
    result = []
    itemsize = ctx.in_meta(0).itemsize
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, batch + hidden, sizes, splittable=splittable):
        hidden_axes = ctx.mesh.sort_axes({a for c in hidden for a in assign[c]})
        if not hidden_axes:
            result.append(Strategy(split_label(ctx.mesh, split), "op", ins, (Spec(out),), split))
            continue
        rows = 1
        for c in batch:
            rows *= sizes[c] // ctx.mesh.group_size(assign[c])
        stats = [Comm("all_reduce", hidden_axes, rows * itemsize, "fwd")] * 2 + [Comm("all_reduce", hidden_axes, rows * itemsize, "bwd")] * 2
        result.append(Strategy("split-hidden", "layer_norm", ins, (Spec(out),), split, tuple(stats)))
    return result


@anchor_rule("aten.scaled_dot_product_attention.default")
def _attention(ctx: RuleContext) -> list[Strategy]:
    q, k, v = ctx.in_shape(0), ctx.in_shape(1), ctx.in_shape(2)
    if len(q) != 4 or q[1] != k[1] or len(ctx.node.inputs) > 4:
        return []  # grouped-query attention: replicate (reported)
    sizes = {"b": q[0], "h": q[1], "t": q[2], "s": k[2], "d": q[3], "e": v[3], "1": 1, "2": 1, "3": 1, "4": 1}
    operands = [Operand("bhtd", False, ctx.needs_grad(0)), Operand("bhsd", False, ctx.needs_grad(1)), Operand("bhse", False, ctx.needs_grad(2))]
    if len(ctx.node.inputs) == 4:  # an attention mask broadcasting to [b, h, t, s]; size-1 dims stay whole
        mask = ctx.in_shape(3)
        full = "bhts"[4 - len(mask) :]
        letters = "".join(c if size == sizes[c] and size != 1 else str(i + 1) for i, (c, size) in enumerate(zip(full, mask, strict=True)))
        operands.append(Operand(letters, False, ctx.needs_grad(3)))
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, "bhte", sizes, splittable="bh", all_or_none=False):
        label = "tp1d-heads" if any(not ctx.mesh.is_dp(a) for a in assign["h"]) else split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "op", ins, (Spec(out),), split))
    return result


@anchor_rule("aten.cross_entropy_loss.default")
def _cross_entropy(ctx: RuleContext) -> list[Strategy]:
    logits, target = ctx.in_shape(0), ctx.in_shape(1)
    args = list(ctx.args) + [None] * 6
    weight, reduction, label_smoothing = args[2], args[3] if args[3] is not None else 1, args[5] or 0.0
    if len(logits) != 2 or len(target) != 1 or weight is not None or label_smoothing or reduction not in (1, 2):
        return []
    sizes = {"n": logits[0], "c": logits[1]}
    operands = [Operand("nc", False, ctx.needs_grad(0)), Operand("n", False, False)]
    result = []
    for ins, _out, split, assign in einsum_strategies(ctx.mesh, operands, "", sizes):
        if any(ctx.mesh.is_dp(a) for a in assign["c"]):
            continue
        n_axes, c_axes = assign["n"], assign["c"]
        comms = []
        n_local = logits[0] // ctx.mesh.group_size(n_axes)
        if c_axes:  # max, sum of exponentials, target logit: one all-reduce each over the class axes
            comms += [Comm("all_reduce", c_axes, n_local * ctx.in_meta(0).itemsize, "fwd")] * 3
        if n_axes and reduction == 1:  # count of non-ignored targets for the global mean
            comms.append(Comm("all_reduce", n_axes, 8, "fwd"))
        label = "vocab-parallel" if c_axes else split_label(ctx.mesh, split)
        out_layout = Layout((), frozenset(n_axes))
        result.append(Strategy(with_dp(label, ctx.mesh, split), "cross_entropy", ins, (Spec(out_layout),), split, tuple(comms)))
    return result


@anchor_rule("aten.cat.default")
def _cat(ctx: RuleContext) -> list[Strategy]:
    out_shape = ctx.node.out.shape
    dim = (ctx.args[1] if len(ctx.args) > 1 else 0) % len(out_shape)
    result = []
    for lay in enumerate_layouts(out_shape, ctx.mesh):
        if lay.dims[dim]:
            continue
        ins = tuple(Spec(lay, frozenset()) for _ in ctx.node.inputs)
        split = lay.shard_axes
        result.append(Strategy(split_label(ctx.mesh, split), "op", ins, (Spec(lay),), split))
    return result


def _elementwise_strategies(ctx: RuleContext) -> list[Strategy]:
    out_shape = ctx.node.out.shape
    result = []
    for lay in enumerate_layouts(out_shape, ctx.mesh):
        ins = []
        for i in range(len(ctx.node.inputs)):
            shape = ctx.in_shape(i)
            offset = len(out_shape) - len(shape)
            dims = tuple(lay.dims[offset + d] if shape[d] == out_shape[offset + d] else () for d in range(len(shape)))
            in_lay = Layout(dims)
            grad = (lay.shard_axes - in_lay.shard_axes) if ctx.needs_grad(i) else frozenset()
            ins.append(Spec(in_lay, grad))
        result.append(Strategy(split_label(ctx.mesh, lay.shard_axes), "op", tuple(ins), (Spec(lay),), lay.shard_axes))
    return result


def _unary_anchor(ctx: RuleContext) -> list[Strategy]:
    """A single-input op that starts a region: one strategy per layout its input may arrive in."""
    shape = ctx.in_shape(0)
    return dedupe(follow(ctx, Spec(lay)) for lay in enumerate_layouts(shape, ctx.mesh))


# --------------------------------------------------------------------------- followers


def follow(ctx: RuleContext, spec_in: Spec) -> Strategy:
    """The strategy of a single-input op whose input arrives as ``spec_in``."""
    target = ctx.node.target
    lay = spec_in.layout
    if target == "getitem":
        return Strategy("follow", "getitem", (Spec(lay),), (Spec(lay),), lay.shard_axes)
    if target in LINEAR_UNARY or (target in SCALAR_LINEAR and len(ctx.node.inputs) == 1):
        return _same(lay, "op")
    if target in DROPOUT:
        p = ctx.args[1] if len(ctx.args) > 1 else 0.5
        return _same(lay if p == 0 else _reduced(lay), "op")
    if target in ELEMENTWISE_UNARY:
        return _same(_reduced(lay), "op")
    if target in RESHAPE:
        return _reshape(ctx, lay)
    if target in SHAPE_ONLY:  # uses only the input's dtype and device: a replicated source
        return _strategy(lay, Layout.replicated(len(ctx.node.out.shape)), "op", "replicate")
    if target == "aten.expand.default":
        shape = ctx.node.out.shape
        in_shape = ctx.in_shape(0)
        offset = len(shape) - len(in_shape)
        dims = [() for _ in range(offset)] + [lay.dims[d] if in_shape[d] == shape[offset + d] else () for d in range(len(in_shape))]
        req = Layout(tuple(d if in_shape[i] == shape[offset + i] else () for i, d in enumerate(lay.dims)), lay.partial)
        return _strategy(req, Layout(tuple(dims), lay.partial), "reshape")
    if target in ("aten.transpose.int", "aten.permute.default", "aten.t.default"):
        perm = _permutation(ctx)
        return _strategy(lay, Layout(tuple(lay.dims[p] for p in perm), lay.partial), "op")
    if target == "aten.unsqueeze.default":
        d = ctx.args[1] % (lay.ndim + 1)
        dims = list(lay.dims)
        dims.insert(d, ())
        return _strategy(lay, Layout(tuple(dims), lay.partial), "op")
    if target in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"):
        in_shape = ctx.in_shape(0)
        keep = [i for i, s in enumerate(in_shape) if s != 1 or len(ctx.node.out.shape) == len(in_shape)]
        if len(keep) != len(ctx.node.out.shape):
            keep = [i for i in range(len(in_shape)) if i < len(ctx.node.out.shape)]
        return _strategy(lay, Layout(tuple(lay.dims[i] for i in keep), lay.partial), "op")
    if target == "aten.select.int":  # x.select(dim, i): the dim must be whole; it disappears
        dim = ctx.args[1] % lay.ndim
        req = Layout(tuple(() if i == dim else d for i, d in enumerate(lay.dims)), lay.partial)
        out = Layout(tuple(d for i, d in enumerate(req.dims) if i != dim), req.partial)
        return _strategy(req, out, "op")
    if target in DIM_NEEDS_WHOLE:
        dim = ctx.args[DIM_NEEDS_WHOLE[target]] if len(ctx.args) > DIM_NEEDS_WHOLE[target] else 0
        dim %= max(lay.ndim, 1)
        req = Layout(tuple(() if i == dim else d for i, d in enumerate(lay.dims)), lay.partial)
        linear = target in ("aten.slice.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.chunk.default", "aten.narrow.default", "aten.unbind.int")
        if not linear:
            req = _reduced(req)
        if target == "aten.unbind.int":
            out = Layout(tuple(d for i, d in enumerate(req.dims) if i != dim), req.partial)
            return Strategy("follow", "op", (Spec(req),), tuple(Spec(out) for _ in ctx.node.outputs), req.shard_axes)
        outs = tuple(Spec(req) for _ in ctx.node.outputs)
        return Strategy(split_label(ctx.mesh, req.shard_axes), "op", (Spec(req),), outs, req.shard_axes)
    if target in ("aten.sum.dim_IntList", "aten.mean.dim", "aten.sum.default", "aten.mean.default"):
        return _reduction(ctx, lay)
    return _strategy(Layout.replicated(lay.ndim), _replicated_outputs(ctx), "op", FALLBACK)


def _replicated_outputs(ctx: RuleContext) -> Layout:
    return Layout.replicated(len(ctx.node.out.shape))


def _reduced(lay: Layout) -> Layout:
    return Layout(lay.dims)


def _same(lay: Layout, kernel: str) -> Strategy:
    return _strategy(lay, lay, kernel)


def _strategy(req: Layout, out: Layout, kernel: str, algorithm: str = "follow") -> Strategy:
    return Strategy(algorithm, kernel, (Spec(req),), (Spec(out),), out.shard_axes | req.shard_axes)


def _permutation(ctx: RuleContext) -> list[int]:
    ndim = len(ctx.in_shape(0))
    if ctx.node.target == "aten.t.default":
        return [1, 0] if ndim == 2 else [0]
    if ctx.node.target == "aten.transpose.int":
        d0, d1 = ctx.args[1] % ndim, ctx.args[2] % ndim
        perm = list(range(ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    return [p % ndim for p in ctx.args[1]]


def _reshape(ctx: RuleContext, lay: Layout) -> Strategy:
    """Map shard axes through a reshape by groups of dims whose sizes multiply to the same value.

    Inside a group, only the group's first (outermost) input dim may be sharded, and its axes move
    to the group's first output dim when they divide it; anything else is gathered first.
    """
    in_shape, out_shape = ctx.in_shape(0), ctx.node.out.shape
    groups = _reshape_groups(in_shape, out_shape)
    req = [list(d) for d in lay.dims]
    out_dims: list[tuple[str, ...]] = [() for _ in out_shape]
    for ins, outs in groups:
        for k, i in enumerate(ins):
            if k > 0 and req[i]:
                req[i] = []
        if ins and outs and req[ins[0]]:
            first = ins[0]
            axes = tuple(req[first])
            real_outs = [o for o in outs if out_shape[o] != 1] or outs
            target_dim = real_outs[0]
            if out_shape[target_dim] % ctx.mesh.group_size(axes) == 0:
                out_dims[target_dim] = axes
            else:
                req[first] = []
        elif ins and not outs:
            for i in ins:
                req[i] = []
    req_layout = Layout(tuple(tuple(d) for d in req), lay.partial)
    return _strategy(req_layout, Layout(tuple(out_dims), lay.partial), "reshape")


def _reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi: list[int] = []
        gj: list[int] = []
        pa = pb = 1
        while True:
            if pa == pb and gi and gj:
                break
            if (pa <= pb and i < len(a)) or j >= len(b):
                if i >= len(a):
                    break
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        # absorb trailing size-1 dims into the group
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i)
            i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _reduction(ctx: RuleContext, lay: Layout) -> Strategy:
    ndim = lay.ndim
    if ctx.node.target in ("aten.sum.default", "aten.mean.default"):
        dims, keep = list(range(ndim)), False
    else:
        raw = ctx.args[1] if len(ctx.args) > 1 and ctx.args[1] is not None else list(range(ndim))
        dims = [d % ndim for d in raw] or list(range(ndim))
        keep = bool(ctx.args[2]) if len(ctx.args) > 2 else bool(ctx.kwargs.get("keepdim", False))
    reduced_axes = frozenset(a for d in dims for a in lay.dims[d])
    out_dims = tuple(() if d in dims else lay.dims[d] for d in range(ndim) if keep or d not in dims)
    out = Layout(out_dims, lay.partial | reduced_axes)
    kernel = "mean" if "mean" in ctx.node.target and reduced_axes else "op"
    return Strategy(split_label(ctx.mesh, lay.shard_axes), kernel, (Spec(lay),), (Spec(out),), lay.shard_axes)
