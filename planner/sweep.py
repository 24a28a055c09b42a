"""The front of one configuration: an epsilon-constraint sweep of the memory budget over its
time ILP (:func:`sweep`), each point the fastest plan within a budget, until the least memory any
plan needs; points closer than the resolution are not solved for.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable

from planner.messages import infeasible_message
from planner.solve import FLOOR_SLACK, TIE_BREAK, BudgetILP, InfeasibleBudget, Solution, SolverSettings, SolveStopped, least_memory, within
from planner.terms import Problem

log = logging.getLogger(__name__)


def sweep(
    problem: Problem,
    *,
    memory_budget: float,
    settings: SolverSettings | None = None,
    resolution: float = 0.0,
    max_points: int | None = None,
    covered: Callable[[float], float] | None = None,
    ilp: BudgetILP | None = None,
    fastest: Solution | None = None,
    bounding: BudgetILP | None = None,
) -> list[Solution]:
    """The configuration's time/memory Pareto front within ``memory_budget``, fastest first.

    1. The two ends: the fastest plan (no budget) and the least memory any plan needs (``m_min``),
       ended by the fastest plan of that memory (``resolution`` r > 0: a plan within
       ``m_min / (1 - r)`` at least as fast as that, the point the spaced front keeps there, see
       :func:`planner.front.merge` and :func:`_end`, and the least-memory plan too where that
       plan is above it: the front merged with other configurations' may need it).
    2. The supported points (on the front's convex hull) by weighted sums (the dichotomic scheme
       of Aneja & Nair 1979): between two points A and B, minimise time + w x memory with w the
       slope of AB; a plan strictly below the segment is a new point, and both halves are
       searched again. These solves have no budget row and are fast.
    3. The points between two neighbours by the epsilon-constraint method (Haimes, Lasdon &
       Wismer 1971): the fastest plan within ``m - step`` of the larger neighbour's memory ``m``,
       and so on down to the smaller neighbour: the plans above the hull, whose budgeted MIPs are
       the hard ones. Where the budget cuts the hull, the fastest plan within it starts the front.

    ``step = max(resolution * m, 1e-6 * m)``: ``resolution = 0`` finds every front point more than a
    millionth apart in memory (the exact front; the tests compare it with brute force), 0.05 leaves out
    points within 5 % of memory of a neighbour. With r > 0 the MIPs of steps 2 and 3 stop at a relative
    gap of ``g = settings.front_gap * r`` (2 % at 5 %; most of their time was spent proving the last
    percents: measured, gpt-tiny on dp=2 x 2 x 2, a weighted MIP 4.2 s exact, 2.3 s at 1 %, the same
    plan; :class:`planner.solve.SolverSettings` has the figures for 2 %): each point of step 3 is within
    g of the fastest plan within its budget, so every point of the exact front has a point at most g
    slower within 1 / (1 - r) of its memory, but near the least memory, where the end is within r
    (:func:`_end`); tests/test_front.py and tests/test_solver.py check both against brute force. The
    fastest plan is solved to ``settings.relative_gap``, the least memory to
    ``e = settings.least_gap * r`` (1e-4 at 5 %; the end's bounds with it, :func:`_end`; exactly
    where whether any plan fits the budget is within e); r = 0 is exact throughout.
    ``max_points`` caps the points (but for the least-memory plan, kept beside an end above it so
    that a merge with other configurations' fronts still has a point near the least memory): the ends
    first, then the supported points, then the gaps, largest first. ``covered(t)``, when given, is
    the memory below which a plan slower than ``t`` seconds beats every point found elsewhere
    (:func:`planner.front.covered_below`): a gap's next budget jumps below it, and further while
    the LP relaxation within the budget (a lower bound on the time of every plan that fits,
    solved in a fraction of the MIP's time) is itself covered. Where the evaluation re-prices
    overlap (ZeRO-3 prefetch, CDP), the ILP's time bounds nothing: ``bounding`` must then be the
    credited model (``BudgetILP(..., credited=True)``), whose relaxation bounds evaluated times,
    and only those bounds are used. ``ilp``: the problem's time ILP, when already built;
    ``fastest``: its answer without a budget, when already solved. Raises
    :class:`InfeasibleBudget` when ``m_min`` exceeds the budget."""
    settings = ilp.settings if ilp is not None else settings or SolverSettings()
    least_gap = settings.least_memory_gap(resolution)
    try:
        least, least_ilp = least_memory(problem, settings, gap=least_gap)
        within_gap = least.evaluation.peak_memory * (1 - least_gap)
        if least.evaluation.peak_memory > memory_budget and least_gap > settings.relative_gap and within_gap <= memory_budget:
            least, least_ilp = least_memory(problem, settings, least_ilp)  # whether a plan fits is within the gap: exactly
    except SolveStopped:  # the front's low-memory end is unknown: the fastest plan is still a plan, marked as stopped
        top = fastest or (ilp or BudgetILP(problem, "time", settings)).run(float("inf"))
        if top is None or top.evaluation.peak_memory > memory_budget:
            raise
        return [dataclasses.replace(top, status="time_limit")]
    floor = least.evaluation.peak_memory
    if floor > memory_budget:
        raise InfeasibleBudget(infeasible_message(problem, memory_budget, least.evaluation), budget=memory_budget, least=least.evaluation)
    ilp = ilp or BudgetILP(problem, "time", settings)
    overlaps = bounding is not None and bounding is not ilp
    bounding = bounding or ilp
    cap = max_points if max_points is not None else float("inf")
    top = fastest or ilp.run(float("inf"))
    assert top is not None
    # the least-memory end (see _end); exact (r = 0), unless a bound shows it covered by points found elsewhere
    gap = settings.sweep_gap(resolution)
    end = _end(ilp, least, resolution, covered, bounding, gap, least_ilp)
    # the least-memory plan itself is a point too where the end is above it (r > 0): a front merged with
    # other configurations' may drop the end for a faster point within r of it and still need a point
    # near the least memory (measured, vit-base on 8 devices: the 3-D end at 270.4 MiB gave way to a
    # 2-D point at 276.1 MiB, where this configuration's least is 257.8 MiB); not where the end is within
    # the least memory's gap of it (the least memory is known to that much)
    above = end is not None and least.evaluation.peak_memory < end.evaluation.peak_memory * (1 - least_gap)
    lowest = least if above else None
    least = end or least  # when covered: the memory objective's plan, to end the hull, not to report
    if covered is not None and top.evaluation.peak_memory > memory_budget:
        covered_at_budget = covered(bounding.relaxation(memory_budget) or 0.0)
        if covered_at_budget <= floor:  # a bound shows every plan that fits covered already
            return []

    def memory(sol: Solution) -> float:
        return sol.evaluation.peak_memory

    def seconds(sol: Solution) -> float:
        return sol.evaluation.step_time  # the ILP's, unless the evaluation re-prices overlap

    # 2. supported points, breadth first so a cap keeps them spread
    hull = [top, least] if memory(least) < memory(top) else [least]
    segments = [(top, least)] if len(hull) == 2 else []
    while segments and len(hull) < cap:
        a, b = segments.pop(0)
        if memory(a) - memory(b) <= max(resolution * memory(a), 1e-6 * memory(a)):
            continue
        if covered is not None and not overlaps and covered(a.evaluation.step_time) <= memory(b):
            continue  # a plan between a and b is slower than a, larger than b: covered already
        dt, dm = (seconds(b) - seconds(a)) / ilp.model.t_unit, (memory(a) - memory(b)) / ilp.model.m_unit
        if dt <= 0:
            continue  # b is as fast as a with less memory: a is not on the front (tolerances)
        w = dt / dm
        line = seconds(a) / ilp.model.t_unit + w * memory(a) / ilp.model.m_unit
        # a point is a plan strictly below the segment: with the tie-break, below a's value (as it is smaller
        # than a), which the solver prunes with where the ILP prices what the evaluation does (not where it
        # hides communication: there a plan above the line as the ILP prices it may be below it evaluated)
        below = math.inf if overlaps else line + TIE_BREAK * memory(a) / ilp.model.m_unit
        r = ilp.weighted_below(w, below, gap=gap)
        if r is None:
            continue
        value = seconds(r) / ilp.model.t_unit + w * memory(r) / ilp.model.m_unit
        if memory(b) < memory(r) < memory(a) and value < line - 1e-9 * max(abs(line), 1.0):
            hull.append(r)
            segments += [(a, r), (r, b)]
    hull.sort(key=memory, reverse=True)
    points = [p for p in hull if memory(p) <= memory_budget and (p is not least or end is not None)]
    # 3. the gaps: the budget's cut of the hull first, then the widest
    gaps: list[tuple[float, Solution]] = []
    if memory(hull[0]) > memory_budget:
        gaps.append((memory_budget, points[0] if points else least))
    neighbours = points if end is not None else [*points, least]  # a covered end still bounds the last gap
    gaps += [(memory(a) - max(resolution * memory(a), 1e-6 * memory(a)), b) for a, b in itertools.pairwise(neighbours)]
    gaps.sort(key=lambda g: g[0] - memory(g[1]), reverse=True)
    for budget, lower in gaps:
        while budget > memory(lower) and len(points) < cap:
            # only a plan faster than the lower neighbour is a point: the solver prunes with its time
            # where the ILP prices what the evaluation does (not where it hides communication)
            sol = _fill(ilp, budget, covered, memory(lower), bounding, gap, None if overlaps else seconds(lower))
            if sol is None or memory(sol) <= memory(lower) or sol.evaluation.step_time >= lower.evaluation.step_time:
                break
            points.append(sol)
            budget = memory(sol) - max(resolution * memory(sol), 1e-6 * memory(sol))
    if lowest is not None and memory(lowest) <= memory_budget:
        points.append(lowest)
    if not points:
        return []
    points.sort(key=lambda p: (p.evaluation.step_time, memory(p)))
    front = [points[0]]
    for p in points[1:]:
        if memory(p) < memory(front[-1]):
            front.append(p)
    return front


def _end(ilp: BudgetILP, least: Solution, resolution: float, covered: Callable[[float], float] | None, bounding: BudgetILP | None,
         gap: float, least_ilp: BudgetILP | None = None) -> Solution | None:
    """The front's least-memory end, from the least-memory plan ``least`` (memory ``m_min``, step
    time ``T_L``), or None (``resolution`` 0) when a bound shows it covered (see :func:`_fill`).
    ``least_ilp``: the model that found ``least``, whose basis the weighted solve below starts from
    (:meth:`planner.solve.BudgetILP.weighted`; where a bound showed this end covered, that bound was an
    LP relaxation near the least memory, which took longer than the solve it could save).

    ``resolution`` 0: the fastest plan of exactly ``m_min`` (a budgeted MIP there). With r > 0,
    ``least`` is solved to a relative gap e (:meth:`planner.solve.SolverSettings.least_memory_gap`):
    its memory ``m_L`` is at most ``m_min / (1 - e)``. The end is the plan P minimising ``M + lam T``
    without a budget, ``lam = r m_L / ((1 - r)(1 + r) T_L)``, solved to an absolute gap of ``lam r T_L``.
    For the fastest plan F within ``m_L`` (``T_F <= T_L``, as ``least`` is such a plan):
    ``M_P + lam T_P <= m_L + lam T_F + lam r T_L``. As ``M_P >= m_min >= (1 - e) m_L``,
    ``T_P <= T_F + r T_L + e m_L / lam = T_F + (r + e (1 - r^2) / r) T_L`` (``e = r / 500``: 0.2 % of
    ``T_L`` more), and ``M_P - m_L <= lam (1 + r) T_L = r m_L / (1 - r)``: P is within the resolution
    of the least memory found in memory, and of the fastest plan there in time (times as the ILP
    prices them: where the evaluation hides communication, ZeRO-3 prefetch or CDP, P may land a
    little past the window). The sweep's gap between P and the next point up then looks for faster
    plans above it.

    Why not the fastest plan within ``m_min / (1 - r)``, a budgeted MIP: near the least memory its
    bound is weak (the peak is a max over instants, which fractional strategies undercut) and it
    was most of a front's time (measured, gpt-tiny on 8 devices, every family and ZeRO stage: the
    ends took 145 of the 167 s of budgeted MIPs at a 1 % gap; on 2 x 2 x 2 alone 69 s, where this
    takes 2.7 s; on dp=2 x 2 x 2 ZeRO-1 22.7 s, this 3.1 s). Solved to the front's 1 % gap instead of
    r, this MIP took 60 s on the latter: its memory bound is as weak, and r is the accuracy the
    spaced front promises."""
    floor = least.evaluation.peak_memory
    window = max(floor * (1 + FLOOR_SLACK), floor / (1 - resolution))
    if resolution <= 0:
        return _fill(ilp, window, covered, floor * (1 - 1e-6), bounding, gap)
    t_least = max(least.evaluation.step_time, 1e-30) / ilp.model.t_unit
    weight = t_least * (1 - resolution) * (1 + resolution) / (resolution * floor / ilp.model.m_unit)
    return (least_ilp or ilp).weighted(weight, absolute_gap=resolution * t_least)


def _fill(ilp: BudgetILP, budget: float, covered: Callable[[float], float] | None, floor: float, bounding: BudgetILP | None = None,
          gap: float | None = None, faster_than: float | None = None) -> Solution | None:
    """The fastest plan within ``budget``, or None when a bound shows every plan between
    ``floor`` and the budget covered (``covered``: see :func:`sweep`), or when no plan within it is
    faster than ``faster_than`` seconds (as the ILP prices them). An answer whose exact memory
    exceeds the budget (solver tolerance, or a term the ILP does not price) is re-solved below."""
    while covered is not None:
        below = _covered_within(ilp, budget, covered, bounding)
        if below is None or below >= budget:
            break
        if below <= floor:
            return None
        budget = below
    return within(ilp, budget, gap, faster_than)


def _covered_within(ilp: BudgetILP, budget: float, covered: Callable[[float], float], bounding: BudgetILP | None) -> float | None:
    """The memory below which a plan within ``budget`` can beat the points ``covered`` knows: it is
    at least as slow as the LP relaxation within the budget; None without a bound (the relaxation
    is infeasible, or the backend is CBC)."""
    bound = (bounding or ilp).relaxation(budget)
    if bound is None:
        return None
    return covered(bound * (1 - ilp.settings.relative_gap)) * (1 - 1e-6)
