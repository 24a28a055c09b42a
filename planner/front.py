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
G + S) >= PO + G and >= PO + A (planner.solve), each group's share of a sum is at least its
smallest over its strategies, and each saved tensor's hold at least the least any plan keeps of
it (:func:`planner.edges.hold_floor`); taken instant by instant (:func:`instant_floor`), it also counts
what runs beside the activations alive there (the loss's working set at the end of forward), and
:func:`instant_lp_floor` takes the instants together as one LP, the conversions' working sets
counted, where a front's search is near a configuration's least memory. :func:`time_lower_bound` bounds the step time as the first does the memory (each
group's fastest strategy, no conversion, less what overlap could hide), and
:func:`conversion_time_bound` a tighter one once conversions are priced (the conversions coupled
along a spanning forest of the groups' graph, solved exactly by a dynamic programme: on 3-D
meshes conversions are most of a step, and this bound dismisses configurations without building
their ILP). The same programme, run both ways along the forest, bounds the plans that choose
each strategy (:func:`strategies_within`): a one-plan search cuts a configuration to the
strategies that could beat the best plan found before it builds its LP (exact: no faster plan is
cut).
A configuration whose two bounds a point already found beats on both (:func:`dominated`) can add
nothing to the front and is not solved.

:func:`covered_below` lets a sweep jump: once a configuration's plan takes ``t`` seconds, its next
plans are slower still, so only memory below every already-found point at least as fast can help.
Both take the sweep's ``resolution``: across configurations as within one, a slower plan is worth
a point only if it needs at least that fraction less memory than a faster point found already.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol, TypeVar, cast

import highspy
import numpy as np

from planner.backends import highs_of, quiet, run_for
from planner.edges import bound_holds, conversion_uses, hold_floors
from planner.ilp import Arrays, instant_rows
from planner.peak import Form, Instant, instants
from planner.problem import price_conversions, price_edges
from planner.terms import HoldTerm, Problem


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


def memory_lower_bound(problem: Problem, *, instants: bool = False) -> float:
    """Bytes per device no plan of ``problem`` can go below (see the module docstring).
    ``instants``: the tighter bound of :func:`instant_floor` too, which takes about ten times as
    long (measured, gpt2-small on 64 devices: 22 ms a configuration against 2.5 ms), so a search
    works it out only just before a configuration's first LP, and a "nothing fits" message before
    each LP relaxation."""
    po_g = po_a = 0.0
    for group in problem.groups.values():
        po_g += min(p + o + g for p, g, o in group.param_memory)
        po_a += min(mem - g for mem, (_, g, _) in zip(group.memory, group.param_memory, strict=True))
    holds = bound_holds(problem)
    floors = hold_floors(problem, holds)
    cheap = max(po_g, po_a + sum(floor for floor, _ in floors))
    return max(cheap, instant_floor(problem, holds, floors)) if instants else cheap


def instant_floor(problem: Problem, holds: dict[tuple[object, ...], HoldTerm], floors: list[tuple[float, tuple[tuple[object, ...], ...]]]) -> float:
    """Bytes per device no plan goes below at any one instant of the step (:mod:`planner.peak`):
    every plan pays PO + P_k + Q_k + F_k + w at each instant k, for each w that may run there, so

        peak >= max over k, w of [ sum_g min_i (PO_g + P_k,g + Q_k,g + F_k,g + w_g)[i] + H_k ]

    each group's part of the sum at its smallest strategy for that instant (the parameters, the
    activations saved so far, the gradients made, those in flight and what runs, together), and
    H_k, the saved tensors alive there: per tensor, its floor (:func:`planner.edges.hold_floors`)
    times the least share of it any of its hold terms has made alive by k. The conversions'
    buffers count 0 (their indicators are at least 0), so the instants are taken without them
    (the holds priced alone, :func:`planner.edges.bound_holds`). The end of forward is where it
    tells: the loss's working set beside every activation, which the bound of the activations
    alone left out (measured, HF Llama-3-8B at sequence 8192, 8 devices: the cross-entropy over
    128k-word logits holds 7.8 GiB, 6 % of the least memory)."""
    points = instants(problem, holds)
    if not points:
        return 0.0
    n = len(points)
    sizes = {g: len(group.strategies) for g, group in problem.groups.items()}
    saved = {g: np.zeros((n, m)) for g, m in sizes.items()}
    made = {g: np.zeros((n, m)) for g, m in sizes.items()}
    flight = {g: np.zeros((n, m)) for g, m in sizes.items()}
    for k, point in enumerate(points):
        for form, xs in ((point.saved, saved), (point.grads, made), (point.in_flight, flight)):
            for var, v in form.items():
                if var[0] == "x":
                    xs[cast(str, var[1])][k, cast(int, var[2])] += v
    base: dict[str, np.ndarray] = {}
    for g, group in problem.groups.items():
        po = np.fromiter((p + o for p, _, o in group.param_memory), dtype=float, count=sizes[g])
        base[g] = po[None, :] + np.cumsum(saved[g], axis=0) + np.cumsum(made[g][::-1], axis=0)[::-1] + flight[g]
    least = {g: b.min(axis=1) for g, b in base.items()}
    total = np.sum(list(least.values()), axis=0)
    total = total + _holds_alive(points, holds, floors)
    best = 0.0
    for k, point in enumerate(points):
        top = 0.0
        for work in point.work:
            extra: dict[str, np.ndarray] = {}
            for var, v in work.items():
                if var[0] == "x":
                    g = cast(str, var[1])
                    if g not in extra:
                        extra[g] = base[g][k].copy()
                    extra[g][cast(int, var[2])] += v
            top = max(top, sum(float(row.min()) - float(least[g][k]) for g, row in extra.items()))
        best = max(best, float(total[k]) + top)
    return best


def _holds_alive(points: list[Instant], holds: dict[tuple[object, ...], HoldTerm], floors: list[tuple[float, tuple[tuple[object, ...], ...]]]) -> np.ndarray:
    """H_k of :func:`instant_floor`: bytes of saved tensors every plan holds at each instant k. Per
    tensor, its floor times the least share of it any of its hold terms has made alive by k."""
    n = len(points)
    alive: dict[tuple[object, ...], np.ndarray] = defaultdict(lambda: np.zeros(n))  # a hold term's bytes made alive at each instant
    in_flight: dict[tuple[object, ...], np.ndarray] = defaultdict(lambda: np.zeros(n))
    for k, point in enumerate(points):
        for form, zs in ((point.saved, alive), (point.in_flight, in_flight)):
            for var, v in form.items():
                if var[0] == "z":
                    zs[cast(tuple[object, ...], var[1])][k] += v

    def share(key: tuple[object, ...]) -> np.ndarray:
        """A hold term's bytes alive at each instant, as a share of those its floor counts."""
        at = np.cumsum(alive[key]) if key in alive else np.zeros(n)
        if key in in_flight:
            at = at + in_flight[key]
        return at / (holds[key].nbytes * (1 - holds[key].recomputed))

    total = np.zeros(n)
    for floor, keys in floors:
        total = total + floor * np.vstack([share(key) for key in keys]).min(axis=0)
    return total


def instant_lp_floor(problem: Problem, time_limit_s: float) -> float | None:
    """Bytes per device no plan goes below: :func:`instant_floor`'s instants as one LP, each group's
    strategy the same at every instant (x continuous, one-hot in sum) and the conversions' working
    sets counted (each edge whose pairs hold bytes at some instant in its transportation form,
    :class:`planner.ilp.Model`), the saved tensors at their floors (H_k, constants):

        min  PO + Z   s.t.  Z >= P_k + Q_k + F_k + w + H_k   for every instant k and w there

    with P, Q, F, w the ILP's forms over x and those edges' pair indicators (the ILP's own rows, :func:`planner.ilp.instant_rows`).
    A relaxation of the least-memory ILP without its time, holds and most conversions: about a
    tenth of its LP's size and time where the conversions' buffers decide the least memory (measured,
    gpt2-small on 64 devices, dp=8 x 2 x 2 x 2 ZeRO-1: 1.362 GiB, as the full LP, in 1.1 s against
    7.8 s; :func:`instant_floor`, which takes each instant's strategies apart and counts no
    conversion, reads 1.252 GiB). The problem's edges are priced first (a solve needs them too).
    None when the LP does not solve within ``time_limit_s``."""
    price_edges(problem)
    holds = bound_holds(problem)
    points = instants(problem, holds)
    if not points:
        return None
    held = _holds_alive(points, holds, hold_floors(problem, holds))
    unit = max((abs(v) for point in points for form in (point.saved, point.grads, point.in_flight, *point.work) for v in form.values()),
               default=1.0) or 1.0
    lp = Arrays()
    x = {g: [lp.var(f"x_{g}_{i}") for i in range(len(group.strategies))] for g, group in problem.groups.items()}
    edges = list(problem.edges.values())
    e: dict[int, dict[tuple[int, int], int]] = {}

    def column(var: tuple[object, ...]) -> int | None:
        if var[0] == "x":
            return x[cast(str, var[1])][cast(int, var[2])]
        if var[0] != "e":
            return None  # a hold: counted in H_k
        k = cast(int, var[1])
        if k not in e:  # the edge's transportation form, on first use
            edge = edges[k]
            pairs = e[k] = {(a, b): lp.var(f"e_{k}_{a}_{b}") for a in edge.src_sets for b in edge.dst_sets}
            for a, iu in edge.src_sets.items():
                lp.row(f"edge_{k}_src_{a}", {**{pairs[(a, b)]: 1.0 for b in edge.dst_sets}, **{x[edge.group_u][i]: -1.0 for i in iu}}, 0.0, 0.0)
            for b, iv in edge.dst_sets.items():
                lp.row(f"edge_{k}_dst_{b}", {**{pairs[(a, b)]: 1.0 for a in edge.src_sets}, **{x[edge.group_v][i]: -1.0 for i in iv}}, 0.0, 0.0)
        return e[k][(cast(int, var[2]), cast(int, var[3]))]

    def terms(form: Form, sign: float) -> list[tuple[int, float]]:
        """A form's (column, coefficient) terms times ``sign``; the holds left out (instant_rows sums them per column)."""
        return [(col, sign * v / unit) for var, v in form.items() if (col := column(var)) is not None]

    for g, xs in x.items():
        lp.row(f"one_strategy_{g}", dict.fromkeys(xs, 1.0), 1.0, 1.0)
    peak = lp.var("peak")
    instant_rows(lp, points, terms, peak, [float(h) / unit for h in held])
    costs = np.zeros(lp.num_cols)
    costs[peak] = 1.0
    for g, group in problem.groups.items():
        for i, (p, _, o) in enumerate(group.param_memory):
            costs[x[g][i]] = (p + o) / unit
    highs = highs_of(lp.highs_lp(costs), 1, {})
    with quiet():
        run_for(highs, time_limit_s)
    if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return max(highs.getInfo().objective_function_value, 0.0) * unit * (1 - 1e-6)  # (1 - 1e-6): the LP's tolerances


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
    """Seconds per step no plan of ``problem`` goes below, conversions counted (prices them first).
    Every plan ``j`` (a strategy per group) pays at least

        T(j) >= sum_g own_g(j_g) + sum_{edges e = (g, h)} c_e(j_g, j_h)

    own: the group's time less what may hide (as in :func:`time_lower_bound`) and the
    conversions inside the group; ``c_e``: the conversions the pair of strategies triggers on the
    edges between two groups, each charged cost / uses (:func:`_coupling`). Minimising the right
    side over all plans is as hard as the ILP without memory, because the groups' graph has cycles
    (a repeated layer's templates feed themselves); on a spanning forest of it, it is a dynamic
    programme. So the edges of a maximum spanning forest (weighted by their largest charge) keep
    their coupling, and every other edge is charged to its consumer at the cheapest producer
    strategy for each of the consumer's (``min_i c_e(i, j)``, a lower bound of its term):

        T >= min_j [ sum_g own'_g(j_g) + sum_{e in forest} c_e(j_g, j_h) ]

    solved exactly tree by tree (leaves up: each group's best total for each strategy of its
    parent). Measured, gpt2-small on 64 devices, one configuration of each family against the LP
    relaxation within 80 GiB and the bound that charged every edge to its consumer alone (ms):
    dp=16 x tp=4 ZeRO-0 35.49 (LP 40.66, alone 33.10), dp=4 x 4 x 4 55.25 (57.23, 46.27),
    dp=8 x 2 x 2 x 2 41.17 (43.29, 38.19), 4 x 4 x 4 118.81 (119.40, 77.04), in 0.13 s at most
    once the conversions are priced; the 2 x 2 x 2 configuration, whose LP the search solved to
    dismiss it, is dismissed by this bound."""
    return _forest(problem, marginals=False)[0]


def strategies_within(problem: Problem, step_time: float) -> dict[str, tuple[int, ...]] | None:
    """Per group, the strategies a plan of ``problem`` faster than ``step_time`` may use, as
    indices of the whole problem (``problem.kept``); None when no plan is faster. The bound of
    :func:`conversion_time_bound` holds for the plans that choose a given strategy too: the same
    programme with the group held at it (its min-marginal, both passes of the forest), so a
    strategy whose bound is at least ``step_time`` is in no faster plan (a relative 1e-9 kept,
    for rounding). Exact: the problem restricted to these strategies
    (:func:`planner.problem.build_problem`'s ``keep``) has every faster plan, priced as before."""
    bound, marginals = _forest(problem, marginals=True)
    if bound >= step_time * (1 - 1e-9):
        return None
    kept: dict[str, tuple[int, ...]] = {}
    for g, least in marginals.items():
        idx = np.flatnonzero(least < step_time * (1 + 1e-9))
        whole = problem.kept.get(g)
        kept[g] = tuple(int(i) for i in idx) if whole is None else tuple(whole[i] for i in idx)
    return kept


def _forest(problem: Problem, *, marginals: bool) -> tuple[float, dict[str, np.ndarray]]:
    """The bound of :func:`conversion_time_bound` and, with ``marginals``, per group and strategy
    the bound with the group held at that strategy (a second pass, parents before children: the
    best the rest of the tree offers each strategy through its parent)."""
    price_conversions(problem)
    within, pairs, forest, dropped = _coupling(problem)
    own: dict[str, np.ndarray] = {}
    for g, group in problem.groups.items():
        own[g] = np.asarray(group.time, dtype=float) - np.asarray(problem.hideable(group), dtype=float)
        for extra in (within.get(g), dropped.get(g)):
            if extra is not None:
                own[g] = own[g] + extra

    def coupling(up: str, g: str) -> np.ndarray:
        """The pair's charges oriented (parent's strategies) x (this group's)."""
        return pairs[(up, g)] if (up, g) in pairs else pairs[(g, up)].T

    total = 0.0
    trees: list[tuple[float, dict[str, np.ndarray]]] = []
    for root, order, parent in forest:
        best = {g: own[g] for g in order}  # a group's strategies, with its subtree at its best
        sent: dict[str, np.ndarray] = {}
        for g in reversed(order[1:]):  # children before their parents
            sent[g] = (coupling(parent[g], g) + best[g][None, :]).min(axis=1)
            best[parent[g]] = best[parent[g]] + sent[g]
        least = float(best[root].min())
        total += least
        if marginals:
            whole = {root: best[root]}  # a group's strategies, with the whole tree at its best
            for g in order[1:]:  # parents before their children
                rest = whole[parent[g]] - sent[g]  # the parent's side of the tree, without this subtree
                whole[g] = best[g] + (coupling(parent[g], g) + rest[:, None]).min(axis=0)
            trees.append((least, whole))
    held = {g: values - least + total for least, whole in trees for g, values in whole.items()}
    return max(total, 0.0), held


_Coupling = tuple[dict[str, np.ndarray], dict[tuple[str, str], np.ndarray], list[tuple[str, list[str], dict[str, str]]], dict[str, np.ndarray]]


def _coupling(problem: Problem) -> _Coupling:
    """The conversion charges of :func:`conversion_time_bound`: per group, those of its own
    strategies (a conversion inside the group); per pair of groups, the matrix of charges
    (first group's strategies x second's; the edges between them, either way, summed); the
    spanning forest (per tree: its root, its groups parents first, each group's parent); and per
    group, what the pairs outside the forest charge it as their second group (at the first
    group's cheapest strategy for each of its own: a lower bound of the pair's charge, whichever
    way its edges run). A conversion that
    several edges (or a group's own strategies) can trigger is paid once, so each use is charged
    its cost / uses: the charges of the uses a plan triggers add up to at most the cost. Worked
    out once per pricing of the conversions (the ZeRO 0-2 problems of a mesh share it:
    :func:`planner.edges.shared_edges`)."""
    memo = cast(_Coupling | None, problem.priced_memo.get("coupling"))
    if memo is not None:
        return memo
    uses = conversion_uses(problem)
    sizes = {g: len(group.time) for g, group in problem.groups.items()}
    within: dict[str, np.ndarray] = {}
    for key, term in problem.conversions.items():
        for gu, iu, gv, iv in term.conditions:
            if gu == gv and term.cost:
                charge = within.setdefault(gu, np.zeros(sizes[gu]))
                charge[np.fromiter(iu & iv, dtype=int)] += term.cost / uses[key]
    pairs: dict[tuple[str, str], np.ndarray] = {}
    for edge in problem.edges.values():
        gu, gv = edge.group_u, edge.group_v
        srcs, dsts = list(edge.src_sets), list(edge.dst_sets)
        row, col = {s: k for k, s in enumerate(srcs)}, {t: k for k, t in enumerate(dsts)}
        cost = np.zeros((len(srcs) + 1, len(dsts) + 1))  # the last row and column: strategies with no Spec at that end
        for (a, b), keys in edge.conversions.items():
            cost[row[a], col[b]] = sum(problem.conversions[k].cost / uses[k] for k in keys)
        rows, cols = np.full(sizes[gu], len(srcs)), np.full(sizes[gv], len(dsts))
        for a, idx in edge.src_sets.items():
            rows[list(idx)] = row[a]
        for b, idx in edge.dst_sets.items():
            cols[list(idx)] = col[b]
        charges = cost[np.ix_(rows, cols)]
        if (gv, gu) in pairs:
            pairs[(gv, gu)] = pairs[(gv, gu)] + charges.T
        else:
            pairs[(gu, gv)] = pairs[(gu, gv)] + charges if (gu, gv) in pairs else charges
    # Kruskal: the largest charges first
    root_of = {g: g for g in sizes}

    def find(g: str) -> str:
        while root_of[g] != g:
            root_of[g] = root_of[root_of[g]]
            g = root_of[g]
        return g

    linked: dict[str, list[str]] = {g: [] for g in sizes}
    dropped: dict[str, np.ndarray] = {}
    for (gu, gv), charges in sorted(pairs.items(), key=lambda kv: -float(kv[1].max())):
        ru, rv = find(gu), find(gv)
        if ru != rv:
            root_of[ru] = rv
            linked[gu].append(gv)
            linked[gv].append(gu)
        else:
            dropped[gv] = dropped.get(gv, np.zeros(sizes[gv])) + charges.min(axis=0)
    forest: list[tuple[str, list[str], dict[str, str]]] = []
    placed: set[str] = set()
    for root in sizes:
        if root in placed:
            continue
        order, parent, stack = [], {}, [root]
        placed.add(root)
        while stack:  # depth first: each group after its parent
            g = stack.pop()
            order.append(g)
            for h in linked[g]:
                if h not in placed:
                    placed.add(h)
                    parent[h] = g
                    stack.append(h)
        forest.append((root, order, parent))
    memo = (within, pairs, forest, dropped)
    problem.priced_memo["coupling"] = memo
    return memo


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
