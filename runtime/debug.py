"""Where a sharded run departs from one device: every traced value compared, in graph order.

:func:`first_divergence` runs the traced (single-device) graph on the full batch and this rank's
module on its shard, both under a recording interpreter; each traced node's value on the rank is
gathered to the full tensor by the node's planned Spec (partial sums reduced) and compared with
the single-device value. All ranks must call it (the gathers are collectives). It answers "which
op is wrong" when the same-math check fails: the first node whose values differ, with its op,
module, Specs and the error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten

from planner.layout import Layout
from planner.runtime.collectives import relayout
from planner.runtime.module import ParallelModule


@dataclass(frozen=True)
class Divergence:
    node: str
    target: str
    module_path: str
    spec: str
    error: float  # max |sharded - single| / max |single|

    def __str__(self) -> str:
        return f"{self.node} ({self.target}) in {self.module_path or '<root>'}, planned {self.spec}: relative error {self.error:.2e}"


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _single_device_values(pm: ParallelModule, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    graph = pm.graph
    tensors = iter(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
    inputs = {name: next(tensors) for name in graph.input_names}
    feed: list[object] = []
    for fx_node in graph.graph_module.graph.nodes:
        if fx_node.op != "placeholder":
            continue
        ir = graph.nodes.get(fx_node.name)
        if ir is None:  # a tied weight's second, unused placeholder
            feed.append(None)
        elif ir.kind == "input":
            feed.append(inputs[fx_node.name])
        elif ir.kind == "param":
            feed.append(model.get_parameter(ir.param_names[0]))
        elif ir.kind == "buffer":
            feed.append(model.get_buffer(ir.param_names[0]))
        else:
            feed.append(graph.constants[ir.param_names[0]])
    rec = _Recorder(graph.graph_module)
    with torch.no_grad():
        rec.run(*feed)
    return rec.values


def first_divergence(pm: ParallelModule, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                     *, tolerance: float = 1e-9) -> Divergence | None:
    """The first traced node whose sharded value differs from one device's by more than
    ``tolerance`` (relative to the value's largest magnitude), or None. ``model`` holds the same
    weights as ``pm`` started from; ``args``/``kwargs`` are the full batch."""
    kwargs = dict(kwargs or {})
    want = _single_device_values(pm, model, args, kwargs)
    local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
    rec = _Recorder(pm.graph_module)
    with torch.no_grad():
        rec.run(*[t for t in tree_flatten((local_args, local_kwargs))[0] if isinstance(t, torch.Tensor)])
    plans = {n.name: n for n in pm.plan.nodes}
    for name, node in pm.graph.nodes.items():
        if node.kind != "op" or name not in plans:
            continue
        for index, meta in enumerate(node.outputs):
            local_name = pm.node_values.get((name, index))
            spec = plans[name].output_specs()[index] if index < len(plans[name].outputs) else None
            if meta is None or local_name is None or spec is None or local_name not in rec.values:
                continue
            local = rec.values[local_name]
            ref = want[name][index] if isinstance(want[name], (tuple, list)) else want[name]
            if not isinstance(local, torch.Tensor) or not isinstance(ref, torch.Tensor):
                continue
            full = relayout(local.detach(), spec.layout, Layout.replicated(spec.layout.ndim), pm.mesh_groups)
            if full.shape != ref.shape:
                return Divergence(name, node.target, node.module_path, str(spec), float("inf"))
            if not ref.is_floating_point():
                error = 0.0 if torch.equal(full, ref) else float("inf")
            else:
                scale = max(ref.abs().max().item(), 1e-30)
                error = (full.to(ref.dtype) - ref).abs().max().item() / scale
            if error > tolerance:
                return Divergence(name, node.target, node.module_path, str(spec), error)
    return None
