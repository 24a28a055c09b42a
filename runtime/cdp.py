"""Cyclic data parallelism (Fournier & Oyallon 2024; design.md section 6) over the data-parallel axis.

The compiled rank-local graph is cut into L stages (:func:`planner.stages.cut_stages`) and run stage
by stage (:class:`planner.runtime.stages.StagedRunner`): each stage's forward builds its own autograd
graph (values crossing a cut enter the next stage as detached leaves; parameters are shared), and
each stage's backward runs alone, handing the gradients of its inputs to the stages that produced
them. This module is the schedule: which worker runs which stage when, and where the gradients go.

**The clock** (:mod:`planner.cdp_clock`). Worker n of N (its coordinate on the data-parallel axis)
runs its op j of step k (forward stages 0..L-1, then backward L-1..0) at 2Lk + j + n*2L/N, the
paper's uniform delay, enforced by tokens: after each op a worker sends its successor an 8-byte
token, and before each op it takes its predecessor's tokens up to the op the schedule puts before
it. Every rank simulates the same schedule, so each knows before which of its ops to receive each
message, to wait for each send, and to apply each stage's update; every wait is for something the
schedule places on another rank's earlier op, so the waits cannot deadlock.

**The messages.** When stage l's backward ends, its parameter gradients move into one flat buffer
(and are let go), cut into pieces (:func:`planner.cdp_clock.schedule_units`; one piece a stage
where that keeps the ranks' bytes even), and each piece joins a point-to-point chain that ends at
the piece's owner o: it starts at o+1, each worker adds the partial sum of the workers before it
(received into a second buffer, added and let go) and sends it on; o then holds the sum and passes
it back around the ring (o -> o+1 -> ... -> o-1, mod N), each copy received into the buffer the
chain sent from once that send has completed. That is 2(N-1) messages per piece per step and no
collective. A worker sends a piece twice, but once where it owns the piece or is the worker before
its owner: the owners differ from piece to piece, and stages are cut into as many pieces as it
takes (the same count for each), so that every rank sends within 10 % of the same bytes and, with
ZeRO, owns within 10 % of the same optimizer state (:func:`planner.stages.message_units`; with
fewer stages than workers, whole stages would leave ranks owning nothing). A chain whose worker
order wraps (o+1 > 0) reaches the workers before o+1 after they have moved on: they take the
partial sum, on the clock, at an op of their next step. Tensor-parallel collectives inside a
worker are unchanged (the TP ranks of a worker share its coordinate n).

**Updates** (theta(t) the parameters step t computes with, g(t) step t's gradient summed over the
workers; each stage has its own optimizer, stepped when the stage's update is due; a step's start,
where the previous step's activations are gone, unless the rule needs it sooner):

* ``sync``:  theta(t+1) = theta(t) - lr g(theta(t))       (no delay: plain DP, through the chain)
* ``v1``:    theta(t+1) = theta(t) - lr g(theta(t-1))     (g(theta(-1)) = 0: step 0 does not update);
             g(t) is applied at step t+2's start
* ``v2``:    worker n computes stage l with theta_l(t) if l >= (N-1-n) L / N (fresh) and with
             theta_l(t-1) otherwise; theta(t+1) = theta(t) - lr g(t). The update is applied just
             before step t+1's forward of l where the worker is fresh, and otherwise just before
             step t+2's: the worker computes step t+1 with the parameters it has, and no second
             copy is kept. v2 always runs as the star (below, with every ZeRO stage): a fresh
             worker needs the sum by its next forward, which the ring's N-1 hops from the owner
             reach in time only with every chain ending at one rank where N > L
             (planner.cdp_clock.star_messages).

"lr g" stands for the torch optimizer's step given that gradient (SGD, momentum, AdamW...). With
ZeRO-1, a piece's owner alone keeps its optimizer state and a master copy of its parameters (a flat
slice of the stage's: exact for element-wise optimizers, as ZeRO's slices elsewhere): it steps them
when the chain's sum reaches it and sends the new parameters around the ring instead of the sum
(the same messages); the other workers install them when the update is due.

**With ZeRO-2**, and under v2 with ZeRO-1 (the clock's star, ``planner.cdp_clock``): no chain and no ring. After a stage's
backward each worker sends each piece of its gradient straight to the piece's owner and lets the
stage's buffer go once those sends complete; the owner sums the N contributions as they arrive
(in the clock's order, the same every run), steps the piece's optimizer when it has them all, and
sends the new parameters straight to each other worker. Each stage's parameters are views of one
flat buffer, so a worker receives them straight into its parameters, posted once its last use of
the old ones (its backward of the stage) has ended and taken by its next forward of the stage at
the latest; the owner copies its own in then. Again 2(N-1) messages a piece a step, and each rank
sends about 2(N-1)/N of the buffer: once to the owners, N-1 times what it owns. The owner holds a
piece's sum until every worker has taken it (the plan counts these on the clock); no rank holds
the previous step's buffer, the ring's largest term. **Under v2 with ZeRO-0** the star carries
the sum back instead of new parameters: each worker receives it into a buffer of its own and
steps its own optimizer with it at its update (the owner with its own sum), so a rank keeps the
sums it has received until then.

**With ZeRO-3** (the star with ``fetch``): the gradients and the owners' updates as with ZeRO-2,
but between its ops a rank holds only the pieces it owns, in the versions some op still computes
with (the first, then each sum once the owner's optimizer has stepped: "version t", the parameters
after step t's gradient). Before each forward and each backward, a worker receives from each
other owner its piece of every stage the op reads (its own stage's; a weight tied to an earlier
stage, such as GPT's embedding read by the LM head, that stage's too) in the version the rule
gives it (the step's, less one step where it is stale: planner.cdp_clock.Clock.version), straight
into the stage's flat parameters, posted an op ahead unless that op reads the same stage; the
owner copies its own pieces in; after the op the flat parameters' storage is let go
(``untyped_storage().resize_(0)``: the autograd graph of the forward keeps referring to the same
storage, filled again before the backward). An owner sends a version from the step before the one
that uses it, so a rank's last step sends none two steps ahead; ``finish()`` takes and drops the
fetches sent for the two steps after the last, then broadcasts each piece's last version, so every
rank holds theta(K) whole again. Per piece a step: N-1 gradients and 2(N-1) fetches per op pair
that reads it (3(N-1), or 5(N-1) for a tied embedding).

Memory (what planner.schemes.cdp prices): a stage's buffer lives from its backward until its update
is applied and its sends have completed: under v1 one buffer per stage of the previous step is
alive through each step beside the step's own gradients; under v2 a fresh stage's until the next
step's forward of it, a stale stage's as v1's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils._pytree import tree_flatten

from planner.cdp_clock import Clock, Message, OpActions, ring_hold, schedule_units, star_messages
from planner.runtime import faults
from planner.runtime.collectives import Convert
from planner.runtime.memory import SavedTensorMeter
from planner.runtime.module import ParallelModule
from planner.runtime.stages import MicroBatch, StagedRunner
from planner.stages import cut_stages, piece_bounds

UpdateRule = Literal["sync", "v1", "v2"]
_REPLAN = "re-plan with CDP (cdp=('v1',) or ('v2',): the planner leaves such collectives out) or train without CDP"


# --------------------------------------------------------------------------- the distributed worker


class CDPTrainer:
    """CDP training on this rank: ``loss = trainer.step(*local_inputs)`` runs one step (its 2L
    stage ops on the clock, with the messages and updates due before each) and returns this
    worker's loss contribution (the global loss is their sum over the data-parallel axis).
    ``finish()`` after the last step completes the messages in flight and the updates that make
    the parameters theta(K) after K steps. On the clock the workers are at different steps at once:
    a rank's ``step`` may wait for its predecessor to have started the next one, so nothing that
    waits for every rank (a barrier, a collective, a checkpoint) may run between steps, only after
    ``finish()``.

    With the plan's ``zero_stage == 1`` (CDP with ZeRO), only a piece's owner keeps its optimizer
    state (and a master copy of its parameters), and what travels back around the ring is the
    owner's updated parameters, not the summed gradient: the same 2(N-1) messages a piece. With
    ``zero_stage == 2`` (and under v2 with ZeRO 0 and 1) the gradients go straight to the owners and
    the new parameters (ZeRO-0: the sum) straight back (the module docstring's star), and no rank
    keeps the previous step's buffer; with
    ``zero_stage == 3`` only the owners keep the parameters, and each op fetches its pieces.

    ``trace = True`` records, per op, (op index, start, end) on ``time.monotonic()`` in ``ops`` and,
    per data message sent, (op index, time, message, bytes) in ``sent``."""

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
        if pm.plan.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"CDP runs with ZeRO 0-3; the plan has ZeRO-{pm.plan.zero_stage}")
        if rule not in ("sync", "v1", "v2"):
            raise ValueError(f"unknown CDP update rule {rule!r}; use sync, v1 or v2")
        # a CDP plan holds none (planner.edges); one made without CDP may (GPT's position-embedding
        # gradient, all-reduced in backward), and the module's conversions say where
        gathers: list[tuple[str, str, str]] = [(c.kind, c.phase, "") for c in pm.plan.comms if c.kind != "send" and axes[0] in c.axes and c.phase in ("fwd", "bwd")]
        gathers = (gathers if pm.plan.cdp != "off" else []) + _collectives_over(pm, axes[0])
        if gathers:
            kind, phase, where = gathers[0]
            raise ValueError(f"the plan issues a collective ({kind}) over the data-parallel axis {axes[0]!r} in {phase}{where}: CDP's workers run "
                             f"at different times and cannot join it; {_REPLAN}")
        self.pm, self.rule = pm, rule
        self.zero = pm.plan.zero_stage >= 1  # each piece's optimizer state on its owner
        self.axis = axes[0]
        self.num_workers = mesh.degree(self.axis)
        self.worker = mg.coords[self.axis]
        pm.keep_grads_local()  # the chains sum the gradients; a DP plan's buckets would race them
        # a collective over the workers that the check above cannot see (one a kernel issues itself)
        # raises where a rank reaches it, instead of waiting there for ranks at other ops, until finish()
        mg.barred[self.axis] = f"CDP's workers (axis {self.axis!r}) run their stage ops at different times and cannot join it; {_REPLAN}"
        self.runner = StagedRunner(pm, cut_stages(pm.graph, num_stages))
        self.num_stages = self.runner.num_stages
        # ZeRO-2 (and under v2, ZeRO-0 and 1): gradients straight to the owner, new parameters (ZeRO-0: the sum)
        # straight back (planner.cdp_clock's star); ZeRO-3: the same, and only the owner keeps a piece between ops:
        # each op fetches the others
        self.star = self.num_workers > 1 and star_messages(rule, pm.plan.zero_stage)
        self.fetch = pm.plan.zero_stage == 3 and self.num_workers > 1
        self.params = pm.local_parameters()
        stage_params = self.runner.stage_params
        sizes = [sum(self.params[a].numel() * self.params[a].element_size() for a in attrs) for attrs in stage_params]
        itemsize = [max((self.params[a].element_size() for a in attrs), default=1) for attrs in stage_params]
        # the other stages whose parameters each stage's ops read (a weight tied across stages belongs to the earliest)
        self.reads = tuple(tuple(sorted({self.runner.param_stage[str(node.target)] for node in self.runner.sources
                                         if node.op == "get_attr" and str(node.target) in self.runner.param_stage
                                         and any(self.runner.stage_of.get(u.name) == stage for u in node.users)} - {stage}))
                           for stage in range(self.runner.num_stages))
        self.units = schedule_units(sizes, self.num_workers, rule, self.zero, itemsize, star=self.star, fetch=self.fetch, reads=self.reads)
        self.owners = self.units.owners
        # each stage's flat buffer cut into its units' element ranges (planner.stages.piece_bounds)
        self.pieces = [piece_bounds(sum(self.params[a].numel() for a in attrs), parts) for attrs, parts in zip(stage_params, self.units.parts, strict=True)]
        has = [bool(a) for a in stage_params]
        self._dtype = [torch.cat([torch.empty(0, dtype=self.params[a].dtype) for a in attrs]).dtype if attrs else torch.float32 for attrs in stage_params]
        self.hold = ring_hold(self.num_workers, self.num_stages, self.owners, rule, has, self.units.parts, star=self.star)
        self.clock = Clock(self.num_workers, self.num_stages, self.owners, rule, has, keep=self.worker, hold=self.hold, parts=self.units.parts,
                           star=self.star, fetch=self.fetch, reads=self.reads, replicated=not self.zero)
        # star with ZeRO: each stage's parameters made views of one flat buffer, so an owner's delivery is received straight into them
        self._flat_params = [self._flatten(attrs) if self.star and self.zero and attrs else None for attrs in stage_params]
        self.optimizers: dict[tuple[int, int], torch.optim.Optimizer] = {}  # by (stage, piece); without ZeRO, piece 0 holds the stage's
        self.masters: dict[tuple[int, int], torch.nn.Parameter] = {}  # ZeRO: the owned pieces' master copies, flat
        for stage, attrs in enumerate(stage_params):
            if not attrs:
                continue
            if not self.zero:
                self.optimizers[(stage, 0)] = optimizer_class([self.params[a] for a in attrs], **optimizer_kwargs)
                continue
            flat = torch.cat([self.params[a].detach().reshape(-1) for a in attrs])
            for part, (lo, hi) in enumerate(self.pieces[stage]):
                if self.units.owners[self.units.unit(stage, part)] == self.worker:  # a master copy of the owned piece
                    self.masters[(stage, part)] = master = torch.nn.Parameter(flat[lo:hi].clone())
                    self.optimizers[(stage, part)] = optimizer_class([master], **optimizer_kwargs)
        self.step_index = 0
        self.op = 0  # the next op on the clock (2L a step)
        # star: (step, stage, piece) -> an owned piece's sum so far, then its new parameters (until delivered and
        # installed; fetch: a version, until every op that computes with it has had it; step -1: the first version)
        self._sums: dict[tuple[int, int, int], torch.Tensor] = {}
        if self.fetch:  # the owned pieces' first version kept apart, every stage's parameters let go until an op needs them
            for stage, flat_params in enumerate(self._flat_params):
                if flat_params is None:
                    continue
                for part, (lo, hi) in enumerate(self.pieces[stage]):
                    if self._owns(stage, part):
                        self._sums[(-1, stage, part)] = flat_params[lo:hi].clone()
                flat_params.untyped_storage().resize_(0)
        self._bufs: dict[tuple[int, int], torch.Tensor] = {}  # (step, stage) -> this rank's flat buffer
        self._summed: dict[tuple[int, int, int], int] = {}  # star: contributions in each owned sum
        self._sending: dict[Message, tuple[Any, torch.Tensor]] = {}  # sends not yet waited for
        self._receiving: dict[Message, tuple[Any, torch.Tensor]] = {}  # receives posted, not yet taken
        self._tokens_in = -1
        self._pending: OpActions | None = None  # the next op's actions, done at the end of the last step
        self._finished = False
        self.messages: list[tuple[int, int, str]] = []  # (step, stage, "chain"|"ring") sent by this rank
        self.trace = False
        self.ops: list[tuple[int, float, float]] = []
        self.sent: list[tuple[int, float, Message, int]] = []

    # ---------------------------------------------------------------- messages

    def _peer(self, worker: int) -> int:
        return self.pm.mesh_groups.peer(self.axis, worker)

    def _tag(self, message: Message) -> int:
        if message.kind == "token":
            return 4 * len(self.owners)
        if message.kind in ("fetch", "refetch"):  # unique among those in flight between two ranks: by unit, op and step (mod 4)
            phase = 2 * (message.step % 4) + (message.kind == "refetch")
            return 4 * len(self.owners) + 1 + self.units.unit(message.stage, message.part) + len(self.owners) * (message.at + self.num_stages * phase)
        return 4 * self.units.unit(message.stage, message.part) + 2 * (message.step % 2) + (message.kind in ("ring", "deliver"))

    def _what(self, message: Message) -> str:
        piece = f" (piece {message.part + 1} of {self.units.parts[message.stage]})" if self.units.parts[message.stage] > 1 else ""
        return f"CDP {message.kind} of stage {message.stage}'s gradient{piece}, step {message.step}"

    def _piece(self, message: Message) -> torch.Tensor:
        """This rank's buffer of ``message``'s piece: a view of its stage's flat buffer (star: an
        owner's delivery, the piece's new parameters)."""
        if message.kind == "deliver":
            return self._sums[(message.step, message.stage, message.part)]
        if message.kind in ("fetch", "refetch"):  # the version the receiver computes this op with
            return self._sums[(self.clock.version(message.dst, message.step, message.stage), message.stage, message.part)]
        lo, hi = self.pieces[message.stage][message.part]
        return self._bufs[(message.step, message.stage)][lo:hi]

    def _send(self, message: Message, buf: torch.Tensor, *, record: bool = True) -> None:
        nbytes = buf.numel() * buf.element_size()
        if record:
            self.pm.recorder.add("send", (self.axis,), nbytes, "bwd")
        if message.kind != "token":
            self.messages.append((message.step, message.stage, message.kind))
            if self.trace:
                self.sent.append((self.op, time.monotonic(), message, nbytes))
        what = f"CDP token of op {message.step}" if message.kind == "token" else self._what(message)
        self._sending[message] = (faults.isend(buf, self._peer(message.dst), self._tag(message), what), buf)

    def _flat(self, stage: int) -> torch.Tensor:
        """Stage ``stage``'s gradients as one buffer (the module's gradients let go)."""
        parts = []
        for attr in self.runner.stage_params[stage]:
            p = self.params[attr]
            parts.append((p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1))
            p.grad = None
        return torch.cat(parts)

    def _unflat(self, stage: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, offset = {}, 0
        for attr in self.runner.stage_params[stage]:
            p = self.params[attr]
            out[attr] = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return out

    def _runs(self, message: Message, last: int) -> bool:
        """Whether ``message`` is exchanged where ``last`` is the last step run: not if its step
        never ran, but a fetch for the two steps after the last (its owner may have sent it during
        the last step: planner.cdp_clock sends a version from the step before its use) is taken and
        dropped."""
        if message.kind in ("fetch", "refetch"):  # (and only a version made from the steps run)
            return message.step <= last + 2 and self.clock.version(message.dst, message.step, message.stage) <= last
        return message.step <= last

    def _keeps(self, step: int, last: int) -> bool:
        """Whether step ``step``'s update is applied where ``last`` is the last step run: theta(last + 1)
        takes every step's but, under v1, the last one's (it would make theta(last + 2))."""
        return step <= (last - 1 if self.rule == "v1" else last)

    def _post(self, message: Message, last: int) -> None:
        """Post the receive of ``message``: a chain's partial sum into a buffer of its own, a
        ring's copy into the buffer the chain sent from (that send has completed)."""
        if not self._runs(message, last):
            return
        if message.kind == "reduce" or (message.kind == "deliver" and not self.zero):
            # star: a gradient into a piece of its own; ZeRO-0's sum too, kept until this rank's update
            lo, hi = self.pieces[message.stage][message.part]
            into = torch.empty(hi - lo, dtype=self._dtype[message.stage])
            if message.kind == "deliver":
                self._sums[(message.step, message.stage, message.part)] = into
        elif message.kind in ("deliver", "fetch", "refetch"):  # star: parameters into the parameters
            lo, hi = self.pieces[message.stage][message.part]
            flat = self._flat_params[message.stage]
            assert flat is not None
            # (after the last step: v1's last delivery would make theta(K+1), a fetch for a step not run is taken and dropped)
            into_params = self._keeps(message.step, last) if message.kind == "deliver" else message.step <= last
            if into_params:
                if message.kind != "deliver":
                    self._hold_stage(message.stage)
                into = flat[lo:hi]
            else:
                into = torch.empty(hi - lo, dtype=self._dtype[message.stage])
        else:
            buf = self._piece(message)
            into = torch.empty_like(buf) if message.kind == "chain" else buf
        self._receiving[message] = (faults.irecv(into, self._peer(message.src), self._tag(message), self._what(message)), into)

    def _receive(self, acts: OpActions, message: Message, last: int) -> None:
        """Wait for ``message`` (a chain's partial sum is added to this rank's buffer) and pass on
        what the clock says."""
        if not self._runs(message, last):
            return
        if message.kind in ("reduce", "deliver", "fetch", "refetch"):
            work, into = self._receiving.pop(message)
            work.wait()
            key = (message.step, message.stage, message.part)
            if message.kind != "reduce":  # installed where it arrived
                return
            self._contribute(key, into)
            for delivery in acts.delivers.get(message, []):
                if self._runs(delivery, last):
                    self._send(delivery, self._piece(delivery))
            return
        buf = self._piece(message)
        onward = acts.forwards.get(message)
        work, into = self._receiving.pop(message)
        work.wait()
        if message.kind == "chain":
            buf.add_(into)  # the same sum as partial + buf (IEEE addition commutes)
            del into
            if self.zero and (onward is None or onward.kind == "ring"):  # the owner: the sum is final
                self._owner_update(message.stage, message.part, buf)
        if onward is not None:
            self._send(onward, buf)

    def _contribute(self, key: tuple[int, int, int], grad: torch.Tensor) -> None:
        """Star: add one worker's gradient of an owned piece to its sum (the first becomes it);
        with every worker's, step the piece's optimizer (the sum then holds the new parameters)."""
        total = self._sums.get(key)
        if total is None:
            self._sums[key] = grad
        else:
            total.add_(grad)  # in the clock's order of receipt, the same every run
        self._summed[key] = self._summed.get(key, 0) + 1
        if self._summed[key] == self.num_workers:
            del self._summed[key]
            if self.zero:  # (ZeRO-0: the sum is what goes back)
                self._owner_update(key[1], key[2], self._sums[key])

    def _owner_update(self, stage: int, part: int, buf: torch.Tensor) -> None:
        """ZeRO: step the owned piece's master with the summed gradient in ``buf`` (the piece's
        view of the stage's buffer), then put the new parameters in ``buf`` (what the ring carries).
        The optimizer steps a flat slice: exact for element-wise optimizers (SGD, Adam, AdamW), as
        ZeRO's slices elsewhere (runtime.zero)."""
        master = self.masters[(stage, part)]
        master.grad = buf.clone()
        self.optimizers[(stage, part)].step()
        master.grad = None
        buf.copy_(master.detach())

    def _use(self, step: int, stage: int) -> None:
        """Apply step ``step``'s update of stage ``stage`` (the sum's optimizer step; with ZeRO the
        owner's new parameters) and let its buffer go (its sends keep it until they complete)."""
        if self.star and self.zero:  # the owned pieces' new parameters from their sums (the sends keep them until they complete); the rest arrived in place
            flat = self._flat_params[stage]
            assert flat is not None
            with torch.no_grad():
                for part, (lo, hi) in enumerate(self.pieces[stage]):
                    if self._owns(stage, part):
                        flat[lo:hi].copy_(self._sums.pop((step, stage, part)))
            return
        if self.star:  # ZeRO-0: the sum's pieces, owned or received
            sums = [self._sums.pop((step, stage, part)) for part in range(len(self.pieces[stage]))]
            buf = sums[0] if len(sums) == 1 else torch.cat(sums)
        else:
            buf = self._bufs.pop((step, stage))
        if self.zero:
            with torch.no_grad():
                for attr, value in self._unflat(stage, buf).items():
                    self.params[attr].copy_(value)
            return
        for attr, g in self._unflat(stage, buf).items():
            self.params[attr].grad = g
        self.optimizers[(stage, 0)].step()
        for attr in self.runner.stage_params[stage]:
            self.params[attr].grad = None

    def _flatten(self, attrs: tuple[str, ...] | list[str]) -> torch.Tensor:
        """One flat buffer holding the stage's parameters, each parameter made a view of it."""
        dtypes = {self.params[a].dtype for a in attrs}
        if len(dtypes) > 1:
            raise ValueError(f"CDP with ZeRO-2 or 3 (and v2 with ZeRO-1) receives a stage's parameters into one flat buffer: its parameters {list(attrs)} mix dtypes "
                             f"{sorted(map(str, dtypes))}; cast the model to one dtype (mixed precision: keep float32 masters in the optimizer)")
        flat = torch.cat([self.params[a].detach().reshape(-1) for a in attrs])
        offset = 0
        for a in attrs:
            p = self.params[a]
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _owns(self, stage: int, part: int) -> bool:
        return self.units.owners[self.units.unit(stage, part)] == self.worker

    def _before(self, last: int) -> OpActions:
        """What the clock puts before this rank's next op: tokens, receives, send waits, updates.
        ``last``: the last step that runs (after it, messages of later steps do not exist, and only
        the updates that make theta(last + 1) are applied)."""
        acts = self.clock.actions(self.worker, self.op)
        pred = (self.worker - 1) % self.num_workers
        for kind, item, _ in acts.log:
            if kind == "tokens":
                assert isinstance(item, int)
                token = torch.empty(1, dtype=torch.int64)
                for psi in range(self._tokens_in + 1, item + 1):
                    faults.recv(token, self._peer(pred), self._tag(Message(psi, -1, "token", 0, pred, self.worker)), f"CDP token of op {psi}")
                    assert int(token) == psi, (int(token), psi)
                self._tokens_in = max(self._tokens_in, item)
            elif kind == "wait":
                assert isinstance(item, Message)
                sending = self._sending.pop(item, None)
                if sending is not None:
                    sending[0].wait()
            elif kind == "post":
                assert isinstance(item, Message)
                self._post(item, last)
            elif kind == "send":  # fetch: a version of an owned piece
                assert isinstance(item, Message)
                if self._runs(item, last):
                    self._send(item, self._piece(item))
            else:
                assert isinstance(item, Message)
                self._receive(acts, item, last)
        for step, stage in acts.uses:
            if self._keeps(step, last):
                self._use(step, stage)
        return acts

    def _after(self, acts: OpActions, last: int, record: bool = True) -> None:
        for head in acts.heads:
            if self._runs(head, last):
                self._send(head, self._piece(head))
        step, j = divmod(self.op, 2 * self.num_stages)
        if self.star and j >= self.num_stages:  # the stage's reduces have left: their sends keep the buffer until they complete
            self._bufs.pop((step, 2 * self.num_stages - 1 - j), None)
        if self.num_workers > 1:
            token = Message(self.op, -1, "token", 0, self.worker, (self.worker + 1) % self.num_workers)
            self._send(token, torch.tensor([self.op], dtype=torch.int64), record=record)
        self.op += 1

    def _op(self, run: Callable[[], None], last: int) -> None:
        acts = self._pending if self._pending is not None else self._before(last)
        self._pending = None
        reads = self.clock.op_reads(self.op) if self.fetch else []
        for stage in reads:
            self._own_version(stage)
        began = time.monotonic()
        run()
        if self.trace:
            self.ops.append((self.op, began, time.monotonic()))
        for stage in reads:  # let the parameters go until the next op that reads them fetches them
            self._flat_params[stage].untyped_storage().resize_(0)  # type: ignore[union-attr]
        self._after(acts, last)

    def _hold_stage(self, stage: int) -> None:
        """Fetch: give the stage's flat parameters their memory back (the same storage, which the
        autograd graph of its forward still refers to)."""
        flat = self._flat_params[stage]
        assert flat is not None
        storage = flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(flat.numel() * flat.element_size())

    def _own_version(self, stage: int) -> None:
        """Fetch: copy the owned pieces of ``stage`` into its parameters, in the version this op
        computes with (the other pieces were fetched before it); after its last op, the owner lets
        a version go (its sends keep it until they complete)."""
        step = self.op // (2 * self.num_stages)
        version = self.clock.version(self.worker, step, stage)
        last_use = self.op == self.clock.last_read(step, stage) and self.clock.version(self.worker, step + 1, stage) != version
        self._hold_stage(stage)
        flat = self._flat_params[stage]
        assert flat is not None
        with torch.no_grad():
            for part, (lo, hi) in enumerate(self.pieces[stage]):
                if self._owns(stage, part):
                    key = (version, stage, part)
                    flat[lo:hi].copy_(self._sums.pop(key) if last_use else self._sums[key])

    # ---------------------------------------------------------------- the step

    def step(self, *args: Any, **kwargs: Any) -> float:
        if self._finished:
            raise RuntimeError("CDPTrainer.step after finish(): make a new trainer to train on")
        flat, _ = tree_flatten((args, kwargs))
        inputs = [a for a in flat if isinstance(a, torch.Tensor)]
        t, big_l, never = self.step_index, self.num_stages, 1 << 62
        mb = self.runner.start(*inputs)
        for stage in range(big_l):
            self._op(lambda stage=stage: self.runner.forward(mb, stage), never)  # type: ignore[misc]
        assert mb.loss is not None
        loss = float(mb.loss.detach())
        for p in self.params.values():
            p.grad = None

        def backward(stage: int) -> None:
            self.runner.backward(mb, stage)
            if self.runner.stage_params[stage]:
                self._bufs[(t, stage)] = flat = self._flat(stage)
                if self.star:  # this rank's share of the pieces it owns joins their sums; the rest leave after the op
                    for part, (lo, hi) in enumerate(self.pieces[stage]):
                        if self._owns(stage, part):
                            self._contribute((t, stage, part), flat[lo:hi] if (t, stage, part) in self._sums else flat[lo:hi].clone())
                if self.zero and self.num_workers == 1:  # no chain: the sum is final here
                    for part, (lo, hi) in enumerate(self.pieces[stage]):
                        self._owner_update(stage, part, self._bufs[(t, stage)][lo:hi])

        for stage in reversed(range(big_l)):
            self._op(lambda stage=stage: backward(stage), never)  # type: ignore[misc]
        # what the clock puts before the next step's first op (the updates due at a step's start
        # among it) is done now, so that between steps this rank holds what a step leaves behind
        self._pending = self._before(never)
        self.step_index += 1
        return loss

    def finish(self) -> None:
        """After the last step: run the clock's ops up to where every message of the steps run has
        been received and waited for, without compute (their receives, sends and updates only), then
        take the tokens left and wait for the last sends. The parameters are then theta(K), K the
        steps run (v1: the update of step K-1 is not applied; it would make theta(K+1))."""
        if self._finished:
            return
        self._finished = True
        self.pm.mesh_groups.barred.pop(self.axis, None)
        last = self.step_index - 1
        if last < 0:
            return
        end = self.clock.drained_by(last)
        if self.fetch:  # the fetches sent for the two steps after the last are taken (and dropped) at their ops
            end = max(end, 2 * self.num_stages * (last + 3))
        while self.op < end:
            acts = self._pending if self._pending is not None else self._before(last)
            self._pending = None
            self._after(acts, last, record=False)
        if self.num_workers > 1:
            # the successor's last ops wait for tokens of ops past ``end``: send them, then take ours
            succ = (self.worker + 1) % self.num_workers
            for psi in range(end, end + self.clock.lead - 1):
                self._send(Message(psi, -1, "token", 0, self.worker, succ), torch.tensor([psi], dtype=torch.int64), record=False)
            pred = (self.worker - 1) % self.num_workers
            token = torch.empty(1, dtype=torch.int64)
            for psi in range(self._tokens_in + 1, max(end, end + self.clock.lead - 1)):
                faults.recv(token, self._peer(pred), self._tag(Message(psi, -1, "token", 0, pred, self.worker)), f"CDP token of op {psi}")
            self._tokens_in = max(end, end + self.clock.lead - 1) - 1
        for work, _ in self._sending.values():
            work.wait()
        self._sending.clear()
        self._bufs.clear()
        if self.fetch:
            self._gather_final(last)
        self._sums.clear()

    def _gather_final(self, last: int) -> None:
        """Fetch, after the last step: every rank's parameters made theta(K) again, each piece from
        its owner's last version (a broadcast over the workers, which finish() allows)."""
        import torch.distributed as dist

        keep = last - 1 if self.rule == "v1" else last  # the last step whose update theta(last + 1) takes (_keeps)
        group = self.pm.mesh_groups.group((self.axis,))
        for stage, flat in enumerate(self._flat_params):
            if flat is None:
                continue
            self._hold_stage(stage)
            for part, (lo, hi) in enumerate(self.pieces[stage]):
                owner = self.units.owners[self.units.unit(stage, part)]
                if owner == self.worker:
                    flat[lo:hi].copy_(self._sums[(max(keep, -1), stage, part)])
                dist.broadcast(flat[lo:hi], src=self._peer(owner), group=group)

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: parameters and the optimizers (their states and,
        with ZeRO, the masters of the stages it owns)."""
        def size(tensors: Any) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        states = [t for opt in self.optimizers.values() for st in opt.state.values() for t in st.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0]
        # ZeRO-3: what the flat parameters hold now (between steps, the stages fetched for the next step's first ops; the
        # owners' versions are message buffers)
        params = sum(f.untyped_storage().nbytes() for f in self._flat_params if f is not None) if self.fetch else size(self.params.values())
        return {"params": params, "optimizer": size(states) + size(self.masters.values())}

    def message_bytes(self) -> int:
        """Bytes of the buffers CDP's messages hold on this rank now (each storage once): stage
        buffers, sums, receives and sends in flight. Between steps, what the previous steps left."""
        storages: dict[int, int] = {}
        for t in [*self._bufs.values(), *self._sums.values(),
                  *(buf for m, (_, buf) in self._sending.items() if m.kind != "token"), *(buf for m, (_, buf) in self._receiving.items() if m.kind not in ("deliver", "fetch", "refetch"))]:  # (those arrive in the parameters)
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def _collectives_over(pm: ParallelModule, axis: str) -> list[tuple[str, str, str]]:
    """(kind, phase, where) of each collective over ``axis`` in the module's layout conversions:
    the graph's own and those a kernel runs on its inputs (a ``RegatherKernel``'s gathers, run again
    in backward)."""
    origin = {str(node.target): pm.node_origin.get(node.name, node.name) for node in pm.graph_module.graph.nodes if node.op == "call_module"}
    out: list[tuple[str, str, str]] = []
    for name, conv in pm.graph_module.named_modules():
        if not isinstance(conv, Convert):
            continue
        top = name.split(".")[0]
        where = (f"converting the output of {origin[name]}: {conv.label}" if name in origin
                 else f"an input {origin.get(top, top)}'s kernel gathers: {conv.label}")
        for phase, steps in (("fwd", conv.forward_steps), ("bwd", conv.backward_steps)):
            for step in steps:
                if step.is_collective and axis in step.axes and pm.mesh_groups.size(step.axes) > 1:
                    out.append((step.kind, phase, f" ({where})"))
    return out


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

