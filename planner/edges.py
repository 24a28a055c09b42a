"""The conversion and hold terms of a problem: what its edges cost.

Every producer -> consumer edge whose Specs can differ gets a conversion term (the collectives
that turn one into the other, :func:`planner.layout.spec_conversion`), paid once per producer
tensor and target Spec; every tensor saved for backward a hold term, keyed by the storage it keeps
alive (:func:`_root`), counted once however many consumers save it. Identical edges of the
instances of a repeated layer are priced once. The bytes a conversion holds while it runs are
worked out after, by :func:`price_work`, for the problems that get as far as a solve.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import cast

from planner.cost import comm_time
from planner.ir import InputRef, IRGraph, Node
from planner.layout import Spec, is_unit_gather
from planner.peak import Form
from planner.terms import ConversionTerm, EdgeTerm, HoldTerm, Problem, conversion_cache, instances_of, spec_id, spec_sets

_PRICED_KEPT = 4  # the priced terms of the last few problems a graph's searches priced


def shared_edges(problem: Problem) -> None:
    """:func:`_price_edges`, or the terms an earlier problem priced from the same inputs (the
    graph, mesh, hardware, strategies, ZeRO-3's units and the settings that change edge terms,
    ``problem.edge_settings``: micro-batches, CDP, recomputation): ZeRO 0, 1 and 2 of
    one mesh have the same strategies, so a search prices their edges once (measured, gpt2-small
    on 64 devices, one plan: 21 of the 35 problems it prices are priced, the rest share). The
    terms are not changed after pricing, so the problems share them. The last
    :data:`_PRICED_KEPT` are kept on the graph, so what a search drops is freed."""
    key = (problem.mesh, id(problem.hardware), problem.in_units and problem.unit_share_bytes,
           problem.edge_settings,
           tuple((g, tuple(grp.strategies)) for g, grp in problem.groups.items()))
    kept = cast(dict[object, tuple[object, ...]], problem.graph.memo("priced_edges", dict))
    entry = kept.pop(key, None)
    if entry is None or entry[0] is not problem.hardware:
        _price_edges(problem)
        entry = (problem.hardware, problem.conversions, problem.holds, problem.edges, problem.conversion_work, problem.pending_work,
                 problem.priced_memo)
    else:
        (problem.conversions, problem.holds, problem.edges, problem.conversion_work, problem.pending_work,
         problem.priced_memo) = entry[1:]  # type: ignore[assignment]
    kept[key] = entry  # the newest last
    while len(kept) > _PRICED_KEPT:
        del kept[next(iter(kept))]


def _root(graph: IRGraph, ref: InputRef) -> InputRef:
    """The tensor whose storage a saved ``ref`` keeps alive, as a hold term counts it: up through
    alias ops (views, transposes, reshapes, expands) while they do not cut a piece, so every
    consumer that saves one storage through different views shares one term. A piece (of a split
    or chunk, smaller than what it is cut from) is its own tensor: saved in another layout than it
    was made in, what backward holds is the converted copy, of the piece's size (measured, HF Mixtral under 1-D: the gate and up
    halves of the experts' fused projection, all-reduced for a replicated SiLU and reduce-scattered
    for the product, hold 40 KB; the fused output the halves are cut from would count 80 KB), and
    saved as made, the pieces a model cuts are saved together (q, k, v; gate and up) and add up to
    the whole."""
    meta = graph.nodes[ref.node].outputs[ref.index]
    node = graph.nodes[ref.node]
    while node.kind == "op" and node.alias_input is not None and node.inputs:
        up = node.inputs[node.alias_input]
        up_meta = graph.nodes[up.node].outputs[up.index]
        if up_meta is None or meta is None or up_meta.nbytes > meta.nbytes:
            break
        ref, meta = up, up_meta
        node = graph.nodes[ref.node]
    return ref


def _price_edges(problem: Problem) -> None:
    """Conversion terms of every producer -> consumer edge. Identical edges of the instances of a
    repeated layer are gathered first and priced once (their producers counted together)."""
    graph, mesh, hw = problem.graph, problem.mesh, problem.hardware
    barred = problem.barred_axes
    consumers = graph.consumers()
    signatures: dict[str, tuple[tuple[str, int], ...]] = {}
    # (producer template, output index, consumer template, input position, signature, whether the
    # tensor's first consumer runs in a recomputed segment) -> producers
    pending: dict[tuple[str, int, str, int, tuple[tuple[str, int], ...], bool], set[str]] = {}
    reruns: dict[tuple[str, int], bool] = {}
    for v in graph.nodes.values():
        if v.kind == "output":
            continue
        for p, ref in enumerate(v.inputs):
            u = graph.nodes[ref.node]
            if u.outputs[ref.index] is None:
                continue
            signature = signatures.get(u.name)
            if signature is None:
                signature = signatures[u.name] = tuple(sorted({(graph.nodes[c].template, q) for c, q in consumers[u.name]}))
            # a conversion runs where the first consumer that needs it runs (runtime.compile): priced as
            # inside a recomputed segment when the tensor's first consumer is (exact unless an earlier
            # consumer outside keeps the tensor as it is and a later one inside converts it)
            rerun = reruns.get((u.name, ref.index))
            if rerun is None:
                rerun = reruns[(u.name, ref.index)] = bool(problem.segment_of) and _first_consumer_recomputed(problem, u.name, ref.index)
            # templates stand for their instances: same strategies, same groups
            pending.setdefault((u.template, ref.index, v.template, p, signature, rerun), set()).add(u.name)
            if v.template == v.name:
                _price_holds(problem, v, p, ref)
    outs: dict[tuple[str, int], tuple[int, ...]] = {}  # interned Spec ids per strategy, each end
    ins: dict[tuple[str, int], tuple[int, ...]] = {}
    cache = conversion_cache(mesh)
    sig_ids: dict[tuple[tuple[str, int], ...], int] = {}  # the conversion keys hold a consumer signature's id
    for (ut, index, vt, p, signature, rerun), producers in pending.items():
        u = graph.nodes[ut]
        gu, gv = problem.node_group[ut], problem.node_group[vt]
        meta = u.outputs[index]
        assert meta is not None
        with_grad = u.requires_grad and meta.is_float
        if (ut, index) not in outs:
            outs[(ut, index)] = tuple(spec_id(s.outputs[index]) for s in problem.choices[ut])
        if (vt, p) not in ins:
            ins[(vt, p)] = tuple(spec_id(t.inputs[p] if p < len(t.inputs) else None) for t in problem.choices[vt])
        su, sv = outs[(ut, index)], ins[(vt, p)]
        pairs: dict[tuple[int, int], tuple[frozenset[int], frozenset[int]]] = {}
        edge: EdgeTerm | None = None
        if gu == gv:  # one choice drives both ends: strategy i meets strategy i
            for i, (a, b) in enumerate(zip(su, sv, strict=True)):
                if a >= 0 and b >= 0 and a != b:
                    ia, ib = pairs.get((a, b), (frozenset(), frozenset()))
                    pairs[(a, b)] = (ia | {i}, ib | {i})
        else:
            src_sets, dst_sets = spec_sets(su), spec_sets(sv)
            edge_key = (gu, gv, tuple(src_sets.items()), tuple(dst_sets.items()))
            edge = problem.edges.get(edge_key)
            if edge is None:
                edge = problem.edges[edge_key] = EdgeTerm(gu, gv, src_sets, dst_sets, {}, index=len(problem.edges))
            pairs = {(a, b): (ia, ib) for a, ia in src_sets.items() for b, ib in dst_sets.items() if a != b}
        problem.pending_work.append((ut, index, vt, gu, edge.index if edge is not None else None, tuple(pairs.items())))
        sig = sig_ids.setdefault(signature, len(sig_ids))
        for (a, b), (iu, iv) in pairs.items():
            key = ("conv", ut, index, a, b, sig, rerun)  # the instances recomputed and the others pay apart
            term = problem.conversions.get(key)
            if term is None:
                in_unit = problem.in_units and u.kind == "param" and is_unit_gather(cache.conversion(a, b), mesh)
                comms = cache.conversion_comms(a, b, meta.nbytes, with_grad, problem.unit_share_bytes if in_unit else 0)
                again = tuple(c for c in comms if c.phase == "fwd") if rerun else ()  # its forward steps, when the segment is recomputed
                term = problem.conversions[key] = ConversionTerm(key, 0.0, comms + again, rerun=len(again))
                # no collective over axes whose ranks run at different times (CDP's workers, planner.schemes.cdp)
                term.forbidden = bool(barred) and any(set(c.axes) & barred for c in comms if c.kind != "send")
            term.producers |= producers
            cond = (gu, iu, gv, iv)
            if cond not in term.conditions:
                term.conditions.append(cond)
            if edge is not None:
                edge.conversions.setdefault((a, b), set()).add(key)
    seconds: dict[int, float] = {}  # by the identity of a (shared) comms tuple
    for term in problem.conversions.values():
        t = seconds.get(id(term.comms))
        if t is None:
            t = seconds[id(term.comms)] = sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in term.comms)
        term.cost = t * term.count
        if term.rerun:
            term.rerun_cost = sum(comm_time(c, mesh, hw) * problem.repeats(c) for c in term.comms[-term.rerun:]) * term.count


def price_work(problem: Problem) -> None:
    """The bytes each conversion holds while it runs (``problem.conversion_work``: the ILP's and
    the evaluation's memory), from the edges :func:`_price_edges` left pending. Apart from the
    conversion terms because only a solve needs them: the bound that dismisses most large
    configurations reads times alone (:func:`planner.front.conversion_time_bound`; measured,
    gpt2-small on 64 devices, one plan: the working sets were 43 % of the edges' pricing). The
    lists are the ones a shared pricing holds (:func:`shared_edges`), filled in place, so every
    problem that shares them sees them filled."""
    pending, graph = problem.pending_work, problem.graph
    if not pending:
        return
    cache = conversion_cache(problem.mesh)
    seen: set[tuple[str, frozenset[tuple[tuple[object, ...], float]]]] = set()
    helds: dict[tuple[str, int, int, int], float] = {}  # every consumer of a tensor asks again for the same pairs
    for ut, index, vt, gu, edge, pairs in pending:
        u = graph.nodes[ut]
        meta = u.outputs[index]
        assert meta is not None
        with_grad = u.requires_grad and meta.is_float
        work: Form = {}
        for (a, b), (iu, _iv) in pairs:
            held = helds.get((ut, index, a, b))
            if held is None:
                forward, backward = cache.working_sets(a, b, meta.nbytes, meta.shape)
                held = helds[(ut, index, a, b)] = float(max(forward, backward if with_grad else 0))
            if held and edge is not None:
                work[("e", edge, a, b)] = held
            elif held:
                work.update({("x", gu, i): held for i in iu})
        if work and (vt, frozenset(work.items())) not in seen:
            seen.add((vt, frozenset(work.items())))
            problem.conversion_work.append((vt, work))
    pending.clear()


def conversion_uses(problem: Problem) -> Counter[tuple[object, ...]]:
    """Per conversion term, how many causes can trigger it: its conditions within one group, and
    each edge pair that lists it. A term with more than one is paid once however many of its
    causes a plan triggers (the ILP's ``y``; the conversion bound charges each cause cost / uses).
    Counted once per pricing, shared with the problems that share it."""
    memo = cast("Counter[tuple[object, ...]] | None", problem.priced_memo.get("uses"))
    if memo is not None:
        return memo
    uses: Counter[tuple[object, ...]] = Counter()
    for key, term in problem.conversions.items():
        uses[key] += sum(1 for gu, _, gv, _ in term.conditions if gu == gv)
    for edge in problem.edges.values():
        for keys in edge.conversions.values():
            uses.update(keys)
    problem.priced_memo["uses"] = uses
    return uses


def hold_floor(problem: Problem) -> float:
    """Bytes of saved tensors every plan of ``problem`` holds at the end of forward: per tensor a
    hold term keeps (keyed by its storage, :func:`_root`), the most over the groups that save it
    of the least that group's strategies save it as (a strategy that does not save it: 0). Valid
    because whatever strategy a saver's group chooses, the hold of that strategy's layout is
    counted, and each tensor's holds are apart from every other's. A parameter's copy saved in
    another layout than it is stored in counts 0 (stored as saved, it is no copy), and so does
    what a recomputed segment saves (alive only while its backward runs).

    The holds are priced here alone when the conversions are not (the cheap part of
    :func:`_price_edges`), so :func:`planner.front.memory_lower_bound` has them before any
    conversion is priced. Measured, GPT-3 175B on 64 devices at batch 64 (ZeRO 0-3): the bounds of
    all 39 configurations in 0.26 s, where pricing the conversions of dp=8 x 2 x 2 x 2 alone took
    4.9 s; every plan holds 153 GiB of saved tensors there (the attention scores), which lifts the
    bound of dp=8 x 2 x 2 x 2 ZeRO-1 from 182.9 to 255.3 GiB (its LP relaxation: 257.5)."""
    return sum(floor for floor, _ in hold_floors(problem, bound_holds(problem)))


def bound_holds(problem: Problem) -> dict[tuple[object, ...], HoldTerm]:
    """The hold terms of ``problem``: its own once its conversions are priced, else those
    :func:`_price_edges` would make, priced alone (the cheap part of it; ``problem.holds`` is left
    as it was)."""
    return problem.holds if problem.conversions_priced else _holds_alone(problem)


def hold_floors(problem: Problem, holds: dict[tuple[object, ...], HoldTerm]) -> list[tuple[float, tuple[tuple[object, ...], ...]]]:
    """Per saved tensor (:func:`_root`), the bytes of it every plan holds (:func:`hold_floor`) and
    the hold terms that may keep them: whatever the plan, the sum over those terms of
    ``nbytes * (1 - recomputed)`` times their indicators is at least the floor."""
    least: dict[tuple[object, ...], dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    keys: dict[tuple[object, ...], dict[tuple[object, ...], None]] = defaultdict(dict)  # per tensor, its hold terms in order
    for key, hold in holds.items():
        kept = hold.nbytes * (1 - hold.recomputed)
        for gu, iu, gv, _ in hold.conditions:
            if gv is not None or not kept:
                continue
            per = least[key[1:3]][gu]
            for j in iu:
                per[j] = min(per.get(j, kept), kept)
            keys[key[1:3]][key] = None
    return [(max(min(per.get(j, 0.0) for j in range(len(problem.groups[g].strategies))) for g, per in savers.items()), tuple(keys[root]))
            for root, savers in least.items()]


def _holds_alone(problem: Problem) -> dict[tuple[object, ...], HoldTerm]:
    """The hold terms :func:`_price_edges` would make, without its conversions (``problem.holds``
    is left as it was)."""
    graph, own = problem.graph, problem.holds
    problem.holds = {}
    try:
        for v in graph.nodes.values():
            if v.kind == "output" or v.template != v.name:
                continue
            for p, ref in enumerate(v.inputs):
                if graph.nodes[ref.node].outputs[ref.index] is not None:
                    _price_holds(problem, v, p, ref)
        return problem.holds
    finally:
        problem.holds = own


def _first_consumer_recomputed(problem: Problem, producer: str, index: int) -> bool:
    """Whether the first op (graph order) reading output ``index`` of ``producer`` runs in a recomputed segment."""
    graph = problem.graph
    first = next((c for c, q in graph.consumers()[producer] if graph.nodes[c].inputs[q].index == index and graph.nodes[c].kind == "op"), None)
    return first is not None and problem.recomputes(graph.nodes[first])


def _price_holds(problem: Problem, v: Node, p: int, ref: InputRef) -> None:
    """Inputs ``v`` saves for backward, as hold terms keyed by the storage they keep alive."""
    graph, _mesh = problem.graph, problem.mesh
    saved_inputs = {s.index for s in v.saved if s.source == "input"}
    saved_output = any(s.source == "output" for s in v.saved)
    gv = problem.node_group[v.name]
    if p in saved_inputs:
        root = _root(graph, ref)
        _add_hold(problem, root, gv, [(j, s.inputs[p]) for j, s in enumerate(problem.choices[v.name]) if p < len(s.inputs)], v)
    if p == 0 and saved_output and v.template == v.name:
        root = _root(graph, InputRef(v.name, 0))
        _add_hold(problem, root, gv, [(j, s.outputs[0]) for j, s in enumerate(problem.choices[v.name]) if s.outputs and s.outputs[0] is not None], v)  # type: ignore[misc]
    if problem.recomputes(v):
        _segment_input(problem, v, p, ref)


def _segment_input(problem: Problem, v: Node, p: int, ref: InputRef) -> None:
    """An input of a recomputed segment read by its op ``v`` (its ``p``-th): the checkpoint keeps it, as its
    producer made it, from forward to the segment's backward, whether or not an op saves it
    (measured, HF GPT-2 with eager attention under selective recomputation: the causal mask added
    to the scores, 8 KB of its 1-D plan's 165 KB, which no op saves). One storage read by every
    instance (made once, outside the stack) is held once."""
    graph = problem.graph
    segment_of = problem.segment_of
    u = graph.nodes[ref.node]
    if u.kind != "op" or segment_of.get(u.name) == segment_of[v.name]:
        return
    roots = {_root(graph, w.inputs[p]) for w in instances_of(graph)[v.template] if problem.recomputes(w)}
    made = [(i, s.outputs[ref.index]) for i, s in enumerate(problem.choices[u.template]) if ref.index < len(s.outputs)]
    _add_hold(problem, _root(graph, ref), problem.node_group[u.name], [(i, spec) for i, spec in made if spec is not None], v,
              instances=len(roots), checkpoint=True)


def _add_hold(problem: Problem, root: InputRef, gv: str, specs: list[tuple[int, Spec]], v: Node, instances: int | None = None,
              checkpoint: bool = False) -> None:
    graph, mesh = problem.graph, problem.mesh
    root_node = graph.nodes[root.node]
    meta = root_node.outputs[root.index]
    if meta is None:
        return
    by_axes: dict[frozenset[str], set[int]] = defaultdict(set)
    for j, spec in specs:
        by_axes[spec.layout.shard_axes].add(j)
    instances = problem.instances[v.template] if instances is None else instances
    # made inside the saver's recomputed segment (a parameter's converted copy, an op of the same
    # instance): recomputed, in the instances recomputed; a segment's input (made outside the
    # instance) is kept by the checkpoint, in the instances recomputed
    inside = problem.recomputes(v) and (root_node.kind == "param" or problem.segment_of.get(root_node.name) == problem.segment_of[v.name])
    share = problem.recomputed_instances(v.template) / problem.instances[v.template] if inside else 0.0
    for axes, idx in by_axes.items():
        key = ("hold", root_node.template, root.index, axes)
        term = problem.holds.get(key)
        if term is None:
            term = HoldTerm(key, meta.nbytes / mesh.group_size(axes) * instances, saver=v.template, recomputed=share, checkpointed=checkpoint)
            problem.holds[key] = term
        elif not inside:  # another saver keeps it through the step
            term.recomputed = 0.0
            term.checkpointed = term.checkpointed and checkpoint
        if root_node.kind == "param":
            gp = problem.node_group[root_node.name]
            stored = frozenset(
                i for i, s in enumerate(problem.choices[root_node.name]) if s.outputs[0] is not None and s.outputs[0].layout.shard_axes != axes
            )
            if stored:
                term.conditions.append((gp, stored, gv, frozenset(idx)))
        else:
            term.conditions.append((gv, frozenset(idx), None, frozenset()))
