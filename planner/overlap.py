"""ZeRO-3's parameter units and the communication they hide behind compute (prefetch).

The runtime (:mod:`runtime.zero3`) gathers a ZeRO-3 plan's parameters as FSDP2 does, a block at a
time: the parameter gathers (a parameter converted by one all-gather over the data-parallel axes
straight from its stored layout, on an edge or inside a kernel that gathers it itself and again in
backward) are listed in graph order and packed into units (:func:`planner.buckets.pack_units`: a
block's gathers, up to ``bucket_bytes``). A unit is one flat all-gather in forward, one
reduce-scatter of its gradients in backward, and one all-gather again in backward for the
parameters its kernels re-gather. The ILP prices each gather as its share of a unit's latency
(``Comm.bucket_bytes``, as the gradient buckets); the plan lists the units (``param_units``).

With prefetch the runtime starts unit u_{k+1}'s all-gather when unit u_k's arrives (its first
consumer runs), so u_{k+1} travels while the ops from u_k's first consumer up to u_{k+1}'s run
their forward:

    hidden_k = min(t(u_{k+1}), sum_{ops in that window} t_fwd(op)),   t_fwd = t_op * F_fwd / (F_fwd + F_bwd)

(t_op the roofline time of :func:`planner.cost.compute_time`, split by the op's forward share of
FLOPs), and while u_k's first consumer runs, u_{k+1}'s gather (its result and gloo's staging
buffer, two of its size) is in flight and u_k's other parameters wait in the unit:

    transient = max_k (transient(first consumer of u_k) + 2 bytes(u_{k+1}) + bytes(u_k) - bytes(its first gather))

The ILP's objective is linear and cannot take these minima: it prices without overlap, and the
chosen plan is re-priced here (:func:`planner.problem.evaluate`), whose memory the solver then
checks against the budget as for any plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.buckets import Gather, Unit, pack_units
from planner.cost import comm_time, compute_time
from planner.layout import is_unit_gather
from planner.strategy import Comm
from planner.trace import match_layer

if TYPE_CHECKING:
    from planner.problem import Problem


@dataclass(frozen=True)
class Site:
    gather: Gather
    consumer: str  # the first node whose forward uses the gathered parameter
    position: int  # its index in graph order
    loose: bool = False  # a kernel's own gather of a parameter converted on the edge first: it runs alone


def parameter_gathers(problem: Problem, assignment: dict[str, int]) -> list[Site]:
    """The unit gathers of a ZeRO-3 plan, in graph order (as the runtime builds them): an edge
    conversion once per (parameter, Spec), a kernel's own gather once per input. A kernel that
    gathers a parameter which reaches it through an edge conversion first gathers what arrives,
    outside any unit (``loose``: the runtime cannot prefetch a tensor computed in the graph)."""
    from planner.problem import _conversion_cache, spec_id

    graph, mesh = problem.graph, problem.mesh
    cache = _conversion_cache(mesh)
    out: list[Site] = []
    seen: set[str] = set()
    for position, node in enumerate(graph.nodes.values()):
        if node.kind != "op":
            continue
        s = problem.choices[node.name][assignment[problem.node_group[node.name]]]
        regather = dict(s.regather)
        saved = {x.index for x in node.saved if x.source == "input"}
        for pos, ref in enumerate(node.inputs):
            producer = graph.nodes[ref.node]
            if producer.kind != "param" or pos >= len(s.inputs) or s.inputs[pos] is None:
                continue
            stored = problem.choices[producer.name][assignment[problem.node_group[producer.name]]].outputs[0]
            assert stored is not None
            want = s.inputs[pos]
            own = pos in regather  # the kernel gathers it itself (and frees it)
            loose = own and want != stored
            if own:
                stored, want = want, regather[pos]
            if want == stored:
                continue
            conv = cache.conversion(spec_id(stored), spec_id(want))
            if not is_unit_gather(conv, mesh):
                continue
            site = f"{node.name}:{pos}" if own else f"{producer.name}->{want.encode()}"
            if site in seen:
                continue
            seen.add(site)
            layer = match_layer(node.module_path)
            block = f"{layer[0]}.{layer[1]}" if layer is not None else ""
            nbytes = producer.out.nbytes // want.layout.shard_factor(mesh)
            reduced = bool(conv.backward) and producer.requires_grad and producer.out.is_float
            gather = Gather(site, producer.name, block, conv.forward[0].axes, producer.out.dtype, nbytes, own and pos in saved, reduced)
            out.append(Site(gather, node.name, position, loose))
    return out


def param_units(problem: Problem, assignment: dict[str, int]) -> tuple[tuple[Unit, ...], tuple[Gather, ...]]:
    """The plan's ZeRO-3 units and its loose gathers (none for other stages, or under CDP)."""
    if problem.zero_stage != 3 or problem.cdp != "off":
        return (), ()
    sites = parameter_gathers(problem, assignment)
    units = pack_units((s.gather for s in sites if not s.loose), problem.bucket_bytes)
    return units, tuple(s.gather for s in sites if s.loose)


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
    """(seconds of gather time hidden, peak transient bytes with one unit in flight)."""
    sites = [s for s in parameter_gathers(problem, assignment) if not s.loose]
    units = pack_units((s.gather for s in sites), problem.bucket_bytes)
    if len(units) < 2:
        return 0.0, 0.0
    first: list[Site] = []
    k = 0
    for unit in units:
        first.append(sites[k])
        k += len(unit.gathers)
    fwd = forward_compute(problem, assignment)
    mesh, hw = problem.mesh, problem.hardware
    hidden = 0.0
    transient = 0.0
    for (unit, site), (nxt, nxt_site) in itertools.pairwise(zip(units, first, strict=True)):
        window = sum(fwd[site.position : nxt_site.position])
        hidden += min(comm_time(Comm("all_gather", nxt.axes, nxt.nbytes, "fwd"), mesh, hw), window)
        key = problem.node_group[site.consumer]
        waiting = unit.nbytes - site.gather.nbytes
        transient = max(transient, problem.groups[key].transient[assignment[key]] + 2 * nxt.nbytes + waiting)
    return hidden, transient
