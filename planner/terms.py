"""The terms a planning problem is the sum of, and the evaluation of one assignment.

A :class:`Problem` is built for one mesh by :func:`planner.problem.build_problem` from the
contributions of the parallelism schemes (:mod:`planner.schemes`); :mod:`planner.solve` solves it;
:func:`planner.problem.evaluate` prices any assignment exactly.

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
  consumers save it (:mod:`planner.edges`).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from planner.buckets import DEFAULT_BUCKET_BYTES
from planner.cost import steps_comms, steps_working_set
from planner.hardware import HardwareProfile
from planner.ir import InputRef, IRGraph, Node
from planner.layout import Conversion, Spec, spec_conversion
from planner.mesh import Mesh
from planner.peak import Form, Instant
from planner.plan import peak_of
from planner.strategy import Comm, Strategy

# a recomputed segment: (the stack's module prefix, the instance, the segment within it), e.g.
# ("h", 3, 0): full recomputation has one segment per instance, selective one per attention core
Segment = tuple[str, int, int]


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
    forbidden: bool = False  # a pair of strategies the plan may not choose (CDP: a collective over its workers)


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
    # saved inside a recomputed segment (planner.schemes.recompute): in this share of its saver's
    # instances (those recomputed: all, or the first ones of each stack) not held through the
    # step, alive again while the segment's backward runs (an in-flight term of planner.peak)
    recomputed: float = 0.0
    # a recomputed segment's input the checkpoint keeps: alive at the recomputed instances only
    checkpointed: bool = False


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
    # each scheme's setting, by its name (planner.schemes.base.Scheme.setting: zero_stage, cdp,
    # micro_batches, recompute, ...); the ones the sum itself reads have a property below
    settings: dict[str, Any] = field(default_factory=dict)
    # what of the settings changes the edge terms (planner.schemes.base.Scheme.edge_key): problems
    # alike in it and in their strategies share their priced edges (planner.edges.shared_edges)
    edge_settings: tuple[Any, ...] = ()
    master_dtype: str | None = None
    prefetch: bool = False  # ZeRO-3 parameter gathers started one ahead (planner.overlap)
    cdp_stages: int = 0
    param_stage: dict[str, int] = field(default_factory=dict)  # CDP: parameter node -> stage
    cdp_owned: dict[str, list[float]] = field(default_factory=dict)  # CDP + ZeRO: owner bytes per strategy
    instances: dict[str, int] = field(default_factory=dict)  # template -> number of instances
    build_seconds: float = 0.0
    # what is worked out from the conversion terms alone (planner.edges.conversion_uses,
    # planner.front._coupling) and the last LP relaxation's basis (planner.solve.BudgetILP.relax),
    # shared with the problems that share the terms (planner.edges.shared_edges)
    priced_memo: dict[str, object] = field(default_factory=dict)
    conversions_priced: bool = False  # conversion and hold terms built (price_conversions)
    edges_priced: bool = False  # and the conversions' working sets, the schemes' edge terms, the instants (price_edges)
    # ops whose forward runs again in backward, by the segment each runs in (a scheme sets them:
    # planner.schemes.recompute); what they save is held only while their segment's backward runs
    segment_of: dict[str, Segment] = field(default_factory=dict)
    # mesh axes no collective may run over inside forward or backward (CDP's staggered workers)
    barred_axes: frozenset[str] = frozenset()
    # the graph stores parameters split over the data-parallel axes and gathers them before use
    # (ZeRO-3, in units: planner.overlap); False where a scheme fetches them itself (CDP's star)
    params_gathered: bool = False
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
    zero1_reduce: str = "reduce_scatter"  # how ZeRO-1 sums its gradients (planner.schemes.zero.zero1_reduce)
    # gradients summed by collectives over the data-parallel axes (False: a scheme moves them
    # itself, CDP's chain), and whether that sync runs beside backward, how often per step
    # (planner.overlap.sync_rows; ZeRO-3 and CDP hide their communication their own way)
    collective_sync: bool = True
    sync_overlapped: bool = False
    sync_repeats: int = 1
    node_terms: dict[str, NodeTerms] = field(default_factory=dict)  # by template
    # the conversions into each consumer template's input, a form over x (within a group) or e
    # (an edge's pair of Specs): the bytes the conversion of the pair chosen holds while it runs
    conversion_work: list[tuple[str, Form]] = field(default_factory=list)
    # the edges whose conversion_work is not yet worked out: (producer template, output index,
    # consumer template, producer group, edge index or None, ((a, b), (strategies u, strategies v)) pairs)
    pending_work: list[tuple[str, int, str, str, int | None, tuple[tuple[tuple[int, int], tuple[frozenset[int], frozenset[int]]], ...]]] = field(default_factory=list)
    instants: list[Instant] | None = None  # the moments the peak may happen (planner.peak; price_edges makes them)
    # CDP: each stage's gradient buffer (a form over x) and the last op of each stage but the last
    # (planner.schemes.cdp.stage_buffers; a worker past the chain's head receives a partial sum that size)
    stage_sums: list[Form] = field(default_factory=list)
    stage_ends: list[str] = field(default_factory=list)
    # the gradient sync's exposure (planner.overlap.sync_rows): E >= each form (seconds over x),
    # E >= 0; a step hides overlap_efficiency * (sum of Group.sync chosen - E)
    sync_rows: list[Form] = field(default_factory=list)
    # a problem restricted to some strategies (planner.problem.restrict): per group cut, the
    # indices its strategies have in the whole problem, in order
    kept: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def zero_stage(self) -> int:
        """ZeRO's stage (planner.schemes.zero)."""
        return self.settings.get("zero_stage", 0)

    @property
    def cdp(self) -> str:
        """Cyclic data parallelism over the dp axis: off, v1, v2 (planner.schemes.cdp)."""
        return self.settings.get("cdp", "off")

    @property
    def micro_batches(self) -> int:
        """Gradient accumulation: the graph is one micro-batch; a step runs this many of them one
        after another and syncs gradients once (forward/backward terms repeat, the step phase does not)."""
        return self.settings.get("micro_batches", 1)

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
        return node.name in self.segment_of

    def recomputed_instances(self, template: str) -> int:
        """How many instances of ``template`` run in a recomputed segment: all of a repeated
        layer's, or the first ones of each stack (planner.schemes.recompute), or none."""
        if not self.segment_of:
            return 0
        return sum(1 for n in instances_of(self.graph)[template] if n.name in self.segment_of)

    @property
    def in_units(self) -> bool:
        """ZeRO-3 gathers its parameters in units (planner.overlap), where the graph gathers them."""
        return self.params_gathered

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


def _input_spec_bytes(graph: IRGraph, ref: InputRef) -> int:
    meta = graph.nodes[ref.node].outputs[ref.index]
    return meta.nbytes if meta is not None else 0


def input_bytes(graph: IRGraph, node: Node, strategy: Strategy, mesh: Mesh) -> int:
    """Local bytes of ``node``'s inputs in the layouts ``strategy`` computes on."""
    return sum(
        _input_spec_bytes(graph, ref) // spec.layout.shard_factor(mesh)
        for ref, spec in zip(node.inputs, strategy.inputs, strict=False)
    )


def _conversion_working_sets(nbytes: int, src: Spec, dst: Spec, mesh: Mesh, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """The working sets of the two halves of ``src -> dst`` on a tensor of ``nbytes``
    (:func:`planner.cost.steps_working_set`): the forward steps on its local bytes in ``src``, the
    backward steps on its gradient's in ``dst``."""
    return conversion_cache(mesh).working_sets(spec_id(src), spec_id(dst), nbytes, shape)


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


def spec_sets(ids: tuple[int, ...]) -> dict[int, frozenset[int]]:
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
def conversion_cache(mesh: Mesh) -> _ConversionCache:
    return _ConversionCache(mesh)


def instances_of(graph: IRGraph) -> dict[str, list[Node]]:
    """Each template's nodes (itself and the other instances of its repeated layer)."""

    def make() -> dict[str, list[Node]]:
        out: dict[str, list[Node]] = defaultdict(list)
        for n in graph.nodes.values():
            out[n.template].append(n)
        return out

    return graph.memo("instances_of_template", make)
