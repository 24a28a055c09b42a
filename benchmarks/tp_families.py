"""1-D vs 2-D vs 3-D tensor parallelism at scale, as the planner prices them (figures, not a test).

    python benchmarks/tp_families.py [--models gpt3-13b,gpt3-175b] [--devices 8,64,512,4096]
                                     [--hardware a100-80g,v100-16g] [--dp 1] [--batch 8]

For each model, device count and hardware: the best plan of each family (pure tensor
parallelism with --dp 1, as Bian et al. compare them; any dp x tp otherwise), its per-device
communication per transformer layer (ring bytes), predicted step time and memory, and the family
the ILP picks when all are allowed. A family that cannot tile the devices (2-D needs q^2 devices,
3-D q^3) or does not fit in memory says so.
"""

from __future__ import annotations

import argparse
import time

from planner.config import SearchConfig
from planner.hardware import load_profile
from planner.models import build_model, example_inputs
from planner.problem import build_problem, layer_volume
from planner.solve import InfeasibleBudget, SolverSettings, solve
from planner.space import candidate_meshes
from planner.trace import trace
from planner.units import format_bytes, format_seconds


def best(graph, devices: int, family: str, hw, dp: int | None, settings: SolverSettings):  # type: ignore[no-untyped-def]
    batch = graph.nodes[graph.input_names[0]].out.shape[0]
    found = None
    least = None
    try:
        config = SearchConfig(devices=devices, tp=(family,), dp=dp)
    except ValueError:  # no mesh of the family tiles the devices with this dp (2-D on 8 with dp = 1)
        return None, None
    for cand in candidate_meshes(config, batch):
        if cand.reason:
            continue
        problem = build_problem(graph, cand.mesh, hw)
        try:
            sol = solve(problem, memory_budget=hw.device_memory, settings=settings)
        except InfeasibleBudget as exc:
            if exc.least is not None and (least is None or exc.least.peak_memory < least):
                least = exc.least.peak_memory
            continue
        if found is None or sol.evaluation.step_time < found[1].evaluation.step_time:
            found = (cand.mesh, sol, layer_volume(problem, sol.assignment))
    return found, least


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt3-13b,gpt3-175b")
    p.add_argument("--devices", default="8,64,512,4096")
    p.add_argument("--hardware", default="a100-80g,v100-16g")
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1: pure tensor parallelism); 0: any")
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args()
    settings = SolverSettings(time_limit_s=60, relative_gap=1e-4)
    for model_name in a.models.split(","):
        model = build_model(model_name, device="meta")
        args, kwargs = example_inputs(model_name, batch=a.batch, device="meta")
        graph = trace(model, args, kwargs)
        print(f"\n== {model_name}, batch {a.batch} x {args[0].shape[1]} tokens: {graph.summary()}")
        for hw_name in a.hardware.split(","):
            hw = load_profile(hw_name)
            for devices in (int(d) for d in a.devices.split(",")):
                t0 = time.perf_counter()
                rows = {}
                for family in ("1d", "2d", "3d"):
                    rows[family] = best(graph, devices, family, hw, a.dp or None, settings)
                fits = {f: r[0] for f, r in rows.items() if r[0] is not None}
                pick = min(fits, key=lambda f: fits[f][1].evaluation.step_time) if fits else "none fits"
                print(f"{hw.name:<9} {devices:>5} devices (ILP picks {pick}; {time.perf_counter() - t0:.1f} s to plan all families)")
                for family, (found, least) in rows.items():
                    if found is None:
                        why = f"needs {format_bytes(least)}/device" if least else "no mesh of this family for these devices/batch"
                        print(f"    {family}: -- {why}")
                        continue
                    mesh, sol, vol = found
                    ev = sol.evaluation
                    print(
                        f"    {family}: {mesh!s:<26} comm/layer {format_bytes(vol):>11}  step {format_seconds(ev.step_time):>10}"
                        f"  (comm {format_seconds(ev.comm_time)})  memory {format_bytes(ev.peak_memory)}  [{sol.status}]"
                    )


if __name__ == "__main__":
    main()
