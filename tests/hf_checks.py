"""Helpers for tests/test_hf_sharded.py: plans that really use a family, and several checks in one world.

``require_family`` is a strategy filter: every op that multiplies by a parameter (linear, addmm,
conv, MoE grouped matmul) uses every tensor-parallel axis of the mesh, wherever its shapes allow a
strategy that does. Planning with it (objective time) gives the family's fastest real plan: on
models this small the unconstrained fastest plan would replicate, and the least-memory MIPs of
2-D/3-D meshes take minutes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from planner.ir import IRGraph, Node
from planner.mesh import Mesh
from planner.rules import anchor_strategies
from planner.strategy import Strategy

WEIGHTED = ("aten.linear.default", "aten.addmm.default", "aten.conv2d.default", "transformers.grouped_mm_fallback.default")
FAMILY_AXES = {"1d": ("tp",), "2d": ("row", "col"), "3d": ("i", "j", "k")}


def family_mesh(family: str, devices: int, dp: int) -> Mesh:
    """The mesh the search builds for ``family`` over ``devices`` with data-parallel degree ``dp``."""
    axes = FAMILY_AXES[family]
    side = round((devices // dp) ** (1 / len(axes)))
    assert dp * side ** len(axes) == devices, (family, devices, dp)
    return Mesh(("dp", *axes), (dp, *[side] * len(axes)))


def require_family(graph: IRGraph, mesh: Mesh) -> Callable[[Node, Strategy], bool]:
    tp = {a for a in mesh.tp_axes if mesh.degree(a) > 1}
    can: dict[str, bool] = {}

    def allow(node: Node, s: Strategy) -> bool:
        if node.kind != "op" or node.target not in WEIGHTED or not any(graph.nodes[r.node].kind == "param" for r in node.inputs):
            return True
        if node.name not in can:
            can[node.name] = any(tp <= t.split_axes for t in anchor_strategies(node, graph, mesh))
        return not can[node.name] or tp <= s.split_axes

    return allow


def run_many(rank: int, world: int, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Each ``fn(rank, world, *args)`` in turn, in one spawned world (spawning and importing
    transformers are most of a small check's time); the results, then each call's seconds."""
    out, seconds = [], []
    for fn, args in calls:
        t0 = time.perf_counter()
        out.append(fn(rank, world, *args))
        seconds.append(round(time.perf_counter() - t0, 1))
    return [*out, seconds]


def failing_kernel_message(rank: int, world: int, name: str, plan_json: str, module: str) -> str:
    """The error a sharded forward raises when the kernel of the first op traced in ``module``
    fails (its forward replaced by one that raises): ``str`` of the :class:`runtime.module.KernelError`."""
    import torch

    from planner.plan import Plan
    from planner.runtime.compile import compile_plan
    from planner.runtime.module import KernelError
    from tests.dist_checks import BATCH, build, inputs

    model = build(name, torch.float32)
    args, kwargs = inputs(name, BATCH, torch.float32)
    pm = compile_plan(Plan.model_validate_json(plan_json), model, args, kwargs)
    fx_node = next(n for n in pm.graph_module.graph.nodes
                   if n.op == "call_module" and n.name in pm.node_origin and pm.graph.nodes[pm.node_origin[n.name]].module_path == module)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("injected failure")

    pm.graph_module.get_submodule(str(fx_node.target)).forward = broken  # type: ignore[method-assign]
    local_args, local_kwargs = pm.shard_batch(*args, **kwargs)
    try:
        pm(*local_args, **local_kwargs)
    except KernelError as exc:
        assert isinstance(exc.__cause__, RuntimeError) and "injected failure" in str(exc.__cause__)
        return str(exc)
    raise AssertionError("the forward did not fail")
