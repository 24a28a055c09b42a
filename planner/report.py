"""Readable reports of a search and of one plan (plain text; the CLI adds nothing but printing).

Also the JSON document ``planner report --json`` prints: a ``pareto`` array of the
non-dominated (step time, memory per device) plans among the configurations searched, each with
``step_time_s``, ``peak_memory_bytes``, ``memory_breakdown``, ``mesh``, ``tp``, ``zero_stage``,
``cdp``, and a ``candidates`` array saying what happened to every configuration.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from planner.hardware import HardwareProfile
from planner.ir import IRGraph
from planner.plan import Plan
from planner.search import SearchResult
from planner.units import format_bytes, format_seconds


def pareto(plans: list[Plan]) -> list[Plan]:
    """Plans not dominated in (step time, peak memory), fastest first."""
    front: list[Plan] = []
    for p in sorted(plans, key=lambda p: (p.step_time_s, p.peak_memory_bytes)):
        if not front or p.peak_memory_bytes < front[-1].peak_memory_bytes:
            front.append(p)
    return front


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def format_search(
    result: SearchResult,
    *,
    model_name: str,
    devices: int,
    hardware: HardwareProfile,
    trace_seconds: float,
    graph: IRGraph | None = None,
) -> str:
    out = [f"planner report: {model_name} on {devices} devices, hardware {hardware.name}"]
    if graph is not None:
        shapes = ", ".join(str(list(graph.nodes[n].out.shape)) for n in graph.input_names)
        out.append(f"model: {graph.summary()}; inputs {shapes}")
    out.append(f"searched {len(result.candidates)} configurations in {result.seconds:.2f} s (trace {trace_seconds:.2f} s)")
    rows = []
    front = {id(p) for p in pareto(result.feasible)}
    for c in result.candidates:
        if c.plan is not None:
            p = c.plan
            mark = "best" if p is result.best else ("pareto" if id(p) in front else "")
            rows.append([str(c.mesh), p.tp, str(p.zero_stage), p.cdp, format_seconds(p.step_time_s), format_bytes(p.peak_memory_bytes), p.solver.status, mark])
        else:
            need = f"needs {format_bytes(c.least_memory)}" if c.least_memory is not None else "-"
            reason = "infeasible" if c.least_memory is not None else "pruned"
            rows.append([str(c.mesh), c.family, str(c.zero), c.cdp, "-", need, reason, ""])
    out.append("")
    out.append(_table(rows, ["mesh", "tp", "zero", "cdp", "step time", "memory/device", "status", ""]))
    pruned = [c for c in result.candidates if c.plan is None]
    if pruned:
        out.append("")
        out += [f"  {c.mesh}" + (f" CDP {c.cdp}" if c.cdp != "off" else "") + f": {c.reason}" for c in pruned]
    if result.pipelines:
        out.append("")
        out.append(f"CDP with stages on different devices (analytic estimate, not searched by the ILP; runtime.cdp.CDPPipeline runs it), "
                   f"N = {result.pipelines[0].workers} micro-batches:")
        prow = [[str(e.stages), str(e.devices), str(e.dp_mp_devices), format_bytes(e.peak_memory), format_seconds(e.step_time)] for e in result.pipelines]
        out.append(_table(prow, ["stages", "devices", "DP x MP would need", "memory/device", "step time"]))
    out.append("")
    if result.best is None:
        out.append("No configuration fits the memory budget (see above for the least memory each needs).")
    else:
        out.append(format_plan(result.best, graph=graph))
    return "\n".join(out)


def format_plan(plan: Plan, *, graph: IRGraph | None = None) -> str:
    mesh = " x ".join(f"{a}={d}" for a, d in plan.mesh.items())
    m = plan.memory_breakdown
    cdp = []
    if plan.cdp != "off":
        cdp = [
            f"  CDP {plan.cdp}, {plan.cdp_stages} stages: the data-parallel workers run staggered and sum each stage's gradient "
            "along a point-to-point chain (2(N-1) messages per stage, overlapping compute) instead of an all-reduce; "
            + ("the update uses the previous step's gradient" if plan.cdp == "v1" else "workers use the newest parameters on the stages already updated, the previous version elsewhere")
            + " (a one-step gradient delay), and holds "
            + ("the delayed gradient" if plan.cdp == "v1" else "a second parameter version")
            + ". Run it with runtime.cdp.CDPTrainer.",
        ]
    lines = [
        f"Plan: mesh {mesh}, tensor parallelism {plan.tp}, ZeRO {plan.zero_stage}, CDP {plan.cdp}, optimizer {plan.optimizer}"
        + (f" (master weights {plan.master_dtype})" if plan.master_dtype else ""),
        f"  predicted step time {format_seconds(plan.step_time_s)}: compute {format_seconds(plan.compute_time_s)}, communication {format_seconds(plan.comm_time_s)} "
        + (f"({format_seconds(plan.overlap_time_s)} of it hidden behind compute by {'CDP' if plan.cdp != 'off' else 'ZeRO-3 prefetch'})"
           if plan.overlap_time_s else "(not overlapped)"),
        f"  memory per device {format_bytes(plan.peak_memory_bytes)} of {format_bytes(plan.memory_budget_bytes) if plan.memory_budget_bytes else 'no budget'}: "
        f"params {format_bytes(m.params)}, grads {format_bytes(m.grads)}, optimizer {format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}, transient {format_bytes(m.transient)}",
        *cdp,
        f"  solver: {plan.solver.status} ({plan.solver.backend}, {plan.solver.num_variables} variables, {plan.solver.num_constraints} constraints, "
        f"build {plan.solver.build_s:.2f} s, solve {plan.solver.solve_s:.2f} s)",
        "",
        "Strategies (one line per distinct node; repeated layers once):",
    ]
    lines += _strategy_lines(plan, graph)
    lines.append("")
    lines.append("Collectives per device per step:")
    by_phase: dict[str, list[str]] = defaultdict(list)
    for c in plan.comms:
        by_phase[c.phase].append(f"{c.count} x {c.kind}({','.join(c.axes)}) {format_bytes(c.nbytes)}")
    for phase in ("fwd", "bwd", "step"):
        if by_phase[phase]:
            lines.append(f"  {phase}: " + "; ".join(by_phase[phase]))
    if not plan.comms:
        lines.append("  none")
    if plan.fallbacks:
        lines.append("")
        lines.append(f"Replicated because no sharding rule covers the op ({len(plan.fallbacks)}): " + ", ".join(plan.fallbacks[:12]) + (" ..." if len(plan.fallbacks) > 12 else ""))
    return "\n".join(lines)


def _strategy_lines(plan: Plan, graph: IRGraph | None) -> list[str]:
    templates: dict[str, str] = {}
    counts: Counter[str] = Counter()
    paths: dict[str, str] = {}
    if graph is not None:
        for n in graph.nodes.values():
            templates[n.name] = n.template
            counts[n.template] += 1
            paths[n.name] = n.module_path
    lines = []
    for node in plan.nodes:
        if node.target == "placeholder" or node.algorithm in ("follow",):
            continue
        if templates.get(node.name, node.name) != node.name:
            continue
        times = counts.get(node.name, 1)
        rep = f" x{times}" if times > 1 else ""
        where = paths.get(node.name, "")
        lines.append(f"  {node.name:<32} {node.target.removeprefix('aten.'):<44} {node.algorithm:<24} {where}{rep}")
    return lines


def search_json(result: SearchResult, *, model_name: str, devices: int, hardware: HardwareProfile) -> dict[str, Any]:
    def entry(p: Plan) -> dict[str, Any]:
        return {
            "step_time_s": p.step_time_s,
            "peak_memory_bytes": p.peak_memory_bytes,
            "memory_breakdown": p.memory_breakdown.model_dump(),
            "mesh": dict(p.mesh),
            "tp": p.tp,
            "zero_stage": p.zero_stage,
            "cdp": p.cdp,
            "compute_time_s": p.compute_time_s,
            "comm_time_s": p.comm_time_s,
            "solver_status": p.solver.status,
            "best": p is result.best,
        }

    return {
        "model": model_name,
        "devices": devices,
        "hardware": hardware.name,
        "search_seconds": result.seconds,
        "pareto": [entry(p) for p in pareto(result.feasible)],
        "candidates": [
            {"mesh": c.mesh.as_dict(), "tp": c.family, "zero_stage": c.zero, "cdp": c.cdp, "feasible": c.plan is not None, "reason": c.reason,
             "least_memory_bytes": c.least_memory}
            for c in result.candidates
        ],
    }
