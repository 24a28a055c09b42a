"""Layout conversions executed: the steps of :mod:`planner.layout`, autograd-aware and recorded.

:class:`Convert` runs a conversion's forward steps in forward and its backward steps on the
gradient in backward, exactly the lists the planner priced. A conversion that is one all-gather
(a ZeRO-3 parameter gather) can be started early (``start``, asynchronous) and waited for when
used: the runtime's prefetch (:func:`runtime.compile.prefetch_parameter_gathers`). Every collective issued goes
through :func:`run_steps`, which appends ``(kind, axes, bytes, phase)`` to the recorder when one
is active, so tests compare what ran with what was priced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from planner.layout import Layout, Step, conversion_steps
from planner.runtime.faults import failed, group_ranks
from planner.runtime.groups import MeshGroups


@dataclass
class CommRecorder:
    enabled: bool = False
    records: list[tuple[str, tuple[str, ...], int, str]] = field(default_factory=list)

    def add(self, kind: str, axes: tuple[str, ...], nbytes: int, phase: str) -> None:
        if self.enabled:
            self.records.append((kind, axes, nbytes, phase))


def named_failure(kind: str, axes: tuple[str, ...], mg: MeshGroups, phase: str, exc: BaseException) -> Exception:
    """The error a collective over ``axes`` raises when a rank of its group stalled or died
    (:mod:`runtime.faults`: it names the collective and the rank)."""
    return failed(f"{kind} over mesh axes {mg.mesh.sort_axes(axes)} in {phase}", group_ranks(mg.group(axes)), exc)


class Issued:
    """An asynchronous collective's work whose ``wait()`` names a failure as :func:`named_failure` does.
    Unlike :class:`planner.runtime.faults.NamedWork` it keeps the arguments and writes the message
    only on failure: it wraps every bucket and prefetch of every step, where building the text
    and the group's ranks up front would cost microseconds each."""

    __slots__ = ("axes", "kind", "mg", "phase", "work")

    def __init__(self, work: Any, kind: str, axes: tuple[str, ...], mg: MeshGroups, phase: str) -> None:
        self.work, self.kind, self.axes, self.mg, self.phase = work, kind, axes, mg, phase

    def wait(self) -> None:
        try:
            self.work.wait()
        except RuntimeError as exc:
            raise named_failure(self.kind, self.axes, self.mg, self.phase, exc) from exc


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, axes: tuple[str, ...], mg: MeshGroups, rec: CommRecorder, phase: str, op: Any = None) -> torch.Tensor:
    """The sum over the group, in a new tensor (one copy of ``t``, reduced in place)."""
    out = t.clone(memory_format=torch.contiguous_format)
    if mg.size(axes) > 1:
        rec.add("all_reduce", mg.mesh.sort_axes(axes), _nbytes(out), phase)
        try:
            dist.all_reduce(out, op=op or dist.ReduceOp.SUM, group=mg.group(axes))
        except RuntimeError as exc:
            raise named_failure("all_reduce", axes, mg, phase, exc) from exc
    return out


def gathered_empty(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """An uninitialised tensor ``n`` times ``t`` along ``dim``: an all-gather's result."""
    shape = list(t.shape)
    shape[dim] *= n
    return t.new_empty(shape)


def _gather_targets(out: torch.Tensor, like: torch.Tensor, n: int, dim: int) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """The tensors an all-gather into ``out`` (``n`` chunks along ``dim``) receives into, and what
    to run once it is done. The chunks of ``out`` themselves when they are contiguous (gathered in
    place, nothing to do after); otherwise (a split dim after a dim of more than one element) n
    parts, concatenated into ``out`` after: gloo writes a received buffer as a flat block."""
    chunks = list(out.chunk(n, dim=dim))
    if all(c.is_contiguous() for c in chunks):
        return chunks, lambda: None
    parts = [torch.empty_like(like, memory_format=torch.contiguous_format) for _ in range(n)]

    def concatenate() -> None:
        torch.cat(parts, dim=dim, out=out)

    return parts, concatenate


def all_gather(t: torch.Tensor, axes: tuple[str, ...], dim: int, mg: MeshGroups, rec: CommRecorder, phase: str) -> torch.Tensor:
    """The shards of the group concatenated along ``dim``: into the result's chunks where they are
    contiguous; otherwise into one [n, *shard] buffer, concatenated along ``dim`` once the
    collective is done (gloo's staging freed by then), so at most two copies of the result are
    alive at once, as where the chunks are contiguous (result + gloo's staging), not three (n parts +
    staging + a result allocated up front: measured, HF ViT 1-D, a [4, 17, 8] -> [4, 17, 32]
    gradient gather held 3 x 8,704 B)."""
    n = mg.size(axes)
    if n == 1:
        return t
    t = t.contiguous()
    if all(size == 1 for size in t.shape[: dim % t.dim()]):
        return all_gather_into(gathered_empty(t, n, dim), t, axes, dim, mg, rec, phase)
    flat = t.new_empty((n, *t.shape))
    rec.add("all_gather", mg.mesh.sort_axes(axes), _nbytes(flat), phase)
    parts = list(flat.unbind(0))
    try:
        dist.all_gather(parts, t, group=mg.group(axes))
    except RuntimeError as exc:
        raise named_failure("all_gather", axes, mg, phase, exc) from exc
    return torch.cat(parts, dim=dim)


def all_gather_into(out: torch.Tensor, t: torch.Tensor, axes: tuple[str, ...], dim: int, mg: MeshGroups, rec: CommRecorder, phase: str) -> torch.Tensor:
    """Fill ``out`` with the group's shards ``t`` along ``dim`` (``t`` may be this rank's chunk of
    ``out`` itself)."""
    n = mg.size(axes)
    rec.add("all_gather", mg.mesh.sort_axes(axes), _nbytes(out), phase)
    targets, finish = _gather_targets(out, t, n, dim)
    try:
        dist.all_gather(targets, t.contiguous(), group=mg.group(axes))
    except RuntimeError as exc:
        raise named_failure("all_gather", axes, mg, phase, exc) from exc
    finish()
    return out


def reduce_scatter(t: torch.Tensor, axes: tuple[str, ...], dim: int, mg: MeshGroups, rec: CommRecorder, phase: str) -> torch.Tensor:
    """This rank's chunk (along ``dim``) of the sum over the group; the chunks go to the collective
    as views of ``t`` where they are contiguous (copies where not: a dim after one of more than one
    element)."""
    n = mg.size(axes)
    if n == 1:
        return t
    parts = [p.contiguous() for p in t.chunk(n, dim=dim)]
    out = t.new_empty(parts[0].shape)
    rec.add("reduce_scatter", mg.mesh.sort_axes(axes), _nbytes(t), phase)
    try:
        dist.reduce_scatter(out, parts, group=mg.group(axes))
    except RuntimeError as exc:
        raise named_failure("reduce_scatter", axes, mg, phase, exc) from exc
    return out


def broadcast_start(t: torch.Tensor, axis: str, root: int, mg: MeshGroups, rec: CommRecorder, phase: str) -> tuple[torch.Tensor, Any]:
    """``t`` from the rank at coordinate ``root`` of ``axis`` to the others of its group, started
    asynchronously: (the buffer, its work; wait before reading the buffer). Issued ahead of use,
    it travels while the caller computes (SUMMA's next step)."""
    out = t.clone(memory_format=torch.contiguous_format) if mg.coords[axis] == root else torch.empty_like(t, memory_format=torch.contiguous_format)
    rec.add("broadcast", (axis,), _nbytes(out), phase)
    return out, Issued(dist.broadcast(out, src=mg.peer(axis, root), group=mg.group((axis,)), async_op=True), "broadcast", (axis,), mg, phase)


def reduce(t: torch.Tensor, axis: str, root: int, mg: MeshGroups, rec: CommRecorder, phase: str) -> torch.Tensor:
    """Sum of ``t`` over the group of ``axis``, valid on the rank at coordinate ``root``."""
    out = t.clone(memory_format=torch.contiguous_format)
    rec.add("reduce", (axis,), _nbytes(out), phase)
    try:
        dist.reduce(out, dst=mg.peer(axis, root), group=mg.group((axis,)))
    except RuntimeError as exc:
        raise named_failure("reduce", (axis,), mg, phase, exc) from exc
    return out


def local_slice(t: torch.Tensor, axes: tuple[str, ...], dim: int, mg: MeshGroups) -> torch.Tensor:
    n = mg.size(axes)
    if n == 1:
        return t
    # a copy, not a view: a view would keep the whole tensor's storage alive
    return t.chunk(n, dim=dim)[mg.index(axes)].clone(memory_format=torch.contiguous_format)


def keep_on_first(t: torch.Tensor, axes: tuple[str, ...], mg: MeshGroups) -> torch.Tensor:
    """Replicated -> partial: the value stays on the group's first rank, zeros elsewhere.

    A multiplication on every rank (not a branch), so each rank builds the same autograd graph
    and runs backward collectives in the same order.
    """
    return t * (1 if mg.index(axes) == 0 else 0)


def run_steps(t: torch.Tensor, steps: tuple[Step, ...], mg: MeshGroups, rec: CommRecorder, phase: str) -> torch.Tensor:
    for step in steps:
        if step.kind == "all_reduce":
            t = all_reduce(t, step.axes, mg, rec, phase)
        elif step.kind == "all_gather":
            assert step.dim is not None
            t = all_gather(t, step.axes, step.dim, mg, rec, phase)
        elif step.kind == "reduce_scatter":
            assert step.dim is not None
            t = reduce_scatter(t, step.axes, step.dim, mg, rec, phase)
        elif step.kind == "slice":
            assert step.dim is not None
            t = local_slice(t, step.axes, step.dim, mg)
        elif step.kind == "zero":
            t = keep_on_first(t, step.axes, mg)
        else:
            raise ValueError(f"unknown conversion step {step}")
    return t


def relayout(t: torch.Tensor, src: Layout, dst: Layout, mg: MeshGroups) -> torch.Tensor:
    """``t`` (this rank's part in layout ``src``) in layout ``dst``, outside autograd and not
    recorded: sharding a full parameter or batch, gathering shards back."""
    return run_steps(t, conversion_steps(src, dst, mg.mesh), mg, CommRecorder(), "fwd")


class _ConvertFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, conv: Convert) -> torch.Tensor:  # type: ignore[override]
        ctx.conv = conv
        out = conv.run_forward(x)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:  # type: ignore[override]
        conv: Convert = ctx.conv
        if conv.unit is not None:  # a ZeRO-3 unit reduces it with the rest of its block (runtime.zero3)
            conv.unit.reduce(conv, grad)
            return None, None
        if not conv.backward_steps:
            return grad, None
        return run_steps(grad, conv.backward_steps, conv.mesh_groups, conv.recorder, "bwd"), None


class Convert(torch.nn.Module):
    """Convert a local tensor from one Spec to another: forward steps, and backward steps on its grad."""

    def __init__(self, forward_steps: tuple[Step, ...], backward_steps: tuple[Step, ...], mesh_groups: MeshGroups, recorder: CommRecorder, label: str) -> None:
        super().__init__()
        self.forward_steps = forward_steps
        self.backward_steps = backward_steps
        self.mesh_groups = mesh_groups
        self.recorder = recorder
        self.label = label
        self._pending: tuple[int, Any, torch.Tensor, Callable[[], None]] | None = None
        self.unit: Any = None  # the runtime.zero3.ParamUnits that gathers and reduces it, if any

    @property
    def prefetchable(self) -> bool:
        """A single all-gather (a ZeRO-3 parameter gather) outside a unit: it can be started
        ahead of use."""
        return self.unit is None and len(self.forward_steps) == 1 and self.forward_steps[0].kind == "all_gather" and self.mesh_groups.size(self.forward_steps[0].axes) > 1

    def start(self, x: torch.Tensor) -> None:
        """Issue the all-gather of ``x`` now (asynchronously); the next ``forward(x)`` waits for it."""
        step = self.forward_steps[0]
        assert step.dim is not None
        src = x.detach().contiguous()
        n = self.mesh_groups.size(step.axes)
        out = gathered_empty(src, n, step.dim)
        self.recorder.add("all_gather", self.mesh_groups.mesh.sort_axes(step.axes), _nbytes(out), "fwd")
        targets, finish = _gather_targets(out, src, n, step.dim)
        work = Issued(dist.all_gather(targets, src, group=self.mesh_groups.group(step.axes), async_op=True), "all_gather", step.axes,
                      self.mesh_groups, "fwd")
        self._pending = (id(x), work, out, finish)

    def run_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit is not None:
            return self.unit.take(self)  # type: ignore[no-any-return]
        pending, self._pending = self._pending, None
        if pending is not None:
            key, work, out, finish = pending
            work.wait()
            finish()
            if key == id(x):
                return out
        return run_steps(x, self.forward_steps, self.mesh_groups, self.recorder, "fwd")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            return _ConvertFn.apply(x, self)  # type: ignore[no-any-return]
        return self.run_forward(x)

    def regather(self, x: torch.Tensor) -> torch.Tensor:
        """The forward steps again on ``x``, for backward (a unit's members together)."""
        if self.unit is not None:
            return self.unit.regather(self)  # type: ignore[no-any-return]
        return run_steps(x, self.forward_steps, self.mesh_groups, self.recorder, "bwd")

    def extra_repr(self) -> str:
        fwd = " ".join(str(s) for s in self.forward_steps) or "-"
        bwd = " ".join(str(s) for s in self.backward_steps) or "-"
        return f"{self.label}: fwd [{fwd}] bwd [{bwd}]"
