"""A solved assignment turned into a :class:`planner.plan.Plan`: each node's strategy, what each
scheme marks on it (:meth:`planner.schemes.base.Scheme.node_fields`), the gradient buckets and ZeRO-3 units the runtime runs, the collectives
priced, and the predicted time and memory broken down.
"""

from __future__ import annotations

from collections import Counter

from planner.buckets import Bucket, Gather, Gradient, Unit, pack
from planner.ir import IRGraph
from planner.overlap import param_units
from planner.plan import CommRecord, GradBucket, MemoryBreakdown, NodePlan, ParamUnit, Plan, SolverInfo, UnitGather, fingerprint
from planner.rules import FALLBACK
from planner.schemes.registry import SCHEMES
from planner.schemes.tp import tp_family
from planner.schemes.zero import zero_param_terms
from planner.solve import Solution
from planner.terms import Evaluation, Problem


def make_plan(
    graph: IRGraph,
    problem: Problem,
    solution: Solution,
    *,
    model_name: str,
    memory_budget: float,
    optimizer: str = "adamw",
    trace_seconds: float | None = None,
) -> Plan:
    nodes = []
    fallbacks = []
    for name, strategies in problem.choices.items():
        s = strategies[solution.assignment[problem.node_group[name]]]
        nodes.append(
            NodePlan(
                name=name,
                target=graph.nodes[name].target,
                algorithm=s.algorithm,
                kernel=s.kernel,
                inputs=tuple(spec.encode() for spec in s.inputs),
                outputs=tuple(spec.encode() if spec is not None else None for spec in s.outputs),
                split_axes=problem.mesh.sort_axes(s.split_axes),
                raw_output=s.raw_output.encode() if s.raw_output is not None else None,
                regather=tuple((pos, spec.encode()) for pos, spec in s.regather),
                module=graph.nodes[name].module_path,
                **{key: value for scheme in SCHEMES for key, value in scheme.node_fields(problem, name).items()},
            )
        )
        if s.algorithm == FALLBACK:
            fallbacks.append(f"{name} ({graph.nodes[name].target}) in {graph.nodes[name].module_path or '<root>'}")
    ev = solution.evaluation
    buckets = gradient_buckets(graph, problem, solution.assignment)
    units, loose = param_units(problem, solution.assignment)
    return Plan(
        model=model_name,
        model_fingerprint=fingerprint(graph),
        input_shapes=tuple(graph.nodes[n].out.shape for n in graph.input_names),
        mesh=problem.mesh.as_dict(),
        mesh_roles=problem.mesh.roles_dict(),
        hardware=problem.hardware.name,
        tp=tp_family(problem, solution.assignment),
        **problem.settings,
        optimizer=optimizer,
        master_dtype=problem.master_dtype,
        memory_budget_bytes=int(memory_budget) if memory_budget != float("inf") else 0,
        step_time_s=ev.step_time,
        compute_time_s=ev.compute_time,
        comm_time_s=ev.comm_time,
        overlap_time_s=ev.overlap_time,
        **{key: value for scheme in SCHEMES for key, value in scheme.plan_fields(problem, ev).items()},
        peak_memory_bytes=int(ev.peak_memory),
        memory_breakdown=_breakdown(ev),
        nodes=tuple(nodes),
        comms=_comm_records(ev, buckets, problem.micro_batches, problem.sync_share_bytes, units, loose, problem.unit_share_bytes),
        grad_bucket_bytes=problem.bucket_bytes,
        grad_buckets=tuple(GradBucket(axes=b.axes, dtype=b.dtype, params=b.params, nbytes=b.nbytes, collectives=b.collectives) for b in buckets),
        param_units=tuple(
            ParamUnit(axes=u.axes, dtype=u.dtype, block=u.gathers[0].block,
                      gathers=tuple(UnitGather(site=g.site, param=g.param, nbytes=g.nbytes, regather=g.regather, reduced=g.reduced) for g in u.gathers))
            for u in units
        ),
        fallbacks=tuple(fallbacks),
        solver=SolverInfo(
            status="optimal" if solution.status == "optimal" else "time_limit",
            backend=solution.backend,
            trace_s=trace_seconds if trace_seconds is not None else sum(graph.timings.values()),
            build_s=problem.build_seconds + solution.build_seconds,
            solve_s=solution.solve_seconds,
            num_variables=solution.num_variables,
            num_constraints=solution.num_constraints,
        ),
    )


def _breakdown(ev: Evaluation) -> MemoryBreakdown:
    m = ev.memory
    return MemoryBreakdown(
        params=int(m["params"]), grads=int(m["grads"]), optimizer=int(m["optimizer"]),
        activations=int(m["activations"]), transient=int(m["transient"]), step_transient=int(m["step_transient"]),
        peak_at=ev.peak_at,
    )


def gradient_buckets(graph: IRGraph, problem: Problem, assignment: dict[str, int]) -> tuple[Bucket, ...]:
    """The gradient sync's buckets under ``assignment``: every packed collective a parameter's
    strategy prices (:func:`planner.schemes.zero.zero_param_terms`), ready in the reverse order of the
    parameters' first use."""
    if problem.cdp != "off":
        return ()
    order = {name: k for k, name in enumerate(graph.nodes)}
    consumers = graph.consumers()
    gradients = []
    for name, node in graph.nodes.items():
        if node.kind != "param":
            continue
        spec = problem.choices[name][assignment[problem.node_group[name]]].outputs[0]
        assert spec is not None
        _, _, _, step = zero_param_terms(node.out.shape, node.out.itemsize, spec, problem.mesh, problem.zero_stage, 1.0, problem.bucket_bytes,
                                         problem.zero1_reduce)
        first_use = min((order[c] for c, _ in consumers[name]), default=-1)
        packed = tuple((c.kind, c.phase) for c in step if c.bucket_bytes)
        if packed:
            gradients.append(Gradient(name, step[0].nbytes, step[0].axes, node.out.dtype, first_use, packed))
    return pack(gradients, problem.bucket_bytes)


def _comm_records(ev: Evaluation, buckets: tuple[Bucket, ...] = (), micro_batches: int = 1, bucket_bytes: int = 0,
                  units: tuple[Unit, ...] = (), loose: tuple[Gather, ...] = (), unit_bytes: int = 0) -> tuple[CommRecord, ...]:
    """The evaluation's collectives per step, with the packed collectives (one per parameter in
    the evaluation) as the buckets and ZeRO-3 units that run them (a backward-phase bucket, ZeRO-2's
    reduce-scatter, and every unit collective, once per micro-batch), each priced as its members'
    shares (of ``bucket_bytes``, the gradient sync's share bytes, and ``unit_bytes``, the units');
    a ``loose`` gather (priced as a share, run alone) as its own collectives."""
    counts: Counter[tuple[str, tuple[str, ...], int, str, int]] = Counter()
    packed: Counter[tuple[str, tuple[str, ...], str]] = Counter()  # bytes the parameters' packed collectives move
    for comm, n in ev.comms:
        if comm.bucket_bytes:
            packed[(comm.kind, comm.axes, comm.phase)] += comm.nbytes * n
        else:
            counts[(comm.kind, comm.axes, comm.nbytes, comm.phase, 0)] += n
    for bucket in buckets:
        for kind, phase in bucket.collectives:
            n = 1 if phase == "step" else micro_batches
            counts[(kind, bucket.axes, bucket.nbytes, phase, bucket_bytes)] += n
            packed[(kind, bucket.axes, phase)] -= bucket.nbytes * n
    for unit in units:
        for kind, phase, nbytes in unit.collectives():
            counts[(kind, unit.axes, nbytes, phase, unit_bytes)] += micro_batches
            packed[(kind, unit.axes, phase)] -= nbytes * micro_batches
    for g in loose:
        for kind, phase, nbytes in Unit(g.axes, g.dtype, (g,)).collectives():
            counts[(kind, g.axes, nbytes, phase, unit_bytes)] += micro_batches
            packed[(kind, g.axes, phase)] -= nbytes * micro_batches
    assert not any(packed.values()), f"the buckets and units do not move what the evaluation priced: {dict(packed)}"
    return tuple(
        CommRecord(kind=k, axes=a, nbytes=b, phase=p, count=c, bucket_bytes=s)  # type: ignore[arg-type]
        for (k, a, b, p, s), c in sorted(counts.items())
    )
