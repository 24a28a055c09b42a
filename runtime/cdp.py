"""Cyclic data parallelism (Fournier & Oyallon 2024; design.md section 6) over the data-parallel axis.

The compiled rank-local graph is cut into L stages (:func:`planner.stages.cut_stages`) and run stage
by stage (:class:`planner.runtime.stages.StagedRunner`): each stage's forward builds its own autograd
graph (values crossing a cut enter the next stage as detached leaves; parameters are shared), and
each stage's backward runs alone, handing the gradients of its inputs to the stages that produced
them. This module is the schedule: which worker runs which stage when, and where the gradients go.

Worker n of N (its coordinate on the data-parallel axis) runs forward stages 0..L-1 then backward
L-1..0 on its micro-batch. When stage l's backward ends, its parameter gradients (one flat buffer)
join a point-to-point chain that ends at the stage's owner o: it starts at o+1, and each worker
receives the partial sum of the workers before it from its predecessor, adds its own and sends it
on; o then holds the sum and passes it back around the ring (o -> o+1 -> ... -> o-1, mod N). That
is 2(N-1) messages per stage per step and no collective; the chain makes a worker wait for its
predecessor at each stage, which staggers the workers, and the ring messages travel while later
stages compute. A worker sends a stage's buffer twice, but once where it is the owner or the
worker before it: the owners differ from stage to stage so that the ranks send about the same
bytes (:func:`planner.stages.stage_owners`; with one owner for all stages two ranks sent half
what the others did). Tensor-parallel collectives inside
a worker are unchanged (the TP ranks of a worker share its coordinate n).

Memory (what planner.problem prices for CDP): a stage's gradients move into one flat buffer when
its backward ends and are let go; a worker past the chain's head receives the partial sum into a
second buffer that size, adds it and lets it go; the ring's copy is received into the buffer the
chain sent from, once that send has completed (gloo's point-to-point works report completion only
through wait(), so on gloo the ring moves at the update, :meth:`CDPTrainer._settle`). A step's
buffers go when their last send completes, at the update that uses them: under v1 one buffer per
stage (the previous step's) is alive through each step, beside the step's own gradients. Each
retiring send waits for its receiver to reach the same update; the receivers need nothing more
from this worker by then, so the waits form no cycle.

Update rules (theta(t) the parameters step t computes with, g(.) the gradient summed over workers):

* ``sync``:  theta(t+1) = theta(t) - lr g(theta(t))       (delta = 0: plain DP, through the chain)
* ``v1``:    theta(t+1) = theta(t) - lr g(theta(t-1))     (g(theta(-1)) = 0: step 0 does not update)
* ``v2``:    worker n computes stage l with theta_l(t) if l >= (N-1-n) L / N (fresh) and with
             theta_l(t-1) otherwise (two versions kept per stage); theta(t+1) = theta(t) - lr g(t).

"lr g" stands for the torch optimizer's step given that gradient (SGD, momentum, AdamW...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_flatten

from planner.runtime import faults
from planner.runtime.memory import SavedTensorMeter
from planner.runtime.module import ParallelModule
from planner.runtime.stages import MicroBatch, StagedRunner
from planner.stages import cut_stages, stage_owners

UpdateRule = Literal["sync", "v1", "v2"]


# --------------------------------------------------------------------------- the distributed worker


class CDPTrainer:
    """CDP training on this rank: ``loss = trainer.step(*local_inputs)`` runs one step (forward,
    backward, chain and ring messages, the update rule) and returns this worker's loss contribution
    (the global loss is their sum over the data-parallel axis).

    With the plan's ``zero_stage == 1`` (CDP with ZeRO), only a stage's owner keeps its optimizer
    state (and a master copy of its parameters), the owners chosen to even the state they hold
    (:func:`planner.stages.stage_owners`), and what travels back around the ring is the owner's
    updated parameters, not the summed gradient: the same 2(N-1) messages. Without ZeRO every
    worker updates every stage and the owners even the bytes each rank sends."""

    def __init__(
        self,
        pm: ParallelModule,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        num_stages: int | None = None,
        rule: UpdateRule | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        """``rule`` and ``num_stages`` default to the plan's (``plan.cdp``, ``plan.cdp_stages``)."""
        rule = rule or (pm.plan.cdp if pm.plan.cdp != "off" else None)  # type: ignore[assignment]
        num_stages = num_stages or pm.plan.cdp_stages or None
        if rule is None or num_stages is None:
            raise ValueError("the plan has no CDP mode: pass rule= (sync, v1, v2) and num_stages=, or plan with cdp=('v1',) / ('v2',)")
        mesh, mg = pm.mesh_groups.mesh, pm.mesh_groups
        axes = mesh.active_dp_axes
        if len(axes) != 1:
            raise ValueError(f"CDP runs over one data-parallel axis; mesh {mesh} has {len(axes)} with degree > 1")
        if pm.plan.zero_stage not in (0, 1):
            raise ValueError(f"CDP runs with ZeRO 0 or 1 (optimizer states owned by stage); the plan has ZeRO-{pm.plan.zero_stage}")
        if rule not in ("sync", "v1", "v2"):
            raise ValueError(f"unknown CDP update rule {rule!r}; use sync, v1 or v2")
        self.pm, self.rule = pm, rule
        self.zero = pm.plan.zero_stage == 1
        self.axis = axes[0]
        self.num_workers = mesh.degree(self.axis)
        self.worker = mg.coords[self.axis]
        self.runner = StagedRunner(pm, cut_stages(pm.graph, num_stages))
        self.num_stages = self.runner.num_stages
        self.params = pm.local_parameters()
        # each stage's owner, from the bytes of its buffer here (planner.stages.stage_owners: the
        # ranks' sent bytes evened; with ZeRO, the optimizer state they hold)
        sizes = [sum(self.params[a].numel() * self.params[a].element_size() for a in attrs) for attrs in self.runner.stage_params]
        self.owners = stage_owners(sizes, self.num_workers, zero=self.zero)
        if self.zero:  # master copies of the owned stages' parameters, stepped by the optimizer
            self.masters = {a: torch.nn.Parameter(self.params[a].detach().clone()) for s in self.owned() for a in self.runner.stage_params[s]}
            self.optimizer = optimizer_class(list(self.masters.values()), **optimizer_kwargs) if self.masters else None
        else:
            self.masters = {}
            self.optimizer = optimizer_class(list(self.params.values()), **optimizer_kwargs)
        self.step_index = 0
        self._buffers: dict[tuple[int, int], StageBuffer] = {}  # (step, stage) -> its flat buffer here
        self._old: dict[str, torch.Tensor] = {}
        self.messages: list[tuple[int, int, str]] = []  # (step, stage, "chain"|"ring") sent by this rank

    # ---------------------------------------------------------------- roles

    def owner(self, stage: int) -> int:
        """The worker where stage ``stage``'s chain ends (and, with ZeRO, whose optimizer updates it)."""
        return self.owners[stage]

    def owned(self) -> list[int]:
        return [s for s in range(self.num_stages) if self.runner.stage_params[s] and self.owner(s) == self.worker]

    def _position(self, stage: int) -> int:
        """This worker's place in stage ``stage``'s chain (0 first, N-1 the owner); the ring runs
        from the owner (place N-1) through places 0, 1, ..., N-2."""
        return (self.worker - self.owner(stage) - 1) % self.num_workers

    def _worker_at(self, stage: int, position: int) -> int:
        return (self.owner(stage) + 1 + position) % self.num_workers

    # ---------------------------------------------------------------- messages

    def _peer(self, worker: int) -> int:
        return self.pm.mesh_groups.peer(self.axis, worker)

    def _tag(self, step: int, stage: int, kind: int) -> int:
        return 4 * stage + 2 * (step % 2) + kind

    def _send(self, buf: torch.Tensor, worker: int, step: int, stage: int, kind: int) -> Any:
        self.pm.recorder.add("send", (self.axis,), buf.numel() * buf.element_size(), "bwd")
        self.messages.append((step, stage, "ring" if kind else "chain"))
        return faults.isend(buf, self._peer(worker), self._tag(step, stage, kind), f"CDP {'ring' if kind else 'chain'} of stage {stage}'s gradient, step {step}")

    def _flat(self, stage: int, grads: bool) -> torch.Tensor:
        parts = []
        for attr in self.runner.stage_params[stage]:
            p = self.params[attr]
            t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p.detach()
            parts.append(t.reshape(-1))
        return torch.cat(parts)

    def _unflat(self, stage: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for attr in self.runner.stage_params[stage]:
            p = self.params[attr]
            out[attr] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return out

    def _reduce_stage(self, stage: int) -> None:
        """Chain-sum stage ``stage``'s gradient toward its owner (the module's gradients of the
        stage move into one flat buffer and are let go: the buffer is the stage's only copy)."""
        big_n, t = self.num_workers, self.step_index
        if not self.runner.stage_params[stage]:
            return  # a stage without parameters sends nothing
        buf = self._flat(stage, grads=True)
        for attr in self.runner.stage_params[stage]:
            self.params[attr].grad = None
        position = self._position(stage)
        if position > 0:
            partial = torch.empty_like(buf)
            faults.recv(partial, self._peer(self._worker_at(stage, position - 1)), self._tag(t, stage, 0), f"CDP chain of stage {stage}'s gradient, step {t}")
            buf.add_(partial)  # the same sum as partial + buf (IEEE addition commutes)
            del partial
        record = StageBuffer(buf)
        if position < big_n - 1:
            record.chain = self._send(buf, self._worker_at(stage, position + 1), t, stage, 0)
            record.source = self.owner(stage) if position == 0 else self._worker_at(stage, position - 1)
        elif big_n > 1 and not self.zero:  # the owner: the sum itself goes around the ring
            record.forward = self._send(buf, self._worker_at(stage, 0), t, stage, 1)
        self._buffers[(t, stage)] = record

    def _receive_ring(self, key: tuple[int, int], record: StageBuffer) -> None:
        """Post the ring's receive into the buffer the chain sent from (its send has completed)."""
        record.chain = None
        record.ring = faults.irecv(record.buf, self._peer(record.source), self._tag(key[0], key[1], 1), f"CDP ring of stage {key[1]}'s gradient, step {key[0]}")

    def _pass_on(self, key: tuple[int, int], record: StageBuffer) -> None:
        """The ring's copy is in: send it on (the place before the owner is the last)."""
        record.ring, record.source = None, -1
        position = self._position(key[1])
        if position < self.num_workers - 2:
            record.forward = self._send(record.buf, self._worker_at(key[1], position + 1), key[0], key[1], 1)

    def _progress(self) -> None:
        """Move the ring on where messages have completed without waiting (NCCL reports completion;
        gloo's point-to-point works report it only through wait(), so on gloo the ring moves in
        :meth:`_settle`)."""
        for key, record in sorted(self._buffers.items()):
            if record.chain is not None and record.chain.is_completed():
                self._receive_ring(key, record)
            if record.ring is not None and record.ring.is_completed():
                self._pass_on(key, record)

    def _settle(self, step: int) -> dict[int, torch.Tensor]:
        """Every stage's final buffer of ``step`` (the summed gradient; ZeRO: the new parameters),
        its ring copy received and passed on."""
        out = {}
        for (t, stage), record in sorted(self._buffers.items()):
            if t != step:
                continue
            if record.chain is not None:  # done: the ring's copy (below) comes after it
                record.chain.wait()
                self._receive_ring((t, stage), record)
            if record.ring is not None:
                record.ring.wait()
                self._pass_on((t, stage), record)
            out[stage] = record.buf
        return out

    def _retire(self, step: int) -> None:
        """Let go of ``step``'s buffers once their last sends have completed (each waits for its
        receiver to reach the end of the same step at the latest: no cycle, see the module)."""
        for key in [k for k in self._buffers if k[0] == step]:
            record = self._buffers.pop(key)
            if record.forward is not None:
                record.forward.wait()

    # ---------------------------------------------------------------- updates

    def _apply(self, step: int) -> None:
        """Without ZeRO: give every parameter the summed gradient of ``step`` (views of the stage
        buffers, no copies) and step."""
        for stage, buf in self._settle(step).items():
            for attr, g in self._unflat(stage, buf).items():
                self.params[attr].grad = g
        assert self.optimizer is not None
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None
        self._retire(step)

    def _owner_update(self, step: int) -> None:
        """ZeRO: the owner steps its masters with the summed gradient of ``step`` and sends the new
        parameters around the ring (tagged with ``step``), in the buffer the sum arrived in."""
        for stage in self.owned():  # the chain ends here: the sum is final
            for attr, g in self._unflat(stage, self._buffers[(step, stage)].buf).items():
                self.masters[attr].grad = g
        if self.optimizer is not None:
            self.optimizer.step()
        for m in self.masters.values():
            m.grad = None
        for stage in self.owned():
            record = self._buffers[(step, stage)]
            torch.cat([self.masters[a].detach().reshape(-1) for a in self.runner.stage_params[stage]], out=record.buf)
            if self.num_workers > 1:
                record.forward = self._send(record.buf, self._worker_at(stage, 0), step, stage, 1)

    def _install(self, step: int) -> None:
        """ZeRO: put the parameters sent around the ring after ``step`` (and the owned ones) in place."""
        with torch.no_grad():
            for stage, flat in self._settle(step).items():
                for attr, value in self._unflat(stage, flat).items():
                    self.params[attr].copy_(value)
        self._retire(step)

    # ---------------------------------------------------------------- v2 versions

    def uses_fresh(self, stage: int) -> bool:
        """v2: worker n computes stage l with the newest parameters iff l >= (N-1-n) L / N."""
        return stage * self.num_workers >= (self.num_workers - 1 - self.worker) * self.num_stages

    def _swap_in_old(self) -> dict[str, torch.Tensor]:
        fresh = {}
        with torch.no_grad():
            for stage in range(self.num_stages):
                if self.uses_fresh(stage):
                    continue
                for attr in self.runner.stage_params[stage]:
                    if attr in self._old:
                        fresh[attr] = self.params[attr].detach().clone()
                        self.params[attr].copy_(self._old[attr])
        return fresh

    # ---------------------------------------------------------------- the step

    def step(self, *args: Any, **kwargs: Any) -> float:
        flat, _ = tree_flatten((args, kwargs))
        inputs = [a for a in flat if isinstance(a, torch.Tensor)]
        t = self.step_index
        fresh = self._swap_in_old() if self.rule == "v2" else {}
        mb = self.runner.start(*inputs)
        for stage in range(self.num_stages):
            self.runner.forward(mb, stage)
            self._progress()
        assert mb.loss is not None
        loss = float(mb.loss.detach())
        for p in self.params.values():
            p.grad = None
        for stage in reversed(range(self.num_stages)):
            self.runner.backward(mb, stage)
            self._reduce_stage(stage)
            self._progress()
        with torch.no_grad():
            for attr, value in fresh.items():
                self.params[attr].copy_(value)
        if self.rule == "v2":
            self._old = {a: p.detach().clone() for a, p in self.params.items()}
        if not self.zero:
            if self.rule != "v1":
                self._apply(t)
            elif t > 0:
                self._apply(t - 1)
        elif self.rule == "v1":  # theta(t+1) was sent after step t-1; theta(t+2) leaves now
            if t > 0:
                self._install(t - 1)
            self._owner_update(t)
        else:
            self._owner_update(t)
            self._install(t)
        self.step_index += 1
        return loss

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters (with v2's previous version) and the
        optimizer (its states and, with ZeRO, the masters of the stages it owns)."""
        def size(tensors: Any) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        states = [t for st in (self.optimizer.state.values() if self.optimizer is not None else ()) for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        return {
            "params": size(self.params.values()) + size(self._old.values()),
            "optimizer": size(states) + size(self.masters.values()),
        }

    def finish(self) -> None:
        """Complete outstanding messages (call once after the last step)."""
        for step in sorted({t for t, _ in self._buffers}):
            self._settle(step)
            self._retire(step)


@dataclass
class StageBuffer:
    """One stage's flat buffer of one step on this rank and the messages on it: the chain's sum
    sent on (``chain``), then the ring's copy received into the same buffer (``ring``, from
    ``source``; posted once the chain's send has completed, so one buffer serves both) and passed
    on (``forward``). The buffer is let go when its last send completes (CDPTrainer._retire)."""

    buf: torch.Tensor
    chain: Any = None
    ring: Any = None
    forward: Any = None
    source: int = -1  # the worker the ring's copy comes from; -1: nothing to receive


# --------------------------------------------------------------------------- memory, in one process


def simulate_schedule(runner: StagedRunner, micro_batches: list[tuple[torch.Tensor, ...]], *, delta: int, steps: int) -> list[int]:
    """Run N micro-batches through the stages in one process on CDP's clock and return, per time
    unit, the live saved-for-backward bytes after that unit's forwards (before its backwards).

    Worker n runs forward stage l at 2Lk + n*delta + l and backward stage l at
    2Lk + n*delta + 2L-1-l (design.md section 6); delta = 0 is DP, delta = 2L/N is CDP."""
    num_stages, n_workers = runner.num_stages, len(micro_batches)
    meter = SavedTensorMeter([*runner.pm.local_parameters().values(), *(t for mb in micro_batches for t in mb)])
    state: list[MicroBatch | None] = [None] * n_workers
    period = 2 * num_stages
    timeline = []
    for tau in range(period * steps + delta * (n_workers - 1)):
        phases = []
        for n in range(n_workers):
            phi = tau - n * delta
            if 0 <= phi < period * steps:
                phases.append((n, phi % period))
        for n, r in phases:
            if r < num_stages:
                if r == 0:
                    state[n] = runner.start(*micro_batches[n])
                mb = state[n]
                assert mb is not None
                with meter.hooks():
                    runner.forward(mb, r)
                meter.track_all(runner.crossing(mb, r))
        timeline.append(meter.live_bytes())
        for n, r in phases:
            if r >= num_stages:
                runner.backward(state[n], period - 1 - r)  # type: ignore[arg-type]
    return timeline


# --------------------------------------------------------------------------- CDP with model parallelism

