"""Anchors: the ops with a choice of strategy (an ILP variable each), by op family."""

from __future__ import annotations

from planner.ir import IRGraph, Node
from planner.layout import Layout, Spec
from planner.mesh import Mesh
from planner.rules.context import (
    ANCHOR_RULES,
    BINARY_ELEMENTWISE,
    FALLBACK,
    SOURCE_OPS_OK,
    RuleContext,
    active_tp,
    anchor_rule,
    letter_range,
    multi_axis_label,
)
from planner.rules.followers import follow
from planner.rules.indexing import INPUT_DRIVEN, OUTPUT_DRIVEN, input_driven_anchor
from planner.rules.variants import reduced_variants, regather_variants, summa_strategies
from planner.strategy import Comm, Operand, Strategy, dedupe, einsum_strategies, enumerate_layouts, split_label, with_dp


def is_follower(node: Node, graph: IRGraph) -> bool:
    if node.kind != "op" or len(node.inputs) != 1 or broadcasts_batch(node, graph):
        return False
    leader = graph.nodes[node.inputs[0].node]
    return leader.layer == node.layer


def broadcasts_batch(node: Node, graph: IRGraph) -> bool:
    """An expand of a size-1 dim 0 to more rows (ViT's class token to the batch): it chooses."""
    if node.target != "aten.expand.default":
        return False
    src = graph.nodes[node.inputs[0].node].outputs[node.inputs[0].index]
    out = node.out.shape
    return src is not None and len(src.shape) == len(out) and bool(out) and src.shape[0] == 1 < out[0]


@anchor_rule("aten.expand.default")
def _expand(ctx: RuleContext) -> list[Strategy]:
    """An expand that starts a region: the follower's strategy for each input layout, and, where it
    broadcasts dim 0, the output split along it over the data-parallel axes (each rank expands to
    its own rows; the input's gradient, summed over those rows only, is partial over them)."""
    out = [follow(ctx, Spec(lay)) for lay in enumerate_layouts(ctx.in_shape(0), ctx.mesh)]
    dp = ctx.mesh.active_dp_axes
    shape = ctx.node.out.shape
    if dp and broadcasts_batch(ctx.node, ctx.graph) and shape[0] % ctx.mesh.group_size(dp) == 0:
        for s in list(out):
            spec_in, spec_out = s.inputs[0], s.outputs[0]
            if spec_in.layout.dims[0] or spec_out is None or set(dp) & (spec_out.layout.shard_axes | spec_out.layout.partial):
                continue
            grad = (spec_in.grad_partial | set(dp)) if ctx.needs_grad(0) else spec_in.grad_partial
            split_out = Spec(Layout((dp, *spec_out.layout.dims[1:]), spec_out.layout.partial), spec_out.grad_partial - set(dp))
            out.append(Strategy(split_label(ctx.mesh, s.split_axes | set(dp)), "reshape", (Spec(spec_in.layout, frozenset(grad)),), (split_out,), s.split_axes | set(dp)))
    return dedupe(out)


def anchor_strategies(node: Node, graph: IRGraph, mesh: Mesh) -> list[Strategy]:
    if node.kind == "param":
        return _param_strategies(node, mesh)
    if node.kind == "input":
        return [_input_strategy(node, mesh)]
    if node.kind in ("buffer", "constant"):
        return [Strategy("replicate", "source", (), (Spec(Layout.replicated(len(node.out.shape))),))]
    ctx = RuleContext(node, graph, mesh)
    if not node.inputs:
        outs = tuple(Spec(Layout.replicated(len(o.shape))) if o is not None else None for o in node.outputs)
        return [Strategy("replicate" if node.target in SOURCE_OPS_OK else FALLBACK, "op", (), outs)]
    rule = ANCHOR_RULES.get(node.target) or OUTPUT_DRIVEN.get(node.target)
    if rule is None and node.target in INPUT_DRIVEN and len(node.inputs) > 1:
        rule = input_driven_anchor
    if rule is None and node.target in BINARY_ELEMENTWISE:
        rule = _elementwise_strategies
    if rule is None and len(node.inputs) == 1:
        rule = _unary_anchor
    strategies = rule(ctx) if rule is not None else []
    if not strategies:
        strategies = [_fallback(ctx)]
    return strategies


def _fallback(ctx: RuleContext) -> Strategy:
    ins = tuple(Spec(Layout.replicated(len(ctx.in_shape(i)))) for i in range(len(ctx.node.inputs)))
    outs = tuple(Spec(Layout.replicated(len(o.shape))) if o is not None else None for o in ctx.node.outputs)
    return Strategy(FALLBACK, "op", ins, outs)


def _param_strategies(node: Node, mesh: Mesh) -> list[Strategy]:
    out = []
    for lay in enumerate_layouts(node.out.shape, mesh, axes=mesh.tp_axes, orders=True, all_or_none=False):
        label = "replicated" if not lay.shard_axes else "sharded"
        out.append(Strategy(label, "source", (), (Spec(lay),)))
    return out


def _input_strategy(node: Node, mesh: Mesh) -> Strategy:
    """Each rank is fed its data-parallel shard of the batch: dim 0 split over the dp axes."""
    shape = node.out.shape
    dims: list[tuple[str, ...]] = [() for _ in shape]
    dp = mesh.active_dp_axes
    if shape and dp:
        if shape[0] % mesh.group_size(dp):
            raise ValueError(
                f"input {node.name} has batch {shape[0]}, not divisible by the data-parallel degree "
                f"{mesh.group_size(dp)} of mesh {mesh}; use a batch that is a multiple of it"
            )
        dims[0] = dp
    lay = Layout(tuple(dims))
    return Strategy("dp" if dp else "replicate", "source", (), (Spec(lay),))


@anchor_rule("aten.linear.default")
def _linear(ctx: RuleContext) -> list[Strategy]:
    x_shape = ctx.in_shape(0)
    o_dim, i_dim = ctx.in_shape(1)
    batch = letter_range(len(x_shape) - 1)
    sizes = dict(zip(batch, x_shape[:-1], strict=True)) | {"i": i_dim, "o": o_dim}
    operands = [Operand(batch + "i", ctx.is_param(0), ctx.needs_grad(0)), Operand("oi", ctx.is_param(1), ctx.needs_grad(1))]
    if len(ctx.node.inputs) > 2:
        operands.append(Operand("o", ctx.is_param(2), ctx.needs_grad(2)))
    result = []
    roles = {c: "batch" for c in batch} | {"i": "in", "o": "out"}
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, batch + "o", sizes, batch_letters=batch):
        tp_o = [a for a in assign["o"] if not ctx.mesh.is_dp(a)]
        tp_i = [a for a in assign["i"] if not ctx.mesh.is_dp(a)]
        if len(active_tp(ctx.mesh)) > 1:
            label = multi_axis_label(ctx.mesh, assign, roles)
        elif tp_o and tp_i:
            label = "tp-col-row"
        elif tp_o:
            label = "tp1d-col"
        elif tp_i:
            label = "tp1d-row"
        else:
            label = split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "linear", ins, (Spec(out),), split))
    result = regather_variants(ctx, reduced_variants(ctx, result, len(batch), bias=2), {0: None, 1: 1})
    return result + summa_strategies(ctx, batch, sizes)


@anchor_rule("aten.addmm.default")
def _addmm(ctx: RuleContext) -> list[Strategy]:
    """``addmm(bias[n], x[m,k], w[k,n])`` (Hugging Face's Conv1D): a linear with the weight transposed."""
    args = list(ctx.args) + [None] * 5
    beta = ctx.kwargs.get("beta", 1)
    alpha = ctx.kwargs.get("alpha", 1)
    if len(ctx.in_shape(0)) != 1 or beta != 1 or alpha != 1 or args[3] is not None:
        return []
    (n,) = ctx.in_shape(0)
    m, k = ctx.in_shape(1)
    sizes = {"m": m, "k": k, "n": n}
    operands = [Operand("n", ctx.is_param(0), ctx.needs_grad(0)), Operand("mk", ctx.is_param(1), ctx.needs_grad(1)), Operand("kn", ctx.is_param(2), ctx.needs_grad(2))]
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, "mn", sizes, dp_letters="m", batch_letters="m"):
        tp_n = [a for a in assign["n"] if not ctx.mesh.is_dp(a)]
        tp_k = [a for a in assign["k"] if not ctx.mesh.is_dp(a)]
        label = "tp1d-col" if tp_n and not tp_k else "tp1d-row" if tp_k and not tp_n else "tp-col-row" if tp_k else split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "addmm", ins, (Spec(out),), split))
    return reduced_variants(ctx, result, 1, bias=0)


@anchor_rule("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def _matmul(ctx: RuleContext) -> list[Strategy]:
    a, b = ctx.in_shape(0), ctx.in_shape(1)
    if len(a) < 2 or len(b) < 2 or (len(b) > 2 and a[:-2] != b[:-2]):
        return []
    batch = letter_range(len(a) - 2)
    sizes = dict(zip(batch, a[:-2], strict=True)) | {"m": a[-2], "k": a[-1], "n": b[-1]}
    b_letters = (batch if len(b) > 2 else "") + "kn"
    operands = [Operand(batch + "mk", ctx.is_param(0), ctx.needs_grad(0)), Operand(b_letters, ctx.is_param(1), ctx.needs_grad(1))]
    return [
        Strategy(with_dp(split_label(ctx.mesh, split), ctx.mesh, split), "op", ins, (Spec(out),), split)
        for ins, out, split, _ in einsum_strategies(ctx.mesh, operands, batch + "mn", sizes, batch_letters=batch + "m")
        if not out.partial or not any(ctx.mesh.is_dp(p) for p in out.partial)
    ]


@anchor_rule("aten.embedding.default")
def _embedding(ctx: RuleContext) -> list[Strategy]:
    v, e = ctx.in_shape(0)
    idx_shape = ctx.in_shape(1)
    batch = letter_range(len(idx_shape))
    sizes = dict(zip(batch, idx_shape, strict=True)) | {"v": v, "e": e}
    operands = [Operand("ve", ctx.is_param(0), ctx.needs_grad(0)), Operand(batch, False, False)]
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, batch + "e", sizes, dp_letters=batch[:1], batch_letters=batch):
        if assign["v"]:
            label = "vocab-parallel"
        elif assign["e"]:
            label = "tp1d-col"
        else:
            label = split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "embedding", ins, (Spec(out),), split))
    return reduced_variants(ctx, result, len(batch))


@anchor_rule("aten.layer_norm.default")
def _layer_norm(ctx: RuleContext) -> list[Strategy]:
    """Rows split freely; the normalised dim split too (2-D/3-D), when the kernel all-reduces the
    row statistics over those axes: mean and variance forward, and the two row sums of the
    gradient backward (one all-reduce each, of one value per local row)."""
    return _norm_strategies(ctx, "layer_norm", 2)


def _norm_strategies(ctx: RuleContext, kernel: str, stats: int) -> list[Strategy]:
    """A norm over the trailing ``len(args[1])`` dims (weight and bias of that shape): rows split
    freely; one normalised dim split too, by the ``kernel`` that all-reduces ``stats`` row sums
    over its axes forward and as many backward (runtime.kernels.NormKernel)."""
    x_shape = ctx.in_shape(0)
    norm = len(ctx.args[1])
    batch = letter_range(len(x_shape) - norm)
    hidden = letter_range(norm, "p")
    sizes = dict(zip(batch + hidden, x_shape, strict=True))
    operands = [Operand(batch + hidden, ctx.is_param(0), ctx.needs_grad(0))]
    operands += [Operand(hidden, ctx.is_param(i), ctx.needs_grad(i)) for i in range(1, len(ctx.node.inputs))]
    splittable = batch + (hidden if len(hidden) == 1 else "")
    result = []
    itemsize = ctx.in_meta(0).itemsize
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, batch + hidden, sizes, splittable=splittable):
        hidden_axes = ctx.mesh.sort_axes({a for c in hidden for a in assign[c]})
        if not hidden_axes:
            result.append(Strategy(split_label(ctx.mesh, split), "op", ins, (Spec(out),), split))
            continue
        rows = 1
        for c in batch:
            rows *= sizes[c] // ctx.mesh.group_size(assign[c])
        comms = [Comm("all_reduce", hidden_axes, rows * itemsize, "fwd")] * stats + [Comm("all_reduce", hidden_axes, rows * itemsize, "bwd")] * stats
        result.append(Strategy("split-hidden", kernel, ins, (Spec(out),), split, tuple(comms)))
    return result


@anchor_rule("aten.scaled_dot_product_attention.default")
def _attention(ctx: RuleContext) -> list[Strategy]:
    q, k, v = ctx.in_shape(0), ctx.in_shape(1), ctx.in_shape(2)
    if len(q) != 4 or len(ctx.node.inputs) > 4 or q[1] % k[1] or k[1] != v[1]:
        return []
    # grouped-query attention (enable_gqa: q has k[1] x r heads, query head n reads key/value head
    # n // r): heads split into contiguous blocks keep each query block with its key/value block
    # exactly when the split divides the key/value heads, so "h" is sized by those
    sizes = {"b": q[0], "h": k[1], "t": q[2], "s": k[2], "d": q[3], "e": v[3], "1": 1, "2": 1, "3": 1, "4": 1}
    operands = [Operand("bhtd", False, ctx.needs_grad(0)), Operand("bhsd", False, ctx.needs_grad(1)), Operand("bhse", False, ctx.needs_grad(2))]
    splittable = "bh"
    if len(ctx.node.inputs) == 4:  # an attention mask broadcasting to [b, h, t, s]; size-1 dims stay whole
        mask = ctx.in_shape(3)
        full = "bhts"[4 - len(mask) :]
        letters = "".join(c if size == sizes[c] and size != 1 else str(i + 1) for i, (c, size) in enumerate(zip(full, mask, strict=True)))
        operands.append(Operand(letters, False, ctx.needs_grad(3)))
        if len(mask) >= 3 and mask[-3] not in (1, sizes["h"]):  # a per-query-head mask beside fewer key/value heads
            splittable = "b"
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, "bhte", sizes, splittable=splittable, all_or_none=False):
        label = "tp1d-heads" if any(not ctx.mesh.is_dp(a) for a in assign["h"]) else split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "op", ins, (Spec(out),), split))
    return result


@anchor_rule("aten.cross_entropy_loss.default")
def _cross_entropy(ctx: RuleContext) -> list[Strategy]:
    logits, target = ctx.in_shape(0), ctx.in_shape(1)
    args = list(ctx.args) + [None] * 6
    weight, reduction, label_smoothing = args[2], args[3] if args[3] is not None else 1, args[5] or 0.0
    if len(logits) != 2 or len(target) != 1 or weight is not None or label_smoothing or reduction not in (1, 2):
        return []
    sizes = {"n": logits[0], "c": logits[1]}
    operands = [Operand("nc", False, ctx.needs_grad(0)), Operand("n", False, False)]
    result = []
    for ins, _out, split, assign in einsum_strategies(ctx.mesh, operands, "", sizes):
        if any(ctx.mesh.is_dp(a) for a in assign["c"]):
            continue
        n_axes, c_axes = assign["n"], assign["c"]
        comms = []
        n_local = logits[0] // ctx.mesh.group_size(n_axes)
        if c_axes:  # max, sum of exponentials, target logit: one all-reduce each over the class axes
            comms += [Comm("all_reduce", c_axes, n_local * ctx.in_meta(0).itemsize, "fwd")] * 3
        if n_axes and reduction == 1:  # count of non-ignored targets for the global mean
            comms.append(Comm("all_reduce", n_axes, 8, "fwd"))
        label = "vocab-parallel" if c_axes else split_label(ctx.mesh, split)
        out_layout = Layout((), frozenset(n_axes))
        result.append(Strategy(with_dp(label, ctx.mesh, split), "cross_entropy", ins, (Spec(out_layout),), split, tuple(comms)))
    return result


@anchor_rule("aten.cat.default")
def _cat(ctx: RuleContext) -> list[Strategy]:
    out_shape = ctx.node.out.shape
    dim = (ctx.args[1] if len(ctx.args) > 1 else 0) % len(out_shape)
    result = []
    for lay in enumerate_layouts(out_shape, ctx.mesh):
        if lay.dims[dim]:
            continue
        # torch.cat still accepts a legacy empty 1-d tensor of shape [0] beside inputs of any rank
        ins = tuple(Spec(lay) if len(ctx.in_shape(i)) == len(out_shape) else Spec(Layout.replicated(len(ctx.in_shape(i))))
                    for i in range(len(ctx.node.inputs)))
        split = lay.shard_axes
        result.append(Strategy(split_label(ctx.mesh, split), "op", ins, (Spec(lay),), split))
    return result


def _elementwise_strategies(ctx: RuleContext) -> list[Strategy]:
    out_shape = ctx.node.out.shape
    result = []
    for lay in enumerate_layouts(out_shape, ctx.mesh):
        ins = []
        for i in range(len(ctx.node.inputs)):
            shape = ctx.in_shape(i)
            offset = len(out_shape) - len(shape)
            dims = tuple(lay.dims[offset + d] if shape[d] == out_shape[offset + d] else () for d in range(len(shape)))
            in_lay = Layout(dims)
            grad = (lay.shard_axes - in_lay.shard_axes) if ctx.needs_grad(i) else frozenset()
            ins.append(Spec(in_lay, grad))
        result.append(Strategy(split_label(ctx.mesh, lay.shard_axes), "op", tuple(ins), (Spec(lay),), lay.shard_axes))
    return result


def _unary_anchor(ctx: RuleContext) -> list[Strategy]:
    """A single-input op that starts a region: one strategy per layout its input may arrive in."""
    shape = ctx.in_shape(0)
    return dedupe(follow(ctx, Spec(lay)) for lay in enumerate_layouts(shape, ctx.mesh))


# --------------------------------------------------------------------------- followers




@anchor_rule("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default")
def _convolution(ctx: RuleContext) -> list[Strategy]:
    """``conv(x[n, c, *spatial], w[o, c/groups, *kernel], b[o])``: the batch split (data parallel),
    the output channels split (column-parallel: w and b sharded on o), or, without a bias and
    groups, the input channels split (a partial output); the spatial dims stay whole."""
    x, w = ctx.in_shape(0), ctx.in_shape(1)
    spatial = len(x) - 2
    groups = ctx.args[6] if len(ctx.args) > 6 else ctx.kwargs.get("groups", 1)
    x_l, w_l, y_l = "nc" + "HWD"[:spatial], "oc" + "KLM"[:spatial], "no" + "PQR"[:spatial]
    sizes = {"n": x[0], "c": x[1], "o": w[0]} | dict.fromkeys("HWDKLMPQR", 1)
    operands = [Operand(x_l, ctx.is_param(0), ctx.needs_grad(0)), Operand(w_l, ctx.is_param(1), ctx.needs_grad(1))]
    if len(ctx.node.inputs) > 2:
        operands.append(Operand("o", ctx.is_param(2), ctx.needs_grad(2)))
    splittable = "n" if groups != 1 else "no" + ("c" if len(ctx.node.inputs) == 2 else "")
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, y_l, sizes, splittable=splittable, batch_letters="n"):
        label = "tp1d-col" if assign["o"] else "tp1d-row" if assign["c"] else split_label(ctx.mesh, split)
        result.append(Strategy(with_dp(label, ctx.mesh, split), "op", ins, (Spec(out),), split))
    return result


@anchor_rule("transformers.grouped_mm_fallback.default", "aten._grouped_mm.default")
def _grouped_mm(ctx: RuleContext) -> list[Strategy]:
    """Mixture-of-experts grouped matmul ``y[s] = x[s] @ w[e(s)]`` (rows sorted by expert, ``offs``
    the experts' cumulative row counts): the experts' weights split column- or row-parallel over
    tensor-parallel axes like a linear's; the rows stay whole (their order and the offsets are the
    whole batch's routing)."""
    x, w = ctx.in_shape(0), ctx.in_shape(1)
    if len(x) != 2 or len(w) != 3:
        return []
    sizes = {"s": x[0], "k": x[1], "E": w[0], "n": w[2], "F": 1}
    operands = [Operand("sk", ctx.is_param(0), ctx.needs_grad(0)), Operand("Ekn", ctx.is_param(1), ctx.needs_grad(1))]
    operands += [Operand("F"[: len(ctx.in_shape(i))], False, False) for i in range(2, len(ctx.node.inputs))]
    result = []
    for ins, out, split, assign in einsum_strategies(ctx.mesh, operands, "sn", sizes, splittable="kn", dp_letters=""):
        if out.partial and len(ctx.node.inputs) > 3:  # a bias would be added on every rank
            continue
        label = "tp1d-col" if assign["n"] else "tp1d-row" if assign["k"] else split_label(ctx.mesh, split)
        result.append(Strategy(label, "op", ins, (Spec(out),), split))
    return result


@anchor_rule("aten.rms_norm.default")
def _rms_norm(ctx: RuleContext) -> list[Strategy]:
    """``rms_norm(x, shape, weight, eps)`` (torch's nn.RMSNorm): as LayerNorm, one row statistic
    (the mean square) all-reduced forward and one row sum of the gradient backward when the
    normalised dim is split."""
    return _norm_strategies(ctx, "rms_norm", 1)
