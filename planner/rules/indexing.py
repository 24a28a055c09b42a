"""Rules for indexing, scattering, padding and differencing ops (attention masks, rotary position
ids, MoE routing, BART's shifted labels).

They share one idea: the dims an op *indexes* (reads or writes at positions given by values) must
be whole on every rank, because index values are global positions; every other dim maps to an
output dim one to one and may stay sharded as it arrives. Index tensors (``index``, ``gather``,
``scatter``) carry their own dims into the output, so those may be split too: the rank then reads
the rows its shard of the index names, from a tensor it holds whole along the indexed dim.

Two forms, both keyed by the op in :data:`LAYOUT_RULES`:

* *output-driven* (``index``, ``gather``, ``scatter``, ``index_put``, ``index_select``, the
  ``*_scatter`` ops): one strategy per layout of the output, each operand's Spec derived from it;
* *input-driven* (``pad``, ``diff``, ``histc``): the strategy for the layout the first input
  arrives in; these are followers when they have one tensor input and anchors (every layout of
  the first input) when they have more.
"""

from __future__ import annotations

from collections.abc import Callable

from planner.layout import Layout, Spec
from planner.rules.context import RuleContext
from planner.strategy import Strategy, dedupe, enumerate_layouts, split_label

Dims = tuple[tuple[str, ...], ...]


def _spec(ctx: RuleContext, i: int, dims: Dims, work: frozenset[str]) -> Spec:
    """Input ``i`` in ``dims``; its gradient partial over the axes that split the work but not it."""
    lay = Layout(dims)
    grad = (work - lay.shard_axes) if ctx.needs_grad(i) else frozenset()
    return Spec(lay, grad)


def _broadcast_dims(out: Dims, out_shape: tuple[int, ...], shape: tuple[int, ...]) -> Dims:
    """The dims of an operand aligned with ``out_shape`` from the right (broadcasting): a dim of size
    1 where the output is larger, or one beyond the output's leading dim, stays whole."""
    offset = len(out_shape) - len(shape)
    return tuple(out[offset + d] if offset + d >= 0 and shape[d] == out_shape[offset + d] else () for d in range(len(shape)))


def _whole(dims: Dims, which: set[int]) -> Dims:
    return tuple(() if d in which else axes for d, axes in enumerate(dims))


def _dim(ctx: RuleContext, pos: int, default: int, ndim: int) -> int:
    value = ctx.args[pos] if len(ctx.args) > pos else ctx.kwargs.get("dim", default)
    return int(value) % max(ndim, 1)


def _by_output(make: Callable[[RuleContext, Dims], tuple[tuple[Spec, ...], Dims] | None]) -> Callable[[RuleContext], list[Strategy]]:
    """A rule enumerating the output's layouts; ``make`` gives the inputs' Specs (and the output's
    dims, which it may narrow) for one, or None when the op cannot run on it."""

    def rule(ctx: RuleContext) -> list[Strategy]:
        out = []
        for lay in enumerate_layouts(ctx.node.out.shape, ctx.mesh):
            made = make(ctx, lay.dims)
            if made is None:
                continue
            ins, dims = made
            out_lay = Layout(dims)
            outs = tuple(Spec(out_lay) if o is not None else None for o in ctx.node.outputs)
            out.append(Strategy(split_label(ctx.mesh, out_lay.shard_axes), "op", ins, outs, out_lay.shard_axes))
        return dedupe(out)

    return rule


def _index_positions(ctx: RuleContext) -> list[int]:
    """The dims of ``x`` that ``aten.index.Tensor(x, indices)`` indexes (a non-None entry each)."""
    indices = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("indices", [])
    return [d for d, t in enumerate(indices) if t is not None]


def _index(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``x[i0, i1, ...]`` (advanced indexing): output = x's dims before the indexed ones, the index
    tensors' broadcast dims, x's dims after (the broadcast dims first when the indexed dims are not
    adjacent, as torch orders them)."""
    x_shape, out_shape = ctx.in_shape(0), ctx.node.out.shape
    indexed = _index_positions(ctx)
    rest = [d for d in range(len(x_shape)) if d not in indexed]
    nb = len(out_shape) - len(rest)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1)) if indexed else True
    first = indexed[0] if adjacent and indexed else 0
    b_dims = out[first : first + nb]
    b_shape = out_shape[first : first + nb]
    x_dims: list[tuple[str, ...]] = [() for _ in x_shape]
    for k, d in enumerate(rest):
        x_dims[d] = out[k if k < first else k + nb]
    work = frozenset(a for axes in out for a in axes)
    specs = [_spec(ctx, 0, tuple(x_dims), work)]
    for i in range(1, len(ctx.node.inputs)):
        specs.append(_spec(ctx, i, _broadcast_dims(b_dims, b_shape, ctx.in_shape(i)), work))
    return tuple(specs), out


def _gather(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``gather(x, dim, index)``: out[..i..] = x[.. index[..i..] ..] along ``dim``; x whole along
    ``dim`` and, where its size differs from the index's, along that dim too."""
    x_shape, idx_shape = ctx.in_shape(0), ctx.in_shape(1)
    dim = _dim(ctx, 1, 0, len(x_shape))
    x_dims = tuple(() if d == dim or x_shape[d] != idx_shape[d] else out[d] for d in range(len(x_shape)))
    work = frozenset(a for axes in out for a in axes)
    return (_spec(ctx, 0, x_dims, work), _spec(ctx, 1, out, work)), out


def _scatter(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``scatter(self, dim, index, src)`` (and ``scatter_add``, ``scatter.value``): the output is
    ``self`` written along ``dim`` at the index's positions; ``dim`` whole; another dim may be split
    only where index (and src) span all of it, so each rank writes only its own rows."""
    self_shape = ctx.in_shape(0)
    dim = _dim(ctx, 1, 0, len(self_shape))
    if out[dim]:
        return None
    shapes = [ctx.in_shape(i) for i in range(1, len(ctx.node.inputs))]
    if any(out[d] and s[d] != self_shape[d] for s in shapes for d in range(len(self_shape))):
        return None
    work = frozenset(a for axes in out for a in axes)
    return (_spec(ctx, 0, out, work), *(_spec(ctx, i, out, work) for i in range(1, len(ctx.node.inputs)))), out


def _index_put(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``index_put(self, indices, values)``: the indexed dims whole; the index and value tensors whole
    along the broadcast dims (their values are global positions), sharded like ``self`` after them."""
    self_shape = ctx.in_shape(0)
    indexed = _index_positions(ctx)
    if any(out[d] for d in indexed) or indexed != list(range(len(indexed))):
        return None
    work = frozenset(a for axes in out for a in axes)
    tail, tail_shape = out[len(indexed) :], self_shape[len(indexed) :]
    *index_refs, _values = range(1, len(ctx.node.inputs))
    specs = [_spec(ctx, 0, out, work)]
    specs += [_spec(ctx, i, tuple(() for _ in ctx.in_shape(i)), work) for i in index_refs]
    specs.append(_spec(ctx, _values, _broadcast_dims(tail, tail_shape, ctx.in_shape(_values)), work))
    return tuple(specs), out


def _index_select(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``index_select(x, dim, index)``: x whole along ``dim``; the output's ``dim`` follows the index."""
    x_shape = ctx.in_shape(0)
    dim = _dim(ctx, 1, 0, len(x_shape))
    work = frozenset(a for axes in out for a in axes)
    return (_spec(ctx, 0, _whole(out, {dim}), work), _spec(ctx, 1, (out[dim],), work)), out


def _slice_scatter(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``slice_scatter(self, src, dim, ...)``: ``dim`` whole in both; the others as the output."""
    dim = _dim(ctx, 2, 0, len(out))
    if out[dim]:
        return None
    work = frozenset(a for axes in out for a in axes)
    return (_spec(ctx, 0, out, work), _spec(ctx, 1, out, work)), out


def _select_scatter(ctx: RuleContext, out: Dims) -> tuple[tuple[Spec, ...], Dims] | None:
    """``select_scatter(self, src, dim, index)``: ``dim`` whole; src has no ``dim``."""
    dim = _dim(ctx, 2, 0, len(out))
    if out[dim]:
        return None
    work = frozenset(a for axes in out for a in axes)
    return (_spec(ctx, 0, out, work), _spec(ctx, 1, tuple(a for d, a in enumerate(out) if d != dim), work)), out


# ----------------------------------------------------------------------------- input-driven


def _padded_dims(ctx: RuleContext, ndim: int) -> set[int]:
    pad = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("pad", [])
    return {ndim - 1 - k for k in range(len(pad) // 2)}


def pad_strategy(ctx: RuleContext, lay: Layout) -> Strategy:
    """``pad(x, pad, mode, value)`` / ``constant_pad_nd``: the padded (last) dims whole; zero padding
    commutes with a sum over ranks (a partial input stays partial), other values do not."""
    padded = _padded_dims(ctx, lay.ndim)
    args = list(ctx.args)
    mode = args[2] if len(args) > 2 and isinstance(args[2], str) else ctx.kwargs.get("mode", "constant")
    value = args[-1] if len(args) > 2 and not isinstance(args[-1], str) else ctx.kwargs.get("value", 0)
    partial = lay.partial if mode == "constant" and not value else frozenset()
    req = Layout(_whole(lay.dims, padded), partial)
    return Strategy(split_label(ctx.mesh, req.shard_axes), "op", (Spec(req),), (Spec(req),), req.shard_axes)


def diff_strategy(ctx: RuleContext, lay: Layout) -> Strategy:
    """``diff(x, n, dim, prepend, append)``: linear, along ``dim`` (whole); prepend/append as x."""
    dim = _dim(ctx, 2, -1, lay.ndim)
    req = Layout(_whole(lay.dims, {dim}), lay.partial)
    ins = [Spec(req)]
    for i in range(1, len(ctx.node.inputs)):
        ins.append(Spec(req) if len(ctx.in_shape(i)) == lay.ndim else Spec(Layout.replicated(len(ctx.in_shape(i)))))
    return Strategy(split_label(ctx.mesh, req.shard_axes), "op", tuple(ins), (Spec(req),), req.shard_axes)


def histc_strategy(ctx: RuleContext, lay: Layout) -> Strategy:
    """``histc(x, bins)``: counts of this rank's elements; the counts of all ranks add up, so the
    output is a partial sum over the axes that split ``x``."""
    req = Layout(lay.dims)
    out = Layout(((),), req.shard_axes)
    return Strategy(split_label(ctx.mesh, req.shard_axes), "op", (Spec(req),), (Spec(out),), req.shard_axes)


INPUT_DRIVEN: dict[str, Callable[[RuleContext, Layout], Strategy]] = {
    "aten.pad.default": pad_strategy,
    "aten.constant_pad_nd.default": pad_strategy,
    "aten.diff.default": diff_strategy,
    "aten.histc.default": histc_strategy,
    "aten.bincount.default": histc_strategy,
}

OUTPUT_DRIVEN: dict[str, Callable[[RuleContext], list[Strategy]]] = {
    "aten.index.Tensor": _by_output(_index),
    "aten._unsafe_index.Tensor": _by_output(_index),
    "aten.gather.default": _by_output(_gather),
    "aten.scatter.src": _by_output(_scatter),
    "aten.scatter.value": _by_output(_scatter),
    "aten.scatter_add.default": _by_output(_scatter),
    "aten.scatter_reduce.two": _by_output(_scatter),
    "aten.index_put.default": _by_output(_index_put),
    "aten.index_select.default": _by_output(_index_select),
    "aten.slice_scatter.default": _by_output(_slice_scatter),
    "aten.select_scatter.default": _by_output(_select_scatter),
}


def input_driven_anchor(ctx: RuleContext) -> list[Strategy]:
    """An input-driven op with several tensor inputs: its strategy for every layout of input 0."""
    rule = INPUT_DRIVEN[ctx.node.target]
    return dedupe(rule(ctx, lay) for lay in enumerate_layouts(ctx.in_shape(0), ctx.mesh))
