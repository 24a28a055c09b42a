r"""The ILP that picks one strategy per group (HiGHS through highspy, the model handed over as
arrays; CBC through PuLP as the second backend, ``SolverSettings(backend="cbc")``).

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
    conversion:    between groups, the transportation form (see _Model.conversion): e[S,T] >= 0,
                   sum_T e[S,T] = sum_{i outputs S} x[gu,i], sum_S e[S,T] = sum_{j needs T} x[gv,j],
                   y[c] >= e[S,T] for the pairs (S, T) of term c (y is e itself when one pair of
                   one edge is its only cause; a conversion that costs nothing has no variable);
                   within a group: y[c] >= sum_{i in I and J} x[g,i]
    hold:          z[h] >= sum_{j in J} x[gv,j]       (or the pair form, for gathered weights)
                   (the pair form: z >= x_u + x_v - 1; in the LP relaxations also z >= the
                   sum of an edge's transportation variables over the pairs, see _Model.hold)
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

Beside the budgeted solve, one built model answers (:class:`BudgetILP`): the weighted sum
min Time / t_unit + w M / m_unit without a budget (a supported point of the front; no knapsack row,
so far faster), and the LP relaxation within a budget (a lower bound on the time of every plan
that fits, which lets the search skip configurations and budgets without a MIP). ``credited``
models subtract what the evaluation may hide behind compute, so their optima bound evaluated times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Literal, NamedTuple, cast

import highspy
import numpy as np

from planner.messages import infeasible_message
from planner.peak import Form
from planner.problem import evaluate, price_edges
from planner.terms import EdgeTerm, Evaluation, Group, Problem
from planner.units import format_bytes

log = logging.getLogger(__name__)


TIE_BREAK = 1e-9  # weight of the secondary objective, both objectives normalised (see docstring)
FEASIBILITY_TOL = 1e-9  # HiGHS' defaults (1e-6, 1e-7) let memory rows slip by ~1 KiB on small models
MAX_RESOLVES = 4
# a budget at a plan's exact memory is solved at that memory times (1 + FLOOR_SLACK): the time model's
# memory row for that plan can sum to it plus a rounding error, which HiGHS without presolve reads as
# infeasible (GPT-3 175B on 8 x 8: the least-memory point, 49.79 GiB, fell off the front that way)
FLOOR_SLACK = 1e-9
NO_BUDGET = 1e20  # a memory row bound that stands for no budget (HiGHS reads bounds >= 1e20 as infinite)
Status = Literal["optimal", "time_limit", "infeasible"]


@dataclass(frozen=True, kw_only=True)
class SolverSettings:
    backend: Literal["highs", "cbc"] = "highs"
    time_limit_s: float = 120.0
    relative_gap: float = 1e-6
    threads: int = 1
    # a front of resolution r > 0 (sweep) stops its weighted and budgeted MIPs at a relative gap of
    # front_gap * r: each budgeted point is within that of the fastest plan within its budget
    front_gap: float = 0.2

    def sweep_gap(self, resolution: float) -> float:
        """The relative gap of a front's weighted and budgeted MIPs at ``resolution`` (see :func:`sweep`)."""
        return max(self.relative_gap, self.front_gap * resolution)


@dataclass(frozen=True)
class Solution:
    assignment: dict[str, int]
    status: Status
    evaluation: Evaluation
    objective: float
    build_seconds: float
    solve_seconds: float
    num_variables: int
    num_constraints: int
    backend: str


class InfeasibleBudget(ValueError):
    """No plan fits the memory budget; carries the least memory any plan needs."""

    def __init__(self, message: str, *, budget: float, least: Evaluation | None) -> None:
        super().__init__(message)
        self.budget = budget
        self.least = least


class SolveStopped(RuntimeError):
    """A solve that ended at its time limit without any plan (only the least-memory ILP can:
    every other has a plan to fall back on); the message names the mesh and the limit."""


EQ, GE, LE = "==", ">=", "<="
Expr = dict[int, float]  # a linear form over the model's columns: column -> coefficient


class _Arrays:
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

    def highs(self, costs: np.ndarray) -> highspy.Highs:
        """A HiGHS instance holding this model with objective ``costs`` (minimised)."""
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
        highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
        status = highs.passModel(lp)
        assert status != highspy.HighsStatus.kError, "HiGHS refused the model"
        return highs


class _Model:
    def __init__(self, problem: Problem, name: str) -> None:
        self.problem = price_edges(problem)
        self.name = name
        self.lp = _Arrays()
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
        return _summed(terms)

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
            terms += [(self.z[key], h.nbytes / u) for key, h in p.holds.items() if h.nbytes and not h.recomputed]
        return _summed(terms)

    def memory_expr(self) -> Expr:
        return _summed([*self._terms("PO").items(), (self.peak, 1.0)])

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
        """The peak over the step's instants (planner.peak): P_k, the activations alive, and Q_k, the
        gradients made, as chains of one variable each per instant; Z >= P_k + Q_k + F_k + w for
        what may run there; every activation, every gradient, and the optimizer step after them."""
        points = self.problem.instants or []
        alive = [self.lp.var(f"alive_{k}") for k in range(len(points))]
        made = [self.lp.var(f"made_{k}") for k in range(len(points))]
        for k, point in enumerate(points):
            before = [(alive[k - 1], -1.0)] if k else []
            self._row(f"peak_alive_{k}", EQ, 0.0, [(alive[k], 1.0)], before, self._form_terms(point.saved, -1.0))
            after = [(made[k + 1], -1.0)] if k + 1 < len(points) else []
            self._row(f"peak_made_{k}", EQ, 0.0, [(made[k], 1.0)], after, self._form_terms(point.grads, -1.0))
        for k, point in enumerate(points):
            base = [(alive[k], 1.0), (made[k], 1.0), *self._form_terms(point.in_flight)]
            if len(point.work) > 1:  # one variable for what is alive, so each row is short
                held = self.lp.var(f"held_{k}")
                self._row(f"peak_held_{k}", EQ, 0.0, [(held, 1.0)], [(v, -c) for v, c in base])
                base = [(held, 1.0)]
            for m, work in enumerate(point.work):
                self._row(f"peak_{k}_{m}", GE, 0.0, [(self.peak, 1.0)], [(v, -c) for v, c in base], self._form_terms(work, -1.0))
        grads = self._terms("G")
        self._row("peak_activations", GE, 0.0, [(self.peak, 1.0)], _negated(self._terms("A")))
        self._row("peak_gradients", GE, 0.0, [(self.peak, 1.0)], _negated(grads))
        self._row("peak_step", GE, 0.0, [(self.peak, 1.0), (self.step_transient, -1.0)], _negated(grads))

    def _ones(self, g: str, idx: frozenset[int], coef: float = 1.0) -> list[tuple[int, float]]:
        return [(self.x[g][i], coef) for i in idx]

    def _row(self, name: str, sense: str, rhs: float, *parts: Iterable[tuple[int, float]]) -> int:
        """sum(parts) <sense> rhs, added to the model (the terms summed: a column appears once)."""
        terms = _summed(itertools.chain.from_iterable(parts))
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
        uses: dict[tuple[object, ...], int] = defaultdict(int)
        for key, term in p.conversions.items():
            uses[key] += sum(1 for gu, _, gv, _ in term.conditions if gu == gv)
        for edge in p.edges.values():
            for keys in edge.conversions.values():
                for key in keys:
                    uses[key] += 1
        for k, (key, term) in enumerate(p.conversions.items()):
            if term.cost and (uses[key] > 1 or any(gu == gv for gu, _, gv, _ in term.conditions)):
                self.y[key] = self.lp.var(f"y_{k}", 0.0, 1.0)
            for m, (gu, iu, gv, iv) in enumerate(term.conditions):
                if gu == gv and key in self.y:
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


def _summed(terms: Iterable[tuple[int, float]]) -> Expr:
    out: Expr = {}
    for var, coef in terms:
        out[var] = out.get(var, 0.0) + coef
    return out


def _negated(expr: Expr) -> list[tuple[int, float]]:
    return [(v, -c) for v, c in expr.items()]


def _pulp() -> ModuleType:
    """PuLP, imported on first use (only the CBC backend needs it). PuLP keeps the error of each
    solver it cannot import (a class attribute ``err``); its traceback holds every frame up that
    import, so the code that first imported it kept its locals alive for good (measured: a function
    that compiled a plan kept its ParallelModule after it returned). The tracebacks go; the
    messages stay."""
    import pulp

    for name, module in list(sys.modules.items()):
        if name == "pulp" or name.startswith("pulp."):
            for value in list(vars(module).values()):
                err = getattr(value, "err", None) if isinstance(value, type) else None
                while isinstance(err, BaseException):
                    err.__traceback__ = None
                    err = err.__context__ or err.__cause__
    return pulp


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a banner on file descriptor 1 the first time it runs, whatever its options."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def solve(
    problem: Problem,
    *,
    memory_budget: float,
    objective: Literal["time", "memory"] = "time",
    settings: SolverSettings | None = None,
) -> Solution:
    """The fastest assignment (or the smallest, ``objective="memory"``) within the budget.

    ``Solution.objective`` is the primary objective of the ILP's answer in its own unit (seconds
    per step, or bytes per device); ``Solution.evaluation`` is the exact evaluation.
    """
    settings = settings or SolverSettings()
    if objective == "memory":
        # lexicographic: the least memory, then the fastest plan holding exactly that much
        least = _solve_once(problem, float("inf"), "memory", settings)
        floor = least.evaluation.peak_memory * (1 + FLOOR_SLACK)
        try:
            fastest = solve(problem, memory_budget=floor, settings=settings)
        except InfeasibleBudget:
            return least
        better = fastest.evaluation.peak_memory <= floor and fastest.evaluation.step_time < least.evaluation.step_time
        return replace(fastest, objective=fastest.evaluation.peak_memory) if better else least
    return solve_within(BudgetILP(problem, "time", settings), memory_budget)


def solve_within(ilp: BudgetILP, memory_budget: float, fastest: Solution | None = None, *, exact_least: bool = True) -> Solution:
    """The fastest plan within ``memory_budget`` from a built time ILP (``fastest``: its answer
    without a budget, when already solved: it answers at once if it fits). An answer whose exact
    memory exceeds the budget (a tolerance slip, or a term the ILP does not price) is re-solved
    with the budget lowered by the overrun; raises :class:`InfeasibleBudget` when nothing fits,
    with the least memory a plan needs (``exact_least=False``: without it, one MIP saved, for a
    search that has a plan elsewhere; only for problems whose evaluation adds no memory term
    the ILP leaves out, where the ILP finding nothing means nothing fits)."""
    problem, settings = ilp.problem, ilp.settings
    if fastest is None and memory_budget != float("inf") and ilp.objective == "time":
        # the fastest plan without a budget, when it fits, is the fastest within it: an easy MIP
        # (no presolve, no knapsack row) in place of a budgeted one (measured, gpt-tiny's one-plan
        # search on 8 devices, 2-D and 3-D meshes within 80 GiB: 4.5 s and 2.2 s budgeted)
        fastest = ilp.run(float("inf"))
    if fastest is not None and fastest.evaluation.peak_memory <= memory_budget:
        return fastest
    solution = _within(ilp, memory_budget)
    if solution is not None:
        return solution
    if not exact_least:
        raise InfeasibleBudget(f"no plan on mesh {problem.mesh} fits {format_bytes(memory_budget)} per device (the ILP within the budget "
                               "has no solution; the least memory a plan needs was not solved for)", budget=memory_budget, least=None)
    # nothing within the budget, or the exact evaluation kept exceeding what the ILP priced (a term
    # it does not model, such as the ZeRO-3 prefetch's in-flight gather): the least-memory plan
    # answers if it fits
    least = _solve_once(problem, float("inf"), "memory", settings)
    if least.evaluation.peak_memory <= memory_budget:
        return least
    raise InfeasibleBudget(infeasible_message(problem, memory_budget, least.evaluation), budget=memory_budget, least=least.evaluation)


def _within(ilp: BudgetILP, memory_budget: float, gap: float | None = None) -> Solution | None:
    """The fastest plan within ``memory_budget`` (``gap``: to within that relative gap instead of
    the settings'), or None. An answer whose exact memory exceeds the budget (a tolerance slip, or
    a term the ILP does not price) is re-solved with the budget lowered by twice the last overrun
    each time, :data:`MAX_RESOLVES` times at most."""
    budget = memory_budget
    for attempt in range(MAX_RESOLVES):
        solution = ilp.run(budget, gap=gap)
        if solution is None:
            return None
        overrun = solution.evaluation.peak_memory - memory_budget
        if overrun <= 0:
            return solution
        log.info("mesh %s: answer exceeds the budget by %.0f B (solver tolerance); re-solving", ilp.problem.mesh, overrun)
        budget -= overrun * 2**attempt
    return None


class Relaxation(NamedTuple):
    bound: float | None  # seconds no plan within the budget goes below; None: nothing fits
    plan: Evaluation | None  # the relaxation's answer rounded, when it fits the budget
    infeasible: bool = False  # proven: even with integrality dropped nothing fits, so no plan does


class BudgetILP:
    """One problem's ILP, built once and handed to the solver once, then solved for any number of
    budgets (HiGHS: only the memory row's bound moves between solves; CBC, through PuLP, gets the
    model anew each solve). ``objective="memory"`` has no budget row. ``credited``: the time
    objective less each strategy's credit (:attr:`planner.terms.Group.credit`), so its optimum
    (``Solution.objective``) bounds the evaluated step time of every plan from below where the
    evaluation hides communication."""

    def __init__(self, problem: Problem, objective: Literal["time", "memory"], settings: SolverSettings, *, credited: bool = False) -> None:
        t0 = time.perf_counter()
        self.problem, self.objective, self.settings = problem, objective, settings
        self.model = _Model(problem, f"plan_{problem.mesh}".replace(" ", "").replace("=", "").replace("x", "_"))
        self.time_e, self.mem_e = self.model.time_expr(credited), self.model.memory_expr()
        if objective == "time":
            self.model.memory_budget(float("inf"))
        first, second = (self.time_e, self.mem_e) if objective == "time" else (self.mem_e, self.time_e)
        self.costs = self._costs((first, 1.0), (second, TIE_BREAK))
        self.backend = settings.backend
        self._solver: highspy.Highs | None = None
        self.build_seconds = time.perf_counter() - t0
        self.solves = 0

    def _highs(self) -> highspy.Highs | None:
        """The HiGHS model, built on first use (None for CBC)."""
        if self.backend != "highs":
            return None
        if self._solver is None:
            with _quiet_stdout():  # HiGHS prints a banner when its first instance is made
                highs = self.model.lp.highs(self.costs)
            s = self.settings
            for key, value in {"time_limit": s.time_limit_s, "mip_rel_gap": s.relative_gap, "mip_abs_gap": 0.0, "threads": s.threads,
                               "mip_feasibility_tolerance": FEASIBILITY_TOL, "primal_feasibility_tolerance": FEASIBILITY_TOL}.items():
                highs.setOptionValue(key, value)
            self._solver = highs
            self._pair_rows(highs, on=False)
        return self._solver

    def _pair_rows(self, highs: highspy.Highs, *, on: bool) -> None:
        """The gathered weights' pair rows (:meth:`_Model.hold`): on for a relaxation, off (free
        rows, which presolve drops) for the MIPs."""
        rows = self.model.pair_rows
        if rows:
            index = np.array(rows, dtype=np.int32)
            lower = np.full(len(rows), 0.0 if on else -np.inf)
            highs.changeRowsBounds(len(rows), index, lower, np.full(len(rows), np.inf))  # type: ignore[attr-defined]

    def _run(self, budget: float, costs: np.ndarray, gap: float, absolute_gap: float) -> _Outcome:
        row = self.model.memory_budget(budget) if self.objective == "time" else None
        highs = self._highs()
        if highs is None:
            return self._run_cbc(costs, gap, absolute_gap)
        if row is not None:
            highs.changeRowBounds(row, -NO_BUDGET, self.model.budget_bound)
        highs.setOptionValue("mip_rel_gap", gap)
        highs.setOptionValue("mip_abs_gap", absolute_gap)
        # without a budget (or with a budget that cannot bind) the MIP is easy, its root LP often
        # integral, and HiGHS' presolve was most of its time: measured, GPT-3 175B on 4 x 4 x 4,
        # a weighted solve 1.2 s with presolve (0.84 s of it presolving), 0.2 s without; with a
        # budget that binds, presolve pays (a knapsack MIP of 10-20 s either way, 25 % faster with)
        easy = budget == float("inf") or self.objective == "memory"
        if not easy:
            highs.setOptionValue("presolve", "choose")
            highs.run()
        else:
            self._run_without_presolve(highs)
        return _outcome(highs)

    def _run_cbc(self, costs: np.ndarray, gap: float, absolute_gap: float) -> _Outcome:
        """The model through PuLP's CBC, from the arrays (the relaxation-only pair rows left out)."""
        pulp = _pulp()
        lp, s = self.model.lp, self.settings
        model = pulp.LpProblem(self.model.name, pulp.LpMinimize)
        binary = set(lp.binary)
        cols = [model.add_variable(name, lo, None if hi == math.inf else hi, cat="Binary" if k in binary else "Continuous")
                for k, (name, lo, hi) in enumerate(zip(lp.names, lp.lower, lp.upper, strict=True))]
        model.setObjective(pulp.LpAffineExpression([(cols[k], c) for k, c in enumerate(costs) if c]))
        skip = set(self.model.pair_rows)
        for r in range(lp.num_rows):
            if r in skip:
                continue
            lo, hi = lp.row_lower[r], lp.row_upper[r]
            if r == self.model.budget_row:
                lo, hi = -math.inf, self.model.budget_bound
            expr = pulp.LpAffineExpression([(cols[k], c) for k, c in lp.row_terms(r).items()])
            sense, rhs = (pulp.LpConstraintEQ, lo) if lo == hi else (pulp.LpConstraintGE, lo) if hi == math.inf else (pulp.LpConstraintLE, hi)
            model.addConstraint(pulp.LpConstraint(expr, sense, lp.row_names[r], rhs))
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=s.time_limit_s, gapRel=gap, gapAbs=absolute_gap, threads=s.threads,
                                   options=[f"primalTolerance {FEASIBILITY_TOL}", f"integerTolerance {FEASIBILITY_TOL}"])
        model.solve(solver)
        if pulp.LpStatus[model.status] in ("Infeasible", "Not Solved") or model.sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound):
            return _Outcome(None, None, pulp.LpStatus[model.status])
        values = np.array([v.value() or 0.0 for v in cols])
        return _Outcome("optimal" if model.sol_status == pulp.LpSolutionOptimal else "time_limit", values, pulp.LpStatus[model.status])

    def _run_without_presolve(self, highs: highspy.Highs) -> None:
        """An easy MIP without presolve, first for at most ``3 cap`` (``cap`` in proportion to the
        model's size), interrupted at ``cap`` if it has no plan by then: measured, the
        least-memory MIP of a 2-layer Llama on 2 x 2 x 2, 58k columns, found none in 60 s without
        presolve and was optimal in 15 s with; the root LP of a 76k-column weighted MIP (GPT-3 1.3B
        on 64 devices) ran past 120 s without presolve (HiGHS calls the interrupt only between LPs,
        so the time limit bounds the root). Without a plan the rest of the time limit runs with
        presolve; with one it goes on without presolve from it (measured, GPT-3 1.3B on 2 x 2 x 2,
        a weighted MIP: 7.8 s without presolve, 33.7 s with, its presolve alone 25 s). The first
        attempt runs past ``cap`` once it has a plan because a restart loses the root's cuts and
        search: gpt-tiny's weighted MIPs on 2 x 2 x 2 took 3.8 s in one run and 7.1 s stopped at a
        2.6 s cap and resumed."""
        limit = self.settings.time_limit_s
        cap = min(limit, max(2.0, 1e-4 * highs.getNumCol()))

        def interrupt(kind: highspy.cb.HighsCallbackType, message: str, out: highspy.cb.HighsCallbackOutput, into: highspy.cb.HighsCallbackInput,
                      data: object) -> None:
            if out.running_time > cap and out.mip_primal_bound == math.inf:
                into.user_interrupt = True  # out.running_time: seconds of this run

        highs.setOptionValue("presolve", "off")
        highs.setOptionValue("time_limit", min(limit, 3 * cap))
        highs.setCallback(interrupt, None)
        highs.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
        t0 = time.perf_counter()
        try:
            highs.run()
            stopped = highs.getModelStatus() in (highspy.HighsModelStatus.kInterrupt, highspy.HighsModelStatus.kTimeLimit)
        finally:
            highs.stopCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
            highs.setOptionValue("time_limit", limit)
        if not stopped or time.perf_counter() - t0 >= limit:
            return
        incumbent = highs.getSolution() if highs.getInfo().primal_solution_status == 2 else None  # 2: feasible
        highs.setOptionValue("time_limit", max(limit - (time.perf_counter() - t0), 1.0))
        try:
            if incumbent is not None:
                highs.setSolution(incumbent)
            else:
                highs.setOptionValue("presolve", "choose")
            highs.run()
        finally:
            highs.setOptionValue("time_limit", limit)

    def relaxation(self, budget: float) -> float | None:
        """A lower bound on the objective of every plan within ``budget`` (seconds): the LP
        relaxation's optimum (integrality dropped), less the most the tie-break adds. None when
        the relaxation is infeasible (no plan fits) or the backend is not HiGHS."""
        return self.relax(budget).bound

    def relax(self, budget: float, *, simplex_first: bool = False) -> Relaxation:
        """:meth:`relaxation`, and its answer rounded (each group's largest x) and evaluated
        exactly: a plan, when it fits the budget (often near the MIP's, where the bound is tight).

        Interior point without presolve takes a steady time (measured, GPT-3 175B: ~0.45 s on a
        3-D mesh of 64 devices, ~6 s on 8 x 8 x 8 of 4096), where dual simplex, from no basis,
        takes 0.07-1.6 s on the same models when the budget is loose and up to 20 s (or fails)
        near the least memory. ``simplex_first`` (a fresh model, a budget that is likely loose):
        dual simplex first, stopped after a time in proportion to the model's size, then
        interior point if it has not finished."""
        t0 = time.perf_counter()
        highs = self._highs()
        if highs is None or self.objective != "time":
            return Relaxation(None, None)
        row = self.model.memory_budget(budget)
        highs.changeRowBounds(row, -NO_BUDGET, self.model.budget_bound)
        attempts: list[dict[str, bool | str | float]] = [{"solve_relaxation": True, "presolve": "off", "solver": "ipm"}]
        if simplex_first:
            cap = max(0.5, 2e-5 * highs.getNumCol())
            attempts.insert(0, {"solve_relaxation": True, "presolve": "off", "solver": "simplex", "time_limit": cap})
        saved: dict[str, bool | str | float] = {k: highs.getOptionValue(k)[1] for k in ("solve_relaxation", "presolve", "solver", "time_limit")}
        self._pair_rows(highs, on=True)
        try:
            for options in attempts:
                for k, v in {**saved, **options}.items():
                    highs.setOptionValue(k, v)
                with _quiet_stdout():
                    highs.run()
                status = highs.getModelStatus()
                if status in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible):
                    break
            value = highs.getInfo().objective_function_value - TIE_BREAK * min(budget, NO_BUDGET) / self.model.m_unit
            values = np.asarray(highs.getSolution().col_value)
        finally:  # after reading the answer: changing the model clears it
            self._pair_rows(highs, on=False)
            for k, v in saved.items():
                highs.setOptionValue(k, v)
        log.debug("mesh %s: LP relaxation within %s took %.2f s", self.problem.mesh, format_bytes(budget), time.perf_counter() - t0)
        if status != highspy.HighsModelStatus.kOptimal:
            return Relaxation(None, None, infeasible=status == highspy.HighsModelStatus.kInfeasible)
        rounded = evaluate(self.problem, self.model.assignment(values))
        return Relaxation(max(value, 0.0) * self.model.t_unit, rounded if rounded.peak_memory <= budget else None)

    def weighted(self, weight: float, *, gap: float | None = None, absolute_gap: float = 0.0) -> Solution:
        """The plan minimising time + ``weight`` x memory (both in the model's normalised units),
        without a budget: a supported point of the front (on its convex hull), solved without the
        budget row whose knapsack makes the epsilon-constraint MIPs hard (measured, GPT-3 13B on
        4x4x4: about 1 s each, where a budgeted solve took up to 19 s). ``gap``, ``absolute_gap``:
        stop once within that fraction, or that much (in the objective's units), of the optimum."""
        assert self.objective == "time"
        costs = self._costs((self.time_e, 1.0), (self.mem_e, weight + TIE_BREAK))
        highs = self._highs()
        if highs is None:
            solution = self.run(float("inf"), costs, gap=gap, absolute_gap=absolute_gap)
        else:
            cols = np.arange(len(costs), dtype=np.int32)
            highs.changeColsCost(len(costs), cols, costs)
            try:
                solution = self.run(float("inf"), costs, gap=gap, absolute_gap=absolute_gap)
            finally:
                highs.changeColsCost(len(costs), cols, self.costs)
        assert solution is not None  # no budget binds
        return solution

    def _costs(self, *parts: tuple[Expr, float]) -> np.ndarray:
        """The objective's column costs: the sum of each form times its weight."""
        costs = np.zeros(self.model.lp.num_cols)
        for expr, weight in parts:
            for col, coef in expr.items():
                costs[col] += weight * coef
        return costs

    def run(self, budget: float, costs: np.ndarray | None = None, *, gap: float | None = None, absolute_gap: float = 0.0) -> Solution | None:
        """The fastest plan within ``budget`` bytes per device (the smallest, for the memory
        objective), or None when none fits. ``costs``: another objective (:meth:`weighted`);
        ``gap``: the relative MIP gap of this solve (the settings' otherwise); ``absolute_gap``:
        the absolute one (in the objective's units)."""
        t0 = time.perf_counter()
        gap = self.settings.relative_gap if gap is None else gap
        with _quiet_stdout():
            outcome = self._run(budget, self.costs if costs is None else costs, gap, absolute_gap)
        elapsed = time.perf_counter() - t0
        log.debug("mesh %s: %s solve within %s took %.2f s", self.problem.mesh, self.objective, format_bytes(budget), elapsed)
        build = self.build_seconds if not self.solves else 0.0
        self.solves += 1
        if outcome.values is None or outcome.status is None:
            if self.objective == "memory":
                raise SolveStopped(f"the least-memory ILP of mesh {self.problem.mesh} found no plan within the time limit of "
                                   f"{self.settings.time_limit_s:g} s ({outcome.reason}): raise it (--time-limit, SolverSettings.time_limit_s)")
            return None
        values = outcome.values
        assignment = self.model.assignment(values)
        evaluation = evaluate(self.problem, assignment)
        primary = _dot(self.time_e, values) * self.model.t_unit if self.objective == "time" else _dot(self.mem_e, values) * self.model.m_unit
        return Solution(
            assignment=assignment,
            status=outcome.status,
            evaluation=evaluation,
            objective=float(primary),
            build_seconds=build,
            solve_seconds=elapsed,
            num_variables=self.model.lp.num_cols,
            num_constraints=self.model.lp.num_rows,
            backend="HiGHS" if self.backend == "highs" else "CBC",
        )


class _Outcome(NamedTuple):
    status: Status | None  # None: no plan (infeasible, or stopped without one)
    values: np.ndarray | None  # the columns' values
    reason: str  # the solver's word for how it ended


def _outcome(highs: highspy.Highs) -> _Outcome:
    """How a HiGHS run ended: optimal (within the gap), stopped with a plan, or no plan."""
    status = highs.getModelStatus()
    word = highs.modelStatusToString(status)
    if status == highspy.HighsModelStatus.kOptimal:
        return _Outcome("optimal", np.asarray(highs.getSolution().col_value), word)
    if highs.getInfo().primal_solution_status == 2 and status not in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
        return _Outcome("time_limit", np.asarray(highs.getSolution().col_value), word)  # 2: feasible
    return _Outcome(None, None, word)


def _dot(expr: Expr, values: np.ndarray) -> float:
    return float(sum(coef * values[col] for col, coef in expr.items()))


def _solve_once(problem: Problem, budget: float, objective: Literal["time", "memory"], settings: SolverSettings) -> Solution:
    solution = BudgetILP(problem, objective, settings).run(budget)
    if solution is None:
        least = _solve_once(problem, float("inf"), "memory", settings).evaluation
        raise InfeasibleBudget(infeasible_message(problem, budget, least), budget=budget, least=least)
    return solution


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
       :func:`planner.front.merge` and :func:`_end`).
    2. The supported points (on the front's convex hull) by weighted sums (the dichotomic scheme
       of Aneja & Nair 1979): between two points A and B, minimise time + w x memory with w the
       slope of AB; a plan strictly below the segment is a new point, and both halves are
       searched again. These solves have no budget row and are fast.
    3. The points between two neighbours by the epsilon-constraint method (Haimes, Lasdon &
       Wismer 1971): the fastest plan within ``m - step`` of the larger neighbour's memory ``m``,
       and so on down to the smaller neighbour: the plans above the hull, whose budgeted MIPs are
       the hard ones. Where the budget cuts the hull, the fastest plan within it starts the front.

    ``step = max(resolution * m, 1e-6 * m)``: ``resolution = 0`` finds every front point more than
    a millionth apart in memory (the exact front; the tests compare it with brute force), 0.05
    leaves out points within 5 % of memory of a neighbour. With r > 0 the MIPs of steps 2 and 3
    stop at a relative gap of ``g = settings.front_gap * r`` (1 % at 5 %; most of their time was
    spent proving the last percent: measured, gpt-tiny on dp=2 x 2 x 2, a weighted MIP 4.2 s exact,
    2.3 s at 1 %, the same plan): each point of step 3 is within g of the fastest plan within its
    budget, so every point of the exact front has a point at most g slower within 1 / (1 - r) of
    its memory, but near the least memory, where the end is within r (:func:`_end`);
    tests/test_front.py and tests/test_solver.py check both against brute force. The fastest plan
    is solved to ``settings.relative_gap``; r = 0 is exact throughout.
    ``max_points`` caps the points: the ends
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
    try:
        least = _solve_once(problem, float("inf"), "memory", settings)
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
    # the least-memory end (see _end), unless a bound shows it covered by points found elsewhere
    gap = settings.sweep_gap(resolution)
    end = _end(ilp, least, resolution, covered, bounding, gap)
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
        r = ilp.weighted(w, gap=gap)
        line = seconds(a) / ilp.model.t_unit + w * memory(a) / ilp.model.m_unit
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
            sol = _fill(ilp, budget, covered, memory(lower), bounding, gap)
            if sol is None or memory(sol) <= memory(lower) or sol.evaluation.step_time >= lower.evaluation.step_time:
                break
            points.append(sol)
            budget = memory(sol) - max(resolution * memory(sol), 1e-6 * memory(sol))
    if not points:
        return []
    points.sort(key=lambda p: (p.evaluation.step_time, memory(p)))
    front = [points[0]]
    for p in points[1:]:
        if memory(p) < memory(front[-1]):
            front.append(p)
    return front


def _end(ilp: BudgetILP, least: Solution, resolution: float, covered: Callable[[float], float] | None, bounding: BudgetILP | None,
         gap: float) -> Solution | None:
    """The front's least-memory end, from the least-memory plan ``least`` (memory ``m_min``, step
    time ``T_L``), or None when a bound shows it covered (see :func:`_fill`).

    ``resolution`` 0: the fastest plan of exactly ``m_min`` (a budgeted MIP there). With r > 0: the
    plan P minimising ``M + lam T`` without a budget, ``lam = r m_min / ((1 - r)(1 + r) T_L)``,
    solved to an absolute gap of ``lam r T_L``. For the fastest plan F of ``m_min`` (``T_F <= T_L``):
    ``M_P + lam T_P <= m_min + lam T_F + lam r T_L``, so ``T_P <= T_F + r T_L`` (as ``M_P >= m_min``)
    and ``M_P - m_min <= lam (1 + r) T_L = r m_min / (1 - r)``: P is within the resolution of the
    least memory in memory, and of the fastest plan there in time (times as the ILP prices them:
    where the evaluation hides communication, ZeRO-3 prefetch or CDP, P may land a little past the
    window). The sweep's gap between P and the next point up then looks for faster plans above it.

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
    if covered is not None:
        below = _covered_within(ilp, window, covered, bounding)
        if below is not None and below <= floor * (1 - 1e-6):
            return None
    t_least = max(least.evaluation.step_time, 1e-30) / ilp.model.t_unit
    weight = t_least * (1 - resolution) * (1 + resolution) / (resolution * floor / ilp.model.m_unit)
    return ilp.weighted(weight, absolute_gap=resolution * t_least)


def _fill(ilp: BudgetILP, budget: float, covered: Callable[[float], float] | None, floor: float, bounding: BudgetILP | None = None,
          gap: float | None = None) -> Solution | None:
    """The fastest plan within ``budget``, or None when a bound shows every plan between
    ``floor`` and the budget covered (``covered``: see :func:`sweep`). An answer whose exact memory
    exceeds the budget (solver tolerance, or a term the ILP does not price) is re-solved below."""
    while covered is not None:
        below = _covered_within(ilp, budget, covered, bounding)
        if below is None or below >= budget:
            break
        if below <= floor:
            return None
        budget = below
    return _within(ilp, budget, gap)


def _covered_within(ilp: BudgetILP, budget: float, covered: Callable[[float], float], bounding: BudgetILP | None) -> float | None:
    """The memory below which a plan within ``budget`` can beat the points ``covered`` knows: it is
    at least as slow as the LP relaxation within the budget; None without a bound (the relaxation
    is infeasible, or the backend is CBC)."""
    bound = (bounding or ilp).relaxation(budget)
    if bound is None:
        return None
    return covered(bound * (1 - ilp.settings.relative_gap)) * (1 - 1e-6)

