"""Variants that strategies of matmul-like ops come in: partial outputs reduced inside the
strategy, inputs re-gathered in backward, and 2-D SUMMA with stepped broadcasts."""

from __future__ import annotations

from dataclasses import replace

from planner.cost import steps_comms
from planner.layout import Layout, Spec, is_unit_gather, spec_conversion
from planner.rules.context import RuleContext, active_tp
from planner.strategy import Comm, Strategy, with_dp


def reduced_variants(ctx: RuleContext, strategies: list[Strategy], batch_dims: int, bias: int | None = None) -> list[Strategy]:
    """Each strategy with a partial output over tensor-parallel axes, plus variants that reduce it
    inside the strategy: all-reduce (Megatron's row-parallel output), or reduce-scatter onto one
    of the first ``batch_dims`` dims (sequence parallelism; 3-D's reduce-scatter over k).

    The reduced variants add the bias (input ``bias``) after the reduction, as Megatron does: after
    an all-reduce every rank adds the whole bias, so its gradient is no longer partial over the
    reduced axes (no gradient all-reduce for it)."""
    out: list[Strategy] = list(strategies)
    meta = ctx.node.out
    for s in strategies:
        raw = s.outputs[0]
        if raw is None:
            continue
        tp_partial = ctx.mesh.sort_axes({a for a in raw.layout.partial if not ctx.mesh.is_dp(a)})
        if not tp_partial:
            continue
        targets = [Layout(raw.layout.dims, raw.layout.partial - set(tp_partial))]
        for d in range(batch_dims):
            dims = list(raw.layout.dims)
            dims[d] = (*dims[d], *tp_partial)
            target = Layout(tuple(dims), raw.layout.partial - set(tp_partial))
            if target.divides(meta.shape, ctx.mesh):
                targets.append(target)
        for target in targets:
            conv = spec_conversion(raw, Spec(target), ctx.mesh)
            raw_local = meta.nbytes // raw.layout.shard_factor(ctx.mesh)
            comms = steps_comms(conv.forward, raw_local, ctx.mesh, "fwd")
            if ctx.node.requires_grad:
                comms += steps_comms(conv.backward, meta.nbytes // target.shard_factor(ctx.mesh), ctx.mesh, "bwd")
            kind = "all-reduce" if not target.shard_axes - raw.layout.shard_axes else "reduce-scatter"
            inputs = s.inputs
            if bias is not None and bias < len(inputs):
                b = inputs[bias]
                grad = b.grad_partial - set(tp_partial) if kind == "all-reduce" else b.grad_partial | (target.shard_axes - raw.layout.shard_axes - b.layout.shard_axes)
                inputs = (*inputs[:bias], Spec(b.layout, frozenset(grad)), *inputs[bias + 1 :])
            out.append(replace(s, algorithm=f"{s.algorithm}/{kind}", inputs=inputs, outputs=(Spec(target),), comms=s.comms + comms, raw_output=raw))
    return out


def regather_variants(
    ctx: RuleContext, strategies: list[Strategy], inputs: dict[int, int | None], axes: tuple[str, ...] | None = None, bucket_bytes: int = 0
) -> list[Strategy]:
    """On 2-D/3-D meshes, each strategy whose inputs are gathered before use (over the
    tensor-parallel axes they leave idle) also comes in a variant that receives them still split
    over those axes, gathers them itself, and gathers them again in backward rather than keeping
    the gathered tensors saved (Bian et al.'s two 3-D variants: less memory, more traffic).

    With ``axes`` (the data-parallel axes, ZeRO-3) the inputs arrive split over those axes
    instead: parameters sharded at rest, gathered before use, freed, gathered again for backward.

    ``inputs``: position -> dim that carries the idle axes on arrival (None: the first dim that
    is already split, else dim 0; for ZeRO-3 the first such dim that divides). ``bucket_bytes``:
    ZeRO-3's gathers of one all-gather run in units of that size (planner.overlap), each priced as
    its share of a unit's latency."""
    tp = active_tp(ctx.mesh)
    if axes is None and len(tp) < 2:
        return strategies
    out = list(strategies)
    # what a position's arrival and its collectives are depends on the Spec the kernel computes
    # with alone, which many strategies share (measured, gpt2-small's 3-D ZeRO-3 problem on 64
    # devices: this function was 0.67 s of its 0.73 s build when it worked them out per strategy)
    arrivals: dict[tuple[int, Spec], tuple[Spec, tuple[Comm, ...]] | None] = {}
    for s in strategies:
        if axes is None and not s.split_axes & set(tp):
            continue
        new_inputs = list(s.inputs)
        regather: list[tuple[int, Spec]] = []
        comms: list[Comm] = []
        for pos, dim in inputs.items():
            if pos >= len(s.inputs) or not ctx.needs_grad(pos):
                continue
            compute = s.inputs[pos]
            if (pos, compute) not in arrivals:
                arrivals[(pos, compute)] = _arrival(ctx, compute, pos, dim, axes, bucket_bytes)
            arrival = arrivals[(pos, compute)]
            if arrival is None:
                continue
            new_inputs[pos] = arrival[0]
            comms += arrival[1]
            regather.append((pos, compute))
        if regather:
            tag = "+zero3" if axes is not None else "+regather"
            out.append(replace(s, algorithm=f"{s.algorithm}{tag}", inputs=tuple(new_inputs), comms=s.comms + tuple(comms), regather=tuple(regather)))
    return out


def _arrival(ctx: RuleContext, compute: Spec, pos: int, dim: int | None, axes: tuple[str, ...] | None,
             bucket_bytes: int) -> tuple[Spec, tuple[Comm, ...]] | None:
    """How input ``pos`` arrives for a kernel computing with it as ``compute`` (see
    :func:`regather_variants`), and the collectives that gather it before use and again for
    backward; None where it arrives as the kernel computes with it."""
    tp = active_tp(ctx.mesh)
    pool = axes if axes is not None else tuple(tp)
    idle = tuple(a for a in pool if ctx.mesh.degree(a) > 1 and a not in compute.layout.shard_axes and a not in compute.layout.partial)
    if not idle:
        return None
    arrival_layout = _extended(compute.layout, idle, dim, ctx.in_shape(pos), ctx, any_dim=axes is not None)
    if arrival_layout is None:
        return None
    arrival = Spec(arrival_layout, compute.grad_partial - set(idle))
    conv = spec_conversion(arrival, compute, ctx.mesh)
    nbytes = ctx.in_meta(pos).nbytes
    gathered = steps_comms(conv.forward, nbytes // arrival_layout.shard_factor(ctx.mesh), ctx.mesh, "fwd")
    reduced = steps_comms(conv.backward, nbytes // compute.layout.shard_factor(ctx.mesh), ctx.mesh, "bwd")
    if axes is not None and bucket_bytes and is_unit_gather(conv, ctx.mesh):
        gathered = tuple(replace(c, bucket_bytes=bucket_bytes) for c in gathered)
        reduced = tuple(replace(c, bucket_bytes=bucket_bytes) for c in reduced)
    comms = (*gathered, *reduced)
    if any(saved.source == "input" and saved.index == pos for saved in ctx.node.saved):
        comms += tuple(replace(c, phase="bwd") for c in gathered)  # gathered again for backward, where autograd keeps it
    return arrival, comms


def _extended(
    layout: Layout, idle: tuple[str, ...], dim: int | None, shape: tuple[int, ...], ctx: RuleContext, *, any_dim: bool
) -> Layout | None:
    """``layout`` further split over ``idle`` on ``dim``; without ``dim``, on its first split dim
    (else dim 0), or with ``any_dim`` on the first dim where that divides. None if it does not
    divide: the input then arrives as the kernel computes with it (kept gathered)."""
    if dim is not None:
        order = [dim]
    elif any_dim:
        order = sorted(range(layout.ndim), key=lambda k: not layout.dims[k])
    else:
        order = [next((k for k, axes in enumerate(layout.dims) if axes), 0)]
    for d in order:
        dims = list(layout.dims)
        dims[d] = (*dims[d], *idle)
        candidate = Layout(tuple(dims), layout.partial)
        if candidate.divides(shape, ctx.mesh):
            return candidate
    return None


def summa_strategies(ctx: RuleContext, batch: str, sizes: dict[str, int]) -> list[Strategy]:
    """2-D SUMMA (van de Geijn & Watts; Optimus, Xu et al. 2021) on a ``row x col`` mesh: X, W
    and Y blocked q x q (rows of X on ``row``, its hidden dim on ``col``; W[in, out] on
    ``(row, col)``). Forward runs q steps, each broadcasting a block-column of X along the row's
    ``col`` group and a block-row of W along the ``row`` group, then a local matmul-accumulate.
    Backward: dX = dY W^T re-broadcasts W and reduces over ``col``; dW = X^T dY re-broadcasts X
    and reduces over ``row``; dY never moves, and only local blocks are saved. Per device per
    linear X[N,a] W[a,b]: forward q broadcasts of N*a/q^2 and of a*b/q^2; backward the same
    broadcasts again plus q reduces of N*a/q^2 and of a*b/q^2 (ring volume (2Na + 2ab)/q^2 * q
    each way), 4q latency steps forward+backward per operand pair."""
    mesh = ctx.mesh
    if set(active_tp(mesh)) != {"row", "col"} or mesh.degree("row") != mesh.degree("col"):
        return []
    q = mesh.degree("row")
    o_dim, i_dim = ctx.in_shape(1)
    dp = mesh.active_dp_axes
    itemsize = ctx.in_meta(0).itemsize
    out = []
    for d in range(len(batch)):
        x_dims: list[tuple[str, ...]] = [() for _ in range(len(batch) + 1)]
        if d == 0 and dp:
            x_dims[0] = dp
        x_dims[d] = (*x_dims[d], "row")
        x_dims[-1] = ("col",)
        x_lay = Layout(tuple(x_dims))
        if not x_lay.divides(ctx.in_shape(0), mesh) or o_dim % q or i_dim % q:
            continue
        split = frozenset({"row", "col", *dp})
        x = Spec(x_lay, frozenset())
        w = Spec(Layout((("col",), ("row",))), frozenset(dp))
        ins = [x, w]
        if len(ctx.node.inputs) > 2:
            ins.append(Spec(Layout((("col",),)), frozenset({"row", *dp})))
        y = Layout((*x_lay.dims[:-1], ("col",)))
        rows = ctx.node.out.numel // o_dim // mesh.group_size(x_lay.shard_axes - {"col"})
        x_block, w_block = rows * (i_dim // q) * itemsize, (o_dim // q) * (i_dim // q) * itemsize
        comms = [Comm("broadcast", ("col",), x_block, "fwd"), Comm("broadcast", ("row",), w_block, "fwd")] * q
        comms += [Comm("broadcast", ("row",), w_block, "bwd"), Comm("reduce", ("col",), x_block, "bwd"),
                  Comm("broadcast", ("col",), x_block, "bwd"), Comm("reduce", ("row",), w_block, "bwd")] * q
        label = with_dp(f"tp2d-summa[batch{d}=row]", mesh, split)
        out.append(Strategy(label, "summa", tuple(ins), (Spec(y),), split, tuple(comms)))
    return out


