"""Compile a plan into this rank's module: shard parameters, rewrite the graph, wire collectives.

The traced graph is rewritten node by node into a rank-local ``torch.fx.GraphModule``:

* each parameter becomes a local shard (``get_attr``), cut from the full parameter by the same
  ``slice`` steps a conversion from replicated would run;
* each input of a node whose producer's Spec differs from the Spec the node's strategy requires
  goes through a :class:`runtime.collectives.Convert` module (one per producer tensor and target
  Spec, shared by every consumer that needs it, as the planner priced it);
* each node runs its rank-local kernel (:mod:`runtime.kernels`, found by its kind in
  :mod:`runtime.kernel_registry`) with localised shape arguments;
* the loss is converted to replicated (an all-reduce over its partial axes) and returned.

``print(pm.graph_module.code)`` shows the result. Parameter gradients that are partial over the
data-parallel axes are all-reduced when backward finishes (``step`` phase collectives).
"""

from __future__ import annotations

import itertools
import operator
import os
import warnings
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx

from planner.ir import IRGraph, Node
from planner.layout import Layout, Spec, parse_spec, spec_conversion
from planner.plan import CONTIGUOUS, NodePlan, Plan, fingerprint
from planner.runtime.collectives import CommRecorder, Convert, relayout
from planner.runtime.groups import MeshGroups, build_groups
from planner.runtime.host_memory import keep_freed_memory
from planner.runtime.kernel_registry import build_kernel
from planner.runtime.kernels import AddBias, RegatherKernel
from planner.runtime.materialize import is_meta_module, materialize
from planner.runtime.module import ParallelModule, attr_name
from planner.runtime.recompute import checkpoint_segments
from planner.runtime.weights import Wanted, WeightSource, box_requests, open_weights
from planner.runtime.zero3 import Member, ParamUnits
from planner.trace import micro_batch_inputs, trace

_BIAS_INPUT = {"linear": 2, "addmm": 0}  # which input of the kernel is the bias


def compile_plan(
    plan: Plan,
    model: torch.nn.Module,
    example_args: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
    mesh_groups: MeshGroups | None = None,
    loss_partial_over: frozenset[str] = frozenset(),
    graph: IRGraph | None = None,
    init: Callable[[torch.nn.Module], None] | None = None,
    weights: str | os.PathLike[str] | WeightSource | None = None,
    device_mesh: Any = None,
    parameters: Collection[str] | None = None,
) -> ParallelModule:
    """This rank's runnable module for ``plan``. ``example_*``: a full (global) batch, as planned.

    A model on the meta device is materialised shard by shard (:mod:`runtime.materialize`): its
    initialisation (``init``, default :func:`runtime.materialize.default_init`) replayed under the
    current random state, each rank keeping only its own shards, which equal the slices of what
    the same model built on a CPU after the same ``torch.manual_seed`` holds. ``weights``: a file
    or checkpoint to take the parameters (and buffers) from (:mod:`runtime.weights`), each rank
    reading only its shards; a meta model then materialises only what the file lacks.
    ``device_mesh``: a torch DeviceMesh with the plan's axis names and degrees to run on (default:
    one made with ``init_device_mesh``; ``pm.device_mesh`` either way). ``parameters``: with a meta
    model, materialise only the parameters of these names (any of a tied weight's names); the others
    stay on the meta device, shapes without values (a pipeline stage's rank holds only its stage's,
    runtime.cdp_pipeline).

    ``loss_partial_over``: mesh axes over which the returned loss stays a partial sum (this rank's
    contribution) instead of being all-reduced; CDP sums over the data-parallel axis itself.
    ``graph``: the model already traced on those inputs (one micro-batch's, for a plan with
    several), to compile several plans of one model without tracing it again each time."""
    example_kwargs = dict(example_kwargs or {})
    if plan.micro_batches > 1:  # the plan is one micro-batch's (gradient accumulation): trace one
        example_args, example_kwargs = micro_batch_inputs(example_args, example_kwargs, plan.micro_batches)
    if graph is None:
        graph = trace(model, example_args, example_kwargs)
    if plan.model_fingerprint not in (fingerprint(graph), fingerprint(graph, exact=True)):
        raise ValueError(
            f"the plan was made for a different model or input shapes (fingerprint {plan.model_fingerprint}, "
            f"this model traces to {fingerprint(graph)}); re-plan with these inputs"
        )
    dev = torch.device(device) if device is not None else _default_device()
    mg = mesh_groups or build_groups(plan.mesh_obj, dev.type, device_mesh)
    if dev.type == "cpu":  # freed tensors' pages kept for the next step, not faulted in again (runtime.host_memory)
        keep_freed_memory()
    recorder = CommRecorder()
    builder = _Builder(plan, graph, model, mg, recorder, dev)
    builder.only = frozenset(parameters) if parameters is not None else None
    loss_partial_over = frozenset(loss_partial_over)  # any collection of axis names
    if plan.cdp != "off":  # CDP sums over the data-parallel axis itself (runtime.cdp)
        loss_partial_over |= set(plan.mesh_obj.active_dp_axes)
    builder.loss_partial_over = loss_partial_over
    source = (weights if isinstance(weights, WeightSource) else open_weights(weights)) if weights is not None else None
    if source is not None:
        builder.read_weights(source)
    if is_meta_module(model):
        builder.materialize(init, prune=source is not None)
    gm = builder.build()
    if plan.recompute != "none":  # each repeated layer's instance under torch.utils.checkpoint
        checkpoint_segments(gm, builder.origin, plan, graph)
    units = _param_units(plan, gm, builder.sites, mg, recorder)
    if plan.zero_prefetch:
        prefetch_parameter_gathers(gm)  # the gathers outside units, one ahead
    pm = ParallelModule(plan, graph, gm, mg, recorder, builder.param_specs, builder.param_names, builder.input_specs)
    pm.units = units
    pm.device = dev
    pm.buffer_names = builder.buffer_names
    pm.persistent_buffers = frozenset(model.state_dict(keep_vars=True)) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    pm.node_origin = builder.origin
    pm.node_values = {key: fx_node.name for key, fx_node in builder.env.items()}
    return pm


def _param_units(plan: Plan, gm: torch.fx.GraphModule, sites: dict[str, tuple[Convert, str]], mg: MeshGroups, rec: CommRecorder) -> ParamUnits | None:
    """The plan's ZeRO-3 units over the gather sites the rewrite made (runtime.zero3)."""
    if not plan.param_units:
        return None
    members = []
    for unit in plan.param_units:
        row = []
        for g in unit.gathers:
            if g.site not in sites:
                raise ValueError(f"the plan's ZeRO-3 unit of {unit.block or '<root>'} gathers {g.site}, which the rewritten graph does not: "
                                 "the plan was made by another version of the planner; re-plan")
            conv, attr = sites[g.site]
            row.append(Member(conv, gm.get_parameter(attr), g.regather, g.reduced))
        members.append(row)
    return ParamUnits(plan.param_units, members, mg, rec, plan.zero_prefetch)


def prefetch_parameter_gathers(gm: torch.fx.GraphModule) -> int:
    """ZeRO-3 prefetch: start each parameter's all-gather one gather ahead.

    The parameter gathers (edge conversions of a parameter, and the gathers a re-gathering kernel
    runs on its parameter inputs) are listed in graph order g_1, g_2, ...; g_k is started
    asynchronously just before the node that consumes g_{k-1}, so it travels while that node and
    the ones up to g_k's consumer compute. At most one gathered parameter is in flight beyond those
    in use. Returns the number of gathers prefetched."""
    gathers: list[tuple[torch.fx.Node, Convert, torch.fx.Node]] = []
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, Convert):
            candidates = [(module, node.args[0])]
        elif isinstance(module, RegatherKernel):
            candidates = [(conv, node.args[int(key)]) for key, conv in module.gathers.items()]  # type: ignore[misc]
        else:
            continue
        for conv, arg in candidates:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and conv.prefetchable:
                gathers.append((node, conv, arg))
    for (before, _, _), (_, conv, param) in itertools.pairwise(gathers):
        name = f"prefetch_{len(list(gm.named_children()))}"
        gm.add_submodule(name, _Start(conv))
        with gm.graph.inserting_before(before):
            attr = gm.graph.get_attr(str(param.target))
            gm.graph.call_module(name, (attr,))
    gm.graph.lint()
    gm.recompile()
    return max(len(gathers) - 1, 0)


class _Start(torch.nn.Module):
    def __init__(self, conv: Convert) -> None:
        super().__init__()
        self.conv = [conv]  # not a submodule: the Convert lives where the graph uses it

    def forward(self, x: torch.Tensor) -> None:
        self.conv[0].start(x)


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Builder:
    def __init__(self, plan: Plan, graph: IRGraph, model: torch.nn.Module, mg: MeshGroups, rec: CommRecorder, device: torch.device) -> None:
        self.plan = plan
        self.graph = graph
        self.model = model
        self.mg = mg
        self.rec = rec
        self.device = device
        self.nodes: dict[str, NodePlan] = {n.name: n for n in plan.nodes}
        for node in graph.nodes.values():  # traced here but not where the plan was made (planner.plan.fingerprint)
            if node.target == CONTIGUOUS and node.name not in self.nodes and len(node.inputs) == 1:
                ref = node.inputs[0]
                spec = self.nodes[ref.node].outputs[ref.index]
                self.nodes[node.name] = NodePlan(name=node.name, target=node.target, algorithm="follow", kernel="op", inputs=(spec,), outputs=(spec,),
                                                 split_axes=self.nodes[ref.node].split_axes, module=node.module_path)
        missing = [name for name, node in graph.nodes.items() if node.kind != "output" and name not in self.nodes]
        extra = [n.name for n in plan.nodes if n.name not in graph.nodes and n.target != CONTIGUOUS]
        if missing or extra:
            raise ValueError(f"the plan does not match the traced graph: nodes {missing[:5]} have no strategy in the plan"
                             f"{f', and the plan names nodes the graph lacks: {extra[:5]}' if extra else ''} (an edited plan file, "
                             "or one made by another version of the planner); re-plan with planner report ... --save-plan FILE")
        self.fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
        self.root = torch.nn.Module()
        self.fx = torch.fx.Graph()
        self.env: dict[tuple[str, int], torch.fx.Node] = {}
        self.converted: dict[tuple[str, int, Spec], torch.fx.Node] = {}
        self.param_specs: dict[str, Spec] = {}
        self.param_names: dict[str, tuple[str, ...]] = {}
        self.buffer_names: dict[str, tuple[str, ...]] = {}
        self.input_specs: list[Spec] = []
        self.count = 0
        self.loss_partial_over: frozenset[str] = frozenset()
        self.origin: dict[str, str] = {}  # rank-local fx node -> the traced node it computes
        self.sites: dict[str, tuple[Convert, str]] = {}  # parameter gather sites (planner.overlap's names) -> (gather, parameter attribute)
        self.materialized: dict[str, torch.Tensor] = {}  # a meta model's parameters (this rank's shards) and buffers, by name
        self.only: frozenset[str] | None = None  # a meta model's parameters to materialise (None: all)

    def _layouts(self) -> dict[str, Layout | None]:
        """Every name of each parameter the graph reads -> its stored layout; of each buffer -> None (whole)."""
        layouts: dict[str, Layout | None] = {}
        for node in self.graph.nodes.values():
            if node.kind == "param":
                spec = self.nodes[node.name].output_specs()[0]
                assert spec is not None
                layouts.update((name, spec.layout) for name in node.param_names)
            elif node.kind == "buffer":
                layouts.update((name, None) for name in node.param_names)
        return layouts

    def _groups_of_names(self) -> list[tuple[str, ...]]:
        return [node.param_names for node in self.graph.nodes.values() if node.kind in ("param", "buffer")]

    def materialize(self, init: Callable[[torch.nn.Module], None] | None, prune: bool = False) -> None:
        """Replay the meta model's initialisation, keeping this rank's shard of each parameter (as
        :meth:`_param` stores it) and each buffer the graph reads, whole; those read from a file
        already are left out (``prune``: and the ops only they need)."""
        layouts = self._layouts()
        wanted = {n for names in self._groups_of_names() if not any(m in self.materialized for m in names) and self._wanted(names, layouts)
                  for n in names}

        def keep(name: str, full: torch.Tensor) -> None:
            layout = layouts[name]
            self.materialized[name] = (full if layout is None else self.shard(full, layout)).to(self.device).clone()

        if wanted:
            materialize(self.model, keep, init=init, names=wanted, prune=prune)

    def _wanted(self, names: tuple[str, ...], layouts: dict[str, Layout | None]) -> bool:
        """Whether a meta model's parameter (or buffer: always) of these names is materialised here."""
        return self.only is None or layouts[names[0]] is None or any(n in self.only for n in names)

    def read_weights(self, source: WeightSource) -> None:
        """This rank's box of every parameter (and every buffer) ``source`` holds under one of its names."""
        layouts = self._layouts()
        wanted = []
        for names in self._groups_of_names():
            layout = layouts[names[0]]
            t = self.model.get_parameter(names[0]) if layout is not None else self.model.get_buffer(names[0])
            wanted.append((Wanted(names, tuple(t.shape), layout), t.dtype))
        dtypes = {w.names: dtype for w, dtype in wanted}
        found, lacking = box_requests([w for w, _ in wanted], source, self.mg, "the weights")
        values = source.read({name: box for name, (_, box) in found.items()})
        for name, (w, _) in found.items():
            self.materialized[name] = values[name].to(device=self.device, dtype=dtypes[w.names])
        params = [w.names[0] for w in lacking if w.layout is not None]
        if params:
            warnings.warn(f"the weights hold no {', '.join(params[:5])}{' ...' if len(params) > 5 else ''} ({len(params)} parameters): "
                          "they keep the model's values (a meta model's are initialised as it would initialise them)", UserWarning, stacklevel=3)

    def build(self) -> torch.fx.GraphModule:
        for node in self.graph.nodes.values():
            if node.kind == "input":
                self.env[(node.name, 0)] = self.fx.placeholder(node.name)
                spec = self.nodes[node.name].output_specs()[0]
                assert spec is not None
                self.input_specs.append(spec)
            elif node.kind == "param":
                self._param(node)
            elif node.kind in ("buffer", "constant"):
                self._buffer(node)
            elif node.kind == "op":
                self._op(node)
            elif node.kind == "output":
                self._output(node)
            for new in reversed(self.fx.nodes):  # the fx nodes this traced node added, newest first
                if new.name in self.origin:
                    break
                self.origin[new.name] = node.name
        return torch.fx.GraphModule(self.root, self.fx, class_name="RankLocalModule")

    # ----------------------------------------------------------------- sources

    def _param(self, node: Node) -> None:
        spec = self.nodes[node.name].output_specs()[0]
        assert spec is not None
        full = self.model.get_parameter(node.param_names[0])
        mine = next((self.materialized[n] for n in node.param_names if n in self.materialized), None)
        if mine is None and full.is_meta and self.only is not None and not any(n in self.only for n in node.param_names):
            mine = torch.empty(spec.layout.local_shape(tuple(full.shape), self.mg.mesh), dtype=full.dtype, device="meta")  # not wanted here
        local = mine if mine is not None else self.shard(full.detach(), spec.layout).to(self.device).clone()
        attr = attr_name(node.name)
        self.root.register_parameter(attr, torch.nn.Parameter(local, requires_grad=full.requires_grad))
        self.param_specs[attr] = spec
        self.param_names[attr] = node.param_names
        self.env[(node.name, 0)] = self.fx.get_attr(attr)

    def _buffer(self, node: Node) -> None:
        name = node.param_names[0]
        full = self.graph.constants.get(name) if node.kind == "constant" else next(
            (self.materialized[n] for n in node.param_names if n in self.materialized), None) if node.kind == "buffer" else None
        if full is None and node.kind == "buffer":
            full = self.model.get_buffer(name)
        if not isinstance(full, torch.Tensor):
            raise ValueError(f"the traced graph reads {node.kind} {name!r}, which neither the model nor the trace holds as a tensor")
        attr = attr_name(node.name)
        self.root.register_buffer(attr, full.detach().to(self.device).clone())
        if node.kind == "buffer":
            self.buffer_names[attr] = node.param_names
        self.env[(node.name, 0)] = self.fx.get_attr(attr)

    def shard(self, full: torch.Tensor, layout: Layout) -> torch.Tensor:
        if full.is_meta:
            raise ValueError("a parameter on the meta device reached sharding unmaterialised (runtime.materialize)")
        return relayout(full, Layout.replicated(layout.ndim), layout, self.mg)

    # ----------------------------------------------------------------- ops

    def _input_value(self, consumer: Node, pos: int, want: Spec | None) -> torch.fx.Node:
        ref = consumer.inputs[pos]
        src = self.env[(ref.node, ref.index)]
        have = self.nodes[ref.node].output_specs()[ref.index]
        if want is None or have is None or have == want:
            return src
        key = (ref.node, ref.index, want)
        if key not in self.converted:
            producer = self.graph.nodes[ref.node]
            meta = producer.outputs[ref.index]
            conv = spec_conversion(have, want, self.mg.mesh)
            with_grad = producer.requires_grad and meta is not None and meta.is_float
            module = Convert(conv.forward, conv.backward if with_grad else (), self.mg, self.rec, f"{ref.node}: {have} -> {want}")
            name = self._add(f"convert_{ref.node}", module)
            self.converted[key] = self.fx.call_module(name, (src,))
            if producer.kind == "param":
                self.sites[f"{ref.node}->{want.encode()}"] = (module, attr_name(ref.node))
        return self.converted[key]

    def _add(self, prefix: str, module: torch.nn.Module) -> str:
        self.count += 1
        name = attr_name(f"{prefix}_{self.count}")
        self.root.add_module(name, module)
        return name

    def _op(self, node: Node) -> None:
        np = self.nodes[node.name]
        ins = np.input_specs()
        outs = np.output_specs()
        values = tuple(self._input_value(node, p, ins[p] if p < len(ins) else None) for p in range(len(node.inputs)))
        if np.kernel == "getitem":  # one output of a multi-output op: _op indexed it already (once)
            self.env[(node.name, 0)] = values[0]
            return
        raw = parse_spec(np.raw_output) if np.raw_output is not None else None
        computes = list(ins)  # the Specs the kernel computes with: re-gathered inputs arrive split further
        for pos, text in np.regather:
            computes[pos] = parse_spec(text)
        kernel: torch.nn.Module = build_kernel(self, node, np, computes, [raw] if raw is not None else outs)
        # a strategy that reduces its own partial output adds the bias after the reduction: a bias
        # the kernel gathers itself (ZeRO-3) is gathered there, for the addition, not for the kernel
        bias = _BIAS_INPUT.get(np.kernel) if raw is not None and outs[0] is not None else None
        bias_gather: Convert | None = None
        if np.regather:
            private = {}
            for pos, text in np.regather:
                compute = parse_spec(text)
                arrival = ins[pos]
                assert arrival is not None
                conv = spec_conversion(arrival, compute, self.mg.mesh)
                private[pos] = Convert(conv.forward, conv.backward, self.mg, self.rec, f"{node.name}[{pos}]: {arrival} -> {compute} (re-gathered in backward)")
                if self.graph.nodes[node.inputs[pos].node].kind == "param" and arrival == self.nodes[node.inputs[pos].node].output_specs()[0]:
                    self.sites[f"{node.name}:{pos}"] = (private[pos], attr_name(node.inputs[pos].node))
            bias_gather = private.pop(bias, None) if bias is not None else None
            if private:
                kernel = RegatherKernel(kernel, private, self.mg, self.rec)
        name = self._add(f"k_{node.name}", kernel)
        out = self.fx.call_module(name, values)
        if raw is not None and outs[0] is not None:  # the strategy reduces its own partial output
            conv = spec_conversion(raw, outs[0], self.mg.mesh)
            module = Convert(conv.forward, conv.backward if node.requires_grad else (), self.mg, self.rec, f"{node.name}: {raw} -> {outs[0]}")
            out = self.fx.call_module(self._add(f"reduce_{node.name}", module), (out,))
            if bias is not None and bias < len(values):
                add: torch.nn.Module = AddBias()
                if bias_gather is not None:
                    add = RegatherKernel(add, {1: bias_gather}, self.mg, self.rec)
                out = self.fx.call_module(self._add(f"bias_{node.name}", add), (out, values[bias]))
        if len(node.outputs) == 1:
            self.env[(node.name, 0)] = out
        else:
            for k in range(len(node.outputs)):
                self.env[(node.name, k)] = self.fx.call_function(operator.getitem, (out, k))

    def _output(self, node: Node) -> None:
        ref = node.inputs[0]
        have = self.nodes[ref.node].output_specs()[ref.index]
        value = self.env[(ref.node, ref.index)]
        if have is not None and have.layout.partial - self.loss_partial_over:
            want = Spec(Layout(have.layout.dims, have.layout.partial & self.loss_partial_over))
            module = Convert(spec_conversion(have, want, self.mg.mesh).forward, (), self.mg, self.rec, f"loss: {have} -> {want}")
            value = self.fx.call_module(self._add("loss", module), (value,))
        self.fx.output(value)
