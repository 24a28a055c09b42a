"""What a plan must satisfy to run under cyclic data parallelism (runtime/cdp.py).

CDP staggers the data-parallel workers, and under update rule v2 they even compute with different
parameter versions: so no worker may depend on another inside forward or backward. A plan for
CDP therefore (a) issues no collective over the data-parallel axes in forward or backward except
the loss normaliser (the cross-entropy's global target count, which no parameter changes), and
(b) splits tensors over the data-parallel axes only along the batch (dim 0 of a tensor that
depends on the input; of one without a gradient, such as a causal mask of batch shape that a
worker slices; or of an expand to the batch, such as ViT's class token, whose rows each worker
makes itself), so what does not depend on the batch (position ids, their embedding) is computed
whole by every worker.

Two things keep the workers apart where plain DP would communicate: such batch-independent ops
get a variant whose gradients stay partial sums over dp down to the parameters
(:func:`partial_gradient_variants`; otherwise GPT's position-embedding gradient is all-reduced in
backward), and the cross-entropy's mean divides by the local target count times N instead of
all-reducing the global count (``runtime.kernels.CrossEntropyKernel``, ``count_scale``): the same
mean when no target is ignored, else the mean of the micro-batch means. Gradients are summed by CDP's
point-to-point chain, not by the step-phase collectives DP would price.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.cdp_clock import TOKEN_BYTES, Clock, Held, Message, op_stage, readers_of, ring_hold, schedule_units, star_messages
from planner.cost import STATES_PER_VALUE, comm_time
from planner.hardware import HardwareProfile
from planner.ir import IRGraph, Node
from planner.layout import Spec
from planner.mesh import Mesh
from planner.peak import Form
from planner.rules.anchors import broadcasts_batch
from planner.schemes.base import Flag, NodePrice, ParamPrice, Scheme, Settings, Tally
from planner.schemes.zero import zero_param_terms
from planner.stages import Units, cut_stages, in_flight, parameter_stages
from planner.strategy import Comm, Strategy
from planner.terms import Evaluation, Problem, StrategyFilter

if TYPE_CHECKING:
    from planner.plan import Plan

LOSS_TARGETS = ("aten.cross_entropy_loss.default",)
# CDP with ZeRO-2/3: the ILP's linear price of what the star holds, in units of a rank's parameter bytes over N (ZeRO-3's
# fetched stages: over L); evaluate() replaces it with the clock's count
STAR_HELD = 3


def batch_independent(graph: IRGraph) -> set[str]:
    """Ops whose value does not depend on any user input, nor on a tensor without a gradient that
    has the batch's rows (a mask or an index of at least 2 dims whose dim 0 is the batch size:
    Hugging Face builds its causal masks, BERT its token types and BART its positions by expanding
    a position table to the batch): a worker computes such a tensor for its own rows alone."""
    rows = {graph.nodes[n].out.shape[0] for n in graph.input_names if graph.nodes[n].out.shape}
    dependent = set(graph.input_names)
    for node in graph.nodes.values():
        meta = node.outputs[0] if node.kind == "op" and node.outputs else None
        batch_shaped = meta is not None and not meta.is_float and len(meta.shape) >= 2 and meta.shape[0] in rows and meta.shape[0] > 1
        if batch_shaped or any(ref.node in dependent for ref in node.inputs):
            dependent.add(node.name)
    return {n.name for n in graph.nodes.values() if n.kind == "op" and n.name not in dependent}


def partial_gradient_variants(node: Node, strategies: list[Strategy], dp_axes: tuple[str, ...]) -> list[Strategy]:
    """For a batch-independent op: each strategy again with the gradients of its floating inputs and
    outputs partial over the data-parallel axes (every worker keeps its own contribution)."""
    dp = frozenset(dp_axes)
    extra = []
    for s in strategies:
        if dp & (s.split_axes | {a for spec in (*s.inputs, *s.outputs) if spec is not None for a in spec.layout.shard_axes | spec.layout.partial}):
            continue

        def widen(spec: Spec | None) -> Spec | None:
            return Spec(spec.layout, spec.grad_partial | dp) if spec is not None else None

        inputs = tuple(widen(spec) for spec in s.inputs)
        outputs = tuple(widen(spec) for spec in s.outputs)
        extra.append(Strategy(f"{s.algorithm}+partial-grad", s.kernel, inputs, outputs, s.split_axes, s.comms, s.raw_output, s.regather))  # type: ignore[arg-type]
    return strategies + extra


def cdp_filter(graph: IRGraph, dp_axes: tuple[str, ...], base: StrategyFilter | None = None) -> StrategyFilter:
    """A strategy filter keeping only what CDP workers can run independently (module docstring),
    over the data-parallel axes ``dp_axes`` (a mesh's ``dp_axes``; for the search's meshes, made
    before it picks one, ``(planner.schemes.tp.DP_AXIS,)``)."""
    independent = batch_independent(graph)
    dp = set(dp_axes)

    def _broadcast_rows(s: Strategy) -> bool:
        """Rows made from a whole input (an expand to the batch): each worker makes its own."""
        return all(not dp & spec.layout.shard_axes for spec in s.inputs) and all(
            spec is None or all(not dp & set(axes) for axes in spec.layout.dims[1:]) for spec in s.outputs
        )

    def batch_split_only(spec: Spec | None, depends: bool) -> bool:
        if spec is None:
            return True
        for d, axes in enumerate(spec.layout.dims):
            if dp & set(axes) and (d != 0 or not depends):
                return False
        return True

    def allow(node: Node, s: Strategy) -> bool:
        if node.name in independent and dp & set(s.split_axes) and not _broadcast_rows(s):
            return False
        if node.kind == "op":
            ins = [batch_split_only(spec, (ref.node not in independent and graph.nodes[ref.node].kind in ("op", "input"))
                                    or _gradient_free(graph, ref.node, ref.index) or broadcasts_batch(graph.nodes[ref.node], graph))
                   for ref, spec in zip(node.inputs, s.inputs, strict=False)]
            outs = [batch_split_only(spec, node.name not in independent or _broadcast_rows(s)) for spec in s.outputs]
            if not all(ins) or not all(outs):
                return False
        if node.target not in LOSS_TARGETS and any(dp & set(c.axes) and c.phase != "step" for c in s.comms):
            return False
        return base(node, s) if base is not None else True

    return allow


def _gradient_free(graph: IRGraph, name: str, index: int) -> bool:
    """A tensor without a gradient (a mask, position ids): a worker may take its own rows of it
    whether or not it depends on the batch (Hugging Face's causal masks have a batch dim but no
    input in them); slicing it is local and its backward is nothing."""
    meta = graph.nodes[name].outputs[index]
    return meta is not None and not meta.is_float


def stage_buffers(problem: Problem) -> tuple[list[Form], list[str]]:
    """Each stage's gradient buffer on a rank (the local shards of its parameters' gradients, a
    form over the strategies x), and the last op of every stage but the last, in graph order.

    runtime.cdp.CDPTrainer flattens stage l's gradients into one buffer when the stage's backward
    ends, and a worker past the chain's head receives the partial sum of the workers before it
    into a second buffer that size, added and let go: stage l's buffer once more, beside
    everything alive at that moment. For l >= 1 that moment is the backward of stage l-1's last
    op (the activations of the stages before l and the gradients of l and after are alive:
    planner.peak places the form at that op's instant); for stage 0 it is the end of backward,
    with every gradient made (the step's bound S, planner.solve.step_bound)."""
    sums: list[Form] = [{} for _ in range(problem.cdp_stages)]
    for node in problem.graph.params:
        group = problem.node_group[node.name]
        form = sums[problem.param_stage[node.name]]
        for i, v in enumerate(problem.node_terms[node.template].grads):
            if v:
                form[("x", group, i)] = form.get(("x", group, i), 0.0) + v
    cut = cut_stages(problem.graph, problem.cdp_stages)
    return sums, [names[-1] for names in cut.stages[:-1]]


def stage_message_bytes(problem: Problem, assignment: dict[str, int]) -> list[int]:
    """Each stage's message on a rank: its gradient buffer (the local shards of its parameters;
    with ZeRO the ring carries the stage's new parameters, the same bytes)."""
    sizes = [0] * problem.cdp_stages
    for node in problem.graph.params:
        spec = problem.choices[node.name][assignment[problem.node_group[node.name]]].outputs[0]
        assert spec is not None
        sizes[problem.param_stage[node.name]] += node.out.nbytes // spec.layout.shard_factor(problem.mesh)
    return sizes


def stage_itemsize(problem: Problem) -> list[int]:
    """Each stage's bytes per value (its parameters'; 1 for a stage without any): a buffer is cut
    into pieces of whole values (planner.stages.message_units)."""
    out = [1] * problem.cdp_stages
    for node in problem.graph.params:
        out[problem.param_stage[node.name]] = max(out[problem.param_stage[node.name]], node.out.itemsize)
    return out


@dataclass(frozen=True)
class Traffic:
    """One step of CDP's point-to-point messages (runtime.cdp.CDPTrainer) on the rank that sends
    the most bytes (the lowest such rank): each stage's buffer cut into units, each with its owner
    (:func:`planner.cdp_clock.schedule_units`, as the runtime chooses them), and how many times the
    rank sends each unit of a stage that has parameters: twice (down the chain and around the
    ring), once where it owns the unit (the chain ends there) or is the worker before its owner
    (the ring ends there); under the star (ZeRO-2 and 3, and v2: :func:`cdp_star`) once, to its
    owner, and N-1 times where it owns it (ZeRO-3: that many times each op that reads it);
    besides, every rank sends its successor a token after each of its 2L stage ops
    (planner.cdp_clock, ``tokens``)."""

    units: Units
    workers: int
    rank: int
    sends: dict[int, int]  # unit -> messages a step
    tokens: int  # the clock's tokens a step
    reads: tuple[tuple[int, ...], ...] | None = None  # ZeRO-3: each stage's reads of other stages' parameters (stage_reads)

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.units.sizes

    @property
    def owners(self) -> tuple[int, ...]:
        return self.units.owners


def stage_reads(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """For each stage, the other stages whose parameters its ops read (a weight tied across
    stages, such as GPT's embedding and LM head, belongs to the earliest stage that reads it), as
    runtime.cdp.CDPTrainer finds them in its stages."""
    def make() -> tuple[tuple[int, ...], ...]:
        graph, stages = problem.graph, problem.cdp_stages
        stage_of, owner = cut_stages(graph, stages).stage_of(), parameter_stages(graph, stages)
        reads: list[set[int]] = [set() for _ in range(stages)]
        consumers = graph.consumers()
        for p in graph.params:
            for c, _ in consumers[p.name]:
                if c in stage_of and stage_of[c] != owner[p.name]:
                    reads[stage_of[c]].add(owner[p.name])
        return tuple(tuple(sorted(r)) for r in reads)

    return problem.graph.memo(("cdp_reads", problem.cdp_stages), make)


def cdp_star(problem: Problem) -> bool:
    """Whether ``problem``'s CDP messages run as the clock's star, not the chain and ring
    (:func:`planner.cdp_clock.star_messages`: ZeRO-2 and 3, and v2)."""
    return problem.mesh.group_size(problem.mesh.active_dp_axes) > 1 and star_messages(problem.cdp, problem.zero_stage)


def cdp_traffic(problem: Problem, assignment: dict[str, int]) -> Traffic:
    sizes = stage_message_bytes(problem, assignment)
    n = problem.mesh.group_size(problem.mesh.active_dp_axes)
    star, fetch = cdp_star(problem), problem.zero_stage == 3
    reads = stage_reads(problem) if fetch else None
    units = schedule_units(sizes, n, problem.cdp, problem.zero_stage >= 1, stage_itemsize(problem), star=star, fetch=fetch, reads=reads)
    owners = units.owners
    if star:  # a unit to its owner once, or, owned, to each other worker (ZeRO-3: before each forward and backward that reads it)
        stage_of = [stage for stage, parts in enumerate(units.parts) for _ in range(parts)]
        uses = [2 * len(readers_of(stage_of[u], reads)) if reads is not None else 1 for u in range(len(owners))]
        per_rank = [{u: uses[u] * (n - 1) if r == owners[u] else 1 for u, b in enumerate(units.sizes) if b} for r in range(n)]
    else:
        per_rank = [{u: 1 if r in (owners[u], (owners[u] - 1) % n) else 2 for u, b in enumerate(units.sizes) if b} for r in range(n)]
    rank = max(range(n), key=lambda r: (sum(units.sizes[u] * k for u, k in per_rank[r].items()), -r))
    return Traffic(units, n, rank, per_rank[rank], 2 * len(sizes) if n > 1 else 0, reads)


def cdp_messages(problem: Problem, traffic: Traffic) -> list[Comm]:
    """The point-to-point messages of one step on the rank that sends the most bytes: its units'
    buffers, then the clock's tokens."""
    axes = problem.mesh.active_dp_axes
    return [*(Comm("send", axes, traffic.sizes[u], "bwd") for u, k in traffic.sends.items() for _ in range(k)),
            *(Comm("send", axes, TOKEN_BYTES, "bwd") for _ in range(traffic.tokens))]


def cdp_overlap(problem: Problem, traffic: Traffic, busy: float, p2p: float) -> tuple[float, float]:
    """(seconds the busiest rank waits beyond its compute and its messages, seconds of its messages
    hidden behind compute), from CDP's clock as runtime.cdp.CDPTrainer runs it (planner.cdp_clock).

    ``busy``: a worker's seconds of ops a step (compute and the collectives inside its ops, e.g.
    tensor parallelism's); ``p2p``: the busiest rank's seconds of messages a step
    (:func:`cdp_messages`). The clock's actions are replayed in seconds
    (:func:`step_period`): stage l's forward and backward take l's share of
    ``busy`` (by the cut's FLOPs, a third forward, two thirds backward), every message its
    alpha-beta time on the data-parallel link, the tokens included, and each rank blocks where the
    clock puts its receives, send waits and token waits. The replay's settled step is the price:
    of ``p2p``, what the step does not add to ``busy`` travelled between ops, hidden, at the hardware's ``overlap_efficiency`` (as
    DP's bucketed all-reduce, planner.overlap); what it takes beyond ``busy + p2p`` is waiting.
    Measured on 4 gloo ranks sharing 2 cores (mlp-large, 4 stages, two runs) it erred by +7 / -13 %
    (v1) and -20 / -14 % (v2, the star; on the ring, before v2 ran as the star, +61 %: a ring hop a
    v2 worker waited for ran 2-3x faster than the profile's price, measured with every rank busy,
    since the waiting rank freed a core). The replay treats each rank as its own processor, as on
    GPUs."""
    mesh, hw = problem.mesh, problem.hardware
    axes = mesh.active_dp_axes
    cut = problem.graph.memo(("cdp_cut", problem.cdp_stages), lambda: cut_stages(problem.graph, problem.cdp_stages))
    flops = [max(f, 1) for f in cut.flops]
    shares = [f / sum(flops) for f in flops]
    stages = len(shares)
    durations = [busy * shares[j] / 3 for j in range(stages)] + [busy * shares[stages - 1 - j] * 2 / 3 for j in range(stages)]
    seconds = {size: comm_time(Comm("send", axes, size, "bwd"), mesh, hw) for size in {*traffic.sizes, TOKEN_BYTES}}
    units = traffic.units

    def latency(message: Message) -> float:
        return seconds[TOKEN_BYTES if message.kind == "token" else units.sizes[units.unit(message.stage, message.part)]]

    has = [any(units.sizes[u] for u in units.of_stage(stage)) for stage in range(stages)]
    star, fetch = cdp_star(problem), problem.zero_stage == 3
    hold = ring_hold(traffic.workers, stages, units.owners, problem.cdp, has, units.parts, star=star)
    period = step_period(traffic.workers, stages, units.owners, problem.cdp, has, durations, latency, hold=hold, parts=units.parts, star=star,
                         fetch=fetch, reads=traffic.reads)
    waits = max(0.0, period - busy - p2p)
    return waits, problem.overlap_efficiency * max(0.0, busy + p2p + waits - period)


def cdp_owner_bytes(problem: Problem, assignment: dict[str, int], traffic: Traffic) -> tuple[float, float]:
    """CDP with ZeRO: the optimizer states and master copy of each unit of a stage's buffer live on
    the unit's owner (``traffic.units``, as runtime.cdp.CDPTrainer chooses them), a stage's in
    proportion to its units' bytes. Returns (their average per worker, as the ILP priced them; the
    busiest worker's share)."""
    units = traffic.units
    per_stage = [0.0] * len(units.parts)
    for node in problem.graph.params:
        per_stage[problem.param_stage[node.name]] += problem.cdp_owned[node.template][assignment[problem.node_group[node.name]]]
    per_worker = [0.0] * traffic.workers
    for stage, owned in enumerate(per_stage):
        total = sum(units.sizes[u] for u in units.of_stage(stage))
        for u in units.of_stage(stage):
            per_worker[units.owners[u]] += owned * units.sizes[u] / total if total else 0.0
    return sum(per_worker) / traffic.workers, max(per_worker)


def fetched_bytes(traffic: Traffic) -> float:
    """CDP with ZeRO-3: the most parameter bytes a rank holds whole at once: an op's stages (its
    own and those it reads) and the next op's, which arrive while it runs (runtime.cdp: a fetch
    is posted an op ahead unless that op reads the same stage). A bound over the step: priced at
    every instant of it, as the step's other CDP terms."""
    units, reads = traffic.units, traffic.reads or ()
    stages = len(units.parts)
    stage_bytes = [sum(units.sizes[u] for u in units.of_stage(st)) for st in range(stages)]

    def op_reads(op: int) -> set[int]:  # (Clock.op_reads, stages without parameters included: they weigh nothing)
        stage, _ = op_stage(op, stages)
        return {stage, *(reads[stage] if reads else ())}

    return float(max(sum(stage_bytes[st] for st in op_reads(op) | op_reads(op + 1)) for op in range(2 * stages)))


def cdp_held_bytes(rule: str, traffic: Traffic, fetch: bool = False, replicated: bool = False) -> tuple[float, float]:
    """CDP's star (ZeRO-2 or 3; v2 with every ZeRO stage): what the rank that holds most between two steps
    holds for CDP's messages, in steady state, as (the sums of the pieces it owns not yet
    installed and taken by every worker, ZeRO-3: the versions of its pieces some op still
    computes with, ``replicated`` (ZeRO-0): and the sums it received and has not yet applied; its
    stage buffers whose pieces have not all been taken by their owners)
    (:attr:`planner.cdp_clock.Clock.live`; runtime.cdp.CDPTrainer.message_bytes)."""
    units = traffic.units
    has = tuple(any(units.sizes[u] for u in units.of_stage(stage)) for stage in range(len(units.parts)))
    live = _live(traffic.workers, len(units.parts), units.owners, rule, has, units.parts, fetch, traffic.reads, replicated)
    stage_bytes = [sum(units.sizes[u] for u in units.of_stage(stage)) for stage in range(len(units.parts))]

    def split(items: tuple[Held, ...]) -> tuple[float, float]:
        sums = sum(units.sizes[units.unit(item[2], item[3])] for item in items if item[0] == "sum")
        sums += sum(units.sizes[item[3]] for item in items if item[0] == "got")
        return float(sums), float(sum(stage_bytes[item[3]] for item in items if item[0] == "grads"))

    return max((split(items) for items in live), key=sum, default=(0.0, 0.0))


@functools.lru_cache(maxsize=64)
def _live(workers: int, stages: int, owners: tuple[int, ...], rule: str, has_params: tuple[bool, ...], parts: tuple[int, ...],
          fetch: bool = False, reads: tuple[tuple[int, ...], ...] | None = None, replicated: bool = False,
          steps: int = 8) -> tuple[tuple[Held, ...], ...]:
    """What each rank holds at the start of each of the last three of ``steps`` simulated steps
    (the star's clock; the first steps settle)."""
    clock = Clock(workers, stages, owners, rule, has_params, parts=parts, star=True, fetch=fetch, reads=reads, replicated=replicated)
    period = 2 * stages
    for op in range(period * steps + 1):
        for n in range(workers):
            clock.actions(n, op)
    return tuple(clock.live[(n, period * k)] for n in range(workers) for k in range(steps - 2, steps + 1) if (n, period * k) in clock.live)


@dataclass(frozen=True)
class PipelineEstimate:
    """CDP with stages on different devices (runtime.cdp_pipeline.CDPPipeline), priced analytically.

    N workers (micro-batches of the traced batch / N), L stages (planner.stages), D = ceil(N/L)
    devices per stage: L*D devices where data parallelism times L-way model parallelism needs N*L.
    A device of stage l holds the parameters of stage l (two versions in use plus the optimizer's
    master: 3 P_l), one gradient accumulator P_l, the optimizer states, and the saved activations
    of those of its workers that are between their forward and backward of stage l
    (:func:`planner.stages.in_flight`: L - l of them where L divides N), A_l each for one
    micro-batch; summed over the devices that is CDP's (N/L) sum_l (L - l) A_l. Every device runs one stage-step per time unit; a step is 2L units of
    the slowest stage-step (roofline, 1/N of the stage's FLOPs) plus the message carrying the
    values that cross its cut (1/N of their traced bytes, on the inter-node link: a bound); the
    gradient chain over the D devices of a stage overlaps the next step's compute."""

    workers: int
    stages: int
    per_stage: int
    stage_memory: tuple[float, ...]
    stage_activations: tuple[float, ...]  # bytes of saved activations per device of each stage
    step_time: float

    @property
    def devices(self) -> int:
        return self.stages * self.per_stage

    @property
    def dp_mp_devices(self) -> int:
        return self.workers * self.stages

    @property
    def peak_memory(self) -> float:
        return max(self.stage_memory)


def pipeline_estimates(graph: IRGraph, hardware: HardwareProfile, *, devices: int, batch: int, optimizer: str = "adamw") -> list[PipelineEstimate]:
    """CDP with its stages on ``devices`` devices, one worker per device (N = ``devices``, which
    must divide ``batch``, the traced batch's rows), for 2, 4 and 8 stages dividing N: a count of
    workers L does not divide would need L*ceil(N/L) devices, more than ``devices``."""
    if batch % devices:
        return []
    ops = sum(1 for n in graph.nodes.values() if n.kind == "op")
    return [pipeline_estimate(graph, hardware, workers=devices, stages=stages, optimizer=optimizer)
            for stages in (2, 4, 8) if stages <= ops and devices % stages == 0]


def pipeline_estimate(graph: IRGraph, hardware: HardwareProfile, *, workers: int, stages: int, optimizer: str = "adamw") -> PipelineEstimate:
    cut = cut_stages(graph, stages)
    owner = parameter_stages(graph, stages)
    param_bytes = [0.0] * stages
    for p in graph.params:
        param_bytes[owner[p.name]] += p.out.nbytes
    per_stage = -(-workers // stages)
    memory, acts, slot = [], [], 0.0
    bw = hardware.tier(True).bandwidth * hardware.bandwidth_efficiency
    stage_of = cut.stage_of()
    consumers = graph.consumers()
    crossing = [0.0] * stages  # bytes leaving stage l's cut (values read by a later stage)
    for name, produced in stage_of.items():
        later = [stage_of[c] for c, _ in consumers[name] if c in stage_of and stage_of[c] > produced]
        for cut_at in range(produced, max(later, default=produced)):
            crossing[cut_at] += sum(m.nbytes for m in graph.nodes[name].outputs if m is not None)
    for st in range(stages):
        activations = in_flight(workers, stages, st) * cut.saved_bytes[st] / workers
        acts.append(activations)
        memory.append(3 * param_bytes[st] + param_bytes[st] * (1 + STATES_PER_VALUE[optimizer]) + activations)
        ops = [graph.nodes[name] for name in cut.stages[st]]
        dtype = next((o.out.dtype for o in ops if o.outputs and o.outputs[0] is not None), "torch.float32")
        fwd = sum(o.flops_fwd for o in ops) / workers / (hardware.compute_efficiency * hardware.flops(dtype))
        bwd = sum(o.flops_bwd for o in ops) / workers / (hardware.compute_efficiency * hardware.flops(dtype))
        slot = max(slot, max(fwd, bwd) + hardware.tier(True).latency + crossing[st] / workers / bw)
    return PipelineEstimate(workers, stages, per_stage, tuple(memory), tuple(acts), 2 * stages * slot)


class CDP(Scheme):
    """Cyclic data parallelism over the one data-parallel axis (module docstring; the runtime is
    ``runtime.cdp``): gradients summed by a point-to-point chain and ring instead of collectives."""

    name = "cdp"
    setting = "cdp"
    searched = "cdp"
    off = "off"
    flags = (Flag("--cdp", "cdp", "CDP modes to search (comma list)", str, ("off", "v1", "v2")),
             Flag("--cdp-stages", "cdp_stages", "CDP: stages the model is cut into (default 4)", int, many=False))
    column = "cdp"
    title = "CDP"

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        cdp, micro_batches = settings["cdp"], settings["micro_batches"]
        if cdp == "off":
            return ""
        if cdp not in ("v1", "v2"):
            return f"CDP modes are off, v1 and v2; got cdp={cdp!r}"
        if not mesh.active_dp_axes:
            return "CDP runs over the data-parallel axis: needs dp > 1"
        if len(mesh.active_dp_axes) > 1:
            return f"CDP runs over one data-parallel axis; mesh {mesh} has {len(mesh.active_dp_axes)}"
        if micro_batches > 1:
            return "CDP staggers its own micro-batches; gradient accumulation runs with CDP off"
        return ""

    def label(self, settings: Settings) -> str:
        return f"CDP {settings['cdp']}" if settings["cdp"] != "off" else ""

    def edge_key(self, value: Any) -> Any:
        return value != "off"  # its conversions bar collectives over the workers, in v1 and v2 alike

    def cell(self, settings: Settings, plan: Plan | None = None) -> str:
        """``off``, or the mode, with its stage count where there is a plan (``v1, 4 stages``)."""
        cdp = settings["cdp"]
        return cdp if cdp == "off" or plan is None else f"{cdp}, {plan.cdp_stages} stages"

    def summary(self, plan: Plan) -> str:
        return f"CDP {plan.cdp} ({plan.cdp_stages} stages)" if plan.cdp != "off" else ""

    def describe(self, plan: Plan) -> list[str]:
        if plan.cdp == "off":
            return []
        if star_messages(plan.cdp, plan.zero_stage):
            how = ("send each piece of a stage's gradient straight to the piece's owner, which sums it" + (
                "; every worker steps its own optimizer with the sum the owner sends back (2(N-1) messages per piece, overlapping compute) "
                "instead of an all-reduce; " if plan.zero_stage == 0 else " and steps its optimizer; " + (
                    "only the owner keeps a piece, and each forward and backward fetches the pieces it reads from their owners point to "
                    "point (3(N-1) messages per piece, overlapping compute) instead of collectives; " if plan.zero_stage == 3 else
                    "the owner sends the new parameters straight back (2(N-1) messages per piece, overlapping compute) instead of "
                    "collectives; ")))
            rule = ("each update applies the gradient summed a step before (a one-step gradient delay)" if plan.cdp == "v1" else
                    "a worker computes a stage with the newest parameters where their sum is ready, with the step before's elsewhere "
                    "(a one-step gradient delay at most)")
            held = ("an owner keeps its pieces in the versions still in use" if plan.zero_stage == 3 else
                    "an owner holds its pieces' sums until every worker has taken them" + (", and a worker each sum until its update"
                                                                                           if plan.zero_stage == 0 else ""))
            return [f"  CDP {plan.cdp}, {plan.cdp_stages} stages, ZeRO-{plan.zero_stage}: the data-parallel workers run staggered and " + how
                    + rule + f"; {held}. Run it with planner.runtime.cdp.CDPTrainer."]
        return [
            f"  CDP {plan.cdp}, {plan.cdp_stages} stages: the data-parallel workers run staggered and sum each stage's gradient "
            "along a point-to-point chain (2(N-1) messages per stage, overlapping compute) instead of an all-reduce; "
            + ("each update applies the gradient summed a step before (a one-step gradient delay), so a worker holds that sum beside the step's own"
               if plan.cdp == "v1" else
               "a worker updates a stage just before its forward where the stage's sum is ready, a step later elsewhere (a one-step gradient delay "
               "at most), holding the sum until then, not a second parameter version")
            + ". Run it with planner.runtime.cdp.CDPTrainer."
        ]

    def fields(self, plan: Plan) -> dict[str, Any]:
        return {"cdp": plan.cdp, "cdp_stages": plan.cdp_stages}

    def plan_fields(self, problem: Problem, evaluation: Evaluation) -> dict[str, Any]:
        return {"cdp_stages": problem.cdp_stages}

    def configure(self, problem: Problem) -> None:
        why = self.unsupported(problem.mesh, problem.settings)
        if why:
            raise ValueError(why)
        if problem.cdp == "off":
            problem.cdp_stages = 0  # (a plan without CDP cuts no stages)
            return
        problem.collective_sync = False
        problem.barred_axes = frozenset(problem.mesh.active_dp_axes)
        problem.params_gathered = False  # ZeRO-3: the runtime fetches each op's pieces from their owners (the star), not the graph
        problem.param_stage = parameter_stages(problem.graph, problem.cdp_stages)

    def strategies(self, problem: Problem, anchors: dict[str, list[Strategy]], allow: StrategyFilter | None) -> StrategyFilter | None:
        if problem.cdp == "off":
            return allow
        graph, dp_axes = problem.graph, problem.mesh.active_dp_axes
        for name in batch_independent(graph) & set(anchors):
            anchors[name] = partial_gradient_variants(graph.nodes[name], anchors[name], dp_axes)
        return cdp_filter(graph, dp_axes, base=allow)

    def price_param(self, problem: Problem, node: Node, index: int, strategy: Strategy, price: ParamPrice, opt_factor: float) -> None:
        if problem.cdp == "off":
            return
        spec = strategy.outputs[0]
        assert spec is not None
        # the chain and the ring instead of the all-reduce
        params, grads, states, step = zero_param_terms(node.out.shape, node.out.itemsize, spec, problem.mesh, 0, opt_factor)
        price.step = [Comm("send", c.axes, c.nbytes, "bwd") for c in step for _ in range(2)]
        workers = problem.mesh.group_size(spec.grad_partial)
        if problem.zero_stage >= 1:
            # states and a master copy live on the stage's owner only: 1/N on average here
            # (linear); adjust() puts the busiest owner's exact share back
            owned = states + params
            problem.cdp_owned.setdefault(node.name, [0.0] * len(problem.choices[node.name]))[index] = owned
            states = owned / workers
        star = cdp_star(problem)
        if star and problem.zero_stage <= 2:
            # the star (runtime.cdp; with ZeRO-1 ZeRO-2's): a worker's gradient leaves for its owners
            # after the stage's backward; an owner holds the sums of its pieces, then their new
            # parameters until every worker has taken them at its update (two or three steps' at
            # once: 3/N here, an estimate from above, so that a budgeted solve's answer rarely
            # exceeds the budget once adjust() puts the clock's count in); with ZeRO-0 each worker
            # also keeps the sums it receives until its update, about the whole buffer
            price.held = STAR_HELD * params / workers + (params if problem.zero_stage == 0 else 0.0)
            grads += price.held
            price.params, price.grads, price.states = params, grads, states
            return
        if problem.zero_stage == 3:
            # no full parameters between ops: an owner's pieces in the versions still in use (3/N),
            # and the stages each op fetches whole, held as a transient (3/L); both estimates from
            # above, the clock's counts and the fetched bytes in adjust()
            price.held = STAR_HELD * params / problem.cdp_stages
            price.params, price.grads, price.states = STAR_HELD * params / workers, grads + price.held, states
            return
        # the previous step's buffer (its summed gradient, applied late: v1 at step t+2's start, v2
        # at step t+1's forward of the stage where the worker is fresh and at step t+2's start where
        # stale; ZeRO: the parameters the owner sent, installed then), alive through the step beside
        # this step's gradient (runtime.cdp: v2 keeps no second parameter version, its update waits)
        price.held = params
        grads += params
        price.params, price.grads, price.states = params, grads, states

    def price_op(self, problem: Problem, node: Node, strategy: Strategy, price: NodePrice) -> None:
        if problem.cdp == "off":
            return
        dp = set(problem.mesh.dp_axes)
        if node.target in LOSS_TARGETS:  # the local count x N, no all-reduce
            price.comms = [c for c in price.comms if not (c.kind == "all_reduce" and set(c.axes) & dp)]
        if price.loss_partial is not None:  # CDPTrainer returns each worker's share of the loss
            price.loss_partial = price.loss_partial - dp
        # the messages adjust() re-prices and overlaps
        price.credit += sum(comm_time(c, problem.mesh, problem.hardware) for c in price.comms if c.kind == "send") * price.count

    def edges_priced(self, problem: Problem) -> None:
        if problem.cdp != "off":
            problem.stage_sums, problem.stage_ends = stage_buffers(problem)

    def adjust(self, problem: Problem, assignment: dict[str, int], tally: Tally) -> None:
        if problem.cdp == "off":
            return
        mesh, hw = problem.mesh, problem.hardware
        # stage 0's partial sum arrives at the end of backward
        tally.step_transient = max(tally.step_transient, sum(v * tally.value(var) for var, v in problem.stage_sums[0].items()))
        # the ILP priced a message pair per parameter; the runtime sends one pair per stage and the
        # clock's tokens, part of them while the workers compute (cdp_overlap: the timed clock)
        per_param = sum(comm_time(c, mesh, hw) * n for c, n in tally.comms if c.kind == "send")
        busy = tally.total - per_param  # a worker's ops: compute and the collectives inside them
        tally.comms = [(c, n) for c, n in tally.comms if c.kind != "send"]
        traffic = cdp_traffic(problem, assignment)
        messages = cdp_messages(problem, traffic)
        p2p = sum(comm_time(c, mesh, hw) for c in messages)
        tally.comms += [(c, 1) for c in messages]
        waits, hidden = cdp_overlap(problem, traffic, busy, p2p)
        tally.total += p2p - per_param + waits
        tally.comm_time += p2p - per_param + waits
        tally.hidden = hidden
        if problem.zero_stage >= 1:
            average, busiest = cdp_owner_bytes(problem, assignment, traffic)
            tally.optimizer += busiest - average
        if cdp_star(problem):  # the owners' sums (ZeRO-3: their versions) and the stage buffers in flight, on the clock, for 3/N priced
            sums, buffers = cdp_held_bytes(problem.cdp, traffic, fetch=problem.zero_stage == 3, replicated=problem.zero_stage == 0)
            total = sum(traffic.sizes)
            if problem.zero_stage <= 2:  # (ZeRO-0: and the sums received, the whole buffer priced)
                tally.held += sums + buffers - STAR_HELD * total / traffic.workers - (total if problem.zero_stage == 0 else 0.0)
            else:  # (the fetched stages, priced 3/L of the parameters at every instant, are a transient)
                tally.params += sums - STAR_HELD * total / traffic.workers
                tally.held += buffers - STAR_HELD * total / len(traffic.units.parts)
                tally.during += fetched_bytes(traffic)


def step_period(workers: int, stages: int, owners: Sequence[int], rule: str, has_params: Sequence[bool],
                durations: Sequence[float], latency: Callable[[Message], float], steps: int = 8, hold: bool = False,
                parts: Sequence[int] | None = None, star: bool = False, fetch: bool = False,
                reads: tuple[tuple[int, ...], ...] | None = None) -> float:
    """Seconds a step takes as runtime.cdp.CDPTrainer runs the clock, once it has settled (the
    planner's price of CDP, :func:`cdp_overlap`): the clock's actions replayed in seconds, in the
    order the clock does them, each rank blocking where the clock puts its waits. ``durations``:
    seconds of op j of a step (2L); ``latency(message)``: seconds a message takes from its send
    (a token's too, from its op's end), the same for every token and for every message of one
    piece of one stage (it is asked once for each). A receive ends when the message has arrived;
    a send's wait when its receiver has it; a token wait when the predecessor's op has ended and
    its token arrived; an op starts when its actions are done. Returns the slowest worker's time
    over its last two simulated steps, halved.

    The replay runs a program compiled once per schedule (:func:`_replay_program`: the clock's
    actions as numbered slots), so an evaluation pays only the arithmetic: a brute force over a
    CDP configuration's plans evaluates thousands of them."""
    program = _replay_program(workers, stages, tuple(owners), rule, tuple(has_params), steps, hold,
                              tuple(parts) if parts is not None else (1,) * stages, star, fetch, reads)
    seconds = [latency(m) for m in program.classes]
    now = [0.0] * workers
    at: list[float | None] = [None] * program.slots  # each message's send (then its take) and each op's end, once done
    starts = [0.0] * (2 * workers)
    for code, n, a, b, c in program.steps:
        if code == _OP:  # a: the op's index in its step, b: its end's slot, c: its heads' slots (and where its start is kept)
            heads, keep = c
            if keep >= 0:
                starts[keep] = now[n]
            now[n] += durations[a]
            at[b] = now[n]
            for slot in heads:
                at[slot] = now[n]
        elif code == _WAIT_FOR:  # a send's completion, or an op's end and its token (a: the slot, b: the latency class or -1)
            t = at[a]
            base = now[n] if t is None else t
            if b >= 0:
                base += seconds[b]
            if base > now[n]:
                now[n] = base
        elif code == _RECV:  # a: the message's slot, b: its latency class, c: where it is taken, and the slots it sends on
            t = at[a]
            arrive = (now[n] if t is None else t) + seconds[b]
            if arrive > now[n]:
                now[n] = arrive
            taken, onward = c
            at[taken] = now[n]
            for slot in onward:
                at[slot] = now[n]
        else:  # _SEND, fetch: a version leaves its owner
            at[a] = now[n]
    # (beyond the measured ops, what an op waits for may not have been replayed: a slot still None, not measured)
    return max(starts[workers + n] - starts[n] for n in range(workers)) / 2


_OP, _WAIT_FOR, _RECV, _SEND = range(4)


@dataclass(frozen=True)
class _Program:
    """:func:`step_period`'s replay of one schedule: ``steps`` (code, worker, a, b, c), see
    there; ``slots``: the floats it keeps; ``classes``: a message of each latency class."""

    steps: tuple[tuple[int, int, int, int, Any], ...]
    slots: int
    classes: tuple[Message, ...]


@functools.lru_cache(maxsize=64)
def _replay_program(workers: int, stages: int, owners: tuple[int, ...], rule: str, has_params: tuple[bool, ...], steps: int,
                    hold: bool, parts: tuple[int, ...], star: bool = False, fetch: bool = False,
                    reads: tuple[tuple[int, ...], ...] | None = None) -> _Program:
    """The clock's actions over ``steps`` + 2 steps (a worker ahead of another in the clock's order
    runs ops of a later step) in the order the clock does them, as :func:`step_period` replays
    them. They depend on the schedule alone, not on the seconds, so a search's evaluations of one
    CDP configuration (a brute force's thousands) simulate the clock once: the simulation was 5 of
    the 6 ms an evaluation of a 2-stage plan on dp=2 took (measured), and the replay, its actions
    read from the clock's records (dicts keyed by Message) each time, 1.75 of the 3.6 ms left
    (under cProfile, the CDP brute force of tests/test_peak.py); from this program, 0.13 ms."""
    clock = Clock(workers, stages, owners, rule, has_params, hold=hold, parts=parts, star=star, fetch=fetch, reads=reads)
    period = 2 * stages
    acts = [(n, op, clock.actions(n, op)) for op in range(period * (steps + 2)) for n in range(workers)]
    order: list[tuple[int, int, int, int]] = []  # (place in the clock's order, worker, op, log index; -1: the op)
    for n, op, a in acts:
        order += [(place, n, op, i) for i, place in enumerate(a.log_order)]
        order.append((a.order, n, op, -1))
    by_key = {(n, op): a for n, op, a in acts}
    slots: dict[object, int] = {}  # a message's send, ("taken", message) its take, (worker, op) an op's end

    def slot(key: object) -> int:
        return slots.setdefault(key, len(slots))

    classes: dict[tuple[int, int] | None, int] = {}  # None: a token; (stage, part) a data message
    representatives: list[Message] = []  # a message of each class, in its number's order

    def latency_class(message: Message) -> int:
        key = None if message.kind == "token" else (message.stage, message.part)
        if key not in classes:
            classes[key] = len(classes)
            representatives.append(message)
        return classes[key]

    last_op, first_op = period * (steps - 1), period * (steps - 3)
    program: list[tuple[int, int, int, int, Any]] = []
    for _, n, op, i in sorted(order):
        a = by_key[(n, op)]
        if i < 0:
            keep = n if op == first_op else workers + n if op == last_op else -1
            program.append((_OP, n, op % period, slot((n, op)), (tuple(slot(h) for h in a.heads), keep)))
            continue
        kind, item, _ = a.log[i]
        if kind == "tokens":
            pred, last = (n - 1) % workers, int(item)  # type: ignore[arg-type]
            program.append((_WAIT_FOR, n, slot((pred, last)), latency_class(Message(last, -1, "token", 0, pred, n)), None))
        elif kind == "recv":  # (a "post" only starts the receive: the message moves from its send)
            assert isinstance(item, Message)
            onward = ([a.forwards[item]] if item in a.forwards else []) + list(a.delivers.get(item, ()))
            program.append((_RECV, n, slot(item), latency_class(item), (slot(("taken", item)), tuple(slot(m) for m in onward))))
        elif kind == "send":
            assert isinstance(item, Message)
            program.append((_SEND, n, slot(item), -1, None))
        elif kind == "wait" and isinstance(item, Message) and item.kind != "token":  # a send's completion: its receive
            program.append((_WAIT_FOR, n, slot(("taken", item)), -1, None))
    return _Program(tuple(program), len(slots), tuple(representatives))
