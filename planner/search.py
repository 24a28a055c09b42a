"""Search over configurations (mesh factorisations per TP family) and turn solutions into Plans.

For ``devices`` devices and the allowed families, every mesh of the family that tiles the
devices is a configuration (``none``: dp only; ``1d``: dp x tp; ``2d``: dp x row x col with
q x q; ``3d``: dp x i x j x k with q x q x q), with every requested ZeRO stage when dp > 1.
Configurations that cannot run are pruned with a reason (the batch does not split ``dp`` ways).
Each remaining one gives its time/memory Pareto front within the budget (:func:`planner.solve.sweep`,
or, ``front=False``, only its fastest plan), unless a bound without an ILP already shows it cannot
fit (:func:`planner.front.memory_lower_bound`). The fronts are merged (:func:`planner.front.merge`)
and the objective picks a point: the fastest, the smallest, or the knee. CDP modes v1/v2 are
configurations too (meshes with dp > 1, ZeRO 0 or 1; planner.schemes.cdp), and so are micro-batch counts
(gradient accumulation: ``m`` micro-batches of batch / m rows, one after another, gradients synced
once; the graph of one micro-batch comes from the caller's ``micro_graph``).
"""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

from planner.buckets import DEFAULT_BUCKET_BYTES, Bucket, Gather, Gradient, Unit, pack
from planner.config import ALL_TP, Objective, SearchConfig
from planner.front import (
    Point,
    conversion_time_bound,
    covered_below,
    dominated,
    knee,
    memory_lower_bound,
    merge,
    reprices_overlap,
    time_lower_bound,
)
from planner.hardware import HardwareProfile
from planner.ir import IRGraph
from planner.mesh import Mesh, mesh_text
from planner.overlap import param_units
from planner.plan import CommRecord, GradBucket, MemoryBreakdown, NodePlan, ParamUnit, Plan, SolverInfo, TPFamily, UnitGather, fingerprint
from planner.problem import build_problem
from planner.rules import FALLBACK
from planner.schemes import recompute as recompute_scheme
from planner.schemes.cdp import PipelineEstimate, pipeline_estimate
from planner.schemes.zero import zero_param_terms
from planner.solve import (
    BudgetILP,
    InfeasibleBudget,
    Solution,
    SolverSettings,
    SolveStopped,
    infeasible_message,
    solve,
    solve_within,
    sweep,
)
from planner.terms import Evaluation, Problem, StrategyFilter
from planner.units import format_bytes, format_seconds

log = logging.getLogger(__name__)


TP_AXES = {"1d": ("tp",), "2d": ("row", "col"), "3d": ("i", "j", "k")}


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    devices: int
    tp: tuple[str, ...] = ALL_TP
    zero: tuple[int, ...] = (0,)
    cdp: tuple[str, ...] = ("off",)
    cdp_stages: int = 4
    dp: int | None = None
    micro_batches: tuple[int, ...] = (1,)  # gradient accumulation: micro-batches per step
    recompute: tuple[str, ...] = ("none",)  # activation recomputation of repeated layers (planner.schemes.recompute)

    def __post_init__(self) -> None:
        recompute_scheme.check(self.recompute)
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        unknown = [t for t in self.tp if t not in ALL_TP]
        if unknown:
            raise ValueError(f"unknown tensor-parallel family {unknown}; choose from {', '.join(ALL_TP)}")
        if any(z not in (0, 1, 2, 3) for z in self.zero):
            raise ValueError(f"ZeRO stages are 0-3, got {self.zero}")
        if any(c not in ("off", "v1", "v2") for c in self.cdp):
            raise ValueError(f"CDP modes are off, v1, v2; got {self.cdp}")
        if self.cdp_stages < 1:
            raise ValueError(f"cdp_stages must be >= 1, got {self.cdp_stages}")
        if not self.micro_batches or any(m < 1 for m in self.micro_batches):
            raise ValueError(f"micro-batch counts must be >= 1, got {self.micro_batches}")
        if self.dp is not None and (self.dp < 1 or self.devices % self.dp):
            raise ValueError(f"--dp {self.dp} does not divide the device count {self.devices}")
        for what, values in (("tensor-parallel family", self.tp), ("ZeRO stage", self.zero), ("CDP mode", self.cdp)):
            if not values:
                raise ValueError(f"the search space names no {what}: give at least one (tp: {', '.join(ALL_TP)}; zero: 0-3; cdp: off, v1, v2)")
        if not any(self.dp is None or m.degree("dp") == self.dp for f in self.tp for m in _family_meshes(self.devices, f)):
            raise ValueError(self._no_mesh())
        if min(self.zero) > 0 and (self.dp == 1 or self.devices == 1):
            stages = ",".join(map(str, self.zero))
            raise ValueError(f"ZeRO {stages} shards over the data-parallel axis, and dp = 1 leaves none to shard over (every stage is "
                             "ZeRO 0 there): search --zero 0 for the same plans, or let dp be > 1")

    def _no_mesh(self) -> str:
        """Why no mesh of the families asked for tiles the devices (with ``dp`` fixed, if it is)."""
        needs = {"none": f"dp = {self.devices}", "1d": "dp x tp with tp >= 2 dividing the device count",
                 "2d": "dp x q x q with q >= 2, q*q dividing the device count (4, 8, 9, 12, 16, ...)",
                 "3d": "dp x q x q x q with q >= 2, q^3 dividing the device count (8, 16, 24, 27, 32, ...)"}
        fixed = f" with dp = {self.dp}" if self.dp is not None else ""
        return (f"no mesh of --tp {','.join(self.tp)} tiles {self.devices} devices{fixed} ("
                + "; ".join(f"{f}: {needs[f]}" for f in self.tp)
                + "): search another family (e.g. --tp none,1d) or a device count these tile")


@dataclass(frozen=True)
class Candidate:
    mesh: Mesh
    family: str
    zero: int = 0
    cdp: str = "off"
    micro_batches: int = 1
    recompute: str = "none"
    plan: Plan | None = None  # the configuration's fastest plan within the budget
    reason: str = ""  # why pruned or infeasible
    least_memory: float | None = None
    least_is_bound: bool = False  # least_memory is a lower bound (no ILP was run), not the exact least
    least_terms: tuple[tuple[str, float], ...] = ()  # the exact least-memory plan's terms (params, grads, ...)
    front: tuple[Plan, ...] = ()  # the configuration's Pareto plans within the budget, fastest first
    seconds: float = 0.0  # building and solving this configuration


@dataclass(frozen=True)
class SearchProgress:
    """Where a search stands, after each configuration it finished (``done`` of ``total``; the
    configurations pruned before any bound, e.g. a batch that does not split, are not counted):
    how many gave plans, were dismissed by bounds or dominance, or cannot fit, the seconds so far,
    and the one just finished. ``str()`` is the line a log shows."""

    done: int
    total: int
    solved: int
    dismissed: int
    infeasible: int
    elapsed_s: float
    configuration: str
    outcome: str

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far (None before the first configuration)."""
        return self.elapsed_s / self.done * (self.total - self.done) if self.done else None

    def __str__(self) -> str:
        eta = f", ETA {self.eta_s:.0f} s" if self.eta_s is not None and self.done < self.total else ""
        return (f"[{self.done}/{self.total}] {self.configuration}: {self.outcome} "
                f"({self.solved} solved, {self.dismissed} dismissed, {self.infeasible} infeasible{eta})")


@dataclass
class SearchResult:
    best: Plan | None
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0
    pipelines: list[PipelineEstimate] = field(default_factory=list)  # CDP with stages on different devices
    front: list[Plan] = field(default_factory=list)  # non-dominated across configurations, fastest first
    knee: Plan | None = None
    objective: Objective = "time"
    memory_budget: float = 0.0
    infeasible: str = ""  # when nothing fits: the least memory any plan needs, its terms, what to change
    config: SearchConfig | None = None  # what was searched (search_configured): every plan carries it too

    @property
    def feasible(self) -> list[Plan]:
        """Every plan found: each configuration's front (or its one plan)."""
        return [p for c in self.candidates for p in (c.front or ((c.plan,) if c.plan is not None else ()))]


def _family_meshes(devices: int, family: str) -> list[Mesh]:
    """``none``: dp only; ``1d``: dp x tp (tp > 1); ``2d``: dp x row x col (q x q, q > 1);
    ``3d``: dp x i x j x k (q x q x q, q > 1). Tensor-parallel axes are the innermost, so they
    land on the fastest links (consecutive ranks share a node)."""
    if family == "none":
        return [Mesh(("dp", "tp"), (devices, 1))]
    if family not in TP_AXES:
        raise ValueError(f"unknown tensor-parallel family {family!r}")
    axes = TP_AXES[family]
    meshes = []
    q = 2
    while q ** len(axes) <= devices:
        tp = q ** len(axes)
        if devices % tp == 0:
            meshes.append(Mesh(("dp", *axes), (devices // tp, *([q] * len(axes)))))
        q += 1
    return meshes


def candidate_meshes(space: SearchSpace, batch: int) -> list[Candidate]:
    out = []
    for family in ALL_TP:
        if family not in space.tp:
            continue
        for mesh in _family_meshes(space.devices, family):
            dp = mesh.degree("dp")
            if space.dp is not None and dp != space.dp:
                continue
            for m in space.micro_batches:
                if batch % (dp * m):
                    what = f"batch {batch} does not split {dp} ways" if m == 1 else f"batch {batch} does not split into {m} micro-batches x {dp} ways"
                    out.append(Candidate(mesh, family, micro_batches=m, reason=what))
                    continue
                stages = [z for z in space.zero if z == 0 or dp > 1]
                if not stages:  # ZeRO shards over data-parallel axes: with dp = 1 every stage is stage 0
                    stages = [0]
                for cdp, zero, recompute in itertools.product(space.cdp, stages, space.recompute):
                    if cdp != "off" and dp == 1:
                        reason = "CDP runs over the data-parallel axis: needs dp > 1"
                    elif cdp != "off" and zero > 1:
                        reason = f"CDP with ZeRO-{zero} is not built in the runtime; CDP runs with ZeRO 0 or 1"
                    elif cdp != "off" and m > 1:
                        reason = "CDP staggers its own micro-batches; gradient accumulation runs with CDP off"
                    else:
                        reason = recompute_scheme.unsupported(recompute, zero, cdp)
                    out.append(Candidate(mesh, family, zero, cdp, micro_batches=m, recompute=recompute, reason=reason))
    return out


_F = TypeVar("_F", bound=Callable[..., Any])


def _collector_paused(fn: _F) -> _F:
    """``fn`` with Python's cyclic garbage collector off while it runs. A search builds millions of
    small objects (strategies, terms, ILP rows) that live until their configuration is done, and
    the collector's full passes kept traversing them: measured, GPT-3 175B on 64 devices, one plan
    8.3 s with it, 5.3 s without; the front 62.2 s and 57.7 s, with the same peak memory (1.22 GB:
    what a search drops is freed by reference counting, not by the collector)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return paused  # type: ignore[return-value]


@_collector_paused
def search(
    graph: IRGraph,
    space: SearchSpace,
    hardware: HardwareProfile,
    *,
    model_name: str,
    memory_budget: float | None = None,
    objective: Objective = "time",
    optimizer: str = "adamw",
    master_dtype: str | None = None,
    prefetch: bool = True,
    settings: SolverSettings | None = None,
    allow: StrategyFilter | None = None,
    front: bool = True,
    resolution: float = 0.05,
    max_points: int | None = 8,
    progress: Callable[[SearchProgress], None] | None = None,
    workers: int | None = None,
    exhaustive: bool = False,
    micro_graph: Callable[[int], IRGraph] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SearchResult:
    """Plan every candidate configuration of ``space``; merge their fronts and pick by ``objective``.

    ``front``: each configuration's Pareto front (``resolution``, ``max_points``: see
    :func:`planner.solve.sweep`; the resolution holds across configurations too: a plan slower
    than a point already found is sought only if it needs at least ``resolution`` less memory,
    so ``resolution=0`` gives the exact merged front); otherwise only its fastest plan within the
    budget (its smallest, ``objective="memory"``), which is what one plan for one budget needs. ``objective``: the
    fastest plan, the smallest, or the knee of the merged front (:func:`planner.front.knee`).
    ``master_dtype`` (mixed precision): the graph is priced in its traced dtype (trace the model in
    bfloat16 for bf16 training) and the optimizer keeps master weights and states in this dtype.
    ``prefetch``: ZeRO-3 plans start parameter gathers one ahead (:mod:`planner.overlap`).
    ``exhaustive``: solve every configuration that can fit, even one that bounds show cannot add to
    the front (or beat the best plan): the configuration table then has each one's own plans.
    ``progress`` receives a :class:`SearchProgress` before the first configuration and after each. ``workers``: processes solving configurations
    at once for a front (default 1: in this process; more fork workers, for a process without
    threads or a process group, e.g. a script; one plan is searched serially, which is faster);
    each new configuration starts with the front found so far, so the order the solves finish in
    can change which points are skipped as dominated, never the merged front's non-dominated
    points up to the sweep's resolution. The cyclic garbage collector is off while it runs.

    ``bucket_bytes``: the size of the buckets the gradient sync packs its collectives into
    (:mod:`planner.buckets`; DDP's 25 MiB by default).

    ``micro_graph(m)``: the graph of one micro-batch (the traced batch / ``m``), for each count
    ``m`` > 1 of ``space.micro_batches`` (:func:`planner.trace.micro_batch_inputs` cuts the inputs)."""
    if objective not in ("time", "memory", "knee"):
        raise ValueError(f"objective must be time, memory or knee; got {objective!r}")
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory budget {memory_budget!r} must be > 0 bytes per device (e.g. 40GiB; leave it out for the device's memory)")
    t0 = time.perf_counter()
    budget = float(memory_budget if memory_budget is not None else hardware.device_memory)
    batch = batch_rows(graph)
    result = SearchResult(best=None, objective=objective, memory_budget=budget)
    configs = candidate_meshes(space, batch)
    if "selective" in space.recompute and not recompute_scheme.segments(graph, "selective"):
        configs = [c if c.recompute != "selective" or c.reason else
                   replace(c, reason="selective recomputation: no repeated layer of this model has an attention core (a softmax between "
                                     "two matmuls of activations, or a fused scaled-dot-product attention)") for c in configs]
    if all(c.reason for c in configs):  # nothing to solve, and memory is not why: the user's options are
        reasons = list(dict.fromkeys(c.reason for c in configs))
        raise ValueError(f"no configuration of this search can run: {'; '.join(reasons[:4])}{' ...' if len(reasons) > 4 else ''} "
                         f"(global batch {batch}, {space.devices} devices); change the options named")
    graphs = _micro_graphs(graph, batch, {c.micro_batches for c in configs if not c.reason}, micro_graph)
    problems = {}
    for k, cand in enumerate(configs):
        if not cand.reason:
            # conversions and holds are priced when a configuration is solved, not for its bounds
            problems[k] = build_problem(graphs[cand.micro_batches], cand.mesh, hardware, optimizer=optimizer, zero_stage=cand.zero,
                                        master_dtype=master_dtype, prefetch=prefetch, cdp=cand.cdp, cdp_stages=space.cdp_stages, allow=allow,
                                        edges=False, micro_batches=cand.micro_batches, bucket_bytes=bucket_bytes, recompute=cand.recompute)
    bounds = {k: (time_lower_bound(pb), memory_lower_bound(pb)) for k, pb in problems.items()}
    outcome: dict[int, Candidate] = {k: c for k, c in enumerate(configs) if c.reason}
    found: list[Plan] = []  # the front so far, across configurations
    options = {"model_name": model_name, "optimizer": optimizer, "objective": objective, "front": front, "settings": settings,
               "resolution": resolution, "max_points": max_points, "exhaustive": exhaustive}

    def finished(k: int, cand: Candidate) -> None:
        nonlocal found
        outcome[k] = cand
        found = merge([*found, *cand.front])
        if progress:
            searched = [outcome[j] for j in outcome if not configs[j].reason]  # the pruned ones are not counted
            progress(_progress(searched, len(bounds), _configuration_text(configs[k]), _outcome_line(cand), t0))

    if progress:
        progress(_progress([], len(bounds), "", "", t0))
    # the configurations that could be fastest first (overlap aside, which only ZeRO-3 and CDP get
    # and which the bound counts as if it hid every collective): their points dismiss the others sooner
    order = sorted(problems, key=lambda k: (time_lower_bound(problems[k], overlap=False), bounds[k][1]))
    # one plan: the serial two passes (bounds and relaxations for all, then MIPs in bound order)
    # beat workers that each solve their MIP at once (GPT-3 175B, 64 devices: 2.8 s serial, 18.1 s with 2)
    workers = _workers(workers, len(order)) if front or exhaustive else 1
    if workers <= 1:
        # one plan: a budgeted MIP (the slow solve) waits until every configuration has its bounds,
        # then runs in bound order, so the most promising is solved first and dismisses the rest
        deferred: list[tuple[int, Deferred]] = []
        incumbents: list[_Seen] = []  # plans the first pass met on the way (rounded LP answers that fit)
        for k in order:
            t_lb, m_lb = bounds[k]
            outcome_k = _plan_configuration(problems.pop(k), configs[k], t_lb, m_lb, budget, lambda: merge([*found, *incumbents]),
                                            defer=not front and not exhaustive, incumbents=incumbents, **options)  # type: ignore[arg-type]
            if isinstance(outcome_k, Deferred):
                deferred.append((k, outcome_k))
            else:
                finished(k, outcome_k)
        for k, d in sorted(deferred, key=lambda kd: kd[1].t_lb):
            others = [p for p in incumbents if p is not d.own]  # a rounded plan of its own stands for it, unsolved
            finished(k, d.finish(merge([*found, *others]), objective=objective, front=front))
    else:
        _run_parallel(workers, order, finished, (problems, configs, bounds, budget, options))
    result.candidates = [outcome[k] for k in range(len(configs))]
    if any(c != "off" for c in space.cdp) and batch % space.devices == 0:
        ops = sum(1 for n in graph.nodes.values() if n.kind == "op")
        result.pipelines = [
            pipeline_estimate(graph, hardware, workers=space.devices, stages=stages, optimizer=optimizer)
            for stages in (2, 4, 8)
            if stages <= ops and space.devices % stages == 0  # runtime.cdp.CDPPipeline needs L | N
        ]
    result.front = merge(result.feasible, resolution if front else 0.0)  # spaced by the resolution (planner.front.merge)
    result.knee = knee(result.front)
    if result.front:
        result.best = {"time": result.front[0], "memory": result.front[-1], "knee": result.knee}[objective]
    elif any(c.least_memory is not None for c in result.candidates):
        result.infeasible = least_memory_message(graphs, space, hardware, result, budget, optimizer=optimizer,
                                                 master_dtype=master_dtype, prefetch=prefetch, settings=settings, allow=allow,
                                                 bucket_bytes=bucket_bytes)
    else:
        stopped = [c for c in result.candidates if c.reason.startswith("stopped")]
        if stopped:
            result.infeasible = (f"No plan found: {len(stopped)} configuration{'s' if len(stopped) > 1 else ''} stopped at the time limit "
                                 f"before finding any, e.g. {stopped[0].reason.removeprefix('stopped: ')}")
    result.seconds = time.perf_counter() - t0
    return result


def search_space(config: SearchConfig) -> SearchSpace:
    """The configurations ``config`` asks for (``ValueError`` when no mesh of them tiles the devices)."""
    return SearchSpace(devices=config.devices, tp=config.tp, zero=config.zero, cdp=config.cdp, cdp_stages=config.cdp_stages, dp=config.dp,
                       micro_batches=config.micro_batches, recompute=config.recompute)


def search_configured(graph: IRGraph, config: SearchConfig, *, model_name: str, progress: Callable[[SearchProgress], None] | None = None,
                      workers: int | None = None, micro_graph: Callable[[int], IRGraph] | None = None,
                      allow: StrategyFilter | None = None) -> SearchResult:
    """:func:`search` as ``config`` says; the result and every plan in it carry ``config`` (so a
    saved plan repeats its search: ``planner report MODEL --config PLAN.json``)."""
    result = search(graph, search_space(config), config.hardware, model_name=model_name, memory_budget=config.memory_budget, objective=config.objective,
                    optimizer=config.optimizer, master_dtype=config.master_dtype, prefetch=config.prefetch,
                    settings=SolverSettings(time_limit_s=config.time_limit_s, relative_gap=config.relative_gap), front=config.front,
                    resolution=config.resolution, max_points=config.max_points, progress=progress, workers=workers, micro_graph=micro_graph,
                    bucket_bytes=config.bucket_bytes, allow=allow)
    stamped: dict[int, Plan] = {}

    def stamp(plan: Plan | None) -> Plan | None:
        if plan is None:
            return None
        if id(plan) not in stamped:  # one copy per plan, so the same plan stays the same object everywhere
            stamped[id(plan)] = plan.model_copy(update={"search_config": config})
        return stamped[id(plan)]

    result.candidates = [replace(c, plan=stamp(c.plan), front=tuple(stamp(p) for p in c.front)) for c in result.candidates]  # type: ignore[misc]
    result.front = [stamp(p) for p in result.front]  # type: ignore[misc]
    result.best, result.knee, result.config = stamp(result.best), stamp(result.knee), config
    return result


def _progress(finished: list[Candidate], total: int, configuration: str, line: str, t0: float) -> SearchProgress:
    """The search's progress after the configurations ``finished`` (of ``total`` to solve)."""
    solved = sum(1 for c in finished if c.front)
    dismissed = sum(1 for c in finished if not c.front and c.reason.startswith("dominated"))
    return SearchProgress(done=len(finished), total=total, solved=solved, dismissed=dismissed, infeasible=len(finished) - solved - dismissed,
                          elapsed_s=time.perf_counter() - t0, configuration=configuration, outcome=line)


def batch_rows(graph: IRGraph) -> int:
    """The traced batch: dim 0 of the first input (1 without inputs)."""
    return graph.nodes[graph.input_names[0]].out.shape[0] if graph.input_names else 1


def _micro_graphs(graph: IRGraph, batch: int, counts: set[int], micro_graph: Callable[[int], IRGraph] | None) -> dict[int, IRGraph]:
    """The graph of one micro-batch for each micro-batch count (1: ``graph`` itself), checked."""
    graphs = {1: graph}
    for m in sorted(counts - {1}):
        if micro_graph is None:
            raise ValueError(f"micro-batch count {m} needs the graph of one micro-batch: pass micro_graph= (e.g. "
                             "lambda m: trace(model, *micro_batch_inputs(args, kwargs, m)))")
        g = micro_graph(m)
        rows = batch_rows(g)
        if rows * m != batch:
            raise ValueError(f"micro_graph({m}) traced a batch of {rows}; one of {m} micro-batches of {batch} has {batch // m}")
        graphs[m] = g
    return graphs


_SHARED: tuple[Any, ...] = ()  # what forked workers read: problems, configurations, bounds, budget, options


def _workers(requested: int | None, configurations: int) -> int:
    """Serial unless asked: forking a process that holds threads or a process group (a notebook,
    torchrun's rank 0) can deadlock the child, and on 2 cores the serial order dismisses more
    configurations (measured, GPT-3 13B on 64 devices: 63 s serial, 74 s with 2 workers)."""
    if requested is None or requested <= 1 or configurations < 2 or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return min(requested, configurations, os.cpu_count() or 1)


class _Seen(NamedTuple):
    """A point found by another process: all dominance needs of a plan."""

    step_time_s: float
    peak_memory_bytes: int
    label: str


def _solve_shared(k: int, seen: Any) -> Candidate:
    problems, configs, bounds, budget, options = _SHARED
    t_lb, m_lb = bounds[k]
    done = _plan_configuration(problems[k], configs[k], t_lb, m_lb, budget, lambda: [_Seen(*p) for p in list(seen)], **options)
    assert isinstance(done, Candidate)  # workers do not defer
    return done


def _run_parallel(workers: int, order: list[int], finished: Callable[[int, Candidate], None], shared: tuple[Any, ...]) -> None:
    """Solve configurations in forked processes (they inherit the built problems; only indices and
    results travel), ``workers`` at a time. The points found so far live in a manager list that
    every worker reads at each sweep step, so a configuration still running benefits from one
    that finished meanwhile, as in the serial order."""
    global _SHARED
    _SHARED = shared
    context = multiprocessing.get_context("fork")
    try:
        with context.Manager() as manager, ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            seen = manager.list()
            queue = iter(order)
            pending = {pool.submit(_solve_shared, k, seen): k for k in itertools.islice(queue, workers)}
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    cand = future.result()
                    seen.extend([(p.step_time_s, p.peak_memory_bytes, _describe(p)) for p in cand.front])
                    finished(pending.pop(future), cand)
                    nxt = next(queue, None)
                    if nxt is not None:
                        pending[pool.submit(_solve_shared, nxt, seen)] = nxt
    finally:
        _SHARED = ()


def _plan_configuration(
    problem: Problem,
    cand: Candidate,
    t_lb: float,
    m_lb: float,
    budget: float,
    found: Callable[[], Sequence[Point]],
    *,
    model_name: str,
    optimizer: str,
    objective: Objective,
    front: bool,
    settings: SolverSettings | None,
    resolution: float,
    max_points: int | None,
    exhaustive: bool = False,
    defer: bool = False,
    incumbents: list[_Seen] | None = None,
) -> Candidate | Deferred:
    """One configuration: dismissed by its bounds, or its front (its fastest plan, ``front=False``).
    ``defer`` (one plan, the time objective): only bounds now, the MIP in :meth:`Deferred.finish`;
    a rounded LP answer that fits goes to ``incumbents``."""
    t0 = time.perf_counter()
    done = Candidate(cand.mesh, cand.family, cand.zero, cand.cdp, cand.micro_batches, cand.recompute)
    if m_lb > budget:
        return replace(done, reason=f"no plan on mesh {cand.mesh} fits {format_bytes(budget)} per device: every plan needs at least "
                         f"{format_bytes(m_lb)} (a bound without an ILP), {format_bytes(m_lb - budget)} over",
                         least_memory=m_lb, least_is_bound=True, seconds=time.perf_counter() - t0)
    dismissed = _dismissed(done, t_lb, m_lb, [] if exhaustive else found(), objective=objective, front=front, resolution=resolution,
                           what="bounds")
    if dismissed is not None:
        return replace(dismissed, seconds=time.perf_counter() - t0)
    now = [] if exhaustive else found()
    if now:
        # conversions priced (the solve needs them anyway): a bound that counts them, before any ILP
        t_lb = max(t_lb, conversion_time_bound(problem) * (1 - 1e-9))
        dismissed = _dismissed(done, t_lb, m_lb, now, objective=objective, front=front, resolution=resolution,
                               what="bounds with conversions")
        if dismissed is not None:
            return replace(dismissed, seconds=time.perf_counter() - t0)
    settings = settings or SolverSettings()
    overlaps = reprices_overlap(problem)
    if defer and objective == "time":
        # one plan: the LP relaxation within the budget is all the first pass solves (its rounded
        # answer, when it fits, is a plan that dismisses others); the MIP waits for the second
        bounding = BudgetILP(problem, "time", settings, credited=overlaps)
        relaxation = bounding.relax(budget, simplex_first=True)  # a fresh model, the device's memory: likely loose
        if relaxation.infeasible:
            return _relaxation_infeasible(done, budget, time.perf_counter() - t0)
        if relaxation.bound is not None:
            t_lb = max(t_lb, relaxation.bound * (1 - settings.relative_gap))
        dismissed = _dismissed(done, t_lb, m_lb, found(), objective=objective, front=front, resolution=resolution,
                               what="the LP relaxation within the budget")
        if dismissed is not None:
            return replace(dismissed, seconds=time.perf_counter() - t0)
        own = None
        if relaxation.plan is not None and incumbents is not None:  # dismisses others, never its own configuration
            own = _Seen(relaxation.plan.step_time, int(relaxation.plan.peak_memory), f"{_configuration_text(done)} (the LP relaxation rounded)")
            incumbents.append(own)
        return Deferred(problem, done, None if overlaps else bounding, settings, t_lb, m_lb, budget, time.perf_counter() - t0,
                        model_name, optimizer, own)
    ilp = BudgetILP(problem, "time", settings) if front or objective != "memory" else None
    # where the evaluation hides communication, the credited model's relaxation bounds evaluated times
    credited = BudgetILP(problem, "time", settings, credited=True) if overlaps and ilp is not None and not exhaustive else None
    fastest: Solution | None = None
    now = [] if exhaustive else found()
    if ilp is not None and now:
        # the LP relaxation within the budget bounds the time of every plan that fits (of the
        # credited objective, where the evaluation may hide communication: the evaluated time)
        limit = min(budget, covered_below(now, t_lb, resolution) * (1 - 1e-6)) if front else budget
        relaxation = (credited if credited is not None else ilp).relax(limit)
        if relaxation.infeasible and limit >= budget:
            return _relaxation_infeasible(done, budget, time.perf_counter() - t0)
        bound = relaxation.bound
        if bound is not None:
            t_lb = max(t_lb, bound * (1 - settings.relative_gap))
        dismissed = _dismissed(done, t_lb, m_lb, now, objective=objective, front=front, resolution=resolution,
                               what="the LP relaxation within the budget")
        if dismissed is not None:
            return replace(dismissed, seconds=time.perf_counter() - t0)
    if ilp is not None and not (overlaps and front):
        # (where the evaluation re-prices overlap it bounds nothing: a sweep solves it after its
        # least memory, which may show the configuration cannot add a point)
        fastest = ilp.run(float("inf"))
        assert fastest is not None  # no budget row binds: every assignment is feasible
        if not overlaps and fastest.status == "optimal" and now:
            # the fastest plan without a budget bounds every plan of the configuration
            t_lb = max(t_lb, fastest.objective * (1 - settings.relative_gap))
            dismissed = _dismissed(done, t_lb, m_lb, found(), objective=objective, front=front, resolution=resolution,
                                   what="its fastest plan without a budget")
            if dismissed is not None:
                return replace(dismissed, seconds=time.perf_counter() - t0)
    now = [] if exhaustive else found()
    # only a plan smaller than what is already found at its speed can join the front
    useful = min(budget, covered_below(now, t_lb, resolution) * (1 - 1e-6)) if front else budget
    try:
        if ilp is None:
            solutions = [solve(problem, memory_budget=budget, objective="memory", settings=settings)]
        elif front:
            solutions = sweep(problem, memory_budget=useful, resolution=resolution, max_points=max_points, ilp=ilp, fastest=fastest,
                              covered=None if exhaustive else (lambda t: covered_below(found(), t, resolution)),
                              bounding=credited)
        else:
            solutions = [solve_within(ilp, budget, fastest)]
    except InfeasibleBudget as exc:
        least = exc.least.peak_memory if exc.least else None
        if useful < budget and least is not None and least <= budget:
            return replace(done, reason=f"dominated: its plans within {format_bytes(budget)} are all slower and {_larger(resolution)} than plans "
                             "of the configurations above", least_memory=least, seconds=time.perf_counter() - t0)
        return _infeasible(done, problem, budget, exc, time.perf_counter() - t0)
    except SolveStopped as exc:  # no plan of it is known: it stays out of the front, and says why
        return replace(done, reason=f"stopped: {exc}", seconds=time.perf_counter() - t0)
    if not solutions:  # the sweep's LP bounds showed every plan that fits covered by points found before
        return replace(done, reason=f"dominated: the LP relaxation shows its plans within {format_bytes(budget)} all slower and "
                       f"{_larger(resolution)} than plans of the configurations above", seconds=time.perf_counter() - t0)
    plans = merge([make_plan(problem.graph, problem, sol, model_name=model_name, memory_budget=budget, optimizer=optimizer) for sol in solutions],
                  resolution if front else 0.0)
    log.info("mesh %s ZeRO-%d CDP %s: %d points", cand.mesh, cand.zero, cand.cdp, len(plans))
    return replace(done, family=plans[0].tp, plan=plans[0], front=tuple(plans), seconds=time.perf_counter() - t0)


def _larger(resolution: float) -> str:
    """How a dominated configuration's plans compare in memory with faster points (see ``resolution``)."""
    return f"larger (or less than {resolution:.0%} smaller)" if resolution > 0 else "larger"


@dataclass
class Deferred:
    """A configuration left for the second pass of a one-plan search, with its bounds and (where
    the LP relaxation's model is the time ILP itself) its built model."""

    problem: Problem
    done: Candidate
    ilp: BudgetILP | None
    settings: SolverSettings
    t_lb: float
    m_lb: float
    budget: float
    seconds: float  # spent on it so far
    model_name: str
    optimizer: str
    own: _Seen | None = None  # the plan its LP relaxation rounded to, among the search's incumbents

    def finish(self, found: Sequence[Point], *, objective: Objective, front: bool) -> Candidate:
        start = time.perf_counter()
        dismissed = _dismissed(self.done, self.t_lb, self.m_lb, found, objective=objective, front=front,
                               what="the LP relaxation within the budget")
        if dismissed is not None:
            return replace(dismissed, seconds=self.seconds)
        try:
            # a plan of another configuration is known: this one's exact least memory is not needed
            # when nothing fits (its ILP prices all the memory only without overlap: self.ilp set)
            sol = solve_within(self.ilp or BudgetILP(self.problem, "time", self.settings), self.budget,
                               exact_least=not (found and self.ilp is not None))
        except InfeasibleBudget as exc:
            return _infeasible(self.done, self.problem, self.budget, exc, self.seconds + time.perf_counter() - start)
        except SolveStopped as exc:
            return replace(self.done, reason=f"stopped: {exc}", seconds=self.seconds + time.perf_counter() - start)
        plan = make_plan(self.problem.graph, self.problem, sol, model_name=self.model_name, memory_budget=self.budget, optimizer=self.optimizer)
        return replace(self.done, family=plan.tp, plan=plan, front=(plan,), seconds=self.seconds + time.perf_counter() - start)


def _relaxation_infeasible(done: Candidate, budget: float, seconds: float) -> Candidate:
    """The configuration, when even its LP relaxation has nothing within the budget (the ILP's
    memory is a lower bound on every plan's: the evaluation only adds terms)."""
    return _over_budget(done, budget, f"no plan on mesh {done.mesh} fits {format_bytes(budget)} per device: even the LP relaxation "
                        "(integrality dropped) has nothing within it", seconds)


def _over_budget(done: Candidate, budget: float, reason: str, seconds: float) -> Candidate:
    """The configuration, when nothing fits and its least memory was not solved for: more than the
    budget is all that is known."""
    return replace(done, reason=reason, least_memory=budget, least_is_bound=True, seconds=seconds)


def _infeasible(done: Candidate, problem: Problem, budget: float, exc: InfeasibleBudget, seconds: float) -> Candidate:
    """The configuration, when nothing fits: the least memory any plan needs, its terms, what to change."""
    if exc.least is None:
        return _over_budget(done, budget, str(exc), seconds)
    reason = infeasible_message(problem, budget, exc.least)
    return replace(done, reason=reason, least_memory=exc.least.peak_memory, least_terms=tuple(exc.least.memory.items()), seconds=seconds)


def _dismissed(done: Candidate, t_lb: float, m_lb: float, now: Sequence[Point], *, objective: Objective, front: bool,
               what: str, resolution: float = 0.0) -> Candidate | None:
    """The configuration, dismissed with its reason, when no plan of it faster than ``t_lb`` or
    smaller than ``m_lb`` (lower bounds, from ``what``) can beat the points found so far (on
    the front: be faster, or at least ``resolution`` smaller than a point as fast)."""
    if not front and now and objective != "knee":
        # one plan: a configuration whose bound cannot beat the best plan found is not solved
        best = now[0] if objective == "time" else now[-1]
        if (t_lb >= best.step_time_s) if objective == "time" else (m_lb >= best.peak_memory_bytes):
            bound = f"faster than {format_seconds(t_lb)}" if objective == "time" else f"smaller than {format_bytes(m_lb)}"
            return replace(done, reason=f"dominated: no plan here is {bound} ({what}), and the {_describe(best)} plan takes "
                           f"{format_seconds(best.step_time_s)} with {format_bytes(best.peak_memory_bytes)}")
    if front:
        better = dominated(now, t_lb, m_lb, resolution)
        if better is not None:
            within = f"; a plan less than {resolution:.0%} smaller is within the front's resolution" if better.peak_memory_bytes > m_lb else ""
            return replace(done, reason=f"dominated: no plan here is faster than {format_seconds(t_lb)} ({what}) or smaller than "
                             f"{format_bytes(m_lb)} (a bound), and the {_describe(better)} plan takes {format_seconds(better.step_time_s)} "
                             f"with {format_bytes(better.peak_memory_bytes)}{within}")
    return None


def _describe(plan: Plan | Point) -> str:
    if not isinstance(plan, Plan):
        return getattr(plan, "label", "another configuration's")
    return _label(mesh_text(plan.mesh), plan.zero_stage, plan.cdp, plan.micro_batches, plan.recompute)


def _configuration_text(c: Candidate) -> str:
    return _label(str(c.mesh), c.zero, c.cdp, c.micro_batches, c.recompute)


def _label(mesh: str, zero: int, cdp: str, micro_batches: int = 1, recompute: str = "none") -> str:
    return (f"{mesh} ZeRO-{zero}" + (f" CDP {cdp}" if cdp != "off" else "") + (f" x{micro_batches} micro-batches" if micro_batches > 1 else "")
            + (f" recompute {recompute}" if recompute != "none" else ""))


def _outcome_line(c: Candidate) -> str:
    if c.front:
        first, last = c.front[0], c.front[-1]
        return (f"{len(c.front)} point{'s' if len(c.front) > 1 else ''}, {format_seconds(first.step_time_s)} at "
                f"{format_bytes(first.peak_memory_bytes)} to {format_seconds(last.step_time_s)} at {format_bytes(last.peak_memory_bytes)} "
                f"({c.seconds:.1f} s)")
    if c.reason.startswith("dominated"):
        return f"dominated ({c.seconds:.1f} s)"
    need = f"needs {'at least ' if c.least_is_bound else ''}{format_bytes(c.least_memory)}" if c.least_memory is not None else c.reason
    return f"{need}, infeasible ({c.seconds:.1f} s)"


def least_memory_message(
    graphs: dict[int, IRGraph],
    space: SearchSpace,
    hardware: HardwareProfile,
    result: SearchResult,
    budget: float,
    *,
    optimizer: str,
    master_dtype: str | None,
    prefetch: bool,
    settings: SolverSettings | None,
    allow: StrategyFilter | None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> str:
    """Nothing fits: the least memory any configuration needs (exact: configurations dismissed by
    their bound are solved, smallest bound first, until no bound is below the best exact least),
    the terms that make it up, and what would change it."""
    exact = [c for c in result.candidates if c.least_memory is not None and not c.least_is_bound]
    best: tuple[float, Candidate, dict[str, float]] | None = None
    if exact:
        c = min(exact, key=lambda c: c.least_memory or 0.0)
        best = (c.least_memory or 0.0, c, dict(c.least_terms))
    for c in sorted((c for c in result.candidates if c.least_is_bound), key=lambda c: c.least_memory or 0.0):
        if best is not None and (c.least_memory or 0.0) >= best[0]:
            break
        problem = build_problem(graphs[c.micro_batches], c.mesh, hardware, optimizer=optimizer, zero_stage=c.zero, master_dtype=master_dtype,
                                prefetch=prefetch, cdp=c.cdp, cdp_stages=space.cdp_stages, allow=allow, micro_batches=c.micro_batches,
                                bucket_bytes=bucket_bytes, recompute=c.recompute)
        ev = solve(problem, memory_budget=float("inf"), objective="memory", settings=settings).evaluation
        if best is None or ev.peak_memory < best[0]:
            best = (ev.peak_memory, c, ev.memory)
    if best is None:
        return ""
    least, cand, memory = best
    terms = sorted(memory.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in terms if v)
    state = memory["params"] + memory["grads"] + memory["optimizer"]
    advice = []
    if max(space.zero) < 3:
        advice.append("ZeRO (--zero 1,2,3: stage 3 divides parameters, gradients and optimizer states by the data-parallel degree)")
    if memory["activations"] >= state / 2:
        advice.append("a smaller batch per step (--batch), since activations are a large share")
        more = max(space.micro_batches) * 2
        if batch_rows(graphs[1]) % more == 0:
            advice.append(f"gradient accumulation (--micro-batches {more}: each micro-batch holds a share of the activations)")
        if space.recompute == ("none",) and graphs[1].repeated:
            advice.append("activation recomputation (--recompute none,full: each repeated layer keeps only its input and runs "
                          "its forward again in backward)")
        if all(m == "off" for m in space.cdp):
            advice.append("CDP (--cdp v1: staggered micro-batches hold about half the activations)")
    advice.append(f"more devices (at least {least / budget:.1f}x the memory in all: more tensor or data parallelism spreads the "
                  f"{'parameter, gradient and optimizer state' if state >= memory['activations'] else 'activation'} bytes)")
    return (f"No plan on {space.devices} devices fits {format_bytes(budget)} per device. The least memory any plan needs is "
            f"{format_bytes(least)} ({format_bytes(least - budget)} over), on mesh {cand.mesh} with ZeRO-{cand.zero}"
            + (f" and CDP {cand.cdp}" if cand.cdp != "off" else "")
            + (f" in {cand.micro_batches} micro-batches" if cand.micro_batches > 1 else "")
            + (f", recomputing {cand.recompute}" if cand.recompute != "none" else "") + f": {parts}. To fit, try " + "; or ".join(advice) + ".")


def tp_family(problem: Problem, assignment: dict[str, int]) -> TPFamily:
    """The mesh's family if any node uses its tensor-parallel axes, else ``none``."""
    mesh = problem.mesh
    tp_axes = {a for a in mesh.tp_axes if mesh.degree(a) > 1}
    for name, strategies in problem.choices.items():
        s = strategies[assignment[problem.node_group[name]]]
        if s.split_axes & tp_axes or any(o is not None and o.layout.shard_axes & tp_axes for o in s.outputs):
            for family, axes in TP_AXES.items():
                if set(axes) == set(mesh.tp_axes):
                    return family  # type: ignore[return-value]
            return "mixed"
    return "none"


def make_plan(
    graph: IRGraph,
    problem: Problem,
    solution: Solution,
    *,
    model_name: str,
    memory_budget: float,
    optimizer: str = "adamw",
    trace_seconds: float | None = None,
) -> Plan:
    nodes = []
    fallbacks = []
    segment_of = recompute_scheme.segments(graph, problem.recompute)
    number = {key: k for k, key in enumerate(dict.fromkeys(segment_of.values()))}
    ends = recompute_scheme.last_savers(graph, problem.recompute)
    for name, strategies in problem.choices.items():
        s = strategies[solution.assignment[problem.node_group[name]]]
        nodes.append(
            NodePlan(
                name=name,
                target=graph.nodes[name].target,
                algorithm=s.algorithm,
                kernel=s.kernel,
                inputs=tuple(spec.encode() for spec in s.inputs),
                outputs=tuple(spec.encode() if spec is not None else None for spec in s.outputs),
                split_axes=problem.mesh.sort_axes(s.split_axes),
                raw_output=s.raw_output.encode() if s.raw_output is not None else None,
                regather=tuple((pos, spec.encode()) for pos, spec in s.regather),
                module=graph.nodes[name].module_path,
                recompute_segment=number[segment_of[name]] if name in segment_of else None,
                ends_segment=name in ends,
            )
        )
        if s.algorithm == FALLBACK:
            fallbacks.append(f"{name} ({graph.nodes[name].target}) in {graph.nodes[name].module_path or '<root>'}")
    ev = solution.evaluation
    buckets = gradient_buckets(graph, problem, solution.assignment)
    units, loose = param_units(problem, solution.assignment)
    return Plan(
        model=model_name,
        model_fingerprint=fingerprint(graph),
        input_shapes=tuple(graph.nodes[n].out.shape for n in graph.input_names),
        mesh=problem.mesh.as_dict(),
        hardware=problem.hardware.name,
        tp=tp_family(problem, solution.assignment),
        zero_stage=problem.zero_stage,
        micro_batches=problem.micro_batches,
        recompute=problem.recompute,  # type: ignore[arg-type]
        optimizer=optimizer,
        master_dtype=problem.master_dtype,
        zero_prefetch=problem.prefetch,
        cdp=problem.cdp,  # type: ignore[arg-type]
        cdp_stages=problem.cdp_stages,
        memory_budget_bytes=int(memory_budget) if memory_budget != float("inf") else 0,
        step_time_s=ev.step_time,
        compute_time_s=ev.compute_time,
        comm_time_s=ev.comm_time,
        overlap_time_s=ev.overlap_time,
        recompute_time_s=ev.recompute_time,
        peak_memory_bytes=int(ev.peak_memory),
        memory_breakdown=_breakdown(ev),
        nodes=tuple(nodes),
        comms=_comm_records(ev, buckets, problem.micro_batches, problem.sync_share_bytes, units, loose, problem.unit_share_bytes),
        grad_bucket_bytes=problem.bucket_bytes,
        grad_buckets=tuple(GradBucket(axes=b.axes, dtype=b.dtype, params=b.params, nbytes=b.nbytes, collectives=b.collectives) for b in buckets),
        param_units=tuple(
            ParamUnit(axes=u.axes, dtype=u.dtype, block=u.gathers[0].block,
                      gathers=tuple(UnitGather(site=g.site, param=g.param, nbytes=g.nbytes, regather=g.regather, reduced=g.reduced) for g in u.gathers))
            for u in units
        ),
        fallbacks=tuple(fallbacks),
        solver=SolverInfo(
            status="optimal" if solution.status == "optimal" else "time_limit",
            backend=solution.backend,
            trace_s=trace_seconds if trace_seconds is not None else sum(graph.timings.values()),
            build_s=problem.build_seconds + solution.build_seconds,
            solve_s=solution.solve_seconds,
            num_variables=solution.num_variables,
            num_constraints=solution.num_constraints,
        ),
    )


def _breakdown(ev: Evaluation) -> MemoryBreakdown:
    m = ev.memory
    return MemoryBreakdown(
        params=int(m["params"]), grads=int(m["grads"]), optimizer=int(m["optimizer"]),
        activations=int(m["activations"]), transient=int(m["transient"]), step_transient=int(m["step_transient"]),
        peak_at=ev.peak_at,
    )


def gradient_buckets(graph: IRGraph, problem: Problem, assignment: dict[str, int]) -> tuple[Bucket, ...]:
    """The gradient sync's buckets under ``assignment``: every packed collective a parameter's
    strategy prices (:func:`planner.schemes.zero.zero_param_terms`), ready in the reverse order of the
    parameters' first use."""
    if problem.cdp != "off":
        return ()
    order = {name: k for k, name in enumerate(graph.nodes)}
    consumers = graph.consumers()
    gradients = []
    for name, node in graph.nodes.items():
        if node.kind != "param":
            continue
        spec = problem.choices[name][assignment[problem.node_group[name]]].outputs[0]
        assert spec is not None
        _, _, _, step = zero_param_terms(node.out.shape, node.out.itemsize, spec, problem.mesh, problem.zero_stage, 1.0, problem.bucket_bytes,
                                         problem.zero1_reduce)
        first_use = min((order[c] for c, _ in consumers[name]), default=-1)
        packed = tuple((c.kind, c.phase) for c in step if c.bucket_bytes)
        if packed:
            gradients.append(Gradient(name, step[0].nbytes, step[0].axes, node.out.dtype, first_use, packed))
    return pack(gradients, problem.bucket_bytes)


def _comm_records(ev: Evaluation, buckets: tuple[Bucket, ...] = (), micro_batches: int = 1, bucket_bytes: int = 0,
                  units: tuple[Unit, ...] = (), loose: tuple[Gather, ...] = (), unit_bytes: int = 0) -> tuple[CommRecord, ...]:
    """The evaluation's collectives per step, with the packed collectives (one per parameter in
    the evaluation) as the buckets and ZeRO-3 units that run them (a backward-phase bucket, ZeRO-2's
    reduce-scatter, and every unit collective, once per micro-batch), each priced as its members'
    shares (of ``bucket_bytes``, the gradient sync's share bytes, and ``unit_bytes``, the units');
    a ``loose`` gather (priced as a share, run alone) as its own collectives."""
    counts: Counter[tuple[str, tuple[str, ...], int, str, int]] = Counter()
    packed: Counter[tuple[str, tuple[str, ...], str]] = Counter()  # bytes the parameters' packed collectives move
    for comm, n in ev.comms:
        if comm.bucket_bytes:
            packed[(comm.kind, comm.axes, comm.phase)] += comm.nbytes * n
        else:
            counts[(comm.kind, comm.axes, comm.nbytes, comm.phase, 0)] += n
    for bucket in buckets:
        for kind, phase in bucket.collectives:
            n = 1 if phase == "step" else micro_batches
            counts[(kind, bucket.axes, bucket.nbytes, phase, bucket_bytes)] += n
            packed[(kind, bucket.axes, phase)] -= bucket.nbytes * n
    for unit in units:
        for kind, phase, nbytes in unit.collectives():
            counts[(kind, unit.axes, nbytes, phase, unit_bytes)] += micro_batches
            packed[(kind, unit.axes, phase)] -= nbytes * micro_batches
    for g in loose:
        for kind, phase, nbytes in Unit(g.axes, g.dtype, (g,)).collectives():
            counts[(kind, g.axes, nbytes, phase, unit_bytes)] += micro_batches
            packed[(kind, g.axes, phase)] -= nbytes * micro_batches
    assert not any(packed.values()), f"the buckets and units do not move what the evaluation priced: {dict(packed)}"
    return tuple(
        CommRecord(kind=k, axes=a, nbytes=b, phase=p, count=c, bucket_bytes=s)  # type: ignore[arg-type]
        for (k, a, b, p, s), c in sorted(counts.items())
    )
