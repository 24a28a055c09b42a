"""What a search says about a configuration it gives no plan for, in one place: dismissed by a
bound (and which point dominates it), infeasible within the budget (the least memory it needs, the
terms that make it up, what to change), or over the budget by its LP relaxation; and the labels
and one-line outcomes a progress log and the report print.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from planner.config import Objective, SearchConfig
from planner.front import Point, dominated
from planner.ir import IRGraph
from planner.mesh import mesh_text
from planner.plan import Plan
from planner.schemes.base import Settings, settings_of
from planner.schemes.cdp import PipelineEstimate
from planner.schemes.registry import SCHEMES
from planner.space import Candidate
from planner.terms import Evaluation, Problem
from planner.units import format_bytes, format_seconds


def larger_text(resolution: float) -> str:
    """How a dominated configuration's plans compare in memory with faster points (see ``resolution``)."""
    return f"larger (or less than {resolution:.0%} smaller)" if resolution > 0 else "larger"


def relaxation_infeasible(done: Candidate, budget: float, seconds: float) -> Candidate:
    """The configuration, when even its LP relaxation has nothing within the budget (the ILP's
    memory is a lower bound on every plan's: the evaluation only adds terms)."""
    cdp = (" (with CDP, or no choice of strategies avoids a collective over the data-parallel workers, which CDP's workers, "
           "running at different times, cannot join: plan it without CDP)") if done.cdp != "off" else ""
    return over_budget(done, budget, f"no plan on mesh {done.mesh} fits {format_bytes(budget)} per device: even the LP relaxation "
                        f"(integrality dropped) has nothing within it{cdp}", seconds)


def over_budget(done: Candidate, budget: float, reason: str, seconds: float) -> Candidate:
    """The configuration, when nothing fits and its least memory was not solved for: more than the
    budget is all that is known."""
    return replace(done, reason=reason, least_memory=budget, least_is_bound=True, seconds=seconds)


def infeasible(done: Candidate, problem: Problem, budget: float, least: Evaluation | None, reason: str, seconds: float) -> Candidate:
    """The configuration, when nothing fits: the least memory any plan needs (``least``, when the
    solver found it; else ``reason`` says why not), its terms, what to change."""
    if least is None:
        return over_budget(done, budget, reason, seconds)
    return replace(done, reason=infeasible_message(problem, budget, least), least_memory=least.peak_memory,
                   least_terms=tuple(least.memory.items()), seconds=seconds)


def dismissal(done: Candidate, t_lb: float, m_lb: float, now: Sequence[Point], *, objective: Objective, front: bool,
               what: str, resolution: float = 0.0) -> Candidate | None:
    """The configuration, dismissed with its reason, when no plan of it faster than ``t_lb`` or
    smaller than ``m_lb`` (lower bounds, from ``what``) can beat the points found so far (on
    the front: be faster, or at least ``resolution`` smaller than a point as fast)."""
    if not front and now and objective != "knee":
        # one plan: a configuration whose bound cannot beat the best plan found is not solved
        best = now[0] if objective == "time" else now[-1]
        if (t_lb >= best.step_time_s) if objective == "time" else (m_lb >= best.peak_memory_bytes):
            bound = f"faster than {format_seconds(t_lb)}" if objective == "time" else f"smaller than {format_bytes(m_lb)}"
            return replace(done, reason=f"dominated: no plan here is {bound} ({what}), and the {describe(best)} plan takes "
                           f"{format_seconds(best.step_time_s)} with {format_bytes(best.peak_memory_bytes)}")
    if front:
        better = dominated(now, t_lb, m_lb, resolution)
        if better is not None:
            within = f"; a plan less than {resolution:.0%} smaller is within the front's resolution" if better.peak_memory_bytes > m_lb else ""
            return replace(done, reason=f"dominated: no plan here is faster than {format_seconds(t_lb)} ({what}) or smaller than "
                             f"{format_bytes(m_lb)} (a bound), and the {describe(better)} plan takes {format_seconds(better.step_time_s)} "
                             f"with {format_bytes(better.peak_memory_bytes)}{within}")
    return None


def describe(plan: Plan | Point) -> str:
    """A plan's configuration, as :func:`label` names it."""
    if not isinstance(plan, Plan):
        return getattr(plan, "label", "another configuration's")
    return label(mesh_text(plan.mesh), settings_of(plan))


def configuration_text(c: Candidate) -> str:
    return label(str(c.mesh), c.settings)


def label(mesh: str, settings: Settings) -> str:
    """``dp=4 x tp=2 ZeRO-1 recompute full``: the mesh, then each scheme's part (schemes.base.Scheme.label)."""
    return " ".join([mesh, *(part for part in (scheme.label(settings) for scheme in SCHEMES) if part)])


def outcome_line(c: Candidate) -> str:
    if c.front:
        first, last = c.front[0], c.front[-1]
        return (f"{len(c.front)} point{'s' if len(c.front) > 1 else ''}, {format_seconds(first.step_time_s)} at "
                f"{format_bytes(first.peak_memory_bytes)} to {format_seconds(last.step_time_s)} at {format_bytes(last.peak_memory_bytes)} "
                f"({c.seconds:.1f} s)")
    if c.reason.startswith("dominated"):
        return f"dominated ({c.seconds:.1f} s)"
    need = f"needs {'at least ' if c.least_is_bound else ''}{format_bytes(c.least_memory)}" if c.least_memory is not None else c.reason
    return f"{need}, infeasible ({c.seconds:.1f} s)"


def nothing_fits(config: SearchConfig, graph: IRGraph, least: float, cand: Candidate, memory: dict[str, float],
                 pipeline: PipelineEstimate | None = None, *, lower: float | None = None) -> str:
    """No configuration fits the budget (``config.budget``): the least memory any plan needs (``least``, the smallest
    plan found, on ``cand``, made of ``memory``'s terms; ``lower``: what no plan goes below, where that is less) and
    what would change it (``graph``: the traced batch's).
    ``pipeline``: CDP with its stages on different devices for these devices, the estimate that
    needs least memory; CDP is advised only where it needs less than ``least`` (CDP over data
    parallelism alone holds more per device than DP, not less)."""
    budget = config.budget
    terms = sorted(memory.items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in terms if v)
    state = memory["params"] + memory["grads"] + memory["optimizer"]
    advice = [part for scheme in SCHEMES if (part := scheme.advice(config, graph, memory))]
    if memory["activations"] >= state / 2:
        advice.append("a smaller batch per step (--batch), since activations are a large share")
    lower = least if lower is None or lower >= least * (1 - 1e-5) else lower  # (1e-5: an LP bound's tolerances)
    if pipeline is not None and pipeline.peak_memory < lower:
        advice.append(f"CDP with its {pipeline.stages} stages on different devices (runtime.cdp_pipeline.CDPPipeline, "
                      f"{pipeline.per_stage} devices a stage: each holds its stage's parameters and the activations of its workers "
                      f"in flight), estimated at {format_bytes(pipeline.peak_memory)} per device")
    advice.append(f"more devices (at least {lower / budget:.1f}x the memory in all: more tensor or data parallelism spreads the "
                  f"{'parameter, gradient and optimizer state' if state >= memory['activations'] else 'activation'} bytes)")
    if lower == least:
        need = f"{format_bytes(least)} ({format_bytes(least - budget)} over), on {configuration_text(cand)}"
    else:
        need = (f"between {format_bytes(lower)} and {format_bytes(least)} (at least {format_bytes(lower - budget)} over); "
                f"the smallest plan found needs {format_bytes(least)}, on {configuration_text(cand)}")
    return (f"No plan on {config.devices} devices fits {format_bytes(budget)} per device. The least memory any plan needs is "
            f"{need}: {parts}. To fit, try " + "; or ".join(advice) + ".")


def infeasible_message(problem: Problem, budget: float, least: Evaluation) -> str:
    """One configuration has no plan within ``budget``: ``least`` is its least-memory plan."""
    parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in sorted(least.memory.items(), key=lambda kv: -kv[1]))
    return (
        f"no plan on mesh {problem.mesh} fits {format_bytes(budget)} per device: the least any plan needs is "
        f"{format_bytes(least.peak_memory)} ({parts}), {format_bytes(least.peak_memory - budget)} over. "
        + ("Use ZeRO (--zero 1,2,3), more devices (more tensor or data parallelism), or a smaller micro-batch." if problem.zero_stage < 3 else "Use more devices (more tensor or data parallelism) or a smaller micro-batch.")
    )
