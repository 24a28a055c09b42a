"""Why this plan: ``planner explain`` for one point of the time/memory front.

For a point of the merged front (numbered from 1, fastest first, as ``planner report`` prints it;
by default the point the objective chose) :func:`explain` says

- the per-layer strategy and collectives (:func:`planner.report.format_plan`);
- where the step time goes: compute against communication (and what overlap hides), and the
  collectives that cost the most in total, each priced again by the alpha-beta model
  (:func:`planner.cost.comm_time`) on the plan's mesh and the hardware profile;
- where the memory goes: each term of the per-device peak with its share, and which phase sets the
  peak (:class:`planner.plan.MemoryBreakdown`);
- why the alternatives lost: the neighbouring front points (the faster one needs more memory, the
  smaller one is slower), and for every other TP family, ZeRO stage and CDP mode the search
  tried, its fastest plan (and its fastest within this point's memory), or why it has none.

Pure text from a :class:`planner.search.SearchResult`: nothing is solved again.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.cost import comm_time
from planner.hardware import HardwareProfile
from planner.ir import IRGraph
from planner.mesh import mesh_text
from planner.plan import CommRecord, Plan
from planner.report import candidate_status, format_plan, needs_text, point_marks, render
from planner.schemes.base import settings_of
from planner.schemes.registry import SCHEMES
from planner.search import SearchResult
from planner.space import Candidate
from planner.strategy import Comm
from planner.units import format_bytes, format_seconds

TOP_COLLECTIVES = 8


def select_point(result: SearchResult, point: int | None) -> tuple[int, Plan]:
    """The front point numbered ``point`` (from 1, fastest first), or the objective's choice.
    Raises ``ValueError`` saying what to change when the front is empty or ``point`` is out of range."""
    n = len(result.front)
    if not n or result.best is None:
        raise ValueError("nothing to explain: no plan fits the memory budget. " + (result.infeasible or "Raise --memory or add devices."))
    if point is None:
        return next(i for i, p in enumerate(result.front, start=1) if p is result.best), result.best
    if not 1 <= point <= n:
        raise ValueError(f"--point {point} is out of range: the front has {n} point{'s' if n > 1 else ''}, numbered 1 to {n} "
                         "(fastest first) in the table `planner report` prints")
    return point, result.front[point - 1]


def explain(result: SearchResult, hardware: HardwareProfile, *, point: int | None = None, graph: IRGraph | None = None) -> str:
    """The explanation of one front point (see the module docstring); ``graph`` groups repeated
    layers in the strategy listing."""
    index, plan = select_point(result, point)
    marks = point_marks(result, plan)
    header = (f"Point {index} of {len(result.front)} on the front" + (f" ({marks}; objective {result.objective})" if marks else "")
              + f": step time {format_seconds(plan.step_time_s)}, memory {format_bytes(plan.peak_memory_bytes)} per device, "
              f"mesh {mesh_text(plan.mesh)}, TP {plan.tp}" + "".join(f", {part}" for scheme in SCHEMES if (part := scheme.summary(plan))))
    return "\n\n".join([
        header,
        "== Strategy ==\n" + format_plan(plan, graph=graph),
        "== Where the time goes ==\n" + time_section(plan, hardware),
        "== Where the memory goes ==\n" + memory_section(plan),
        "== Why not the alternatives ==\n" + alternatives_section(result, index, plan),
    ])


# --------------------------------------------------------------------------- time


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def collective_seconds(record: CommRecord, plan: Plan, hardware: HardwareProfile) -> float | None:
    """Seconds one instance of ``record`` takes on the plan's mesh (alpha-beta ring model), or
    None for a kind the cost model has no formula for."""
    try:
        return comm_time(Comm(record.kind, record.axes, record.nbytes, record.phase, record.bucket_bytes), plan.mesh_obj, hardware)
    except ValueError:
        return None


def time_section(plan: Plan, hardware: HardwareProfile) -> str:
    """Compute vs communication, then the collectives costing most per step (count x each)."""
    step = plan.step_time_s
    lines = [
        f"  step time      {format_seconds(step)} = compute + communication - overlap",
        f"  compute        {format_seconds(plan.compute_time_s)} ({_share(plan.compute_time_s, step)} of the step)",
        f"  communication  {format_seconds(plan.comm_time_s)} ({_share(plan.comm_time_s, step)} of the step)",
    ]
    if plan.overlap_time_s:
        lines.append(f"  overlap        {format_seconds(plan.overlap_time_s)} of the communication runs behind compute "
                     f"({'CDP' if plan.cdp != 'off' else 'ZeRO-3 prefetch'})")
    lines += [line for scheme in SCHEMES for line in scheme.time_lines(plan)]
    priced = [(r, collective_seconds(r, plan, hardware)) for r in plan.comms]
    timed = sorted(((r, s) for r, s in priced if s is not None), key=lambda rs: -rs[1] * rs[0].count)
    if not timed:
        lines.append("  no collectives: every device computes its share without exchanging data")
        return "\n".join(lines)
    total = sum(s * r.count for r, s in timed)
    rows = [[r.kind, ",".join(r.axes), r.phase, format_bytes(r.nbytes), str(r.count), format_seconds(s), format_seconds(s * r.count), _share(s * r.count, total)]
            for r, s in timed[:TOP_COLLECTIVES]]
    lines += ["", f"  Top collectives by total time per step ({min(len(timed), TOP_COLLECTIVES)} of {len(timed)} distinct ones; "
                  f"all together {format_seconds(total)}, priced on {hardware.name}):", ""]
    lines += ["  " + line for line in render(rows, ["kind", "axes", "phase", "bytes", "count", "each", "total", "share"]).splitlines()]
    unpriced = [r for r, s in priced if s is None]
    if unpriced:
        lines.append(f"  (no cost formula here for: {', '.join(sorted({r.kind for r in unpriced}))})")
    return "\n".join(lines)


# --------------------------------------------------------------------------- memory


def peak_phase(plan: Plan) -> tuple[str, tuple[str, ...]]:
    """Which moment sets the peak and the terms held then (see MemoryBreakdown): forward/backward
    with the activations, the end of backward with the gradients, or the optimizer step."""
    m = plan.memory_breakdown
    at = f" at {m.peak_at}" if m.peak_at else ""
    options = [
        (m.activations + m.transient, f"forward/backward{at}, while activations are held", ("activations", "transient")),
        (m.grads + m.transient, f"backward{at}, once the gradients exist", ("grads", "transient")),
        (m.grads + m.step_transient, "the optimizer step", ("grads", "step_transient")),
    ]
    _, phase, terms = max(options, key=lambda o: o[0])
    return phase, ("params", "optimizer", *terms)


def memory_section(plan: Plan) -> str:
    """Every memory term with its share of the peak; terms not held at the peak say so."""
    m = plan.memory_breakdown.model_dump()
    peak = plan.peak_memory_bytes
    phase, at_peak = peak_phase(plan)
    budget = plan.memory_budget_bytes
    lines = [f"  peak {format_bytes(peak)} per device" + (f" of a {format_bytes(budget)} budget ({_share(peak, budget)})" if budget else "")
             + f", reached during {phase}:"]
    rows = []
    for term in ("params", "grads", "optimizer", "activations", "transient", "step_transient"):
        held = term in at_peak
        rows.append([term, format_bytes(m[term]), _share(m[term], peak) if held else "-", "" if held else "not held at the peak"])
    lines += ["", *("  " + line for line in render(rows, ["term", "bytes", "share", ""]).splitlines())]
    return "\n".join(lines)


# --------------------------------------------------------------------------- alternatives


def compare(alt: Plan, ref: Plan) -> str:
    """``215.87 ms at 3.14 GiB: 17.31 ms slower (+8.7%), 1.00 GiB less memory per device``."""
    dt = alt.step_time_s - ref.step_time_s
    dm = alt.peak_memory_bytes - ref.peak_memory_bytes
    pct = f"{100 * dt / ref.step_time_s:+.1f}%" if ref.step_time_s else ""
    speed = "the same time" if dt == 0 else f"{format_seconds(abs(dt))} {'slower' if dt > 0 else 'faster'} ({pct})"
    memory = "the same memory" if dm == 0 else f"{format_bytes(abs(dm))} {'more' if dm > 0 else 'less'} memory per device"
    return f"{format_seconds(alt.step_time_s)} at {format_bytes(alt.peak_memory_bytes)}: {speed}, {memory}"


def neighbour_lines(result: SearchResult, index: int, plan: Plan) -> list[str]:
    """The front points just faster and just smaller than point ``index``."""
    budget = format_bytes(result.memory_budget)
    lines = []
    if index > 1:
        faster = result.front[index - 2]
        fits = "fits" if faster.peak_memory_bytes <= result.memory_budget else "does not fit"
        lines.append(f"    point {index - 1} (faster, {mesh_text(faster.mesh)}, TP {faster.tp}, ZeRO {faster.zero_stage}): {compare(faster, plan)}; "
                     f"it {fits} the {budget} budget")
    else:
        lines.append("    no faster point: this is the fastest plan within the budget")
    if index < len(result.front):
        smaller = result.front[index]
        lines.append(f"    point {index + 1} (smaller, {mesh_text(smaller.mesh)}, TP {smaller.tp}, ZeRO {smaller.zero_stage}): {compare(smaller, plan)}")
    else:
        lines.append("    no smaller point: this is the plan that needs the least memory")
    return lines


def _unplanned(cands: list[Candidate], budget: float) -> str:
    """Why configurations with no plan have none: beaten by the plans found (it fits, but its
    bounds lose), the least memory they need, or why they cannot run."""
    dominated = [c for c in cands if candidate_status(c, budget) == "dominated"]
    if dominated:
        return dominated[0].reason
    sized = [c for c in cands if candidate_status(c, budget) == "infeasible"]
    if sized:
        c = min(sized, key=lambda c: c.least_memory or 0.0)
        return f"infeasible: {needs_text(c)} per device at the least{' (a bound)' if c.least_is_bound else ''}, on mesh {c.mesh}"
    return f"pruned: {cands[0].reason}"


def alternative_line(plan: Plan, label: str, plans: list[Plan], cands: list[Candidate], budget: float) -> str:
    """One other choice: its fastest plan against ``plan``, and when that needs more memory, its
    fastest within ``plan``'s memory; with no plan, why."""
    if not plans:
        return f"    {label}: {_unplanned(cands, budget)}"
    fastest = min(plans, key=lambda p: (p.step_time_s, p.peak_memory_bytes))
    line = f"    {label}: fastest {mesh_text(fastest.mesh)}, ZeRO {fastest.zero_stage}: {compare(fastest, plan)}"
    if fastest.peak_memory_bytes > plan.peak_memory_bytes:
        within = [p for p in plans if p.peak_memory_bytes <= plan.peak_memory_bytes]
        if within:
            best = min(within, key=lambda p: (p.step_time_s, p.peak_memory_bytes))
            line += f"; within this point's memory: {compare(best, plan)}"
        else:
            least = min(p.peak_memory_bytes for p in plans)
            line += f"; none within this point's memory (its least is {format_bytes(least)})"
    return line


def alternatives_section(result: SearchResult, index: int, plan: Plan) -> str:
    """Neighbouring front points, then each other TP family and each other value of every
    scheme's setting searched (ZeRO stage, CDP mode, micro-batch count, recomputation)."""
    lines = ["  Neighbours on the front:", *neighbour_lines(result, index, plan), "",
             "  Other choices (each one's fastest plan, compared with this point):"]
    dimensions: list[tuple[str, Callable[[Plan], str], Callable[[Candidate], str]]] = [
        ("TP", lambda p: p.tp, lambda c: c.family),
        *((scheme.title, lambda p, key=scheme.setting: str(settings_of(p)[key]), lambda c, key=scheme.setting: str(c.settings[key]))
          for scheme in SCHEMES),
    ]
    feasible = result.feasible
    others = 0
    for name, of_plan, of_cand in dimensions:
        values = sorted({of_plan(p) for p in feasible} | {of_cand(c) for c in result.candidates if c.plan is None})
        for value in values:
            if value == of_plan(plan):
                continue
            others += 1
            plans = [p for p in feasible if of_plan(p) == value]
            cands = [c for c in result.candidates if c.plan is None and of_cand(c) == value]
            lines.append(alternative_line(plan, f"{name} {value}", plans, cands, result.memory_budget))
    if not others:
        searched = [scheme.flags[0].name for scheme in SCHEMES if scheme.flags]
        lines.append(f"    none: every plan found uses this point's TP family and {', '.join(s.title for s in SCHEMES)} settings "
                     f"(widen --tp, {', '.join(searched)})")
    return "\n".join(lines)
