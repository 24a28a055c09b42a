"""Run a compiled graph's recomputed segments under ``torch.utils.checkpoint`` (the plan's
``recompute``, :mod:`planner.schemes.recompute`).

Each maximal run of the rank-local graph's nodes that belong to one recomputed segment (full: an
instance of a repeated layer up to the kernel of its last op that saves a tensor; selective: an
attention core; :func:`planner.schemes.recompute.segments`:
the planner marks each plan node's segment; the kernels of its ops and the conversions into them, which compile places before the op that
needs them) becomes a ``torch.fx.GraphModule`` of its own, called through
:class:`Recomputed`: forward saves only the segment's inputs, and backward runs its forward again
(collectives included, recorded like any other) before the segment's own backward. Parameters and
buffers stay ``get_attr`` nodes of the outer graph, handed to the segment as inputs, so the
module's parameters, hooks and optimizer are those of the graph without recomputation.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from planner.ir import IRGraph
from planner.plan import Plan
from planner.runtime.module import attr_name


class Recomputed(torch.nn.Module):
    """One segment, its forward run again in backward (non-reentrant checkpointing). ``random``:
    the segment draws random numbers (dropout with p > 0), so the random state is saved for the
    second run to draw the same masks; otherwise it is not (torch's CPU state is a 5,056-byte
    tensor held from forward to backward per segment: measured, 9-31 KB over the predicted peak
    of the Hugging Face models' 1-D plans, 2-4 segments each, before it was left out)."""

    def __init__(self, body: torch.fx.GraphModule, random: bool = True) -> None:
        super().__init__()
        self.body = body
        self.random = random

    def forward(self, *args: Any) -> Any:
        # the whole segment runs again, as priced (stopping at the last tensor saved would skip
        # collectives after it)
        with set_checkpoint_early_stop(False):
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.random)


_RANDOM = ("dropout", "bernoulli", "rand", "normal", "uniform", "multinomial", "rrelu")


def _draws_random(graph: IRGraph, name: str) -> bool:
    """Whether traced op ``name`` draws random numbers: a random op, except a dropout of p = 0 or
    outside training (read from the traced call's arguments)."""
    node = graph.nodes[name]
    if not any(word in node.target for word in _RANDOM):
        return False
    if "dropout" in node.target:
        call = next((n for n in graph.graph_module.graph.nodes if n.name == name), None)
        if call is not None and len(call.args) >= 3 and isinstance(call.args[1], float) and isinstance(call.args[2], bool):
            return call.args[1] > 0 and call.args[2]
    return True


def checkpoint_segments(gm: torch.fx.GraphModule, origin: dict[str, str], plan: Plan, graph: IRGraph) -> int:
    """Rewrite ``gm`` in place: each run of nodes of one of the plan's recomputed segments (its
    nodes' ``recompute_segment``, through ``origin``: rank-local node name -> traced node) goes
    through a :class:`Recomputed` module. Returns the number of segments."""
    fx = gm.graph
    nodes = list(fx.nodes)
    first_body = next((n for n in nodes if n.op not in ("placeholder", "get_attr")), None)
    if first_body is None:
        return 0
    for n in nodes:  # attributes have no inputs: hoisted, they do not cut a run
        if n.op == "get_attr":
            first_body.prepend(n)

    inside = {n.name: n.recompute_segment for n in plan.nodes if n.recompute_segment is not None}
    last = {n.name for n in plan.nodes if n.ends_segment}
    ended: set[str] = set()  # last ops whose kernel has run: what they add after it is outside

    def key(n: torch.fx.Node) -> object:
        op = origin.get(n.name)
        if n.op not in ("call_module", "call_function", "call_method") or op is None or op in ended:
            return None
        if op in last and n.op == "call_module" and str(n.target).startswith(f"k_{attr_name(op)}_"):
            ended.add(op)
        return inside.get(op)

    runs: list[list[torch.fx.Node]] = []
    current: object = None
    for n in fx.nodes:
        k = key(n)
        if k is None:
            current = None
            continue
        if k != current:
            runs.append([])
            current = k
        runs[-1].append(n)
    for index, run in enumerate(runs):
        random = any(_draws_random(graph, origin[n.name]) for n in run)
        _extract(gm, run, f"recompute_{index}", random)
    fx.lint()
    gm.recompile()
    return len(runs)


def _extract(gm: torch.fx.GraphModule, run: list[torch.fx.Node], name: str, random: bool) -> None:
    """Move ``run`` (consecutive nodes of ``gm``) into a GraphModule called through :class:`Recomputed`."""
    inside = set(run)
    inputs: dict[torch.fx.Node, None] = {}
    for n in run:
        for a in n.all_input_nodes:
            if a not in inside:
                inputs[a] = None
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {a: body.placeholder(a.name) for a in inputs}
    for n in run:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outputs))
    gm.add_module(name, Recomputed(torch.fx.GraphModule(gm, body, class_name="RecomputedSegment"), random))
    with gm.graph.inserting_before(run[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        for k, o in enumerate(outputs):
            value = gm.graph.call_function(operator.getitem, (call, k))
            for user in [u for u in o.users if u not in inside]:
                user.replace_input_with(o, value)
    for n in reversed(run):
        gm.graph.erase_node(n)
