"""The planning problem for one mesh: the generic sum of the terms the schemes contribute.

Built from the IR by :func:`build_problem`; solved by :mod:`planner.solve`; evaluated exactly for
any assignment by :func:`evaluate` (the solver's objective equals the evaluation of its answer,
and brute-force tests compare the two). The terms (groups, conversion and hold terms) are
:mod:`planner.terms`; the edges' are priced by :mod:`planner.edges`.

Each node gets the tensor-parallel strategies of :mod:`planner.rules` (an anchor) or follows its
producer's; each strategy is priced as its compute (:func:`planner.cost.compute_time`), its
collectives (:func:`planner.cost.comm_time`) and the bytes it holds and saves for backward. A
parameter holds its shard, its gradient and its optimizer states, and steps the optimizer
(:func:`planner.cost.optimizer_step_time`). Everything else a parallelism dimension changes (how
gradients are summed, where parameters are stored, what runs again, what overlaps) is the
schemes' (:mod:`planner.schemes`): their hooks run in :data:`planner.schemes.registry.SCHEMES` order at the
points :mod:`planner.schemes.base` names; this module names no scheme.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping
from typing import Any, cast

from planner.buckets import DEFAULT_BUCKET_BYTES
from planner.cost import comm_time, compute_time, dtype_itemsize, optimizer_bytes_per_value, optimizer_step_time, ring_volume
from planner.edges import price_work, shared_edges
from planner.hardware import HardwareProfile
from planner.ir import IRGraph, Node
from planner.layout import Layout, Spec
from planner.mesh import Mesh
from planner.overlap import ASYNC_SYNC, sync_rows
from planner.peak import instants, peak
from planner.rules import RuleContext, anchor_strategies, follow, is_follower
from planner.rules.context import active_tp
from planner.schemes.base import OFF, NodePrice, ParamPrice, Tally
from planner.schemes.registry import SCHEMES
from planner.strategy import Comm, Strategy
from planner.terms import Evaluation, Group, NodeTerms, Problem, StrategyFilter, input_bytes, instances_of, op_working_set

log = logging.getLogger(__name__)


def build_problem(
    graph: IRGraph,
    mesh: Mesh,
    hardware: HardwareProfile,
    *,
    optimizer: str = "adamw",
    master_dtype: str | None = None,
    prefetch: bool = True,
    cdp_stages: int = 4,
    allow: StrategyFilter | None = None,
    edges: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    keep: Mapping[str, Collection[int]] | None = None,
    **settings: Any,
) -> Problem:
    """The problem of planning ``graph`` on ``mesh``. ``settings``: a value of each scheme's
    setting (:attr:`planner.schemes.base.Scheme.setting`; a scheme left out is off), each
    documented in its scheme's module (:mod:`planner.schemes`); ``bucket_bytes``, ``prefetch``
    and ``cdp_stages`` are ZeRO's and CDP's parameters. The graph is traced on one micro-batch.

    ``master_dtype`` (e.g. ``"float32"``, mixed precision): parameters and gradients stay in the
    traced dtype, the optimizer adds a master copy and keeps its states in ``master_dtype``
    (:func:`planner.cost.optimizer_bytes_per_value`); everything else is priced in the traced dtype.

    ``edges=False`` leaves out the conversion and hold terms (most of the building time):
    enough for the pricing-free bounds of :mod:`planner.front`; :func:`price_conversions` adds
    the terms the conversion bound reads, :func:`price_edges` the rest before a solve.

    ``allow(node, strategy)``, when given, pins choices: an anchor keeps only the strategies it
    accepts (a ValueError names the node if it accepts none).

    ``keep``: per group, the indices (as the problem built without ``keep`` numbers them) of the
    only strategies it may choose; a group left out keeps all (:func:`restrict`). What the
    schemes work out over every choice (ZeRO's largest packed gradient) still sees them all, so
    each plan of the restricted problem is priced exactly as the whole problem prices it."""
    t0 = time.perf_counter()
    unknown = sorted(set(settings) - set(OFF))
    if unknown:
        raise TypeError(f"build_problem got {', '.join(unknown)}: the schemes' settings are {', '.join(s.setting for s in SCHEMES)}")
    settings = OFF | settings
    instances = {template: len(nodes) for template, nodes in instances_of(graph).items()}
    problem = Problem(mesh, hardware, graph, {}, {}, {}, conversions={}, holds={}, instances=instances, master_dtype=master_dtype,
                      prefetch=prefetch, cdp_stages=cdp_stages, bucket_bytes=bucket_bytes, settings=settings,
                      edge_settings=tuple(s.edge_key(settings[s.setting]) for s in SCHEMES))
    for scheme in SCHEMES:
        scheme.configure(problem)
    op_anchors = {
        node.name: graph.memo(("anchors", node.name, mesh), lambda node=node: anchor_strategies(node, graph, mesh))  # type: ignore[misc]
        for node in graph.nodes.values()
        if node.kind == "op" and node.template == node.name and not is_follower(node, graph)
    }
    for scheme in SCHEMES:
        allow = scheme.strategies(problem, op_anchors, allow)
    _choose(problem, op_anchors, allow)
    for scheme in SCHEMES:
        scheme.prepare(problem)
    if keep is not None:
        restrict(problem, keep)
    master_itemsize = dtype_itemsize(master_dtype) if master_dtype else None
    sync, backward = _price_nodes(problem, optimizer, master_itemsize)
    problem.sync_rows = sync_rows(graph, problem.node_group, sync, backward)
    problem.build_seconds = time.perf_counter() - t0
    if edges:
        price_edges(problem)
    return problem


def _choose(problem: Problem, op_anchors: dict[str, list[Strategy]], allow: StrategyFilter | None) -> None:
    """Every node's strategies (``problem.choices``) and its group: an anchor's own, a follower
    its leader's, an instance of a repeated layer its template's."""
    graph, mesh = problem.graph, problem.mesh
    choices, node_group = problem.choices, problem.node_group
    consumers = graph.consumers()
    for node in graph.nodes.values():
        if node.kind == "output":
            continue
        if node.template != node.name:
            choices[node.name] = choices[node.template]
            node_group[node.name] = node_group[node.template]
            continue
        if is_follower(node, graph):
            ref = node.inputs[0]
            ctx = RuleContext(node, graph, mesh)
            # the same objects for every problem of the mesh, so their prices are shared too (_op_prices)
            cache = cast(dict[Spec | None, Strategy], graph.memo(("follow", node.name, mesh), dict))
            out = []
            for s in choices[ref.node]:
                spec = s.outputs[ref.index]
                if spec not in cache:
                    cache[spec] = follow(ctx, spec) if spec is not None else Strategy("follow", "op", (), (None,))
                out.append(cache[spec])
            choices[node.name] = out
            node_group[node.name] = node_group[ref.node]
            continue
        if node.name in op_anchors:
            strategies = op_anchors[node.name]
        elif node.kind == "param":
            strategies = _param_strategies(node, mesh, [(op_anchors.get(c), p) for c, p in consumers[node.name]])
            for scheme in SCHEMES:
                strategies = scheme.param_storage(problem, node, strategies)
        else:
            strategies = anchor_strategies(node, graph, mesh)
        if allow is not None:
            kept = [s for s in strategies if allow(node, s)]
            if not kept:
                options = sorted({s.algorithm for s in strategies})
                raise ValueError(f"the strategy filter rejects every strategy of {node.name} ({node.target}); its options: {options}")
            strategies = kept
        if node.kind == "param":  # a parameter's gradient is a partial sum over the data-parallel axes it is not split over
            dp = frozenset(problem.mesh.active_dp_axes)
            strategies = [
                Strategy(s.algorithm, s.kernel, s.inputs, (Spec(s.outputs[0].layout, dp - s.outputs[0].layout.shard_axes),))  # type: ignore[union-attr]
                for s in strategies
                if s.outputs[0]
            ]
        choices[node.name] = strategies
        node_group[node.name] = node.name
        problem.groups[node.name] = _unpriced_group(problem, node.name, strategies)


def _unpriced_group(problem: Problem, name: str, strategies: list[Strategy]) -> Group:
    n = len(strategies)
    return Group(name, strategies, problem.instances[name], [0.0] * n, [0.0] * n, [(0.0, 0.0, 0.0)] * n,
                 [[] for _ in range(n)], [0.0] * n, credit=[0.0] * n, sync=[0.0] * n)


def restrict(problem: Problem, keep: Mapping[str, Collection[int]]) -> None:
    """Before pricing: each group of ``keep`` keeps only the strategies at those indices (its
    nodes' choices cut alike, so a follower still follows its leader strategy by strategy);
    ``problem.kept`` records, per group cut, the indices they have in the whole problem."""
    cut: dict[str, list[int]] = {}
    for g, indices in keep.items():
        n = len(problem.groups[g].strategies)
        wanted = sorted(i for i in set(indices) if 0 <= i < n)
        if len(wanted) < n:
            cut[g] = wanted
    for node, strategies in list(problem.choices.items()):
        kept = cut.get(problem.node_group[node])
        if kept is not None:
            problem.choices[node] = [strategies[i] for i in kept]
    for g in cut:
        problem.groups[g] = _unpriced_group(problem, g, problem.choices[g])
    problem.kept = {g: tuple(wanted) for g, wanted in cut.items()}


def price_conversions(problem: Problem) -> Problem:
    """Add the conversion and hold terms, all a bound on time needs (once)."""
    if not problem.conversions_priced:
        t0 = time.perf_counter()
        shared_edges(problem)
        problem.conversions_priced = True
        problem.build_seconds += time.perf_counter() - t0
    return problem


def price_edges(problem: Problem) -> Problem:
    """Add the conversion and hold terms, the bytes conversions hold while they run, and what
    the schemes build on them (once; a problem built with ``edges=False`` needs them before it is
    solved or evaluated)."""
    if not problem.edges_priced:
        price_conversions(problem)
        t0 = time.perf_counter()
        price_work(problem)
        for scheme in SCHEMES:
            scheme.edges_priced(problem)
        problem.instants = instants(problem)
        problem.edges_priced = True
        problem.build_seconds += time.perf_counter() - t0
    return problem


def _param_strategies(node: Node, mesh: Mesh, consumers: list[tuple[list[Strategy] | None, int]]) -> list[Strategy]:
    """Storage layouts of a parameter: each layout a consumer computes with, and that layout
    further split over the tensor-parallel axes it leaves idle (gathered before use: 2-D/3-D
    weights, ZeRO-3-like over tp). Every layout, when a consumer is not an anchor."""
    if any(strategies is None for strategies, _ in consumers):
        return anchor_strategies(node, None, mesh)  # type: ignore[arg-type]
    wanted: dict[Layout, None] = {}
    for strategies, pos in consumers:
        for s in strategies or ():
            if pos < len(s.inputs):
                wanted[Layout(s.inputs[pos].layout.dims)] = None
    tp = active_tp(mesh)
    layouts: dict[Layout, None] = dict.fromkeys(sorted(wanted))
    for lay in sorted(wanted):
        idle = tuple(a for a in tp if a not in lay.shard_axes)
        for d in range(lay.ndim) if idle else ():
            dims = list(lay.dims)
            dims[d] = (*dims[d], *idle)
            ext = Layout(tuple(dims))
            if ext.divides(node.out.shape, mesh):
                layouts[ext] = None
    return [Strategy("replicated" if not lay.shard_axes else "sharded", "source", (), (Spec(lay),)) for lay in layouts]


def _price_nodes(problem: Problem, optimizer: str, master_itemsize: int | None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Price every template's strategies into its group. Returns, per template and strategy, one
    instance's seconds of gradient sync that runs beside backward, and one instance's backward
    compute as often as that sync runs (once a step, or once per micro-batch for ZeRO-2's
    reduce-scatter): the inputs of :func:`planner.overlap.sync_rows`."""
    graph, mesh, hw = problem.graph, problem.mesh, problem.hardware
    sync_one: dict[str, list[float]] = {}
    backward_one: dict[str, list[float]] = {}
    consumers_of = graph.consumers()
    consumers_of_output = graph.nodes["output"].inputs[0].node
    prices = _op_prices(graph, mesh, hw)
    for node in graph.nodes.values():
        if node.kind == "output" or node.template != node.name:
            continue
        group = problem.groups[problem.node_group[node.name]]
        count = problem.instances[node.name]
        n = len(problem.choices[node.name])
        terms = problem.node_terms[node.name] = NodeTerms([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
        kept = count - problem.recomputed_instances(node.name)
        saves = sum(saved.nbytes for saved in node.saved if saved.source == "internal")
        for i, strategy in enumerate(problem.choices[node.name]):
            internal = saves / mesh.group_size(strategy.split_axes)
            op = prices.get((node.name, strategy)) if node.kind == "op" else None
            if op is None and node.kind == "op":
                op = prices[(node.name, strategy)] = (compute_time(node, strategy, mesh, hw, input_bytes(graph, node, strategy, mesh)),
                                                     float(op_working_set(graph, node, strategy, mesh, internal)))
            # forward and backward run once per micro-batch
            compute = op[0] * problem.micro_batches if op is not None else 0.0
            price = NodePrice(compute, compute, list(strategy.comms), count)
            if node.kind == "param":
                one = _price_param(problem, node, i, strategy, price, group, terms, optimizer, master_itemsize, sync_one)
                if sum(1 for c, _ in consumers_of[node.name] if graph.nodes[c].kind == "op") > 1:
                    # a weight read twice (tied): backward holds both gradient contributions while summing
                    group.transient[i] = max(group.transient[i], one)
                    terms.work[i] = one
            if node.name == consumers_of_output:
                price.loss_partial = strategy.outputs[0].layout.partial if strategy.outputs[0] else frozenset()
            for scheme in SCHEMES:
                scheme.price_op(problem, node, strategy, price)
            if price.loss_partial:
                price.comms.append(Comm("all_reduce", mesh.sort_axes(price.loss_partial), node.out.itemsize, "fwd"))
            price.seconds += sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in price.comms)
            group.time[i] += price.seconds * count
            if price.rerun is not None:  # in the recomputed instances only
                if not group.rerun:
                    group.rerun = [0.0] * len(group.strategies)
                group.rerun[i] += price.rerun
                group.time[i] += price.rerun
                group.comms[i].extend((c, price.rerun_instances * problem.repeats(c)) for c in price.rerun_comms)
            group.credit[i] += price.credit
            if node.kind == "op" and problem.sync_overlapped:
                total_flops = node.flops_fwd + node.flops_bwd
                share = node.flops_fwd / total_flops if total_flops else 1 / 3  # as planner.overlap.forward_compute
                backward_one.setdefault(node.name, [0.0] * n)[i] = compute / problem.micro_batches * (1 - share) * problem.sync_repeats
            group.comms[i].extend((c, count * problem.repeats(c)) for c in price.comms)
            if op is not None:
                terms.work[i] = op[1]
                group.transient[i] = max(group.transient[i], terms.work[i])
            terms.saved[i] = internal
            # a recomputed instance's intermediates live only while its segment's backward runs (planner.peak)
            group.memory[i] += internal * kept
    return sync_one, backward_one


_PRICES_KEPT = 8  # the op prices of the last few (mesh, profile) pairs a graph was priced on


def _op_prices(graph: IRGraph, mesh: Mesh, hw: HardwareProfile) -> dict[tuple[str, Strategy], tuple[float, float]]:
    """Per (op, strategy), one run's compute seconds (:func:`planner.cost.compute_time`) and its
    working set (:func:`planner.terms.op_working_set`): they depend on the op, the strategy, the
    mesh and the profile alone, so the problems of one mesh (its ZeRO stages, recomputation and
    CDP settings, whose own terms the schemes add) price each once. Kept on the graph for the
    last :data:`_PRICES_KEPT` (mesh, profile) pairs; an entry holds its profile, so a profile's id
    is not reused while it is kept."""
    kept = cast(dict[tuple[Mesh, int], tuple[HardwareProfile, dict[tuple[str, Strategy], tuple[float, float]]]],
                graph.memo("op_prices", dict))
    entry = kept.pop((mesh, id(hw)), None)
    if entry is None or entry[0] is not hw:
        entry = (hw, {})
    kept[(mesh, id(hw))] = entry  # the newest last
    while len(kept) > _PRICES_KEPT:
        del kept[next(iter(kept))]
    return entry[1]


def breaks_a_rule(problem: Problem, assignment: Mapping[str, int]) -> bool:
    """Whether ``assignment`` triggers a conversion the schemes forbid (a collective over the axes
    whose ranks run at different times, CDP's workers: ``problem.barred_axes``). The ILP never
    chooses one (their indicators are held at 0); an LP relaxation's rounded answer may, and
    :func:`evaluate` prices what it is given, so a rounded answer is checked before it stands
    for a plan."""
    if not problem.barred_axes:
        return False
    return any(assignment[gu] in iu and assignment[gv] in iv
               for term in problem.conversions.values() if term.forbidden for gu, iu, gv, iv in term.conditions)


def _price_param(problem: Problem, node: Node, i: int, strategy: Strategy, price: NodePrice, group: Group, terms: NodeTerms,
                 optimizer: str, master_itemsize: int | None, sync_one: dict[str, list[float]]) -> float:
    """A parameter's bytes (shard, gradient, optimizer states), its gradient sync (the schemes'
    :meth:`~planner.schemes.base.Scheme.price_param`) and its optimizer step, into ``price``,
    ``group`` and ``terms``. Returns the bytes of one version of its local shard."""
    mesh, hw, count = problem.mesh, problem.hardware, price.count
    opt_factor = optimizer_bytes_per_value(optimizer, node.out.itemsize, master_itemsize) / node.out.itemsize
    local = float(node.out.itemsize)
    spec = strategy.outputs[0]
    assert spec is not None
    for d in spec.layout.local_shape(node.out.shape, mesh):
        local *= d
    param = ParamPrice(local, local, local * opt_factor)
    for scheme in SCHEMES:
        scheme.price_param(problem, node, i, strategy, param, opt_factor)
    step = param.step
    price.comms += step
    n = len(group.strategies)
    if problem.sync_overlapped:
        # with several micro-batches ZeRO-2's reduce-scatters run beside every backward (rows
        # scaled by sync_repeats); its step-phase all-reduces, beside the last one only, are
        # then not credited (a small, conservative error)
        hidden = sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in step
                     if c.bucket_bytes and c.kind in ASYNC_SYNC and (problem.sync_repeats == 1 or c.phase == "bwd"))
        sync_one.setdefault(node.name, [0.0] * n)[i] = hidden
        group.sync[i] += hidden * count
    if not group.bucketed:
        group.bucketed = [0.0] * n
    group.bucketed[i] += max((c.nbytes for c in step if c.bucket_bytes), default=0) * count
    p, g, o = group.param_memory[i]
    group.param_memory[i] = (p + param.params * count, g + param.grads * count, o + param.states * count)
    terms.grads[i] = param.grads - param.held
    terms.held[i] = param.held
    group.memory[i] += (param.params + param.grads + param.states) * count
    # the step's temporaries: one copy of the parameter's size for its gradient sync (the
    # all-reduce's copy; ZeRO-1/2: the reduce-scatter's output and clones of the other chunks,
    # then gloo's staging buffer of the all-gather into the parameter, runtime.collectives), and
    # the optimizer's own: torch's single-tensor AdamW computes sqrt(v) and its quotient (two
    # tensors the size of what it updates) while the previous tensor's quotient is still bound to
    # its loop variable (measured, HF Llama: three at once; a transformer's consecutive weights
    # have the same size, so three of this one's); SGD with momentum: one
    one = param.params / param.versions
    updated = param.states / opt_factor if opt_factor else 0.0
    price.seconds += optimizer_step_time(optimizer, updated, hw)
    temps = (3 if optimizer in ("adamw", "adam") else 1) * updated
    sync = one if {c.kind for c in step} & {"all_reduce", "reduce_scatter", "all_gather"} else 0.0
    if not group.step_transient:
        group.step_transient = [0.0] * n
    group.step_transient[i] = max(group.step_transient[i], temps, sync)
    return one


def layer_volume(problem: Problem, assignment: dict[str, int]) -> float:
    """Ring bytes per device per step that one repeated layer moves (its nodes' collectives and
    the conversions of tensors its nodes produce), averaged over the instances."""
    graph, mesh = problem.graph, problem.mesh
    if not graph.repeated:
        return 0.0
    layers = graph.repeated[0].count
    in_layer = {n.name for n in graph.nodes.values() if n.layer is not None}
    total = 0.0
    for key, group in problem.groups.items():
        if key in in_layer:
            total += sum(ring_volume(c, mesh) * n for c, n in group.comms[assignment[key]])
    for term in problem.conversions.values():
        if term.producers <= in_layer and any(assignment[gu] in iu and assignment[gv] in iv for gu, iu, gv, iv in term.conditions):
            total += sum(ring_volume(c, mesh) * problem.repeats(c) for c in term.comms) * term.count
    return total / layers


def evaluate(problem: Problem, assignment: dict[str, int]) -> Evaluation:
    """Exact time, memory and collectives of one strategy per group."""
    price_edges(problem)
    mesh, hw = problem.mesh, problem.hardware
    total = 0.0
    comm_t = 0.0
    params = grads = opt = act = 0.0
    step_t = packed = rerun = 0.0
    comms: list[tuple[Comm, int]] = []
    for key, group in problem.groups.items():
        i = assignment[key]
        total += group.time[i]
        rerun += group.rerun[i] if group.rerun else 0.0
        c_t = sum(comm_time(c, mesh, hw) * n for c, n in group.comms[i])
        comm_t += c_t
        p, g, o = group.param_memory[i]
        params, grads, opt = params + p, grads + g, opt + o
        act += group.memory[i] - p - g - o
        if group.step_transient:
            step_t = max(step_t, group.step_transient[i])
        if group.bucketed:
            packed += group.bucketed[i]
        comms.extend(group.comms[i])
    step_t = max(step_t, problem.bucket_transient(packed))
    for term in problem.conversions.values():
        if any(assignment[gu] in iu and assignment[gv] in iv for gu, iu, gv, iv in term.conditions):
            total += term.cost
            comm_t += term.cost
            comms.extend((c, term.count * problem.repeats(c)) for c in term.comms)
            rerun += term.rerun_cost
    held: set[tuple[object, ...]] = set()
    for hold_key, hold in problem.holds.items():
        if any(assignment[gu] in iu and (gv is None or assignment[gv] in iv) for gu, iu, gv, iv in hold.conditions):
            held.add(hold_key)
            act += hold.nbytes * (1 - hold.recomputed)

    edges = list(problem.edges.values())

    def value(var: tuple[object, ...]) -> float:
        kind = var[0]
        if kind == "x":
            return 1.0 if assignment[cast(str, var[1])] == var[2] else 0.0
        if kind == "e":  # the edge's chosen pair of Specs
            edge = edges[cast(int, var[1])]
            src, dst = edge.src_sets[cast(int, var[2])], edge.dst_sets[cast(int, var[3])]
            return 1.0 if assignment[edge.group_u] in src and assignment[edge.group_v] in dst else 0.0
        return 1.0 if var[1] in held else 0.0

    during, peak_at = peak(problem.instants or [], value)
    if peak_at:
        at = problem.graph.nodes[peak_at]
        peak_at += f" ({at.module_path})" if at.module_path else ""
    during = max(during, act, grads)
    hidden = 0.0
    if problem.sync_rows:  # the gradient sync beside backward (planner.overlap)
        exposed = max(0.0, *(sum(v * value(var) for var, v in row.items()) for row in problem.sync_rows))
        synced = sum(group.sync[assignment[key]] for key, group in problem.groups.items() if group.sync)
        hidden = problem.overlap_efficiency * max(synced - exposed, 0.0)
    tally = Tally(total, comm_t, hidden, comms, act, opt, during, peak_at, step_t, value)
    for scheme in SCHEMES:
        scheme.adjust(problem, assignment, tally)
    grads += tally.held  # held at every instant: the peak moves by as much
    tally.during += tally.held
    params += tally.params
    # the breakdown's transient is what the peak adds to the larger of activations and gradients
    memory = {"params": params, "grads": grads, "optimizer": tally.optimizer, "activations": act,
              "transient": tally.during - max(act, grads), "step_transient": tally.step_transient}
    peak_at = "" if grads + tally.step_transient > tally.during else tally.peak_at
    return Evaluation(tally.total - tally.hidden, tally.total - tally.comm_time, tally.comm_time, memory, tuple(tally.comms), tally.hidden,
                      peak_at, rerun)
