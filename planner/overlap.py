"""Communication hidden behind compute where the runtime really overlaps it: ZeRO-3 prefetch.

The runtime (:func:`runtime.compile.prefetch_parameter_gathers`) lists the parameter gathers in
graph order g_1, g_2, ... (a parameter converted by one all-gather straight from its stored
layout, on an edge or inside a re-gathering kernel) and starts g_k asynchronously just before the
consumer of g_{k-1} runs; g_k is waited for at its own consumer. So g_k travels while the ops from
g_{k-1}'s consumer up to g_k's consumer run their forward:

    hidden_k = min(t(g_k), sum_{ops in that window} t_fwd(op)),   t_fwd = t_op * F_fwd / (F_fwd + F_bwd)

(t_op the roofline time of :func:`planner.cost.compute_time`, split by the op's forward share of
FLOPs), and while consumer(k-1) runs, g_k's gathered bytes are held on top of its working set:

    transient = max_k (transient(consumer(k-1)) + bytes(g_k))   (g_k not kept for backward)

The ILP's objective is linear and cannot take these minima: it prices without overlap, and the
chosen plan is re-priced here (:func:`planner.problem.evaluate`), whose memory the solver then
checks against the budget as for any plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.cost import comm_time, compute_time, steps_comms
from planner.layout import spec_conversion

if TYPE_CHECKING:
    from planner.problem import Problem


@dataclass(frozen=True)
class Gather:
    consumer: str  # the node whose forward uses the gathered parameter
    position: int  # the consumer's index in graph order
    seconds: float
    nbytes: int  # gathered bytes
    kept: bool = True  # saved for backward by its consumer (already among the activations)


def parameter_gathers(problem: Problem, assignment: dict[str, int]) -> list[Gather]:
    """The prefetchable parameter gathers of a plan, in graph order (as the runtime finds them)."""
    graph, mesh, hw = problem.graph, problem.mesh, problem.hardware
    out: list[Gather] = []
    for position, node in enumerate(graph.nodes.values()):
        if node.kind != "op":
            continue
        s = problem.choices[node.name][assignment[problem.node_group[node.name]]]
        regather = dict(s.regather)
        for pos, ref in enumerate(node.inputs):
            producer = graph.nodes[ref.node]
            if producer.kind != "param" or pos >= len(s.inputs) or s.inputs[pos] is None:
                continue
            stored = problem.choices[producer.name][assignment[problem.node_group[producer.name]]].outputs[0]
            assert stored is not None
            want = s.inputs[pos]
            kept = True
            if want == stored and pos in regather:  # arrives as stored; the kernel gathers it (and frees it)
                want = regather[pos]
                kept = False
            steps = spec_conversion(stored, want, mesh).forward
            if len(steps) != 1 or steps[0].kind != "all_gather" or mesh.group_size(steps[0].axes) <= 1:
                continue
            comms = steps_comms(steps, producer.out.nbytes // stored.layout.shard_factor(mesh), mesh, "fwd")
            out.append(Gather(node.name, position, sum(comm_time(c, mesh, hw) for c in comms), comms[0].nbytes, kept))
    return out


def forward_compute(problem: Problem, assignment: dict[str, int]) -> list[float]:
    """Forward seconds of every node, in graph order (0 for non-ops)."""
    from planner.problem import input_bytes

    graph, mesh, hw = problem.graph, problem.mesh, problem.hardware
    out = []
    for node in graph.nodes.values():
        if node.kind != "op" or node.name not in problem.choices:
            out.append(0.0)
            continue
        s = problem.choices[node.name][assignment[problem.node_group[node.name]]]
        total_flops = node.flops_fwd + node.flops_bwd
        share = node.flops_fwd / total_flops if total_flops else 1 / 3
        out.append(compute_time(node, s, mesh, hw, input_bytes(graph, node, s, mesh)) * share)
    return out


def prefetch_terms(problem: Problem, assignment: dict[str, int]) -> tuple[float, float]:
    """(seconds of gather time hidden, peak transient bytes with one gather in flight)."""
    gathers = parameter_gathers(problem, assignment)
    if len(gathers) < 2:
        return 0.0, 0.0
    fwd = forward_compute(problem, assignment)
    hidden = 0.0
    transient = 0.0
    for prev, cur in itertools.pairwise(gathers):
        window = sum(fwd[prev.position : cur.position])
        hidden += min(cur.seconds, window)
        group = problem.groups[problem.node_group[prev.consumer]]
        # a gathered weight its consumer keeps for backward is counted among the activations
        # already; one it frees again is held here on top of the running op's working set
        in_flight = 0 if cur.kept else cur.nbytes
        transient = max(transient, group.transient[assignment[problem.node_group[prev.consumer]]] + in_flight)
    return hidden, transient
