"""Which rank-local kernel a planned node runs: builders registered by kernel kind.

A strategy names the kernel kind of its node (``NodePlan.kernel``: ``"linear"``, ``"summa"``,
``"layer_norm"``, ...). :data:`KERNELS` maps a kind to the function that builds the node's
:class:`runtime.kernels.Kernel` from what the plan says (the Specs the kernel computes with and
the Specs it produces) and what the compile knows (the traced graph, the mesh's groups, the
communication recorder). A new kernel family registers one builder and touches nothing else::

    @register("my_family")
    def _my_family(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
        return MyFamilyKernel(node.name, call_template(ctx, node), ctx.mg, ctx.rec)

A kind without a builder (``"op"``: the followers, elementwise ops) runs the traced op unchanged
on local shards: :func:`build_kernel` falls back to the plain :class:`Kernel` for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.ir import IRGraph, Node
from planner.layout import Spec
from planner.plan import NodePlan
from planner.runtime.collectives import CommRecorder
from planner.runtime.groups import MeshGroups
from planner.runtime.kernels import (
    AddmmKernel,
    CrossEntropyKernel,
    EmbeddingKernel,
    Kernel,
    LinearKernel,
    MeanKernel,
    NormKernel,
    Slot,
    SummaKernel,
)

EXPAND = "aten.expand.default"
Specs = list[Spec | None]


class KernelContext(Protocol):
    """What a builder may read of the compile in progress (runtime.compile's builder)."""

    @property
    def graph(self) -> IRGraph: ...
    @property
    def fx_nodes(self) -> dict[str, torch.fx.Node]: ...  # the traced graph's fx nodes by name
    @property
    def mg(self) -> MeshGroups: ...
    @property
    def rec(self) -> CommRecorder: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def loss_partial_over(self) -> frozenset[str]: ...


KernelBuilder = Callable[[KernelContext, Node, NodePlan, Specs, Specs], Kernel]
"""``(ctx, node, np, ins, outs) -> Kernel``: ``ins`` the Specs the kernel computes with
(re-gathered inputs arrive split further than the strategy's input Specs), ``outs`` those of its
outputs (the raw output's when the strategy converts it afterwards)."""

KERNELS: dict[str, KernelBuilder] = {}


def register(*kinds: str) -> Callable[[KernelBuilder], KernelBuilder]:
    """Register the decorated builder for each of ``kinds``."""

    def add(builder: KernelBuilder) -> KernelBuilder:
        taken = [kind for kind in kinds if kind in KERNELS]
        if taken:
            raise ValueError(f"kernel kinds {taken} have a builder already")
        KERNELS.update(dict.fromkeys(kinds, builder))
        return builder

    return add


def build_kernel(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    """The node's kernel: its kind's registered builder, or, for a kind without one, the plain
    :class:`Kernel` (the traced op on local shards)."""
    return KERNELS.get(np.kernel, plain_kernel)(ctx, node, np, ins, outs)


def call_template(ctx: KernelContext, node: Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The traced op's ``(args, kwargs)`` with each tensor input replaced by its :class:`Slot` and
    each device by the rank's (runtime.kernels fills the slots at each call)."""
    fx_node = ctx.fx_nodes[node.name]
    counter = iter(range(len(node.inputs)))

    def swap(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return Slot(next(counter))
        if isinstance(a, torch.device):
            return ctx.device
        return a

    flat, spec = tree_flatten((fx_node.args, fx_node.kwargs))
    args, kwargs = tree_unflatten([swap(a) for a in flat], spec)
    return tuple(args), dict(kwargs)


def plain_kernel(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    return Kernel(node.name, ctx.fx_nodes[node.name].target, call_template(ctx, node))


@register("linear", "addmm")
def _linear(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    partial = ctx.mg.mesh.sort_axes(outs[0].layout.partial) if outs[0] else ()
    cls = LinearKernel if np.kernel == "linear" else AddmmKernel
    return cls(node.name, call_template(ctx, node), partial, ctx.mg, with_bias=np.raw_output is None)


@register("summa")
def _summa(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    return SummaKernel(node.name, call_template(ctx, node), ctx.mg, ctx.rec)


@register("layer_norm", "rms_norm")
def _norm(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    x = ins[0]
    assert x is not None
    normalized_shape = ctx.fx_nodes[node.name].args[1]
    assert isinstance(normalized_shape, (list, tuple))
    norm = len(normalized_shape)
    axes = ctx.mg.mesh.sort_axes({a for d in x.layout.dims[x.layout.ndim - norm :] for a in d})
    return NormKernel(node.name, call_template(ctx, node), np.kernel == "rms_norm", axes, ctx.mg, ctx.rec)


@register("embedding")
def _embedding(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    w = ins[0]
    assert w is not None
    rows = ctx.graph.nodes[node.inputs[0].node].out.shape[0] // ctx.mg.mesh.group_size(w.layout.dims[0])
    return EmbeddingKernel(node.name, call_template(ctx, node), w.layout.dims[0], rows, ctx.mg)


@register("cross_entropy")
def _cross_entropy(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    logits = ins[0]
    assert logits is not None
    classes = ctx.graph.nodes[node.inputs[0].node].outputs[node.inputs[0].index]
    assert classes is not None
    local = classes.shape[1] // ctx.mg.mesh.group_size(logits.layout.dims[1])
    scaled = tuple(a for a in logits.layout.dims[0] if a in ctx.loss_partial_over)
    template = call_template(ctx, node)
    return CrossEntropyKernel(node.name, template, logits.layout.dims[0], logits.layout.dims[1], local, ctx.mg, ctx.rec, scaled)


@register("mean")
def _mean(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    assert ins[0] is not None and outs[0] is not None
    shards = ctx.mg.mesh.group_size(outs[0].layout.partial - ins[0].layout.partial)
    return MeanKernel(node.name, ctx.fx_nodes[node.name].target, call_template(ctx, node), shards)


@register("reshape")
def _reshape(ctx: KernelContext, node: Node, np: NodePlan, ins: Specs, outs: Specs) -> Kernel:
    """view/reshape/flatten/unflatten/expand, to the local shape (an expand stays an expand)."""
    args, kwargs = call_template(ctx, node)
    meta = node.outputs[0]
    assert meta is not None and outs[0] is not None
    local = list(outs[0].layout.local_shape(meta.shape, ctx.mg.mesh))
    args = (args[0], local, *args[2:]) if node.target == EXPAND else (args[0], local)
    target = ctx.fx_nodes[node.name].target if node.target == EXPAND else torch.ops.aten.reshape.default
    return Kernel(node.name, target, (args, kwargs))
