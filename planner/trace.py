"""Trace a model into the planner's IR.

1. ``torch.export.export(..., strict=False)`` captures the training-IR ATen graph. It copes with
   ordinary model code (asserts, shape arithmetic, Hugging Face models built from a config) where
   ``torch.fx.symbolic_trace`` fails. A model on the ``meta`` device is traced with meta inputs:
   nothing is allocated, so a 175B-parameter model traces in seconds.
2. Every op node is replayed alone on meta tensors of its recorded shapes and strides, under
   ``FlopCounterMode`` (forward, then ``autograd.grad`` for backward FLOPs) and
   ``saved_tensors_hooks`` (what autograd keeps for backward, attributed to the node's inputs,
   output or internal buffers by storage identity). Replays are cached by op signature, so the 96
   identical blocks of GPT-3 cost one replay each.
3. Repeated layers are found from each node's module path (``h.0``, ``h.1``, ...) and checked to
   be structurally identical; each node then names its template (the node at the same position
   in the first instance) so the solver can share variables.

``forward`` should return the training loss. Models that return it inside a richer output are
accepted as they are (see :func:`_loss_only`): a dict or ``ModelOutput`` with a ``loss`` entry, or a
tuple whose first element is the loss, as Hugging Face ``transformers`` models return when given
``labels``. A model whose ``config`` has ``use_cache`` (Hugging Face) is traced with it off.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator
import re
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from planner.ir import InputRef, IRGraph, Node, RepeatedLayers, Saved, TensorMeta

log = logging.getLogger(__name__)

SDPA = "aten.scaled_dot_product_attention.default"
_LAYER_RE = re.compile(r"^(.+)\.(\d+)$")


class TraceError(ValueError):
    """The model could not be captured; the message says where and what to do."""


def trace(model: torch.nn.Module, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> IRGraph:
    """Trace ``model(*args, **kwargs)`` (which should return the training loss) into an IRGraph."""
    kwargs = dict(kwargs or {})
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        args, kwargs = tree_map(_to_meta, (tuple(args), kwargs))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    ep = _export(model, tuple(args), kwargs)
    timings["export_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    nodes, input_names, output_name = _build_nodes(ep, model)
    timings["annotate_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    repeated = _detect_repeats(nodes)
    timings["repeats_s"] = time.perf_counter() - t0
    graph = IRGraph(
        graph_module=ep.graph_module,
        nodes=nodes,
        input_names=input_names,
        output_name=output_name,
        repeated=repeated,
        in_spec=ep.call_spec.in_spec,
        timings=timings,
        constants=dict(ep.constants),
    )
    log.info("traced %s: %s (%s)", type(model).__name__, graph.summary(), timings)
    return graph


def micro_batch_inputs(args: tuple[Any, ...], kwargs: dict[str, Any] | None, micro_batches: int, index: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Micro-batch ``index`` of ``micro_batches`` cut from one batch: every tensor split along dim 0
    (the batch dim, as the runtime splits it over data parallelism), other values kept. A
    ValueError names the input whose dim 0 does not split."""
    if micro_batches < 1 or not 0 <= index < micro_batches:
        raise ValueError(f"micro-batch {index} of {micro_batches} does not exist")
    flat, spec = tree_flatten((tuple(args), dict(kwargs or {})))
    out = []
    for k, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            if a.dim() == 0 or a.shape[0] % micro_batches:
                raise ValueError(f"input {k} of shape {tuple(a.shape)} does not split into {micro_batches} micro-batches along dim 0 "
                                 f"(the batch dim): use a batch that {micro_batches} divides, or fewer micro-batches")
            a = a.chunk(micro_batches)[index]
        out.append(a)
    mb_args, mb_kwargs = tree_unflatten(out, spec)
    return tuple(mb_args), dict(mb_kwargs)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


@contextlib.contextmanager
def _torch_errors_unlogged() -> Iterator[None]:
    """torch's fake-tensor dispatch logs the traceback of an op that fails on fake tensors (a shape
    mismatch: 19 lines) at ERROR before raising; the TraceError below says it in three, so torch's
    own copy is held back while exporting (it is still the TraceError's cause)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _export(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        with _loss_only(model), _without_partial_graph(), _torch_errors_unlogged():
            ep = torch.export.export(model, args, kwargs, strict=False)
        if any(_mutates(n) for n in ep.graph.nodes):
            # in-place ops (BART's shift_tokens_right, a router's ``/=``, ``detach_``) write through
            # views that sharding would copy: make every node a pure function of its inputs first
            # (functionalisation only; the high-level ops stay as they are)
            ep = ep.run_decompositions({})
        return ep
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/torch/" not in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "inside torch"
        where += _failing_module(exc, model)
        if frames and frames[-1].line:
            where += f"\n    {frames[-1].line.strip()}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "data-dependent" in str(exc) or "DataDependent" in type(exc).__name__:
            advice = ("a shape, or a Python branch or loop, depends on tensor values (nonzero, boolean-mask "
                      "indexing, unique, iterating over a tensor, `if tensor:`): a plan needs every shape to follow "
                      "from the input shapes alone. Compute with fixed shapes instead (torch.where, masks, padding to a "
                      "fixed capacity); for a Hugging Face mixture of experts, keep its default "
                      "experts_implementation='grouped_mm' (or 'batched_mm') rather than 'eager'.")
        else:
            advice = ("make forward() return the training loss for the example inputs you pass (for Hugging Face "
                      "models, pass labels=...); avoid data-dependent Python control flow on tensor values (use "
                      "torch.where / torch.cond); and mark a module whose internals cannot be traced as a leaf by "
                      "wrapping its call in a torch.library custom op.")
        raise TraceError(
            f"could not trace {type(model).__name__} with torch.export (non-strict): {type(exc).__name__}: "
            f"{first}\n  at {where}\n  What to do: {advice}"
        ) from exc


@contextlib.contextmanager
def _without_partial_graph() -> Iterator[None]:
    """A failed ``torch.export`` prints the whole partial graph it traced (hundreds of lines) to
    stderr before raising; the TraceError says what matters. Stderr is held meanwhile and written
    back, less that graph (warnings and logs stay)."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    except BaseException as exc:
        text = held.getvalue().replace(str(getattr(exc, "partial_fx_graph", "") or "\0"), "")
        sys.stderr.write(text.strip("\n") + "\n" if text.strip() else "")
        raise
    sys.stderr.write(held.getvalue())


def _mutates(fx_node: torch.fx.Node) -> bool:
    target = fx_node.target
    return fx_node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


@contextlib.contextmanager
def _loss_only(model: torch.nn.Module) -> Iterator[None]:
    """While exporting, make ``model(...)`` return only its loss, and build no key/value cache.

    A forward hook replaces the output by :func:`loss_of` of it, so the exported graph returns one
    tensor while parameter names and module paths stay the model's own (no wrapper prefix). A
    ``config.use_cache`` (Hugging Face models) is set to False for the export and restored after:
    the cache serves generation, not training, and torch.export cannot return a ``DynamicCache``.
    """
    config: Any = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    if use_cache:
        config.use_cache = False
    handle = model.register_forward_hook(lambda _module, _args, out: loss_of(out))
    try:
        yield
    finally:
        handle.remove()
        if use_cache:
            config.use_cache = use_cache


def loss_of(out: Any) -> Any:
    """The loss in a model's output: the tensor itself, a mapping's ``loss``, a sequence's first item.

    Anything else (a mapping without a loss: no labels were passed) is returned unchanged, and the
    single-scalar check in :func:`_build_nodes` reports what came back.
    """
    if isinstance(out, Mapping) and out.get("loss") is not None:  # dict, Hugging Face ModelOutput
        return out["loss"]
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out


def _failing_module(exc: BaseException, model: torch.nn.Module) -> str:
    """`` (module 'path', Class)`` for the innermost submodule of ``model`` whose forward raised."""
    paths = {id(m): name for name, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in paths:
            found = f" (module {paths[id(owner)] or '<root>'!r}, {type(owner).__name__})"
        tb = tb.tb_next
    return found


def _meta_of(val: Any) -> TensorMeta | None:
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in val.shape), str(val.dtype))
    return None


def _module_path(fx_node: torch.fx.Node) -> str:
    stack = fx_node.meta.get("nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if v[0]]
    return paths[-1] if paths else ""


def _layer_of_path(fx_node: torch.fx.Node) -> tuple[str, int] | None:
    stack = fx_node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        m = _LAYER_RE.match(path or "")
        if m:
            return m.group(1), int(m.group(2))
    return None


def _build_nodes(ep: Any, model: torch.nn.Module) -> tuple[dict[str, Node], tuple[str, ...], str]:
    sig = ep.graph_signature
    to_param = dict(sig.inputs_to_parameters)
    to_buffer = dict(sig.inputs_to_buffers)
    to_const = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases[id(p)].append(name)
    names_of = {names[0]: tuple(names) for names in aliases.values()}
    for names in aliases.values():
        for n in names:
            names_of[n] = tuple(names)
    nodes: dict[str, Node] = {}
    inputs: list[str] = []
    output_name = ""
    cache: dict[Any, tuple[int, int, tuple[Saved, ...], int | None]] = {}
    for fx_node in ep.graph.nodes:
        val = fx_node.meta.get("val")
        if fx_node.op == "placeholder" and not isinstance(val, torch.Tensor) and not fx_node.users:
            continue  # a Python constant argument (use_cache=False, return_dict=False): baked into the graph
        if fx_node.op == "placeholder":
            meta = _meta_of(val)
            if fx_node.name in to_param:
                fqn = to_param[fx_node.name]
                kind, pnames, grad = "param", names_of.get(fqn, (fqn,)), True
            elif fx_node.name in to_buffer:
                kind, pnames, grad = "buffer", (to_buffer[fx_node.name],), False
            elif fx_node.name in to_const:
                kind, pnames, grad = "constant", (to_const[fx_node.name],), False
            else:
                kind, pnames, grad = "input", (), False
                inputs.append(fx_node.name)
            nodes[fx_node.name] = Node(
                fx_node.name, kind, "placeholder", (), (meta,), param_names=pnames, requires_grad=grad,  # type: ignore[arg-type]
                template=fx_node.name,
            )
        elif fx_node.op == "call_function" and val is None and not fx_node.users:
            continue  # a check with no result, e.g. aten._assert_tensor_metadata: nothing to plan
        elif fx_node.op == "call_function":
            refs = _input_refs(fx_node)
            outs = tuple(_meta_of(v) for v in val) if isinstance(val, (tuple, list)) else (_meta_of(val),)
            target = _target_name(fx_node.target)
            node = Node(fx_node.name, "op", target, refs, outs, module_path=_module_path(fx_node), template=fx_node.name)
            if fx_node.target is operator.getitem:
                node.alias_input = 0
            else:
                key = _signature(fx_node)
                if key not in cache:
                    cache[key] = _replay(fx_node)
                node.flops_fwd, node.flops_bwd, node.saved, node.alias_input = cache[key]
            node.requires_grad = any(nodes[r.node].requires_grad for r in refs) and any(
                o is not None and o.is_float for o in outs
            )
            nodes[fx_node.name] = node
        elif fx_node.op == "output":
            flat, _ = tree_flatten(fx_node.args)
            returned = [a for a in flat if isinstance(a, torch.fx.Node)]
            if len(returned) != 1 or nodes[returned[0].name].outputs[0] is None or nodes[returned[0].name].out.shape != ():
                shapes = [str(nodes[o.name].outputs[0]) for o in returned]
                raise TraceError(
                    f"the model returns {len(returned)} tensor(s) {shapes}; the planner needs forward() to "
                    "return one scalar training loss for the example inputs: a tensor, a dict or "
                    "ModelOutput with a 'loss', or a tuple whose first element is the loss (pass the "
                    "targets/labels, e.g. labels=... for Hugging Face models)"
                )
            output_name = returned[0].name
            _drop_unused_placeholders(ep.graph, nodes)
            nodes["output"] = Node("output", "output", "output", (InputRef(output_name),), (), template="output")
        else:
            raise TraceError(f"unexpected fx node {fx_node.op} {fx_node.target} in the exported graph")
    return nodes, tuple(inputs), output_name


def _drop_unused_placeholders(graph: torch.fx.Graph, nodes: dict[str, Node]) -> None:
    """Tied weights export as one used placeholder and one unused one: keep the used one."""
    for fx_node in graph.nodes:
        if fx_node.op == "placeholder" and not fx_node.users and fx_node.name in nodes and nodes[fx_node.name].kind != "input":
            del nodes[fx_node.name]


def _target_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    return str(target)


def _input_refs(fx_node: torch.fx.Node) -> tuple[InputRef, ...]:
    if fx_node.target is operator.getitem:
        src, idx = fx_node.args
        assert isinstance(src, torch.fx.Node)
        return (InputRef(src.name, int(idx)),)  # type: ignore[arg-type]
    flat, _ = tree_flatten((fx_node.args, fx_node.kwargs))
    return tuple(InputRef(a.name) for a in flat if isinstance(a, torch.fx.Node))


def _tensor_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), tuple(v.stride()), str(v.dtype))
    return v


def _signature(fx_node: torch.fx.Node) -> Any:
    def key(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return _tensor_key(a.meta.get("val"))
        return repr(a)

    flat, _ = tree_flatten((fx_node.args, fx_node.kwargs))
    return (str(fx_node.target), tuple(key(a) for a in flat))


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # type: ignore[no-any-return]


def _replay(fx_node: torch.fx.Node) -> tuple[int, int, tuple[Saved, ...], int | None]:
    """Run the node's op alone on meta tensors: (fwd FLOPs, bwd FLOPs, saved tensors, aliased input)."""

    def materialize(a: Any) -> Any:
        if isinstance(a, torch.device):  # x.to(device) replays on meta
            return torch.device("meta")
        if isinstance(a, torch.fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                if t.is_floating_point():
                    t.requires_grad_(True)
                return t
            return v
        return a

    args, kwargs = tree_map(materialize, (fx_node.args, fx_node.kwargs), is_leaf=lambda x: isinstance(x, torch.fx.Node))
    tensor_inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), FlopCounterMode(display=False) as fc:
            out = fx_node.target(*args, **kwargs)  # type: ignore[operator]
        flops_fwd = int(fc.get_total_flops())
    except Exception as exc:
        log.warning("could not replay %s (%s) on meta tensors: %s; counting 0 FLOPs", fx_node.name, fx_node.target, exc)
        return 0, 0, (), None
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    in_storage = {_storage_id(t): i for i, t in reversed(list(enumerate(tensor_inputs)))}
    alias = None
    if outs and _storage_id(outs[0]) in in_storage:
        alias = in_storage[_storage_id(outs[0])]
    flops_bwd = 0
    diff_outs = [o for o in outs if o.requires_grad and o.grad_fn is not None]
    grad_ins = [t for t in tensor_inputs if t.requires_grad]
    if diff_outs and grad_ins:
        try:
            with FlopCounterMode(display=False) as fc:
                torch.autograd.grad(diff_outs, grad_ins, [torch.ones_like(o) for o in diff_outs], allow_unused=True)
            flops_bwd = int(fc.get_total_flops())
        except Exception as exc:
            log.warning("no backward FLOPs for %s: %s", fx_node.name, exc)
    if str(fx_node.target) == SDPA:
        return flops_fwd, flops_bwd, _flash_saved(tensor_inputs, outs[0]), alias
    records: list[Saved] = []
    seen: set[int] = set()
    out_storage = {_storage_id(o): i for i, o in enumerate(outs)}
    for t in saved:
        sid = _storage_id(t)
        if sid in seen:
            continue
        seen.add(sid)
        if sid in in_storage:
            i = in_storage[sid]
            records.append(Saved("input", i, _nbytes(tensor_inputs[i])))
        elif sid in out_storage:
            records.append(Saved("output", out_storage[sid], _nbytes(outs[out_storage[sid]])))
        else:
            records.append(Saved("internal", 0, int(t.untyped_storage().nbytes())))
    return flops_fwd, flops_bwd, tuple(records), alias


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flash_saved(inputs: list[torch.Tensor], out: torch.Tensor) -> tuple[Saved, ...]:
    """What a fused (flash / memory-efficient) attention kernel saves: q, k, v, output, logsumexp.

    On meta tensors attention decomposes into the math path, which would also save the
    T x S probabilities; the kernels that run on GPUs and CPUs do not, so we do not price them.
    """
    q = inputs[0]
    lse = q.numel() // q.shape[-1] * 4  # float32 log-sum-exp per (batch, head, query)
    recs = [Saved("input", i, _nbytes(inputs[i])) for i in range(min(3, len(inputs)))]
    return (*recs, Saved("output", 0, _nbytes(out)), Saved("internal", 0, lse))


def _detect_repeats(nodes: dict[str, Node]) -> tuple[RepeatedLayers, ...]:
    """Find structurally identical instances of an indexed module (``h.0``, ``h.1``, ...)."""
    # nodes are annotated with their layer instance through the module path
    by_layer: dict[str, dict[int, list[Node]]] = defaultdict(lambda: defaultdict(list))
    for node in nodes.values():
        if node.kind == "op":
            m = match_layer(node.module_path)
            if m:
                by_layer[m[0]][m[1]].append(node)
    repeated: list[RepeatedLayers] = []
    for prefix, instances in by_layer.items():
        if len(instances) < 2:
            continue
        idxs = sorted(instances)
        params: dict[int, list[Node]] = defaultdict(list)
        for node in nodes.values():
            if node.kind == "param":
                for pname in node.param_names:
                    found = re.match(rf"^{re.escape(prefix)}\.(\d+)\.(.+)$", pname)
                    if found:
                        params[int(found.group(1))].append(node)
                        break
        for i in idxs:
            params[i].sort(key=lambda n: _suffix(n, prefix))
        seqs = {i: params[i] + instances[i] for i in idxs}
        if not _same_structure([seqs[i] for i in idxs]):
            log.info("layers %s.* are not identical; not sharing variables", prefix)
            continue
        first = seqs[idxs[0]]
        for i in idxs:
            for pos, node in enumerate(seqs[i]):
                node.layer = i
                node.template = first[pos].name
        repeated.append(RepeatedLayers(prefix, len(idxs), len(first)))
    return tuple(repeated)


def match_layer(path: str) -> tuple[str, int] | None:
    """(prefix, index) of the numbered submodule a module path lies in (``h.3.attn`` -> ("h", 3))."""
    parts = path.split(".")
    for k in range(1, len(parts)):
        if parts[k].isdigit():
            return ".".join(parts[:k]), int(parts[k])
    return None


def _suffix(node: Node, prefix: str) -> str:
    for pname in node.param_names:
        m = re.match(rf"^{re.escape(prefix)}\.\d+\.(.+)$", pname)
        if m:
            return m.group(1)
    return node.name


def _same_structure(seqs: list[list[Node]]) -> bool:
    if len({len(s) for s in seqs}) != 1:
        return False
    positions = [{n.name: k for k, n in enumerate(s)} for s in seqs]
    ref = seqs[0]
    for seq, pos in zip(seqs[1:], positions[1:], strict=True):
        for a, b in zip(ref, seq, strict=True):
            if a.target != b.target or a.outputs != b.outputs or len(a.inputs) != len(b.inputs):
                return False
            for ra, rb in zip(a.inputs, b.inputs, strict=True):
                inside_a = positions[0].get(ra.node)
                inside_b = pos.get(rb.node)
                if (inside_a is None) != (inside_b is None) or inside_a != inside_b or ra.index != rb.index:
                    return False
    return True
