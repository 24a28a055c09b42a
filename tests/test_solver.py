"""Specification of :func:`planner.solve.solve`: the ILP returns the optimum.

Each case is a traced model small enough in *strategy count* to enumerate every assignment: the
brute force evaluates each with :func:`planner.problem.evaluate` and takes the fastest plan within
the memory budget (or the least memory). The solver must agree.

Two kinds of case:

* ``wide-*`` / ``repeated-*`` models live on the meta device with realistic widths, so their
  memory is a sizeable fraction of a GiB (the scale the ILP's GiB-denominated memory rows were
  written for);
* ``mlp-tiny`` and ``two-linear`` are a few KiB per device: the memory rows' coefficients are
  ~1e-7..1e-5 GiB, at HiGHS's feasibility tolerances. Several specifications fail there (see the
  xfail reasons), and ``test_*_with_tight_solver_tolerances`` shows the formulation itself is right.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np
import pulp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import planner.solve as solve_module
from models import build_model, example_inputs
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.problem import Problem, build_problem, evaluate
from planner.solve import EPS_PER_GIB, GIB, InfeasibleBudget, solve
from planner.trace import trace

REL = 1e-9

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
        return trace(model, _meta_inputs(64, 4096))
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

    def memory_bound(self) -> float:
        """An upper bound on the ILP's memory expression (bytes): every term at its largest."""
        p = self.problem
        return (
            sum(max(g.memory) for g in p.groups.values())
            + sum(h.nbytes for h in p.holds.values())
            + max(max(g.transient) for g in p.groups.values())
        )


CASES = {
    "mlp-tiny/dp1xtp2": ("mlp-tiny", Mesh(("dp", "tp"), (1, 2))),
    "two-linear/dp2xtp2": ("two-linear", Mesh(("dp", "tp"), (2, 2))),
    "wide-two-linear/dp2xtp2": ("wide-two-linear", Mesh(("dp", "tp"), (2, 2))),
    "repeated/dp1xtp2": ("repeated", Mesh(("dp", "tp"), (1, 2))),
}
TINY = ("mlp-tiny/dp1xtp2", "two-linear/dp2xtp2")
LARGE = ("wide-two-linear/dp2xtp2", "repeated/dp1xtp2")


@functools.cache
def case(name: str) -> Case:
    model, mesh = CASES[name]
    problem = build_problem(_graph(model), mesh, A100_80G)
    keys = tuple(problem.groups)
    sizes = tuple(len(problem.groups[k].strategies) for k in keys)
    assert math.prod(sizes) <= 50_000, sizes
    times, mems = [], []
    for combo in itertools.product(*(range(n) for n in sizes)):
        ev = evaluate(problem, dict(zip(keys, combo, strict=True)))
        times.append(ev.step_time)
        mems.append(ev.peak_memory)
    return Case(problem, keys, sizes, np.array(times), np.array(mems))


def _time_slack(c: Case) -> float:
    """How much slower than the fastest plan the ILP may go: its memory tiebreak (solve.py)."""
    return EPS_PER_GIB * (float(c.memory.max()) - c.least_memory) / GIB


def between_pareto_budgets(c: Case, min_gap: float = 0.0) -> list[float]:
    """Budgets half-way between consecutive Pareto memories at least ``min_gap`` bytes apart
    (binding, away from any plan's exact memory), plus the largest memory any plan needs."""
    front = c.pareto()
    mids = [(a[0] + b[0]) / 2 for a, b in itertools.pairwise(front) if b[0] - a[0] >= min_gap]
    return [*mids, float(c.memory.max())]


# Pareto plans of the large cases can differ by a few hundred bytes (a bias, a label tensor);
# budgets between those are inside the solver's tolerance (see EXACT_BUDGET_BUG), so the binding
# budget test on them keeps to gaps of at least this much.
LARGE_GAP = 64 * 1024


def _xfail_tiny(reason: str) -> list:
    return [
        pytest.param(n, marks=pytest.mark.xfail(reason=reason, strict=True)) if n in TINY else n for n in CASES
    ]


TOLERANCE_BUG = (
    "planner/solve.py: memory rows are in GiB, so a KiB-sized problem has coefficients ~1e-7 GiB, "
    "inside HiGHS's default mip_feasibility_tolerance (1e-6): the transient bound and the budget row "
    "are violated 'within tolerance' and evaluate() of the answer exceeds the budget"
)


def _assert_fastest_within(c: Case, budget: float, **kwargs) -> None:
    sol = solve(c.problem, memory_budget=budget, **kwargs)
    best = c.fastest_within(budget)
    ev = sol.evaluation
    assert ev.peak_memory <= budget, f"budget {budget:.0f} B, plan needs {ev.peak_memory:.0f} B"
    assert ev.step_time >= best * (1 - REL)  # the plan fits, so brute force cannot be beaten
    assert ev.step_time <= best * (1 + REL) + _time_slack(c), f"budget {budget:.0f}: {ev.step_time} vs {best}"


# --------------------------------------------------------------------------- sanity of the cases


def test_brute_force_cases_are_small_and_have_memory_time_tradeoffs() -> None:
    for name in CASES:
        c = case(name)
        assert 1_000 <= c.time.size <= 50_000
        assert len(c.pareto()) >= 3, name  # at least two binding budgets to probe
    assert case("repeated/dp1xtp2").problem.groups["linear"].count == 3  # shared blocks


# --------------------------------------------------------------------------- time objective


@pytest.mark.parametrize("name", list(CASES))
def test_unbounded_budget_gives_the_bruteforce_fastest_plan(name: str) -> None:
    c = case(name)
    sol = solve(c.problem, memory_budget=float("inf"))
    assert sol.status == "optimal"
    best = float(c.time.min())
    assert sol.evaluation.step_time == pytest.approx(best, rel=REL, abs=_time_slack(c))


@pytest.mark.parametrize("name", _xfail_tiny(TOLERANCE_BUG))
def test_binding_budgets_give_the_bruteforce_fastest_plan_that_fits(name: str) -> None:
    c = case(name)
    budgets = between_pareto_budgets(c, LARGE_GAP if name in LARGE else 0.0)
    assert len(budgets) >= 2  # at least one really binding budget
    for budget in budgets:
        _assert_fastest_within(c, budget)


@pytest.mark.parametrize("name", list(LARGE))
def test_a_budget_half_way_from_the_least_memory_to_the_fastest_plan_gives_the_bruteforce_fastest(name: str) -> None:
    c = case(name)
    fastest = float(c.time.min())
    fastest_memory = float(c.memory[c.time <= fastest * (1 + REL)].min())
    budget = (c.least_memory + fastest_memory) / 2
    assert c.fastest_within(budget) > fastest  # binding
    _assert_fastest_within(c, budget)


EXACT_BUDGET_BUG = (
    "planner/solve.py: the budget row 'M <= budget / GiB' is only enforced to HiGHS's "
    "mip_feasibility_tolerance (1e-6 GiB ~ 1 KiB): with the budget equal to a plan's exact peak "
    "memory the solver returns a faster plan that is up to ~1 KiB over the budget"
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=EXACT_BUDGET_BUG, strict=True))
        if n in ("wide-two-linear/dp2xtp2", *TINY)
        else n
        for n in CASES
    ],
)
def test_a_budget_equal_to_a_pareto_plans_exact_memory_is_never_exceeded(name: str) -> None:
    c = case(name)
    for memory, _ in c.pareto():
        _assert_fastest_within(c, memory)


@pytest.mark.parametrize("name", list(CASES))
def test_time_objective_is_step_time_plus_the_memory_tiebreak(name: str) -> None:
    c = case(name)
    for budget in (float("inf"), float(c.memory.max())):
        sol = solve(c.problem, memory_budget=budget)
        t = sol.evaluation.step_time
        # objective = time + EPS * M, with M (GiB) between the plan's memory (less the solver's
        # feasibility tolerance) and every memory term at its largest (slack y/z stay unpushed).
        assert sol.objective >= t * (1 - REL) + EPS_PER_GIB * (sol.evaluation.peak_memory / GIB - 1e-6)
        assert sol.objective <= t * (1 + REL) + EPS_PER_GIB * c.memory_bound() / GIB


# --------------------------------------------------------------------------- memory objective


MIN_MEMORY_BUG = (
    "planner/solve.py: with objective='memory' the transient variable T is left at 0 because every "
    "transient row coefficient (<= ~9e-7 GiB) is inside HiGHS's mip_feasibility_tolerance; two-linear "
    "on dp=2 x tp=2 gets a 4100 B plan while 2265 B is achievable"
)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=MIN_MEMORY_BUG, strict=True)) if n == "two-linear/dp2xtp2" else n
        for n in CASES
    ],
)
def test_memory_objective_finds_the_bruteforce_least_memory(name: str) -> None:
    c = case(name)
    sol = solve(c.problem, memory_budget=float("inf"), objective="memory")
    assert sol.evaluation.peak_memory == pytest.approx(c.least_memory, rel=REL)


# --------------------------------------------------------------------------- infeasible budgets


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=MIN_MEMORY_BUG, strict=True)) if n == "two-linear/dp2xtp2" else n
        for n in CASES
    ],
)
def test_infeasible_budget_raises_with_the_least_memory_plan(name: str) -> None:
    c = case(name)
    budget = c.least_memory / 2
    with pytest.raises(InfeasibleBudget) as info:
        solve(c.problem, memory_budget=budget)
    err = info.value
    assert err.budget == budget
    assert err.least is not None
    assert err.least.peak_memory == pytest.approx(c.least_memory, rel=REL)


@pytest.mark.parametrize("name", list(LARGE))
def test_infeasible_budget_message_quotes_the_gib_numbers(name: str) -> None:
    c = case(name)
    budget = c.least_memory / 2
    with pytest.raises(InfeasibleBudget) as info:
        solve(c.problem, memory_budget=budget)
    message = str(info.value)
    least = c.least_memory / GIB
    assert f"fits {budget / GIB:.2f} GiB per device" in message
    assert f"the least any plan needs is {least:.2f} GiB" in message
    assert f"{least - budget / GIB:.2f} GiB over" in message
    assert str(c.problem.mesh) in message
    assert least >= 0.1  # the numbers are informative at this scale


@pytest.mark.parametrize("name", _xfail_tiny(TOLERANCE_BUG))
def test_a_budget_one_percent_below_the_least_memory_is_infeasible(name: str) -> None:
    c = case(name)
    with pytest.raises(InfeasibleBudget):
        solve(c.problem, memory_budget=c.least_memory * 0.99)


# --------------------------------------------------------------------------- root cause


@pytest.fixture
def tight_tolerances(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS with feasibility tolerances far below the smallest memory coefficient and no
    absolute optimality gap (HiGHS's default mip_abs_gap is 1e-6, i.e. 1 us of step time)."""

    def _solver(settings: solve_module.SolverSettings) -> pulp.LpSolver:
        return pulp.HiGHS(
            msg=False,
            gapRel=settings.relative_gap,
            gapAbs=0.0,
            threads=settings.threads,
            timeLimit=settings.time_limit_s,
            mip_feasibility_tolerance=1e-10,
            primal_feasibility_tolerance=1e-10,
        )

    monkeypatch.setattr(solve_module, "_solver", _solver)


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_problems_match_brute_force_with_tight_solver_tolerances(name: str, tight_tolerances: None) -> None:
    c = case(name)
    for budget in between_pareto_budgets(c):
        _assert_fastest_within(c, budget)
    sol = solve(c.problem, memory_budget=float("inf"), objective="memory")
    assert sol.evaluation.peak_memory == pytest.approx(c.least_memory, rel=REL)
    with pytest.raises(InfeasibleBudget) as info:
        solve(c.problem, memory_budget=c.least_memory * 0.99)
    assert info.value.least is not None
    assert info.value.least.peak_memory == pytest.approx(c.least_memory, rel=REL)
