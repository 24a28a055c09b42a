"""The rank-local module a plan compiles to: forward, automatic gradient sync, state gathering.

**Feeding data.** Each rank calls the module with *its* data-parallel shard of the global batch:
the plan's inputs are split along dim 0 over the data-parallel axes (rank coordinates in the
mesh decide which slice), replicated over the tensor-parallel axes. ``pm.shard_batch(*full)``
cuts that slice from a full batch (handy when every rank loads the same batch); a data loader
with a ``DistributedSampler`` over ``num_replicas=pm.dp_degree, rank=pm.dp_rank`` gives each
rank its slice without loading the rest.

The forward returns the global loss (identical on every rank); ``loss.backward()`` computes the
local gradient shards, and gradients that are partial sums over mesh axes (the data-parallel
ones, and tensor-parallel partial sums such as a sequence-parallel norm's weight) are all-reduced
in the plan's buckets, each started as soon as backward has its last gradient
(:mod:`runtime.buckets`), and waited for when backward finishes (the ``step`` phase).

**Gradient accumulation.** A plan with ``micro_batches = m`` > 1 was made for one micro-batch (its
shapes are the batch / m): ``pm.forward_backward(*local)`` runs a step's m micro-batches of this
rank's shard one after another, each loss scaled by 1/m, and syncs gradients once, after the last
(:meth:`no_sync` keeps the others local, as DDP's ``no_sync``; ZeRO-2 still reduce-scatters each
micro-batch's gradients into its slice as backward produces them, and ZeRO-3's reduce-scatters are
part of every backward: both are priced per micro-batch).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.ir import IRGraph
from planner.layout import Layout, Spec
from planner.plan import Plan
from planner.runtime.buckets import GradBuckets
from planner.runtime.collectives import CommRecorder, all_reduce, relayout
from planner.runtime.faults import CollectiveError
from planner.runtime.groups import MeshGroups
from planner.runtime.precision import MasterWeights, find_master_weights
from planner.runtime.zero import ZeroOptimizer, ZeroShards
from planner.runtime.zero3 import ParamUnits
from planner.trace import micro_batch_inputs


class KernelError(RuntimeError):
    """An op of the rank-local module failed; the message names the traced op, its module, the
    model's source line and the plan's Specs for it, then the original error (``__cause__``)."""


def attr_name(node: str) -> str:
    """The rank-local module's attribute holding traced parameter (or buffer) ``node``."""
    return re.sub(r"[^0-9a-zA-Z_]", "_", node)


def source_line(graph: IRGraph, node: str) -> str:
    """The model's own source line that produced traced node ``node`` (the last frame outside
    torch in its stack trace), "file:line" with the code; "" when the trace kept none."""
    fx_node = next((n for n in graph.graph_module.graph.nodes if n.name == node), None)
    stack = (fx_node.meta.get("stack_trace") or "") if fx_node is not None else ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', stack)
    ours = [f for f in frames if "/torch/" not in f[0]] or frames
    if not ours:
        return ""
    file, line, code = ours[-1]
    return f"{file}:{line}: {code.strip()}"


def _failed_node(gm: torch.fx.GraphModule, exc: BaseException) -> torch.fx.Node | None:
    """The node of ``gm``'s generated forward running when ``exc`` was raised: the innermost frame
    of that code in the traceback, through fx's line-number map."""
    code, line = type(gm).forward.__code__, None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    lineno_map = getattr(gm, "_lineno_map", None)
    if line is None or not lineno_map:
        return None
    index = lineno_map.get(line - gm._prologue_start)
    nodes = list(gm.graph.nodes)
    return nodes[index] if index is not None and index < len(nodes) else None


class _SyncAtBackwardEnd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, module: ParallelModule) -> torch.Tensor:  # type: ignore[override]
        ctx.module = module
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        torch.autograd.Variable._execution_engine.queue_callback(ctx.module.sync_grads)  # type: ignore[attr-defined]
        return grad, None


class ParallelModule(torch.nn.Module):
    def __init__(
        self,
        plan: Plan,
        graph: IRGraph,
        graph_module: torch.fx.GraphModule,
        mesh_groups: MeshGroups,
        recorder: CommRecorder,
        param_specs: dict[str, Spec],
        param_names: dict[str, tuple[str, ...]],
        input_specs: list[Spec],
    ) -> None:
        super().__init__()
        self.plan = plan
        self.front: list[Plan] = []  # auto_parallelize: the time/memory front the plan was chosen from
        self.graph = graph
        self.graph_module = graph_module
        self.mesh_groups = mesh_groups
        self.recorder = recorder
        self.param_specs = param_specs
        self.param_names = param_names
        self.buffer_names: dict[str, tuple[str, ...]] = {}  # buffer attribute -> the model's names for it (set by compile)
        self.persistent_buffers: frozenset[str] = frozenset()  # the buffer names the model's state_dict holds (set by compile)
        self.input_specs = input_specs
        self.device = torch.device("cpu")  # where the shards live; inputs are moved here (set by compile)
        self.zero: ZeroShards | None = None
        self.units: ParamUnits | None = None  # ZeRO-3's per-block gathers (set by compile)
        self._sync = True  # no_sync() turns the data-parallel sync at backward end off
        self._local = False  # keep_grads_local(): a schedule of the caller's syncs the gradients
        self.node_origin: dict[str, str] = {}  # rank-local fx node name -> traced node name (set by compile)
        self.node_values: dict[tuple[str, int], str] = {}  # traced (node, output) -> the rank-local fx node holding it
        if plan.shards_nothing:  # say so once, where the user builds the module
            warnings.warn(plan.shards_nothing_note(), UserWarning, stacklevel=3)
        names = [n for b in plan.grad_buckets for n in b.params] if plan.cdp == "off" else []
        self._bucketed = {attr_name(n) for n in names}  # attributes whose gradients the buckets sync
        if plan.zero_stage in (1, 2) and plan.cdp == "off":  # CDP shards optimizer states its own way (runtime.cdp)
            dp_axes = {attr: mesh_groups.mesh.sort_axes(spec.grad_partial) for attr, spec in param_specs.items()}
            self.zero = ZeroShards(self.local_parameters(), dp_axes, plan.zero_stage, mesh_groups, recorder, self._bucketed)
        self.buckets: GradBuckets | None = None
        if names:
            slices = self.zero.shards if self.zero is not None else {}
            self.buckets = GradBuckets(plan.grad_buckets, {n: graph_module.get_parameter(attr_name(n)) for n in names}, mesh_groups, recorder,
                                       lambda: self._sync, {n: slices[attr_name(n)] for n in names if attr_name(n) in slices}, plan.zero_stage)
            if self.zero is not None:
                self.zero.buckets = self.buckets

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any) -> Any:
        """A torch optimizer over this rank's parameters; with ZeRO-1/2 over its data-parallel slices
        (states only for the slice; ``step`` all-gathers the updated parameters); with the plan's
        ``master_dtype`` (mixed precision) over master copies in that dtype."""
        params = self.zero.optimizer_params() if self.zero is not None else list(self.parameters())
        inner: Any
        if self.plan.master_dtype:
            inner = MasterWeights(params, optimizer_class, getattr(torch, self.plan.master_dtype), **kwargs)
        else:
            inner = optimizer_class(params, **kwargs)
        return ZeroOptimizer(self.zero, inner) if self.zero is not None else inner

    # ----------------------------------------------------------------- data

    @property
    def dp_axes(self) -> tuple[str, ...]:
        return self.mesh_groups.mesh.active_dp_axes

    @property
    def dp_degree(self) -> int:
        return self.mesh_groups.mesh.group_size(self.dp_axes)

    @property
    def dp_rank(self) -> int:
        return self.mesh_groups.index(self.dp_axes) if self.dp_axes else 0

    def shard_batch(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """This rank's part of a full batch, as the plan's input Specs say, on this rank's device."""
        flat, spec = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self.input_specs):
            raise ValueError(f"expected {len(self.input_specs)} tensor inputs as planned, got {len(tensors)}")
        it = iter(self.input_specs)
        out = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                s = next(it)
                a = relayout(a.to(self.device), Layout.replicated(s.layout.ndim), s.layout, self.mesh_groups)
            out.append(a)
        return tree_unflatten(out, spec)  # type: ignore[no-any-return]

    # ----------------------------------------------------------------- run

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t.to(self.device) for t in flat if isinstance(t, torch.Tensor)]  # (no copy when already there)
        if self.units is not None:
            self.units.begin()
        try:
            # forward itself, not fx's __call__ wrapper: that drops the traceback of an error raised
            # in the generated code (a getitem, a view), the frame that says which node failed
            loss = self.graph_module.forward(*tensors)
        except Exception as exc:
            raise self._kernel_error(exc) from exc
        if torch.is_grad_enabled() and loss.requires_grad:
            loss = _SyncAtBackwardEnd.apply(loss, self)
        return loss  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside leave data-parallel gradients local: they sum up, and the first
        backward after the block syncs the sum (gradient accumulation)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def keep_grads_local(self) -> None:
        """From now on backward leaves every gradient local and nothing here syncs it: the caller
        sums the gradients its own way (runtime.cdp's point-to-point chains). The plan's gradient
        buckets lose their hooks; left on, a bucket's asynchronous all-reduce would write into the
        gradients while the caller reads them, and its collective would meet the other ranks' at
        whatever op each has reached."""
        if self.zero is not None and self.zero.stage == 2:
            raise ValueError("keep_grads_local: this module reduce-scatters gradients in backward (ZeRO-2 hooks); compile the plan with ZeRO 0 or 1")
        if self.buckets is not None:
            self.buckets.remove()
            self.buckets = None
            self._bucketed = set()
            if self.zero is not None:
                self.zero.buckets = None
        self._local = True

    def forward_backward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One training step's forward and backward on this rank's shard of the batch (as
        :meth:`shard_batch` cuts it), in the plan's ``micro_batches`` micro-batches (dim 0 split),
        each loss scaled by 1/m, gradients synced after the last. Returns the step's loss (the mean
        of the micro-batches' losses, detached); then step the optimizer as usual."""
        m = self.plan.micro_batches
        total: torch.Tensor | None = None
        for k in range(m):
            mb_args, mb_kwargs = micro_batch_inputs(args, kwargs, m, k)
            with self.no_sync() if k < m - 1 else contextlib.nullcontext():
                loss = self(*mb_args, **mb_kwargs)
                (loss / m if m > 1 else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        return total / m

    def sync_grads(self) -> None:
        """Finish the gradient sync when backward ends: wait for the buckets (a plan without them,
        from before buckets: one collective per parameter here). Inside :meth:`no_sync` only
        ZeRO-2's, which reduce every micro-batch."""
        if self._local:
            return
        if self.buckets is not None:  # ZeRO-2's buckets reduce in every backward, the others when syncing
            self.buckets.finish()
        if self.units is not None:  # ZeRO-3 reduces every micro-batch
            self.units.finish()
        if not self._sync:
            return
        if self.zero is not None:
            self.zero.reduce_at_backward_end()
            return
        for attr, spec in self.param_specs.items():
            p = self.graph_module.get_parameter(attr)
            axes = self.mesh_groups.mesh.sort_axes(spec.grad_partial)
            if p.grad is not None and axes and attr not in self._bucketed:
                p.grad.copy_(all_reduce(p.grad, axes, self.mesh_groups, self.recorder, "step"))

    def _kernel_error(self, exc: Exception) -> Exception:
        """``exc`` as a :class:`KernelError` naming the traced op that raised it (``exc`` itself
        when no node of the generated forward was running: an error before or after the graph)."""
        if isinstance(exc, CollectiveError):  # a rank stalled or died: that message is the one to read
            return exc
        fx_node = _failed_node(self.graph_module, exc)
        traced = self.node_origin.get(fx_node.name) if fx_node is not None else None
        node = self.graph.nodes.get(traced) if traced is not None else None
        if fx_node is None or node is None:
            return exc
        planned = next((n for n in self.plan.nodes if n.name == node.name), None)
        specs = f"; planned {planned.algorithm}, inputs {list(planned.inputs)} -> outputs {list(planned.outputs)}" if planned is not None else ""
        where = source_line(self.graph, node.name)
        return KernelError(
            f"rank-local op {fx_node.name} for traced node {node.name} ({node.target}) in module "
            f"{node.module_path or '<root>'}{specs}\n  model source: {where or 'not recorded'}\n  {type(exc).__name__}: {exc}\n"
            "planner.runtime.debug.first_divergence on a plan that runs finds a wrong value; a failing op is a runtime bug: report it with this message"
        )

    # ----------------------------------------------------------------- introspection

    # ----------------------------------------------------------------- the model's own names

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters (its shards) under the model's own names: a tied weight under its
        first name, or under each with ``remove_duplicate=False``."""
        for attr, p in self.local_parameters().items():
            names = self.param_names[attr]
            for name in names[:1] if remove_duplicate else names:
                yield prefix + name, p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers the graph reads, under the model's own names."""
        for name, b in self.named_original_buffers().items():
            yield prefix + name, b

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shards of the parameters and the persistent buffers, under the model's own
        names, each name of a tied weight as the model's ``state_dict`` has them (the full tensors:
        :meth:`full_state_dict`)."""
        out: dict[str, Any] = destination if destination is not None else {}
        for name, p in self.named_parameters(remove_duplicate=False):
            out[prefix + name] = p if keep_vars else p.detach()
        for name, b in self.named_buffers():
            if name in self.persistent_buffers:
                out[prefix + name] = b if keep_vars else b.detach()
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Copy this rank's shards (as :meth:`state_dict` gives them) into the parameters and
        buffers. ``strict``: a missing or unexpected name is an error listing them."""
        if assign:
            raise ValueError("assign=True would replace the sharded parameters; load_state_dict copies into them")
        own = self.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(own))
        if strict and (missing or unexpected):
            raise ValueError(f"load_state_dict: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                             f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} (the model's own names; this rank's shards)")
        with torch.no_grad():
            for name, t in own.items():
                if name in state_dict:
                    value = state_dict[name]
                    if tuple(value.shape) != tuple(t.shape):
                        raise ValueError(f"load_state_dict: {name} is {list(value.shape)}, this rank's shard is {list(t.shape)} "
                                         "(pm.state_dict() holds shards; a full state dict loads with runtime.weights.load_weights)")
                    t.copy_(value)
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    @property
    def device_mesh(self) -> Any:
        """The torch DeviceMesh this module runs on (the plan's axis names and degrees)."""
        return self.mesh_groups.device_mesh

    def placements(self, name: str) -> tuple[Any, ...] | None:
        """Parameter ``name``'s sharding as DTensor placements, one per axis of :attr:`device_mesh`:
        ``Shard(d)`` where the layout splits dim d over that axis, ``Replicate()`` elsewhere. None
        where DTensor has no equivalent (a dim split over several axes in another order than the
        mesh's: DTensor splits in mesh order)."""
        from torch.distributed.tensor import Replicate, Shard

        attr = next((a for a, names in self.param_names.items() if name in names), None)
        if attr is None:
            raise KeyError(f"the model has no parameter {name!r}")
        layout = self.param_specs[attr].layout
        mesh = self.mesh_groups.mesh
        out: list[Any] = [Replicate() for _ in mesh.axes]
        for d, axes in enumerate(layout.dims):
            if tuple(axes) != mesh.sort_axes(axes):
                return None
            for axis in axes:
                out[mesh.axes.index(axis)] = Shard(d)
        return tuple(out)

    def to_dtensor(self, name: str) -> Any:
        """Parameter ``name`` as a DTensor over :attr:`device_mesh` (this rank's shard, no copy)."""
        from torch.distributed.tensor import DTensor

        placements = self.placements(name)
        if placements is None or self.device_mesh is None:
            raise ValueError(f"{name}'s layout has no DTensor equivalent on this mesh" if placements is None else "no DeviceMesh: built without one")
        attr = next(a for a, names in self.param_names.items() if name in names)
        return DTensor.from_local(self.graph_module.get_parameter(attr).detach(), self.device_mesh, placements, run_check=False)

    def named_original_buffers(self) -> dict[str, torch.Tensor]:
        """The graph's buffers under the model's own names (each name of a shared one)."""
        return {name: self.graph_module.get_buffer(attr) for attr, names in self.buffer_names.items() for name in names}

    def local_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {attr: self.graph_module.get_parameter(attr) for attr in self.param_specs}

    def gather(self, attr: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full tensor of a parameter (or its gradient) from the local shards (all ranks call)."""
        spec = self.param_specs[attr]
        full = relayout(tensor.detach(), spec.layout, Layout.replicated(spec.layout.ndim), self.mesh_groups)
        if full.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            full = full.clone()  # a replicated parameter: a copy, not the live tensor
        return full

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, under its original names (tied weights under each name), and the
        persistent buffers: what the original model's ``load_state_dict(strict=True)`` takes."""
        out: dict[str, torch.Tensor] = {}
        for attr, p in self.local_parameters().items():
            full = self.gather(attr, p)
            for name in self.param_names[attr]:
                out[name] = full
        for name, b in self.named_buffers():
            if name in self.persistent_buffers:
                out[name] = b.detach().clone()
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for attr, p in self.local_parameters().items():
            grad = self.zero.full_grad(attr) if self.zero is not None else p.grad
            if grad is None:
                continue
            full = self.gather(attr, grad)
            for name in self.param_names[attr]:
                out[name] = full
        return out

    def held_bytes(self, optimizer: Any) -> dict[str, int]:
        """Bytes this rank holds in parameters, gradients and optimizer states (live tensors,
        each storage counted once)."""
        seen: set[int] = set()

        def size(tensors: list[torch.Tensor]) -> int:
            total = 0
            for t in tensors:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            return total

        params: list[torch.Tensor] = list(self.local_parameters().values())
        grads = [p.grad for p in params if p.grad is not None]
        if self.zero is not None:
            grads += [s.grad for s in self.zero.shards.values() if s.grad is not None]
        states = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
        masters = find_master_weights(optimizer)
        states += masters.masters if masters is not None else []
        return {"params": size(params), "grads": size(grads), "optimizer": size(states)}

    def executed_comms(self) -> Counter[tuple[str, tuple[str, ...], int, str]]:
        return Counter(self.recorder.records)
