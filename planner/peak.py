"""The step's peak memory, taken where it happens: at each op, in forward and in backward.

Autograd frees a saved tensor once the backward of the op that saved it has run, and makes a
parameter's gradient at the backward of its last consumer. So at op ``v`` (in graph order; for a
repeated layer, its first and its last instance) the bytes alive beside what runs there are

    B_v = P_v + Q_v + F_v
    P_v = the activations saved by the nodes up to v   (forward: made so far; backward: not freed yet)
    Q_v = the gradients of the parameters read after v (backward: made already)
    F_v = the gradients in flight: one per tensor made before v and read after it (its consumers'
          backward has run, its producer's not yet), in its producer's layout

and, where ``v`` runs in a recomputed segment (:mod:`planner.schemes.recompute`: the segment's
saves are not in P), R_v = the saves of the segment's ops up to v, recomputed before its backward
and freed by the backward of the ops after v, counted in F_v. The peak is the largest, over the
ops, of B_v plus one of what runs at v: its own working set
(:func:`planner.terms.op_working_set`), a conversion into it (the larger of its halves' buffers,
:func:`planner.cost.steps_working_set`; a conversion several consumers share is placed at each),
or a tied weight's gradient contributions being summed (at its first consumer), or under CDP a
stage's partial gradient sum received (:func:`planner.schemes.cdp.stage_buffers`; CDP v1's previous
buffer, alive through the step, is in every Q_v). Two more moments
bound it from below: every activation (the loss, end of forward) and every gradient (end of
backward). Forward, Q and F are not alive yet: counting them there over-states B_v by at most the
gradients in flight, and the working set is already the larger of the op's two halves.

Before this, the peak was every activation plus the largest working set anywhere, which
over-stated ZeRO-3 plans (their largest working set, a gathered expert weight's backward, runs
once the layers after it have freed their activations: HF Mixtral +11.5 %) and missed the
conversions' buffers of tensor-parallel plans (a gradient all-gathered while other converted
gradients wait: the ops model's 1-D plan -24.6 %).

As ILP rows (:mod:`planner.solve`), with P and Q as chains of one variable per instant:

    P_k = P_{k-1} + saved_k,   Q_k = Q_{k+1} + grads_k,   Z >= P_k + Q_k + F_k + w   (w in work_k)
    Z >= A,   Z >= G

Each term is a linear form over the ILP's indicators (:data:`Var`): strategies x, holds z and
an edge's chosen pair of Specs e (its transportation variables); :func:`peak` evaluates the same
forms for one assignment.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.terms import HoldTerm, Problem

Var = tuple[object, ...]  # ("x", group, strategy) | ("z", hold key) | ("e", edge index, Spec id, Spec id)
Form = dict[Var, float]  # bytes per unit of each indicator


@dataclass(frozen=True)
class Instant:
    node: str  # the op instance
    saved: Form  # activations saved by the nodes after the previous instant, up to this one
    grads: Form  # gradients of the parameters last read after this instant, up to the next one
    in_flight: Form  # F: gradients of tensors made before this op and read after it
    work: tuple[Form, ...]  # what may run here, one at a time (the op first)


def instants(problem: Problem, holds: dict[tuple[object, ...], HoldTerm] | None = None) -> list[Instant]:
    """The moments of a step at which the peak may happen, in graph order (see the module).
    ``holds``: the hold terms to place, where not ``problem.holds`` (a bound's, priced without
    the conversions: :func:`planner.edges.bound_holds`)."""
    graph, mesh = problem.graph, problem.mesh
    order = [n for n in graph.nodes.values() if n.kind != "output"]
    pos = {n.name: k for k, n in enumerate(order)}
    consumers = graph.consumers()
    by_template: dict[str, list[int]] = defaultdict(list)
    for n in order:
        by_template[n.template].append(pos[n.name])
    keep = sorted({p for ps in by_template.values() if order[ps[0]].kind == "op" for p in (ps[0], ps[-1])}
                  | {pos[name] for name in problem.stage_ends})
    if not keep:
        return []
    at = {p: k for k, p in enumerate(keep)}

    def x(template: str, values: list[float]) -> Form:
        g = problem.node_group[template]
        return {("x", g, i): v for i, v in enumerate(values) if v}

    def add(form: Form, more: Form) -> None:
        for var, v in more.items():
            form[var] = form.get(var, 0.0) + v

    def upto(p: int) -> int:  # the first instant at or after position p
        return min(bisect.bisect_left(keep, p), len(keep) - 1)

    saved: list[Form] = [{} for _ in keep]
    grads: list[Form] = [{} for _ in keep]
    flight: list[Form] = [{} for _ in keep]
    work: list[list[Form]] = [[] for _ in keep]
    floor: list[float] = []
    for p in keep:
        terms = problem.node_terms[order[p].template]
        work[at[p]].append(x(order[p].template, terms.work))
        floor.append(min(terms.work))
    # recomputed segments (planner.schemes.recompute): what their ops save is alive only while the
    # segment's backward runs; at its op v, the saves of its ops up to v: (position, form) per segment
    rerun: dict[object, list[tuple[int, Form]]] = defaultdict(list)
    segment = problem.segment_of.get
    for n in order:
        terms = problem.node_terms[n.template]
        if any(terms.saved):
            if problem.recomputes(n):
                rerun[segment(n.name)].append((pos[n.name], x(n.template, terms.saved)))
            else:
                add(saved[upto(pos[n.name])], x(n.template, terms.saved))
        uses = [pos[c] for c, _ in consumers[n.name] if graph.nodes[c].kind == "op"]
        if not uses:
            continue
        if n.kind == "param":
            if any(terms.grads):  # made at its last consumer's backward: alive at the instants before it
                k = bisect.bisect_left(keep, max(uses)) - 1
                if k >= 0:
                    add(grads[k], x(n.template, terms.grads))
            if any(terms.work) and pos[n.name] == by_template[n.template][0]:
                work[upto(min(uses))].append(x(n.template, terms.work))
        elif n.kind == "op" and n.requires_grad:
            for index, meta in enumerate(n.outputs):
                if meta is None or not meta.is_float:
                    continue
                last = max((pos[c] for c, q in consumers[n.name] if graph.nodes[c].kind == "op" and graph.nodes[c].inputs[q].index == index), default=-1)
                lo, hi = bisect.bisect_right(keep, pos[n.name]), bisect.bisect_left(keep, last)
                if lo >= hi:
                    continue
                local = []
                for s in problem.choices[n.template]:
                    spec = s.outputs[index] if index < len(s.outputs) else None
                    local.append(float(meta.nbytes // spec.layout.shard_factor(mesh)) if spec is not None else 0.0)
                form = x(n.template, local)
                for k in range(lo, hi):
                    add(flight[k], form)
    for key, hold in (problem.holds if holds is None else holds).items():
        places = by_template[hold.saver]
        if hold.checkpointed:  # kept by the checkpoint of the recomputed instances
            places = [p for p in places if problem.recomputes(order[p])] or places
        for p in places:
            if hold.recomputed and problem.recomputes(order[p]):
                rerun[segment(order[p].name)].append((p, {("z", key): hold.nbytes / len(places)}))
            else:
                add(saved[upto(p)], {("z", key): hold.nbytes / len(places)})
    for k, p in enumerate(keep):
        for q, form in rerun.get(segment(order[p].name), ()) if rerun else ():
            if q <= p:
                add(flight[k], form)
    for vt, form in problem.conversion_work:
        for p in {by_template[vt][0], by_template[vt][-1]}:
            work[upto(p)].append(form)
    for k, name in enumerate(problem.stage_ends):  # CDP: stage k+1's partial sum arrives (planner.schemes.cdp.stage_buffers)
        work[at[pos[name]]].append(problem.stage_sums[k + 1])
    held: Form = {}  # held through the whole step (CDP v1's previous buffer): in every Q_k
    for n in order:
        if n.kind == "param" and any(problem.node_terms[n.template].held):
            add(held, x(n.template, problem.node_terms[n.template].held))
    add(grads[-1], held)
    return [Instant(order[p].name, saved[k], grads[k], flight[k], _undominated(work[k], floor[k])) for k, p in enumerate(keep)]


def _undominated(work: list[Form], floor: float) -> tuple[Form, ...]:
    """``work`` (the op's own working set first) less the forms that never exceed it, whatever the
    plan: those whose every coefficient is at most ``floor``, the op's least working set. Most
    conversions into an op are smaller than the op; their rows would only slow the MIP."""
    return (work[0], *(w for w in work[1:] if max(w.values(), default=0.0) > floor))


def peak(points: list[Instant], value: Callable[[Var], float]) -> tuple[float, str]:
    """(the largest B_k + w over the instants, the op instance where it happens) for the
    indicators' values ``value`` (one plan: 0 or 1 each)."""

    def of(form: Form) -> float:
        return sum(v * value(var) for var, v in form.items())

    if not points:
        return 0.0, ""
    suffix = [0.0] * (len(points) + 1)
    for k in range(len(points) - 1, -1, -1):
        suffix[k] = suffix[k + 1] + of(points[k].grads)
    best, where, prefix = 0.0, "", 0.0
    for k, point in enumerate(points):
        prefix += of(point.saved)
        base = prefix + suffix[k] + of(point.in_flight)
        top = max((of(w) for w in point.work), default=0.0)
        if base + top > best:
            best, where = base + top, point.node
    return best, where
