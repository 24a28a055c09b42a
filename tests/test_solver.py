"""Specification of :func:`planner.solve.solve`: the ILP returns the optimum.

Each case is a traced model small enough in *strategy count* to enumerate every assignment: the
brute force evaluates each with :func:`planner.problem.evaluate` and takes the fastest plan within
the memory budget (or the least memory). The solver must agree.

Two kinds of case, five orders of magnitude apart in memory:

* ``wide-*`` / ``repeated-*`` models live on the meta device with realistic widths, so their
  memory is a sizeable fraction of a GiB, and some Pareto plans of ``wide-two-linear`` differ by
  only 64 B;
* ``mlp-tiny`` and ``two-linear`` are a few KiB per device.

The ILP normalises memory and time by the problem's largest coefficients (``planner.ilp.Model.m_unit``,
``planner.ilp.Model.t_unit``), so both kinds sit at the same scale for HiGHS, and :func:`solve` re-solves an
answer whose exact memory exceeds the budget; ``test_a_budget_row_slip_*`` simulates a slip to
exercise that re-solve.

Two bugs these tests found are fixed: a re-solve that lost the plan fitting the caller's budget, and a
memory objective that did not prefer the fastest least-memory plan (now lexicographic).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, replace

import highspy
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner.backends as backends
import planner.ilp as ilp_module
import planner.solve as solve_module
import planner.sweep as sweep_module
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.models import build_model, example_inputs
from planner.problem import build_problem, evaluate
from planner.solve import TIE_BREAK, InfeasibleBudget, SolverSettings, solve
from planner.terms import Problem
from planner.trace import trace
from planner.units import format_bytes

REL = 1e-9
# The default relative_gap (1e-6) lets HiGHS stop at a plan up to ~1e-6 slower than the optimum, and
# these cases have near-ties (plans a 32 B all-gather, ~3e-11 s, apart) that it does stop at; the
# optimality checks ask for the optimum itself.
EXACT = SolverSettings(relative_gap=0.0)

# --------------------------------------------------------------------------- models


class TwoLinear(nn.Module):
    """``cross_entropy(b(relu(a(x))), t)``."""

    def __init__(self, d_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, hidden)
        self.b = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.b(torch.relu(self.a(x))), t)


class Repeated(nn.Module):
    """``n`` identical ``relu(Linear(h, h))`` blocks (one shared ILP group) and a head."""

    def __init__(self, hidden: int, classes: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(n))
        self.head = nn.Linear(hidden, classes, bias=False)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return F.cross_entropy(self.head(x), t)


def _meta_inputs(batch: int, d_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(batch, d_in, device="meta"), torch.empty(batch, dtype=torch.long, device="meta")


def _graph(name: str):
    if name == "mlp-tiny":
        args, kwargs = example_inputs("mlp-tiny", batch=4)
        return trace(build_model("mlp-tiny"), args, kwargs)
    if name == "two-linear":
        torch.manual_seed(0)
        return trace(TwoLinear(8, 16, 4), (torch.randn(4, 8), torch.randint(0, 4, (4,))))
    if name == "wide-two-linear":
        with torch.device("meta"):
            model = TwoLinear(2048, 8192, 1024)
        return trace(model, _meta_inputs(64, 2048))
    if name == "repeated":
        with torch.device("meta"):
            model = Repeated(4096, 1024, 3)
        # a batch whose activations rival the weights: under the lifetime-aware peak the
        # trade-off between sharding weights and activations needs both to matter (7 Pareto plans)
        return trace(model, _meta_inputs(2048, 4096))
    raise KeyError(name)


# --------------------------------------------------------------------------- brute force


@dataclass(frozen=True)
class Case:
    problem: Problem
    keys: tuple[str, ...]
    sizes: tuple[int, ...]
    time: np.ndarray  # step time of every assignment, itertools.product order
    memory: np.ndarray  # peak memory of every assignment

    def assignment(self, flat: int) -> dict[str, int]:
        return dict(zip(self.keys, (int(i) for i in np.unravel_index(flat, self.sizes)), strict=True))

    def fastest_within(self, budget: float) -> float:
        fits = self.memory <= budget
        assert fits.any()
        return float(self.time[fits].min())

    @property
    def least_memory(self) -> float:
        return float(self.memory.min())

    def pareto(self) -> list[tuple[float, float]]:
        """(memory, time) of the plans no other plan beats on both, by increasing memory."""
        order = np.lexsort((self.time, self.memory))
        front: list[tuple[float, float]] = []
        for k in order:
            t, m = float(self.time[k]), float(self.memory[k])
            if not front or t < front[-1][1]:
                front.append((m, t))
        return front


CASES = {
    "mlp-tiny/dp1xtp2": ("mlp-tiny", Mesh(("dp", "tp"), (1, 2))),
    "two-linear/dp2xtp2": ("two-linear", Mesh(("dp", "tp"), (2, 2))),
    "wide-two-linear/dp2xtp2": ("wide-two-linear", Mesh(("dp", "tp"), (2, 2))),
    "repeated/dp1xtp2": ("repeated", Mesh(("dp", "tp"), (1, 2))),
    # every repeated layer recomputed in backward (planner.schemes.recompute)
    "repeated/dp1xtp2 recompute": ("repeated", Mesh(("dp", "tp"), (1, 2)), {"recompute": "full"}),
    # the first half of the repeated layers recomputed, the others keeping their activations
    "repeated/dp1xtp2 recompute half": ("repeated", Mesh(("dp", "tp"), (1, 2)), {"recompute": "full 1/2"}),
}
TINY = ("mlp-tiny/dp1xtp2", "two-linear/dp2xtp2")
LARGE = ("wide-two-linear/dp2xtp2", "repeated/dp1xtp2")


@functools.cache
def case(name: str) -> Case:
    model, mesh, *options = CASES[name]
    problem = build_problem(_graph(model), mesh, A100_80G, **(options[0] if options else {}))
    keys = tuple(problem.groups)
    sizes = tuple(len(problem.groups[k].strategies) for k in keys)
    assert math.prod(sizes) <= 200_000, sizes
    times, mems = [], []
    for combo in itertools.product(*(range(n) for n in sizes)):
        ev = evaluate(problem, dict(zip(keys, combo, strict=True)))
        times.append(ev.step_time)
        mems.append(ev.peak_memory)
    return Case(problem, keys, sizes, np.array(times), np.array(mems))


def _time_slack(c: Case) -> float:
    """How much slower than the fastest plan the ILP may go: its memory tie-break (planner.ilp) weighs
    memory at TIE_BREAK per m_unit bytes against time at 1 per t_unit seconds."""
    model = ilp_module.Model(c.problem, "units")
    return TIE_BREAK * model.t_unit * (float(c.memory.max()) - c.least_memory) / model.m_unit


def between_pareto_budgets(c: Case) -> list[float]:
    """Budgets half-way between consecutive Pareto memories (binding, away from any plan's exact
    memory), plus the largest memory any plan needs."""
    front = c.pareto()
    mids = [(a[0] + b[0]) / 2 for a, b in itertools.pairwise(front)]
    return [*mids, float(c.memory.max())]


def _assert_fastest_within(c: Case, budget: float) -> None:
    sol = solve(c.problem, memory_budget=budget, settings=EXACT)
    best = c.fastest_within(budget)
    ev = sol.evaluation
    assert ev.peak_memory <= budget, f"budget {budget:.0f} B, plan needs {ev.peak_memory:.0f} B"
    assert ev.step_time >= best * (1 - REL)  # the plan fits, so brute force cannot be beaten
    assert ev.step_time <= best * (1 + REL) + _time_slack(c), f"budget {budget:.0f}: {ev.step_time} vs {best}"


# --------------------------------------------------------------------------- sanity of the cases


def test_brute_force_cases_are_small_and_have_memory_time_tradeoffs() -> None:
    for name in CASES:
        c = case(name)
        assert 1_000 <= c.time.size <= 200_000
        assert len(c.pareto()) >= 2, name  # binding budgets to probe (wide-two-linear keeps 2 under the lifetime-aware peak)
    assert case("repeated/dp1xtp2").problem.groups["linear"].count == 3  # shared blocks
    # Pareto plans only a small tensor apart: budgets between them are binding to the byte
    front = case("wide-two-linear/dp2xtp2").pareto()
    assert min(b[0] - a[0] for a, b in itertools.pairwise(front)) <= 8192  # 8 KiB apart on 256 MiB


# --------------------------------------------------------------------------- time objective


@pytest.mark.parametrize("name", list(CASES))
def test_unbounded_budget_gives_the_bruteforce_fastest_plan(name: str) -> None:
    c = case(name)
    sol = solve(c.problem, memory_budget=float("inf"), settings=EXACT)
    assert sol.status == "optimal"
    best = float(c.time.min())
    assert sol.evaluation.step_time == pytest.approx(best, rel=REL, abs=_time_slack(c))


@pytest.mark.parametrize("name", list(CASES))
def test_binding_budgets_give_the_bruteforce_fastest_plan_that_fits(name: str) -> None:
    c = case(name)
    budgets = between_pareto_budgets(c)
    assert len(budgets) >= 2  # at least one really binding budget
    for budget in budgets:
        _assert_fastest_within(c, budget)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("resolution", [0.05, 0.2, 0.5])
def test_the_fronts_least_memory_end_keeps_its_bound(name: str, resolution: float) -> None:
    """planner.sweep._end with a resolution r: a plan within m_min / (1 - r) at most r T_L slower than the
    fastest plan of exactly the least memory m_min (T_L: the least-memory plan's time), checked
    against brute force; r = 0 is the fastest plan of m_min itself."""
    c = case(name)
    least = solve(c.problem, memory_budget=float("inf"), objective="memory", settings=EXACT)
    m_min, t_least = least.evaluation.peak_memory, least.evaluation.step_time
    assert m_min == pytest.approx(c.least_memory, rel=1e-9)
    fastest_at_least = c.fastest_within(m_min * (1 + 1e-9))
    ilp = solve_module.BudgetILP(c.problem, "time", EXACT)
    _, least_ilp = solve_module.least_memory(c.problem, EXACT)
    for model in (None, least_ilp):  # solved on the time model, or on the least-memory model (the sweep's), from its basis
        end = sweep_module._end(ilp, least, resolution, None, None, EXACT.sweep_gap(resolution), model)
        assert end is not None
        assert m_min <= end.evaluation.peak_memory <= m_min / (1 - resolution) * (1 + 1e-9)
        assert end.evaluation.step_time <= fastest_at_least + resolution * t_least * (1 + 1e-9)
    exact = sweep_module._end(ilp, least, 0.0, None, None, 0.0)
    assert exact is not None and exact.evaluation.peak_memory <= m_min * (1 + 1e-9)
    assert exact.evaluation.step_time == pytest.approx(fastest_at_least, rel=1e-6, abs=_time_slack(c))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("resolution", [0.05, 0.2])
def test_the_fronts_end_keeps_its_bound_from_a_least_memory_within_its_gap(name: str, resolution: float) -> None:
    """A front of resolution r solves its least memory to a relative gap e
    (SolverSettings.least_memory_gap): from any plan L within m_min / (1 - e), the slowest there
    included, planner.sweep._end finds a plan within m_L / (1 - r) at most (r + e (1 - r^2) / r) T_L
    slower than the fastest plan within m_L (brute force)."""
    c = case(name)
    e = EXACT.least_memory_gap(resolution)
    assert e == pytest.approx(resolution / 500)
    near = np.flatnonzero(c.memory <= c.least_memory / (1 - e))
    slowest = c.assignment(int(near[np.argmax(c.time[near])]))
    least = solve(c.problem, memory_budget=float("inf"), objective="memory", settings=EXACT)
    least = replace(least, assignment=slowest, evaluation=evaluate(c.problem, slowest))
    m_l, t_l = least.evaluation.peak_memory, least.evaluation.step_time
    end = sweep_module._end(solve_module.BudgetILP(c.problem, "time", EXACT), least, resolution, None, None, EXACT.sweep_gap(resolution))
    assert end is not None
    assert end.evaluation.peak_memory <= m_l / (1 - resolution) * (1 + 1e-9)
    slower = (resolution + e * (1 - resolution**2) / resolution) * t_l
    assert end.evaluation.step_time <= c.fastest_within(m_l * (1 + 1e-9)) + slower * (1 + 1e-9) + _time_slack(c)


@pytest.mark.parametrize("name", TINY)
def test_cbc_through_pulp_gives_the_same_plans_as_highs(name: str) -> None:
    """The CBC backend (PuLP, given the same arrays) is a second solver for the same model: the
    fastest plan at each binding budget and the least memory are the brute force's too."""
    c = case(name)
    cbc = SolverSettings(backend="cbc", relative_gap=0.0)
    for budget in between_pareto_budgets(c):
        sol = solve(c.problem, memory_budget=budget, settings=cbc)
        assert sol.backend == "CBC" and sol.evaluation.peak_memory <= budget
        assert sol.evaluation.step_time == pytest.approx(c.fastest_within(budget), rel=1e-6, abs=_time_slack(c))
    least = solve(c.problem, memory_budget=float("inf"), objective="memory", settings=cbc)
    assert least.evaluation.peak_memory == pytest.approx(c.least_memory, rel=1e-9)


@pytest.mark.parametrize("name", list(LARGE))
def test_a_budget_half_way_from_the_least_memory_to_the_fastest_plan_gives_the_bruteforce_fastest(name: str) -> None:
    c = case(name)
    fastest = float(c.time.min())
    fastest_memory = float(c.memory[c.time <= fastest * (1 + REL)].min())
    budget = (c.least_memory + fastest_memory) / 2
    assert c.fastest_within(budget) > fastest  # binding
    _assert_fastest_within(c, budget)


@pytest.mark.parametrize("name", list(CASES))
def test_a_budget_equal_to_a_pareto_plans_exact_memory_is_never_exceeded(name: str) -> None:
    c = case(name)
    for memory, _ in c.pareto():
        _assert_fastest_within(c, memory)


@pytest.mark.parametrize("name", list(CASES))
def test_time_objective_is_the_plans_exact_step_time(name: str) -> None:
    c = case(name)
    for budget in (float("inf"), *between_pareto_budgets(c)):
        sol = solve(c.problem, memory_budget=budget)
        # Solution.objective is the ILP's time expression in seconds, without the tie-break. Its
        # conversion indicators y carry time cost, so they sit at their tight 0/1 values and the
        # expression is the exact step time of the plan.
        assert sol.objective == pytest.approx(sol.evaluation.step_time, rel=REL)


# --------------------------------------------------------------------------- memory objective


@pytest.mark.parametrize("name", list(CASES))
def test_memory_objective_finds_the_bruteforce_least_memory(name: str) -> None:
    c = case(name)
    sol = solve(c.problem, memory_budget=float("inf"), objective="memory")
    assert sol.evaluation.peak_memory == pytest.approx(c.least_memory, rel=REL)
    # Solution.objective is the ILP's memory expression in bytes. Under objective="memory" the
    # hold indicators z and the transient T carry memory cost, so they are pushed down to their
    # tight values and the expression is the exact peak memory (not merely an upper bound).
    assert sol.objective == pytest.approx(sol.evaluation.peak_memory, rel=REL)




@pytest.mark.parametrize("name", list(CASES))
def test_memory_objective_breaks_ties_in_favour_of_the_fastest_least_memory_plan(name: str) -> None:
    c = case(name)
    least = c.memory <= c.least_memory * (1 + REL)
    assert c.time[least].max() > c.time[least].min() * 1.01  # there is a tie to break
    sol = solve(c.problem, memory_budget=float("inf"), objective="memory", settings=EXACT)
    assert sol.evaluation.step_time == pytest.approx(float(c.time[least].min()), rel=REL)


# --------------------------------------------------------------------------- infeasible budgets


@pytest.mark.parametrize("name", list(CASES))
def test_infeasible_budget_raises_with_the_least_memory_plan(name: str) -> None:
    c = case(name)
    budget = c.least_memory / 2
    with pytest.raises(InfeasibleBudget) as info:
        solve(c.problem, memory_budget=budget)
    err = info.value
    assert err.budget == budget
    assert err.least is not None
    assert err.least.peak_memory == pytest.approx(c.least_memory, rel=REL)


@pytest.mark.parametrize("name", list(CASES))
def test_infeasible_budget_message_quotes_the_numbers_with_format_bytes(name: str) -> None:
    c = case(name)
    budget = c.least_memory / 2
    with pytest.raises(InfeasibleBudget) as info:
        solve(c.problem, memory_budget=budget)
    message = str(info.value)
    assert f"no plan on mesh {c.problem.mesh} fits {format_bytes(budget)} per device" in message
    assert f"the least any plan needs is {format_bytes(c.least_memory)} (" in message
    assert f"{format_bytes(c.least_memory - budget)} over." in message
    assert format_bytes(budget) != format_bytes(c.least_memory)  # informative at KiB and GiB scale


@pytest.mark.parametrize("name", list(CASES))
def test_a_budget_one_percent_below_the_least_memory_is_infeasible(name: str) -> None:
    c = case(name)
    with pytest.raises(InfeasibleBudget):
        solve(c.problem, memory_budget=c.least_memory * 0.99)


# --------------------------------------------------------------------------- tolerance slips




@pytest.mark.parametrize("name", list(CASES))
def test_a_budget_row_slip_is_re_solved_without_losing_the_plan_that_fits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first solve enforces the budget row only to ``slip`` bytes (a solver tolerance large
    enough to admit the next Pareto plan), the re-solves exactly: with the budget at the least
    memory, solve() must still return the least-memory plan."""
    c = case(name)
    (least, _), (second, _) = c.pareto()[:2]
    slip = second - least
    exact = ilp_module.Model.memory_budget
    calls = []

    def slipping(model: ilp_module.Model, budget: float) -> None:
        calls.append(budget)
        exact(model, budget + (slip if len(calls) == 1 else 0.0))

    monkeypatch.setattr(ilp_module.Model, "memory_budget", slipping)
    sol = solve(c.problem, memory_budget=least)
    assert len(calls) >= 2  # the slip was seen and re-solved
    assert sol.evaluation.peak_memory <= least


# --------------------------------------------------------------------------- the LP relaxation


def _no_pair(model: ilp_module.Model, gu: str, iu: frozenset[int], gv: str, iv: frozenset[int]) -> None:
    return None


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_weight_holds_are_written_on_the_edges_transportation_variables(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight saved gathered (held only when its parameter is stored otherwise) is the product
    of two groups' choices; beside x_u + x_v - 1, the relaxation has a row summing the edge's
    transportation variables over the (stored, saved) pairs. Both are exact for one-hot x (the
    brute-force tests above pass with both); the relaxation's least memory is at least the loose
    form's alone, and at most the least memory of any plan."""
    c = case(name)
    model = ilp_module.Model(c.problem, "pairs")
    pairs = [(gu, iu, gv, iv) for term in c.problem.holds.values() for gu, iu, gv, iv in term.conditions if gv is not None]
    assert pairs  # every case has gathered weights
    assert all(model._pair(*cond) is not None for cond in pairs) and len(model.pair_rows) == len(pairs)
    tight = solve_module.BudgetILP(c.problem, "time", EXACT)
    monkeypatch.setattr(ilp_module.Model, "_pair", _no_pair)
    loose = solve_module.BudgetILP(c.problem, "time", EXACT)

    def relaxed_least(ilp: solve_module.BudgetILP) -> float:
        lo, hi = 0.0, c.least_memory
        assert ilp.relax(hi).bound is not None  # every plan is a point of the relaxation
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ilp.relax(mid).infeasible else (lo, mid)
        return hi

    assert relaxed_least(loose) * (1 - 1e-6) <= relaxed_least(tight) <= c.least_memory * (1 + 1e-9)


@pytest.mark.parametrize("name", TINY)
def test_a_relaxation_with_nothing_within_the_budget_says_so(name: str) -> None:
    c = case(name)
    ilp = solve_module.BudgetILP(c.problem, "time", EXACT)
    relaxation = ilp.relax(c.least_memory / 4)
    assert relaxation.infeasible and relaxation.bound is None and relaxation.plan is None
    fits = ilp.relax(c.least_memory)
    assert not fits.infeasible and fits.bound is not None


@pytest.mark.parametrize("name", list(CASES))
def test_dual_simplex_first_gives_the_interior_points_bound(name: str) -> None:
    """relax(simplex_first=True) (dual simplex, then interior point if it runs past its time) is
    the same LP: the same bound within solver tolerance, the same verdict when nothing fits."""
    c = case(name)
    for budget in (c.least_memory / 4, c.least_memory, float(c.memory.max())):
        a = solve_module.BudgetILP(c.problem, "time", EXACT).relax(budget)
        b = solve_module.BudgetILP(c.problem, "time", EXACT).relax(budget, simplex_first=True)
        assert a.infeasible == b.infeasible
        if a.bound is None:
            assert b.bound is None
        else:
            assert b.bound == pytest.approx(a.bound, rel=1e-6)
            assert b.bound <= c.fastest_within(budget) * (1 + 1e-6)  # a lower bound on every plan that fits


@pytest.mark.parametrize("name", TINY)
def test_a_relaxation_stopped_at_its_simplex_cap_still_gives_the_bound_and_the_plan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With simplex stopped after one iteration (solve.simplex_cap), relax(simplex_first=True)
    gets its bound from interior point, and a budgeted solve, its relaxation unfinished, from the
    MIP: the same bound, the brute-force fastest plan within the budget."""
    c = case(name)
    monkeypatch.setattr(solve_module, "simplex_cap", lambda columns: 1)
    for budget in (c.least_memory, *between_pareto_budgets(c)[:2]):
        a = solve_module.BudgetILP(c.problem, "time", EXACT).relax(budget)
        b = solve_module.BudgetILP(c.problem, "time", EXACT).relax(budget, simplex_first=True)
        assert a.bound is not None and b.bound == pytest.approx(a.bound, rel=1e-6)
        _assert_fastest_within(c, budget)


@pytest.mark.parametrize("name", TINY)
def test_a_mip_its_relaxation_proves_is_answered_without_running_it(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """BudgetILP._from_relaxation: where the LP-integral neighbourhood's plan is within the gap of
    the LP bound, that plan is the answer (the brute-force optimum, within the gap) and HiGHS' MIP
    never runs; the least-memory model likewise."""
    c = case(name)

    def no_mip(self: solve_module.BudgetILP, highs: object, budget: float, *, planned: bool) -> None:
        raise AssertionError("the MIP ran although its relaxation proves the answer")

    monkeypatch.setattr(solve_module.BudgetILP, "_run_mip", no_mip)
    settings = SolverSettings(relative_gap=1e-6)
    fastest = solve_module.BudgetILP(c.problem, "time", settings).run(float("inf"))
    assert fastest is not None and fastest.status == "optimal"
    assert fastest.evaluation.step_time == pytest.approx(float(c.time.min()), rel=1e-6, abs=_time_slack(c))
    least = solve_module.BudgetILP(c.problem, "memory", settings).run(float("inf"))
    assert least is not None and least.evaluation.peak_memory == pytest.approx(c.least_memory, rel=1e-6)


def test_a_slower_host_takes_the_same_path_to_the_same_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """No decision inside a solve is taken by the clock: the relaxations stop at an iteration
    count (solve.simplex_cap), the MIP that starts from a plan runs to its end. With every simplex
    iteration made 10 ms slower (a host many times slower, or loaded), a solve makes the same
    HiGHS runs, each with the same iterations and status, and gives the same plan. (With the
    relaxation stopped at 8e-5 s a column, 0.5 s at least, the first relaxation stopped at about
    its 50th iteration here and the MIP ran instead.)"""
    c = case("repeated/dp1xtp2")
    budget = between_pareto_budgets(c)[0]

    def path() -> tuple[list[tuple[object, ...]], dict[str, int]]:
        runs: list[tuple[object, ...]] = []
        real = solve_module.run_for

        def recording(highs: highspy.Highs, seconds: float) -> None:
            real(highs, seconds)
            info = highs.getInfo()
            runs.append((highs.getOptionValue("solve_relaxation")[1], highs.getModelStatus(), info.simplex_iteration_count, info.mip_node_count))

        with monkeypatch.context() as m:
            m.setattr(solve_module, "run_for", recording)
            plan = solve(c.problem, memory_budget=budget)
        return runs, plan.assignment

    quick = path()
    real_highs_of = solve_module.highs_of

    def slow_highs_of(*args: object, **kwargs: object) -> highspy.Highs:
        highs = real_highs_of(*args, **kwargs)  # type: ignore[arg-type]
        highs.setCallback(lambda *_: time.sleep(0.01), None)  # HiGHS calls it at each simplex iteration
        highs.startCallback(highspy.cb.HighsCallbackType.kCallbackSimplexInterrupt)
        return highs

    monkeypatch.setattr(solve_module, "highs_of", slow_highs_of)
    started = time.perf_counter()
    slow = path()
    assert time.perf_counter() - started > 0.5  # the slowing took: the old clock's cap would have bitten
    assert any(relaxation for relaxation, *_ in quick[0])
    assert slow == quick


def test_every_solve_gets_its_own_time_limit_although_highs_adds_up_its_runs() -> None:
    """HiGHS' time_limit bounds a solver's run clock summed over all its runs (a model solved many
    times ran out of time after its first solves); solve._run_for gives each run its own seconds."""
    c = case("two-linear/dp2xtp2")
    ilp = solve_module.BudgetILP(c.problem, "time", SolverSettings(time_limit_s=0.5))
    highs = ilp._highs()
    assert highs is not None
    for _ in range(100_000):  # the run clock past the time limit, as after many solves
        if highs.getRunTime() > 0.6:
            break
        highs.clearSolver()
        highs.run()
    highs.setOptionValue("solve_relaxation", True)  # an LP, which checks the clock from its start
    highs.setOptionValue("presolve", "off")
    highs.setOptionValue("time_limit", 0.5)
    highs.clearSolver()
    highs.run()
    assert highs.getModelStatus() == highspy.HighsModelStatus.kTimeLimit  # what plain runs did
    highs.clearSolver()
    backends.run_for(highs, 0.5)
    assert highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    highs.setOptionValue("solve_relaxation", False)
    budget = between_pareto_budgets(c)[0]
    sol = ilp.run(budget)  # a budgeted MIP on that solver
    assert sol is not None and sol.status == "optimal"
    assert sol.evaluation.step_time == pytest.approx(c.fastest_within(budget), rel=1e-6, abs=_time_slack(c))


def test_importing_the_planner_keeps_no_caller_frames_alive() -> None:
    """PuLP stores the ImportError of every solver it cannot load; with its traceback that held
    each frame up the first import of the planner, and their locals (a function that compiled a
    plan kept its module alive). planner.backends imports PuLP only for CBC, and drops those tracebacks."""
    import sys

    backends._pulp()

    kept = [
        f"{name}.{cls.__name__}"
        for name, module in list(sys.modules.items()) if name == "pulp" or name.startswith("pulp.")
        for cls in list(vars(module).values()) if isinstance(cls, type) and isinstance(getattr(cls, "err", None), BaseException)
        if cls.err.__traceback__ is not None
    ]
    assert not kept, kept
