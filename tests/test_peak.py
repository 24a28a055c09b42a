"""Specification of :mod:`planner.peak`: the step's peak memory taken at the op where it happens.

The ILP's peak rows equal the evaluation (tests/test_solver.py and tests/test_front.py compare the
solver with brute force over every assignment); these tests pin what the peak means: at least
every activation and every gradient, at most their sum with the gradients in flight and the
largest working set; a working set charged with only the activations saved before it; a number
of rows that does not grow with a model's depth (repeated layers: their first and last instance).
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from planner.front import memory_lower_bound
from planner.hardware import A100_80G
from planner.mesh import Mesh
from planner.models import GPT, GPTConfig
from planner.problem import build_problem, evaluate
from planner.trace import trace
from tests.test_solver import CASES, case


def test_every_plan_peaks_between_its_largest_term_and_the_sum_of_all() -> None:
    """max(A, G) <= the moving part of the peak <= A + G + every gradient in flight + the largest
    working set, on 100 plans of each brute-force case; the op it names is one of the graph's."""
    rng = random.Random(0)
    for name in CASES:
        c = case(name)
        problem = c.problem
        for _ in range(100):
            assignment = {k: rng.randrange(n) for k, n in zip(c.keys, c.sizes, strict=True)}
            ev = evaluate(problem, assignment)
            m = ev.memory
            during = max(m["activations"], m["grads"]) + m["transient"]
            flight = sum(max(f.values(), default=0.0) for p in problem.instants or [] for f in [p.in_flight])
            work = max((max(w.values(), default=0.0) for p in problem.instants or [] for w in p.work), default=0.0)
            assert max(m["activations"], m["grads"]) <= during <= m["activations"] + m["grads"] + flight + work + 1e-6, (name, m)
            assert ev.peak_at.split(" ")[0] in problem.graph.nodes or ev.peak_at == "", ev.peak_at


class _Funnel(nn.Module):
    """A wide projection first (the largest working set: its 64 x 4096 input and 4096 x 16
    weight), then twelve small layers that save their activations."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(4096, 16)
        self.small = nn.ModuleList(nn.Linear(16, 16) for _ in range(12))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wide(x)
        for layer in self.small:
            h = torch.tanh(layer(h))
        return h.square().mean()


def test_a_working_set_is_charged_with_only_the_activations_saved_before_it() -> None:
    """The wide projection runs before the small layers save anything (forward) and after they
    have freed it all (backward): the peak is below every activation plus its working set."""
    graph = trace(_Funnel(), (torch.randn(64, 4096),))
    problem = build_problem(graph, Mesh(("dp", "tp"), (1, 1)), A100_80G)
    ev = evaluate(problem, {k: 0 for k in problem.groups})
    first = next(n for n in graph.nodes.values() if n.kind == "op" and n.module_path == "wide")
    wide = problem.node_terms[first.name].work[0]
    assert ev.peak_at.startswith(first.name), ev.peak_at
    after = sum(problem.node_terms[n.template].saved[0] for n in graph.nodes.values() if n.module_path.startswith("small"))
    held_after = sum(h.nbytes for key, h in problem.holds.items() if graph.nodes[h.saver].module_path.startswith("small"))
    assert after + held_after > 0
    during = max(ev.memory["activations"], ev.memory["grads"]) + ev.memory["transient"]
    assert during < ev.memory["activations"] + wide


def test_the_peak_rows_do_not_grow_with_depth() -> None:
    """A repeated layer's ops are instants in its first and last instance only: a 2-layer and an
    8-layer GPT have the same number of instants and of what may run at them."""
    sizes = []
    for layers in (2, 8):
        with torch.device("meta"):
            model = GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=64, block_size=16, vocab_size=256))
        ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
        graph = trace(model, (ids, ids))
        problem = build_problem(graph, Mesh(("dp", "tp"), (2, 2)), A100_80G)
        points = problem.instants or []
        sizes.append((len(points), sum(len(p.work) for p in points)))
    assert sizes[0] == sizes[1], sizes


def test_cdp_peak_rows_equal_the_evaluation_and_count_the_stage_buffers() -> None:
    """CDP v1 (with and without ZeRO-1) on dp=2 x tp=2, 2 stages: the least-memory MIP equals brute
    force over every assignment, and every plan's peak holds v1's previous buffer at every instant
    (its activations and its gradients each beside it) and a stage's partial sum beside its gradients."""
    from planner.schemes.cdp import cdp_filter
    from planner.solve import solve
    from tests.test_solver import _graph

    graph = _graph("two-linear")
    for zero in (0, 1):
        mesh = Mesh(("dp", "tp"), (2, 2))
        problem = build_problem(graph, mesh, A100_80G, cdp="v1", cdp_stages=2, zero_stage=zero, allow=cdp_filter(graph, mesh.dp_axes))
        keys = list(problem.groups)
        sizes = [len(problem.groups[k].strategies) for k in keys]
        assert len(problem.stage_sums) == 2 and len(problem.stage_ends) == 1
        least = float("inf")
        for combo in itertools.product(*(range(n) for n in sizes)):
            assignment = dict(zip(keys, combo, strict=True))
            ev = evaluate(problem, assignment)
            least = min(least, ev.peak_memory)
            m = ev.memory
            value = {("x", g, i): 1.0 for g, i in assignment.items()}
            held = sum(problem.node_terms[p.template].held[assignment[problem.node_group[p.name]]] for p in graph.params)
            stage0 = sum(v * value.get(var, 0.0) for var, v in problem.stage_sums[0].items())
            assert held > 0 and stage0 > 0
            during = max(m["activations"], m["grads"]) + m["transient"]
            assert during >= m["activations"] + held - 1e-6, (zero, combo, m, held)
            assert m["step_transient"] >= stage0 - 1e-6, (zero, combo, m, stage0)
        sol = solve(problem, memory_budget=float("inf"), objective="memory")
        assert sol.evaluation.peak_memory == pytest.approx(least, rel=1e-6), (zero, sol.evaluation.peak_memory, least)
        assert memory_lower_bound(problem, instants=True) <= least * (1 + 1e-12)  # the bounds without an ILP hold under CDP too
