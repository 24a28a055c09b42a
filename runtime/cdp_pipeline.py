"""Cyclic data parallelism with model parallelism (design.md section 6): stage l of the model on
its own devices, N workers' micro-batches flowing through the L stages with CDP's uniform delay,
so L * N/L devices do what data parallelism times L-way model parallelism needs N * L for.

The schedule, the update rules and the gradient chain-and-ring are :mod:`planner.runtime.cdp`'s
(here per stage, over the D devices of a stage); the stages are
:class:`planner.runtime.stages.StagedRunner`'s. Priced analytically by
:func:`planner.schemes.cdp.pipeline_estimate` (not searched).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from planner.runtime import faults
from planner.runtime.cdp import UpdateRule
from planner.runtime.module import ParallelModule
from planner.runtime.stages import MicroBatch, StagedRunner, getattr_path
from planner.stages import cut_stages, parameter_stages


class CDPPipeline:
    """CDP with model parallelism: stage l on its own devices (design.md section 6).

    N workers (micro-batches), L stages, D = ceil(N/L) devices per stage, L*D ranks: rank l*D + j
    holds stage l and serves the workers n = j (mod D), so worker n's activations go down column j
    of the grid and its gradients come back up it. Worker n does the forward of stage l at
    2Lk + n*delta + l and its backward at 2Lk + n*delta + 2L-1-l (delta = 2L/N); where L divides N a
    device's L workers alternate forward and backward slots without ever colliding, so L*D devices
    do what DP + MP needs N*L for. Where L does not divide N (the paper's ceil(N/L) devices per
    stage), a column serves floor or ceil of N/D workers whose slots are not a whole number of time
    units apart: two of them may want the device at overlapping times, and it runs them one after
    the other in clock order (every message a stage-step waits for was sent at an earlier tick of
    the clock, so the order cannot deadlock); their activations in flight are
    :func:`planner.stages.in_flight`'s. Each stage's gradient of step k is accumulated over its
    workers and summed over its D devices by the chain-and-ring (2(D-1) messages) as soon as the
    step's last backward of that stage is done; the update rule decides which parameter version
    each worker-step uses (v1: theta(k) for step k, with theta(1) = theta(0); v2: theta(k) on the
    stages it is fresh for, theta(k-1) elsewhere), versions being separate tensors, since the
    workers of two steps share a device at the same time.

    ``pm`` is the model compiled for one device (a plan for one device, ``mesh_groups`` of that
    one device). Built by :meth:`build` from a model on the meta device, each rank materialises
    only its stage's parameters (the rest stay on meta); given a model built whole, each rank lets
    the other stages' parameters go. ``run(batches)`` trains on ``batches[k]`` (a full global batch
    per step, split in N micro-batches) and returns the losses of the steps (on the ranks of the
    last stage; others return zeros).
    """

    @classmethod
    def build(cls, plan: Any, model: torch.nn.Module, example_args: tuple[Any, ...], example_kwargs: dict[str, Any] | None = None, *,
              num_workers: int, num_stages: int, rule: UpdateRule, optimizer_class: type[torch.optim.Optimizer],
              init: Any = None, **optimizer_kwargs: Any) -> CDPPipeline:
        """Compile ``plan`` (one device's, for one micro-batch: ``example_*``) and make this rank's
        pipeline. A ``model`` on the meta device (``init``: its initialiser, runtime.materialize)
        is materialised only for this rank's stage: the parameters the stage's ops read first
        (:func:`planner.stages.parameter_stages`)."""
        from planner.runtime.compile import compile_plan
        from planner.runtime.groups import MeshGroups
        from planner.trace import trace

        mesh = plan.mesh_obj
        if mesh.size != 1:
            raise ValueError(f"CDP with model parallelism compiles a plan for one device per stage; this plan's mesh is {mesh}")
        graph = trace(model, example_args, dict(example_kwargs or {}))
        stage = dist.get_rank() // -(-num_workers // num_stages)
        owner = parameter_stages(graph, num_stages)
        names = [n for p in graph.params if owner[p.name] == stage for n in p.param_names]
        pm = compile_plan(plan, model, example_args, example_kwargs, mesh_groups=MeshGroups(mesh, 0, mesh.coords(0)), graph=graph,
                          init=init, parameters=names)
        return cls(pm, num_workers=num_workers, num_stages=num_stages, rule=rule, optimizer_class=optimizer_class, **optimizer_kwargs)

    def __init__(self, pm: ParallelModule, *, num_workers: int, num_stages: int, rule: UpdateRule,
                 optimizer_class: type[torch.optim.Optimizer], **optimizer_kwargs: Any) -> None:
        if rule not in ("v1", "v2"):
            raise ValueError(f"CDP with model parallelism runs update rule v1 or v2, not {rule!r} (sync would stall the pipeline)")
        if num_workers < 1 or num_stages < 1:
            raise ValueError(f"CDP with model parallelism needs N >= 1 workers and L >= 1 stages: N={num_workers}, L={num_stages}")
        self.pm, self.rule = pm, rule
        self.n_workers, self.n_stages = num_workers, num_stages
        self.per_stage = -(-num_workers // num_stages)  # D
        world = dist.get_world_size()
        if world != num_stages * self.per_stage:
            raise ValueError(f"CDP with model parallelism needs L*ceil(N/L) = {num_stages * self.per_stage} ranks, WORLD_SIZE is {world}")
        self.rank = dist.get_rank()
        self.stage, self.column = divmod(self.rank, self.per_stage)
        # the clock ticks in 1/scale time units so that delta = 2L/N is a whole number of ticks
        self.scale = num_workers // math.gcd(2 * num_stages, num_workers)
        self.delta = 2 * num_stages * self.scale // num_workers
        pm.keep_grads_local()  # the stage gradients travel by this schedule's messages
        self.runner = StagedRunner(pm, cut_stages(pm.graph, num_stages))
        if self.runner.num_stages != num_stages:
            raise ValueError(f"the graph cut gave {self.runner.num_stages} stages, not {num_stages}")
        shared = {a: sorted(st) for a, st in self.runner.param_users().items() if len(st) > 1}
        if shared:
            a, st = next(iter(shared.items()))
            raise ValueError(
                f"parameter {pm.param_names[a][0]} is read by stages {st} (a tied weight?); with stages on different devices each "
                f"parameter must belong to one stage: untie it, or run CDP over data parallelism (CDPTrainer)"
            )
        self.attrs = self.runner.stage_params[self.stage]
        params = pm.local_parameters()
        unmade = [pm.param_names[a][0] for a in self.attrs if params[a].is_meta]
        if unmade:
            raise ValueError(f"stage {self.stage}'s parameters {unmade[:3]} are on the meta device: compile with parameters= naming them "
                             "(CDPPipeline.build does)")
        self.masters = {a: torch.nn.Parameter(params[a].detach().clone()) for a in self.attrs}
        with torch.no_grad():  # this rank keeps only its stage's parameters
            for a, p in params.items():
                if a not in self.masters and not p.is_meta:
                    p.data = torch.empty(0, dtype=p.dtype)
        self.optimizer = optimizer_class(list(self.masters.values()), **optimizer_kwargs) if self.masters else None
        self.versions: dict[int, dict[str, torch.Tensor]] = {0: self._snapshot()}
        if rule == "v1":
            self.versions[1] = self.versions[0]  # theta(1) = theta(0): no gradient before step 0
        self.messages: list[tuple[int, str]] = []  # (step, "activation"|"gradient"|"chain"|"ring") sent
        self.steps_run = 0

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {a: m.detach().clone().requires_grad_(True) for a, m in self.masters.items()}

    def _rank(self, stage: int, column: int) -> int:
        return stage * self.per_stage + column

    def fresh(self, worker: int, stage: int) -> bool:
        return stage * self.n_workers >= (self.n_workers - 1 - worker) * self.n_stages

    def _version(self, worker: int, step: int) -> int:
        if self.rule == "v1" or self.fresh(worker, self.stage):
            return step
        return max(step - 1, 0)

    def run(self, batches: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> list[float]:
        big_l, n_w, delta, stage, sc = self.n_stages, self.n_workers, self.delta, self.stage, self.scale
        steps = len(batches)
        micro = []
        for args, kwargs in batches:
            flat, _ = tree_flatten((args, kwargs))
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            if any(t.shape[0] % n_w for t in tensors):
                raise ValueError(f"a batch of {tensors[0].shape[0]} rows does not split into N={n_w} equal micro-batches: "
                                 f"make the global batch a multiple of {n_w}")
            micro.append([tuple(t.chunk(n_w)[n] for t in tensors) for n in range(n_w)])
        meta = self._probe(micro[0][0])
        mine = [n for n in range(n_w) if n % self.per_stage == self.column]
        events: dict[int, list[tuple[str, int, int]]] = {}
        for k in range(steps):
            for n in mine:
                events.setdefault(sc * (2 * big_l * k + stage) + n * delta, []).append(("fwd", n, k))
                events.setdefault(sc * (2 * big_l * k + 2 * big_l - 1 - stage) + n * delta, []).append(("bwd", n, k))
            events.setdefault(sc * (2 * big_l * k + 2 * big_l - 1 - stage) + (n_w - 1) * delta, []).append(("sum", -1, k))
        live: dict[tuple[int, int], MicroBatch] = {}
        grads: dict[int, dict[str, torch.Tensor]] = {}
        losses = [0.0] * steps
        sends: list[Any] = []
        for tau in sorted(events):
            for kind, n, k in sorted(events[tau], key=lambda e: e[0] == "sum"):
                if kind == "fwd":
                    live[(n, k)] = self._forward(n, k, micro[k][n], meta, sends)
                    mb = live[(n, k)]
                    if mb.loss is not None:
                        losses[k] += float(mb.loss.detach())
                elif kind == "bwd":
                    self._backward(live.pop((n, k)), n, k, meta, grads.setdefault(k, {}), sends)
                else:
                    self._sum_and_update(k, grads.pop(k, {}), sends)
        for work, _ in sends:
            work.wait()
        self.steps_run += steps
        return losses

    def _probe(self, inputs: tuple[torch.Tensor, ...]) -> dict[str, tuple[torch.Size, torch.dtype, bool]]:
        """Shapes of the values crossing each cut, from one forward of the whole model on the meta
        device (every parameter and buffer as a meta tensor its shape: nothing is allocated, and
        the stages this rank does not hold need no values)."""
        gm = self.pm.graph_module
        shapes = {}
        for node in self.runner.sources:
            if node.op == "get_attr":
                target = str(node.target)
                if target in self.pm.param_specs:  # its shape from the trace: this rank may have let its values go
                    t = gm.get_parameter(target)
                    shapes[target] = torch.empty(self._shape(target), dtype=t.dtype, device="meta").requires_grad_(t.requires_grad)
                else:
                    shapes[target] = getattr_path(gm, target).to("meta")
        mb = MicroBatch(tuple(t.to("meta") for t in inputs), params=shapes)
        with torch.enable_grad():
            for s in range(self.n_stages):
                self.runner.forward(mb, s)
        return {name: (v.shape, v.dtype, v.requires_grad) for name, v in mb.values.items() if isinstance(v, torch.Tensor)}

    def _shape(self, attr: str) -> torch.Size:
        """A parameter's shape, as traced (one device's plan: its whole tensor)."""
        names = self.pm.param_names[attr]
        node = next(n for n in self.pm.graph.params if n.param_names == names)
        return torch.Size(node.out.shape)

    def _forward(self, n: int, k: int, inputs: tuple[torch.Tensor, ...], meta: Any, sends: list[Any]) -> MicroBatch:
        stage = self.stage
        mb = MicroBatch(inputs, params=self.versions[self._version(n, k)])
        for i, name in enumerate(self.runner.boundary(stage)):
            shape, dtype, grad = meta[name]
            t = torch.empty(shape, dtype=dtype)
            faults.recv(t, self._rank(stage - 1, self.column), i, f"CDP pipeline activation {name} into stage {stage}, micro-batch {k}")
            mb.values[name] = t.requires_grad_(grad)
        self.runner.forward(mb, stage)
        if stage == self.n_stages - 1:
            assert mb.loss is not None
            mb.loss = mb.loss / self.n_workers  # this worker's share of the global mean
        else:
            for i, name in enumerate(self.runner.boundary(stage + 1)):
                t = mb.values[name].detach().contiguous()
                sends.append((faults.isend(t, self._rank(stage + 1, self.column), i, f"CDP pipeline activation {name} out of stage {stage}, micro-batch {k}"), t))
                self.messages.append((k, "activation"))
        return mb

    def _backward(self, mb: MicroBatch, n: int, k: int, meta: Any, acc: dict[str, torch.Tensor], sends: list[Any]) -> None:
        stage = self.stage
        received: dict[str, torch.Tensor] = {}
        if stage < self.n_stages - 1:
            for i, name in enumerate(self.runner.boundary(stage + 1)):
                shape, dtype, _ = meta[name]
                g = torch.empty(shape, dtype=dtype)
                faults.recv(g, self._rank(stage + 1, self.column), 1000 + i, f"CDP pipeline gradient of {name} into stage {stage}, micro-batch {k}")
                received[name] = g
        mine = {name: g for name, g in received.items() if self.runner.stage_of[name] == stage}
        self.runner.backward(mb, stage, output_grads=mine)
        assert mb.params is not None
        for a, p in mb.params.items():
            if p.grad is not None:
                acc[a] = acc[a] + p.grad if a in acc else p.grad.clone()
                p.grad = None
        if stage > 0:
            for i, name in enumerate(self.runner.boundary(stage)):
                leaf = mb.leaves.get((name, stage))
                g = leaf.grad if isinstance(leaf, torch.Tensor) and leaf.grad is not None else torch.zeros(meta[name][0], dtype=meta[name][1])
                if name in received:  # passed through this stage: its later uses' gradient too
                    g = g + received[name]
                g = g.contiguous()
                sends.append((faults.isend(g, self._rank(stage - 1, self.column), 1000 + i, f"CDP pipeline gradient of {name} out of stage {stage}, micro-batch {k}"), g))
                self.messages.append((k, "gradient"))

    def _sum_and_update(self, k: int, acc: dict[str, torch.Tensor], sends: list[Any]) -> None:
        """Sum step k's gradient of this stage over its D devices (chain 0..D-1, ring back), step
        the optimizer and make the new version (v1: theta(k+2); v2: theta(k+1))."""
        if not self.attrs:  # nothing to sum; the (empty) version still moves on
            self.versions[k + 2 if self.rule == "v1" else k + 1] = {}
            return
        d, j = self.per_stage, self.column
        buf = torch.cat([(acc[a] if a in acc else torch.zeros_like(self.masters[a])).reshape(-1) for a in self.attrs])
        if j > 0:
            partial = torch.empty_like(buf)
            faults.recv(partial, self._rank(self.stage, j - 1), 2000, f"CDP pipeline chain of stage {self.stage}'s gradient, step {k}")
            buf = partial + buf
        if j < d - 1:
            sends.append((faults.isend(buf, self._rank(self.stage, j + 1), 2000, f"CDP pipeline chain of stage {self.stage}'s gradient, step {k}"), buf))
            self.messages.append((k, "chain"))
            total = torch.empty_like(buf)
            faults.recv(total, self._rank(self.stage, d - 1 if j == 0 else j - 1), 2001, f"CDP pipeline ring of stage {self.stage}'s gradient, step {k}")
            buf = total
            if j + 1 < d - 1:
                sends.append((faults.isend(buf, self._rank(self.stage, j + 1), 2001, f"CDP pipeline ring of stage {self.stage}'s gradient, step {k}"), buf))
                self.messages.append((k, "ring"))
        elif d > 1:
            sends.append((faults.isend(buf, self._rank(self.stage, 0), 2001, f"CDP pipeline ring of stage {self.stage}'s gradient, step {k}"), buf))
            self.messages.append((k, "ring"))
        offset = 0
        for a in self.attrs:
            m = self.masters[a]
            m.grad = buf[offset : offset + m.numel()].view_as(m).clone()
            offset += m.numel()
        assert self.optimizer is not None
        self.optimizer.step()
        self.versions[k + 2 if self.rule == "v1" else k + 1] = self._snapshot()
        for old in [v for v in self.versions if v < k]:
            del self.versions[old]

    def stage_state(self) -> dict[str, torch.Tensor]:
        """This rank's stage parameters as the next step would use them (v1: theta(K) after K
        steps, though theta(K+1) is already computed), under their first original names."""
        version = self.versions[self.steps_run]
        return {self.pm.param_names[a][0]: version[a].detach().clone() for a in self.attrs}

