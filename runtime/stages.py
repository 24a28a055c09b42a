"""Running a compiled graph stage by stage: the generic runner that CDP's schedules (runtime.cdp) drive.

A *stage* is a contiguous run of the traced graph's ops; :func:`planner.stages.cut_stages` cuts the
graph into L stages balanced by compute. :class:`StagedRunner` carries that cut over to a
ParallelModule's rank-local fx graph: each rank-local node goes to the stage of the traced node it
computes (a node with no traced node stays with the stage of the node before it), never to a stage
before its inputs'. Sources (inputs, parameters, buffers) belong to no stage; a parameter is
assigned to the earliest stage that reads it, where its gradient completes (``stage_params``).

One micro-batch's values live in a :class:`MicroBatch`. ``forward(mb, l)`` runs stage l's nodes and
builds stage l's own autograd graph: a value an earlier stage produced enters as a detached leaf
(one per producer and consuming stage), parameters are shared (or taken from ``mb.params``, a
parameter version). A value is let go after its last reader in its stage, unless a later stage or
the loss reads it; the last stage sets ``mb.loss``.

``backward(mb, l)`` runs stage l's backward alone, after the backward of every later stage of that
micro-batch: the gradients of l's outputs are those its later stages' leaves received (or, with
stages on other devices, ``output_grads``, received by message). It then drops the stage's values
and leaves, so what the stage saved for backward goes with its graph. ``boundary(l)`` names the
values crossing the cut into l (what travels when stages live on different devices) and
``crossing(mb, l)`` gives the tensors l holds for later stages.

The runner sends no message and steps no optimizer: the schedule (which micro-batch runs which
stage when, and where the gradients go) is the caller's, e.g. runtime.cdp's CDPTrainer and
simulate_schedule and runtime.cdp_pipeline's CDPPipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_map

from planner.runtime.module import ParallelModule
from planner.stages import StageCut


@dataclass
class MicroBatch:
    """One worker's (or one simulated micro-batch's) values while its stages run."""

    inputs: tuple[torch.Tensor, ...]
    params: dict[str, torch.Tensor] | None = None  # a parameter version to use instead of the module's
    values: dict[str, Any] = field(default_factory=dict)
    leaves: dict[tuple[str, int], Any] = field(default_factory=dict)  # (producer, consuming stage) -> detached copy
    loss: torch.Tensor | None = None


class StagedRunner:
    """Runs a ParallelModule's rank-local graph one stage at a time (forward and backward)."""

    def __init__(self, pm: ParallelModule, cut: StageCut) -> None:
        self.pm, self.cut = pm, cut
        gm = pm.graph_module
        traced_stage = cut.stage_of()
        self.num_stages = cut.num_stages
        self.stage_nodes: list[list[torch.fx.Node]] = [[] for _ in range(self.num_stages)]
        self.stage_of: dict[str, int] = {}
        self.sources: list[torch.fx.Node] = []
        last = 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                self.sources.append(node)
                continue
            if node.op == "output":
                self.output = node
                continue
            origin = pm.node_origin.get(node.name)
            # an fx node follows its traced node's stage; helper nodes stay with the stage before
            last = traced_stage.get(origin, last) if origin is not None else last
            last = max(last, max((self.stage_of.get(a.name, 0) for a in node.all_input_nodes), default=0))
            self.stage_of[node.name] = last
            self.stage_nodes[last].append(node)
        # parameters belong to the earliest stage using them (their gradient completes there)
        self.param_stage: dict[str, int] = {}
        for node in self.sources:
            if node.op == "get_attr" and node.target in pm.param_specs:
                users = [self.stage_of[u.name] for u in node.users if u.name in self.stage_of]
                self.param_stage[str(node.target)] = min(users, default=0)
        self.stage_params: list[list[str]] = [[a for a, s in self.param_stage.items() if s == stage] for stage in range(self.num_stages)]
        self._input_index = {n.name: i for i, n in enumerate(n for n in self.sources if n.op == "placeholder")}
        self._consumers: dict[str, set[int]] = {}
        for node in gm.graph.nodes:
            for a in node.all_input_nodes:
                if a.name in self.stage_of:
                    stage = self.stage_of.get(node.name, self.num_stages - 1)
                    if stage != self.stage_of[a.name]:
                        self._consumers.setdefault(a.name, set()).add(stage)
        self._boundaries = [
            tuple(name for name, consumers in self._consumers.items() if self.stage_of[name] < stage and max(consumers) >= stage)
            for stage in range(self.num_stages)
        ]
        # forward lets a value go after its last reader in its stage (autograd keeps what it saved),
        # unless a later stage or the loss reads it: the values crossing a cut stay for backward
        keep = set(self._consumers) | {a.name for a in self.output.all_input_nodes}
        last_reader: dict[str, str] = {}
        for node in gm.graph.nodes:
            if node.name in self.stage_of:
                last_reader.setdefault(node.name, node.name)  # read by nobody: goes at once
                for a in node.all_input_nodes:
                    if self.stage_of.get(a.name) == self.stage_of[node.name]:
                        last_reader[a.name] = node.name
        self._release: dict[str, list[str]] = {}
        for name, reader in last_reader.items():
            if name not in keep:
                self._release.setdefault(reader, []).append(name)

    # ----------------------------------------------------------------- forward

    def start(self, *inputs: torch.Tensor) -> MicroBatch:
        return MicroBatch(tuple(inputs))

    def _source(self, node: torch.fx.Node, mb: MicroBatch) -> Any:
        if node.op == "placeholder":
            return mb.inputs[self._input_index[node.name]]
        target = str(node.target)
        if mb.params is not None and target in mb.params:
            return mb.params[target]
        return self.pm.graph_module.get_parameter(target) if target in self.pm.param_specs else getattr_path(self.pm.graph_module, target)

    def _value(self, node: torch.fx.Node, stage: int, mb: MicroBatch) -> Any:
        if node.name not in self.stage_of:
            return self._source(node, mb)
        if self.stage_of[node.name] == stage:
            return mb.values[node.name]
        key = (node.name, stage)
        if key not in mb.leaves:
            mb.leaves[key] = tree_map(_leaf, mb.values[node.name])
        return mb.leaves[key]

    def forward(self, mb: MicroBatch, stage: int) -> None:
        gm = self.pm.graph_module
        for node in self.stage_nodes[stage]:
            args = torch.fx.node.map_arg(node.args, lambda n: self._value(n, stage, mb))
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self._value(n, stage, mb))
            if node.op == "call_module":
                out = gm.get_submodule(str(node.target))(*args, **kwargs)
            elif node.op == "call_function":
                out = node.target(*args, **kwargs)  # type: ignore[operator]
            elif node.op == "call_method":
                out = getattr(args[0], str(node.target))(*args[1:], **kwargs)
            else:
                raise NotImplementedError(f"fx node {node.op} {node.target} in a stage")
            mb.values[node.name] = out
            for name in self._release.get(node.name, ()):
                del mb.values[name]
        if stage == self.num_stages - 1:
            mb.loss = self._value(self.output.args[0], stage, mb)  # type: ignore[arg-type]

    def crossing(self, mb: MicroBatch, stage: int) -> list[torch.Tensor]:
        """The tensors ``stage`` produced that later stages read (held until its backward)."""
        return [t for node in self.stage_nodes[stage] if node.name in self._consumers for t in _tensors(mb.values[node.name])]

    # ----------------------------------------------------------------- backward

    def param_users(self) -> dict[str, set[int]]:
        """For each parameter, the stages whose nodes read it."""
        out: dict[str, set[int]] = {}
        for node in self.sources:
            if node.op == "get_attr" and node.target in self.pm.param_specs:
                out[str(node.target)] = {self.stage_of[u.name] for u in node.users if u.name in self.stage_of}
        return out

    def boundary(self, stage: int) -> tuple[str, ...]:
        """Values produced before ``stage`` that ``stage`` or a later one reads (what crosses the cut
        into ``stage`` when stages live on different devices)."""
        return self._boundaries[stage]

    def backward(self, mb: MicroBatch, stage: int, output_grads: dict[str, Any] | None = None) -> None:
        """Backward of ``stage``: its outputs' gradients are those its later-stage leaves received
        (or, stages on other devices, ``output_grads`` by value name)."""
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if stage == self.num_stages - 1 and mb.loss is not None:
            tensors.append(mb.loss)
            grads.append(None)
        for node in self.stage_nodes[stage]:
            if output_grads is not None:
                if node.name in output_grads:
                    for t, g in zip(_tensors(mb.values[node.name]), _tensors(output_grads[node.name]), strict=True):
                        if t.requires_grad:
                            tensors.append(t)
                            grads.append(g)
                continue
            for consumer in self._consumers.get(node.name, ()):
                produced, leaf = mb.values[node.name], mb.leaves.get((node.name, consumer))
                if leaf is None:
                    continue
                for t, lt in zip(_tensors(produced), _tensors(leaf), strict=True):
                    if t.requires_grad and lt.grad is not None:
                        tensors.append(t)
                        grads.append(lt.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for node in self.stage_nodes[stage]:  # release the stage: its saved tensors go with its graph
            mb.values.pop(node.name, None)
            for consumer in self._consumers.get(node.name, ()):
                mb.leaves.pop((node.name, consumer), None)  # and the gradients its outputs received


def getattr_path(module: torch.nn.Module, target: str) -> Any:
    out: Any = module
    for part in target.split("."):
        out = getattr(out, part)
    return out


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []
