"""The planning problem for one mesh: variable groups, their costs, and the terms that couple them.

Built from the IR by :func:`build_problem`; solved by :mod:`planner.solve`; evaluated exactly for
any assignment by :func:`evaluate` (the solver's objective equals the evaluation of its answer,
and brute-force tests compare the two).

* A **group** is one ILP choice: an anchor node (see :mod:`planner.rules`), shared by every
  instance of a repeated layer (``count`` instances) and by the followers that take their layout
  from it. ``time[i]``: seconds of every node in the group under strategy ``i``, all instances;
  ``memory[i]``: bytes it holds per device (parameter, gradient and optimizer shards, tensors it
  saves for backward that no other node shares).
* A **conversion term** prices turning a producer's output Spec ``S`` into the Spec ``T`` a
  consumer needs: forward steps and backward steps (:func:`planner.layout.spec_conversion`). It is
  paid once per producer tensor and target, however many consumers want the same ``T``. Its
  buffers count at the consumer's instant of the peak (:mod:`planner.peak`), one form per edge
  over the edge's transportation variables (a row per conversion term instead: GPT-3 13B's
  8 x 8 configuration searched in 139 s, not 40 s); an op's own output reduction and re-gathers
  are in the op's working set, :func:`op_working_set`.
* A **hold term** is a tensor saved for backward in a given sharding, counted once however many
  consumers save it.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import cast

from planner.buckets import DEFAULT_BUCKET_BYTES
from planner.cdp import LOSS_TARGETS
from planner.cost import (
    comm_time,
    compute_time,
    dtype_itemsize,
    optimizer_bytes_per_value,
    optimizer_step_time,
    ring_volume,
    steps_comms,
    steps_working_set,
)
from planner.hardware import HardwareProfile
from planner.ir import InputRef, IRGraph, Node
from planner.layout import Conversion, Layout, Spec, is_unit_gather, spec_conversion, zero_dim
from planner.mesh import Mesh
from planner.overlap import ASYNC_SYNC, sync_rows, unit_terms
from planner.peak import Form, Instant, instants, peak
from planner.plan import peak_of
from planner.rules import RuleContext, anchor_strategies, follow, is_follower
from planner.rules.variants import regather_variants
from planner.schemes import recompute as recompute_scheme
from planner.strategy import Comm, Strategy, dedupe
from planner.trace import match_layer

log = logging.getLogger(__name__)


@dataclass
class Group:
    key: str
    strategies: list[Strategy]
    count: int = 1
    time: list[float] = field(default_factory=list)
    memory: list[float] = field(default_factory=list)  # bytes per device, all instances
    param_memory: list[tuple[float, float, float]] = field(default_factory=list)  # params, grads, optimizer
    comms: list[list[tuple[Comm, int]]] = field(default_factory=list)  # (comm, multiplicity) per strategy
    transient: list[float] = field(default_factory=list)
    step_transient: list[float] = field(default_factory=list)  # gradient sync / optimizer step temporaries
    bucketed: list[float] = field(default_factory=list)  # gradient bytes packed into buckets (planner.buckets), all instances
    # the most of time[i] evaluate() may hide behind compute (ZeRO-3 prefetch: the forward compute
    # of the group's ops; CDP: its point-to-point messages); 0 where nothing overlaps
    credit: list[float] = field(default_factory=list)
    # seconds of gradient collectives that run asynchronously beside backward (DP's bucketed
    # all-reduce, ZeRO-1/2's reduce-scatter), all instances: the ILP hides overlap_efficiency of
    # them, less what the sync rows leave exposed (planner.overlap.sync_rows)
    sync: list[float] = field(default_factory=list)
    # seconds activation recomputation adds (the forward compute and collectives run again in
    # backward), all instances; empty where the group recomputes nothing
    rerun: list[float] = field(default_factory=list)


@dataclass
class NodeTerms:
    """One node's memory, one instance, per strategy of its group (for :mod:`planner.peak`)."""

    saved: list[float]  # bytes it saves for backward itself (its internal intermediates)
    work: list[float]  # bytes live while it runs (op_working_set; a tied weight: its gradients' sum)
    grads: list[float]  # a parameter: its gradient's bytes, made in backward
    held: list[float]  # a parameter: bytes held through the whole step beside them (CDP v1's previous buffer)


@dataclass
class ConversionTerm:
    key: tuple[object, ...]
    cost: float  # seconds, all instances
    comms: tuple[Comm, ...]
    producers: set[str] = field(default_factory=set)  # producer node instances paying it
    rerun: int = 0  # the last ``rerun`` comms: its forward steps again, in a recomputed segment
    rerun_cost: float = 0.0  # their seconds, all instances (part of ``cost``)
    # y >= [producer group in idx_u] + [consumer group in idx_v] - 1
    conditions: list[tuple[str, frozenset[int], str, frozenset[int]]] = field(default_factory=list)


    @property
    def count(self) -> int:
        return len(self.producers)


@dataclass
class EdgeTerm:
    """A producer-consumer edge between two groups, for the ILP's transportation formulation:
    the producer's strategies grouped by the Spec they output, the consumer's by the Spec they
    need, and the conversion term each (output, need) pair pays (absent when they are equal)."""

    group_u: str
    group_v: str
    src_sets: dict[int, frozenset[int]]  # by the interned Spec id (spec_id; spec_of gives the Spec)
    dst_sets: dict[int, frozenset[int]]
    conversions: dict[tuple[int, int], set[tuple[object, ...]]]
    index: int = 0  # its position in Problem.edges (the ILP's transportation variables e[index])


@dataclass
class HoldTerm:
    key: tuple[object, ...]
    nbytes: float  # all instances
    saver: str = ""  # the template of the first node that saves it (it is alive from there)
    # h >= [group_u in idx_u] (+ [group_v in idx_v] - 1 when group_v is given)
    conditions: list[tuple[str, frozenset[int], str | None, frozenset[int]]] = field(default_factory=list)
    # saved inside a recomputed segment (planner.schemes.recompute): not held through the step,
    # alive again while its segment's backward runs (an in-flight term of planner.peak)
    recomputed: bool = False


@dataclass
class Problem:
    mesh: Mesh
    hardware: HardwareProfile
    graph: IRGraph
    groups: dict[str, Group]
    node_group: dict[str, str]
    choices: dict[str, list[Strategy]]
    conversions: dict[tuple[object, ...], ConversionTerm]
    holds: dict[tuple[object, ...], HoldTerm]
    edges: dict[tuple[object, ...], EdgeTerm] = field(default_factory=dict)
    zero_stage: int = 0
    master_dtype: str | None = None
    prefetch: bool = False  # ZeRO-3 parameter gathers started one ahead (planner.overlap)
    cdp: str = "off"  # cyclic data parallelism over the dp axis: off, v1, v2 (planner.cdp)
    cdp_stages: int = 0
    param_stage: dict[str, int] = field(default_factory=dict)  # CDP: parameter node -> stage
    cdp_owned: dict[str, list[float]] = field(default_factory=dict)  # CDP + ZeRO: owner bytes per strategy
    instances: dict[str, int] = field(default_factory=dict)  # template -> number of instances
    build_seconds: float = 0.0
    edges_priced: bool = False  # conversion and hold terms built (price_edges)
    # gradient accumulation: the graph is one micro-batch; a step runs this many of them one after
    # another and syncs gradients once (forward/backward terms repeat, the step phase does not)
    micro_batches: int = 1
    # activation recomputation of repeated layers (planner.schemes.recompute): none or full
    recompute: str = "none"
    # the gradient sync's collectives packed into buckets of this many bytes (planner.buckets)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    packed_whole: bool = True  # every packed gradient fits one bucket, whatever the choices
    # the bytes whose share of one latency a packed gradient pays (Comm.bucket_bytes of the sync):
    # bucket_bytes, or, when every choice packs into one bucket, the most any choice packs (so a
    # model smaller than a bucket pays one whole latency per collective, as the runtime runs it)
    sync_share_bytes: int = DEFAULT_BUCKET_BYTES
    # the bytes whose share of one latency a ZeRO-3 unit member pays: a block's parameters (a unit
    # is a block's gathers), at most bucket_bytes
    unit_share_bytes: int = DEFAULT_BUCKET_BYTES
    zero1_reduce: str = "reduce_scatter"  # how ZeRO-1 sums its gradients (zero1_reduce)
    node_terms: dict[str, NodeTerms] = field(default_factory=dict)  # by template
    # the conversions into each consumer template's input, a form over x (within a group) or e
    # (an edge's pair of Specs): the bytes the conversion of the pair chosen holds while it runs
    conversion_work: list[tuple[str, Form]] = field(default_factory=list)
    instants: list[Instant] | None = None  # the moments the peak may happen (planner.peak; price_edges makes them)
    # CDP: each stage's gradient buffer (a form over x) and the last op of each stage but the last
    # (planner.cdp.stage_buffers; a worker past the chain's head receives a partial sum that size)
    stage_sums: list[Form] = field(default_factory=list)
    stage_ends: list[str] = field(default_factory=list)
    # the gradient sync's exposure (planner.overlap.sync_rows): E >= each form (seconds over x),
    # E >= 0; a step hides overlap_efficiency * (sum of Group.sync chosen - E)
    sync_rows: list[Form] = field(default_factory=list)

    @property
    def overlap_efficiency(self) -> float:
        return self.hardware.overlap_efficiency

    def hideable(self, group: Group) -> list[float]:
        """Per strategy, the most of ``group.time`` any evaluation hides behind compute: its credit
        (ZeRO-3 prefetch, CDP) and its share of the overlapped gradient sync."""
        eff = self.overlap_efficiency
        sync = group.sync or [0.0] * len(group.time)
        credit = group.credit or [0.0] * len(group.time)
        return [c + eff * t for c, t in zip(credit, sync, strict=True)]

    def recomputes(self, node: Node) -> bool:
        """Whether ``node`` runs in a recomputed segment (its forward runs again in backward)."""
        return self.recompute != "none" and node.name in recompute_scheme.segments(self.graph, self.recompute)

    @property
    def in_units(self) -> bool:
        """ZeRO-3 gathers its parameters in units (planner.overlap; CDP never runs with ZeRO-3)."""
        return self.zero_stage == 3

    def repeats(self, comm: Comm) -> int:
        """How many times per step ``comm`` runs: once per micro-batch, except the step phase's."""
        return 1 if comm.phase == "step" else self.micro_batches

    def bucket_transient(self, packed: float) -> float:
        """The gradient sync's largest temporary when ``packed`` bytes of gradients are packed into
        buckets: a bucket's buffer, cut from its gradients when the last arrives (they then live in
        it; runtime.buckets). All of ``packed`` when every choice packs into one bucket (linear);
        otherwise a full bucket in every plan (at most one bucket too many, for a plan that packs
        less, on a model whose gradients can fill several)."""
        if self.packed_whole:
            return packed
        return float(self.bucket_bytes)

    @property
    def num_choices(self) -> int:
        return sum(len(g.strategies) for g in self.groups.values())


StrategyFilter = Callable[[Node, Strategy], bool]


def build_problem(
    graph: IRGraph,
    mesh: Mesh,
    hardware: HardwareProfile,
    *,
    optimizer: str = "adamw",
    zero_stage: int = 0,
    master_dtype: str | None = None,
    prefetch: bool = True,
    cdp: str = "off",
    cdp_stages: int = 4,
    allow: StrategyFilter | None = None,
    edges: bool = True,
    micro_batches: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    recompute: str = "none",
) -> Problem:
    """``micro_batches`` (gradient accumulation): ``graph`` is traced on one micro-batch (the
    global batch / ``micro_batches``); a step runs the forward and backward that many times,
    holding one micro-batch's activations, and syncs gradients and steps the optimizer once.

    ``edges=False`` leaves out the conversion and hold terms (most of the building time):
    enough for the bounds of :mod:`planner.front`; :func:`price_edges` adds them before a solve.

    ``allow(node, strategy)``, when given, pins choices: an anchor keeps only the strategies it
    accepts (a ValueError names the node if it accepts none).

    ZeRO (Rajbhandari et al. 2020) over the data-parallel axes, for fp32 AdamW (4 B parameter,
    4 B gradient, 8 B optimizer state per value; ``b`` the local bytes of a parameter after tensor
    parallelism, ``D`` the data-parallel degree): stage 0 holds b + b + 2b and all-reduces the
    gradient (ring 2(D-1)/D b); stage 1 holds b + b + 2b/D; stage 2 b + b/D + 2b/D, both
    reduce-scattering the gradient and all-gathering the updated shard (the same ring volume); stage
    3 holds b/D + b/D + 2b/D: parameters are stored split over the data-parallel axes, gathered
    before use (kept for backward, or, ``+zero3`` strategies, freed and gathered again), and their
    gradients reduce-scattered in backward: 3(D-1)/D b when re-gathered. A parameter whose dims
    cannot be split D ways stays as in stage 0.

    ``bucket_bytes``: the size of the buckets the gradient sync packs its collectives into (an
    all-reduce, or ZeRO-1/2's reduce-scatter and all-gather; :mod:`planner.buckets`), priced as each
    gradient's share of a bucket's latency.

    ``master_dtype`` (e.g. ``"float32"``, mixed precision): parameters and gradients stay in the
    traced dtype, the optimizer adds a master copy and keeps its states in ``master_dtype``
    (:func:`planner.cost.optimizer_bytes_per_value`); everything else is priced in the traced dtype.

    ``recompute="full"``: each instance of a repeated layer is recomputed in backward
    (:mod:`planner.schemes.recompute`: its forward priced again, its saved tensors held only while
    its backward runs); ``"selective"``: each attention core of one."""
    t0 = time.perf_counter()
    recompute_scheme.check((recompute,))
    why = recompute_scheme.unsupported(recompute, zero_stage, cdp)
    if why:
        raise ValueError(f"recompute={recompute!r} with ZeRO-{zero_stage}, CDP {cdp}: {why}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if micro_batches > 1 and cdp != "off":
        raise ValueError(f"CDP staggers its own micro-batches; micro_batches={micro_batches} needs cdp='off' (got {cdp!r})")
    choices: dict[str, list[Strategy]] = {}
    node_group: dict[str, str] = {}
    groups: dict[str, Group] = {}
    instances: dict[str, int] = defaultdict(int, {template: len(nodes) for template, nodes in _instances(graph).items()})
    op_anchors = {
        node.name: graph.memo(("anchors", node.name, mesh), lambda node=node: anchor_strategies(node, graph, mesh))  # type: ignore[misc]
        for node in graph.nodes.values()
        if node.kind == "op" and node.template == node.name and not is_follower(node, graph)
    }
    dp_axes = tuple(a for a in mesh.dp_axes if mesh.degree(a) > 1)
    param_stage: dict[str, int] = {}
    if cdp != "off":
        from planner.cdp import batch_independent, cdp_filter, parameter_stages, partial_gradient_variants

        if len(dp_axes) != 1 or zero_stage not in (0, 1):
            raise ValueError(f"CDP needs one data-parallel axis of degree > 1 and ZeRO 0 or 1; mesh {mesh}, ZeRO {zero_stage}")
        allow = cdp_filter(graph, dp_axes, base=allow)
        param_stage = parameter_stages(graph, cdp_stages)
        independent = batch_independent(graph)
        for name in independent & set(op_anchors):
            op_anchors[name] = partial_gradient_variants(graph.nodes[name], op_anchors[name], dp_axes)
    unit_share = _unit_share_bytes(graph, bucket_bytes)
    if zero_stage == 3 and dp_axes:
        for name, strategies in op_anchors.items():
            node = graph.nodes[name]
            params: dict[int, int | None] = {p: None for p, ref in enumerate(node.inputs) if graph.nodes[ref.node].kind == "param"}
            if params:
                op_anchors[name] = regather_variants(RuleContext(node, graph, mesh), strategies, params, axes=dp_axes, bucket_bytes=unit_share)
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
            leader = choices[ref.node]
            cache: dict[Spec | None, Strategy] = {}
            out = []
            for s in leader:
                spec = s.outputs[ref.index]
                if spec not in cache:
                    cache[spec] = follow(ctx, spec) if spec is not None else Strategy("follow", "op", (), (None,))
                out.append(cache[spec])
            choices[node.name] = out
            node_group[node.name] = node_group[ref.node]
        else:
            if node.name in op_anchors:
                strategies = op_anchors[node.name]
            elif node.kind == "param":
                strategies = _param_strategies(node, mesh, [(op_anchors.get(c), p) for c, p in consumers[node.name]], zero3=zero_stage == 3)
            else:
                strategies = anchor_strategies(node, graph, mesh)
            if allow is not None:
                kept = [s for s in strategies if allow(node, s)]
                if not kept:
                    options = sorted({s.algorithm for s in strategies})
                    raise ValueError(f"the strategy filter rejects every strategy of {node.name} ({node.target}); its options: {options}")
                strategies = kept
            if node.kind == "param":
                dp = frozenset(a for a in mesh.dp_axes if mesh.degree(a) > 1)
                strategies = [
                    Strategy(s.algorithm, s.kernel, s.inputs, (Spec(s.outputs[0].layout, dp - s.outputs[0].layout.shard_axes),))  # type: ignore[union-attr]
                    for s in strategies
                    if s.outputs[0]
                ]
            choices[node.name] = strategies
            node_group[node.name] = node.name
            n = len(strategies)
            groups[node.name] = Group(
                node.name, strategies, instances[node.name], [0.0] * n, [0.0] * n, [(0.0, 0.0, 0.0)] * n,
                [[] for _ in range(n)], [0.0] * n, credit=[0.0] * n, sync=[0.0] * n,
            )
    problem = Problem(mesh, hardware, graph, groups, node_group, choices, conversions={}, holds={}, instances=dict(instances))
    problem.zero_stage = zero_stage
    problem.micro_batches = micro_batches
    problem.recompute = recompute
    problem.bucket_bytes = bucket_bytes
    problem.master_dtype = master_dtype
    problem.prefetch = prefetch and zero_stage == 3 and bool(dp_axes)
    problem.cdp, problem.cdp_stages, problem.param_stage = cdp, (cdp_stages if cdp != "off" else 0), param_stage
    master_itemsize = dtype_itemsize(master_dtype) if master_dtype else None
    most = _most_packed(problem) if cdp == "off" else 0
    problem.packed_whole = most <= bucket_bytes  # no gradient packed (most = 0) is whole too
    problem.sync_share_bytes = most if 0 < most <= bucket_bytes else bucket_bytes
    if zero_stage == 1 and cdp == "off":
        problem.zero1_reduce = zero1_reduce(mesh, hardware, mesh.sort_axes(frozenset(dp_axes)), min(most, bucket_bytes))
    problem.unit_share_bytes = unit_share
    sync, backward = _price_nodes(problem, optimizer, master_itemsize)
    problem.sync_rows = sync_rows(graph, node_group, sync, backward)
    problem.build_seconds = time.perf_counter() - t0
    if edges:
        price_edges(problem)
    return problem


def price_edges(problem: Problem) -> Problem:
    """Add the conversion and hold terms (once; a problem built with ``edges=False`` needs them
    before it is solved or evaluated)."""
    if not problem.edges_priced:
        t0 = time.perf_counter()
        _shared_edges(problem)
        if problem.cdp != "off":
            from planner.cdp import stage_buffers

            problem.stage_sums, problem.stage_ends = stage_buffers(problem)
        problem.instants = instants(problem)
        problem.edges_priced = True
        problem.build_seconds += time.perf_counter() - t0
    return problem


_PRICED_KEPT = 4  # the priced terms of the last few problems a graph's searches priced


def _shared_edges(problem: Problem) -> None:
    """:func:`_price_edges`, or the terms an earlier problem priced from the same inputs (the
    graph, mesh, hardware, strategies, micro-batch count and ZeRO-3's units): ZeRO 0, 1 and 2 of
    one mesh have the same strategies, so a search prices their edges once (measured, gpt2-small
    on 64 devices, one plan: 21 of the 35 problems it prices are priced, the rest share). The
    terms are not changed after pricing, so the problems share them. The last
    :data:`_PRICED_KEPT` are kept on the graph, so what a search drops is freed."""
    key = (problem.mesh, id(problem.hardware), problem.micro_batches, problem.in_units and problem.unit_share_bytes, problem.recompute,
           tuple((g, tuple(grp.strategies)) for g, grp in problem.groups.items()))
    kept = cast(dict[object, tuple[object, ...]], problem.graph.memo("priced_edges", dict))
    entry = kept.pop(key, None)
    if entry is None or entry[0] is not problem.hardware:
        _price_edges(problem)
        entry = (problem.hardware, problem.conversions, problem.holds, problem.edges, problem.conversion_work)
    else:
        problem.conversions, problem.holds, problem.edges, problem.conversion_work = entry[1:]  # type: ignore[assignment]
    kept[key] = entry  # the newest last
    while len(kept) > _PRICED_KEPT:
        del kept[next(iter(kept))]


def _param_strategies(node: Node, mesh: Mesh, consumers: list[tuple[list[Strategy] | None, int]], *, zero3: bool = False) -> list[Strategy]:
    """Storage layouts of a parameter: each layout a consumer computes with, and that layout
    further split over the tensor-parallel axes it leaves idle (gathered before use: 2-D/3-D
    weights, ZeRO-3-like over tp). Every layout, when a consumer is not an anchor. With ``zero3``,
    each layout is also split over the data-parallel axes where a dim allows it."""
    if zero3:
        base = _param_strategies(node, mesh, consumers)
        dp = tuple(a for a in mesh.dp_axes if mesh.degree(a) > 1)
        out = []
        for s in base:
            lay = s.outputs[0].layout  # type: ignore[union-attr]
            if set(dp) <= lay.shard_axes:
                out.append(Strategy("zero3", "source", (), (Spec(lay),)))
                continue
            for d in sorted(range(lay.ndim), key=lambda k: not lay.dims[k]):
                dims = list(lay.dims)
                dims[d] = (*dims[d], *dp)
                ext = Layout(tuple(dims))
                if dp and ext.divides(node.out.shape, mesh):
                    out.append(Strategy("zero3", "source", (), (Spec(ext),)))
                    break
            else:
                out.append(s)
        return dedupe(out)
    if any(strategies is None for strategies, _ in consumers):
        return anchor_strategies(node, None, mesh)  # type: ignore[arg-type]
    wanted: dict[Layout, None] = {}
    for strategies, pos in consumers:
        for s in strategies or ():
            if pos < len(s.inputs):
                wanted[Layout(s.inputs[pos].layout.dims)] = None
    tp = [a for a in mesh.tp_axes if mesh.degree(a) > 1]
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


def _unit_share_bytes(graph: IRGraph, bucket_bytes: int) -> int:
    """A ZeRO-3 unit's bytes, for its members' shares of its latency: the largest block's
    parameters (whole; a unit gathers one block), the largest parameter where there are no
    blocks, at most ``bucket_bytes``. A unit of a smaller block, or of tensor-parallel shards,
    pays less than one whole latency."""
    blocks: dict[tuple[str, int], int] = defaultdict(int)
    largest = 0
    for node in graph.nodes.values():
        if node.kind != "param":
            continue
        largest = max(largest, node.out.nbytes)
        layer = match_layer(node.param_names[0]) if node.param_names else None
        if layer is not None:
            blocks[layer] += node.out.nbytes
    most = max(blocks.values(), default=largest)
    return min(bucket_bytes, most) if most > 0 else bucket_bytes


def zero1_reduce(mesh: Mesh, hardware: HardwareProfile, axes: tuple[str, ...], bucket: int) -> str:
    """ZeRO-1's gradient sum, the faster on ``hardware`` for a bucket of ``bucket`` bytes: a
    reduce-scatter moves half an all-reduce's bytes in half its steps, but gloo's reduce-scatter
    costs about as much as its all-reduce (measured: ``planner calibrate``'s per-kind fits), as
    ZeroRedundancyOptimizer's all-reduce then broadcasts rely on."""
    if not axes or bucket <= 0:
        return "reduce_scatter"
    scatter = comm_time(Comm("reduce_scatter", axes, bucket, "step"), mesh, hardware)
    return "all_reduce" if comm_time(Comm("all_reduce", axes, bucket, "step"), mesh, hardware) < scatter else "reduce_scatter"


def _most_packed(problem: Problem) -> int:
    """The most gradient bytes any assignment packs into buckets (each parameter at its largest)."""
    graph, mesh = problem.graph, problem.mesh
    most = 0
    for node in graph.nodes.values():
        if node.kind != "param" or node.template != node.name:
            continue
        largest = 0
        for strategy in problem.choices[node.name]:
            spec = strategy.outputs[0]
            assert spec is not None
            step = zero_param_terms(node.out.shape, node.out.itemsize, spec, mesh, problem.zero_stage, 1.0, problem.bucket_bytes)[3]
            largest = max(largest, max((c.nbytes for c in step if c.bucket_bytes), default=0))
        most += largest * problem.instances[node.name]
    return most


def zero_param_terms(
    shape: tuple[int, ...], itemsize: int, spec: Spec, mesh: Mesh, stage: int, opt_factor: float, bucket_bytes: int = 0,
    reduce: str = "reduce_scatter",
) -> tuple[float, float, float, list[Comm]]:
    """(parameter, gradient, optimizer-state bytes held per device, step-phase collectives). A
    gradient's collectives are packed into ``bucket_bytes`` buckets (0: alone). ``reduce``: how
    ZeRO-1 sums the gradients (its gradients are whole on every rank, so an all-reduce serves as
    well as a reduce-scatter: :func:`zero1_reduce` picks the faster on the hardware)."""
    local_shape = spec.layout.local_shape(shape, mesh)
    local = float(itemsize)
    for n in local_shape:
        local *= n
    dp = mesh.sort_axes(spec.grad_partial)
    degree = mesh.group_size(dp)
    if not dp:  # stage 3 storage (split over dp: reduced in backward), or no data parallelism
        return local, local, local * opt_factor, []
    if stage in (1, 2) and zero_dim(local_shape, degree) is not None:
        # stage 2 reduce-scatters each gradient as soon as backward has it (and frees it)
        grads = local / degree if stage == 2 else local
        kind = reduce if stage == 1 else "reduce_scatter"
        comms = [Comm(kind, dp, int(local), "bwd" if stage == 2 else "step", bucket_bytes), Comm("all_gather", dp, int(local), "step", bucket_bytes)]
        return local, grads, local * opt_factor / degree, comms
    return local, local, local * opt_factor, [Comm("all_reduce", dp, int(local), "step", bucket_bytes)]


def _input_spec_bytes(graph: IRGraph, ref: InputRef) -> int:
    meta = graph.nodes[ref.node].outputs[ref.index]
    return meta.nbytes if meta is not None else 0


def input_bytes(graph: IRGraph, node: Node, strategy: Strategy, mesh: Mesh) -> int:
    """Local bytes of ``node``'s inputs in the layouts ``strategy`` computes on."""
    return sum(
        _input_spec_bytes(graph, ref) // spec.layout.shard_factor(mesh)
        for ref, spec in zip(node.inputs, strategy.inputs, strict=False)
    )


def _price_nodes(problem: Problem, optimizer: str, master_itemsize: int | None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Price every template's strategies into its group. Returns, per template and strategy, one
    instance's seconds of gradient sync that runs beside backward, and one instance's backward
    compute as often as that sync runs (once a step, or once per micro-batch for ZeRO-2's
    reduce-scatter): the inputs of :func:`planner.overlap.sync_rows`."""
    graph, mesh, hw = problem.graph, problem.mesh, problem.hardware
    sync_one: dict[str, list[float]] = {}
    backward_one: dict[str, list[float]] = {}
    overlaps = problem.cdp == "off" and not problem.in_units  # CDP and ZeRO-3 hide their own way
    sync_repeats = problem.micro_batches if problem.zero_stage == 2 else 1
    consumers_of = graph.consumers()
    consumers_of_output = graph.nodes["output"].inputs[0].node
    for node in graph.nodes.values():
        if node.kind == "output" or node.template != node.name:
            continue
        group = problem.groups[problem.node_group[node.name]]
        count = problem.instances[node.name]
        n = len(problem.choices[node.name])
        terms = problem.node_terms[node.name] = NodeTerms([0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n)
        for i, strategy in enumerate(problem.choices[node.name]):
            in_bytes = input_bytes(graph, node, strategy, mesh)
            # forward and backward run once per micro-batch
            compute = t = (compute_time(node, strategy, mesh, hw, in_bytes) * problem.micro_batches) if node.kind == "op" else 0.0
            comms = list(strategy.comms)
            if node.kind == "param":
                spec = strategy.outputs[0]
                assert spec is not None
                opt_factor = optimizer_bytes_per_value(optimizer, node.out.itemsize, master_itemsize) / node.out.itemsize
                params, grads, states, step = zero_param_terms(node.out.shape, node.out.itemsize, spec, mesh, problem.zero_stage, opt_factor,
                                                               problem.sync_share_bytes, problem.zero1_reduce)
                held = 0.0  # bytes of a buffer held through the whole step (CDP v1)
                if problem.cdp != "off":  # the chain and the ring instead of the all-reduce
                    params, grads, states, step = zero_param_terms(node.out.shape, node.out.itemsize, spec, mesh, 0, opt_factor)
                    step = [Comm("send", c.axes, c.nbytes, "bwd") for c in step for _ in range(2)]
                    if problem.zero_stage == 1:
                        # states and a master copy live on the stage's owner only: 1/N on average
                        # here (linear); evaluate() puts the busiest owner's exact share back
                        owned = states + params
                        problem.cdp_owned.setdefault(node.name, [0.0] * len(problem.choices[node.name]))[i] = owned
                        states = owned / mesh.group_size(spec.grad_partial)
                    if problem.cdp == "v2":
                        params += params  # the previous parameter version
                    else:
                        # v1: the previous step's buffer (its summed gradient, applied one step
                        # late; ZeRO: the parameters the owner sent, installed one step late),
                        # alive through the whole step, beside this step's gradient
                        held = params
                        grads += held
                comms += step
                if overlaps:
                    # with several micro-batches ZeRO-2's reduce-scatters run beside every backward (rows
                    # scaled by sync_repeats); its step-phase all-reduces, beside the last one only, are
                    # then not credited (a small, conservative error)
                    hidden = sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in step
                                 if c.bucket_bytes and c.kind in ASYNC_SYNC and (sync_repeats == 1 or c.phase == "bwd"))
                    sync_one.setdefault(node.name, [0.0] * n)[i] = hidden
                    group.sync[i] += hidden * count
                if not group.bucketed:
                    group.bucketed = [0.0] * len(group.strategies)
                group.bucketed[i] += max((c.nbytes for c in step if c.bucket_bytes), default=0) * count
                p, g, o = group.param_memory[i]
                group.param_memory[i] = (p + params * count, g + grads * count, o + states * count)
                terms.grads[i] = grads - held
                terms.held[i] = held
                group.memory[i] += (params + grads + states) * count
                # the step's temporaries: one copy of the parameter's size for its gradient sync
                # (the all-reduce's copy; ZeRO-1/2: the reduce-scatter's output and clones of the
                # other chunks, then gloo's staging buffer of the all-gather into the parameter,
                # runtime.collectives), and the optimizer's own: torch's single-tensor AdamW computes
                # sqrt(v) and its quotient (two tensors the size of what it updates) while the
                # previous tensor's quotient is still bound to its loop variable (measured, HF Llama:
                # three at once; a transformer's consecutive weights have the same size, so three
                # of this one's); SGD with momentum: one
                local = params / (2 if problem.cdp == "v2" else 1)
                updated = states / opt_factor if opt_factor else 0.0
                t += optimizer_step_time(optimizer, updated, hw)
                temps = (3 if optimizer in ("adamw", "adam") else 1) * updated
                kinds = {c.kind for c in step}
                sync = local if kinds & {"all_reduce", "reduce_scatter", "all_gather"} else 0.0
                if not group.step_transient:
                    group.step_transient = [0.0] * len(group.strategies)
                group.step_transient[i] = max(group.step_transient[i], temps, sync)
                if sum(1 for c, _ in consumers_of[node.name] if graph.nodes[c].kind == "op") > 1:
                    # a weight read twice (tied): backward holds both gradient contributions while summing
                    group.transient[i] = max(group.transient[i], local)
                    terms.work[i] = local
            recomputed = problem.recomputes(node)
            if recomputed:  # the forward runs again in backward: its compute and its forward collectives
                flops = node.flops_fwd + node.flops_bwd
                again = recompute_scheme.rerun_comms(node, strategy, mesh, node.name in recompute_scheme.last_savers(graph, problem.recompute))
                rerun = compute * (node.flops_fwd / flops if flops else 1 / 3)
                t += rerun
                comms += again
                if not group.rerun:
                    group.rerun = [0.0] * len(group.strategies)
                group.rerun[i] += (rerun + sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in again)) * count
            if problem.cdp != "off" and node.target in LOSS_TARGETS:  # CDP: local count x N, no all-reduce
                comms = [c for c in comms if not (c.kind == "all_reduce" and set(c.axes) & set(mesh.dp_axes))]
            if node.name == consumers_of_output:
                partial = strategy.outputs[0].layout.partial if strategy.outputs[0] else frozenset()
                if problem.cdp != "off":  # CDPTrainer returns each worker's share of the loss
                    partial = partial - set(mesh.dp_axes)
                if partial:
                    comms.append(Comm("all_reduce", mesh.sort_axes(partial), node.out.itemsize, "fwd"))
            t += sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in comms)
            group.time[i] += t * count
            if node.kind == "op":
                total_flops = node.flops_fwd + node.flops_bwd
                share = node.flops_fwd / total_flops if total_flops else 1 / 3  # as planner.overlap.forward_compute
                if problem.prefetch:  # a gather can travel during this op's forward
                    group.credit[i] += compute * share * count
                if overlaps:
                    backward_one.setdefault(node.name, [0.0] * n)[i] = compute / problem.micro_batches * (1 - share) * sync_repeats
            if problem.cdp != "off":  # the messages evaluate() re-prices and overlaps
                group.credit[i] += sum(comm_time(c, mesh, hw) for c in comms if c.kind == "send") * count
            group.comms[i].extend((c, count * problem.repeats(c)) for c in comms)
            internal = sum(saved.nbytes for saved in node.saved if saved.source == "internal") / mesh.group_size(strategy.split_axes)
            if node.kind == "op":
                terms.work[i] = float(op_working_set(graph, node, strategy, mesh, internal))
                group.transient[i] = max(group.transient[i], terms.work[i])
            terms.saved[i] = internal
            if not recomputed:  # a recomputed op's intermediates live only while its segment's backward runs (planner.peak)
                group.memory[i] += internal * count
    return sync_one, backward_one


def _conversion_working_sets(nbytes: int, src: Spec, dst: Spec, mesh: Mesh, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """The working sets of the two halves of ``src -> dst`` on a tensor of ``nbytes``
    (:func:`planner.cost.steps_working_set`): the forward steps on its local bytes in ``src``, the
    backward steps on its gradient's in ``dst``."""
    return _conversion_cache(mesh).working_sets(spec_id(src), spec_id(dst), nbytes, shape)


def op_working_set(graph: IRGraph, node: Node, strategy: Strategy, mesh: Mesh, internal: float) -> float:
    """Bytes live while ``node`` runs under ``strategy``, the largest of:

    * its kernel: local inputs in the layouts it computes with, local outputs (the raw, partial
      output when the strategy reduces it itself) and the intermediates it saves. Forward, the
      inputs and outputs; backward, their gradients and the gradient of each saved intermediate
      (an op autograd runs as steps, e.g. cross-entropy = log_softmax + nll_loss: measured at
      log_softmax's backward, the saved log-probs, their gradient and the logits' gradient are
      alive at once);
    * its own output reduction (``raw_output``: all-reduce or reduce-scatter forward, all-gather
      of the gradient backward): that conversion's working set;
    * each input it gathers itself (``regather``): the kernel's inputs with that one still
      arriving, plus the gather's working set (arrival, result and buffers); backward, the
      reduction of that input's gradient."""
    computes = dict(strategy.regather)
    kernel_in = sum(
        _input_spec_bytes(graph, ref) // computes.get(p, spec).layout.shard_factor(mesh)
        for p, (ref, spec) in enumerate(zip(node.inputs, strategy.inputs, strict=False))
    )
    outs = (strategy.raw_output, *strategy.outputs[1:]) if strategy.raw_output is not None else strategy.outputs
    out_local = sum(m.nbytes // s.layout.shard_factor(mesh) for m, s in zip(node.outputs, outs, strict=False) if m is not None and s is not None)
    peak = kernel_in + out_local + internal
    final = strategy.outputs[0]
    if strategy.raw_output is not None and final is not None:
        reduce, gather = _conversion_working_sets(node.out.nbytes, strategy.raw_output, final, mesh, node.out.shape)
        peak = max(peak, reduce, gather if node.requires_grad else 0)
    for p, compute in strategy.regather:
        nbytes = _input_spec_bytes(graph, node.inputs[p])
        meta = graph.nodes[node.inputs[p].node].outputs[node.inputs[p].index]
        gather, reduce = _conversion_working_sets(nbytes, strategy.inputs[p], compute, mesh, meta.shape if meta is not None else None)
        peak = max(peak, kernel_in - nbytes // compute.layout.shard_factor(mesh) + gather, reduce)
    return peak


def _root(graph: IRGraph, ref: InputRef) -> InputRef:
    """The tensor whose storage a saved ``ref`` keeps alive, as a hold term counts it: up through
    alias ops (views, transposes, reshapes, expands) while they do not cut a piece, so every
    consumer that saves one storage through different views shares one term. A piece (of a split
    or chunk, smaller than what it is cut from) is its own tensor: saved in another layout than it
    was made in, what backward holds is the converted copy, of the piece's size (measured, HF Mixtral under 1-D: the gate and up
    halves of the experts' fused projection, all-reduced for a replicated SiLU and reduce-scattered
    for the product, hold 40 KB; the fused output the halves are cut from would count 80 KB), and
    saved as made, the pieces a model cuts are saved together (q, k, v; gate and up) and add up to
    the whole."""
    meta = graph.nodes[ref.node].outputs[ref.index]
    node = graph.nodes[ref.node]
    while node.kind == "op" and node.alias_input is not None and node.inputs:
        up = node.inputs[node.alias_input]
        up_meta = graph.nodes[up.node].outputs[up.index]
        if up_meta is None or meta is None or up_meta.nbytes > meta.nbytes:
            break
        ref, meta = up, up_meta
        node = graph.nodes[ref.node]
    return ref


def _spec_sets(ids: tuple[int, ...]) -> dict[int, frozenset[int]]:
    """Strategy indices grouped by the Spec (its interned id, :func:`spec_id`) they produce or need."""
    sets: dict[int, list[int]] = defaultdict(list)
    for i, sid in enumerate(ids):
        if sid >= 0:
            sets[sid].append(i)
    return {sid: frozenset(idx) for sid, idx in sets.items()}


_SPEC_IDS: dict[Spec, int] = {}
_SPECS: list[Spec] = []


def spec_id(spec: Spec | None) -> int:
    """A small integer standing for ``spec`` (-1 for None), the same for equal Specs in this
    process: edges and conversion keys hold these, so pricing a problem's tens of thousands of
    (output, need) pairs hashes integers, not Specs."""
    if spec is None:
        return -1
    sid = _SPEC_IDS.get(spec)
    if sid is None:
        sid = _SPEC_IDS[spec] = len(_SPECS)
        _SPECS.append(spec)
    return sid


def spec_of(sid: int) -> Spec:
    """The Spec an id of :func:`spec_id` stands for."""
    return _SPECS[sid]


class _ConversionCache:
    """The conversions of one mesh by Spec ids, and their collectives by (ids, bytes, with gradient):
    the problems of one mesh (ZeRO stages, CDP modes, micro-batch counts) share them, and tensors
    of different sizes in the same pair of Specs share the steps."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.steps: dict[tuple[int, int], Conversion] = {}
        self.comms: dict[tuple[int, int, int, bool, int], tuple[Comm, ...]] = {}
        self.works: dict[tuple[int, int, int, tuple[int, ...] | None], tuple[int, int]] = {}

    def conversion(self, a: int, b: int) -> Conversion:
        """The steps from Spec id ``a`` to ``b``."""
        conv = self.steps.get((a, b))
        if conv is None:
            conv = self.steps[(a, b)] = spec_conversion(spec_of(a), spec_of(b), self.mesh)
        return conv

    def conversion_comms(self, a: int, b: int, nbytes: int, with_grad: bool, bucket_bytes: int = 0) -> tuple[Comm, ...]:
        """The collectives of ``a -> b`` on a tensor of ``nbytes``; with ``bucket_bytes``, run
        inside ZeRO-3 units of that size (each a share of a unit's latency, planner.overlap)."""
        key = (a, b, nbytes, with_grad, bucket_bytes)
        comms = self.comms.get(key)
        if comms is None:
            mesh, conv = self.mesh, self.conversion(a, b)
            comms = steps_comms(conv.forward, nbytes // spec_of(a).layout.shard_factor(mesh), mesh, "fwd")
            if with_grad:
                comms += steps_comms(conv.backward, nbytes // spec_of(b).layout.shard_factor(mesh), mesh, "bwd")
            if bucket_bytes:
                comms = tuple(replace(c, bucket_bytes=bucket_bytes) for c in comms)
            self.comms[key] = comms
        return comms


    def working_sets(self, a: int, b: int, nbytes: int, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
        """The working sets of the two halves of ``a -> b`` on a tensor of ``nbytes`` (of
        ``shape``, where known: :func:`planner.cost.steps_working_set`): the forward steps on its
        local bytes in ``a``, the backward steps on its gradient's in ``b``."""
        key = (a, b, nbytes, shape)
        works = self.works.get(key)
        if works is None:
            mesh, conv, src, dst = self.mesh, self.conversion(a, b), spec_of(a).layout, spec_of(b).layout
            fits = shape is not None and src.divides(shape, mesh) and dst.divides(shape, mesh)
            works = self.works[key] = (
                steps_working_set(conv.forward, nbytes // src.shard_factor(mesh), mesh, src.local_shape(shape, mesh) if fits else None),  # type: ignore[arg-type]
                steps_working_set(conv.backward, nbytes // dst.shard_factor(mesh), mesh, dst.local_shape(shape, mesh) if fits else None),  # type: ignore[arg-type]
            )
        return works


@functools.lru_cache(maxsize=8)  # the last few meshes' (a search solves one mesh's configurations together)
def _conversion_cache(mesh: Mesh) -> _ConversionCache:
    return _ConversionCache(mesh)


def _price_edges(problem: Problem) -> None:
    """Conversion terms of every producer -> consumer edge. Identical edges of the instances of a
    repeated layer are gathered first and priced once (their producers counted together)."""
    graph, mesh, hw = problem.graph, problem.mesh, problem.hardware
    consumers = graph.consumers()
    signatures: dict[str, tuple[tuple[str, int], ...]] = {}
    # (producer template, output index, consumer template, input position, signature) -> producers
    pending: dict[tuple[str, int, str, int, tuple[tuple[str, int], ...]], set[str]] = {}
    for v in graph.nodes.values():
        if v.kind == "output":
            continue
        for p, ref in enumerate(v.inputs):
            u = graph.nodes[ref.node]
            if u.outputs[ref.index] is None:
                continue
            signature = signatures.get(u.name)
            if signature is None:
                signature = signatures[u.name] = tuple(sorted({(graph.nodes[c].template, q) for c, q in consumers[u.name]}))
            # templates stand for their instances: same strategies, same groups
            pending.setdefault((u.template, ref.index, v.template, p, signature), set()).add(u.name)
            if v.template == v.name:
                _price_holds(problem, v, p, ref)
    outs: dict[tuple[str, int], tuple[int, ...]] = {}  # interned Spec ids per strategy, each end
    ins: dict[tuple[str, int], tuple[int, ...]] = {}
    cache = _conversion_cache(mesh)
    sig_ids: dict[tuple[tuple[str, int], ...], int] = {}  # the conversion keys hold a consumer signature's id
    works_seen: set[tuple[str, frozenset[tuple[tuple[object, ...], float]]]] = set()
    helds: dict[tuple[str, int, int, int], float] = {}  # bytes a conversion holds while it runs
    for (ut, index, vt, p, signature), producers in pending.items():
        u = graph.nodes[ut]
        gu, gv = problem.node_group[ut], problem.node_group[vt]
        meta = u.outputs[index]
        assert meta is not None
        with_grad = u.requires_grad and meta.is_float
        if (ut, index) not in outs:
            outs[(ut, index)] = tuple(spec_id(s.outputs[index]) for s in problem.choices[ut])
        if (vt, p) not in ins:
            ins[(vt, p)] = tuple(spec_id(t.inputs[p] if p < len(t.inputs) else None) for t in problem.choices[vt])
        su, sv = outs[(ut, index)], ins[(vt, p)]
        pairs: dict[tuple[int, int], tuple[frozenset[int], frozenset[int]]] = {}
        edge: EdgeTerm | None = None
        if gu == gv:  # one choice drives both ends: strategy i meets strategy i
            for i, (a, b) in enumerate(zip(su, sv, strict=True)):
                if a >= 0 and b >= 0 and a != b:
                    ia, ib = pairs.get((a, b), (frozenset(), frozenset()))
                    pairs[(a, b)] = (ia | {i}, ib | {i})
        else:
            src_sets, dst_sets = _spec_sets(su), _spec_sets(sv)
            edge_key = (gu, gv, tuple(src_sets.items()), tuple(dst_sets.items()))
            edge = problem.edges.get(edge_key)
            if edge is None:
                edge = problem.edges[edge_key] = EdgeTerm(gu, gv, src_sets, dst_sets, {}, index=len(problem.edges))
            pairs = {(a, b): (ia, ib) for a, ia in src_sets.items() for b, ib in dst_sets.items() if a != b}
        work: Form = {}
        for (a, b), (iu, _iv) in pairs.items():
            held = helds.get((ut, index, a, b))
            if held is None:  # every consumer of a tensor asks again for the same pairs
                forward, backward = cache.working_sets(a, b, meta.nbytes, meta.shape)
                held = helds[(ut, index, a, b)] = float(max(forward, backward if with_grad else 0))
            if held and edge is not None:
                work[("e", edge.index, a, b)] = held
            elif held:
                work.update({("x", gu, i): held for i in iu})
        if work and (vt, frozenset(work.items())) not in works_seen:
            works_seen.add((vt, frozenset(work.items())))
            problem.conversion_work.append((vt, work))
        sig = sig_ids.setdefault(signature, len(sig_ids))
        # a conversion runs where the first consumer that needs it runs (runtime.compile): priced as
        # inside a recomputed segment when the tensor's first consumer is (exact unless an earlier
        # consumer outside keeps the tensor as it is and a later one inside converts it)
        rerun = problem.recompute != "none" and _first_consumer_recomputed(problem, next(iter(producers)), index)
        for (a, b), (iu, iv) in pairs.items():
            key = ("conv", ut, index, a, b, sig)
            term = problem.conversions.get(key)
            if term is None:
                in_unit = problem.in_units and u.kind == "param" and is_unit_gather(cache.conversion(a, b), mesh)
                comms = cache.conversion_comms(a, b, meta.nbytes, with_grad, problem.unit_share_bytes if in_unit else 0)
                again = tuple(c for c in comms if c.phase == "fwd") if rerun else ()  # its forward steps, when the segment is recomputed
                term = problem.conversions[key] = ConversionTerm(key, 0.0, comms + again, rerun=len(again))
            term.producers |= producers
            cond = (gu, iu, gv, iv)
            if cond not in term.conditions:
                term.conditions.append(cond)
            if edge is not None:
                edge.conversions.setdefault((a, b), set()).add(key)
    seconds: dict[int, float] = {}  # by the identity of a (shared) comms tuple
    for term in problem.conversions.values():
        t = seconds.get(id(term.comms))
        if t is None:
            t = seconds[id(term.comms)] = sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in term.comms)
        term.cost = t * term.count
        if term.rerun:
            term.rerun_cost = sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in term.comms[-term.rerun:]) * term.count


def _first_consumer_recomputed(problem: Problem, producer: str, index: int) -> bool:
    """Whether the first op (graph order) reading output ``index`` of ``producer`` runs in a recomputed segment."""
    graph = problem.graph
    first = next((c for c, q in graph.consumers()[producer] if graph.nodes[c].inputs[q].index == index and graph.nodes[c].kind == "op"), None)
    return first is not None and problem.recomputes(graph.nodes[first])


def _price_holds(problem: Problem, v: Node, p: int, ref: InputRef) -> None:
    """Inputs ``v`` saves for backward, as hold terms keyed by the storage they keep alive."""
    graph, _mesh = problem.graph, problem.mesh
    saved_inputs = {s.index for s in v.saved if s.source == "input"}
    saved_output = any(s.source == "output" for s in v.saved)
    gv = problem.node_group[v.name]
    if p in saved_inputs:
        root = _root(graph, ref)
        _add_hold(problem, root, gv, [(j, s.inputs[p]) for j, s in enumerate(problem.choices[v.name]) if p < len(s.inputs)], v)
    if p == 0 and saved_output and v.template == v.name:
        root = _root(graph, InputRef(v.name, 0))
        _add_hold(problem, root, gv, [(j, s.outputs[0]) for j, s in enumerate(problem.choices[v.name]) if s.outputs and s.outputs[0] is not None], v)  # type: ignore[misc]
    if problem.recomputes(v):
        _segment_input(problem, v, p, ref)


def _segment_input(problem: Problem, v: Node, p: int, ref: InputRef) -> None:
    """An input of a recomputed segment read by its op ``v`` (its ``p``-th): the checkpoint keeps it, as its
    producer made it, from forward to the segment's backward, whether or not an op saves it
    (measured, HF GPT-2 with eager attention under selective recomputation: the causal mask added
    to the scores, 8 KB of its 1-D plan's 165 KB, which no op saves). One storage read by every
    instance (made once, outside the stack) is held once."""
    graph = problem.graph
    segment_of = recompute_scheme.segments(graph, problem.recompute)
    u = graph.nodes[ref.node]
    if u.kind != "op" or segment_of.get(u.name) == segment_of[v.name]:
        return
    roots = {_root(graph, w.inputs[p]) for w in _instances(graph)[v.template]}
    made = [(i, s.outputs[ref.index]) for i, s in enumerate(problem.choices[u.template]) if ref.index < len(s.outputs)]
    _add_hold(problem, _root(graph, ref), problem.node_group[u.name], [(i, spec) for i, spec in made if spec is not None], v,
              instances=len(roots))


def _instances(graph: IRGraph) -> dict[str, list[Node]]:
    """Each template's nodes (itself and the other instances of its repeated layer)."""

    def make() -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = defaultdict(list)
        for n in graph.nodes.values():
            out[n.template].append(n)
        return out

    return graph.memo("instances_of_template", make)


def _add_hold(problem: Problem, root: InputRef, gv: str, specs: list[tuple[int, Spec]], v: Node, instances: int | None = None) -> None:
    graph, mesh = problem.graph, problem.mesh
    root_node = graph.nodes[root.node]
    meta = root_node.outputs[root.index]
    if meta is None:
        return
    by_axes: dict[frozenset[str], set[int]] = defaultdict(set)
    for j, spec in specs:
        by_axes[spec.layout.shard_axes].add(j)
    instances = problem.instances[v.template] if instances is None else instances
    # made inside the saver's recomputed segment (a parameter's converted copy, an op of the same
    # instance): recomputed; a segment's input (made outside the instance) is kept by the checkpoint
    inside = problem.recomputes(v) and (root_node.kind == "param" or recompute_scheme.segments(graph, problem.recompute).get(root_node.name) == recompute_scheme.segments(graph, problem.recompute)[v.name])
    for axes, idx in by_axes.items():
        key = ("hold", root_node.template, root.index, axes)
        term = problem.holds.get(key)
        if term is None:
            term = HoldTerm(key, meta.nbytes / mesh.group_size(axes) * instances, saver=v.template, recomputed=inside)
            problem.holds[key] = term
        elif not inside:  # another saver keeps it through the step
            term.recomputed = False
        if root_node.kind == "param":
            gp = problem.node_group[root_node.name]
            stored = frozenset(
                i for i, s in enumerate(problem.choices[root_node.name]) if s.outputs[0] is not None and s.outputs[0].layout.shard_axes != axes
            )
            if stored:
                term.conditions.append((gp, stored, gv, frozenset(idx)))
        else:
            term.conditions.append((gv, frozenset(idx), None, frozenset()))


# --------------------------------------------------------------------------- evaluation


@dataclass(frozen=True)
class Evaluation:
    step_time: float
    compute_time: float
    comm_time: float
    memory: dict[str, float]  # params, grads, optimizer, activations, transient
    comms: tuple[tuple[Comm, int], ...]
    overlap_time: float = 0.0  # communication hidden behind compute (gradient sync, ZeRO-3 prefetch, CDP), already out of step_time
    peak_at: str = ""  # the op at whose forward or backward the memory peaks (planner.peak); "" at the optimizer step
    recompute_time: float = 0.0  # seconds activation recomputation adds (in step_time already)

    @property
    def peak_memory(self) -> float:
        """Lifetime-aware: see :class:`planner.plan.MemoryBreakdown`."""
        m = self.memory
        return float(peak_of(m["params"], m["grads"], m["optimizer"], m["activations"], m["transient"], m.get("step_transient", 0.0)))


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
            act += 0.0 if hold.recomputed else hold.nbytes

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

    if problem.stage_sums:  # CDP: stage 0's partial sum arrives at the end of backward
        step_t = max(step_t, sum(v * value(var) for var, v in problem.stage_sums[0].items()))
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
    if problem.in_units:
        hidden, in_units = unit_terms(problem, assignment, act)
        hidden *= problem.micro_batches  # the gathers repeat, and hide, in every micro-batch's forward
        if act + in_units > during:
            during, peak_at = act + in_units, "a ZeRO-3 unit's gather"
    # the breakdown's transient is what the peak adds to the larger of activations and gradients
    transient = during - max(act, grads)
    if problem.cdp != "off":
        # the ILP priced a message pair per parameter; the runtime sends one pair per stage, and
        # they travel while the workers compute (the chain runs during backward, the ring into the
        # next step): only what exceeds the step's compute is exposed
        from planner.cdp import cdp_messages, cdp_owner_bytes

        per_param = sum(comm_time(c, mesh, hw) * n for c, n in comms if c.kind == "send")
        comms = [(c, n) for c, n in comms if c.kind != "send"]
        messages = cdp_messages(problem, assignment)
        p2p = sum(comm_time(c, mesh, hw) for c in messages)
        comms += [(c, 1) for c in messages]
        total += p2p - per_param
        comm_t += p2p - per_param
        hidden = min(p2p, total - comm_t)
        if problem.zero_stage == 1:
            average, busiest = cdp_owner_bytes(problem, assignment)
            opt += busiest - average
    memory = {"params": params, "grads": grads, "optimizer": opt, "activations": act, "transient": transient, "step_transient": step_t}
    if grads + step_t > during:
        peak_at = ""
    return Evaluation(total - hidden, total - comm_t, comm_t, memory, tuple(comms), hidden, peak_at, rerun)
