"""Helpers for tests/test_hf_sharded.py: plans that really use a family, and several checks in one world.

``require_family`` is a strategy filter: every op that multiplies by a parameter (linear, addmm,
conv, MoE grouped matmul) uses every tensor-parallel axis of the mesh, wherever its shapes allow a
strategy that does. Planning with it (objective time) gives the family's fastest real plan: on
models this small the unconstrained fastest plan would replicate, and the least-memory MIPs of
2-D/3-D meshes take minutes.
"""

from __future__ import annotations

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
    transformers are most of a small check's time)."""
    return [fn(rank, world, *args) for fn, args in calls]
