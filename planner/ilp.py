r"""The ILP that picks one strategy per group, built from a problem's terms as arrays
(:class:`Model`); :mod:`planner.solve` hands it to HiGHS (or CBC) and answers with it.

Sets: groups ``g`` (anchors, shared across repeated layers) with strategies ``i``; conversion
terms ``c`` (a producer Spec turned into a consumer Spec, see :mod:`planner.problem`); hold terms
``h`` (a tensor saved for backward in one sharding); nodes ``n`` with a transient working set.

Variables:
    x[g,i] in {0,1}   strategy i chosen for group g
    y[c]   in [0,1]   conversion c is executed   (integral at the optimum: it is pushed down)
    z[h]   in [0,1]   tensor h is held
    S      >= 0       the largest temporary of the gradient sync / optimizer step
    P[k], Q[k] >= 0   at instant k of planner.peak: activations alive, gradients made
    Z      >= 0       the part of the peak that changes over the step
    E      >= 0       seconds of gradient sync left exposed after backward (planner.overlap)

Minimise   Time / t_unit + eps * M / m_unit
where      Time = sum_{g,i} (time - eta sync)[g,i] x[g,i] + eta E + sum_c cost[c] y[c]   (seconds;
                  sync: the gradient collectives that run beside backward, eta: the hardware's
                  overlap_efficiency)
           M = PO + Z                                                      (bytes per device)
           PO = sum_{g,i} (params + optimizer)[g,i] x[g,i]
           G  = sum_{g,i} grads[g,i] x[g,i]
           A  = sum_{g,i} (mem - params - grads - optimizer)[g,i] x[g,i] + sum_h bytes[h] z[h]

subject to (each family is one function below; constraints carry their family's name)
    one_strategy:  sum_i x[g,i] = 1                                     for every g
    conversion:    between groups, the transportation form (see Model.conversion): e[S,T] >= 0,
                   sum_T e[S,T] = sum_{i outputs S} x[gu,i], sum_S e[S,T] = sum_{j needs T} x[gv,j],
                   y[c] >= e[S,T] for the pairs (S, T) of term c (y is e itself when one pair of
                   one edge is its only cause; a conversion that costs nothing has no variable);
                   within a group: y[c] >= sum_{i in I and J} x[g,i]
    hold:          z[h] >= sum_{j in J} x[gv,j]       (or the pair form, for gathered weights)
                   (the pair form: z >= x_u + x_v - 1; in the LP relaxations also z >= the
                   sum of an edge's transportation variables over the pairs, see Model.hold)
    step:          S >= sum_i step_transient[g,i] x[g,i]                for every g
                   S >= sum_{g,i} bucketed[g,i] x[g,i]   (a gradient bucket's buffer, one row;
                   a full bucket's bytes instead where the choices may need several buckets:
                   Problem.bucket_transient)
    peak:          at every instant k (an op; planner.peak), for each w of what may run there
                   (the op's working set, a conversion into it: a form over x or e):
                   P[k] = P[k-1] + saved[k],  Q[k] = Q[k+1] + grads[k]   (forms over x and z)
                   Z >= P[k] + Q[k] + in_flight[k] + w
                   Z >= A,  Z >= G,  Z >= G + S   (the loss; the end of backward; the step after)
    sync_exposed:  E >= sum_{q ready at or after k} t_q - B(k)   for every ready point k
                   (planner.overlap.sync_rows: the sync still running when backward ends)
    memory_budget: M <= budget

``t_unit`` and ``m_unit`` are the largest time and memory coefficients of the problem, so every
coefficient is at most 1 whatever the model's size; ``eps = 1e-9`` only breaks ties in favour of
less memory. ``objective="memory"`` is solved lexicographically: the least memory first, then
the fastest plan within exactly that memory. Feasibility tolerances are 1e-9, the
absolute gap 0. Time and memory of the answer are re-computed exactly by
:func:`planner.problem.evaluate`, not read off the relaxed y/z, and an answer whose exact memory
exceeds the budget (a tolerance slip) is re-solved with the budget lowered by the overrun.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import highspy
import numpy as np

from planner.edges import conversion_uses
from planner.peak import Form, Instant
from planner.problem import price_edges
from planner.terms import EdgeTerm, Group, Problem

NO_BUDGET = 1e20  # a memory row bound that stands for no budget (HiGHS reads bounds >= 1e20 as infinite)


EQ, GE, LE = "==", ">=", "<="
Expr = dict[int, float]  # a linear form over the model's columns: column -> coefficient


class Arrays:
    """A MIP as plain arrays: columns (bounds, which are binary), rows (bounds, coefficients row by
    row), handed to HiGHS in one call. Building the model as PuLP objects and handing it over a
    column and a row at a time was about a third of a one-plan search (measured, gpt2-small on 64
    devices: 11 of 32 s, HiGHS itself 3 s)."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.binary: list[int] = []
        self.names: list[str] = []
        self.row_lower: list[float] = []
        self.row_upper: list[float] = []
        self.row_names: list[str] = []
        self.starts: list[int] = [0]
        self.index: list[int] = []
        self.value: list[float] = []

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def var(self, name: str, lower: float = 0.0, upper: float = math.inf, *, binary: bool = False) -> int:
        self.lower.append(lower)
        self.upper.append(upper)
        self.names.append(name)
        if binary:
            self.binary.append(len(self.names) - 1)
        return len(self.names) - 1

    def row(self, name: str, terms: Expr, lower: float, upper: float) -> int:
        for col, coef in terms.items():
            if coef:
                self.index.append(col)
                self.value.append(coef)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        self.row_names.append(name)
        return len(self.row_names) - 1

    def row_terms(self, r: int) -> Expr:
        lo, hi = self.starts[r], self.starts[r + 1]
        return dict(zip(self.index[lo:hi], self.value[lo:hi], strict=True))

    def highs_lp(self, costs: np.ndarray) -> highspy.HighsLp:
        """This model as HiGHS takes it, with objective ``costs`` (minimised)."""
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = self.num_cols, self.num_rows
        lp.col_cost_ = np.asarray(costs, dtype=np.float64)
        lp.col_lower_ = np.asarray(self.lower, dtype=np.float64)
        lp.col_upper_ = np.asarray(self.upper, dtype=np.float64)
        lp.row_lower_ = np.asarray(self.row_lower, dtype=np.float64)
        lp.row_upper_ = np.asarray(self.row_upper, dtype=np.float64)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = self.num_cols, self.num_rows
        lp.a_matrix_.start_ = np.asarray(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(self.value, dtype=np.float64)
        integrality = [highspy.HighsVarType.kContinuous] * self.num_cols
        for col in self.binary:
            integrality[col] = highspy.HighsVarType.kInteger
        lp.integrality_ = integrality
        return lp


class Model:
    def __init__(self, problem: Problem, name: str) -> None:
        self.problem = price_edges(problem)
        self.name = name
        self.lp = Arrays()
        self.gid = {g: k for k, g in enumerate(problem.groups)}
        lp = self.lp
        self.x = {
            g: [lp.var(f"x_{self.gid[g]}_{i}", 0.0, 1.0, binary=True) for i in range(len(grp.strategies))]
            for g, grp in problem.groups.items()
        }
        self.y: dict[tuple[object, ...], int] = {}  # conversion executed (conversion() makes them)
        # the transportation variables of the edges between two groups (conversion() makes them)
        self.e: dict[tuple[str, str], list[tuple[EdgeTerm, dict[tuple[int, int], int]]]] = {}
        self.e_of: list[dict[tuple[int, int], int]] = []  # by EdgeTerm.index
        self.pair_rows: list[int] = []  # relaxation-only hold rows (hold() makes them)
        self.z = {key: lp.var(f"z_{k}", 0.0, 1.0) for k, key in enumerate(problem.holds)}
        self.step_transient = lp.var("step_transient")
        self.budget_row: int | None = None
        self.budget_bound = NO_BUDGET  # the budget row's bound (memory_budget), in m_unit
        self.peak = lp.var("peak")
        self.exposed = lp.var("sync_exposed") if problem.sync_rows else None
        mem = [m for g in problem.groups.values() for m in (*g.memory, *g.transient, *g.step_transient)] + [h.nbytes for h in problem.holds.values()]
        mem += [v for _, form in problem.conversion_work for v in form.values()]
        mem += [v for form in problem.stage_sums for v in form.values()]
        self.m_unit = max([abs(m) for m in mem if m] or [1.0])
        times = [t for g in problem.groups.values() for t in g.time] + [c.cost for c in problem.conversions.values()]
        self.t_unit = max([abs(t) for t in times if t] or [1.0])
        self.one_strategy()
        self.conversion()
        self.hold()
        self.step_bound()
        self.peak_bound()
        self.sync_bound()

    def time_expr(self, credited: bool = False) -> Expr:
        """Seconds per step (in ``t_unit``); ``credited``: less each strategy's credit, the most the
        evaluation may hide behind compute, so its minimum bounds the evaluated step time from below."""
        p = self.problem
        u = self.t_unit

        eff = p.overlap_efficiency

        def seconds(grp: Group, i: int) -> float:
            hidden = eff * grp.sync[i] if grp.sync else 0.0  # the sync beside backward, less what E exposes
            return grp.time[i] - hidden - (grp.credit[i] if credited and grp.credit else 0.0)

        terms = [(v, seconds(grp, i) / u) for g, grp in p.groups.items() for i, v in enumerate(self.x[g]) if seconds(grp, i)]
        terms += [(self.y[key], term.cost / u) for key, term in p.conversions.items() if term.cost and key in self.y]
        if self.exposed is not None and eff:
            terms.append((self.exposed, eff))
        return summed(terms)

    def sync_bound(self) -> None:
        """E >= each row of the gradient sync's exposure (planner.overlap.sync_rows), in ``t_unit``."""
        if self.exposed is None:
            return
        for k, row in enumerate(self.problem.sync_rows):
            terms = [(self.x[cast(str, var[1])][cast(int, var[2])], -v / self.t_unit) for var, v in row.items() if v]
            self._row(f"sync_exposed_{k}", GE, 0.0, [(self.exposed, 1.0)], terms)

    def _terms(self, part: str) -> Expr:
        """PO (params + optimizer), G (grads) or A (activations, with the held tensors)."""
        p, u = self.problem, self.m_unit
        terms = []
        for g, grp in p.groups.items():
            for i, v in enumerate(self.x[g]):
                pm, gm, om = grp.param_memory[i]
                value = {"PO": pm + om, "G": gm, "A": grp.memory[i] - pm - gm - om}[part]
                if value:
                    terms.append((v, value / u))
        if part == "A":
            terms += [(self.z[key], h.nbytes * (1 - h.recomputed) / u) for key, h in p.holds.items() if h.nbytes and h.recomputed < 1]
        return summed(terms)

    def memory_expr(self) -> Expr:
        return summed([*self._terms("PO").items(), (self.peak, 1.0)])

    def _form_terms(self, form: Form, sign: float = 1.0) -> list[tuple[int, float]]:
        """A linear form of planner.peak over the indicators x, z, e (in ``m_unit``), as
        (column, coefficient) terms times ``sign`` (each variable once: a form is a dict over them)."""
        terms = []
        scale = sign / self.m_unit
        for var, v in form.items():
            kind = var[0]
            if kind == "x":
                terms.append((self.x[cast(str, var[1])][cast(int, var[2])], v * scale))
            elif kind == "e":
                terms.append((self.e_of[cast(int, var[1])][(cast(int, var[2]), cast(int, var[3]))], v * scale))
            else:
                terms.append((self.z[cast(tuple[object, ...], var[1])], v * scale))
        return terms

    def peak_bound(self) -> None:
        """The peak over the step's instants (:func:`instant_rows`); every activation, every
        gradient, and the optimizer step after them."""
        instant_rows(self.lp, self.problem.instants or [], self._form_terms, self.peak)
        grads = self._terms("G")
        self._row("peak_activations", GE, 0.0, [(self.peak, 1.0)], negated(self._terms("A")))
        self._row("peak_gradients", GE, 0.0, [(self.peak, 1.0)], negated(grads))
        self._row("peak_step", GE, 0.0, [(self.peak, 1.0), (self.step_transient, -1.0)], negated(grads))

    def _ones(self, g: str, idx: frozenset[int], coef: float = 1.0) -> list[tuple[int, float]]:
        return [(self.x[g][i], coef) for i in idx]

    def _row(self, name: str, sense: str, rhs: float, *parts: Iterable[tuple[int, float]]) -> int:
        """sum(parts) <sense> rhs, added to the model (the terms summed: a column appears once)."""
        terms = summed(itertools.chain.from_iterable(parts))
        lower = -math.inf if sense == LE else rhs
        upper = math.inf if sense == GE else rhs
        return self.lp.row(name, terms, lower, upper)

    def one_strategy(self) -> None:
        for g, xs in self.x.items():
            self._row(f"one_strategy_{self.gid[g]}", EQ, 1.0, ((x, 1.0) for x in xs))

    def conversion(self) -> None:
        """Within a group: y >= x[i] for the strategies whose two ends disagree. Between groups,
        the transportation form: e[S,T] >= 0 with sum_T e[S,T] = (producer outputs S) and
        sum_S e[S,T] = (consumer needs T), and y >= e[S,T]; with one-hot x, e is the indicator
        of the pair chosen, and the LP relaxation is far tighter than y >= x_u + x_v - 1.
        A conversion that costs nothing gets no variable; one that only a single pair of a single
        edge can cause is that pair's e itself (y = e at the optimum, without the row)."""
        p = self.problem
        uses = conversion_uses(p)
        for k, (key, term) in enumerate(p.conversions.items()):
            if term.cost and (uses[key] > 1 or any(gu == gv for gu, _, gv, _ in term.conditions)):
                self.y[key] = self.lp.var(f"y_{k}", 0.0, 1.0)
            for m, (gu, iu, gv, iv) in enumerate(term.conditions):
                if gu == gv and term.forbidden:  # a strategy that converts its own tensor this way may not be chosen
                    for i in iu & iv:
                        self.lp.upper[self.x[gu][i]] = 0.0
                elif gu == gv and key in self.y:
                    self._row(f"conversion_{k}_{m}", GE, 0.0, [(self.y[key], 1.0)], self._ones(gu, iu & iv, -1.0))
        for k, edge in enumerate(p.edges.values()):
            e = {(a, b): self.lp.var(f"e_{k}_{m}") for m, (a, b) in enumerate((a, b) for a in edge.src_sets for b in edge.dst_sets)}
            self.e.setdefault((edge.group_u, edge.group_v), []).append((edge, e))
            self.e_of.append(e)
            for a, iu in edge.src_sets.items():
                self._row(f"edge_{k}_src_{a}", EQ, 0.0, ((e[(a, b)], 1.0) for b in edge.dst_sets), self._ones(edge.group_u, iu, -1.0))
            for b, iv in edge.dst_sets.items():
                self._row(f"edge_{k}_dst_{b}", EQ, 0.0, ((e[(a, b)], 1.0) for a in edge.src_sets), self._ones(edge.group_v, iv, -1.0))
            for pair, keys in edge.conversions.items():
                if any(p.conversions[key].forbidden for key in keys):  # the pair may not be chosen
                    self.lp.upper[e[pair]] = 0.0
                for key in keys:
                    if key in self.y:
                        self._row(f"edge_{k}_conv", GE, 0.0, [(self.y[key], 1.0), (e[pair], -1.0)])
                    elif p.conversions[key].cost:
                        self.y[key] = e[pair]

    def hold(self) -> None:
        """z >= [gu in iu] for a tensor one group saves; for a gathered weight (saved by gv only when
        its parameter gu is stored otherwise) z >= x_u + x_v - 1, and beside it, where an edge
        between the two groups has sets that make up iu and iv, the pair's indicator: the sum of
        the edge's transportation variables over the pairs (stored as iu, needed as iv). Both are
        exact for one-hot x; the second is far tighter in the relaxation (x_u + x_v - 1 is 0 at
        x = 1/2; measured, GPT-3 175B on dp=4 x 4 x 4 ZeRO-2: with it the relaxation's least
        memory is 80.60 GiB, the plans' least, and it fitted 80 GiB without), but it slowed
        HiGHS' branch and bound up to tenfold (the same configuration's least-memory MIP: 2.9 s
        -> 25.6 s): its rows (:attr:`pair_rows`) are on for the relaxations only (BudgetILP)."""
        for k, (key, term) in enumerate(self.problem.holds.items()):
            for m, (gu, iu, gv, iv) in enumerate(term.conditions):
                if gv is None:
                    self._row(f"hold_{k}_{m}", GE, 0.0, [(self.z[key], 1.0)], self._ones(gu, iu, -1.0))
                    continue
                self._row(f"hold_{k}_{m}", GE, -1.0, [(self.z[key], 1.0)], self._ones(gu, iu, -1.0), self._ones(gv, iv, -1.0))
                pair = self._pair(gu, iu, gv, iv)
                if pair is not None:
                    self.pair_rows.append(self._row(f"hold_{k}_{m}_pair", GE, 0.0, [(self.z[key], 1.0)], ((v, -1.0) for v in pair)))

    def _pair(self, gu: str, iu: frozenset[int], gv: str, iv: frozenset[int]) -> list[int] | None:
        """The columns whose sum equals [x_gu in iu] * [x_gv in iv] for one-hot x: transportation
        variables of an edge between the groups (see :meth:`hold`); None where no edge has sets
        that make up ``iu`` and ``iv``."""
        for edge, e in self.e.get((gu, gv), ()):
            srcs = [a for a, idx in edge.src_sets.items() if idx <= iu]
            dsts = [b for b, idx in edge.dst_sets.items() if idx <= iv]
            if sum(len(edge.src_sets[a]) for a in srcs) == len(iu) and sum(len(edge.dst_sets[b]) for b in dsts) == len(iv):
                return [e[(a, b)] for a in srcs for b in dsts]
        return None

    def step_bound(self) -> None:
        st = [(self.step_transient, 1.0)]
        if self.problem.stage_sums:  # CDP: stage 0's partial sum arrives at the end of backward
            self._row("step_transient_cdp", GE, 0.0, st, self._form_terms(self.problem.stage_sums[0], -1.0))
        for g, grp in self.problem.groups.items():
            if any(grp.step_transient):
                terms = [(v, -t / self.m_unit) for t, v in zip(grp.step_transient, self.x[g], strict=True) if t]
                self._row(f"step_transient_{self.gid[g]}", GE, 0.0, st, terms)
        packed = [(b, v) for g, grp in self.problem.groups.items() for b, v in zip(grp.bucketed, self.x[g], strict=False) if b]
        if packed and self.problem.packed_whole:
            self._row("step_transient_buckets", GE, 0.0, st, [(v, -b / self.m_unit) for b, v in packed])
        elif packed:
            self._row("step_transient_buckets", GE, self.problem.bucket_transient(0.0) / self.m_unit, st)

    def memory_budget(self, budget: float) -> int:
        """The row M <= budget (bytes; inf: no budget), added on the first call (before the model
        goes to the solver), its bound (:attr:`budget_bound`) moved after; returns the row."""
        self.budget_bound = min(budget / self.m_unit, NO_BUDGET)
        if self.budget_row is None:
            self.budget_row = self._row("memory_budget", LE, self.budget_bound, self.memory_expr().items())
        return self.budget_row

    def assignment(self, values: np.ndarray) -> dict[str, int]:
        """Each group's strategy in column ``values`` (the largest of its x)."""
        return {g: max(range(len(xs)), key=lambda i, xs=xs: values[xs[i]]) for g, xs in self.x.items()}  # type: ignore[misc]


def instant_rows(lp: Arrays, points: Sequence[Instant], form_terms: Callable[[Form, float], Iterable[tuple[int, float]]], peak: int,
                 floors: Sequence[float] | None = None) -> None:
    """The peak over the step's instants (planner.peak) as rows of ``lp``: P_k, the activations
    alive, and Q_k, the gradients made, as chains of one column each per instant,

        P_k = P_{k-1} + saved_k,   Q_k = Q_{k+1} + grads_k,   peak >= P_k + Q_k + F_k + w + floors[k]

    for each working set w that may run at instant k (F_k: what is in flight there; ``floors``:
    constants, in the model's units, zero when None). ``form_terms(form, sign)``: a form's
    (column, coefficient) terms in the model's units, times ``sign``; a variable it has no
    column for is left out. Shared by :meth:`Model.peak_bound` and
    :func:`planner.front.instant_lp_floor` (the same rows over another set of columns)."""
    alive = [lp.var(f"alive_{k}") for k in range(len(points))]
    made = [lp.var(f"made_{k}") for k in range(len(points))]
    for k, point in enumerate(points):
        before = [(alive[k - 1], -1.0)] if k else []
        lp.row(f"peak_alive_{k}", summed([(alive[k], 1.0), *before, *form_terms(point.saved, -1.0)]), 0.0, 0.0)
        after = [(made[k + 1], -1.0)] if k + 1 < len(points) else []
        lp.row(f"peak_made_{k}", summed([(made[k], 1.0), *after, *form_terms(point.grads, -1.0)]), 0.0, 0.0)
    for k, point in enumerate(points):
        base = [(alive[k], 1.0), (made[k], 1.0), *form_terms(point.in_flight, 1.0)]
        if len(point.work) > 1:  # one column for what is alive, so each row is short
            held = lp.var(f"held_{k}")
            lp.row(f"peak_held_{k}", summed([(held, 1.0), *((v, -c) for v, c in base)]), 0.0, 0.0)
            base = [(held, 1.0)]
        floor = floors[k] if floors is not None else 0.0
        for m, work in enumerate(point.work):
            lp.row(f"peak_{k}_{m}", summed([(peak, 1.0), *((v, -c) for v, c in base), *form_terms(work, -1.0)]), floor, math.inf)


def summed(terms: Iterable[tuple[int, float]]) -> Expr:
    out: Expr = {}
    for var, coef in terms:
        out[var] = out.get(var, 0.0) + coef
    return out


def negated(expr: Expr) -> list[tuple[int, float]]:
    return [(v, -c) for v, c in expr.items()]
