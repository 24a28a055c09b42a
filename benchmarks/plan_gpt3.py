"""Planning time and size at GPT-3 scale (a script that prints figures, not a timed test).

    python benchmarks/plan_gpt3.py [--model gpt3-175b] [--devices 64] [--batch 8] [--memory 80GiB]

Prints: trace time and peak resident memory of the process (the model lives on the meta device:
no weight is allocated), then per mesh the problem size (groups, choices, conversion and hold
terms), ILP size, build and solve times, and the plan's step time and memory, and the total.
"""

from __future__ import annotations

import argparse
import resource
import time

from planner.config import SearchConfig
from planner.hardware import load_profile
from planner.models import build_model, example_inputs
from planner.problem import build_problem
from planner.solve import InfeasibleBudget, solve
from planner.space import candidate_meshes
from planner.trace import trace
from planner.units import parse_bytes


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt3-175b")
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--memory", type=parse_bytes, default=None)
    p.add_argument("--hardware", default="a100-80g")
    a = p.parse_args()
    hw = load_profile(a.hardware)
    budget = a.memory or hw.device_memory
    t_all = time.perf_counter()
    t0 = time.perf_counter()
    model = build_model(a.model, device="meta")
    args, kwargs = example_inputs(a.model, batch=a.batch, device="meta")
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = trace(model, args, kwargs)
    t_trace = time.perf_counter() - t0
    print(f"{a.model}, batch {a.batch}: {graph.summary()}")
    print(f"model built on meta in {t_build:.2f} s; traced in {t_trace:.2f} s {graph.timings}; peak RSS so far {rss_gib():.2f} GiB")
    print(f"planning for {a.devices} devices on {hw.name}, budget {budget / 2**30:.1f} GiB/device")
    print(f"{'mesh':<14} {'groups':>6} {'choices':>7} {'conv':>6} {'hold':>5} {'vars':>6} {'cons':>6} {'build s':>8} {'solve s':>8}  result")
    for cand in candidate_meshes(SearchConfig(devices=a.devices), a.batch):
        if cand.reason:
            print(f"{cand.mesh!s:<14} pruned: {cand.reason}")
            continue
        t0 = time.perf_counter()
        problem = build_problem(graph, cand.mesh, hw)
        t_problem = time.perf_counter() - t0
        sizes = f"{len(problem.groups):>6} {problem.num_choices:>7} {len(problem.conversions):>6} {len(problem.holds):>5}"
        try:
            sol = solve(problem, memory_budget=budget)
            ev = sol.evaluation
            outcome = f"{sol.status}: {ev.step_time:.3f} s/step, {ev.peak_memory / 2**30:.2f} GiB"
            print(f"{cand.mesh!s:<14} {sizes} {sol.num_variables:>6} {sol.num_constraints:>6} {t_problem + sol.build_seconds:>8.2f} {sol.solve_seconds:>8.2f}  {outcome}")
        except InfeasibleBudget as exc:
            least = exc.least.peak_memory / 2**30 if exc.least else float("nan")
            print(f"{cand.mesh!s:<14} {sizes} {'':>6} {'':>6} {t_problem:>8.2f} {'':>8}  infeasible: least memory {least:.2f} GiB")
    print(f"total planning time (build, trace, all meshes): {time.perf_counter() - t_all:.2f} s; peak RSS {rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()
