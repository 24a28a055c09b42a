"""The logical device mesh: named axes with degrees, laid out row-major over global ranks.

A mesh ``dp=4 x tp=2`` over 8 devices puts rank ``r`` at coordinates
``(r // 2, r % 2)``: the last axis is the innermost, its groups are runs of consecutive ranks,
so it is the one mapped onto the fastest links (devices of one node are consecutive ranks).

Axis names carry their role: axes named ``dp`` (or starting with ``dp``) are data-parallel axes:
they only ever split activations along batch-like dimensions and never shard parameters
(ZeRO, later, shards parameter *storage* over them). Every other axis is a tensor-parallel axis.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from functools import cached_property

DP_PREFIX = "dp"


@dataclass(frozen=True)
class Mesh:
    """Named mesh axes (outermost first) and their degrees."""

    axes: tuple[str, ...]
    degrees: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.axes) != len(self.degrees):
            raise ValueError(f"mesh axes {self.axes} and degrees {self.degrees} differ in length")
        if len(set(self.axes)) != len(self.axes):
            raise ValueError(f"mesh axis names must be unique, got {self.axes}")
        for name, degree in zip(self.axes, self.degrees, strict=True):
            if degree < 1:
                raise ValueError(f"mesh axis {name!r} has degree {degree}; degrees must be >= 1")

    @classmethod
    def from_dict(cls, degrees: dict[str, int]) -> Mesh:
        return cls(tuple(degrees), tuple(degrees.values()))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.axes, self.degrees, strict=True))

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

    @cached_property
    def dp_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if a.startswith(DP_PREFIX))

    @cached_property
    def tp_axes(self) -> tuple[str, ...]:
        return tuple(a for a in self.axes if not a.startswith(DP_PREFIX))

    def is_dp(self, axis: str) -> bool:
        return axis.startswith(DP_PREFIX)

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
        return mesh_text(dict(zip(self.axes, self.degrees, strict=True)))


def mesh_text(degrees: dict[str, int]) -> str:
    """``dp=8 x tp=8``: a mesh as plans store it (axis -> degree), as reports and errors print it."""
    return " x ".join(f"{a}={d}" for a, d in degrees.items())


@functools.lru_cache(maxsize=1 << 14)
def _sorted_axes(mesh: Mesh, axes: frozenset[str] | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axes if a in axes)
