"""Communication hidden behind compute: the gradient sync beside backward, ZeRO-3's parameter
units and their prefetch.

**Gradient sync** (data parallelism, ZeRO-1/2). The runtime starts a bucket's all-reduce (or
reduce-scatter) as soon as backward has its gradients (:mod:`runtime.buckets`), on one
communication stream (a gloo thread, an NCCL stream), while the rest of backward runs. With
gradient q ready at r_q (the end of the backward of its block, or of its first consumer outside
the repeated layers) and sync time t_q, the stream finishes at F = max_k (r_k + sum_{r_q >= r_k} t_q),
so the sync exposed after backward ends at T is

    E = max(0, max_k [ sum_{q: r_q >= r_k} t_q - B(k) ]),    B(k) = backward compute after r_k

(the backward of the ops before k's ready point in forward order). Each bracket is linear in the
ILP's choices, so E is a variable with one row per ready point (:func:`sync_rows`), and a step
hides ``overlap_efficiency`` * (sum_q t_q - E): the share the hardware really overlaps
(:attr:`planner.hardware.HardwareProfile.overlap_efficiency`, measured by ``planner calibrate``).
The ILP and :func:`planner.problem.evaluate` price it the same way. Granularity: a gradient counts
as ready when its block's backward ends, not when its bucket fills (a bucket of several blocks
starts later than that), so E is a lower bound of what a schedule with large buckets exposes.

**ZeRO-3 units.**

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
FLOPs). The units' temporaries (a unit in flight, its gradients packed for the reduce-scatter,
its re-gathered members) are in :func:`unit_terms`.

The ILP's objective is linear and cannot take these minima: it prices without overlap, and the
chosen plan is re-priced here (:func:`planner.problem.evaluate`), whose memory the solver then
checks against the budget as for any plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.buckets import Gather, Unit, pack_units
from planner.cost import comm_time, compute_time
from planner.ir import IRGraph
from planner.layout import is_unit_gather
from planner.peak import Form
from planner.strategy import Comm
from planner.terms import Problem, conversion_cache, input_bytes, spec_id
from planner.trace import match_layer

# the gradient collectives the runtime runs asynchronously beside backward (ZeRO-1/2's all-gather
# of the updated shards runs after the optimizer step, with nothing to hide behind)
ASYNC_SYNC = frozenset({"all_reduce", "reduce_scatter"})


def sync_rows(graph: IRGraph, node_group: dict[str, str], sync: dict[str, list[float]], backward: dict[str, list[float]]) -> list[Form]:
    """The rows E >= sum_{q: r_q >= r_k} t_q - B(k) of the gradient sync's exposure, one per ready
    point k (module docstring), as forms over the choices x; ``sync`` and ``backward``: per
    template and strategy, one instance's sync seconds and backward compute seconds."""
    if not any(any(v) for v in sync.values()):
        return []
    position: dict[str, int] = {}
    block_start: dict[tuple[str, int], int] = {}
    for k, node in enumerate(graph.nodes.values()):
        position[node.name] = k
        layer = match_layer(node.module_path) if node.kind == "op" else None
        if layer is not None:
            block_start.setdefault(layer, k)
    consumers = graph.consumers()
    ready: dict[int, list[str]] = {}
    for node in graph.nodes.values():
        if node.kind != "param" or not any(sync.get(node.template, ())):
            continue
        users = [c for c, _ in consumers[node.name] if graph.nodes[c].kind == "op"]
        if not users:
            continue
        first = min(users, key=position.__getitem__)
        layer = match_layer(graph.nodes[first].module_path)
        ready.setdefault(block_start[layer] if layer is not None else position[first], []).append(node.name)
    ops = [n for n in graph.nodes.values() if n.template in backward]
    rows: list[Form] = []
    synced: Form = {}
    after: Form = {}  # backward compute of the ops before the ready point
    j = 0
    for point in sorted(ready):
        while j < len(ops) and position[ops[j].name] < point:
            op = ops[j]
            for i, t in enumerate(backward[op.template]):
                if t:
                    var: tuple[object, ...] = ("x", node_group[op.name], i)
                    after[var] = after.get(var, 0.0) + t
            j += 1
        for name in ready[point]:
            template = graph.nodes[name].template
            for i, t in enumerate(sync[template]):
                if t:
                    var = ("x", node_group[name], i)
                    synced[var] = synced.get(var, 0.0) + t
        row = dict(synced)
        for key, t in after.items():
            row[key] = row.get(key, 0.0) - t
        rows.append(row)
    return rows


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

    graph, mesh = problem.graph, problem.mesh
    cache = conversion_cache(mesh)
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
            arrival = s.inputs[pos]
            # up to two gathers: the edge's, stored -> arrival (a unit member), and the kernel's
            # own, arrival -> what it computes with (a unit member when the parameter arrives as
            # stored, else loose); a kernel that gathers over the tensor-parallel axes itself
            # (3-D's re-gathering variant) can still take its input from a unit's edge gather
            layer = match_layer(node.module_path)
            block = f"{layer[0]}.{layer[1]}" if layer is not None else ""
            hops = [(stored, arrival, False)]
            if pos in regather:
                hops.append((arrival, regather[pos], True))
            for have, want, own in hops:
                if want == have:
                    continue
                conv = cache.conversion(spec_id(have), spec_id(want))
                if not is_unit_gather(conv, mesh):
                    continue
                site = f"{node.name}:{pos}" if own else f"{producer.name}->{want.encode()}"
                if site in seen:
                    continue
                seen.add(site)
                nbytes = producer.out.nbytes // want.layout.shard_factor(mesh)
                reduced = bool(conv.backward) and producer.requires_grad and producer.out.is_float
                gather = Gather(site, producer.name, block, conv.forward[0].axes, producer.out.dtype, nbytes, own and pos in saved, reduced)
                out.append(Site(gather, node.name, position, own and arrival != stored))
    return out


def param_units(problem: Problem, assignment: dict[str, int]) -> tuple[tuple[Unit, ...], tuple[Gather, ...]]:
    """The plan's ZeRO-3 units and its loose gathers (none for other stages)."""
    if not problem.in_units:
        return (), ()
    sites = parameter_gathers(problem, assignment)
    units = pack_units((s.gather for s in sites if not s.loose), problem.bucket_bytes)
    return units, tuple(s.gather for s in sites if s.loose)


def forward_compute(problem: Problem, assignment: dict[str, int]) -> list[float]:
    """Forward seconds of every node, in graph order (0 for non-ops)."""

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


def saved_before(problem: Problem) -> list[float]:
    """The share of the bytes autograd saves (all nodes, unsharded) that the nodes before each
    graph position have saved: how much of a step's activations forward has made by then."""
    sizes = [float(sum(x.nbytes for x in node.saved)) if node.kind == "op" else 0.0 for node in problem.graph.nodes.values()]
    total = sum(sizes) or 1.0
    out, run = [], 0.0
    for size in sizes:
        out.append(run / total)
        run += size
    return out


def unit_terms(problem: Problem, assignment: dict[str, int], activations: float = 0.0) -> tuple[float, float]:
    """(seconds of gather time the forward prefetch hides, the transient bytes the units add to
    the peak), for a ZeRO-3 plan.

    The peak adds its transient to all of a step's activations; a unit's temporaries live while
    only part of them do, so each is charged less the activations not alive then (as a share of
    the bytes autograd saves, :func:`saved_before`):

    * forward, at unit k's first consumer (with prefetch): unit k+1 in flight, its result and
      gloo's staging buffer, 2 bytes(u_{k+1}), and u_k's members not taken yet, beside the
      consumer's working set; the activations after that consumer are still to come;
    * backward, when unit k's last gradient arrives (at its first consumer's backward; counted
      with the activations saved before its last consumer alive, those of its own block
      included): its reduce-scatter, the flat buffer its
      gradients are packed into, the result and gloo's copies of the n - 1 other chunks, 2 R_k
      (the previous unit's has landed first), its re-gathered members G_k and, with prefetch,
      the next re-gathered unit's result and staging, 2 G_j."""
    sites = [s for s in parameter_gathers(problem, assignment) if not s.loose]
    units = pack_units((s.gather for s in sites), problem.bucket_bytes)
    if not units:
        return 0.0, 0.0
    first: list[Site] = []
    last: list[Site] = []
    k = 0
    for unit in units:
        first.append(sites[k])
        k += len(unit.gathers)
        last.append(sites[k - 1])
    made = saved_before(problem)
    mesh, hw = problem.mesh, problem.hardware
    hidden = 0.0
    transient = 0.0
    fwd = forward_compute(problem, assignment) if problem.prefetch else []
    for k, (unit, site) in enumerate(zip(units, first, strict=True)):
        key = problem.node_group[site.consumer]
        working = problem.groups[key].transient[assignment[key]]
        nxt = units[k + 1] if k + 1 < len(units) else None
        if problem.prefetch and nxt is not None:
            window = sum(fwd[site.position : first[k + 1].position])
            hidden += min(comm_time(Comm("all_gather", nxt.axes, nxt.nbytes, "fwd", problem.unit_share_bytes), mesh, hw), window)
            waiting = unit.nbytes - site.gather.nbytes
            transient = max(transient, working + 2 * nxt.nbytes + waiting - activations * (1.0 - made[site.position]))
        prev = next((u for u in reversed(units[:k]) if u.regather_nbytes), None) if problem.prefetch else None
        backward = 2 * unit.reduce_nbytes + unit.regather_nbytes + (2 * prev.regather_nbytes if prev is not None else 0.0)
        transient = max(transient, backward - activations * (1.0 - made[last[k].position]))
    return hidden, transient
