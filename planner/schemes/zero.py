"""Data parallelism and ZeRO (Rajbhandari et al. 2020) over the data-parallel axes.

For fp32 AdamW (4 B parameter, 4 B gradient, 8 B optimizer state per value; ``b`` the local bytes
of a parameter after tensor parallelism, ``D`` the data-parallel degree): stage 0 holds
b + b + 2b and all-reduces the gradient (ring 2(D-1)/D b); stage 1 holds b + b + 2b/D; stage 2
b + b/D + 2b/D, both reduce-scattering the gradient and all-gathering the updated shard (the same
ring volume); stage 3 holds b/D + b/D + 2b/D: parameters are stored split over the data-parallel
axes, gathered before use (kept for backward, or, ``+zero3`` strategies, freed and gathered
again), and their gradients reduce-scattered in backward: 3(D-1)/D b when re-gathered. A
parameter whose dims cannot be split D ways stays as in stage 0.

The gradient sync's collectives are packed into buckets of ``bucket_bytes`` (an all-reduce, or
ZeRO-1/2's reduce-scatter and all-gather; :mod:`planner.buckets`), each gradient priced as its
share of a bucket's latency, and run beside backward (:mod:`planner.overlap`'s sync rows); ZeRO-3
gathers a block's parameters as one unit, the next unit's gather started during this one's
forward (``prefetch``, :func:`planner.overlap.unit_terms`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from planner.cost import comm_time
from planner.hardware import HardwareProfile
from planner.ir import IRGraph, Node
from planner.layout import Layout, Spec, zero_dim
from planner.mesh import Mesh
from planner.overlap import unit_terms
from planner.rules import RuleContext
from planner.rules.variants import regather_variants
from planner.schemes.base import Flag, NodePrice, ParamPrice, Scheme, Settings, Tally
from planner.strategy import Comm, Strategy, dedupe
from planner.terms import Evaluation, Problem, StrategyFilter
from planner.trace import match_layer

if TYPE_CHECKING:
    from planner.config import SearchConfig
    from planner.plan import Plan


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


def stored_over_dp(node: Node, mesh: Mesh, strategies: list[Strategy]) -> list[Strategy]:
    """ZeRO-3's storage layouts of parameter ``node``: each of its (tensor-parallel) ``strategies``'
    layouts further split over the data-parallel axes, along the first dim that allows it."""
    dp = mesh.active_dp_axes
    out = []
    for s in strategies:
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


class ZeRO(Scheme):
    """Data parallelism's gradient sync and ZeRO's sharded states (module docstring)."""

    name = "zero"
    setting = "zero_stage"
    searched = "zero"
    off = 0
    flags = (Flag("--zero", "zero", "ZeRO stages to search (comma list, e.g. 0,1,2,3; default 0)", int, (0, 1, 2, 3)),
             Flag("--no-prefetch", "prefetch", "ZeRO-3: gather each parameter when used, not one ahead", switch_off=True))
    column = "zero"
    title = "ZeRO"

    def unsupported(self, mesh: Mesh, settings: Settings, graph: IRGraph | None = None) -> str:
        stage = settings["zero_stage"]
        return "" if stage in (0, 1, 2, 3) else f"ZeRO stages are 0, 1, 2 and 3; got zero_stage={stage}"

    def values(self, config: SearchConfig, mesh: Mesh) -> tuple[Any, ...]:
        """ZeRO shards over the data-parallel axes: where they are 1, every stage is stage 0."""
        dp = mesh.group_size(mesh.dp_axes)
        return tuple(z for z in config.zero if z == 0 or dp > 1) or (0,)

    def label(self, settings: Settings) -> str:
        return f"ZeRO-{settings['zero_stage']}"

    def summary(self, plan: Plan) -> str:
        return f"ZeRO {plan.zero_stage}"

    def edge_key(self, value: Any) -> Any:
        return None  # stage 3's edges differ through its units (Problem.in_units), which the shared key holds

    def plan_fields(self, problem: Problem, evaluation: Evaluation) -> dict[str, Any]:
        return {"zero_prefetch": problem.prefetch}

    def advice(self, config: SearchConfig, graph: IRGraph, memory: Mapping[str, float]) -> str:
        if max(config.zero) == 3:
            return ""
        return "ZeRO (--zero 1,2,3: stage 3 divides parameters, gradients and optimizer states by the data-parallel degree)"

    def configure(self, problem: Problem) -> None:
        why = self.unsupported(problem.mesh, problem.settings)
        if why:
            raise ValueError(why)
        problem.unit_share_bytes = _unit_share_bytes(problem.graph, problem.bucket_bytes)
        problem.params_gathered = problem.zero_stage == 3  # (CDP, configured after, fetches them itself)

    def _gathers(self, problem: Problem) -> bool:
        return problem.params_gathered and bool(problem.mesh.active_dp_axes)

    def strategies(self, problem: Problem, anchors: dict[str, list[Strategy]], allow: StrategyFilter | None) -> StrategyFilter | None:
        if self._gathers(problem):  # each parameter input may be gathered again in backward
            graph = problem.graph
            for name, strategies in anchors.items():
                node = graph.nodes[name]
                params: dict[int, int | None] = {p: None for p, ref in enumerate(node.inputs) if graph.nodes[ref.node].kind == "param"}
                if params:
                    anchors[name] = regather_variants(RuleContext(node, graph, problem.mesh), strategies, params, axes=problem.mesh.active_dp_axes,
                                                      bucket_bytes=problem.unit_share_bytes)
        return allow

    def param_storage(self, problem: Problem, node: Node, strategies: list[Strategy]) -> list[Strategy]:
        return stored_over_dp(node, problem.mesh, strategies) if problem.params_gathered else strategies

    def prepare(self, problem: Problem) -> None:
        problem.prefetch = problem.prefetch and self._gathers(problem)
        most = _most_packed(problem) if problem.collective_sync else 0
        problem.packed_whole = most <= problem.bucket_bytes  # no gradient packed (most = 0) is whole too
        problem.sync_share_bytes = most if 0 < most <= problem.bucket_bytes else problem.bucket_bytes
        if problem.zero_stage == 1 and problem.collective_sync:
            problem.zero1_reduce = zero1_reduce(problem.mesh, problem.hardware, problem.mesh.active_dp_axes,
                                                min(most, problem.bucket_bytes))
        # ZeRO-3 hides its gathers its own way (units); with several micro-batches ZeRO-2's
        # reduce-scatters run beside every backward
        problem.sync_overlapped = problem.collective_sync and not problem.in_units
        problem.sync_repeats = problem.micro_batches if problem.zero_stage == 2 else 1

    def price_param(self, problem: Problem, node: Node, index: int, strategy: Strategy, price: ParamPrice, opt_factor: float) -> None:
        spec = strategy.outputs[0]
        assert spec is not None
        price.params, price.grads, price.states, price.step = zero_param_terms(
            node.out.shape, node.out.itemsize, spec, problem.mesh, problem.zero_stage, opt_factor, problem.sync_share_bytes, problem.zero1_reduce)

    def price_op(self, problem: Problem, node: Node, strategy: Strategy, price: NodePrice) -> None:
        if problem.prefetch and node.kind == "op":  # a gather can travel during this op's forward
            total_flops = node.flops_fwd + node.flops_bwd
            share = node.flops_fwd / total_flops if total_flops else 1 / 3  # as planner.overlap.forward_compute
            price.credit += price.compute * share * price.count

    def adjust(self, problem: Problem, assignment: dict[str, int], tally: Tally) -> None:
        if not problem.in_units:
            return
        hidden, in_units = unit_terms(problem, assignment, tally.activations)
        tally.hidden = hidden * problem.micro_batches  # the gathers repeat, and hide, in every micro-batch's forward
        if tally.activations + in_units > tally.during:
            tally.during, tally.peak_at = tally.activations + in_units, "a ZeRO-3 unit's gather"
