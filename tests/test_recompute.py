"""Activation recomputation as a searched dimension (planner.schemes.recompute).

The runtime side (same losses and gradients as one device, collectives executed = priced with the
recomputed forwards' collectives, held = predicted) is checked in tests/test_same_math.py (DP,
Megatron 1-D, dp x tp ZeRO-1 and 3-D plans) and tests/test_hf_sharded.py (Hugging Face models,
1-D); the ILP against brute force in tests/test_solver.py ("repeated/dp1xtp2 recompute")."""

from __future__ import annotations

import functools

import pytest

from planner.cli import load_model
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.problem import build_problem, evaluate
from planner.schemes.recompute import last_savers, segments
from planner.search import SearchSpace, candidate_meshes, search
from planner.solve import solve
from planner.trace import trace


@functools.cache
def _gpt_tiny():  # type: ignore[no-untyped-def]
    model, args, kwargs, _ = load_model("gpt-tiny", 8)
    return trace(model, args, kwargs)


def test_a_segment_is_a_layer_instance_up_to_its_last_op_that_saves() -> None:
    graph = _gpt_tiny()
    inside = segments(graph)
    instances = {key for key in inside.values()}
    assert instances == {("h", 0), ("h", 1)}
    for name, key in inside.items():
        node = graph.nodes[name]
        assert node.kind == "op" and (node.module_path + ".").startswith(f"h.{key[1]}.")
    ends = last_savers(graph)
    assert len(ends) == 2
    order = list(graph.nodes)
    for end in ends:
        assert graph.nodes[end].saved
        key = inside[end]
        after = [n for n in order[order.index(end) + 1:] if graph.nodes[n].kind == "op" and graph.nodes[n].layer == key[1]]
        assert after and all(n not in inside and not graph.nodes[n].saved for n in after)  # residual add, bias: outside, saving nothing


@pytest.mark.parametrize("mesh", [Mesh(("dp", "tp"), (1, 2)), Mesh(("dp", "tp"), (2, 2))], ids=str)
def test_recomputing_holds_fewer_activations_and_costs_the_forward_again(mesh: Mesh) -> None:
    """Same strategies, with and without recomputation: the activations held drop to the layers'
    inputs, the step gets slower by at most one forward of the layers (and its collectives), and
    the least-memory plan needs less."""
    graph = _gpt_tiny()
    plain = build_problem(graph, mesh, A100_80G)
    again = build_problem(graph, mesh, A100_80G, recompute="full")
    fast = solve(plain, memory_budget=float("inf")).assignment
    a, b = evaluate(plain, fast), evaluate(again, fast)
    assert b.memory["activations"] < 0.5 * a.memory["activations"], (a.memory, b.memory)
    assert a.step_time < b.step_time < 1.6 * a.step_time, (a.step_time, b.step_time)
    assert len(b.comms) >= len(a.comms)
    least_plain = solve(plain, memory_budget=float("inf"), objective="memory").evaluation.peak_memory
    least_again = solve(again, memory_budget=float("inf"), objective="memory").evaluation.peak_memory
    if mesh.degree("dp") == 1:  # (dp=2: the peak is the optimizer step's, where no activation lives)
        assert least_again < 0.9 * least_plain, (least_plain, least_again)
    else:
        assert least_again <= least_plain


def test_recomputation_runs_with_zero_0_to_2_and_without_cdp() -> None:
    space = SearchSpace(devices=4, tp=("none",), zero=(0, 3), cdp=("off", "v1"), recompute=("none", "full"))
    configs = candidate_meshes(space, 8)
    full = [c for c in configs if c.recompute == "full"]
    assert {(c.zero, c.cdp) for c in full if not c.reason} == {(0, "off")}
    assert all("ZeRO-3" in c.reason or "CDP" in c.reason for c in full if c.reason)
    with pytest.raises(ValueError, match="recompute modes are none, full"):
        SearchSpace(devices=4, recompute=("selective",))
    with pytest.raises(ValueError, match="ZeRO 0-2"):
        build_problem(_gpt_tiny(), Mesh(("dp",), (4,)), A100_80G, zero_stage=3, recompute="full")


def test_the_front_gains_points_below_the_least_memory_without_recomputation() -> None:
    graph = _gpt_tiny()
    space = dict(devices=2, tp=("1d",), dp=1)
    without = search(graph, SearchSpace(**space), A100_80G, model_name="gpt-tiny")  # type: ignore[arg-type]
    both = search(graph, SearchSpace(**space, recompute=("none", "full")), A100_80G, model_name="gpt-tiny")  # type: ignore[arg-type]
    least = without.front[-1].peak_memory_bytes
    below = [p for p in both.front if p.peak_memory_bytes < least]
    assert below and all(p.recompute == "full" for p in below)
    assert both.front[0].step_time_s == pytest.approx(without.front[0].step_time_s)  # the fastest plan keeps every activation


@pytest.mark.parametrize("mesh", [Mesh(("dp", "tp"), (1, 2)), Mesh(("dp", "tp"), (2, 2)), Mesh(("dp", "tp"), (1, 4))], ids=str)
def test_the_recompute_time_is_what_recomputing_adds_to_the_same_plan(mesh: Mesh) -> None:
    """``Evaluation.recompute_time`` (Plan.recompute_time_s, which explain prints) is exactly the
    step time the same strategies gain when their layers recompute: the forward compute and the
    forward collectives again (the least-memory assignment shards, so collectives rerun too)."""
    graph = _gpt_tiny()
    plain = build_problem(graph, mesh, A100_80G)
    again = build_problem(graph, mesh, A100_80G, recompute="full")
    small = solve(again, memory_budget=float("inf"), objective="memory").assignment
    a, b = evaluate(plain, small), evaluate(again, small)
    assert a.recompute_time == 0.0 and b.recompute_time > 0
    assert b.step_time - a.step_time == pytest.approx(b.recompute_time, rel=1e-9)
    assert b.comm_time > a.comm_time  # the sharded layers' forward collectives run again


def test_explain_says_which_layers_recompute_and_what_it_costs(capsys: pytest.CaptureFixture[str]) -> None:
    from planner.cli import main

    assert main(["explain", "gpt-tiny", "--devices", "2", "--tp", "1d", "--dp", "1", "--recompute", "full", "--best-only"]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if line.startswith("  recompute  "))  # the time section's row
    assert "of the step) of the above: the forward of h.* (2 layers) again in backward" in line, line
