"""The solvers an ILP's arrays (:class:`planner.ilp.Model`) are handed to, and what they report:
HiGHS through highspy (the backend :mod:`planner.solve` drives), CBC through PuLP (the second,
``SolverSettings(backend="cbc")``), and how a run ended (:class:`Outcome`).

What HiGHS really does here, measured (the reasons behind :func:`run_for` and :func:`quiet`):
its ``time_limit`` bounds a solver object's run clock summed over all its runs, and it prints a
banner on file descriptor 1 when its first instance is made, whatever its options.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Literal, NamedTuple

import highspy
import numpy as np

from planner.ilp import Model

FEASIBILITY_TOL = 1e-9  # HiGHS' defaults (1e-6, 1e-7) let memory rows slip by ~1 KiB on small models
Status = Literal["optimal", "time_limit", "infeasible"]


class Outcome(NamedTuple):
    status: Status | None  # None: no plan (infeasible, or stopped without one)
    values: np.ndarray | None  # the columns' values
    reason: str  # the solver's word for how it ended


def outcome(highs: highspy.Highs) -> Outcome:
    """How a HiGHS run ended: optimal (within the gap), stopped with a plan, or no plan."""
    status = highs.getModelStatus()
    word = highs.modelStatusToString(status)
    if status == highspy.HighsModelStatus.kOptimal:
        return Outcome("optimal", np.asarray(highs.getSolution().col_value), word)
    if highs.getInfo().primal_solution_status == 2 and status not in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
        return Outcome("time_limit", np.asarray(highs.getSolution().col_value), word)  # 2: feasible
    return Outcome(None, None, word)


def run_for(highs: highspy.Highs, seconds: float) -> None:
    """One run of ``highs``, stopped after ``seconds``. HiGHS' ``time_limit`` bounds the object's
    run clock, which adds up over all its runs (measured: three LPs of 3.3 s each, then a fourth
    with a 1 s limit stopped at once), so each run's limit is that clock plus its own seconds.
    (The MIP callback's ``running_time`` is per run.)"""
    highs.setOptionValue("time_limit", highs.getRunTime() + seconds)
    highs.run()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
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


def highs_of(lp: highspy.HighsLp, threads: int, options: dict[str, bool | str | float]) -> highspy.Highs:
    """A new HiGHS solver of ``lp``, silent, with ``threads``, this module's tolerances and ``options``."""
    with quiet():
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)  # before the model: passModel reports on its bounds
    status = highs.passModel(lp)
    assert status != highspy.HighsStatus.kError, "HiGHS refused the model"
    for key, value in {"threads": threads, "mip_feasibility_tolerance": FEASIBILITY_TOL,
                       "primal_feasibility_tolerance": FEASIBILITY_TOL, **options}.items():
        highs.setOptionValue(key, value)
    return highs


def run_cbc(model: Model, costs: np.ndarray, *, time_limit_s: float, threads: int, gap: float, absolute_gap: float) -> Outcome:
    """``model`` with objective ``costs`` through PuLP's CBC, from the arrays (the relaxation-only
    pair rows left out)."""
    pulp = _pulp()
    lp = model.lp
    problem = pulp.LpProblem(model.name, pulp.LpMinimize)
    binary = set(lp.binary)
    cols = [problem.add_variable(name, lo, None if hi == math.inf else hi, cat="Binary" if k in binary else "Continuous")
            for k, (name, lo, hi) in enumerate(zip(lp.names, lp.lower, lp.upper, strict=True))]
    problem.setObjective(pulp.LpAffineExpression([(cols[k], c) for k, c in enumerate(costs) if c]))
    skip = set(model.pair_rows)
    for r in range(lp.num_rows):
        if r in skip:
            continue
        lo, hi = lp.row_lower[r], lp.row_upper[r]
        if r == model.budget_row:
            lo, hi = -math.inf, model.budget_bound
        expr = pulp.LpAffineExpression([(cols[k], c) for k, c in lp.row_terms(r).items()])
        sense, rhs = (pulp.LpConstraintEQ, lo) if lo == hi else (pulp.LpConstraintGE, lo) if hi == math.inf else (pulp.LpConstraintLE, hi)
        problem.addConstraint(pulp.LpConstraint(expr, sense, lp.row_names[r], rhs))
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap, gapAbs=absolute_gap, threads=threads,
                               options=[f"primalTolerance {FEASIBILITY_TOL}", f"integerTolerance {FEASIBILITY_TOL}"])
    problem.solve(solver)
    if pulp.LpStatus[problem.status] in ("Infeasible", "Not Solved") or problem.sol_status in (pulp.LpSolutionInfeasible, pulp.LpSolutionNoSolutionFound):
        return Outcome(None, None, pulp.LpStatus[problem.status])
    values = np.array([v.value() or 0.0 for v in cols])
    return Outcome("optimal" if problem.sol_status == pulp.LpSolutionOptimal else "time_limit", values, pulp.LpStatus[problem.status])


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
