"""Gradient accumulation (micro-batch counts) in the planner: what repeats per micro-batch and what
does not, how configurations are pruned, and the searched front against brute force.

The runtime side (same losses, gradients and parameters as one device, collectives executed equal
collectives priced, memory held equals memory predicted, with 2 micro-batches and ZeRO 0-3) runs
in tests/test_zero.py's 4-rank world.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
import torch

from planner.config import SearchConfig
from planner.cost import comm_time, optimizer_step_time
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.models import build_model, example_inputs
from planner.problem import build_problem, evaluate
from planner.search import search
from planner.space import candidate_meshes
from planner.trace import micro_batch_inputs, trace
from tests.test_front import _brute_front
from tests.test_solver import TwoLinear


def _gpt_tiny(batch: int):
    args, kwargs = example_inputs("gpt-tiny", batch=batch)
    return trace(build_model("gpt-tiny"), args, kwargs)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_forward_and_backward_repeat_per_micro_batch_and_the_step_does_not(zero: int) -> None:
    """The same micro-batch graph priced for 1 and for 3 micro-batches, for random plans: compute
    and every forward/backward collective (activations' conversions, ZeRO-2's and ZeRO-3's
    backward reduce-scatters, ZeRO-3's gathers) 3 times, the step phase's (gradient all-reduce,
    ZeRO-1's reduce-scatter, the parameter all-gathers) once, what prefetch and ZeRO-2's
    reduce-scatters hide 3 times, what the step-phase sync hides once, and the memory the same: one micro-batch's activations are alive at a time."""
    graph = _gpt_tiny(2)
    mesh = Mesh(("dp", "tp"), (2, 2))
    one = build_problem(graph, mesh, A100_80G, zero_stage=zero)
    three = build_problem(graph, mesh, A100_80G, zero_stage=zero, micro_batches=3)
    rng = random.Random(zero)
    phases = Counter()
    for _ in range(20):
        a = {k: rng.randrange(len(g.strategies)) for k, g in one.groups.items()}
        e1, e3 = evaluate(one, a), evaluate(three, a)
        assert e3.memory == pytest.approx(e1.memory, rel=1e-12)
        c1, c3 = Counter(), Counter()
        for c, n in e1.comms:
            c1[c] += n
        for c, n in e3.comms:
            c3[c] += n
        assert set(c1) == set(c3)
        for c in c1:
            assert c3[c] == c1[c] * (1 if c.phase == "step" else 3), (c, c1[c], c3[c])
            phases[c.phase] += 1
        # prefetch (ZeRO-3) and ZeRO-2's reduce-scatters hide beside every micro-batch's backward;
        # ZeRO-0/1's sync runs once, beside the last one's
        assert e3.overlap_time == pytest.approx((1 if zero in (0, 1) else 3) * e1.overlap_time, rel=1e-9, abs=1e-15)
        assert e3.step_time > e1.step_time
    assert phases["fwd"] and phases["bwd"] and (zero == 3 or phases["step"])


def test_micro_batch_time_is_three_passes_plus_one_step() -> None:
    """Step time with m micro-batches = m x (forward + backward, their collectives) + the step
    phase once, on a plan with both (dp=2 x tp=2, ZeRO-0: the gradient all-reduce is the step)."""
    graph = _gpt_tiny(2)
    mesh = Mesh(("dp", "tp"), (2, 2))
    one = build_problem(graph, mesh, A100_80G)
    three = build_problem(graph, mesh, A100_80G, micro_batches=3)
    a = {k: 0 for k in one.groups}
    e1, e3 = evaluate(one, a), evaluate(three, a)
    step = sum(comm_time(c, mesh, A100_80G) * n for c, n in e1.comms if c.phase == "step")
    assert step > 0
    assert e3.comm_time == pytest.approx(3 * (e1.comm_time - step) + step, rel=1e-9)
    # compute: the forward and backward three times, the optimizer's update once
    update = sum(optimizer_step_time("adamw", g.param_memory[0][0] / g.count, A100_80G) * g.count
                 for g in one.groups.values() if g.param_memory[0][0])
    assert update > 0
    assert e3.compute_time == pytest.approx(3 * (e1.compute_time - update) + update, rel=1e-9)


def test_configurations_with_micro_batches_are_pruned_with_a_reason() -> None:
    space = SearchConfig(devices=4, tp=("none",), zero=(0,), cdp=("off", "v1"), micro_batches=(1, 2, 4))
    cands = candidate_meshes(space, batch=8)
    reasons = {(c.cdp, c.micro_batches): c.reason for c in cands}
    assert reasons[("off", 1)] == reasons[("off", 2)] == ""
    assert "does not split into 4 micro-batches x 4 ways" in reasons[("off", 4)]
    assert "CDP staggers its own micro-batches" in reasons[("v1", 2)]
    with pytest.raises(ValueError, match=r"micro_batches are counts >= 1, got \[0\]"):
        SearchConfig.build(devices=4, micro_batches=(0,))


def test_the_search_asks_for_and_checks_the_micro_batch_graph() -> None:
    graph = _gpt_tiny(4)
    space = SearchConfig(devices=2, tp=("none",), micro_batches=(1, 2))
    with pytest.raises(ValueError, match="needs the graph of one micro-batch: pass micro_graph="):
        search(graph, space, model_name="gpt-tiny")
    with pytest.raises(ValueError, match=r"micro_graph\(2\) traced a batch of 4; one of 2 micro-batches of 4 has 2"):
        search(graph, space, model_name="gpt-tiny", micro_graph=lambda m: graph)


def test_micro_batch_inputs_split_dim_0_and_name_what_does_not_split() -> None:
    x, t = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    (a, b), kw = micro_batch_inputs((x, t), {"scale": 2.0}, 3, index=1)
    assert torch.equal(a, x[2:4]) and torch.equal(b, t[2:4]) and kw == {"scale": 2.0}
    with pytest.raises(ValueError, match=r"input 1 of shape \(6,\) does not split into 4 micro-batches"):
        micro_batch_inputs((x[:4], t), None, 4)


def test_the_searched_front_with_micro_batches_is_the_merged_brute_force_front() -> None:
    """Two linear layers on 4 devices (data parallel, Megatron 1-D, ZeRO 0 and 1) in 1 or 2
    micro-batches: every configuration enumerated on its micro-batch graph, the fronts merged; the
    search (resolution 0, no point cap) finds the same, and 2 micro-batches reach less memory."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TwoLinear(64, 256, 8)
    # a batch whose activations outweigh the weights, so that accumulation can save memory
    x, y = torch.empty(512, 64, device="meta"), torch.empty(512, dtype=torch.long, device="meta")
    graphs = {m: trace(model, *micro_batch_inputs((x, y), None, m)) for m in (1, 2)}
    space = SearchConfig(devices=4, tp=("none", "1d"), zero=(0, 1), micro_batches=(1, 2), resolution=0.0, max_points=None, relative_gap=0.0)
    every: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for cand in candidate_meshes(space, 512):
        if not cand.reason:
            every[cand.micro_batches] += _brute_front(graphs[cand.micro_batches], cand.mesh, cand.zero, cand.micro_batches)
    expected = []
    for t, m in sorted(every[1] + every[2]):
        if not expected or m < expected[-1][1]:
            expected.append((t, m))
    result = search(graphs[1], space, model_name="two-linear", micro_graph=graphs.__getitem__)
    found = [(p.step_time_s, float(p.peak_memory_bytes)) for p in result.front]
    assert len(found) == len(expected) >= 2, (found, expected)
    for (t, m), (bt, bm) in zip(found, expected, strict=True):
        assert m == pytest.approx(bm, abs=1.0) and t == pytest.approx(bt, rel=1e-6)
    assert min(m for _, m in every[2]) < min(m for _, m in every[1])
    assert {p.micro_batches for p in result.front} == {1, 2}
    assert all(a.step_time_s < b.step_time_s for a, b in itertools.pairwise(result.front))
