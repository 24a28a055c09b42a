r"""The ILP that picks one strategy per group (PuLP; HiGHS by default, CBC as the fallback).

Sets: groups ``g`` (anchors, shared across repeated layers) with strategies ``i``; conversion
terms ``c`` (a producer Spec turned into a consumer Spec, see :mod:`planner.problem`); hold terms
``h`` (a tensor saved for backward in one sharding); nodes ``n`` with a transient working set.

Variables:
    x[g,i] in {0,1}   strategy i chosen for group g
    y[c]   in [0,1]   conversion c is executed   (integral at the optimum: it is pushed down)
    z[h]   in [0,1]   tensor h is held
    T      >= 0       the largest transient working set

Minimise   sum_{g,i} time[g,i] x[g,i] + sum_c cost[c] y[c] + eps * M
where      M = sum_{g,i} mem[g,i] x[g,i] + sum_h bytes[h] z[h] + T   (GiB per device)

subject to (each family is one function below; constraints carry their family's name)
    one_strategy:  sum_i x[g,i] = 1                                     for every g
    conversion:    y[c] >= sum_{i in I} x[gu,i] + sum_{j in J} x[gv,j] - 1
                   for every (producer group gu, its strategies I whose output is S;
                   consumer group gv, its strategies J that need T) of term c;
                   when gu = gv the pair collapses to y[c] >= sum_{i in I and J} x[gu,i]
    hold:          z[h] >= sum_{j in J} x[gv,j]       (or the pair form, for gathered weights)
    transient:     T >= sum_i transient[g,i] x[g,i]                     for every g
    memory_budget: M <= budget

``eps`` (1e-9 s per GiB) only breaks ties between equally fast plans in favour of less
memory. Time and memory of the answer are re-computed exactly by
:func:`planner.problem.evaluate`, not read off the relaxed y/z.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import pulp

from planner.problem import Evaluation, Problem, evaluate

log = logging.getLogger(__name__)

EPS_PER_GIB = 1e-9  # seconds per GiB: ties go to the plan with less memory
GIB = float(1024**3)  # memory enters the model in GiB, keeping coefficients near 1
Status = Literal["optimal", "time_limit", "infeasible"]


@dataclass(frozen=True, kw_only=True)
class SolverSettings:
    backend: Literal["highs", "cbc"] = "highs"
    time_limit_s: float = 120.0
    relative_gap: float = 1e-6
    threads: int = 1


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


class _Model:
    def __init__(self, problem: Problem, name: str) -> None:
        self.problem = problem
        self.lp = pulp.LpProblem(name, pulp.LpMinimize)
        self.gid = {g: k for k, g in enumerate(problem.groups)}
        lp = self.lp
        self.x = {
            g: [lp.add_variable(f"x_{self.gid[g]}_{i}", 0, 1, cat="Binary") for i in range(len(grp.strategies))]
            for g, grp in problem.groups.items()
        }
        self.y = {key: lp.add_variable(f"y_{k}", 0, 1) for k, key in enumerate(problem.conversions)}
        self.z = {key: lp.add_variable(f"z_{k}", 0, 1) for k, key in enumerate(problem.holds)}
        self.transient = lp.add_variable("transient", 0)
        self.one_strategy()
        self.conversion()
        self.hold()
        self.transient_bound()

    def time_expr(self) -> pulp.LpAffineExpression:
        p = self.problem
        terms = [(v, grp.time[i]) for g, grp in p.groups.items() for i, v in enumerate(self.x[g]) if grp.time[i]]
        terms += [(self.y[key], term.cost) for key, term in p.conversions.items() if term.cost]
        return pulp.LpAffineExpression(terms)

    def memory_expr(self) -> pulp.LpAffineExpression:
        p = self.problem
        terms = [(v, grp.memory[i] / GIB) for g, grp in p.groups.items() for i, v in enumerate(self.x[g]) if grp.memory[i]]
        terms += [(self.z[key], h.nbytes / GIB) for key, h in p.holds.items() if h.nbytes]
        terms.append((self.transient, 1.0))
        return pulp.LpAffineExpression(terms)

    def _sum(self, g: str, idx: frozenset[int]) -> pulp.LpAffineExpression:
        return pulp.lpSum(self.x[g][i] for i in idx)

    def one_strategy(self) -> None:
        for g, xs in self.x.items():
            self.lp += pulp.lpSum(xs) == 1, f"one_strategy_{self.gid[g]}"

    def conversion(self) -> None:
        for k, (key, term) in enumerate(self.problem.conversions.items()):
            for m, (gu, iu, gv, iv) in enumerate(term.conditions):
                if gu == gv:
                    rhs = self._sum(gu, iu & iv)
                else:
                    rhs = self._sum(gu, iu) + self._sum(gv, iv) - 1
                self.lp += self.y[key] >= rhs, f"conversion_{k}_{m}"

    def hold(self) -> None:
        for k, (key, term) in enumerate(self.problem.holds.items()):
            for m, (gu, iu, gv, iv) in enumerate(term.conditions):
                rhs = self._sum(gu, iu) if gv is None else self._sum(gu, iu) + self._sum(gv, iv) - 1
                self.lp += self.z[key] >= rhs, f"hold_{k}_{m}"

    def transient_bound(self) -> None:
        for g, grp in self.problem.groups.items():
            if any(grp.transient):
                expr = pulp.lpSum(t / GIB * v for t, v in zip(grp.transient, self.x[g], strict=True))
                self.lp += self.transient >= expr, f"transient_{self.gid[g]}"

    def memory_budget(self, budget: float) -> None:
        self.lp += self.memory_expr() <= budget / GIB, "memory_budget"

    def assignment(self) -> dict[str, int]:
        out = {}
        for g, xs in self.x.items():
            vals = [v.value() or 0.0 for v in xs]
            out[g] = max(range(len(vals)), key=vals.__getitem__)
        return out


def _solver(settings: SolverSettings) -> pulp.LpSolver:
    if settings.backend == "highs":
        solver = pulp.HiGHS(msg=False, timeLimit=settings.time_limit_s, gapRel=settings.relative_gap, threads=settings.threads)
        if solver.available():
            return solver
        log.warning("HiGHS (highspy) is not installed; falling back to CBC")
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=settings.time_limit_s, gapRel=settings.relative_gap, threads=settings.threads)


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
    """The fastest assignment (or the smallest, ``objective="memory"``) within the budget."""
    settings = settings or SolverSettings()
    t0 = time.perf_counter()
    model = _Model(problem, f"plan_{problem.mesh}".replace(" ", "").replace("=", "").replace("x", "_"))
    time_e, mem_e = model.time_expr(), model.memory_expr()
    model.lp += (time_e + EPS_PER_GIB * mem_e) if objective == "time" else (mem_e + 1e-6 * time_e)
    if objective == "time" and memory_budget != float("inf"):
        model.memory_budget(memory_budget)
    build = time.perf_counter() - t0
    solver = _solver(settings)
    t0 = time.perf_counter()
    with _quiet_stdout():
        model.lp.solve(solver)
    elapsed = time.perf_counter() - t0
    status_name = pulp.LpStatus[model.lp.status]
    if status_name in ("Infeasible", "Not Solved") or model.lp.sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound):
        if objective == "memory":
            raise RuntimeError(f"the memory-minimising ILP for mesh {problem.mesh} found no solution ({status_name})")
        least = solve(problem, memory_budget=float("inf"), objective="memory", settings=settings).evaluation
        raise InfeasibleBudget(_infeasible_message(problem, memory_budget, least), budget=memory_budget, least=least)
    status: Status = "optimal" if model.lp.sol_status == pulp.LpSolutionOptimal else "time_limit"
    assignment = model.assignment()
    evaluation = evaluate(problem, assignment)
    return Solution(
        assignment=assignment,
        status=status,
        evaluation=evaluation,
        objective=float(pulp.value(model.lp.objective) or 0.0),
        build_seconds=build,
        solve_seconds=elapsed,
        num_variables=model.lp.numVariables(),
        num_constraints=model.lp.numConstraints(),
        backend=type(solver).__name__,
    )


def _infeasible_message(problem: Problem, budget: float, least: Evaluation) -> str:
    gib = 1024**3
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in sorted(least.memory.items(), key=lambda kv: -kv[1]))
    return (
        f"no plan on mesh {problem.mesh} fits {budget / gib:.2f} GiB per device: the least any plan needs is "
        f"{least.peak_memory / gib:.2f} GiB ({parts} GiB), {(least.peak_memory - budget) / gib:.2f} GiB over. "
        "Use more devices (more tensor or data parallelism), a smaller micro-batch, or ZeRO/CDP once available."
    )
