"""Search over configurations (mesh factorisations per TP family) and turn solutions into Plans.

For ``devices`` devices and the allowed families, every mesh of the family that tiles the
devices is a configuration (``none``: dp only; ``1d``: dp x tp; ``2d``: dp x row x col with
q x q; ``3d``: dp x i x j x k with q x q x q), with every requested ZeRO stage when dp > 1.
Configurations that cannot run are pruned with a reason (the batch does not split ``dp`` ways).
Each remaining one gives its time/memory Pareto front within the budget (:func:`planner.sweep.sweep`,
or, ``front=False``, only its fastest plan), unless a bound without an ILP already shows it cannot
fit (:func:`planner.front.memory_lower_bound`). The fronts are merged (:func:`planner.front.merge`)
and the objective picks a point: the fastest, the smallest, or the knee. CDP modes v1/v2 are
configurations too (meshes with dp > 1, ZeRO 0-2; planner.schemes.cdp), and so are micro-batch counts
(gradient accumulation: ``m`` micro-batches of batch / m rows, one after another, gradients synced
once; the graph of one micro-batch comes from the caller's ``micro_graph``).
"""

from __future__ import annotations

import functools
import gc
import heapq
import itertools
import logging
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, TypeVar

from planner.assemble import make_plan
from planner.config import Objective, SearchConfig
from planner.front import (
    Point,
    conversion_time_bound,
    covered_below,
    instant_lp_floor,
    knee,
    memory_lower_bound,
    merge,
    reprices_overlap,
    strategies_within,
    time_lower_bound,
)
from planner.ir import IRGraph
from planner.messages import (
    configuration_text,
    describe,
    dismissal,
    infeasible,
    larger_text,
    nothing_fits,
    outcome_line,
    relaxation_infeasible,
)
from planner.plan import Plan
from planner.problem import build_problem
from planner.rules.context import active_tp
from planner.schemes.cdp import PipelineEstimate, pipeline_estimates
from planner.solve import (
    BudgetILP,
    InfeasibleBudget,
    Solution,
    SolverSettings,
    SolveStopped,
    solve,
    solve_within,
)
from planner.space import Candidate, candidate_meshes
from planner.sweep import sweep
from planner.terms import Problem, StrategyFilter
from planner.units import format_bytes, format_seconds

log = logging.getLogger(__name__)

# a front's configuration whose uncovered memory (what the points as fast as its time bound leave)
# is within this fraction above its memory bound has the LP of its instants' memory solved
# (planner.front.instant_lp_floor) before the time LP within that memory (see _plan_configuration)
TIGHT_LIMIT = 0.1


@dataclass(frozen=True)
class SearchProgress:
    """Where a search stands, after each configuration it finished (``done`` of ``total``; the
    configurations pruned before any bound, e.g. a batch that does not split, are not counted):
    how many gave plans, were dismissed by bounds or dominance, or cannot fit, the seconds so far,
    the one just finished, and the seconds left (:class:`_Pace`; None before the first
    configuration and once only a one-plan search's second pass is left). ``str()`` is the line a
    log shows."""

    done: int
    total: int
    solved: int
    dismissed: int
    infeasible: int
    elapsed_s: float
    configuration: str
    outcome: str
    eta_s: float | None = None

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
    # when nothing fits: what no plan goes below and the smallest plan found (bytes per device), the
    # least memory any plan needs between them, the first at least (1 - LEAST_GAP) of the second
    least_memory: tuple[float, float] | None = None
    config: SearchConfig | None = None  # what was searched: every plan carries it too

    @property
    def feasible(self) -> list[Plan]:
        """Every plan found: each configuration's front (or its one plan)."""
        return [p for c in self.candidates for p in (c.front or ((c.plan,) if c.plan is not None else ()))]


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
    config: SearchConfig,
    *,
    model_name: str,
    progress: Callable[[SearchProgress], None] | None = None,
    workers: int | None = None,
    micro_graph: Callable[[int], IRGraph] | None = None,
    allow: StrategyFilter | None = None,
    exhaustive: bool = False,
) -> SearchResult:
    """Plan every configuration ``config`` asks for; merge their fronts and pick by its objective.
    The result and every plan in it carry ``config`` (so a saved plan repeats its search:
    ``planner report MODEL --config PLAN.json``).

    What the search does with ``config``'s fields (:class:`planner.config.SearchConfig`):
    ``front``: each configuration's Pareto front (``resolution``, ``max_points``: see
    :func:`planner.sweep.sweep`; the resolution holds across configurations too: a plan slower
    than a point already found is sought only if it needs at least ``resolution`` less memory,
    so ``resolution=0`` gives the exact merged front); otherwise only its fastest plan within the
    budget (its smallest, ``objective="memory"``), which is what one plan for one budget needs.
    ``objective``: the fastest plan, the smallest, or the knee of the merged front
    (:func:`planner.front.knee`). ``master_dtype`` (mixed precision): the graph is priced in its
    traced dtype (trace the model in bfloat16 for bf16 training) and the optimizer keeps master
    weights and states in this dtype. ``prefetch``: ZeRO-3 plans start parameter gathers one ahead
    (:mod:`planner.overlap`). ``bucket_bytes``: the size of the buckets the gradient sync packs its
    collectives into (:mod:`planner.buckets`; DDP's 25 MiB by default).

    ``exhaustive``: solve every configuration that can fit, even one that bounds show cannot add to
    the front (or beat the best plan): the configuration table then has each one's own plans.
    ``allow``: a filter of the strategies any configuration may use (a test's or a benchmark's
    fixed layout). ``progress`` receives a :class:`SearchProgress` before the first configuration
    and after each. ``workers``: processes solving configurations at once for a front (default 1:
    in this process; more fork workers, for a process without threads or a process group, e.g. a
    script; one plan is searched serially, which is faster); each new configuration starts with the
    front found so far, so the order the solves finish in can change which points are skipped as
    dominated, never the merged front's non-dominated points up to the sweep's resolution. The
    cyclic garbage collector is off while it runs.

    ``micro_graph(m)``: the graph of one micro-batch (the traced batch / ``m``), for each count
    ``m`` > 1 of ``config.micro_batches`` (:func:`planner.trace.micro_batch_inputs` cuts the inputs)."""
    t0 = time.perf_counter()
    budget = config.budget
    batch = graph.batch_rows()
    result = SearchResult(best=None, objective=config.objective, memory_budget=budget, config=config)
    configs = candidate_meshes(config, batch, graph)
    if all(c.reason for c in configs):  # nothing to solve, and memory is not why: the user's options are
        reasons = list(dict.fromkeys(c.reason for c in configs))
        raise ValueError(f"no configuration of this search can run: {'; '.join(reasons[:4])}{' ...' if len(reasons) > 4 else ''} "
                         f"(global batch {batch}, {config.devices} devices); change the options named")
    graphs = _micro_graphs(graph, batch, {c.micro_batches for c in configs if not c.reason}, micro_graph)
    # conversions and holds are priced when a configuration is solved, not for its bounds
    problems = {k: _problem(graphs, cand, config, allow, edges=False) for k, cand in enumerate(configs) if not cand.reason}
    bounds = {k: (time_lower_bound(pb), memory_lower_bound(pb)) for k, pb in problems.items()}
    outcome: dict[int, Candidate] = {k: c for k, c in enumerate(configs) if c.reason}
    found: list[Plan] = []  # the front so far, across configurations
    options = {"model_name": model_name, "exhaustive": exhaustive}

    pace = _Pace({k: math.sqrt(_size(pb)) for k, pb in problems.items()})

    def finished(k: int, cand: Candidate) -> None:
        nonlocal found
        outcome[k] = cand
        found = merge([*found, *cand.front])
        pace.passed(k)
        if progress:
            searched = [outcome[j] for j in outcome if not configs[j].reason]  # the pruned ones are not counted
            progress(_progress(searched, len(bounds), configuration_text(configs[k]), outcome_line(cand), t0, pace.eta_s()))

    if progress:
        progress(_progress([], len(bounds), "", "", t0, None))
    # the small problems first (size class, see _size_class), and within a class the configurations
    # that could be fastest (overlap aside, which only ZeRO-3 and CDP get and which the bound counts as
    # if it hid every collective): their points dismiss the others sooner
    order = sorted(problems, key=lambda k: (_size_class(problems[k]), time_lower_bound(problems[k], overlap=False), bounds[k][1]))
    # one plan: the serial two passes (bounds and relaxations for all, then MIPs in bound order)
    # beat workers that each solve their MIP at once (GPT-3 175B, 64 devices: 2.8 s serial, 18.1 s with 2)
    workers = _workers(workers, len(order)) if config.front or exhaustive else 1
    if workers <= 1:
        # one plan: a budgeted MIP (the slow solve) waits until every configuration has its bounds,
        # then runs in bound order, so the most promising is solved first and dismisses the rest
        deferred: list[tuple[int, Deferred]] = []
        incumbents: list[_Seen] = []  # plans the first pass met on the way (rounded LP answers that fit)
        for k in order:
            t_lb, m_lb = bounds[k]
            outcome_k = _plan_configuration(problems.pop(k), configs[k], t_lb, m_lb, config, lambda: merge([*found, *incumbents]),
                                            defer=not config.front and not exhaustive, incumbents=incumbents,
                                            rebuild=functools.partial(_problem, graphs, configs[k], config, allow, edges=False),
                                            **options)  # type: ignore[arg-type]
            if isinstance(outcome_k, Deferred):
                deferred.append((k, outcome_k))
                pace.passed(k)
            else:
                finished(k, outcome_k)
        for k, d in sorted(deferred, key=lambda kd: kd[1].t_lb):
            others = [p for p in incumbents if p is not d.own]  # a rounded plan of its own stands for it, unsolved
            finished(k, d.finish(merge([*found, *others])))
    else:
        _run_parallel(workers, order, finished, (problems, configs, bounds, config, options))
    result.candidates = [outcome[k] for k in range(len(configs))]
    if any(c != "off" for c in config.cdp):
        result.pipelines = pipeline_estimates(graph, config.hardware, devices=config.devices, batch=batch, optimizer=config.optimizer)
    result.front = merge(result.feasible, config.resolution if config.front else 0.0)  # spaced by the resolution (planner.front.merge)
    result.knee = knee(result.front)
    if result.front:
        result.best = {"time": result.front[0], "memory": result.front[-1], "knee": result.knee}[config.objective]
    elif any(c.least_memory is not None for c in result.candidates):
        result.infeasible, result.least_memory = least_memory_message(graphs, config, result, allow=allow)
    else:
        stopped = [c for c in result.candidates if c.reason.startswith("stopped")]
        if stopped:
            result.infeasible = (f"No plan found: {len(stopped)} configuration{'s' if len(stopped) > 1 else ''} stopped at the time limit "
                                 f"before finding any, e.g. {stopped[0].reason.removeprefix('stopped: ')}")
    _stamp(result, config)
    result.seconds = time.perf_counter() - t0
    return result


def _stamp(result: SearchResult, config: SearchConfig) -> None:
    """Every plan of ``result`` carries ``config`` (one copy per plan, so the same plan stays the
    same object in the candidates, the front, the best and the knee)."""
    stamped: dict[int, Plan] = {}

    def stamp(plan: Plan | None) -> Plan | None:
        if plan is None:
            return None
        if id(plan) not in stamped:
            stamped[id(plan)] = plan.model_copy(update={"search_config": config})
        return stamped[id(plan)]

    result.candidates = [replace(c, plan=stamp(c.plan), front=tuple(stamp(p) for p in c.front)) for c in result.candidates]  # type: ignore[misc]
    result.front = [stamp(p) for p in result.front]  # type: ignore[misc]
    result.best, result.knee = stamp(result.best), stamp(result.knee)


def _problem(graphs: dict[int, IRGraph], cand: Candidate, config: SearchConfig, allow: StrategyFilter | None,
             keep: Mapping[str, Sequence[int]] | None = None, *, edges: bool = True) -> Problem:
    """Configuration ``cand``'s problem: its mesh and scheme settings, the search-wide rest from
    ``config``; ``keep``: only those strategies of each group (:func:`planner.problem.restrict`)."""
    return build_problem(graphs[cand.micro_batches], cand.mesh, config.hardware, optimizer=config.optimizer, master_dtype=config.master_dtype,
                         prefetch=config.prefetch, cdp_stages=config.cdp_stages, allow=allow, edges=edges, bucket_bytes=config.bucket_bytes,
                         keep=keep, **cand.settings)


# a cut problem is built only when it keeps at most this share of the strategies: a smaller cut
# saves less than building and pricing the problem again costs (a round figure, not tuned)
_CUT_SHARE = 0.8


def _within_reach(problem: Problem, step_time: float, rebuild: Callable[[dict[str, tuple[int, ...]]], Problem]) -> Problem | None:
    """``problem`` cut to the strategies a plan faster than ``step_time`` may use
    (:func:`planner.front.strategies_within`), rebuilt where that drops enough of them; None when
    no plan of it can be faster."""
    keep = strategies_within(problem, step_time)
    if keep is None or not all(keep.values()):
        return None
    if sum(map(len, keep.values())) > _CUT_SHARE * problem.num_choices:
        return problem
    return rebuild(keep)


def _solver(config: SearchConfig) -> SolverSettings:
    """The limits ``config`` sets on each ILP solve."""
    return SolverSettings(time_limit_s=config.time_limit_s, relative_gap=config.relative_gap)


def _size(problem: Problem) -> int:
    """The sum over groups of their strategy counts squared: a measure, before any edge is priced,
    of how large a configuration's ILP will be (its transportation variables grow with the
    product of two groups' strategy counts)."""
    return sum(len(group.strategies) ** 2 for group in problem.groups.values())


def _size_class(problem: Problem) -> int:
    """The binary order of magnitude of :func:`_size`. A search takes the classes in turn, the small
    first: their ILPs build and solve in a fraction of the large ones' time, and the plans they give
    dismiss many large configurations by bounds alone, before their LP relaxation. Only the order
    changes: every configuration is still dismissed by a bound or solved. Measured, one plan, ZeRO
    0-3, 64 devices (1-D problems measure about 3e3, 2-D 1e5, 3-D 3e5-1e6), against bound order
    alone: gpt2-small 16.1 s -> 12.4 s in decades, 9.4 s in powers of two; GPT-3 1.3B 15.5 -> 8.1 s;
    GPT-3 13B 14.5 -> 11.0 s; vit-base 6.7 -> 5.5 s; the same plans. In bound order the 3-D ZeRO-3
    configuration of gpt2-small came before any 1-D plan was known and took 4.7 s to dismiss by its
    relaxation, where the 1-D plans' 40.66 ms dismiss it by its conversion bound (42.06 ms). The
    fronts are their configurations' sweeps whatever the order (vit-base on 8 devices: 113 s and
    121 s, mlp-large 20.4 s and 20.3 s)."""
    return int(math.log2(max(1, _size(problem))))


class _Pace:
    """The seconds a search has left, from the pace so far: each configuration weighs the square
    root of its :func:`_size`, and the seconds since the first configuration started are spread
    over the weight passed (solved, dismissed, or deferred to a one-plan search's second pass), so

        left = seconds so far * weight not yet passed / weight passed.

    A search takes the small configurations first, and a large one takes longer, which the rate per
    configuration alone (what this replaced) did not know. Measured on eleven searches (the fronts
    of gpt2-small, GPT-3 1.3B and vit-base on 8 devices and of mlp-large on 64 and 512; one plan of
    gpt-tiny, gpt2-small, vit-base, GPT-3 1.3B and 13B on 64 and of gpt2-small on 512), against the
    seconds that were really left: at a quarter, half and three quarters of the configurations the
    median estimate was off by a factor of 1.59 (2.23 with the rate per configuration), and of the
    352 estimates shown this one was the closer in 231. Of the powers 0, 1/4, 1/2, 3/4 and 1 of the
    size, tried on records of nine of those searches, 1/2 was the best. The second pass is not
    estimated (it is short: the bounds dismiss most deferred configurations at once).
    """

    def __init__(self, weights: dict[int, float]) -> None:
        self.weights, self.left, self.start = weights, set(weights), time.perf_counter()
        self.total = sum(weights.values())

    def passed(self, k: int) -> None:
        self.left.discard(k)

    def eta_s(self) -> float | None:
        remaining = sum(self.weights[k] for k in self.left)
        spent = self.total - remaining
        return (time.perf_counter() - self.start) * remaining / spent if remaining and spent else None


def _progress(finished: list[Candidate], total: int, configuration: str, line: str, t0: float, eta_s: float | None) -> SearchProgress:
    """The search's progress after the configurations ``finished`` (of ``total`` to solve)."""
    solved = sum(1 for c in finished if c.front)
    dismissed = sum(1 for c in finished if not c.front and c.reason.startswith("dominated"))
    return SearchProgress(done=len(finished), total=total, solved=solved, dismissed=dismissed, infeasible=len(finished) - solved - dismissed,
                          elapsed_s=time.perf_counter() - t0, configuration=configuration, outcome=line, eta_s=eta_s)


def _micro_graphs(graph: IRGraph, batch: int, counts: set[int], micro_graph: Callable[[int], IRGraph] | None) -> dict[int, IRGraph]:
    """The graph of one micro-batch for each micro-batch count (1: ``graph`` itself), checked."""
    graphs = {1: graph}
    for m in sorted(counts - {1}):
        if micro_graph is None:
            raise ValueError(f"micro-batch count {m} needs the graph of one micro-batch: pass micro_graph= (e.g. "
                             "lambda m: trace(model, *micro_batch_inputs(args, kwargs, m)))")
        g = micro_graph(m)
        rows = g.batch_rows()
        if rows * m != batch:
            raise ValueError(f"micro_graph({m}) traced a batch of {rows}; one of {m} micro-batches of {batch} has {batch // m}")
        graphs[m] = g
    return graphs


_SHARED: tuple[Any, ...] = ()  # what forked workers read: problems, configurations, bounds, the search config, options


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
    problems, configs, bounds, config, options = _SHARED
    t_lb, m_lb = bounds[k]
    done = _plan_configuration(problems[k], configs[k], t_lb, m_lb, config, lambda: [_Seen(*p) for p in list(seen)], **options)
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
                    seen.extend([(p.step_time_s, p.peak_memory_bytes, describe(p)) for p in cand.front])
                    finished(pending.pop(future), cand)
                    nxt = next(queue, None)
                    if nxt is not None:
                        pending[pool.submit(_solve_shared, nxt, seen)] = nxt
    finally:
        _SHARED = ()


def _over_budget(done: Candidate, budget: float, m_lb: float, t0: float) -> Candidate:
    """``done`` dismissed: its memory bound ``m_lb`` is over ``budget``."""
    return replace(done, reason=f"no plan on mesh {done.mesh} fits {format_bytes(budget)} per device: every plan needs at least "
                   f"{format_bytes(m_lb)} (a bound without an ILP), {format_bytes(m_lb - budget)} over",
                   least_memory=m_lb, least_is_bound=True, seconds=time.perf_counter() - t0)


def _plan_configuration(
    problem: Problem,
    cand: Candidate,
    t_lb: float,
    m_lb: float,
    config: SearchConfig,
    found: Callable[[], Sequence[Point]],
    *,
    model_name: str,
    exhaustive: bool = False,
    defer: bool = False,
    incumbents: list[_Seen] | None = None,
    rebuild: Callable[[dict[str, tuple[int, ...]]], Problem] | None = None,
) -> Candidate | Deferred:
    """One configuration: dismissed by its bounds, or its front (its fastest plan, ``front=False``).
    ``defer`` (one plan, the time objective): only bounds now, the MIP in :meth:`Deferred.finish`;
    a rounded LP answer that fits goes to ``incumbents``. With ``rebuild`` (the configuration's
    problem cut to given strategies) and a plan known, a deferred configuration is first cut to
    the strategies a faster plan may use (:func:`_within_reach`): a one-plan search needs no
    other, and its LP and MIP are smaller."""
    t0 = time.perf_counter()
    budget, objective, front, resolution = config.budget, config.objective, config.front, config.resolution
    done = Candidate(cand.mesh, cand.family, cand.settings)
    if m_lb > budget:
        return _over_budget(done, budget, m_lb, t0)
    dismissed = dismissal(done, t_lb, m_lb, [] if exhaustive else found(), objective=objective, front=front, resolution=resolution,
                           what="bounds")
    if dismissed is not None:
        return replace(dismissed, seconds=time.perf_counter() - t0)
    now = [] if exhaustive else found()
    if now:
        # conversions priced (the solve needs them anyway): a bound that counts them, before any ILP
        t_lb = max(t_lb, conversion_time_bound(problem) * (1 - 1e-9))
        dismissed = dismissal(done, t_lb, m_lb, now, objective=objective, front=front, resolution=resolution,
                               what="bounds with conversions")
        if dismissed is not None:
            return replace(dismissed, seconds=time.perf_counter() - t0)
    # an LP next: first the memory bound that counts each instant's working set (tens of
    # milliseconds, where the LP that would show it takes seconds; worked out only here, since it
    # costs ten times the cheap bound: 6 % of gpt2-small's 64-device search had it run for every
    # configuration the first bounds kept)
    m_lb = max(m_lb, memory_lower_bound(problem, instants=True))
    if m_lb > budget:
        return _over_budget(done, budget, m_lb, t0)
    # on a front, a configuration whose least memory is above what the points as fast as its
    # bound leave uncovered is dismissed here: the LP within that memory would be infeasible, and
    # proving it took longest of all (measured, gpt2-small on 64 devices, 4 x 4 x 4 ZeRO-0: 77 s)
    dismissed = dismissal(done, t_lb, m_lb, [] if exhaustive else found(), objective=objective, front=front, resolution=resolution,
                           what="bounds with conversions and each instant's memory")
    if dismissed is not None:
        return replace(dismissed, seconds=time.perf_counter() - t0)
    # the bounds of a problem cut to the strategies a plan faster than the best found may use hold
    # below that plan's time only: they are clipped there (the configuration's fastest plan is
    # faster, and then in the cut problem, or it is not, and that plan's time bounds it)
    ceiling = math.inf
    if now and defer and objective == "time" and rebuild is not None:
        cut = _within_reach(problem, now[0].step_time_s, rebuild)
        if cut is None:  # (rounding: the bound and the plan's time within 1e-9)
            dismissed = dismissal(done, max(t_lb, now[0].step_time_s), m_lb, now, objective=objective, front=front, what="bounds with conversions")
            assert dismissed is not None
            return replace(dismissed, seconds=time.perf_counter() - t0)
        if cut is not problem:
            problem, ceiling = cut, now[0].step_time_s
    settings = _solver(config)
    overlaps = reprices_overlap(problem)
    if defer and objective == "time":
        # one plan: the LP relaxation within the budget is all the first pass solves (its rounded
        # answer, when it fits, is a plan that dismisses others); the MIP waits for the second
        bounding = BudgetILP(problem, "time", settings, credited=overlaps)
        relaxation = bounding.relax(budget, simplex_first=True)  # a fresh model, the device's memory: likely loose
        if relaxation.infeasible and problem.kept:  # none of the plans that could beat the best found fits
            t_lb = max(t_lb, ceiling)
        elif relaxation.infeasible:
            return relaxation_infeasible(done, budget, time.perf_counter() - t0)
        if relaxation.bound is not None:
            t_lb = max(t_lb, min(relaxation.bound * (1 - settings.relative_gap), ceiling))
        dismissed = dismissal(done, t_lb, m_lb, found(), objective=objective, front=front, resolution=resolution,
                               what="the LP relaxation within the budget" + (" of the strategies that could beat it" if problem.kept else ""))
        if dismissed is not None:
            return replace(dismissed, seconds=time.perf_counter() - t0)
        own = None
        if relaxation.plan is not None and incumbents is not None:  # dismisses others, never its own configuration
            own = _Seen(relaxation.plan.step_time, int(relaxation.plan.peak_memory), f"{configuration_text(done)} (the LP relaxation rounded)")
            incumbents.append(own)
        return Deferred(problem, done, None if overlaps else bounding, config, t_lb, m_lb, time.perf_counter() - t0, model_name, own)
    ilp = BudgetILP(problem, "time", settings) if front or objective != "memory" else None
    # where the evaluation hides communication, the credited model's relaxation bounds evaluated times
    credited = BudgetILP(problem, "time", settings, credited=True) if overlaps and ilp is not None and not exhaustive else None
    fastest: Solution | None = None
    now = [] if exhaustive else found()
    if ilp is not None and now:
        # the LP relaxation within the budget bounds the time of every plan that fits (of the
        # credited objective, where the evaluation may hide communication: the evaluated time)
        limit = min(budget, covered_below(now, t_lb, resolution) * (1 - 1e-6)) if front else budget
        if limit < m_lb * (1 + TIGHT_LIMIT):
            # within a little of the least memory the bounds show, the time LP is hard, a memory bound
            # by LP not (measured, gpt2-small on 64 devices, dp=8 x 2 x 2 x 2 ZeRO-1 within 1.33 GiB:
            # dual simplex and interior point both stopped at the 120 s limit, where the least-memory
            # LP read 1.36 GiB in 7.8 s, and the instants' LP the same in 1.1 s): that first
            m_lb = max(m_lb, instant_lp_floor(problem, settings.time_limit_s) or 0.0)
            if m_lb > budget:
                return _over_budget(done, budget, m_lb, t0)
            dismissed = dismissal(done, t_lb, m_lb, now, objective=objective, front=front, resolution=resolution,
                                   what="the LP of the memory at each instant")
            if dismissed is not None:
                return replace(dismissed, seconds=time.perf_counter() - t0)
        relaxation = (credited if credited is not None else ilp).relax(limit)
        if relaxation.infeasible and limit >= budget:
            return relaxation_infeasible(done, budget, time.perf_counter() - t0)
        if relaxation.infeasible:  # every plan needs more than the limit
            m_lb = max(m_lb, limit)
        bound = relaxation.bound
        if bound is not None:
            t_lb = max(t_lb, bound * (1 - settings.relative_gap))
        dismissed = dismissal(done, t_lb, m_lb, now, objective=objective, front=front, resolution=resolution,
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
            dismissed = dismissal(done, t_lb, m_lb, found(), objective=objective, front=front, resolution=resolution,
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
            solutions = sweep(problem, memory_budget=useful, resolution=resolution, max_points=config.max_points, ilp=ilp, fastest=fastest,
                              covered=None if exhaustive else (lambda t: covered_below(found(), t, resolution)),
                              bounding=credited)
        else:
            solutions = [solve_within(ilp, budget, fastest)]
    except InfeasibleBudget as exc:
        least = exc.least.peak_memory if exc.least else None
        if useful < budget and least is not None and least <= budget:
            return replace(done, reason=f"dominated: its plans within {format_bytes(budget)} are all slower and {larger_text(resolution)} than plans "
                             "of the configurations above", least_memory=least, seconds=time.perf_counter() - t0)
        return infeasible(done, problem, budget, exc.least, str(exc), time.perf_counter() - t0)
    except SolveStopped as exc:  # no plan of it is known: it stays out of the front, and says why
        return replace(done, reason=f"stopped: {exc}", seconds=time.perf_counter() - t0)
    if not solutions:  # the sweep's LP bounds showed every plan that fits covered by points found before
        return replace(done, reason=f"dominated: the LP relaxation shows its plans within {format_bytes(budget)} all slower and "
                       f"{larger_text(resolution)} than plans of the configurations above", seconds=time.perf_counter() - t0)
    every = [make_plan(problem.graph, problem, sol, model_name=model_name, memory_budget=budget, optimizer=config.optimizer) for sol in solutions]
    plans = merge(every, resolution if front else 0.0)
    lowest = min(every, key=lambda p: p.peak_memory_bytes)
    if plans[-1].peak_memory_bytes > lowest.peak_memory_bytes:
        # its least-memory plan stays, at the end, within the resolution of the point before it: the
        # merged front, spaced across configurations, may drop that point for another configuration's
        # and still need this one (planner.sweep.sweep)
        plans.append(lowest)
    log.info("%s: %d points", configuration_text(cand), len(plans))
    return replace(done, family=plans[0].tp, plan=plans[0], front=tuple(plans), seconds=time.perf_counter() - t0)


@dataclass
class Deferred:
    """A configuration left for the second pass of a one-plan search, with its bounds and (where
    the LP relaxation's model is the time ILP itself) its built model."""

    problem: Problem
    done: Candidate
    ilp: BudgetILP | None
    config: SearchConfig
    t_lb: float
    m_lb: float
    seconds: float  # spent on it so far
    model_name: str
    own: _Seen | None = None  # the plan its LP relaxation rounded to, among the search's incumbents

    def finish(self, found: Sequence[Point]) -> Candidate:
        start = time.perf_counter()
        config = self.config
        dismissed = dismissal(self.done, self.t_lb, self.m_lb, found, objective=config.objective, front=config.front,
                               what="the LP relaxation within the budget")
        if dismissed is not None:
            return replace(dismissed, seconds=self.seconds)
        try:
            # a plan of another configuration is known: this one's exact least memory is not needed
            # when nothing fits (its ILP prices all the memory only without overlap: self.ilp set)
            sol = solve_within(self.ilp or BudgetILP(self.problem, "time", _solver(config)), config.budget,
                               exact_least=not (found and (self.ilp is not None or self.problem.kept)))
        except InfeasibleBudget as exc:
            if self.problem.kept:  # cut to the strategies that could beat a plan found: none of those fits
                return replace(self.done, reason=f"dominated: none of its plans that could beat the {describe(found[0])} plan "
                               f"({format_seconds(found[0].step_time_s)} with {format_bytes(found[0].peak_memory_bytes)}) fits "
                               f"{format_bytes(config.budget)} per device", seconds=self.seconds + time.perf_counter() - start)
            return infeasible(self.done, self.problem, config.budget, exc.least, str(exc), self.seconds + time.perf_counter() - start)
        except SolveStopped as exc:
            return replace(self.done, reason=f"stopped: {exc}", seconds=self.seconds + time.perf_counter() - start)
        plan = make_plan(self.problem.graph, self.problem, sol, model_name=self.model_name, memory_budget=config.budget, optimizer=config.optimizer)
        return replace(self.done, family=plan.tp, plan=plan, front=(plan,), seconds=self.seconds + time.perf_counter() - start)


# the least memory a "nothing fits" message quotes is within this fraction of the exact least
LEAST_GAP = 0.02


def least_memory_message(graphs: dict[int, IRGraph], config: SearchConfig, result: SearchResult, *,
                         allow: StrategyFilter | None) -> tuple[str, tuple[float, float] | None]:
    """Nothing fits: the least memory any plan needs, to within :data:`LEAST_GAP`, the terms of
    the smallest plan found, and what would change it.

    Best first over the configurations' lower bounds (the search's bound without an ILP, or the
    budget where the LP relaxation within it was infeasible): the configuration with the least is
    refined by its least-memory LP relaxation, whose rounded answer is a plan
    (:meth:`planner.solve.BudgetILP.memory_relaxation`); the least-memory MIP, to the same gap, runs
    only on a configuration whose LP bound is still the least. It stops once the least bound left
    is within the gap of the smallest plan found, so the least memory is between that bound and
    that plan, and the message says so where they differ. A configuration the search solved
    brings its exact least memory. Measured, GPT-3 175B on 64 devices at batch 64, where nothing
    fits 80 GiB: the exact least (184.90 GiB) took 25 LP relaxations (up to 23 s each on
    dp=8 x 2 x 2 x 2) and a 27.6 s MIP, 131 s in all; now two LP relaxations, 0.7 s, and the
    message says 184.13-187.25 GiB (the bounds count the saved tensors every plan holds,
    :func:`planner.edges.hold_floor`, 153 GiB there: without them the bounds of ZeRO 0-2 were
    their parameters and states alone, and each needed its LP)."""
    settings = replace(_solver(config), relative_gap=max(_solver(config).relative_gap, LEAST_GAP))
    best: tuple[float, Candidate, dict[str, float]] | None = None  # the smallest plan found
    lows: list[float] = []  # the lower bounds of the configurations taken off the queue
    for c in result.candidates:
        if c.least_memory is not None and not c.least_is_bound:  # exact: the search solved it
            lows.append(c.least_memory)
            if best is None or c.least_memory < best[0]:
                best = (c.least_memory, c, dict(c.least_terms))
    # equal bounds (the saved tensors every plan holds are often most of it) in the order of their
    # LPs' cost: the meshes of fewer tensor-parallel axes first
    # stages of a bound: 0 the search's, 1 with each instant's working set, 2 the LP relaxation's
    queue = [(c.least_memory or 0.0, len(active_tp(c.mesh)), k, 0, c) for k, c in enumerate(result.candidates) if c.least_is_bound]
    heapq.heapify(queue)
    problems: dict[int, Problem] = {}

    def waits(bound: float) -> bool:
        """Whether a configuration whose bound rose to ``bound`` goes back to the queue: another may
        need less, or it is within the gap of the smallest plan found."""
        return bool(queue and bound > queue[0][0]) or (best is not None and bound >= best[0] * (1 - LEAST_GAP))

    while queue and (best is None or queue[0][0] < best[0] * (1 - LEAST_GAP)):
        bound, cost, k, stage, c = heapq.heappop(queue)
        if k not in problems:
            problems[k] = _problem(graphs, c, config, allow, edges=False)
        if stage == 0:  # milliseconds, where the LP takes seconds (planner.front.instant_floor)
            bound = max(bound, memory_lower_bound(problems[k], instants=True))
            if waits(bound):
                heapq.heappush(queue, (bound, cost, k, 1, c))
                continue
        ilp = BudgetILP(problems[k], "memory", settings)
        if stage < 2:
            relaxation = ilp.memory_relaxation()
            if relaxation.plan is not None and (best is None or relaxation.plan.peak_memory < best[0]):
                best = (relaxation.plan.peak_memory, c, relaxation.plan.memory)
            bound = max(bound, relaxation.bound or 0.0)
            if waits(bound):
                heapq.heappush(queue, (bound, cost, k, 2, c))
                continue
        # the least bound, refined: its MIP, to the gap, on the model whose LP just ran where it did
        # (its basis is the MIP's start); the lexicographic second MIP, the fastest plan of that
        # memory, is not run: the message quotes the memory alone
        del problems[k]  # solved now, for good
        try:
            solution = ilp.run(float("inf"))
            assert solution is not None  # the memory objective has no budget row; run() raises when it stops without a plan
        except SolveStopped:  # no plan of it (or none known): its bound stays
            lows.append(bound)
            continue
        ev = solution.evaluation
        # within the gap of its optimum (the MIP's own bound, or its LP's where the neighbourhood's plan sufficed)
        lows.append(max(bound, ev.peak_memory * (1 - LEAST_GAP) * (1 - 1e-6)) if solution.status == "optimal" else bound)
        if best is None or ev.peak_memory < best[0]:
            best = (ev.peak_memory, c, ev.memory)
    if best is None:
        return "", None
    lower = min([*lows, *(b for b, *_ in queue[:1]), best[0]])
    least, cand, memory = best
    graph = graphs[1]
    # CDP's one saving: with its stages on different devices (runtime.cdp_pipeline.CDPPipeline),
    # a device holds only its stage's parameters and the activations of its workers in flight
    pipelines = pipeline_estimates(graph, config.hardware, devices=config.devices, batch=graph.batch_rows(), optimizer=config.optimizer)
    text = nothing_fits(config, graph, least, cand, memory, min(pipelines, key=lambda e: e.peak_memory, default=None), lower=lower)
    return text, (lower, least)
