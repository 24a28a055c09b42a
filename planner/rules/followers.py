"""Followers: single-input ops whose layout follows their input (see planner.rules)."""

from __future__ import annotations

from dataclasses import replace

from planner.layout import Layout, Spec
from planner.rules.context import (
    DIM_DROPPED,
    DIM_NEEDS_WHOLE,
    DIM_WHOLE_LINEAR,
    DROPOUT,
    ELEMENTWISE_UNARY,
    FALLBACK,
    LIKE,
    LINEAR_UNARY,
    RESHAPE,
    SCALAR_LINEAR,
    SHAPE_ONLY,
    WHOLE_REDUCTIONS,
    RuleContext,
)
from planner.rules.indexing import INPUT_DRIVEN
from planner.strategy import Strategy, split_label


def follow(ctx: RuleContext, spec_in: Spec) -> Strategy:
    """The strategy of a single-input op whose input arrives as ``spec_in``.

    A gradient that arrives as a partial sum stays one through the op (backward is linear in
    the output's gradient): over the axes of ``spec_in``'s gradient that the op is replicated
    over, its input and output gradients are partial too. A weight's transpose under data
    parallelism (partial over dp until the step's all-reduce) then costs no all-reduce in backward."""
    strategy = _follow(ctx, spec_in)
    keep = spec_in.grad_partial - strategy.split_axes
    if not keep:
        return strategy

    def widen(spec: Spec) -> Spec:
        return Spec(spec.layout, spec.grad_partial | (keep - spec.layout.shard_axes - spec.layout.partial))

    return replace(strategy, inputs=tuple(widen(s) for s in strategy.inputs),
                   outputs=tuple(None if s is None else widen(s) for s in strategy.outputs))


def _follow(ctx: RuleContext, spec_in: Spec) -> Strategy:
    target = ctx.node.target
    lay = spec_in.layout
    if target == "getitem":
        return Strategy("follow", "getitem", (Spec(lay),), (Spec(lay),), lay.shard_axes)
    if target in LINEAR_UNARY or (target in SCALAR_LINEAR and len(ctx.node.inputs) == 1):
        return _same(lay, "op")
    if target in DROPOUT:
        p = ctx.args[1] if len(ctx.args) > 1 else 0.5
        return _same(lay if p == 0 else _reduced(lay), "op")
    if target in ELEMENTWISE_UNARY:
        return _same(_reduced(lay), "op")
    if target in RESHAPE:
        return _reshape(ctx, lay)
    if target in LIKE:  # zeros_like(x): the local zeros of x's shard; its values (partial or not) do not matter
        return Strategy("follow", "op", (Spec(lay),), (Spec(Layout(lay.dims)),), lay.shard_axes)
    if target in SHAPE_ONLY:  # uses only the input's dtype and device: a replicated source
        return _strategy(lay, Layout.replicated(len(ctx.node.out.shape)), "op", "replicate")
    if target == "aten.expand.default":
        shape = ctx.node.out.shape
        in_shape = ctx.in_shape(0)
        offset = len(shape) - len(in_shape)
        dims = [() for _ in range(offset)] + [lay.dims[d] if in_shape[d] == shape[offset + d] else () for d in range(len(in_shape))]
        req = Layout(tuple(d if in_shape[i] == shape[offset + i] else () for i, d in enumerate(lay.dims)), lay.partial)
        return _strategy(req, Layout(tuple(dims), lay.partial), "reshape")
    if target in ("aten.transpose.int", "aten.permute.default", "aten.t.default"):
        perm = _permutation(ctx)
        return _strategy(lay, Layout(tuple(lay.dims[p] for p in perm), lay.partial), "op")
    if target == "aten.unsqueeze.default":
        d = ctx.args[1] % (lay.ndim + 1)
        dims = list(lay.dims)
        dims.insert(d, ())
        return _strategy(lay, Layout(tuple(dims), lay.partial), "op")
    if target in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"):
        in_shape = ctx.in_shape(0)
        keep = [i for i, s in enumerate(in_shape) if s != 1 or len(ctx.node.out.shape) == len(in_shape)]
        if len(keep) != len(ctx.node.out.shape):
            keep = [i for i in range(len(in_shape)) if i < len(ctx.node.out.shape)]
        return _strategy(lay, Layout(tuple(lay.dims[i] for i in keep), lay.partial), "op")
    if target == "aten.select.int":  # x.select(dim, i): the dim must be whole; it disappears
        dim = ctx.args[1] % lay.ndim
        req = Layout(tuple(() if i == dim else d for i, d in enumerate(lay.dims)), lay.partial)
        out = Layout(tuple(d for i, d in enumerate(req.dims) if i != dim), req.partial)
        return _strategy(req, out, "op")
    if target in INPUT_DRIVEN:
        return INPUT_DRIVEN[target](ctx, lay)
    if target in DIM_NEEDS_WHOLE:
        return _dim_whole(ctx, lay)
    if target in WHOLE_REDUCTIONS:
        return _whole_reduction(ctx, lay)
    if target == "aten.repeat_interleave.self_int":  # each row's copies stay beside it: shards stay contiguous
        dim = ctx.args[2] if len(ctx.args) > 2 else ctx.kwargs.get("dim")
        if dim is None:  # flattened first: only a 1-d input keeps its sharding
            return _strategy(lay if lay.ndim == 1 else Layout.replicated(lay.ndim), Layout(lay.dims[:1] if lay.ndim == 1 else ((),), lay.partial), "op")
        return _same(lay, "op")
    if target in ("aten.sum.dim_IntList", "aten.mean.dim", "aten.sum.default", "aten.mean.default"):
        return _reduction(ctx, lay)
    outs = tuple(Spec(Layout.replicated(len(o.shape))) if o is not None else None for o in ctx.node.outputs)
    return Strategy(FALLBACK, "op", (Spec(Layout.replicated(lay.ndim)),), outs)


def _whole_reduction(ctx: RuleContext, lay: Layout) -> Strategy:
    """``var_mean(x, dims)``, ``amax``, ``logsumexp``, ...: the reduced dims whole (their result is no
    sum of per-shard parts), the others as they arrive; every output alike (var and mean)."""
    dims_pos, keep_pos = WHOLE_REDUCTIONS[ctx.node.target]
    raw = ctx.args[dims_pos] if len(ctx.args) > dims_pos else ctx.kwargs.get("dim")
    dims = set(range(lay.ndim)) if raw is None else {d % max(lay.ndim, 1) for d in ([raw] if isinstance(raw, int) else raw)}
    keepdim = bool(ctx.args[keep_pos] if len(ctx.args) > keep_pos else ctx.kwargs.get("keepdim", False))
    req = Layout(tuple(() if d in dims else axes for d, axes in enumerate(lay.dims)))
    out = req if keepdim else Layout(tuple(axes for d, axes in enumerate(req.dims) if d not in dims))
    outs = tuple(Spec(out) if o is not None else None for o in ctx.node.outputs)
    return Strategy(split_label(ctx.mesh, req.shard_axes), "op", (Spec(req),), outs, req.shard_axes)


def _dim_whole(ctx: RuleContext, lay: Layout) -> Strategy:
    """An op along one dim (softmax, slice, split, topk, sort, max.dim, ...): that dim whole, the
    others as they arrive; every output in the same layout (less the dim where the op drops it)."""
    target = ctx.node.target
    pos, default = DIM_NEEDS_WHOLE[target]
    dim = ctx.args[pos] if len(ctx.args) > pos else ctx.kwargs.get("dim", default)
    if dim is None:  # argmax / argmin over the flattened tensor
        outs = tuple(Spec(Layout.replicated(len(o.shape))) if o is not None else None for o in ctx.node.outputs)
        return Strategy("replicate", "op", (Spec(Layout.replicated(lay.ndim)),), outs)
    dim %= max(lay.ndim, 1)
    req = Layout(tuple(() if i == dim else d for i, d in enumerate(lay.dims)), lay.partial)
    if target not in DIM_WHOLE_LINEAR:
        req = _reduced(req)
    out = req
    if target in DIM_DROPPED:
        keep = DIM_DROPPED[target]
        keepdim = keep is not None and bool(ctx.args[keep] if len(ctx.args) > keep else ctx.kwargs.get("keepdim", False))
        if not keepdim:
            out = Layout(tuple(d for i, d in enumerate(req.dims) if i != dim), req.partial)
    outs = tuple(Spec(out) if o is not None else None for o in ctx.node.outputs)
    return Strategy(split_label(ctx.mesh, req.shard_axes), "op", (Spec(req),), outs, req.shard_axes)


def _reduced(lay: Layout) -> Layout:
    return Layout(lay.dims)


def _same(lay: Layout, kernel: str) -> Strategy:
    return _strategy(lay, lay, kernel)


def _strategy(req: Layout, out: Layout, kernel: str, algorithm: str = "follow") -> Strategy:
    return Strategy(algorithm, kernel, (Spec(req),), (Spec(out),), out.shard_axes | req.shard_axes)


def _permutation(ctx: RuleContext) -> list[int]:
    ndim = len(ctx.in_shape(0))
    if ctx.node.target == "aten.t.default":
        return [1, 0] if ndim == 2 else [0]
    if ctx.node.target == "aten.transpose.int":
        d0, d1 = ctx.args[1] % ndim, ctx.args[2] % ndim
        perm = list(range(ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return perm
    return [p % ndim for p in ctx.args[1]]


def _reshape(ctx: RuleContext, lay: Layout) -> Strategy:
    """Map shard axes through a reshape by groups of dims whose sizes multiply to the same value.

    Inside a group, only the group's first (outermost) input dim may be sharded, and its axes move
    to the group's first output dim when they divide it; anything else is gathered first.
    """
    in_shape, out_shape = ctx.in_shape(0), ctx.node.out.shape
    groups = _reshape_groups(in_shape, out_shape)
    req = [list(d) for d in lay.dims]
    out_dims: list[tuple[str, ...]] = [() for _ in out_shape]
    for ins, outs in groups:
        for k, i in enumerate(ins):
            if k > 0 and req[i]:
                req[i] = []
        if ins and outs and req[ins[0]]:
            first = ins[0]
            axes = tuple(req[first])
            real_outs = [o for o in outs if out_shape[o] != 1] or outs
            target_dim = real_outs[0]
            if out_shape[target_dim] % ctx.mesh.group_size(axes) == 0:
                out_dims[target_dim] = axes
            else:
                req[first] = []
        elif ins and not outs:
            for i in ins:
                req[i] = []
    req_layout = Layout(tuple(tuple(d) for d in req), lay.partial)
    return _strategy(req_layout, Layout(tuple(out_dims), lay.partial), "reshape")


def _reshape_groups(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        gi: list[int] = []
        gj: list[int] = []
        pa = pb = 1
        while True:
            if pa == pb and gi and gj:
                break
            if (pa <= pb and i < len(a)) or j >= len(b):
                if i >= len(a):
                    break
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                pb *= b[j]
                gj.append(j)
                j += 1
        # absorb trailing size-1 dims into the group
        while i < len(a) and a[i] == 1 and (j >= len(b) or b[j] != 1):
            gi.append(i)
            i += 1
        while j < len(b) and b[j] == 1 and (i >= len(a) or a[i] != 1):
            gj.append(j)
            j += 1
        groups.append((gi, gj))
    return groups


def _reduction(ctx: RuleContext, lay: Layout) -> Strategy:
    ndim = lay.ndim
    if ctx.node.target in ("aten.sum.default", "aten.mean.default"):
        dims, keep = list(range(ndim)), False
    else:
        raw = ctx.args[1] if len(ctx.args) > 1 and ctx.args[1] is not None else list(range(ndim))
        dims = [d % ndim for d in raw] or list(range(ndim))
        keep = bool(ctx.args[2]) if len(ctx.args) > 2 else bool(ctx.kwargs.get("keepdim", False))
    reduced_axes = frozenset(a for d in dims for a in lay.dims[d])
    out_dims = tuple(() if d in dims else lay.dims[d] for d in range(ndim) if keep or d not in dims)
    out = Layout(out_dims, lay.partial | reduced_axes)
    kernel = "mean" if "mean" in ctx.node.target and reduced_axes else "op"
    return Strategy(split_label(ctx.mesh, lay.shard_axes), kernel, (Spec(lay),), (Spec(out),), lay.shard_axes)
