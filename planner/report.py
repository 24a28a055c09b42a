"""Readable reports of a search and of one plan (plain text or GitHub markdown; the CLI only prints).

:func:`format_search` answers first: the chosen plan and how to run it, then the time/memory
front (one row per non-dominated plan across the configurations searched, fastest first, with the
knee and the objective's choice marked); verbose adds what happened to every configuration (its own
front, or why it was pruned or cannot fit) and the chosen plan's detail (:func:`format_plan`). :func:`plot_front` draws the same front with matplotlib.

:func:`search_json` is the document ``planner report --json`` prints: a ``pareto`` array (the merged
front, fastest first; each entry ``step_time_s``, ``peak_memory_bytes``, ``memory_breakdown``,
``mesh``, ``tp``, each scheme's fields (``zero_stage``, ``cdp``, ``cdp_stages``, ``micro_batches``, ``recompute``:
:meth:`planner.schemes.base.Scheme.fields`), ..., and the booleans ``knee`` and
``best``), a ``candidates`` array (every configuration: ``feasible``, ``status``
(:func:`candidate_status`), ``reason``, ``least_memory_bytes``, ``least_is_bound``,
``front_points`` (how many points its own front has) and ``front`` (those points)), ``objective``,
``memory_budget_bytes`` and ``infeasible`` (the message when nothing fits, else empty).
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from planner.hardware import HardwareProfile
from planner.ir import IRGraph
from planner.mesh import Mesh, mesh_text
from planner.messages import configuration_text
from planner.plan import Plan
from planner.schemes.base import Settings, settings_of
from planner.schemes.registry import SCHEMES
from planner.schemes.tp import TP_AXES
from planner.search import SearchResult
from planner.space import Candidate
from planner.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from matplotlib.axes import Axes


# --------------------------------------------------------------------------- tables


def _table(rows: list[list[str]], header: list[str]) -> str:
    """A plain-text table: columns padded to their widest cell, a dashed rule under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _markdown_table(rows: list[list[str]], header: list[str]) -> str:
    """A GitHub markdown table (``|`` in cells escaped)."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line(["---"] * len(header)), *(line(r) for r in rows)])


def render(rows: list[list[str]], header: list[str], *, markdown: bool = False) -> str:
    return _markdown_table(rows, header) if markdown else _table(rows, header)


def settings_cells(settings: Settings, plan: Plan | None = None) -> list[str]:
    """Each scheme's cell of a table row (:meth:`planner.schemes.base.Scheme.cell`)."""
    return [scheme.cell(settings, plan) for scheme in SCHEMES]


SCHEME_COLUMNS = [scheme.column for scheme in SCHEMES]


def point_marks(result: SearchResult, plan: Plan) -> str:
    """``best`` for the objective's choice, ``knee`` for the front's knee (both may hold)."""
    marks = [name for name, p in (("best", result.best), ("knee", result.knee)) if p is plan]
    return ", ".join(marks)


FRONT_HEADER = ["#", "step time", "memory/device", "mesh", "tp", *SCHEME_COLUMNS, ""]


def front_rows(result: SearchResult) -> list[list[str]]:
    """One row per merged-front point, fastest first, numbered from 1 (``planner explain --point``)."""
    return [
        [str(i), format_seconds(p.step_time_s), format_bytes(p.peak_memory_bytes), mesh_text(p.mesh), p.tp, *settings_cells(settings_of(p), p),
         point_marks(result, p)]
        for i, p in enumerate(result.front, start=1)
    ]


def mesh_family(mesh: Mesh) -> str:
    """The TP family a configuration's mesh is built for (``none`` without tensor-parallel axes
    above degree 1); a plan on it may still use less (``Plan.tp``)."""
    if mesh.group_size(mesh.tp_axes) == 1:
        return "none"
    return next((family for family, axes in TP_AXES.items() if set(axes) == set(mesh.tp_axes)), "mixed")


CONFIG_HEADER = ["mesh", "tp", *SCHEME_COLUMNS, "points", "on front", "fastest", "its memory", "least memory", "status"]


def candidate_status(c: Candidate, budget: float) -> str:
    """``optimal`` / ``time limit`` (it has plans; a time limit means they may not be the best),
    ``infeasible`` (it needs more memory than ``budget``), ``dominated`` (it fits, but its bounds
    show no plan of it can beat the plans found), or ``pruned`` (it cannot run; see its reason)."""
    if c.plan is not None:
        return "time limit" if any(p.solver.status == "time_limit" for p in c.front or (c.plan,)) else "optimal"
    if c.least_memory is not None and c.least_memory > budget:
        return "infeasible"
    return "dominated" if c.reason.startswith("dominated") else "time limit" if c.reason.startswith("stopped") else "pruned"


def needs_text(c: Candidate) -> str:
    """``needs 90.00 GiB`` (the exact least), ``needs >= 90.00 GiB`` (a bound only), or ``-``."""
    if c.least_memory is None:
        return "-"
    return f"needs {'>= ' if c.least_is_bound else ''}{format_bytes(c.least_memory)}"


def _config_row(c: Candidate, on_front: set[int], budget: float) -> list[str]:
    """What happened to one configuration: its front's two ends, or why it has none."""
    status = candidate_status(c, budget)
    head = [str(c.mesh), mesh_family(c.mesh), *settings_cells(c.settings, c.plan)]
    if c.plan is None:
        return [*head, "0", "0", "-", "-", needs_text(c) if status == "infeasible" else "-", status]
    points = c.front or (c.plan,)
    return [*head, str(len(points)), str(sum(id(p) in on_front for p in points)), format_seconds(c.plan.step_time_s),
            format_bytes(c.plan.peak_memory_bytes), format_bytes(points[-1].peak_memory_bytes), status]


def config_rows(result: SearchResult) -> list[list[str]]:
    on_front = {id(p) for p in result.front}
    return [_config_row(c, on_front, result.memory_budget) for c in result.candidates]


def format_front(result: SearchResult, *, markdown: bool = False) -> str:
    """The merged front as a table, fastest first, with a line saying what the marks mean."""
    if not result.front:
        return "No plan fits the memory budget: the front is empty."
    n = len(result.front)
    title = (f"Time/memory front: {n} plan{'s' if n > 1 else ''} no other plan beats on both step time and memory per device, "
             f"fastest first (best: the objective's choice, {result.objective}; knee: the best balance)")
    return title + ":\n\n" + render(front_rows(result), FRONT_HEADER, markdown=markdown)


def format_configurations(result: SearchResult, *, markdown: bool = False) -> str:
    """Every configuration: its own front (points, how many survive the merge, fastest, least
    memory), or ``pruned`` / ``infeasible`` with the least memory it needs (``>=``: a bound only),
    then one line per configuration without a plan saying why."""
    title = f"Configurations ({len(result.candidates)} searched; points: its own front; on front: those no other configuration beats):"
    out = [title, "", render(config_rows(result), CONFIG_HEADER, markdown=markdown)]
    failed = [c for c in result.candidates if c.plan is None]
    if failed:
        out.append("")
        bullet = "- " if markdown else "  "
        out += [f"{bullet}{configuration_text(c)}: {c.reason}" for c in failed]
    return "\n".join(out)


def _pipelines(result: SearchResult, *, markdown: bool) -> list[str]:
    if not result.pipelines:
        return []
    rows = [[str(e.stages), str(e.devices), str(e.dp_mp_devices), format_bytes(e.peak_memory), format_seconds(e.step_time)] for e in result.pipelines]
    return ["", f"CDP with stages on different devices (analytic estimate, not searched by the ILP; planner.runtime.cdp_pipeline.CDPPipeline runs it), "
                f"N = {result.pipelines[0].workers} micro-batches:", "",
            render(rows, ["stages", "devices", "DP x MP would need", "memory/device", "step time"], markdown=markdown)]


def format_search(
    result: SearchResult,
    *,
    model_name: str,
    devices: int,
    hardware: HardwareProfile,
    trace_seconds: float,
    graph: IRGraph | None = None,
    markdown: bool = False,
    verbose: bool = False,
    how_to_run: Sequence[str] = (),
) -> str:
    """The report, answer first: the chosen plan in a few lines and ``how_to_run`` (the command or
    code that runs it), what was searched, the front; with ``verbose``, every configuration (its
    own front, or why it was pruned or cannot fit), CDP pipeline estimates and the chosen plan's
    strategies and collectives (:func:`format_plan`). When nothing fits, the search's message
    saying what would comes first and the configurations follow. ``markdown``: GitHub markdown."""
    out = [("# " if markdown else "") + f"planner report: {model_name} on {devices} devices, hardware {hardware.name}"]
    if markdown:
        out.append("")
    if result.best is None:
        out.append(result.infeasible or "No configuration fits the memory budget (see the configurations below for the least memory each needs).")
    else:
        answer = plan_summary(result.best, objective=result.objective) + [f"  {line}" for line in how_to_run]
        out += ["```text", *answer, "```"] if markdown else answer
    out.append("")
    if graph is not None:
        shapes = ", ".join(str(list(graph.nodes[n].out.shape)) for n in graph.input_names)
        counts = sorted({c.micro_batches for c in result.candidates})
        accumulation = ("no gradient accumulation" if counts == [1] else
                        f"split into {', '.join(map(str, counts))} micro-batch{'es' if len(counts) > 1 or counts[0] > 1 else ''} for gradient accumulation")
        out.append(f"model: {graph.summary()}; inputs {shapes} (one step's global batch, {accumulation})")
    out.append(f"searched {len(result.candidates)} configurations in {result.seconds:.2f} s (trace {trace_seconds:.2f} s); "
               f"objective {result.objective}; memory budget {format_bytes(result.memory_budget)} per device")
    out += ["", format_front(result, markdown=markdown), ""]
    if verbose or result.best is None:
        out += [format_configurations(result, markdown=markdown)]
        out += _pipelines(result, markdown=markdown)
    else:
        statuses = Counter(candidate_status(c, result.memory_budget) for c in result.candidates)
        counts_text = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items(), key=lambda kv: -kv[1]))
        out.append(f"Configurations: {counts_text}. --verbose prints each one (its front, or why it has no plan), the chosen plan's "
                   "strategies and collectives, and the search configuration (a --config file that repeats this search).")
    if verbose and result.best is not None:
        plan = format_plan(result.best, graph=graph)
        out += ["", f"## Chosen plan\n\n```text\n{plan}\n```" if markdown else plan]
    if verbose and result.config is not None:
        batch = f" --batch {graph.nodes[graph.input_names[0]].out.shape[0]}" if graph is not None and graph.input_names else ""
        title = f"Search configuration (in search.toml, planner report {model_name}{batch} --config search.toml repeats this search):"
        toml = result.config.to_toml()
        out += ["", f"## {title}\n\n```toml\n{toml}\n```" if markdown else f"{title}\n{toml}"]
    return "\n".join(out)


def plan_summary(plan: Plan, *, objective: str) -> list[str]:
    """The chosen plan in two or three lines: what it is, its time and memory, and a note where it shards nothing."""
    extra = [part for scheme in SCHEMES if (part := scheme.summary(plan))]
    extra += [f"master weights {plan.master_dtype}"] if plan.master_dtype else []
    hidden = f", {format_seconds(plan.overlap_time_s)} of it hidden" if plan.overlap_time_s else ""
    return [
        f"Chosen plan ({objective}): mesh {mesh_text(plan.mesh)}, tensor parallelism {plan.tp}" + "".join(f", {e}" for e in extra),
        f"  {format_seconds(plan.step_time_s)} per step (compute {format_seconds(plan.compute_time_s)}, communication "
        f"{format_seconds(plan.comm_time_s)}{hidden}); {format_bytes(plan.peak_memory_bytes)} per device of "
        f"{format_bytes(plan.memory_budget_bytes) if plan.memory_budget_bytes else 'no budget'}",
        *(textwrap.wrap(plan.shards_nothing_note(), 118, initial_indent="  ", subsequent_indent="  ") if plan.shards_nothing else []),
    ]


def format_plan(plan: Plan, *, graph: IRGraph | None = None) -> str:
    mesh = mesh_text(plan.mesh)
    m = plan.memory_breakdown
    settings = "".join(f", {part}" for scheme in SCHEMES if (part := scheme.summary(plan)))
    lines = [
        f"Plan: mesh {mesh}, tensor parallelism {plan.tp}{settings}, optimizer {plan.optimizer}"
        + (f" (master weights {plan.master_dtype})" if plan.master_dtype else ""),
        f"  predicted step time {format_seconds(plan.step_time_s)}: compute {format_seconds(plan.compute_time_s)}, communication {format_seconds(plan.comm_time_s)} "
        + (f"({format_seconds(plan.overlap_time_s)} of it hidden behind compute: {'CDP' if plan.cdp != 'off' else 'ZeRO-3 prefetch' if plan.zero_stage == 3 and plan.zero_prefetch else 'gradient sync beside backward'})"
           if plan.overlap_time_s else "(not overlapped)"),
        f"  memory per device {format_bytes(plan.peak_memory_bytes)} of {format_bytes(plan.memory_budget_bytes) if plan.memory_budget_bytes else 'no budget'}: "
        f"params {format_bytes(m.params)}, grads {format_bytes(m.grads)}, optimizer {format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}, transient {format_bytes(m.transient)}",
        *(line for scheme in SCHEMES for line in scheme.describe(plan)),
        *([f"  {plan.shards_nothing_note()}"] if plan.shards_nothing else []),
        f"  solver: {plan.solver.status} ({plan.solver.backend}, {plan.solver.num_variables} variables, {plan.solver.num_constraints} constraints, "
        f"build {plan.solver.build_s:.2f} s, solve {plan.solver.solve_s:.2f} s)",
        "",
        "Strategies (one line per distinct node; repeated layers once):",
    ]
    lines += _strategy_lines(plan, graph)
    lines.append("")
    lines.append("Collectives per device per step (count x kind(mesh axes) total bytes):")
    grouped: dict[tuple[str, str, tuple[str, ...]], list[int]] = defaultdict(lambda: [0, 0])
    for c in plan.comms:
        total = grouped[(c.phase, c.kind, tuple(c.axes))]
        total[0] += c.count
        total[1] += c.count * c.nbytes
    for phase in ("fwd", "bwd", "step"):
        kinds = [f"{n} x {kind}({','.join(axes)}) {format_bytes(nbytes)}" for (ph, kind, axes), (n, nbytes) in sorted(grouped.items()) if ph == phase]
        if kinds:
            lines.append(f"  {phase}: " + "; ".join(kinds))
    if not plan.comms:
        lines.append("  none")
    if plan.fallbacks:
        lines.append("")
        lines.append(f"Replicated because no sharding rule covers the op ({len(plan.fallbacks)}):")
        lines += [f"  {f}" for f in plan.fallbacks]
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
        where = paths.get(node.name, node.module)
        lines.append(f"  {node.name:<32} {node.target.removeprefix('aten.'):<44} {node.algorithm:<24} {where}{rep}")
    return lines


def search_json(result: SearchResult, *, model_name: str, devices: int, hardware: HardwareProfile) -> dict[str, Any]:
    """The ``planner report --json`` document (see the module docstring)."""

    def point(p: Plan) -> dict[str, Any]:
        return {"step_time_s": p.step_time_s, "peak_memory_bytes": p.peak_memory_bytes}

    def entry(i: int, p: Plan) -> dict[str, Any]:
        return {
            "point": i,
            **point(p),
            "memory_breakdown": p.memory_breakdown.model_dump(),
            "mesh": dict(p.mesh),
            "tp": p.tp,
            **{key: value for scheme in SCHEMES for key, value in scheme.fields(p).items()},
            "compute_time_s": p.compute_time_s,
            "comm_time_s": p.comm_time_s,
            "overlap_time_s": p.overlap_time_s,
            "solver_status": p.solver.status,
            "knee": p is result.knee,
            "best": p is result.best,
            "strategies": p.strategies_by_module(),
        }

    def candidate(c: Candidate) -> dict[str, Any]:
        points = c.front or ((c.plan,) if c.plan is not None else ())
        return {"mesh": c.mesh.as_dict(), "tp": mesh_family(c.mesh), **c.settings, "feasible": c.plan is not None,
                "status": candidate_status(c, result.memory_budget), "reason": c.reason,
                "least_memory_bytes": c.least_memory, "least_is_bound": c.least_is_bound, "front_points": len(points),
                "front": [point(p) for p in points], "seconds": c.seconds}

    return {
        "model": model_name,
        "devices": devices,
        "hardware": hardware.name,
        "objective": result.objective,
        "memory_budget_bytes": result.memory_budget,
        "search_seconds": result.seconds,
        "pareto": [entry(i, p) for i, p in enumerate(result.front, start=1)],
        "candidates": [candidate(c) for c in result.candidates],
        "infeasible": result.infeasible,
        "search_config": result.config.model_dump(mode="json") if result.config is not None else None,  # the hardware profile whole
    }


# --------------------------------------------------------------------------- plot

FAMILY_COLOURS = {"none": "tab:gray", "1d": "tab:blue", "2d": "tab:orange", "3d": "tab:green", "mixed": "tab:purple"}


def _plain_ticks(span: float) -> Callable[[float, object], str]:
    """Log-axis tick labels as plain numbers (``0.3``, not ``3 x 10^-1``): every tick over less
    than a factor ``span`` of 30, else only 1, 2 and 5 times a power of ten."""
    leads = range(1, 11) if span <= 30 else (1, 2, 5, 10)

    def label(value: float, _: object = None) -> str:
        if value <= 0:
            return ""
        return f"{value:g}" if round(value / 10 ** math.floor(math.log10(value))) in leads else ""

    return label


def _scale(ax: Axes, axis: str, values: list[float]) -> None:
    """Log scale on ``axis`` (``x`` or ``y``) when the values span more than a factor of 10 (the
    front bunches up in a corner otherwise), with plain tick labels."""
    positive = [v for v in values if v > 0]
    if not positive or max(positive) <= 10 * min(positive):
        return
    from matplotlib.ticker import FuncFormatter

    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    target = ax.xaxis if axis == "x" else ax.yaxis
    labels = FuncFormatter(_plain_ticks(max(positive) / min(positive)))
    target.set_major_formatter(labels)
    target.set_minor_formatter(labels)


def plot_front(result: SearchResult, ax: Axes | None = None, *, title: str = "") -> Axes:
    """Every configuration's points (faint, coloured by the TP family the plan uses), the merged
    front as a step line (at a memory budget, the fastest plan is the step's level to its left),
    the knee and the objective's choice marked; memory per device in GiB across, step time up.
    Draws into ``ax`` or into a new (pyplot-free) figure; returns the axes."""
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=(7.5, 4.8), layout="constrained").add_subplot()
    by_family: dict[str, list[Plan]] = defaultdict(list)
    for p in result.feasible:
        by_family[p.tp].append(p)
    for family, plans in sorted(by_family.items()):
        ax.scatter([p.peak_memory_bytes / 2**30 for p in plans], [p.step_time_s for p in plans], s=18, alpha=0.3, linewidths=0,
                   color=FAMILY_COLOURS.get(family, "tab:brown"), label=f"TP {family}")
    front = sorted(result.front, key=lambda p: p.peak_memory_bytes)
    if front:
        ax.step([p.peak_memory_bytes / 2**30 for p in front], [p.step_time_s for p in front], where="post", color="black", lw=1.2,
                marker=".", label="front")
    for plan, style in ((result.knee, {"marker": "D", "s": 70, "color": "crimson", "label": "knee"}),
                        (result.best, {"marker": "o", "s": 180, "facecolors": "none", "edgecolors": "black", "linewidths": 1.5,
                                       "label": f"best ({result.objective})"})):
        if plan is not None:
            ax.scatter([plan.peak_memory_bytes / 2**30], [plan.step_time_s], zorder=3, **style)  # type: ignore[arg-type]
    xs = [p.peak_memory_bytes / 2**30 for p in result.feasible]
    if xs and result.memory_budget / 2**30 <= 2 * max(xs):
        ax.axvline(result.memory_budget / 2**30, ls="--", lw=1, color="gray", label="memory budget")
    _scale(ax, "x", xs)
    _scale(ax, "y", [p.step_time_s for p in result.feasible])
    ax.set_xlabel("memory per device (GiB)")
    ax.set_ylabel("step time (s)")
    if title:
        ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def save_front_plot(result: SearchResult, path: str, *, title: str = "") -> None:
    """Write :func:`plot_front` to ``path`` (PNG, or any format matplotlib knows by the suffix),
    rendered by Agg: no display, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    plot_front(result, fig.add_subplot(), title=title)
    fig.savefig(path, dpi=120)
