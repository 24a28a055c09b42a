"""Strategies: how one node is computed across the mesh, as data.

A :class:`Strategy` names an algorithm (``replicate``, ``dp``, ``tp1d-col``, ``tp1d-row``,
``vocab-parallel``, ...), the runtime kernel that computes the rank-local part, the :class:`Spec`
each tensor input must arrive in, the Spec of each output, the mesh axes the work is split over,
and the collectives the kernel issues internally (priced on the node; conversions between
neighbours are priced on edges by the solver).

Most ops are *einsum-like*: each operand dim carries a letter (``linear``:
``x[a,b,i] w[o,i] b[o] -> y[a,b,o]``). A strategy assigns each mesh axis (degree > 1) to one
letter or to none. Operands are then sharded on their letters' axes; an axis on a letter that the
output lacks (a contraction) makes the output a partial sum over it; an input replicated over an
axis that splits the work gets its gradient as a partial sum over that axis (see
:mod:`planner.layout`). Data-parallel axes may only take letters that no parameter carries.
Algorithm names follow from where the axes land (weight split on ``o``: ``tp1d-col``; on ``i``:
``tp1d-row``; only batch letters split: ``dp``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from planner.layout import Layout, Spec
from planner.mesh import Mesh

Phase = Literal["fwd", "bwd", "step"]


@dataclass(frozen=True)
class Comm:
    """One collective a rank issues: kind, group (mesh axes), payload bytes per rank, phase.
    ``bucket_bytes`` > 0: a gradient all-reduce packed into buckets of that size with others
    (:mod:`planner.buckets`), priced as its share of one."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    phase: Phase
    bucket_bytes: int = 0

    def __str__(self) -> str:
        return f"{self.phase}:{self.kind}({','.join(self.axes)}) {self.nbytes} B"


@dataclass(frozen=True)
class Strategy:
    algorithm: str
    kernel: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec | None, ...]
    split_axes: frozenset[str] = field(default_factory=frozenset)
    comms: tuple[Comm, ...] = ()
    # the kernel's raw output Spec when the strategy converts it before handing it on (a partial
    # sum reduce-scattered onto a batch dim, as 3-D and sequence parallelism do); None otherwise
    raw_output: Spec | None = None
    # inputs the kernel gathers itself and gathers again in backward instead of keeping the
    # gathered tensor saved (3-D's re-gathering variant): (input position, Spec it computes with)
    regather: tuple[tuple[int, Spec], ...] = ()

    def __str__(self) -> str:
        ins = ", ".join(str(s) for s in self.inputs)
        outs = ", ".join(str(s) for s in self.outputs)
        return f"{self.algorithm}: ({ins}) -> {outs}"


@dataclass(frozen=True)
class Operand:
    letters: str
    is_param: bool = False
    needs_grad: bool = True


def einsum_strategies(
    mesh: Mesh,
    operands: Sequence[Operand],
    out_letters: str,
    sizes: dict[str, int],
    *,
    splittable: Iterable[str] | None = None,
    partial_ok: bool = True,
    dp_letters: Iterable[str] | None = None,
    batch_letters: Iterable[str] | None = None,
    all_or_none: bool = True,
) -> list[tuple[tuple[Spec, ...], Layout, frozenset[str], dict[str, tuple[str, ...]]]]:
    """Every assignment of mesh axes to letters: (input specs, output layout, split axes, assignment).

    ``splittable`` restricts which letters may be sharded at all (default: every letter);
    contraction letters (absent from the output) produce partial outputs unless ``partial_ok`` is
    false. Data-parallel axes split the batch: only ``dp_letters`` (default: the first letter of
    the first operand, when that operand is not a parameter).

    Tensor-parallel axes are used all or not at all (an idle axis would only repeat work; the
    fully replicated strategy stays), unless ``all_or_none`` is false (attention, whose only
    splittable dims, batch and heads, may be too small for every axis). When ``batch_letters`` is given (matmul-like ops), the
    tensor-parallel axes land on distinct letters, at most one of them on a batch letter: the
    1-D, 2-D and 3-D algorithms are all of this form, and it keeps the count of strategies small
    (13 per linear on a 3-D mesh instead of hundreds).
    """
    letters = sorted({c for op in operands for c in op.letters} | set(out_letters))
    allowed = set(splittable) if splittable is not None else set(letters)
    param_letters = {c for op in operands if op.is_param for c in op.letters}
    if dp_letters is None:
        first = operands[0]
        dp_letters = first.letters[:1] if first.letters and not first.is_param else ""
    dp_ok = set(dp_letters) - param_letters
    axes = [a for a in mesh.axes if mesh.degree(a) > 1]
    options: list[list[str | None]] = []
    for axis in axes:
        opts: list[str | None] = [None]
        for c in letters:
            if c not in allowed:
                continue
            if mesh.is_dp(axis) and c not in dp_ok:
                continue
            if not partial_ok and c not in out_letters:
                continue
            opts.append(c)
        options.append(opts)
    results = []
    tp_positions = [n for n, a in enumerate(axes) if not mesh.is_dp(a)]
    batch = set(batch_letters) if batch_letters is not None else None
    for choice in itertools.product(*options):
        tp_letters = [choice[n] for n in tp_positions if choice[n] is not None]
        if all_or_none and tp_letters and len(tp_letters) != len(tp_positions):
            continue
        if batch is not None and (len(tp_letters) != len(set(tp_letters)) or sum(c in batch for c in tp_letters) > 1):
            continue
        assign: dict[str, tuple[str, ...]] = {c: () for c in letters}
        for axis, letter in zip(axes, choice, strict=True):
            if letter is not None:
                assign[letter] = (*assign[letter], axis)
        if any(sizes[c] % mesh.group_size(assign[c]) for c in letters):
            continue
        split = frozenset(a for a, letter in zip(axes, choice, strict=True) if letter is not None)
        partial = frozenset(a for c in letters if c not in out_letters for a in assign[c])
        out = Layout(tuple(assign[c] for c in out_letters), partial)
        ins = []
        for op in operands:
            lay = Layout(tuple(assign[c] for c in op.letters))
            grad = (split - lay.shard_axes) if op.needs_grad else frozenset()
            ins.append(Spec(lay, grad))
        results.append((tuple(ins), out, split, assign))
    return results


def enumerate_layouts(
    shape: tuple[int, ...], mesh: Mesh, *, axes: Iterable[str] | None = None, orders: bool = False, all_or_none: bool = True
) -> list[Layout]:
    """Every layout of ``shape`` sharding each given axis (degree > 1) on one dim or none.

    Data-parallel axes only ever shard dim 0 (the batch). With ``orders``, a dim sharded by
    several axes comes in every order of them (3-D stores a weight's input dim as ``(k, i)`` so
    that gathering over ``i`` leaves it split over ``k``). With ``all_or_none``, tensor-parallel
    axes shard something all together or not at all.
    """
    use = [a for a in (axes if axes is not None else mesh.axes) if mesh.degree(a) > 1]
    out = []
    options = [[None, 0] if mesh.is_dp(a) and shape else [None, *range(len(shape))] for a in use]
    tp_positions = [n for n, a in enumerate(use) if not mesh.is_dp(a)]
    for choice in itertools.product(*options):
        used = sum(choice[n] is not None for n in tp_positions)
        if all_or_none and used not in (0, len(tp_positions)):
            continue
        dims: list[tuple[str, ...]] = [() for _ in shape]
        for axis, d in zip(use, choice, strict=True):
            if d is not None:
                dims[d] = (*dims[d], axis)
        variants = itertools.product(*[itertools.permutations(d) for d in dims]) if orders else [tuple(dims)]
        for v in variants:
            lay = Layout(tuple(tuple(d) for d in v))
            if lay.divides(shape, mesh):
                out.append(lay)
    return out


def dedupe(strategies: Iterable[Strategy]) -> list[Strategy]:
    seen: set[Strategy] = set()
    out = []
    for s in strategies:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def split_label(mesh: Mesh, split: frozenset[str]) -> str:
    """``dp`` when only data-parallel axes split the work, ``replicate`` when none does."""
    if not split:
        return "replicate"
    if all(mesh.is_dp(a) for a in split):
        return "dp"
    return "split(" + ",".join(mesh.sort_axes(split)) + ")"


def with_dp(label: str, mesh: Mesh, split: frozenset[str]) -> str:
    if any(mesh.is_dp(a) for a in split) and label not in ("dp", "replicate"):
        return f"{label}+dp"
    return label
