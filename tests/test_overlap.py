"""The gradient sync beside backward (planner.overlap.sync_rows): what the ILP hides is what a
communication stream running the buckets as backward releases them would hide."""

from __future__ import annotations

import random

import pytest

from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.models import build_model, example_inputs
from planner.overlap import sync_rows
from planner.problem import build_problem, evaluate
from planner.solve import solve
from planner.trace import match_layer, trace


@pytest.fixture(scope="module")
def gpt_graph():  # type: ignore[no-untyped-def]
    args, kwargs = example_inputs("gpt-tiny", batch=4)
    return trace(build_model("gpt-tiny"), args, kwargs)


def stream_exposure(graph, choice, sync, backward) -> float:  # type: ignore[no-untyped-def]
    """Simulated: backward runs the ops in reverse graph order; a parameter's sync is released when
    its block's backward ends (its first consumer's, outside the blocks) and the stream runs the
    released syncs one after another; the seconds it runs past the end of backward."""
    nodes = list(graph.nodes.values())
    block_start: dict[tuple[str, int], int] = {}
    for k, node in enumerate(nodes):
        layer = match_layer(node.module_path) if node.kind == "op" else None
        if layer is not None:
            block_start.setdefault(layer, k)
    position = {n.name: k for k, n in enumerate(nodes)}
    consumers = graph.consumers()
    bwd = [backward[n.template][choice[n.name]] if n.template in backward else 0.0 for n in nodes]
    end_of = {}  # position -> the backward time at which the ops from there on have run
    clock = 0.0
    for k in range(len(nodes) - 1, -1, -1):
        clock += bwd[k]
        end_of[k] = clock
    released = []
    for node in nodes:
        if node.kind != "param" or node.template not in sync:
            continue
        users = [c for c, _ in consumers[node.name] if graph.nodes[c].kind == "op"]
        first = min(users, key=position.__getitem__)
        layer = match_layer(graph.nodes[first].module_path)
        point = block_start[layer] if layer is not None else position[first]
        released.append((end_of[point], sync[node.template][choice[node.name]]))
    finish = 0.0
    for ready, t in sorted(released):
        finish = max(finish, ready) + t
    return max(0.0, finish - clock)


@pytest.mark.parametrize("seed", range(5))
def test_the_exposure_rows_equal_a_simulated_communication_stream(gpt_graph, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    graph = gpt_graph
    strategies = 3
    sync = {n.template: [rng.uniform(0, 2e-3) for _ in range(strategies)] for n in graph.nodes.values() if n.kind == "param"}
    backward = {n.template: [rng.uniform(0, 1e-3) for _ in range(strategies)] for n in graph.nodes.values() if n.kind == "op"}
    node_group = {n.name: n.template for n in graph.nodes.values()}
    choice_of = {t: rng.randrange(strategies) for t in {n.template for n in graph.nodes.values()}}
    choice = {n.name: choice_of[n.template] for n in graph.nodes.values()}
    rows = sync_rows(graph, node_group, sync, backward)
    exposed = max(0.0, *(sum(v for (_, g, i), v in row.items() if choice_of[g] == i) for row in rows))  # type: ignore[misc]
    assert exposed == pytest.approx(stream_exposure(graph, choice, sync, backward), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("efficiency", [0.0, 0.5, 1.0])
def test_the_ilp_prices_the_overlapped_sync_exactly_as_the_evaluation(gpt_graph, efficiency: float) -> None:  # type: ignore[no-untyped-def]
    hw = A100_80G.model_copy(update={"overlap_efficiency": efficiency})
    problem = build_problem(gpt_graph, Mesh(("dp", "tp"), (4, 2)), hw)
    assert problem.sync_rows  # data parallelism: the all-reduces run beside backward
    sol = solve(problem, memory_budget=float("inf"))
    ev = evaluate(problem, sol.assignment)
    assert sol.objective == pytest.approx(ev.step_time, rel=1e-6)
    synced = sum(g.sync[sol.assignment[k]] for k, g in problem.groups.items() if g.sync)
    assert synced > 0
    # what is hidden: at most the efficiency's share of the sync, and none of it when efficiency is 0
    assert ev.overlap_time <= efficiency * synced + 1e-15
    assert ev.step_time == pytest.approx(ev.compute_time + ev.comm_time - ev.overlap_time, rel=1e-9)
    if efficiency == 0.0:
        assert ev.overlap_time == 0.0
    else:
        assert ev.overlap_time > 0.0  # gpt-tiny's later blocks' gradients sync while earlier blocks run backward


def test_zero3_and_cdp_hide_their_own_way_not_through_the_sync_rows(gpt_graph) -> None:  # type: ignore[no-untyped-def]
    mesh = Mesh(("dp",), (4,))
    assert not build_problem(gpt_graph, mesh, A100_80G, zero_stage=3).sync_rows
    assert not build_problem(gpt_graph, mesh, A100_80G, cdp="v1", cdp_stages=2).sync_rows
    assert build_problem(gpt_graph, mesh, A100_80G, zero_stage=1).sync_rows  # reduce-scatter beside backward
