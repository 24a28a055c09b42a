"""Kernels are found by kind (runtime/kernel_registry.py): one registered builder per kind, the
plain kernel (the traced op on local shards) for a kind without one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from planner.plan import NodePlan
from planner.runtime.kernel_registry import KERNELS, build_kernel, register
from planner.runtime.kernels import Kernel
from planner.trace import trace


class _Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sum()


def test_every_kernel_kind_the_runtime_implements_has_one_builder() -> None:
    assert set(KERNELS) == {"linear", "addmm", "summa", "layer_norm", "rms_norm", "embedding", "cross_entropy", "mean", "reshape"}


def test_a_kind_without_a_builder_runs_the_traced_op_on_its_inputs() -> None:
    graph = trace(_Double(), (torch.ones(3),))
    node = next(n for n in graph.nodes.values() if n.kind == "op" and "mul" in n.target)
    ctx = SimpleNamespace(fx_nodes={n.name: n for n in graph.graph_module.graph.nodes}, device=torch.device("cpu"))
    np = NodePlan(name=node.name, target=node.target, algorithm="replicate", kernel="op", inputs=(None,), outputs=(None,))
    kernel = build_kernel(ctx, node, np, [None], [None])  # type: ignore[arg-type]
    assert type(kernel) is Kernel
    assert torch.equal(kernel(torch.tensor([1.0, 2.0, 3.0])), torch.tensor([2.0, 4.0, 6.0]))


def test_a_kind_registered_twice_is_refused_and_the_registry_left_as_it_was() -> None:
    before = dict(KERNELS)
    with pytest.raises(ValueError, match="'linear'"):
        register("brand_new", "linear")(lambda ctx, node, np, ins, outs: Kernel(node.name, None, ((), {})))
    assert KERNELS == before
