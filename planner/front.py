"""The time/memory Pareto front: merging configurations' plans, the knee, and bounds that skip ILPs.

Each configuration (mesh, TP family, ZeRO stage, CDP mode) gives its own front by the
epsilon-constraint method (:func:`planner.sweep.sweep`): the fastest plan within the budget, then
the fastest within just less memory than that plan needs, and so on down to the least memory any
plan of the configuration needs. Every point is non-dominated within its configuration (a plan
beating it on both would have been the fastest within that budget). :func:`merge` keeps the points
no other configuration's point dominates.

:func:`knee` picks the point of best balance: both axes normalised to [0, 1] over the front, the
point farthest from the chord joining the fastest and the smallest plan (the maximum-distance
rule of Das 1999, "On characterizing the knee of the Pareto curve", which Kneedle, Satopaa et al.
2011, also uses). Past it, each byte saved costs more time than before it.

:func:`memory_lower_bound` bounds a configuration's least memory from below without an ILP, so a
configuration that cannot fit is dismissed in microseconds: the peak is PO + max(A + T, G + T,
G + S) >= PO + G and >= PO + A (planner.solve), and each group's share of a sum is at least its
smallest over its strategies. :func:`time_lower_bound` does the same for the step time (each
group's fastest strategy, no conversion, less what overlap could hide), and
:func:`conversion_time_bound` a tighter one once conversions are priced (each group's strategy
with the cheapest conversion any producer leaves it: on 3-D meshes conversions are most of a
step, and this bound dismisses configurations without building their ILP).
A configuration whose two bounds a point already found beats on both (:func:`dominated`) can add
nothing to the front and is not solved.

:func:`covered_below` lets a sweep jump: once a configuration's plan takes ``t`` seconds, its next
plans are slower still, so only memory below every already-found point at least as fast can help.
Both take the sweep's ``resolution``: across configurations as within one, a slower plan is worth
a point only if it needs at least that fraction less memory than a faster point found already.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, cast

import numpy as np

from planner.edges import conversion_uses
from planner.problem import price_conversions
from planner.terms import Problem


class Point(Protocol):
    @property
    def step_time_s(self) -> float: ...

    @property
    def peak_memory_bytes(self) -> int: ...


P = TypeVar("P", bound=Point)


def merge(points: Sequence[P], resolution: float = 0.0) -> list[P]:
    """The points no other point dominates in (step time, memory per device), fastest first (so
    memory falls down the list). Of points equal on both, the first given is kept.

    ``resolution`` r > 0 spaces the front: walking from the fastest point, a slower point is kept
    only if it needs at most (1 - r) of the memory of the last point kept. So each point saves at
    least r of the memory of the one before it, and at the least-memory end the fastest plan
    within r of the least memory stands for the slower ones (a 2.6 s plan at 9.40 GiB, not a
    10.3 s one at 9.39 GiB). Every dropped point has a kept one at least as fast that needs at
    most 1 / (1 - r) of its memory. ``resolution=0`` is the exact front."""
    if not 0.0 <= resolution < 1.0:
        raise ValueError(f"resolution must be in [0, 1), got {resolution}")
    front: list[P] = []
    for p in sorted(points, key=lambda p: (p.step_time_s, p.peak_memory_bytes)):
        last = front[-1].peak_memory_bytes if front else float("inf")
        if p.peak_memory_bytes < last and p.peak_memory_bytes <= last * (1.0 - resolution):
            front.append(p)
    return front


def knee(front: Sequence[P]) -> P | None:
    """The point of ``front`` (fastest first, non-dominated) farthest below the chord from the
    fastest point to the smallest, both axes scaled to [0, 1]; with one or two points, the fastest."""
    if not front:
        return None
    if len(front) <= 2:
        return front[0]
    t0, t1 = front[0].step_time_s, front[-1].step_time_s
    m0, m1 = front[0].peak_memory_bytes, front[-1].peak_memory_bytes
    dt, dm = (t1 - t0) or 1.0, (m0 - m1) or 1.0

    def below_chord(p: P) -> float:
        # normalised: the fastest point at (0, 1), the smallest at (1, 0); the chord is x + y = 1
        x, y = (p.step_time_s - t0) / dt, (p.peak_memory_bytes - m1) / dm
        return 1.0 - x - y

    return max(front, key=below_chord)


def memory_lower_bound(problem: Problem) -> float:
    """Bytes per device no plan of ``problem`` can go below (see the module docstring)."""
    po_g = po_a = 0.0
    for group in problem.groups.values():
        po_g += min(p + o + g for p, g, o in group.param_memory)
        po_a += min(mem - g for mem, (_, g, _) in zip(group.memory, group.param_memory, strict=True))
    return max(po_g, po_a)


def reprices_overlap(problem: Problem) -> bool:
    """Whether :func:`planner.problem.evaluate` hides communication behind compute after the ILP
    (ZeRO-3 prefetch, CDP's point-to-point messages), so a plan's step time is not the ILP's."""
    return problem.prefetch or problem.cdp != "off"


def time_lower_bound(problem: Problem, *, overlap: bool = True) -> float:
    """Seconds per step no plan of ``problem`` goes below: every group at its fastest strategy,
    conversions free, less what the evaluation may hide behind compute (each strategy's
    ``credit``: ZeRO-3 prefetch hides at most the forward compute it travels beside, CDP at most
    its messages; the gradient sync at most overlap_efficiency of itself: planner.problem.evaluate). ``overlap=False`` leaves the credit out (not a bound
    then, an estimate to order by)."""
    total = 0.0
    for group in problem.groups.values():
        credit = problem.hideable(group) if overlap else [0.0] * len(group.time)
        total += min(t - c for t, c in zip(group.time, credit, strict=True))
    return max(total, 0.0)


def conversion_time_bound(problem: Problem) -> float:
    """Seconds per step no plan of ``problem`` goes below, conversions counted (prices them first):

        T >= sum_v min_j [ t_v(j) - credit_v(j) + sum_{edges u -> v} min_i c_e(i, j) ]

    each edge's conversion charged to its consumer, at the cheapest producer strategy for the
    consumer's strategy j (:func:`conversion_charges`). Credit as in :func:`time_lower_bound`."""
    price_conversions(problem)
    charges = conversion_charges(problem)
    total = 0.0
    for g, group in problem.groups.items():
        own = np.asarray(group.time, dtype=float) - np.asarray(problem.hideable(group), dtype=float)
        if g in charges:
            own += charges[g]
        total += float(own.min())
    return max(total, 0.0)


def conversion_charges(problem: Problem) -> dict[str, np.ndarray]:
    """Per group, per strategy, the seconds of conversion it is charged in
    :func:`conversion_time_bound`. A conversion that several edges (or a group's own strategies)
    can trigger is paid once, so each use is charged its cost / uses: the charges of the uses a
    plan triggers add up to at most the cost. Worked out once per pricing of the conversions (the
    ZeRO 0-2 problems of a mesh share it: :func:`planner.edges.shared_edges`)."""
    memo = cast(dict[str, np.ndarray] | None, problem.priced_memo.get("charges"))
    if memo is not None:
        return memo
    uses = conversion_uses(problem)
    charges: dict[str, np.ndarray] = {}

    def charge(g: str) -> np.ndarray:
        if g not in charges:
            charges[g] = np.zeros(len(problem.groups[g].time))
        return charges[g]

    for key, term in problem.conversions.items():
        for gu, iu, gv, iv in term.conditions:
            if gu == gv and term.cost:
                charge(gu)[np.fromiter(iu & iv, dtype=int)] += term.cost / uses[key]
    for edge in problem.edges.values():
        srcs, dsts = list(edge.src_sets), list(edge.dst_sets)
        row, col = {s: k for k, s in enumerate(srcs)}, {t: k for k, t in enumerate(dsts)}
        cost = np.zeros((len(srcs), len(dsts)))
        for (a, b), keys in edge.conversions.items():
            cost[row[a], col[b]] = sum(problem.conversions[k].cost / uses[k] for k in keys)
        cheapest = cost.min(axis=0)
        for b, k in col.items():
            if cheapest[k]:
                charge(edge.group_v)[np.fromiter(edge.dst_sets[b], dtype=int)] += cheapest[k]
    problem.priced_memo["charges"] = charges
    return charges


def dominated(front: Sequence[P], step_time: float, memory: float, resolution: float = 0.0) -> P | None:
    """A point of ``front`` at least as fast as ``step_time`` whose memory is at most ``memory``,
    or within ``resolution`` of it (a plan at most that fraction smaller is not worth a point:
    :func:`planner.sweep.sweep`), if any."""
    return next((p for p in front if p.step_time_s <= step_time and p.peak_memory_bytes * (1 - resolution) <= memory), None)


def covered_below(front: Sequence[P], step_time: float, resolution: float = 0.0) -> float:
    """The least memory of the points of ``front`` at least as fast as ``step_time`` (inf if none),
    less ``resolution`` of it: a plan slower than ``step_time`` needs less than this to be worth a
    point of the front (with ``resolution`` 0, to be on it at all)."""
    return min((float(p.peak_memory_bytes) for p in front if p.step_time_s <= step_time), default=float("inf")) * (1 - resolution)
