"""The tensor-parallel families as search configurations: the meshes each family tiles a device
count with, and which family a solved assignment uses.

``none``: dp only; ``1d`` (Megatron): dp x tp; ``2d`` (SUMMA): dp x row x col, q x q; ``3d``
(Bian et al. 2021): dp x i x j x k, q x q x q. The tensor-parallel axes are the innermost, so they
land on the fastest links. Each family's per-op strategies are the rules of :mod:`planner.rules`
(data: einsum-like operand labels over the family's axes), its kernels the runtime's registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.mesh import AxisRole, Mesh

if TYPE_CHECKING:  # (annotations only: planner.config reads the meshes, and the plan holds a config)
    from planner.plan import TPFamily
    from planner.terms import Problem

DP_AXIS = "dp"  # the search's meshes: one data-parallel axis, outermost, then a family's tensor-parallel axes
TP_AXES = {"1d": ("tp",), "2d": ("row", "col"), "3d": ("i", "j", "k")}


def family_meshes(devices: int, family: str) -> list[Mesh]:
    """``none``: dp only; ``1d``: dp x tp (tp > 1); ``2d``: dp x row x col (q x q, q > 1);
    ``3d``: dp x i x j x k (q x q x q, q > 1). Tensor-parallel axes are the innermost, so they
    land on the fastest links (consecutive ranks share a node)."""
    if family == "none":
        return [_mesh(devices, TP_AXES["1d"], 1)]
    if family not in TP_AXES:
        raise ValueError(f"unknown tensor-parallel family {family!r}")
    axes = TP_AXES[family]
    meshes = []
    q = 2
    while q ** len(axes) <= devices:
        tp = q ** len(axes)
        if devices % tp == 0:
            meshes.append(_mesh(devices // tp, axes, q))
        q += 1
    return meshes


def _mesh(dp: int, tp_axes: tuple[str, ...], q: int) -> Mesh:
    """``dp`` x ``q`` per tensor-parallel axis, with the roles said, not read off the names."""
    return Mesh((DP_AXIS, *tp_axes), (dp, *([q] * len(tp_axes))), roles=(AxisRole.DATA, *([AxisRole.TENSOR] * len(tp_axes))))


def tp_family(problem: Problem, assignment: dict[str, int]) -> TPFamily:
    """The mesh's family if any node uses its tensor-parallel axes, else ``none``."""
    mesh = problem.mesh
    tp_axes = {a for a in mesh.tp_axes if mesh.degree(a) > 1}
    for name, strategies in problem.choices.items():
        s = strategies[assignment[problem.node_group[name]]]
        if s.split_axes & tp_axes or any(o is not None and o.layout.shard_axes & tp_axes for o in s.outputs):
            for family, axes in TP_AXES.items():
                if set(axes) == set(mesh.tp_axes):
                    return family  # type: ignore[return-value]
            return "mixed"
    return "none"
