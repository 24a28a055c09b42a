"""The logical device mesh: named axes with degrees, laid out row-major over global ranks.

A mesh ``dp=4 x tp=2`` over 8 devices puts rank ``r`` at coordinates
``(r // 2, r % 2)``: the last axis is the innermost, its groups are runs of consecutive ranks,
so it is the one mapped onto the fastest links (devices of one node are consecutive ranks).

Each axis has a role (:class:`AxisRole`), typed data on the mesh: a ``DATA`` axis only ever splits
activations along batch-like dimensions and never shards parameters (ZeRO shards parameter
*storage* over it); a ``TENSOR`` axis splits ops, parameters included. Code asks the mesh
(``dp_axes``, ``tp_axes``, ``role``), never an axis's name. Where roles are not given, they come
from the names by one convention, :func:`roles_from_names`: ``dp`` or ``dp*`` is ``DATA``, every
other axis ``TENSOR``. There is no pipeline role: nothing in the planner or runtime places stages
on a mesh axis (CDP's stages run on the data-parallel axis).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property


class AxisRole(StrEnum):
    """What a mesh axis splits: ``DATA`` the batch (data parallelism, ZeRO, CDP), ``TENSOR`` the
    ops and their parameters (tensor parallelism). Plans store the value (``"data"``)."""

    DATA = "data"
    TENSOR = "tensor"


def roles_from_names(axes: Iterable[str]) -> tuple[AxisRole, ...]:
    """The naming convention, the one place a role is read off a name: an axis named ``dp`` or
    starting with ``dp`` (``dp_outer``) is ``DATA``, every other axis ``TENSOR``. Meshes built
    without roles, and plans saved before plans stored roles, get their roles from it."""
    return tuple(AxisRole.DATA if a.startswith("dp") else AxisRole.TENSOR for a in axes)


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes (outermost first), their degrees and roles (one per axis; left out, they
    come from the names: :func:`roles_from_names`)."""

    axes: tuple[str, ...]
    degrees: tuple[int, ...]
    roles: tuple[AxisRole, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.degrees):
            raise ValueError(f"mesh axes {self.axes} and degrees {self.degrees} differ in length")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"mesh axis names must be unique, got {self.axes}")
        for name, degree in zip(self.axes, self.degrees, strict=True):
            if degree < 1:
                raise ValueError(f"mesh axis {name!r} has degree {degree}; degrees must be >= 1")
        if not self.roles:
            object.__setattr__(self, "roles", roles_from_names(self.axes))
        elif len(self.roles) != len(self.axes):
            raise ValueError(f"mesh axes {self.axes} are {len(self.axes)} but roles {tuple(map(str, self.roles))} are {len(self.roles)}: "
                             "give one role per axis (or none, for the naming convention)")
        else:
            object.__setattr__(self, "roles", tuple(_role(a, r) for a, r in zip(self.axes, self.roles, strict=True)))

    @classmethod
    def from_dict(cls, degrees: Mapping[str, int], roles: Mapping[str, AxisRole] | None = None) -> Mesh:
        """A mesh from ``{axis: degree}`` in axis order (a plan's ``mesh``), with ``{axis: role}``
        (a plan's ``mesh_roles``) naming the same axes, or roles from the names when ``None``."""
        if roles is None:
            return cls(tuple(degrees), tuple(degrees.values()))
        if set(roles) != set(degrees):
            missing, extra = [a for a in degrees if a not in roles], [a for a in roles if a not in degrees]
            raise ValueError(f"mesh {mesh_text(degrees)}: roles are given for axes {list(roles)}"
                             + (f"; none for {missing}" if missing else "") + (f"; {extra} are not mesh axes" if extra else ""))
        return cls(tuple(degrees), tuple(degrees.values()), roles=tuple(roles[a] for a in degrees))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.axes, self.degrees, strict=True))

    def roles_dict(self) -> dict[str, AxisRole]:
        """``{axis: role}`` in axis order, as plans store it (``Plan.mesh_roles``)."""
        return dict(zip(self.axes, self.roles, strict=True))

    @property
    def size(self) -> int:
        n = 1
        for d in self.degrees:
            n *= d
        return n

    @cached_property
    def _degree_of(self) -> dict[str, int]:
        return dict(zip(self.axes, self.degrees, strict=True))

    @cached_property
    def _group_sizes(self) -> dict[tuple[str, ...] | frozenset[str], int]:
        return {}  # group_size's answers: a problem asks for the same few groups hundreds of thousands of times

    def degree(self, axis: str) -> int:
        try:
            return self._degree_of[axis]
        except KeyError:
            raise ValueError(f"mesh {self} has no axis {axis!r}") from None

    def group_size(self, axes: tuple[str, ...] | frozenset[str]) -> int:
        n = self._group_sizes.get(axes)
        if n is None:
            n = 1
            for a in axes:
                n *= self.degree(a)
            self._group_sizes[axes] = n
        return n

    def role(self, axis: str) -> AxisRole:
        try:
            return self._role_of[axis]
        except KeyError:
            raise ValueError(f"mesh {self} has no axis {axis!r}") from None

    @cached_property
    def _role_of(self) -> dict[str, AxisRole]:
        return dict(zip(self.axes, self.roles, strict=True))

    @cached_property
    def dp_axes(self) -> tuple[str, ...]:
        """The ``DATA`` axes, in mesh order."""
        return tuple(a for a, r in zip(self.axes, self.roles, strict=True) if r is AxisRole.DATA)

    @cached_property
    def active_dp_axes(self) -> tuple[str, ...]:
        """The ``DATA`` axes of degree > 1, in mesh order: the ones data parallelism (and ZeRO,
        and CDP) actually splits over."""
        return tuple(a for a in self.dp_axes if self.degree(a) > 1)

    @cached_property
    def tp_axes(self) -> tuple[str, ...]:
        """The ``TENSOR`` axes, in mesh order."""
        return tuple(a for a, r in zip(self.axes, self.roles, strict=True) if r is AxisRole.TENSOR)

    def is_dp(self, axis: str) -> bool:
        """Whether ``axis`` is a ``DATA`` axis (strategy enumeration asks per candidate: one dict lookup)."""
        try:
            return self._role_of[axis] is AxisRole.DATA
        except KeyError:
            raise ValueError(f"mesh {self} has no axis {axis!r}") from None

    def sort_axes(self, axes: frozenset[str] | set[str] | tuple[str, ...]) -> tuple[str, ...]:
        """Axes in mesh order (outermost first): the canonical order of a group."""
        return _sorted_axes(self, axes if isinstance(axes, (frozenset, tuple)) else frozenset(axes))

    def stride(self, axis: str) -> int:
        """Distance in global rank between neighbours along ``axis``."""
        i = self.axes.index(axis)
        s = 1
        for d in self.degrees[i + 1 :]:
            s *= d
        return s

    def coords(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for axis in self.axes:
            out[axis] = (rank // self.stride(axis)) % self.degree(axis)
        return out

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """All process groups spanning ``axes``: ranks that differ only in those coordinates.

        Each group lists ranks in row-major order of ``axes`` (so a group's local rank is the
        linearised coordinate over ``axes``, outermost first). Every rank is in exactly one group.
        """
        axes = self.sort_axes(axes)
        others = [a for a in self.axes if a not in axes]
        result = []
        for fixed in itertools.product(*(range(self.degree(a)) for a in others)):
            base = sum(c * self.stride(a) for a, c in zip(others, fixed, strict=True))
            group = []
            for moving in itertools.product(*(range(self.degree(a)) for a in axes)):
                group.append(base + sum(c * self.stride(a) for a, c in zip(axes, moving, strict=True)))
            result.append(group)
        return result

    def __str__(self) -> str:
        """``dp=4 x tp=2``; an axis whose role is not the one its name gives says it: ``x=2(data)``."""
        conventional = roles_from_names(self.axes)
        return " x ".join(f"{a}={d}" + (f"({r})" if r is not c else "")
                          for a, d, r, c in zip(self.axes, self.degrees, self.roles, conventional, strict=True))


_ROLES = frozenset(r.value for r in AxisRole)


def _role(axis: str, role: AxisRole | str) -> AxisRole:
    if role not in _ROLES:
        raise ValueError(f"mesh axis {axis!r} has role {role!r}; roles are {', '.join(sorted(_ROLES))}")
    return AxisRole(role)


def mesh_text(degrees: Mapping[str, int]) -> str:
    """``dp=8 x tp=8``: a mesh as plans store it (axis -> degree), as reports and errors print it."""
    return " x ".join(f"{a}={d}" for a, d in degrees.items())


@functools.lru_cache(maxsize=1 << 14)
def _sorted_axes(mesh: Mesh, axes: frozenset[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axes if a in axes)
