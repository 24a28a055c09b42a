"""Activation recomputation as a searched dimension (planner.schemes.recompute).

The runtime side is checked elsewhere: same losses and gradients as one device and collectives
executed = priced with the recomputed forwards' collectives in tests/test_same_math.py (DP, Megatron
1-D, dp x tp ZeRO-1 and 3-D plans, every block and the first block of two) and
tests/test_hf_sharded.py (Hugging Face models, 1-D), which also checks held = predicted (within its
10 %; every layer, attention cores, and the first half of GPT-2's and Llama's layers); the ILP
against brute force in tests/test_solver.py ("repeated/dp1xtp2 recompute", "... recompute half")."""

from __future__ import annotations

import functools
from fractions import Fraction

import pytest
import torch

from planner.cli import load_model
from planner.config import SearchConfig
from planner.hardware import A100_80G
from planner.ir import IRGraph
from planner.mesh import Mesh
from planner.problem import build_problem, evaluate
from planner.schemes.recompute import last_savers, layers_recomputed, parse, recomputed_layers, segments, setting
from planner.search import search
from planner.solve import solve
from planner.space import candidate_meshes
from planner.trace import trace


@functools.cache
def _gpt_tiny():  # type: ignore[no-untyped-def]
    model, args, kwargs, _ = load_model("gpt-tiny", 8)
    return trace(model, args, kwargs)


def test_a_segment_is_a_layer_instance_up_to_its_last_op_that_saves() -> None:
    graph = _gpt_tiny()
    inside = segments(graph)
    instances = {key for key in inside.values()}
    assert instances == {("h", 0, 0), ("h", 1, 0)}
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
    space = SearchConfig(devices=4, tp=("none",), zero=(0, 3), cdp=("off", "v1"), recompute=("none", "full"))
    configs = candidate_meshes(space, 8)
    full = [c for c in configs if c.settings["recompute"] == "full"]
    assert {(c.zero, c.cdp) for c in full if not c.reason} == {(0, "off")}
    assert all("ZeRO-3" in c.reason or "CDP" in c.reason for c in full if c.reason)
    with pytest.raises(ValueError, match=r"recompute\.0 = 'attention': Input should be 'none', 'selective' or 'full'"):
        SearchConfig.build(devices=4, recompute=("attention",))
    with pytest.raises(ValueError, match="ZeRO 0-2"):
        build_problem(_gpt_tiny(), Mesh(("dp",), (4,)), A100_80G, zero_stage=3, recompute="full")


def test_the_front_gains_points_below_the_least_memory_without_recomputation() -> None:
    graph = _gpt_tiny()
    space = dict(devices=2, tp=("1d",), dp=1)
    without = search(graph, SearchConfig(**space), model_name="gpt-tiny")  # type: ignore[arg-type]
    both = search(graph, SearchConfig(**space, recompute=("none", "full")), model_name="gpt-tiny")  # type: ignore[arg-type]
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


def _between_none_and_full(graph: IRGraph, middle: str, solved: str) -> None:
    """The same strategies (the least-memory plan of recompute ``solved``, 1-D over 2 devices)
    recomputing ``middle`` hold fewer activations than none and more than full, cost less
    recomputation time than full, and are slower than none by exactly their recompute time."""
    mesh = Mesh(("dp", "tp"), (1, 2))
    problems = {mode: build_problem(graph, mesh, A100_80G, recompute=mode) for mode in ("none", middle, "full")}
    small = solve(problems[solved], memory_budget=float("inf"), objective="memory").assignment
    ev = {mode: evaluate(pb, small) for mode, pb in problems.items()}
    assert ev["full"].memory["activations"] < ev[middle].memory["activations"] < ev["none"].memory["activations"], middle
    assert 0 < ev[middle].recompute_time < ev["full"].recompute_time, middle
    assert ev[middle].step_time - ev["none"].step_time == pytest.approx(ev[middle].recompute_time, rel=1e-9)


def test_selective_recomputes_the_attention_cores_between_none_and_full() -> None:
    """Selective segments are the attention cores: the fused SDPA op of this project's GPT, and on
    GPT-2 with eager attention the ops from q k^T to p v (scale, mask, softmax, dropout between).
    For the same strategies it holds fewer activations than none and more than full, and costs
    less time than full; a model without attention has no selective configuration."""
    pytest.importorskip("transformers")
    from tests.dist_checks import build, inputs

    cores = segments(_gpt_tiny(), "selective")
    assert sorted(_gpt_tiny().nodes[n].target for n in cores) == ["aten.scaled_dot_product_attention.default"] * 2
    graph = trace(build("hf-gpt2-eager", torch.float32), *inputs("hf-gpt2-eager", 8, torch.float32))
    cores = segments(graph, "selective")
    assert {key for key in cores.values()} == {("transformer.h", 0, 0), ("transformer.h", 1, 0)}
    targets = [graph.nodes[n].target.split(".")[1] for n, key in cores.items() if key[1] == 0]
    assert targets[0] == targets[-1] == "matmul" and "softmax" in targets and "dropout" in targets and "linear" not in targets, targets
    ends = last_savers(graph, "selective")  # p v ends each core
    assert len(ends) == 2 and all(graph.nodes[n].target.startswith("aten.matmul") and n in cores for n in ends)
    _between_none_and_full(graph, "selective", solved="selective")
    from tests.test_solver import _graph

    result = search(_graph("repeated"), SearchConfig(devices=2, recompute=("none", "selective"), front=False), model_name="repeated")
    pruned = [c for c in result.candidates if c.settings["recompute"] == "selective"]
    assert pruned and all("no repeated layer of this model has an attention core" in c.reason for c in pruned)
    model, args, kwargs, _ = load_model("mlp-tiny", 8)  # no repeated layers at all: no recomputing configuration
    result = search(trace(model, args, kwargs), SearchConfig(devices=2, recompute=("none", "full"), front=False), model_name="mlp-tiny")
    pruned = [c for c in result.candidates if c.settings["recompute"] == "full"]
    assert pruned and all("this model has no repeated layers to recompute" in c.reason for c in pruned)


def test_a_plan_names_the_segment_each_node_recomputes_in() -> None:
    """The runtime checkpoints what the plan says (NodePlan.recompute_segment, ends_segment), not a
    rule of its own: one segment per layer instance (full) or attention core (selective)."""
    graph = _gpt_tiny()
    for mode, ops in (("full", None), ("selective", 1)):
        result = search(graph, SearchConfig(devices=2, dp=1, tp=("1d",), recompute=(mode,), front=False), model_name="gpt-tiny")
        plan = result.best
        assert plan is not None and plan.recompute == mode
        marked = {n.name: n.recompute_segment for n in plan.nodes if n.recompute_segment is not None}
        assert marked == {name: key[1] for name, key in segments(graph, mode).items()}  # numbered in graph order: instance 0, 1
        assert {n.name for n in plan.nodes if n.ends_segment} == last_savers(graph, mode)
        assert ops is None or all(sum(1 for s in marked.values() if s == k) == ops for k in (0, 1))
    plain = search(graph, SearchConfig(devices=2, dp=1, tp=("1d",), front=False), model_name="gpt-tiny").best
    assert plain is not None and all(n.recompute_segment is None and not n.ends_segment for n in plain.nodes)


def test_a_share_recomputes_the_first_layers_of_each_stack_and_prices_only_those() -> None:
    """``recompute="full 1/2"``: the first half of each stack's layers (rounded half up) run as
    recomputed segments, the others keep their activations. For the same strategies the step
    gains the recomputed instances' forwards only, and the activations held lie between none and
    full; the explain text names the layers. (ILP against brute force: tests/test_solver.py
    "repeated/dp1xtp2 recompute half"; the runtime: tests/test_same_math.py and, held = predicted,
    tests/test_hf_sharded.py "1d-recompute-half".)"""
    graph = _gpt_tiny()
    assert {key for key in segments(graph, "full 1/2").values()} == {("h", 0, 0)}
    assert layers_recomputed(12, Fraction(1, 2)) == 6 and layers_recomputed(3, Fraction(1, 2)) == 2 and layers_recomputed(2, Fraction(1, 4)) == 1
    assert parse("full 1/2") == ("full", Fraction(1, 2)) and setting("full", 0.5) == "full 1/2" and setting("full", 1.0) == "full"
    _between_none_and_full(graph, "full 1/2", solved="full")
    plan = search(graph, SearchConfig(devices=2, dp=1, tp=("1d",), recompute=("full",), recompute_layers=(0.5,), front=False),
                  model_name="gpt-tiny").best
    assert plan is not None and plan.recompute == "full 1/2"
    assert {n.recompute_segment for n in plan.nodes} == {None, 0}
    assert recomputed_layers(plan) == "h.0 (1 of 2 layers)"


def test_the_shares_searched_fill_the_front_between_none_and_full() -> None:
    """With ``recompute_layers=(0.5, 1)`` the front gains points between keeping every activation
    and recomputing every layer. On a 2-layer GPT, recomputing the first layer only needs the
    least memory that recomputing both does (the last layer's backward comes first, when every
    activation is alive, and its recomputed saves are alive again then: recomputing it saves nothing
    at this model's peak) and is faster: the whole
    recomputing end of the front is the share's. Shares that round to no layer, or to all of
    them, are not searched."""
    graph = _gpt_tiny()
    space = dict(devices=2, tp=("1d",), dp=1, recompute=("none", "full"))
    whole = search(graph, SearchConfig(**space), model_name="gpt-tiny")  # type: ignore[arg-type]
    shares = search(graph, SearchConfig(**space, recompute_layers=(0.5, 1.0)), model_name="gpt-tiny")  # type: ignore[arg-type]
    halves = [p for p in shares.front if p.recompute == "full 1/2"]
    assert halves and shares.front[-1] in halves
    assert shares.front[-1].peak_memory_bytes == whole.front[-1].peak_memory_bytes
    assert shares.front[-1].step_time_s < whole.front[-1].step_time_s
    pruned = search(graph, SearchConfig(**space, recompute_layers=(0.1, 0.25, 0.75), front=False), model_name="gpt-tiny")  # type: ignore[arg-type]
    reasons = {c.settings["recompute"]: c.reason for c in pruned.candidates}
    assert "1/10 of 2 layers rounds to none" in reasons["full 1/10"], reasons
    assert "3/4 of 2 layers rounds to all of them" in reasons["full 3/4"] and "rounds" not in reasons["full 1/4"], reasons
    with pytest.raises(ValueError, match=r"recompute_layers are shares of each stack's layers, in \(0, 1\]"):
        SearchConfig.build(devices=2, recompute=("full",), recompute_layers=(0, 1))
    with pytest.raises(ValueError, match=r"and recompute is none: search one \(e.g. --recompute none,full --recompute-layers 0.5\)"):
        SearchConfig.build(devices=2, recompute_layers=(0.5,))
