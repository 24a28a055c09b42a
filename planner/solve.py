"""Solving a problem's ILP (:mod:`planner.ilp` builds it and writes its math): the fastest plan
within a memory budget (:func:`solve`, :func:`solve_within`), re-solved when the exact evaluation
of its answer slips over the budget, with the least memory any plan needs when nothing fits
(:class:`InfeasibleBudget`).

One built model answers several questions (:class:`BudgetILP`): the weighted sum
min Time / t_unit + w M / m_unit without a budget (a supported point of the front; no knapsack row,
so far faster), and the LP relaxation within a budget (a lower bound on the time of every plan
that fits, which lets the search skip configurations and budgets without a MIP). ``credited``
models subtract what the evaluation may hide behind compute, so their optima bound evaluated times.
HiGHS through highspy is the backend, the model handed over as arrays; CBC through PuLP the
second, ``SolverSettings(backend="cbc")`` (both in :mod:`planner.backends`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple, cast

import highspy
import numpy as np

from planner.backends import Outcome, Status, highs_of, outcome, quiet, run_cbc, run_for
from planner.ilp import NO_BUDGET, Expr, Model
from planner.messages import infeasible_message
from planner.problem import breaks_a_rule, evaluate
from planner.terms import Evaluation, Problem
from planner.units import format_bytes

log = logging.getLogger(__name__)


TIE_BREAK = 1e-9  # weight of the secondary objective, both objectives normalised (see docstring)
MAX_RESOLVES = 4
# HiGHS' "no limit" for its iteration and node counts (its options' largest value)
NO_LIMIT = 2**31 - 1
# the relaxation-induced neighbourhood's MIP (BudgetILP._from_relaxation) stops after this many
# branch-and-bound nodes: a few dozen binaries are free, and it closed at the root (one node) in
# every solve of five front and one-plan cells of the zoo
NEIGHBOURHOOD_NODES = 1000


def simplex_cap(columns: int) -> int:
    """Dual simplex iterations an LP relaxation of ``columns`` columns gets before the solve takes
    its other path (interior point in :meth:`BudgetILP.relax`, the MIP itself in
    :meth:`BudgetILP._from_relaxation`). A count, not seconds, so that the path, and the plans
    within a MIP's gap that it gives, do not depend on how fast or how loaded the host is: with a
    cap of 8e-5 s a column, gpt-tiny's front on 8 devices beside the test suite had four
    relaxations of 19.7k columns stop at 3.5k-7.4k iterations and go to their MIPs, 157 s in
    all, where alone it took 55 s. Measured alone (the zoo's gpt-tiny and vit-base fronts on 8
    devices, gpt2-small's on 64, one plan of gpt2-small on 64 and 512, GPT-3 1.3B and 13B on 64;
    592 relaxations by simplex, 255-26k columns): 8e-5 s a column was 15k-27k iterations above
    2k columns (more below, where each is cheaper); every relaxation needed at most 8.1k, but
    one of 24.8k columns 23.4k (4.4 s; the clock had stopped it at 2 s). So 20k, and a third of
    the columns beyond 60k: larger relaxations take more (0.1-0.4 iterations a column above 6k
    columns), and gpt2-small's 94k-column dp=64 x 2 x 2 x 2 relaxation on 512 devices took 4.5 s."""
    return max(20_000, columns // 3)


LIGHT_PRESOLVE = 2  # HiGHS' presolve_mode for a budgeted MIP: 0 default (full), 1 initial sweep, 2 light, 3 full (see BudgetILP._run_mip)
# a budget at a plan's exact memory is solved at that memory times (1 + FLOOR_SLACK): the time model's
# memory row for that plan can sum to it plus a rounding error, which HiGHS without presolve reads as
# infeasible (GPT-3 175B on 8 x 8: the least-memory point, 49.79 GiB, fell off the front that way)
FLOOR_SLACK = 1e-9


@dataclass(frozen=True, kw_only=True)
class SolverSettings:
    backend: Literal["highs", "cbc"] = "highs"
    time_limit_s: float = 120.0
    relative_gap: float = 1e-6
    threads: int = 1
    # a front of resolution r > 0 (sweep) stops its weighted and budgeted MIPs at a relative gap of
    # front_gap * r (2 % at 5 %): each budgeted point is within that of the fastest plan within its
    # budget. At 0.2 (1 %) the MIPs' neighbourhood plans, 1-2 % from their LP bound, went on to
    # HiGHS' branch and bound: measured, interleaved, two runs each, GPT-3 1.3B's front on 8 devices
    # 24.4 / 26.3 s -> 17.9 / 16.2 s, vit-base's 52.8 / 45.8 -> 33.0 / 32.1, mlp-large's 21.8 -> 15.8,
    # mlp-large on 512 devices, gpt2-small on 8 and gpt-tiny on 8 unchanged within the host's noise
    front_gap: float = 0.4
    # and its least-memory MIP at least_gap * r (1e-4 at 5 %): proving the last hundred-thousandth of a
    # least memory the LP relaxation had all but shown took most of a 2-D configuration's front
    # (measured, gpt2-small on dp=2 x 2 x 2 of 8 devices, ZeRO-3: a plan 9.8e-6 above the LP bound, 4.7 s more)
    least_gap: float = 0.002

    def sweep_gap(self, resolution: float) -> float:
        """The relative gap of a front's weighted and budgeted MIPs at ``resolution`` (see :func:`sweep`)."""
        return max(self.relative_gap, self.front_gap * resolution)

    def least_memory_gap(self, resolution: float) -> float:
        """The relative gap of a front's least-memory MIP at ``resolution`` (see :func:`planner.sweep._end`)."""
        return max(self.relative_gap, self.least_gap * resolution)


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
        least = solve_once(problem, float("inf"), "memory", settings)
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
    solution = within(ilp, memory_budget)
    if solution is not None:
        return solution
    if not exact_least:
        raise InfeasibleBudget(f"no plan on mesh {problem.mesh} fits {format_bytes(memory_budget)} per device (the ILP within the budget "
                               "has no solution; the least memory a plan needs was not solved for)", budget=memory_budget, least=None)
    # nothing within the budget, or the exact evaluation kept exceeding what the ILP priced (a term
    # it does not model, such as the ZeRO-3 prefetch's in-flight gather): the least-memory plan
    # answers if it fits
    least = solve_once(problem, float("inf"), "memory", settings)
    if least.evaluation.peak_memory <= memory_budget:
        return least
    raise InfeasibleBudget(infeasible_message(problem, memory_budget, least.evaluation), budget=memory_budget, least=least.evaluation)


def within(ilp: BudgetILP, memory_budget: float, gap: float | None = None, faster_than: float | None = None) -> Solution | None:
    """The fastest plan within ``memory_budget`` (``gap``: to within that relative gap instead of
    the settings'), or None (``faster_than``: also when none is faster than that many seconds, as
    the ILP prices them; see :meth:`BudgetILP.run`). An answer whose exact memory exceeds the
    budget (a tolerance slip, or a term the ILP does not price) is re-solved with the budget
    lowered by twice the last overrun each time, :data:`MAX_RESOLVES` times at most."""
    budget = memory_budget
    for attempt in range(MAX_RESOLVES):
        solution = ilp.run(budget, gap=gap, faster_than=faster_than)
        if solution is None:
            return None
        overrun = solution.evaluation.peak_memory - memory_budget
        if overrun <= 0:
            return solution
        log.info("mesh %s: answer exceeds the budget by %.0f B (solver tolerance); re-solving", ilp.problem.mesh, overrun)
        budget -= overrun * 2**attempt
    return None


class Relaxation(NamedTuple):
    bound: float | None  # what no plan within the budget goes below (seconds; bytes for memory_relaxation); None: nothing fits
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
        self.model = Model(problem, f"plan_{problem.mesh}".replace(" ", "").replace("=", "").replace("x", "_"))
        self.time_e, self.mem_e = self.model.time_expr(credited), self.model.memory_expr()
        if objective == "time":
            self.model.memory_budget(float("inf"))
        first, second = (self.time_e, self.mem_e) if objective == "time" else (self.mem_e, self.time_e)
        self.costs = self._costs((first, 1.0), (second, TIE_BREAK))
        self.backend = settings.backend
        self._solver: highspy.Highs | None = None
        self._relaxer: highspy.Highs | None = None  # relax()'s own copy of the model, the pair rows on: its basis moves with the budget
        self.build_seconds = time.perf_counter() - t0
        self.solves = 0

    def _highs(self) -> highspy.Highs | None:
        """The HiGHS model, built on first use (None for CBC)."""
        if self.backend != "highs":
            return None
        if self._solver is None:
            highs = self._highs_of(self.model.lp.highs_lp(self.costs), {"mip_rel_gap": self.settings.relative_gap, "mip_abs_gap": 0.0})
            self._solver = highs
            self._pair_rows(highs, on=False)
        return self._solver

    def _highs_of(self, lp: highspy.HighsLp, options: dict[str, bool | str | float]) -> highspy.Highs:
        """A new HiGHS solver of ``lp`` with the settings' threads and ``options``."""
        return highs_of(lp, self.settings.threads, options)

    def _pair_rows(self, highs: highspy.Highs, *, on: bool) -> None:
        """The gathered weights' pair rows (:meth:`Model.hold`): on for a relaxation, off (free
        rows, which presolve drops) for the MIPs."""
        rows = self.model.pair_rows
        if rows:
            index = np.array(rows, dtype=np.int32)
            lower = np.full(len(rows), 0.0 if on else -np.inf)
            highs.changeRowsBounds(len(rows), index, lower, np.full(len(rows), np.inf))  # type: ignore[attr-defined]

    def _run(self, budget: float, costs: np.ndarray, gap: float, absolute_gap: float, cutoff: float) -> Outcome:
        row = self.model.memory_budget(budget) if self.objective == "time" else None
        highs = self._highs()
        if highs is None:
            s = self.settings
            return run_cbc(self.model, costs, time_limit_s=s.time_limit_s, threads=s.threads, gap=gap, absolute_gap=absolute_gap)
        if row is not None:
            highs.changeRowBounds(row, -NO_BUDGET, self.model.budget_bound)
        highs.setOptionValue("mip_rel_gap", gap)
        highs.setOptionValue("mip_abs_gap", absolute_gap)
        proven, start = self._from_relaxation(highs, budget, costs, gap, absolute_gap, cutoff)
        if proven is not None:
            return proven
        if start is not None:
            highs.setSolution(start)
        highs.setOptionValue("objective_bound", cutoff)
        try:
            self._run_mip(highs, budget, planned=start is not None)
        finally:
            highs.setOptionValue("objective_bound", math.inf)
        return outcome(highs)

    def _run_mip(self, highs: highspy.Highs, budget: float, *, planned: bool) -> None:
        """HiGHS' MIP, one run to the end (to the time limit), so its path depends on the model
        alone, not on the host's speed or load: without presolve when it is easy (no budget, or
        a budget that cannot bind) and starts from a plan (``planned``: the relaxation's
        neighbourhood, :meth:`_from_relaxation`), else with HiGHS' light presolve.

        Easy, its root LP often integral, presolve was most of its time: measured, GPT-3 175B on
        4 x 4 x 4, a weighted solve 1.2 s with presolve (0.84 s of it presolving), 0.2 s
        without; GPT-3 1.3B on 2 x 2 x 2, a weighted MIP from a plan 7.8 s without, 33.7 s with.
        Without a plan it can run away without presolve: the least-memory MIP of a 2-layer Llama
        on 2 x 2 x 2, 58k columns, found none in 60 s without and was optimal in 15 s with; the
        root LP of a 76k-column weighted MIP (GPT-3 1.3B on 64 devices) ran past 120 s without.
        With a budget that binds, the light presolve (presolve_mode 2) pays where the full one
        costs more than it saves: measured on the 58 MIPs over 0.3 s that ran with the full
        presolve in seven front and one-plan cells (57 budgeted, one neighbourhood MIP; the zoo
        on 8-512 devices, HiGHS 1.16, each re-solved alone at a relative gap of 1e-6), 340 s
        with the full presolve, 173 s light, 170 s without; GPT-3 13B's on 64 devices 21-45 s
        full, 8-16 s light; an MLP's on 8 x 8 x 8 3.4 s, 2.7 s of it the full presolve, 0.6 s
        light. Light, not off: it keeps the reductions a large model's root LP needs.
        (presolve_mode 1, the "initial sweep", crashed HiGHS 1.16 on one of those MIPs.)

        An easy MIP without a plan used to try without presolve first, interrupted after a few
        seconds if it had found none, and one with a plan stopped at three times that and
        restarted from it. Both went by the clock: measured, gpt-tiny's front on 8 devices beside
        the test suite, three of its 19.7k-column MIPs stopped at 6 s and ran 26 s more, where
        alone they took 5-6.5 s in one run. HiGHS counts nothing during a root LP that could
        stand in for the clock (its simplex callback is not called inside a MIP, nor does
        ``simplex_iteration_limit`` bind there). Few easy MIPs come without a plan: one of the
        15 of gpt-tiny's 8-device front, none in six other cells of the zoo."""
        easy = budget == float("inf") or self.objective == "memory"
        if easy and planned:
            highs.setOptionValue("presolve", "off")
            run_for(highs, self.settings.time_limit_s)
            return
        highs.setOptionValue("presolve", "choose")
        highs.setOptionValue("presolve_mode", LIGHT_PRESOLVE)  # (an older HiGHS without the option ignores it)
        try:
            run_for(highs, self.settings.time_limit_s)
        finally:
            highs.setOptionValue("presolve_mode", 0)

    def _from_relaxation(self, highs: highspy.Highs, budget: float, costs: np.ndarray, gap: float, absolute_gap: float,
                         cutoff: float) -> tuple[Outcome | None, highspy.HighsSolution | None]:
        """The MIP (objective ``costs``, already the model's) answered from its LP relaxation where
        that suffices: (the outcome, None) when proven, else (None, a plan to start the MIP from, or None).

        1. The LP relaxation by dual simplex, the pair rows on (:meth:`_pair_rows`: exact for
           one-hot x, so its optimum ``b`` bounds every plan), stopped after :func:`simplex_cap`
           iterations, from the basis of this model's last LP (the sweep's weighted solves differ in
           costs only: 0.05-0.2 s each), but from none, in a fresh copy of the model, where that
           basis has the budget binding and this solve has no budget (gpt-tiny's weighted LP at the
           least-memory end of the front, after a relaxation within the budget there: 3.6 s and
           13.0 s on the 2-D and 3-D meshes of 8 devices, 0.44 s and 0.96 s without a basis; the
           model's own solver, its basis dropped, still took over 2 s on the 3-D mesh after earlier
           simplex solves: HiGHS keeps more than the basis between them). A least-memory model
           without a basis first solves the time LP and starts from its basis (measured, gpt-tiny on
           2 x 2 x 2: the least-memory LP 12.6 s cold, 0.02 + 0.27 s so).
        2. The binaries the LP left at 0 or 1 fixed, the rest a MIP of a few dozen binaries
           (relaxation-induced neighbourhood search, RENS: Berthold 2014), with presolve: a
           plan, objective ``z``.
        3. ``z - b <= max(gap z, absolute_gap)``: the plan is within the gap of the optimum, as
           the MIP's own answer would be, and the MIP is not run. Otherwise it starts from the plan.

        Why: HiGHS solves a MIP's root LP from no basis, and without presolve computes an
        analytic centre by interior point first; on these models the LP is nearly always tight
        and most binaries integral in it. Measured (gpt-tiny on 8 devices, a100-80g), the
        least-memory MIP on 2 x 2 x 2 (3-D): 15.5 s -> 0.33 s; on dp=2 x 2 x 2 (2-D) 5.4 s -> 0.51 s;
        both answers equal to the MIP's within its gap."""
        cols = highs.getNumCol()
        limit = self.settings.time_limit_s
        t0 = time.perf_counter()
        options: dict[str, bool | str | float] = {"solve_relaxation": True, "presolve": "off", "solver": "simplex",
                                                  "simplex_iteration_limit": simplex_cap(cols)}
        with self._relaxing(highs, tuple(options)):
            for k, v in options.items():
                highs.setOptionValue(k, v)
            solver, basis, row = highs, highs.getBasis(), self.model.budget_row
            if basis.valid and budget == float("inf") and row is not None and basis.row_status[row] != highspy.HighsBasisStatus.kBasic:
                solver = self._highs_of(highs.getLp(), options)  # the budget bound in that basis: a poor start without it (see above)
            elif self.objective == "memory" and not basis.valid:
                index = np.arange(cols, dtype=np.int32)
                highs.changeColsCost(cols, index, self._costs((self.time_e, 1.0), (self.mem_e, TIE_BREAK)))
                try:
                    run_for(highs, limit)
                finally:
                    highs.changeColsCost(cols, index, costs)
            run_for(solver, limit)
            status = solver.getModelStatus()
            if status == highspy.HighsModelStatus.kInfeasible:
                return Outcome(None, None, "Infeasible"), None  # the pair rows are exact: no plan fits
            if status != highspy.HighsModelStatus.kOptimal:
                log.debug("mesh %s: relaxation %s after %.2f s", self.problem.mesh, solver.modelStatusToString(status), time.perf_counter() - t0)
                return None, None
            bound = solver.getInfo().objective_function_value
            x = np.asarray(solver.getSolution().col_value)
            if solver is not highs:
                highs.setBasis(solver.getBasis())  # the next solves start from this one
        if bound >= cutoff:
            return Outcome(None, None, "Cut off"), None  # no plan beats the cutoff
        lp = highs.getLp()  # the pair rows off again, as the MIP has them
        binary = np.asarray(self.model.lp.binary, dtype=np.int64)
        lower, upper = np.array(lp.col_lower_), np.array(lp.col_upper_)
        upper[binary[x[binary] < 1e-7]] = 0.0
        lower[binary[x[binary] > 1 - 1e-7]] = 1.0
        lp.col_lower_, lp.col_upper_ = lower, upper
        sub = self._highs_of(lp, {"mip_rel_gap": gap, "mip_abs_gap": absolute_gap, "objective_bound": cutoff, "mip_max_nodes": NEIGHBOURHOOD_NODES})
        run_for(sub, limit)
        if sub.getInfo().primal_solution_status != 2:  # 2: feasible
            log.debug("mesh %s: neighbourhood %s after %.2f s", self.problem.mesh, sub.modelStatusToString(sub.getModelStatus()), time.perf_counter() - t0)
            return None, None
        z = sub.getInfo().objective_function_value
        log.debug("mesh %s: relaxation %.9g, its neighbourhood's plan %.9g (%.1e apart), %.2f s", self.problem.mesh, bound, z,
                  (z - bound) / max(abs(z), 1e-30), time.perf_counter() - t0)
        if z - bound <= max(gap * abs(z), absolute_gap):
            return Outcome("optimal", np.asarray(sub.getSolution().col_value), "Optimal (within the gap of the LP relaxation)"), None
        return None, sub.getSolution()

    @contextlib.contextmanager
    def _relaxing(self, highs: highspy.Highs, keys: tuple[str, ...]) -> Iterator[dict[str, bool | str | float]]:
        """The model as an LP relaxation wants it: the pair rows on (:meth:`_pair_rows`); on exit
        they are off again and the options ``keys`` back as they were (given inside as their saved
        values). Read the answer inside: changing the model clears it."""
        saved: dict[str, bool | str | float] = {k: highs.getOptionValue(k)[1] for k in keys}
        self._pair_rows(highs, on=True)
        try:
            yield saved
        finally:
            self._pair_rows(highs, on=False)
            for k, v in saved.items():
                highs.setOptionValue(k, v)

    def relaxation(self, budget: float) -> float | None:
        """A lower bound on the objective of every plan within ``budget`` (seconds): the LP
        relaxation's optimum (integrality dropped), less the most the tie-break adds. None when
        the relaxation is infeasible (no plan fits) or the backend is not HiGHS."""
        return self.relax(budget).bound

    def relax(self, budget: float, *, simplex_first: bool = False) -> Relaxation:
        """:meth:`relaxation`, and its answer rounded (each group's largest x) and evaluated
        exactly: a plan, when it fits the budget (often near the MIP's, where the bound is tight).

        Interior point without presolve takes a steady time (measured, GPT-3 175B: ~0.45 s on a 3-D
        mesh of 64 devices, ~6 s on 8 x 8 x 8 of 4096), where dual simplex, from no basis, takes
        0.07-1.6 s on the same models when the budget is loose and up to 20 s (or fails) near the
        least memory. ``simplex_first`` (a fresh model, a budget that is likely loose): dual simplex
        first, stopped after :func:`simplex_cap` iterations (it was 8e-5 s a column, about what
        interior point takes: at worst twice its time), then interior point if it has not finished.
        Measured at 80 GiB on gpt2-small's 64- and 512-device meshes and GPT-3's, 2.6k-104k columns:
        simplex 0.08-4.8e-5 s a column, interior point 3.4-9.5e-5. At 2e-5 s a column the
        104k-column 3-D ZeRO-3 relaxation stopped at 2.1 s, 0.1 s before its answer, and spent 8.3 s
        more in interior point (gpt2-small, 64 devices, one plan: 27.2 s -> 16.0 s at 4e-5); at 4e-5
        gpt2-small's dp=64 x 2 x 2 x 2 relaxation stopped at 3.8 s of its 4.5 s (512 devices:
        47.1 s -> 37.6 s at 8e-5).

        A fresh model starts from the basis of the last relaxation of a sibling configuration
        (one that shares its priced conversions: ZeRO 0, 1 and 2 of a mesh, whose models differ in
        coefficients, not shape), by dual simplex: measured, gpt2-small on dp=64 x 2 x 2 x 2 of 512
        devices, 94k columns, ZeRO-1's relaxation 2.24 s -> 0.14 s and ZeRO-2's 1.70 s -> 0.15 s
        from ZeRO-0's basis, the same bounds. (A starting basis changes the path, not the optimum.)
        Without a sibling's, it starts from the basis of the MIPs' model's last LP (the front's
        fastest, least-memory and hull solves come first): measured, GPT-3 13B's dp=8 x 2 x 2 x 2
        ZeRO-1 on 64 devices, the first relaxation 11.4 s (interior point) -> 0.44 s.

        The relaxations run on their own copy of the model (the pair rows on for good), so each
        starts by dual simplex from the basis of the last, at another budget, and the MIPs' own
        LPs (:meth:`_from_relaxation`) keep theirs: measured, GPT-3 13B's front on 64 devices,
        ZeRO 0-3, 91 relaxations 45.9 s -> 13.4 s (the search 127 -> 96 s, the same front);
        on the MIPs' model the tight budgets' bases had slowed the weighted LPs after them."""
        t0 = time.perf_counter()
        main = self._highs()
        if main is None or self.objective != "time":
            return Relaxation(None, None)
        if self._relaxer is None:
            self._relaxer = self._highs_of(main.getLp(), {"solve_relaxation": True, "presolve": "off"})
            self._pair_rows(self._relaxer, on=True)
        highs = self._relaxer
        row = self.model.memory_budget(budget)
        highs.changeRowBounds(row, -NO_BUDGET, self.model.budget_bound)
        attempts = ["ipm"]
        shape = (highs.getNumCol(), highs.getNumRow())
        sibling = cast(tuple[tuple[int, int], highspy.HighsBasis] | None, self.problem.priced_memo.get("lp_basis"))
        if highs.getBasis().valid:
            simplex_first = True
        elif sibling is not None and sibling[0] == shape:
            highs.setBasis(sibling[1])
            simplex_first = True
        elif (basis := main.getBasis()).valid:  # the MIPs' last LP (see above: the same rows and columns)
            highs.setBasis(basis)
            simplex_first = True
        if simplex_first:
            attempts.insert(0, "simplex")
        for solver in attempts:
            highs.setOptionValue("solver", solver)
            highs.setOptionValue("simplex_iteration_limit", simplex_cap(highs.getNumCol()) if solver == "simplex" else NO_LIMIT)
            with quiet():
                run_for(highs, self.settings.time_limit_s)
            status = highs.getModelStatus()
            if status in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kInfeasible):
                break
        value = highs.getInfo().objective_function_value - TIE_BREAK * min(budget, NO_BUDGET) / self.model.m_unit
        values = np.asarray(highs.getSolution().col_value)
        if status == highspy.HighsModelStatus.kOptimal and highs.getBasis().valid:
            self.problem.priced_memo["lp_basis"] = (shape, highs.getBasis())
            if not main.getBasis().valid:
                main.setBasis(highs.getBasis())  # the MIPs' relaxations start from it (see _from_relaxation)
        log.debug("mesh %s: LP relaxation within %s took %.2f s", self.problem.mesh, format_bytes(budget), time.perf_counter() - t0)
        if status != highspy.HighsModelStatus.kOptimal:
            return Relaxation(None, None, infeasible=status == highspy.HighsModelStatus.kInfeasible)
        assignment = self.model.assignment(values)
        rounded = None if breaks_a_rule(self.problem, assignment) else evaluate(self.problem, assignment)
        return Relaxation(max(value, 0.0) * self.model.t_unit, rounded if rounded is not None and rounded.peak_memory <= budget else None)

    def memory_relaxation(self) -> Relaxation:
        """The least-memory LP relaxation (``objective="memory"``; integrality dropped, the pair
        rows on, the time tie-break off), by interior point after presolve: its optimum, bytes per
        device no plan goes below (a bound to skip a configuration's MIP with, not its answer:
        fractional strategies undercut the peak, a max over instants), and its answer rounded (each
        group's largest x) and evaluated exactly, a plan (:meth:`relax`, for memory). Both None
        where the backend is not HiGHS or the LP does not solve. The model is left as it was, so
        :meth:`run` solves the MIP after it, from its basis."""
        assert self.objective == "memory"
        t0 = time.perf_counter()
        highs = self._highs()
        if highs is None:
            return Relaxation(None, None)
        cols = np.arange(len(self.costs), dtype=np.int32)
        highs.changeColsCost(len(cols), cols, self._costs((self.mem_e, 1.0)))
        try:
            # with presolve (measured, GPT-3 175B on dp=8 x 2 x 2 x 2 ZeRO-3, 105k columns: 13.4 s, where
            # interior point without presolve took 80 s and dual simplex 23.9 s)
            options: dict[str, bool | str | float] = {"solve_relaxation": True, "presolve": "choose", "solver": "ipm"}
            with self._relaxing(highs, tuple(options)):
                for k, v in options.items():
                    highs.setOptionValue(k, v)
                with quiet():
                    run_for(highs, self.settings.time_limit_s)
                optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
                value = highs.getInfo().objective_function_value
                values = np.asarray(highs.getSolution().col_value)
        finally:
            highs.changeColsCost(len(cols), cols, self.costs)
        log.debug("mesh %s: least-memory LP relaxation took %.2f s", self.problem.mesh, time.perf_counter() - t0)
        if not optimal:
            return Relaxation(None, None)
        assignment = self.model.assignment(values)
        # (1 - 1e-6): the LP's tolerances
        return Relaxation(max(value, 0.0) * self.model.m_unit * (1 - 1e-6),
                          None if breaks_a_rule(self.problem, assignment) else evaluate(self.problem, assignment))

    def weighted(self, weight: float, *, gap: float | None = None, absolute_gap: float = 0.0) -> Solution:
        """The plan minimising time + ``weight`` x memory (both in the model's normalised units),
        without a budget: a supported point of the front (on its convex hull), solved without the
        budget row whose knapsack makes the epsilon-constraint MIPs hard (measured, GPT-3 13B on
        4x4x4: about 1 s each, where a budgeted solve took up to 19 s). ``gap``, ``absolute_gap``:
        stop once within that fraction, or that much (in the objective's units), of the optimum.

        On a least-memory model (``objective="memory"``, no budget row) the same objective starts
        from the least-memory plan's basis, a near start where ``weight`` makes memory dominate:
        measured, gpt-tiny on 8 devices, the front's least-memory end (:func:`planner.sweep._end`)
        0.54 s where the time model took 6.38 s (3-D 2 x 2 x 2), 1.16 s where it took 7.55 s
        (dp=2 x 2 x 2 2-D); the same plans."""
        solution = self.weighted_below(weight, math.inf, gap=gap, absolute_gap=absolute_gap)
        assert solution is not None  # no budget binds, no cutoff
        return solution

    def weighted_below(self, weight: float, below: float, *, gap: float | None = None, absolute_gap: float = 0.0) -> Solution | None:
        """:meth:`weighted`, only a plan whose value (time + ``weight`` x memory, normalised, the
        tie-break's ``TIE_BREAK`` x memory included) is below ``below``: None when there is none.
        The solver prunes with it (HiGHS' ``objective_bound``), so a search for a point below a
        segment of the front's hull (:func:`planner.sweep.sweep`) need not prove the optimum of
        plans above the segment: measured, gpt-tiny on 8 devices, the hull of the 3-D 2 x 2 x 2
        configuration had weighted MIPs of 100.9 s and 14.9 s without it (the relaxation that
        would have answered them stopped at its time limit)."""
        costs = self._costs((self.time_e, 1.0), (self.mem_e, weight + TIE_BREAK))
        highs = self._highs()
        if highs is None:
            return self.run(float("inf"), costs, gap=gap, absolute_gap=absolute_gap, cutoff=below)
        cols = np.arange(len(costs), dtype=np.int32)
        highs.changeColsCost(len(costs), cols, costs)
        try:
            return self.run(float("inf"), costs, gap=gap, absolute_gap=absolute_gap, cutoff=below)
        finally:
            highs.changeColsCost(len(costs), cols, self.costs)

    def _costs(self, *parts: tuple[Expr, float]) -> np.ndarray:
        """The objective's column costs: the sum of each form times its weight."""
        costs = np.zeros(self.model.lp.num_cols)
        for expr, weight in parts:
            for col, coef in expr.items():
                costs[col] += weight * coef
        return costs

    def run(self, budget: float, costs: np.ndarray | None = None, *, gap: float | None = None, absolute_gap: float = 0.0,
            faster_than: float | None = None, cutoff: float = math.inf) -> Solution | None:
        """The fastest plan within ``budget`` bytes per device (the smallest, for the memory
        objective), or None when none fits. ``costs``: another objective (:meth:`weighted`);
        ``gap``: the relative MIP gap of this solve (the settings' otherwise); ``absolute_gap``:
        the absolute one (in the objective's units). ``faster_than`` (seconds, the time
        objective): None also when no plan within the budget is faster than that, as the ILP
        prices it; a cutoff the solver prunes with (HiGHS' ``objective_bound``; measured, gpt-tiny's
        front on 8 devices, ZeRO 0: 22.4 s -> 19.4-20.5 s; vit-base's, ZeRO 0-3, unchanged: most of
        its budgeted MIPs are of configurations whose evaluation hides communication, where the
        ILP's time bounds nothing and the sweep passes no cutoff). ``cutoff``: None also when no
        plan's objective (in the model's normalised units, ``costs``' when given) is below it."""
        t0 = time.perf_counter()
        gap = self.settings.relative_gap if gap is None else gap
        if faster_than is not None and costs is None and self.objective == "time":
            cutoff = min(cutoff, faster_than / self.model.t_unit * (1 + 1e-9) + TIE_BREAK * min(budget, NO_BUDGET) / self.model.m_unit)
        costs = self.costs if costs is None else costs
        with quiet():
            outcome = self._run(budget, costs, gap, absolute_gap, cutoff)
        elapsed = time.perf_counter() - t0
        log.debug("mesh %s: %s solve within %s took %.2f s", self.problem.mesh, self.objective, format_bytes(budget), elapsed)
        build = self.build_seconds if not self.solves else 0.0
        self.solves += 1
        if outcome.values is None or outcome.status is None:
            if cutoff < math.inf:
                return None  # (or none below the cutoff)
            if self.objective == "memory" and outcome.reason == "Infeasible" and self.problem.cdp != "off":
                raise SolveStopped(f"no CDP plan of mesh {self.problem.mesh}: every choice of strategies needs a collective over the "
                                   "data-parallel workers (a tensor gathered over them), which CDP's workers, running at different times, "
                                   "cannot join; plan it without CDP")
            if self.objective == "memory":
                raise SolveStopped(f"the least-memory ILP of mesh {self.problem.mesh} found no plan within the time limit of "
                                   f"{self.settings.time_limit_s:g} s ({outcome.reason}): raise it (--time-limit, SolverSettings.time_limit_s)")
            return None
        values = outcome.values
        if float(costs @ values) >= cutoff:
            return None  # (a plan the solver's neighbourhood search or tolerances let through)
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


def _dot(expr: Expr, values: np.ndarray) -> float:
    return float(sum(coef * values[col] for col, coef in expr.items()))


def least_memory(problem: Problem, settings: SolverSettings, ilp: BudgetILP | None = None, gap: float | None = None) -> tuple[Solution, BudgetILP]:
    """The least-memory plan (to the time tie-break, the fastest of that memory; ``gap``: to that
    relative gap, the settings' otherwise) and the model that found it (``ilp``, when given: the
    problem's least-memory model, built already), whose basis a weighted solve near that memory
    starts from (:meth:`BudgetILP.weighted`). Raises :class:`SolveStopped` when the time limit ends
    the MIP without a plan."""
    ilp = ilp or BudgetILP(problem, "memory", settings)
    least = ilp.run(float("inf"), gap=gap)
    assert least is not None  # no budget row: run() returns a plan or raises
    return least, ilp


def solve_once(problem: Problem, budget: float, objective: Literal["time", "memory"], settings: SolverSettings) -> Solution:
    solution = BudgetILP(problem, objective, settings).run(budget)
    if solution is None:
        least = solve_once(problem, float("inf"), "memory", settings).evaluation
        raise InfeasibleBudget(infeasible_message(problem, budget, least), budget=budget, least=least)
    return solution

