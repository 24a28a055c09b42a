"""How fast the search is at GPT-3 scale: the full front, one plan for a budget, 4096 devices.

    python benchmarks/front_speed.py [--scenario NAME ...] [--workers N] [--gap G]

Each scenario traces a preset on the meta device (no memory for weights), then runs
:func:`planner.search.search` and prints, per scenario: trace and search seconds, configurations
solved / dismissed by bounds or dominance / infeasible / pruned, front points, and the largest ILP
(variables, constraints) among the plans found. The issue's targets, on a 2-core CPU: the
``gpt3-175b`` front for 64 devices under 30 s, one best plan for a budget under 5 s, 4096 devices
under 2 minutes.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from planner.cli import load_model
from planner.config import SearchConfig
from planner.search import search
from planner.trace import trace


@dataclass(frozen=True)
class Scenario:
    model: str
    devices: int
    batch: int
    front: bool
    zero: tuple[int, ...] = (0, 1, 2, 3)
    cdp: tuple[str, ...] = ("off",)


SCENARIOS = {
    "175b-64-front": Scenario("gpt3-175b", 64, 8, front=True),
    "175b-64-best": Scenario("gpt3-175b", 64, 8, front=False),
    "175b-4096-best": Scenario("gpt3-175b", 4096, 1024, front=False, zero=(1, 3)),
    "13b-64-front": Scenario("gpt3-13b", 64, 8, front=True, zero=(0, 1)),
}


def run(name: str, sc: Scenario, workers: int | None, gap: float | None = None) -> list[str]:
    model, args, kwargs, _ = load_model(sc.model, sc.batch)
    t0 = time.perf_counter()
    graph = trace(model, args, kwargs)
    trace_s = time.perf_counter() - t0
    gaps = {"relative_gap": gap} if gap is not None else {}
    config = SearchConfig(devices=sc.devices, zero=sc.zero, cdp=sc.cdp, hardware="a100-80g", front=sc.front, **gaps)
    result = search(graph, config, model_name=sc.model, workers=workers)
    cands = result.candidates
    solved = sum(1 for c in cands if c.front)
    dominated = sum(1 for c in cands if c.reason.startswith("dominated"))
    bounded = sum(1 for c in cands if c.least_is_bound)
    infeasible = sum(1 for c in cands if c.least_memory is not None and not c.least_is_bound and not c.front and not c.reason.startswith("dominated"))
    pruned = len(cands) - solved - dominated - bounded - infeasible
    plans = result.feasible
    big = max(plans, key=lambda p: p.solver.num_variables, default=None)
    size = f"{big.solver.num_variables} x {big.solver.num_constraints}" if big else "-"
    limited = sum(1 for p in plans if p.solver.status != "optimal")
    best = result.best
    chosen = f"{best.step_time_s:.3f} s, {best.peak_memory_bytes / 2**30:.1f} GiB ({' x '.join(f'{a}={d}' for a, d in best.mesh.items())} ZeRO-{best.zero_stage})" if best else "none fits"
    return [name, f"{trace_s:.1f}", f"{result.seconds:.1f}", f"{solved}/{dominated}/{bounded}/{infeasible}/{pruned}", str(len(result.front)),
            size, str(limited), chosen]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: the search's)")
    parser.add_argument("--gap", type=float, default=None, help="the MIPs' relative gap (default: SolverSettings')")
    a = parser.parse_args()
    header = ["scenario", "trace s", "search s", "solved/dominated/bound/infeasible/pruned", "front", "largest ILP (vars x rows)",
              "time-limited", "chosen (objective time)"]
    rows = []
    for name in a.scenario:
        rows.append(run(name, SCENARIOS[name], a.workers, a.gap))
        print("  ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
